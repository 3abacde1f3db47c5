"""One engine under every API (``serving.py``): the same question gets the same greedy answer through each.

On the shared ring of three serving the real SmolLM2-135M-Instruct, with each
API's official client: chat completions, completions (the chat template's
prompt as token ids), Responses, Anthropic's Messages and Ollama's chat, each
plain and streamed, give one text, equal to single-process mlx-lm's greedy
answer for the same prompt, which ends its turn (each API's own tests, on the
tiny SmolLM2, end answers at max_tokens too). Each API's own tests
(test_openai_api, test_responses_api, test_anthropic_api, test_ollama_api)
cover the rest.
"""

from __future__ import annotations

import anthropic
import ollama
import pytest

MODEL_ID = "smollm2"
QUESTIONS = ["What is the capital of France?"]
# Enough for the France answer to end its turn (eight tokens); each token costs ~0.15 s here, ten times over.
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mlx_lm_answers(smollm2_reference):
    """mlx-lm's own greedy answers, in this process: the reference every API must give."""
    from mlx_lm import generate

    model, tokenizer = smollm2_reference
    out = {}
    for q in QUESTIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out[q] = (prompt, generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS))
    return out


def answers(ring, question: str, prompt: list[int]) -> dict[str, str]:
    """The answer to ``question`` through every API, plain and streamed."""
    oai = ring.client()
    ant = anthropic.Anthropic(base_url=ring.url, api_key="not-needed", max_retries=0, timeout=120)
    oll = ollama.Client(host=ring.url, timeout=120)
    messages = [{"role": "user", "content": question}]
    greedy = {"model": MODEL_ID, "temperature": 0}
    got = {}

    chat = oai.chat.completions.create(messages=messages, max_tokens=MAX_TOKENS, **greedy).choices[0]
    assert chat.finish_reason == "stop", chat  # it ended its turn, as mlx-lm did
    got["chat"] = chat.message.content
    stream = oai.chat.completions.create(messages=messages, max_tokens=MAX_TOKENS, stream=True, **greedy)
    got["chat streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    got["completions"] = oai.completions.create(prompt=prompt, max_tokens=MAX_TOKENS, **greedy).choices[0].text
    stream = oai.completions.create(prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **greedy)
    got["completions streamed"] = "".join(c.choices[0].text for c in stream if c.choices)

    got["responses"] = oai.responses.create(input=question, max_output_tokens=MAX_TOKENS, **greedy).output_text
    stream = oai.responses.create(input=question, max_output_tokens=MAX_TOKENS, stream=True, **greedy)
    got["responses streamed"] = "".join(e.delta for e in stream if e.type == "response.output_text.delta")

    kw = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, "messages": messages, "extra_body": {"temperature": 0}}
    got["anthropic"] = "".join(b.text for b in ant.messages.create(**kw).content if b.type == "text")
    with ant.messages.stream(**kw) as s:
        got["anthropic streamed"] = "".join(s.text_stream)

    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    got["ollama"] = oll.chat(model=MODEL_ID, messages=messages, options=options).message.content
    got["ollama streamed"] = "".join(c.message.content for c in oll.chat(model=MODEL_ID, messages=messages, options=options, stream=True))
    return got


@pytest.mark.parametrize("question", QUESTIONS)
def test_every_api_gives_mlx_lms_greedy_answer_plain_and_streamed(smollm2_ring, mlx_lm_answers, question):
    prompt, want = mlx_lm_answers[question]
    got = answers(smollm2_ring, question, prompt)
    assert want.strip() and {api: text for api, text in got.items() if text != want} == {}, want


# The smallest reproducer: a named tool_choice with parallel calls left allowed (every
# API's default), max_tokens 48, temperature 0. SmolLM2 repeats its call until max_tokens; the
# answer is that one call, finish tool_calls, and the engine's JSON never reaches the client.
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# The tool test_agents.py's clients declare, described the same: the prompts are one, and the
# ring's cached prefix serves all but the first of them.
WEATHER_DOC = "The current weather of a city."
WEATHER_QUESTION = "What is the weather in Paris right now?"
CALL_TOKENS = 48


