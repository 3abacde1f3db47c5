"""A tiny qwen3 that really thinks and really calls tools: trained a little, in about fifteen seconds.

Random weights never write ``<think>`` or ``<tool_call>``, and a test that
injected them would prove nothing about reading what a model writes. So this
model is ringd's tiny qwen3 (``ringd.models.tinymodel``) with Qwen3's real chat
template, its tokenizer retrained with the examples' text (so Qwen3's tool preamble is
short), and its four markers as added tokens (``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>``, not special, as in Qwen3's tokenizer), fully
fine-tuned (Adam, a few lines below) on a few conversations rendered by that
template, until greedy decoding says what they say:

- "What is the capital of France?" -> a think block, then "Paris."
- the same with ``enable_thinking=False`` (the template closes the think block in
  the prompt) -> "Paris."
- "What is the weather in Paris?" with a ``get_weather`` tool -> a think block, then
  Qwen3's call: ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``
- and after the tool's result (with the call's thinking sent back or not) -> "It is 18 C and sunny in Paris."

mlx-lm itself recognizes it: its ``TokenizerWrapper`` finds the think markers and
the ``json_tools`` parser from the template. The build checks the result with
mlx-lm's own step-by-step greedy decoding and raises ``ThinkModelError`` if it
says anything else. Same seed, same model; built once for this file's text and the
libraries' versions, and kept (``tests/kit/buildcache.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen/Qwen3-0.6B's chat_template, as llama.cpp keeps it (models/templates/Qwen-Qwen3-0.6B.jinja).
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set content = message.content %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in message.content %}\n                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n                {%- endif %}\n"
    "                {%- if tool_call.function %}\n                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n                    {{- tool_call.arguments }}\n                {%- else %}\n                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "<think>\nThe user asks about France.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_ANSWER = "It is 18 C and sunny in Paris."
# What greedy decoding must say, after each rendered prompt (name: messages, template kwargs, tools, completion).
EXAMPLES = [
    ("plain", FRANCE, {}, None, THOUGHT + "Paris."),
    ("no thinking", FRANCE, {"enable_thinking": False}, None, "Paris."),
    ("tool", WEATHER, {}, [WEATHER_TOOL], "<think>\nThe user wants the weather.\n</think>\n\n" + CALL),
    (
        "tool result",
        [
            *WEATHER,
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C and sunny"},
        ],
        {},
        [WEATHER_TOOL],
        "<think>\nThe tool answered.\n</think>\n\n" + WEATHER_ANSWER,
    ),
    (
        # The same, with the call's thinking sent back (Anthropic's clients send thinking
        # blocks back with tool_use; Qwen3's template renders it within the turn).
        "tool result after thinking",
        [
            *WEATHER,
            {
                "role": "assistant", "content": "", "reasoning_content": "The user wants the weather.",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C and sunny"},
        ],
        {},
        [WEATHER_TOOL],
        "<think>\nThe tool answered.\n</think>\n\n" + WEATHER_ANSWER,
    ),  # fmt: skip
]
# The tokenizer is the tiny one retrained with the examples' text: Qwen3's tool
# preamble then takes ~5x fewer tokens than in bytes, which is most of the cost
# (MLX on a CPU runs a forward and backward of ~2,000 tokens here in ~2 s).
VOCAB_SIZE = 1024
# Adam on one example at a time until teacher-forced greedy decoding says every
# completion with a margin (top logit minus the runner-up, at every position)
# that float differences between a whole forward and step-by-step decoding cannot
# flip: ~40 epochs, ~15 s here (a hidden size of 64: twice it took ~40 s for no gain).
LEARNING_RATE = 1e-2
MIN_MARGIN = 2.0
MAX_EPOCHS = 400
SEED = 0


class ThinkModelError(RuntimeError):
    pass


def build(path: Path) -> None:
    """Write the trained model into the folder ``path`` (tests/kit/buildcache.py keeps it: a change to
    this file builds it anew); ThinkModelError if it does not say every completion."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from tokenizers import AddedToken

    from ringd.models.tinymodel import build_tokenizer, write_tiny_model

    write_tiny_model(path, arch="qwen3", layers=2, hidden_size=64, heads=4, kv_heads=2, vocab_size=VOCAB_SIZE, dtype="float32", seed=SEED)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    _, tokenizer = load(str(path))
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, tokenize=False, **kwargs) + completion
        for _, messages, kwargs, tools, completion in EXAMPLES
    ]
    tok = build_tokenizer(VOCAB_SIZE - len(MARKERS), extra_texts=texts * 4)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise ThinkModelError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than the model's {VOCAB_SIZE}")
    tok.save(str(path / "tokenizer.json"), pretty=True)
    for m in MARKERS:
        cfg["added_tokens_decoder"][str(tok.token_to_id(m))] = {
            "content": m, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": False,
        }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    mx.random.seed(SEED)
    model, tokenizer = load(str(path))
    eos = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    data = []  # (inputs, targets, where the completion's targets start)
    for _, messages, kwargs, tools, completion in EXAMPLES:
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs))
        seq = prompt + tokenizer.encode(completion, add_special_tokens=False) + eos
        data.append((mx.array([seq[:-1]]), mx.array(seq[1:]), len(prompt) - 1))

    def loss(m, x, y, start):
        return nn.losses.cross_entropy(m(x)[0, start:], y[start:]).mean()

    step = nn.value_and_grad(model, loss)
    opt = optim.Adam(learning_rate=LEARNING_RATE)
    model.train()
    for _ in range(MAX_EPOCHS):
        for x, y, start in data:
            _, grads = step(model, x, y, start)
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
        if _says_every_completion(model, data) >= MIN_MARGIN:
            break
    else:
        raise ThinkModelError(f"after {MAX_EPOCHS} epochs the model does not yet say every example's completion")
    model.eval()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(sorted(weights), "model.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name, messages, kwargs, tools, completion in EXAMPLES:  # as mlx-lm decodes it, step by step
        said = greedy(path, messages, tools, **kwargs)
        if said != completion:
            raise ThinkModelError(f"trained, the model answers the {name!r} example with {said!r}, not {completion!r}")


def _says_every_completion(model, data) -> float:
    """The smallest margin of the right token over the next at any completion position; -inf if one is wrong."""
    import mlx.core as mx

    worst = float("inf")
    for x, y, start in data:
        logits = model(x)[0, start:]
        if not mx.array_equal(mx.argmax(logits, axis=-1), y[start:]).item():
            return float("-inf")
        top = mx.sort(logits, axis=-1)[:, -2:]
        worst = min(worst, (top[:, 1] - top[:, 0]).min().item())
    return worst


def greedy(path: Path, messages: list[dict], tools=None, max_tokens: int = 120, **kwargs) -> str:
    """mlx-lm's own greedy answer (it stops at <|im_end|>)."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)
