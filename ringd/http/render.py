"""A request's prompt, grammar and reading plan, from its messages, tools and format.

Three ways a model meets tools:

- **native**: its chat template takes ``tools`` (mlx-lm's ``TokenizerWrapper``
  found a tool parser for it: ``has_tool_calling``). The template renders them;
  the model writes calls between its own markers (``tool_call_start`` /
  ``tool_call_end``), which mlx-lm's parser reads (``reader.py``). A forced call
  (``required``, a named function) is a grammar in the model's own format, so the
  model still writes it token by token; that grammar exists for the JSON-in-tags
  formats (``json_tools``: Qwen, Hermes), and other formats refuse forcing.
- **generic**: the template knows no tools (SmolLM2's). As llama.cpp does, the
  tools are described in a system message and the answer is constrained to
  either a JSON object ``{"tool_calls": [...]}`` or plain text (``auto``), or to
  the JSON alone (forced). Past calls and results in the history are written in
  the same JSON, so the model sees one convention.
- **none**: ``tool_choice: none``, or no tools: no tools rendered, no calls read.

Structured output (``response_format``) is a JSON-schema grammar. For a model
that thinks, every grammar lets a think block come first (``<think>`` ...
``</think>``, lazily: it ends at the first end marker), so constraining the
answer does not forbid the reasoning before it.

Pure functions of the request and the tokenizer; they run off the event loop
(templates and tokenizers take milliseconds per long prompt).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from ringd.http.request import Request, ResponseFormat, Tool
from ringd.ring.media import PromptImages

# The JSON a grammar makes: one line, the separators people write, so the
# model's usual tokens fit it.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# mlx-lm's parser for tool calls written as JSON between tags: forcing a call
# is only possible where ringd can write the format's grammar.
JSON_TOOLS_PARSER = "mlx_lm.tool_parsers.json_tools"


class RenderError(ValueError):
    """The request cannot be rendered for this model; ``field`` is the request field at fault."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class ReadPlan:
    """How ``reader.Reader`` splits what the model writes."""

    initial: str = "normal"  # "reasoning" when the prompt left a think block open
    think: tuple[str, str] | None = None  # the model's think markers, when reasoning is split
    tools: str | None = None  # "native", "generic", or None
    tool_markers: tuple[str, str] | None = None  # native: where a call starts and ends
    tool_parser: object = None  # native: mlx-lm's parse_tool_call(text, tools)
    template_tools: list[dict] = field(default_factory=list)  # what the parser is given
    forced: bool = False  # a call must come (required, or a named function)


@dataclass
class Rendered:
    prompt: list[int]
    grammar: str | None
    read: ReadPlan
    text: str | None = None  # a prompt with images: its text, which the model's processor reads with them
    images: PromptImages | None = None  # and the images as the leader keeps them (set by serving.py, off the loop)


def tool_mode(req: Request, tokenizer) -> str | None:
    if not req.tools or req.tool_choice == "none":
        return None
    return "native" if getattr(tokenizer, "has_tool_calling", False) else "generic"


