"""Ollama's Go chat templates that ringd knows, each with the Jinja template that renders the same prompt.

ringd renders a chat with a Jinja template (Hugging Face's convention, what
mlx-lm's tokenizer applies): a GGUF carries one as ``tokenizer.chat_template``,
and that one is used whenever it is there. An Ollama model's template layer is
a Go ``text/template`` instead; it is needed only for a GGUF without a template of
its own, and then only if it is one of these, matched by its text (byte for byte,
after Ollama's own CRLF -> LF), each translated by hand here:

- ``chatml``, ``llama3-instruct``, ``gemma-instruct``, ``mistral-instruct``,
  ``phi-3``, ``zephyr``: the files of those names in Ollama's ``template/``
  directory (what ``ollama create`` writes for a GGUF whose Jinja template it
  recognizes);
- ``prompt``: Ollama's default, ``{{ .Prompt }}``, a base model's (a chat becomes
  its user messages one after another).

Every other Go template (the Ollama library's own, with tools and thinking
sections, a Modelfile's ``TEMPLATE``) is not interpreted: ringd has no Go
template engine, and a guess would build prompts the model was not trained on.
``source.py`` refuses such a model at start, naming the template.

Each translation does what Ollama's ``template.Execute`` does before a template
sees the messages: consecutive messages of one role (tool results apart) are one,
their contents joined by a blank line (``collate``). Ollama's runner puts BOS
before the prompt where the GGUF says so (``tokenizer.ggml.add_bos_token``); a
Jinja template writes BOS itself (the tokenizer adds no special tokens to a chat),
so the translation starts with ``bos_token`` exactly then. Messages' images,
tools and thinking are not rendered: these Go templates render none of them.

Pure: text in, text out.
"""

from __future__ import annotations

# Ollama's template.Execute: consecutive messages of one role (not tool results) become one.
_COLLATE = (
    "{%- set ns = namespace(turns=[]) -%}"
    "{%- for m in messages -%}"
    "{%- set text = m.content if m.content is string else '' -%}"
    "{%- if ns.turns and ns.turns[-1].role == m.role and m.role != 'tool' -%}"
    "{%- set ns.turns = ns.turns[:-1] + [{'role': m.role, 'content': ns.turns[-1].content + '\\n\\n' + text}] -%}"
    "{%- else -%}"
    "{%- set ns.turns = ns.turns + [{'role': m.role, 'content': text}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _each(turn: str, end: str) -> str:
    """Every turn as ``turn`` (a Jinja expression of ``m``), then ``end``: the shape of most."""
    return "{%- for m in ns.turns -%}{{ " + turn + " }}{%- endfor -%}{{ " + end + " }}"


# name -> (Ollama's Go template, the Jinja body that renders the same text after _COLLATE).
KNOWN: dict[str, tuple[str, str]] = {
    "chatml": (
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        _each("'<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n'", "'<|im_start|>assistant\\n'"),
    ),
    "llama3-instruct": (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
        "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        _each("'<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>'", "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'"),
    ),
    "gemma-instruct": (
        '{{- $system := "" }}\n{{- range .Messages }}\n{{- if eq .Role "system" }}\n{{- if not $system }}{{ $system = .Content }}\n'
        '{{- else }}{{ $system = printf "%s\\n\\n%s" $system .Content }}\n{{- end }}\n{{- continue }}\n'
        '{{- else if eq .Role "user" }}<start_of_turn>user\n{{- if $system }}\n{{ $system }}\n{{- $system = "" }}\n{{- end }}\n'
        '{{- else if eq .Role "assistant" }}<start_of_turn>model\n{{- end }}\n{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n',
        # System messages wait for the next user turn, which opens with them.
        "{%- set g = namespace(system='') -%}"
        "{%- for m in ns.turns -%}"
        "{%- if m.role == 'system' -%}"
        "{%- set g.system = m.content if not g.system else g.system + '\\n\\n' + m.content -%}"
        "{%- else -%}"
        "{%- if m.role == 'user' -%}{{ '<start_of_turn>user' }}"
        "{%- if g.system -%}{{ '\\n' + g.system }}{%- set g.system = '' -%}{%- endif -%}"
        "{%- elif m.role == 'assistant' -%}{{ '<start_of_turn>model' }}{%- endif -%}"
        "{{ '\\n' + m.content + '<end_of_turn>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{{ '<start_of_turn>model\\n' }}",
    ),
    "mistral-instruct": (
        '[INST] {{ range $index, $_ := .Messages }}\n{{- if eq .Role "system" }}{{ .Content }}\n\n'
        '{{ else if eq .Role "user" }}{{ .Content }}[/INST]\n{{- else if eq .Role "assistant" }} {{ .Content }}</s>[INST] {{ end }}\n{{- end }}',
        "{{ '[INST] ' }}"
        "{%- for m in ns.turns -%}"
        "{%- if m.role == 'system' -%}{{ m.content + '\\n\\n' }}"
        "{%- elif m.role == 'user' -%}{{ m.content + '[/INST]' }}"
        "{%- elif m.role == 'assistant' -%}{{ ' ' + m.content + '</s>[INST] ' }}"
        "{%- endif -%}"
        "{%- endfor -%}",
    ),
    "phi-3": (
        "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
        _each("'<|' + m.role + '|>\\n' + m.content + '<|end|>\\n'", "'<|assistant|>\\n'"),
    ),
    "zephyr": (
        "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}</s>\n{{ end }}<|assistant|>\n",
        _each("'<|' + m.role + '|>\\n' + m.content + '</s>\\n'", "'<|assistant|>\\n'"),
    ),
    # Ollama's DefaultTemplate, a base model's: run once per turn with only .Prompt, so a chat
    # becomes its user messages (as collated) one after another, and nothing else.
    "prompt": (
        "{{ .Prompt }}",
        "{%- for m in ns.turns if m.role == 'user' -%}{{ m.content }}{%- endfor -%}",
    ),
}
_BY_TEXT = {go: name for name, (go, _) in KNOWN.items()}


def known_name(go_template: str) -> str | None:
    """Which of ``KNOWN`` ``go_template`` is (its text, CRLF read as LF as Ollama reads it), or None."""
    return _BY_TEXT.get(go_template.replace("\r\n", "\n"))


def jinja_for(go_template: str, bos: bool) -> str | None:
    """The Jinja template that renders what ``go_template`` renders, with BOS first when ``bos``
    (the GGUF's tokenizer adds it); None for a Go template not in ``KNOWN``."""
    name = known_name(go_template)
    if name is None:
        return None
    return ("{{- bos_token -}}" if bos else "") + _COLLATE + KNOWN[name][1]


def first_line(go_template: str, limit: int = 80) -> str:
    """How a message shows a template it cannot use: its first non-blank line, cut at ``limit``."""
    line = next((s.strip() for s in go_template.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"
