"""ringd.http.openai_types: every malformed body is a 400 naming the field, and nothing else escapes.

Worked examples for what a security review found (500s and silently ignored
fields), then Hypothesis: random JSON, mutated valid bodies and random bytes go
through ``parse_json`` + ``parse_request`` for both endpoints and raise only
``ApiError``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringd.http.errors import ApiError
from ringd.http.fields import MAX_MODEL_CHARS, parse_json
from ringd.http.openai_types import UNSUPPORTED_FIELDS, CompletionRequest, parse_request
from ringd.ring.sampling import SamplingError

# intake.py's cap on a request body (MAX_BODY_BYTES), which parse_json must handle.
BODY_BYTES = 16 * 1024 * 1024

CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "Once upon a time"}


def request(body: dict | bytes, chat: bool = True) -> CompletionRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" stays an escape
    return parse_request(parse_json(raw), chat)


def refused(body: dict | bytes, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as e:
        request(body, chat)
    assert e.value.status == 400 and e.value.type == "invalid_request_error", e.value.body()
    return e.value


# --- the largest body (parse_json's own tests: test_fields.py) ----------------------------


def test_parse_json_is_safe_in_an_executor_on_the_largest_body():
    """intake.py runs parse_json off the event loop on bodies up to 16 MiB: a thread's stack and time."""
    deep = b"[" * 50_000  # deeper than the interpreter recurses, within MAX_JSON_CONTAINERS
    text = json.dumps({**CHAT, "messages": [{"role": "user", "content": "a" * (BODY_BYTES - 100)}]}).encode()
    assert len(text) <= BODY_BYTES
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(ApiError, match="too deeply"):
            pool.submit(parse_json, deep).result()
        with pytest.raises(ApiError, match="at most 100000 are read"):
            pool.submit(parse_json, b"[" * BODY_BYTES).result()
        start = time.monotonic()
        # A generous deadline that raises (a fraction of a second on a quiet machine); the time is a figure.
        body = pool.submit(parse_json, text).result(timeout=60)
        print(f"\nparsed a {len(text) / 2**20:.0f} MiB body in {time.monotonic() - start:.2f} s")
    assert parse_request(body, chat=True).to_request().prompt_chars(BODY_BYTES) >= BODY_BYTES - 100