def render(req: Request, tokenizer, default_template_kwargs: dict | None = None, prepare=None) -> Rendered:
    """The request's prompt ids, the grammar its answer must follow (None: free), and its ReadPlan.

    A chat with images is rendered to text (the template writes a marker for each image part)
    and ``prepare`` (the model's processor, with the request's pictures) makes its ids: each
    marker expanded to the positions its image takes."""
    if not req.chat:
        return _render_completion(req, tokenizer)
    mode = tool_mode(req, tokenizer)
    if mode is not None and req.response_format is not None:
        raise RenderError(
            f"{req.name('response_format')} and tools cannot be combined unless tool_choice is none", req.name("response_format")
        )
    if req.tool_choice == "function" and req.tool_name not in {t.name for t in req.tools}:
        raise RenderError(f"tool_choice names {req.tool_name!r}, which is not among the tools", req.name("tool_choice"))
    if req.tool_choice in ("required", "function") and not req.tools:
        raise RenderError(f"tool_choice {req.tool_choice!r} needs tools", req.name("tool_choice"))
    kwargs = {**(default_template_kwargs or {}), **req.template_kwargs}
    native = getattr(tokenizer, "has_tool_calling", False)
    messages = req.messages if native else _generic_history(req.messages)
    if mode == "generic":
        messages = _with_tool_prompt(messages, req)
    template_tools = [t.as_template_tool() for t in req.tools] if mode == "native" else []
    prefill = None
    if req.prefill:
        if mode is not None or req.response_format is not None:
            raise RenderError(
                "a final assistant message (a prefill for the answer) cannot be combined with tools or a structured output format",
                req.name("messages"),
            )
        # The answer's start: the generation prompt, then the text the client put in the
        # model's mouth, tokenized together (as the model would have written it); any
        # template works, with no continue_final_message of its own.
        prefill, messages = messages[-1].get("content") or "", messages[:-1]
    text = None
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=prefill is None and not req.images,
            **({"tools": template_tools} if template_tools else {}), **kwargs,
        )  # fmt: skip
        if req.images:
            text = prompt + (prefill or "")
        elif prefill is not None:
            prompt = tokenizer.encode(prompt + prefill, add_special_tokens=False)
    except Exception as e:  # jinja raises for conversations its template rejects
        raise RenderError(f"the model's chat template rejected these messages: {e}", req.name("messages")) from None
    prompt = list(prompt) if text is None else _with_images(text, prepare, req)

    read = ReadPlan(tools=mode, template_tools=template_tools, forced=req.tool_choice in ("required", "function"))
    thinks = getattr(tokenizer, "has_thinking", False)
    if thinks:
        read.think = (tokenizer.think_start, tokenizer.think_end)
        if _opens_thinking(tokenizer, prompt):
            read.initial = "reasoning"
    if mode == "native":
        read.tool_markers = (tokenizer.tool_call_start, tokenizer.tool_call_end or "")
        read.tool_parser = tokenizer.tool_parser

    body = None  # the grammar of the answer after any thinking, in lark
    if req.response_format is not None:
        body = "%json " + json.dumps(_schema_of(req.response_format, req))
    elif mode == "generic":
        calls = "%json " + json.dumps(_generic_calls_schema(req))
        body = calls if read.forced else f"{calls} | FREE_TEXT\nFREE_TEXT: /[^{{](.|\\n)*/"
    elif mode == "native" and read.forced:
        body = _native_calls(req, tokenizer)
    if body is None:
        return Rendered(prompt, None, read, text)
    lark = _with_thinking(body, tokenizer, read) if thinks else f"start: {body}\n"
    return Rendered(prompt, _lark(lark, req.name(_grammar_field(req))), read, text)


def _with_images(text: str, prepare, req: Request) -> list[int]:
    """The ids of a chat's ``text`` with its images, made by the model's processor (``prepare``)."""
    if prepare is None:
        raise RenderError("this model does not take images", req.images[0].where)
    try:
        return prepare(text)
    except Exception as e:  # the processor's own refusal (an image marker the template did not write, ...)
        raise RenderError(f"the model's processor could not read the prompt with its images: {type(e).__name__}: {e}", req.name("messages")) from None


def _render_completion(req: Request, tokenizer) -> Rendered:
    if req.images:
        raise RenderError("images come in a chat's messages; a completion's prompt is text", req.images[0].where)
    if isinstance(req.prompt, list):
        prompt = req.prompt
    else:
        try:
            prompt = tokenizer.encode(req.prompt)
        except (UnicodeError, ValueError) as e:
            raise RenderError(f"the tokenizer could not encode the prompt: {e}", req.name("prompt")) from None
    g = None
    if req.response_format is not None:
        g = _lark("start: %json " + json.dumps(_schema_of(req.response_format, req)) + "\n", req.name("response_format"))
    return Rendered(list(prompt), g, ReadPlan())