def test_a_forced_call_with_parallel_calls_allowed_comes_back_once_in_every_api(smollm2_ring):
    """Chat completions, Responses and Anthropic's Messages, each plain and streamed (Ollama's API has
    no tool_choice). The prompt is one (test_agents' too): after the first answer the ring's cached
    prefix serves it, and each answer costs ~42 decoded tokens."""
    import json

    oai = smollm2_ring.client()
    ant = anthropic.Anthropic(base_url=smollm2_ring.url, api_key="not-needed", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    got: dict[str, list[tuple[str, dict]]] = {}

    kw = {
        "model": MODEL_ID, "messages": messages, "max_tokens": CALL_TOKENS, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": WEATHER_DOC, "parameters": WEATHER_SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }  # fmt: skip
    chat = oai.chat.completions.create(**kw).choices[0]
    assert chat.finish_reason == "tool_calls" and not chat.message.content, chat
    got["chat"] = [(c.function.name, json.loads(c.function.arguments)) for c in chat.message.tool_calls]
    chunks = [c for c in oai.chat.completions.create(**kw, stream=True) if c.choices]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks) and chunks[-1].choices[0].finish_reason == "tool_calls"
    # Streamed as generated: the role, then at once the call's name, then its arguments a few
    # characters a chunk; no empty content chunks while the engine's own format is read.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.tool_calls[0].function.name == "get_weather"
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) >= 4 and all(c.choices[0].delta.tool_calls or c.choices[0].finish_reason for c in chunks[1:]), chunks
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        streamed.setdefault(d.index, ["", ""])
        streamed[d.index][0] += (d.function.name or "") if d.function else ""
        streamed[d.index][1] += (d.function.arguments or "") if d.function else ""
    got["chat streamed"] = [(n, json.loads(a)) for n, a in streamed.values()]

    kw = {
        "model": MODEL_ID, "input": WEATHER_QUESTION, "max_output_tokens": CALL_TOKENS, "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "description": WEATHER_DOC, "parameters": WEATHER_SCHEMA, "strict": False}],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    plain = oai.responses.create(**kw)
    assert plain.status == "completed" and not plain.output_text, plain
    got["responses"] = [(o.name, json.loads(o.arguments)) for o in plain.output if o.type == "function_call"]
    events = list(oai.responses.create(**kw, stream=True))
    [done] = [e.response for e in events if e.type == "response.completed"]
    assert done.status == "completed" and not done.output_text, done
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) >= 3
    got["responses streamed"] = [(o.name, json.loads(o.arguments)) for o in done.output if o.type == "function_call"]

    kw = {
        "model": MODEL_ID, "messages": messages, "max_tokens": CALL_TOKENS, "extra_body": {"temperature": 0},
        "tools": [{"name": "get_weather", "description": WEATHER_DOC, "input_schema": WEATHER_SCHEMA}], "tool_choice": {"type": "tool", "name": "get_weather"},
    }  # fmt: skip
    plain = ant.messages.create(**kw)
    assert plain.stop_reason == "tool_use" and not [b for b in plain.content if b.type == "text"], plain
    got["anthropic"] = [(b.name, b.input) for b in plain.content if b.type == "tool_use"]
    with ant.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert len([e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]) >= 3
    assert final.stop_reason == "tool_use" and not [b for b in final.content if b.type == "text"], final
    got["anthropic streamed"] = [(b.name, b.input) for b in final.content if b.type == "tool_use"]

    want = got["chat"]
    assert len(want) == 1 and want[0][0] == "get_weather" and "city" in want[0][1], want  # its repeats dropped
    assert {api: calls for api, calls in got.items() if calls != want} == {}, want