# --- lone surrogates ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,chat,param",
    [
        ({**CHAT, "messages": [{"role": "user", "content": "hi \ud800 there"}]}, True, "messages[0].content"),
        ({**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": "\udfff"}]}, True, "messages[1].content"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "x\udc00"}]}]},
            True,
            "messages[0].content[1].text",
        ),
        ({**CHAT, "stop": "\ud83d"}, True, "stop"),
        ({**CHAT, "stop": ["fine", "\ude00"]}, True, "stop"),
        ({**CHAT, "model": "tiny\ud800"}, True, "model"),
        ({**COMPLETION, "prompt": "\ud800"}, False, "prompt"),
        ({**COMPLETION, "prompt": ["once \udbff"]}, False, "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(body, chat, param):
    e = refused(body, chat)
    assert e.param == param and "lone surrogate (U+" in e.message and "send valid Unicode" in e.message


def test_the_example_message_for_a_lone_surrogate():
    e = refused({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]})
    assert e.message == "messages[0].content contains a lone surrogate (U+D800); send valid Unicode"
    assert refused({**CHAT, "stop": ["a", "\ud800"]}).message.startswith("stop[1] contains")


def test_a_surrogate_sent_as_utf8_bytes_is_caught_too():
    # json decodes with "surrogatepass", so ED A0 80 becomes U+D800 rather than an error.
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    assert refused(raw).param == "messages[0].content"


def test_a_surrogate_pair_is_one_valid_character():
    req = request({**CHAT, "messages": [{"role": "user", "content": "\ud83d\ude00 and é"}]})
    assert req.messages[0]["content"] == "😀 and é"


# --- fields ringd does not do yet ----------------------------------------------------------

NOT_YET = {
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
}


def test_every_unsupported_field_has_an_example():
    assert set(NOT_YET) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("name", sorted(NOT_YET))
def test_an_unsupported_field_is_a_400_not_ignored(name, chat):
    e = refused({**(CHAT if chat else COMPLETION), name: NOT_YET[name]}, chat)
    assert e.param == name and e.message.startswith(f"{name} is not supported by ringd yet") and e.code == "unsupported_parameter"


@pytest.mark.parametrize(
    "extra",
    [
        {"functions": None, "audio": None},
        {"functions": [], "modalities": []},
        {"response_format": {}, "prediction": {}},
        # Values that ask for nothing ringd does not do anyway.
        {"function_call": "none", "response_format": {"type": "text"}, "modalities": ["text"]},
    ],
)
def test_unsupported_fields_that_ask_for_nothing_are_accepted(extra):
    assert request({**CHAT, **extra}).messages == CHAT["messages"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_and_choices_become_the_internal_request():
    r = request({**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False})
    core = r.to_request()
    assert [t.name for t in core.tools] == ["get_weather"] and core.tool_choice == "function" and core.tool_name == "get_weather"
    assert core.parallel_tool_calls is False and core.tools[0].parameters["properties"]["city"] == {"type": "string"}
    assert request({**CHAT, "tools": [WEATHER], "tool_choice": "required"}).tool_choice == "required"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        # A name that is a list or an object is a client's mistake, not a 500 (issue 28).
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_and_formats_are_400s_naming_the_field(extra, param):
    assert refused({**CHAT, **extra}).param == param


def test_a_schema_nested_past_the_limit_is_refused_before_any_compiler_sees_it():
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    e = refused({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}})
    assert e.param == "response_format.json_schema.schema" and "deeper" in e.message


def test_history_with_tool_calls_and_results_takes_the_form_templates_take():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    got = request({**CHAT, "messages": messages}).messages
    assert got[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}
    bad = [*messages[:1], {**messages[1], "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{not json"}}]}]
    assert refused({**CHAT, "messages": bad}).param == "messages[1].tool_calls[0].function.arguments"
    assert refused({**CHAT, "messages": [{"role": "tool", "content": "x"}]}).param == "messages[0].tool_call_id"


# --- sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 10**400),  # math.isfinite would overflow on it
        ("top_p", -(10**300)),
        ("presence_penalty", 10**200),
        ("seed", 2**64),
        ("top_logprobs", 10**30),
        ("min_p", 2),
    ],
)
def test_huge_and_out_of_range_numbers_are_400s_naming_the_field(field, value):
    assert refused({**CHAT, field: value}).param == field


@pytest.mark.parametrize("logprobs", [None, False])
def test_top_logprobs_without_logprobs_is_a_400_naming_it(logprobs):
    """As OpenAI: "logprobs must be set to true if this parameter is used" (0 too: it was asked for)."""
    body = {**CHAT, "top_logprobs": 2} | ({} if logprobs is None else {"logprobs": logprobs})
    for top in (2, 0):
        e = refused({**body, "top_logprobs": top})
        assert e.status == 400 and e.param == "top_logprobs" and "logprobs: true" in e.message
    assert request({**CHAT, "logprobs": True, "top_logprobs": 2}).params.top_logprobs == 2
    assert request({**CHAT, "top_logprobs": None}).params.logprobs is False  # null is not asking


@pytest.mark.parametrize("chat", [True, False])
def test_ignore_eos_reaches_the_internal_request_and_must_be_a_boolean(chat):
    body = CHAT if chat else COMPLETION
    assert request({**body, "ignore_eos": True}, chat).to_request().ignore_eos is True
    assert request(body, chat).to_request().ignore_eos is False
    e = refused({**body, "ignore_eos": "yes"}, chat)
    assert e.param == "ignore_eos" and "boolean" in e.message


def test_a_float_json_reads_as_infinity_is_a_400():
    raw = json.dumps(CHAT).encode()[:-1] + b', "temperature": 1e400}'
    assert refused(raw).param == "temperature"


def test_top_k_at_or_above_the_vocabulary_names_top_k():
    # parse_request cannot know the vocabulary; the API checks it with check_vocab.
    req = request({**CHAT, "top_k": 32000})
    with pytest.raises(SamplingError) as e:
        req.params.check_vocab(32000)
    assert e.value.field == "top_k" and "top_k" in str(e.value) and "32000" in str(e.value)
    request({**CHAT, "top_k": 31999}).params.check_vocab(32000)
    with pytest.raises(SamplingError) as e:
        request({**CHAT, "logit_bias": {"32000": 1}}).params.check_vocab(32000)
    assert e.value.field == "logit_bias"


def test_logit_bias_errors_name_logit_bias():
    for bias in ({"x": 1}, {"-1": 1}, {"5": 101}, {"5": "much"}, {"1" * 5000: 1}, {str(i): 1 for i in range(301)}):
        assert refused({**CHAT, "logit_bias": bias}).param == "logit_bias", bias


def test_a_long_value_is_not_quoted_back_whole():
    e = refused({**CHAT, "temperature": "x" * 100_000})
    assert e.param == "temperature" and len(e.message) < 300


def test_a_long_model_name_is_refused():
    assert refused({**CHAT, "model": "m" * (MAX_MODEL_CHARS + 1)}).param == "model"
    assert request({**CHAT, "model": "m" * MAX_MODEL_CHARS}).model == "m" * MAX_MODEL_CHARS


# --- what the tokenizer will be fed ---------------------------------------------------------


def test_prompt_chars_counts_what_the_tokenizer_gets():
    big = 1 << 30
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "😀"}]
    chat = request({**CHAT, "messages": [{"role": "system", "content": "12345"}, {"role": "user", "content": parts}, {"role": "assistant"}]})
    assert chat.to_request().prompt_chars(big) >= 5 + 4
    assert request({**COMPLETION, "prompt": "héllo"}, chat=False).to_request().prompt_chars(big) == 5
    assert request({**COMPLETION, "prompt": [1, 2, 3]}, chat=False).to_request().prompt_chars(big) == 3
    assert request({**COMPLETION, "prompt": [[7, 8]]}, chat=False).to_request().prompt_chars(big) == 2


def test_prompt_chars_counts_every_string_a_template_may_render():
    """Tools' descriptions and schemas, a call's id, a result's name: all counted (issue 28, item 2:
    15 MB of tool descriptions went to the tokenizer before a character of them was counted)."""
    big = 1 << 30
    tool = {"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object", "properties": {}}}}
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    base = request({**CHAT, "messages": messages, "tools": [tool]}).to_request().prompt_chars(big)

    def grown(body: dict) -> int:
        return request(body).to_request().prompt_chars(big) - base

    described = {**tool, "function": {**tool["function"], "description": "d" * 1000}}
    assert grown({**CHAT, "messages": messages, "tools": [described]}) == 1000
    schema = {"type": "object", "properties": {"x" * 500: {"type": "string", "description": "y" * 500}}}
    assert grown({**CHAT, "messages": messages, "tools": [{**tool, "function": {**tool["function"], "parameters": schema}}]}) >= 1000
    long_id = [{**calls[0], "id": "c" * 1000}]
    answered = [messages[0], {**messages[1], "tool_calls": long_id}, {**messages[2], "tool_call_id": "c" * 1000}]
    assert grown({**CHAT, "messages": answered, "tools": [tool]}) == 2 * (1000 - len("c1"))


@given(st.lists(st.text(), min_size=1, max_size=20), st.integers(0, 200))
def test_prompt_chars_is_at_least_the_contents_and_stops_past_its_limit(contents, limit):
    req = request({"model": "tiny", "messages": [{"role": "user", "content": c} for c in contents]}).to_request()
    whole = req.prompt_chars(1 << 30)
    assert whole >= sum(map(len, contents))
    counted = req.prompt_chars(limit)
    # Counting stops once past the limit: past it by one string (or one object's keys) at most.
    step = max(max(len(c) for c in contents), len("role") + len("content"))
    assert counted <= whole and (counted == whole or limit < counted <= limit + step)


# --- Hypothesis: nothing but ApiError -----------------------------------------------------

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "best_of", "echo", "suffix",
    "stream", "stream_options", "logprobs", "top_logprobs", "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop",
    "return_tokens_as_token_ids", "ignore_eos", "user", *UNSUPPORTED_FIELDS,
]  # fmt: skip

# Text with everything JSON can carry; a lone surrogate is put in on purpose, as
# st.text draws one only rarely.
_text = st.text(st.characters(codec=None), max_size=20)
texts = _text | st.builds(lambda a, s, b: a + s + b, _text, st.characters(categories=["Cs"]), _text)
# Values at the edges of what the parser checks: bounds, sizes, types JSON confuses.
EDGES = [
    None, True, False, 0, 1, -1, 2, 0.5, 2**31, 2**63 - 1, 2**63, -(2**63), 10**400, -(10**400), 1e308, -1e308,
    5e-324, "", "text", "none", "auto", "tiny", [], {}, [0], ["x"], "\ud800", {"type": "text"}, {"5": 1},
]  # fmt: skip
edges = st.sampled_from(EDGES)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts | edges
keys = st.sampled_from(FIELDS + ["role", "content", "type", "text", "include_usage"]) | texts
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5), max_leaves=30
)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text")}, optional={"text": texts | edges}), min_size=1, max_size=3)
# Mostly well-formed messages, so that the content checks are reached, not only the role's.
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
        optional={"content": texts | text_parts | edges | json_values},
    ),
    min_size=1,
    max_size=4,
) | json_values


def only_api_errors(raw: bytes, chat: bool) -> None:
    try:
        req = parse_request(parse_json(raw), chat)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message and isinstance(e.body()["error"]["message"], str)
        json.dumps(e.body())  # what api.py sends must serialize
        return
    # What was accepted can reach a tokenizer: valid Unicode, a countable size.
    texts = [req.model, *req.stop] + ([m["content"] for m in req.messages] if req.chat else [])
    if isinstance(req.prompt, str):
        texts.append(req.prompt)
    for s in texts:
        s.encode("utf-8")
    assert req.to_request().prompt_chars(1 << 30) >= 0
    assert req.params.to_wire() is not None


def test_every_field_with_every_edge_value_parses_or_is_a_400():
    """Each (field, value) pair, as h2 tests each (state, event) pair: too few to leave to chance."""
    for chat in (True, False):
        for name in FIELDS:
            for value in EDGES:
                only_api_errors(json.dumps({**(CHAT if chat else COMPLETION), name: value}).encode(), chat)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@given(body=st.dictionaries(keys, json_values, max_size=8) | json_values)
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_random_json_raises_only_api_errors(chat, body):
    only_api_errors(json.dumps(body).encode(), chat)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@given(
    changes=st.lists(st.tuples(st.sampled_from(FIELDS) | keys, edges | json_values | st.just(...)), max_size=4),
    msgs=messages | st.just(...),
    prompt=st.sampled_from([..., "hello", [1, 2, 3], ["hello"], [[1, 2]], ["a", "b"], [], [-1]]) | json_values,
)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_bodies_raise_only_api_errors(chat, changes, msgs, prompt):
    body = {
        **(CHAT if chat else COMPLETION),
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
        "stop": ["\n\n"], "stream": True, "stream_options": {"include_usage": True},
        "logprobs": True if chat else 2, **({"top_logprobs": 2} if chat else {}), "logit_bias": {"5": -1.5},
    }  # fmt: skip
    if msgs is not ...:
        body["messages"] = msgs
    if prompt is not ...:
        body["prompt"] = prompt
    for key, value in changes:  # ... deletes the field
        if value is ...:
            body.pop(key, None)
        else:
            body[key] = value
    only_api_errors(json.dumps(body).encode(), chat)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@given(data=st.data())
@settings(max_examples=300)
def test_byte_level_mutations_of_a_valid_body_raise_only_api_errors(chat, data):
    raw = bytearray(json.dumps({**(CHAT if chat else COMPLETION), "stop": ["\n"], "logit_bias": {"5": 1}}).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        edit = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        chunk = data.draw(st.binary(min_size=1, max_size=4) | st.sampled_from([b"[", b"{", b'"', b"\\ud800", b"9" * 5000, b"NaN"]))
        if edit == "insert":
            raw[at:at] = chunk
        elif edit == "delete":
            del raw[at : at + len(chunk)]
        else:
            raw[at : at + len(chunk)] = chunk
    only_api_errors(bytes(raw), chat)