def _lark(text: str, where: str) -> str:
    from ringd.stage import grammar  # llguidance: loaded by the first request that needs a grammar

    try:
        return grammar.from_lark(text, where)
    except grammar.GrammarError as e:
        raise RenderError(str(e), where) from None


def _grammar_field(req: Request) -> str:
    return "response_format" if req.response_format is not None else "tools"


def _schema_of(fmt: ResponseFormat, req: Request) -> dict:
    schema = {"type": "object"} if fmt.kind == "json_object" or fmt.schema is None else fmt.schema
    if not isinstance(schema, (dict, bool)):
        raise RenderError("the JSON schema must be an object", req.name("response_format"))
    return _compact(strict(schema) if fmt.strict else schema)


def strict(schema):
    """OpenAI's strict mode: every object without its own rule takes no properties but those it names.

    (A JSON schema allows any others by default, and a small model, free to add
    one, may write on in it until max_tokens.) Schemas are depth-checked when parsed.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


# Schema keywords that describe and do not constrain: a grammar travels in the
# request's first frame (ring/sampling.py's MAX_GRAMMAR_BYTES), and an agent's tools are
# mostly prose.
_ANNOTATIONS = ("description", "title", "examples", "$comment", "deprecated", "readOnly", "writeOnly")


def _constraining(schema):
    """The schema without its annotations (in every subschema; ``properties`` named like one are kept)."""
    if isinstance(schema, list):
        return [_constraining(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _constraining(sub) for name, sub in v.items()}
        elif k not in _ANNOTATIONS and k not in ("const", "enum", "default"):
            out[k] = _constraining(v)
        elif k in ("const", "enum"):
            out[k] = v
    return out


def _compact(schema) -> dict:
    """The schema with ringd's JSON layout, unless it names its own (x-guidance), without annotations."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    schema = _constraining(schema)
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": _COMPACT}


def _call_schema(tool: Tool) -> dict:
    params = tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else {"type": "object"}
    # A call's arguments take only the properties their schema names, strict or not, unless it
    # allows others (additionalProperties): as llama.cpp's grammars (Ollama's too) read a tool's
    # schema. Free to add one, SmolLM2 writes on in invented properties until max_tokens.
    params = strict(params)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _callable(req: Request) -> list[Tool]:
    return [t for t in req.tools if req.tool_choice != "function" or t.name == req.tool_name]


def _one_call_schema(req: Request) -> dict:
    tools = _callable(req)
    return _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}


