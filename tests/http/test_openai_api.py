"""Tool calls, structured output and reasoning through OpenAI's chat completions, with the official SDK.

A ring of three daemons of the tiny llama that speaks through SmolLM2's
tokenizer and chat template (``tiny_smollm2``, tests/kit/tinysmol.py): the template
knows no tools, so tools go the generic way (``render.py``): described in a
system message, the answer constrained to a call or text. Forced calls always
parse and validate; streamed calls assemble to the same JSON. Structured output
validates against its schema greedy, streamed, and sampled at temperature 0.8
over many seeds. Reasoning and native
tool calls use the tiny qwen3 trained to think and call (``think_model``): its
template takes tools and mlx-lm's own parser reads its calls.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL_ID = "tiny-smollm2"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city", "parameters": WEATHER_SCHEMA}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["French", "English", "German"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
DESCRIBE = [{"role": "user", "content": "Describe a French person as JSON with name, age and languages."}]


def create(client, **kw):
    kw.setdefault("model", MODEL_ID)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(**kw)


def streamed(client, **kw) -> tuple[str, list[dict], str | None, list]:
    """The content, the calls assembled from their deltas, the finish reason, and the chunks."""
    content, calls, finish, chunks = [], {}, None, []
    for chunk in create(client, stream=True, **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id comes once, first"
                call["id"], call["name"] = d.id, d.function.name
            else:
                assert call["id"] is not None, "arguments come after the call's id and name"
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, chunks


# --- tool calls, the generic way ------------------------------------------------------


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"], ids=["named", "required"])
def test_a_forced_call_parses_and_validates(tiny_smollm2_client, choice):
    r = create(tiny_smollm2_client, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls, c.message
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = {"get_weather": WEATHER_SCHEMA, "get_time": TIME["function"]["parameters"]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # One call (the tiny model's greedy answer: it makes one, then ends or repeats it), of the named
    # tool; "required", of either (its pick between them is no answer to the question).
    assert len(c.message.tool_calls) == 1 and (choice == "required" or c.message.tool_calls[0].function.name == "get_weather")


def test_one_call_when_parallel_calls_are_off(tiny_smollm2_client):
    r = create(tiny_smollm2_client, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


# A city of at most 24 characters: sampled, a 49,152-token vocabulary is nearly flat, and an
# unbounded string would not close within max_tokens (tests/kit/tinysmol.py).
BOUNDED_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "parameters": {**WEATHER_SCHEMA, "properties": {"city": {"type": "string", "maxLength": 24}}}}}


@pytest.mark.parametrize("seed", range(6))
def test_forced_strict_calls_validate_when_sampled(tiny_smollm2_client, seed):
    # strict: no properties beyond the schema's, where a sampled model could ramble on.
    r = create(tiny_smollm2_client, messages=ASK, tools=[strict(BOUNDED_WEATHER), strict(TIME)], tool_choice="required", temperature=0.8, seed=seed, max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message.content
    for call in r.choices[0].message.tool_calls:
        schema = {"get_weather": BOUNDED_WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_streamed_call_assembles_to_the_same_call(tiny_smollm2_client):
    # One call: greedy, this small model would repeat the same call until max_tokens.
    kw = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    whole = create(tiny_smollm2_client, **kw).choices[0].message.tool_calls
    content, calls, finish, _ = streamed(tiny_smollm2_client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(w.function.name, json.loads(w.function.arguments)) for w in whole]


def test_auto_answers_with_a_call_or_with_text(tiny_smollm2_client):
    """Auto lets the model choose (the grammar takes a call or text: test_render.py); greedy, this one
    answers both questions in words and ends its turn, never with a call's JSON (as the real SmolLM2 does too)."""
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        c = create(tiny_smollm2_client, messages=messages, tools=[WEATHER], tool_choice="auto").choices[0]
        assert c.finish_reason == "stop" and c.message.tool_calls is None, c
        assert c.message.content and not c.message.content.startswith("{")


def test_none_means_no_call(tiny_smollm2_client):
    c = create(tiny_smollm2_client, messages=ASK, tools=[WEATHER], tool_choice="none").choices[0]
    assert c.message.tool_calls is None and c.message.content


def test_a_tool_result_gets_an_answer(tiny_smollm2_client):
    call = create(tiny_smollm2_client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
    # The call's id is in the prompt (the generic format names each result's call), and a new one
    # is made at random each run: one fixed id keeps the answer the same run after run.
    call = call.model_copy(update={"id": "call_weather"})
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    # tool_choice none: the answer is text (the thinking qwen3 below answers a result under "auto").
    c = create(tiny_smollm2_client, messages=history, tools=[WEATHER], tool_choice="none").choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.content and c.message.tool_calls is None
    # The result reached the prompt: without it, the same request answers otherwise.
    assert create(tiny_smollm2_client, messages=history[:2] + [{**history[2], "content": "3 C and snowing"}], tools=[WEATHER], tool_choice="none").choices[0].message.content != c.message.content


# --- structured output -----------------------------------------------------------------


def json_schema(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_answers_validate_plain_and_streamed(tiny_smollm2_client):
    plain = create(tiny_smollm2_client, messages=DESCRIBE, response_format=json_schema(PERSON), max_tokens=120).choices[0]
    assert plain.finish_reason == "stop", plain
    jsonschema.validate(json.loads(plain.message.content), PERSON)
    content, _, finish, _ = streamed(tiny_smollm2_client, messages=DESCRIBE, response_format=json_schema(PERSON), max_tokens=120)
    assert finish == "stop" and content == plain.message.content


@pytest.mark.parametrize("seed", range(12))
def test_json_schema_answers_validate_when_sampled(tiny_smollm2_client, seed):
    c = create(tiny_smollm2_client, messages=DESCRIBE, response_format=json_schema(PERSON), max_tokens=160, temperature=0.8, seed=seed).choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_parses(tiny_smollm2_client):
    capital = [{"role": "user", "content": "Answer in JSON: what is the capital of France?"}]
    c = create(tiny_smollm2_client, messages=capital, response_format={"type": "json_object"}, max_tokens=120).choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_completions_take_a_schema_too(tiny_smollm2_client):
    r = tiny_smollm2_client.completions.create(model=MODEL_ID, prompt="A person as JSON:", max_tokens=100, temperature=0, extra_body={"response_format": json_schema(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_a_schema_that_cannot_compile_is_a_400_naming_it(tiny_smollm2_client):
    with pytest.raises(openai.BadRequestError) as e:
        create(tiny_smollm2_client, messages=DESCRIBE, response_format=json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}))
    err = e.value.body
    assert err["param"] == "response_format" and err["code"] == "invalid_grammar" and "response_format" in err["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ],
)
def test_bad_tool_and_format_requests_are_400s(tiny_smollm2_client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(tiny_smollm2_client, messages=ASK, **{k: v for k, v in extra.items() if k in ("tools", "tool_choice", "response_format")})
    assert e.value.body["param"] == param


def test_an_image_for_a_model_that_does_not_see_is_a_400_naming_the_part(tiny_smollm2_client):
    from devkit.pictures import data_url, gradient

    image = {"type": "image_url", "image_url": {"url": data_url(gradient(8, 8))}}
    with pytest.raises(openai.BadRequestError) as e:
        create(tiny_smollm2_client, messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert e.value.body["message"] == f"{MODEL_ID} does not take images: it has no vision tower"
    assert e.value.body["param"] == "messages[0].content[1].image_url"


# --- reasoning and native tool calls: the tiny qwen3 that thinks ------------------------


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
THINK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_reasoning_goes_to_reasoning_content(think_client):
    m = create(think_client, model="think", messages=FRANCE).choices[0].message
    assert m.model_extra.get("reasoning_content", "").strip() and "<think>" not in (m.content or "")
    assert m.content.strip() == "Paris."


def test_reasoning_streams_apart_from_the_answer(think_client):
    whole = create(think_client, model="think", messages=FRANCE).choices[0].message
    content, _, _, chunks = streamed(think_client, model="think", messages=FRANCE)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content


def test_enable_thinking_false_is_honoured(think_client):
    m = create(think_client, model="think", messages=FRANCE, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert not m.model_extra.get("reasoning_content") and m.content.strip() == "Paris."


def test_a_native_call_goes_through_mlx_lms_parser(think_client):
    c = create(think_client, model="think", messages=THINK_WEATHER, tools=[WEATHER]).choices[0]
    assert c.finish_reason == "tool_calls" and not (c.message.content or "").strip()
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The model wrote it: no text ringd made up reached it (its prompt carries no generic instructions).
    history = [*THINK_WEATHER, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}, {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = create(think_client, model="think", messages=history, tools=[WEATHER]).choices[0].message
    assert "18 C and sunny" in answer.content


def test_a_forced_native_call_is_written_in_the_models_own_format(think_client):
    c = create(think_client, model="think", messages=FRANCE, tools=[WEATHER], tool_choice="required").choices[0]
    assert c.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER_SCHEMA)