def _generic_calls_schema(req: Request) -> dict:
    calls = {"type": "array", "items": _one_call_schema(req), "minItems": 1}
    if not req.parallel_tool_calls:
        calls["maxItems"] = 1
    return _compact({"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False})


def _is_token(tokenizer, text: str) -> bool:
    """``text`` is one token llguidance matches by name, never by its spelling.

    llguidance counts every added token as special, Qwen3's ``<think>`` and
    ``<tool_call>`` (added, not special to Hugging Face) too: the text lexer
    never sees them, so a grammar names them as ``<think>``.
    """
    if not (text.startswith("<") and text.endswith(">")):
        return False
    try:
        added = tokenizer.get_added_vocab()
    except (AttributeError, TypeError):
        added = {}
    return text in added or text in set(getattr(tokenizer, "all_special_tokens", ()) or ())


def _literal(tokenizer, text: str) -> str:
    """``text`` in lark: a token by name (it has no spelling the text lexer could match), else a string."""
    return text if _is_token(tokenizer, text) else json.dumps(text)


def _native_calls(req: Request, tokenizer) -> str:
    parser = getattr(tokenizer.tool_parser, "__module__", None)
    if parser != JSON_TOOLS_PARSER:
        raise RenderError(
            f"this model writes tool calls in a format ringd cannot force ({parser or 'unknown'}); "
            'use tool_choice "auto"',
            req.name("tool_choice"),
        )
    start, end = _literal(tokenizer, tokenizer.tool_call_start), _literal(tokenizer, tokenizer.tool_call_end)
    call = f'{start} "\\n" %json {json.dumps(_compact(_one_call_schema(req)))} "\\n" {end}'
    return f'{call} ("\\n" {call})*' if req.parallel_tool_calls else call


def _with_thinking(body: str, tokenizer, read: ReadPlan) -> str:
    """A grammar whose answer ``body`` may follow a think block (must, when the prompt opened one)."""
    start, end = _literal(tokenizer, tokenizer.think_start), tokenizer.think_end
    if _is_token(tokenizer, end):
        # The end marker is a token no text can spell: the thought is any text before it.
        thought = f"thought: /(.|\\n)*/ {end}"
    else:
        # lazy: the thought ends at the first end marker, which the regex spells as text.
        thought = f"thought[lazy]: /(.|\\n)*{_regex_escape(end)}/"
    if read.initial == "reasoning":
        return f'start: thought /[ \\n]*/ answer\n{thought}\nanswer: {body}\n'
    return f'start: think? answer\nthink: {start} thought /[ \\n]*/\n{thought}\nanswer: {body}\n'


# What a lark /regex/ treats as syntax (and the slash that ends it). Not more:
# the regex engine reads an escaped < or > as a word boundary.
_REGEX_SYNTAX = set("\\.^$|?*+()[]{}/-")


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SYNTAX else c for c in text)


def _opens_thinking(tokenizer, prompt: list[int]) -> bool:
    """The prompt ends inside a think block (the template opened it): the model starts by thinking."""
    try:
        return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    except (TypeError, AttributeError):
        return False


# --- the generic format ------------------------------------------------------------


def _generic_history(messages: list[dict]) -> list[dict]:
    """Past calls and results as the generic format writes them, for a template that knows no tools."""
    if not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            content = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m["role"] == "tool":
            result = {"name": m.get("name") or "", "id": m.get("tool_call_id") or "", "content": m.get("content") or ""}
            out.append({"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    return out


# What a tool's schema says that the model need not read: a title repeats a name, and which
# properties may be added is the grammar's to hold (``_call_schema``). Left out of the prompt.
_UNREAD = ("title", "additionalProperties", "$schema")


def _readable(schema):
    """A tool's schema as the prompt lists it: without ``_UNREAD``, keys sorted. One tool reads the
    same whichever client declared it (pydantic, an agent SDK, plain JSON), so the prompts of
    requests with the same tools share their prefix, and the ring's cached prefixes serve them."""
    if isinstance(schema, list):
        return [_readable(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k in sorted(schema):
        v = schema[k]
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _readable(sub) for name, sub in sorted(v.items())}
        elif k not in _UNREAD:
            out[k] = v if k in ("const", "enum", "default", "examples") else _readable(v)
    return out


def tool_prompt(req: Request) -> str:
    """The system text that teaches a model without a tool template the generic format."""
    tools = [{"name": t.name, "description": t.description, "parameters": _readable(t.parameters)} for t in req.tools]
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    form = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    if req.tool_choice == "function" or (req.tool_choice == "required" and len(req.tools) == 1):
        # One tool required is that tool named: the same words, so the same prompt (and cached prefix).
        name = req.tool_name if req.tool_choice == "function" else req.tools[0].name
        how = f'You must call the tool "{name}" now. Reply with only this JSON object:\n{form}'
    elif req.tool_choice == "required":
        how = f"You must call one or more tools now. Reply with only this JSON object:\n{form}"
    else:
        how = f"To call tools, reply with only this JSON object and nothing else:\n{form}\nOtherwise, reply to the user in plain text."
    return (
        f"You can call these tools (each with a JSON schema of its arguments):\n{listing}\n\n{how}\n"
        'A tool\'s result comes back as {"tool_result": ...}; once you have the results you need, answer the user in plain text.'
    )


def _with_tool_prompt(messages: list[dict], req: Request) -> list[dict]:
    messages = copy.copy(messages)
    text = tool_prompt(req)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}" if messages[0]["content"] else text}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages
