"""render.render: a request's prompt, grammar and reading plan, for the real SmolLM2 and the thinking qwen3.

Grammars are checked by running them: llguidance's matcher, over the model's
own tokenizer, must accept the answers the format means and refuse the rest.
"""

from __future__ import annotations

import json

import llguidance.hf
import pytest
from llguidance import LLMatcher

from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.http.render import RenderError, render, tool_prompt
from ringd.http.request import Request, ResponseFormat, Tool
from ringd.ring.sampling import SamplingParams

WEATHER = Tool("get_weather", "The weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get_time", "The time in a zone", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]})
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(**kw) -> Request:
    kw.setdefault("messages", ASK)
    return Request(model="m", params=SamplingParams(), max_tokens=50, **kw)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_tokenizer(model_info(str(smollm2_gguf)))


@pytest.fixture(scope="module")
def qwen(think_model):
    return load_tokenizer(model_info(str(think_model)))


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """llguidance's verdict on ``text`` as the whole answer (then an end token)."""
    ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids))
    m = LLMatcher(ll, grammar)
    assert not m.is_error(), m.get_error()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def test_generic_tools_are_taught_in_the_system_message(smollm2):
    r = render(request(messages=[{"role": "system", "content": "Be brief."}, *ASK], tools=[WEATHER]), smollm2)
    prompt = smollm2.decode(r.prompt)
    assert r.read.tools == "generic" and prompt.count("<|im_start|>system") == 1
    assert "Be brief.\n\n" + tool_prompt(request(tools=[WEATHER])) in prompt and '"get_weather"' in prompt


def test_generic_history_writes_past_calls_and_results_in_the_same_json(smollm2):
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
    ]
    prompt = smollm2.decode(render(request(messages=history, tools=[WEATHER]), smollm2).prompt)
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}<|im_end|>' in prompt
    assert '<|im_start|>user\n{"tool_result": {"name": "get_weather", "id": "c1", "content": "sunny"}}' in prompt


CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
TWO = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]}'


def test_a_forced_generic_call_is_the_json_and_nothing_else(smollm2):
    g = render(request(tools=[WEATHER, TIME], tool_choice="required"), smollm2).grammar
    assert accepts(smollm2, g, CALL) and accepts(smollm2, g, TWO)
    assert not accepts(smollm2, g, "It is sunny.")
    assert not accepts(smollm2, g, '{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')  # city is required
    assert not accepts(smollm2, g, '{"tool_calls": [{"name": "launch", "arguments": {}}]}')


def test_a_named_function_and_no_parallel_calls_narrow_the_grammar(smollm2):
    g = render(request(tools=[WEATHER, TIME], tool_choice="function", tool_name="get_time"), smollm2).grammar
    assert accepts(smollm2, g, '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}')
    assert not accepts(smollm2, g, CALL)
    one = render(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), smollm2).grammar
    assert accepts(smollm2, one, CALL) and not accepts(smollm2, one, TWO)


def test_calls_and_strict_schemas_take_no_other_properties(smollm2):
    """A call's arguments, strict or not, as llama.cpp reads a tool's schema: only the properties
    it names, unless it allows more; a response_format schema only in strict mode."""
    plain = render(request(tools=[TIME], tool_choice="required"), smollm2).grammar
    tight = render(request(tools=[Tool(TIME.name, TIME.description, TIME.parameters, strict=True)], tool_choice="required"), smollm2).grammar
    extra = '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC", "note": "x"}}]}'
    assert not accepts(smollm2, plain, extra) and not accepts(smollm2, tight, extra)
    assert accepts(smollm2, plain, '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}')
    open_ = Tool(TIME.name, TIME.description, {**TIME.parameters, "additionalProperties": True})
    assert accepts(smollm2, render(request(tools=[open_], tool_choice="required"), smollm2).grammar, extra)
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    g = render(request(response_format=ResponseFormat("json_schema", schema, strict=True)), smollm2).grammar
    assert accepts(smollm2, g, '{"a": {"b": 1}}') and not accepts(smollm2, g, '{"a": {"b": 1, "c": 2}}')


def test_auto_allows_a_call_or_text(smollm2):
    g = render(request(tools=[WEATHER]), smollm2).grammar
    assert accepts(smollm2, g, CALL) and accepts(smollm2, g, "It is sunny in Paris.")
    assert not accepts(smollm2, g, '{"weather": 1}')


def test_tool_choice_none_renders_no_tools(smollm2):
    r = render(request(tools=[WEATHER], tool_choice="none"), smollm2)
    assert r.grammar is None and r.read.tools is None and "get_weather" not in smollm2.decode(r.prompt)


def test_json_schema_and_json_object(smollm2):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = render(request(response_format=ResponseFormat("json_schema", schema)), smollm2).grammar
    assert accepts(smollm2, g, '{"a": 12}') and not accepts(smollm2, g, '{"a": "12"}') and not accepts(smollm2, g, "12")
    g = render(request(response_format=ResponseFormat("json_object")), smollm2).grammar
    assert accepts(smollm2, g, '{"x": [1, 2]}') and not accepts(smollm2, g, "[1, 2]")


def test_a_prefill_is_the_generation_prompt_then_its_text(smollm2):
    turns = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "The capital is"}]
    r = render(request(messages=turns, prefill=True), smollm2)
    head = smollm2.apply_chat_template(turns[:1], add_generation_prompt=True, tokenize=False)
    assert r.prompt == smollm2.encode(head + "The capital is", add_special_tokens=False)
    assert smollm2.decode(r.prompt).endswith("<|im_start|>assistant\nThe capital is")


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"tools": [WEATHER], "response_format": ResponseFormat("json_object")}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "function", "tool_name": "other"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"prefill": True, "response_format": ResponseFormat("json_object"), "messages": [*ASK, {"role": "assistant", "content": "{"}]}, "messages"),
    ],
)
def test_requests_that_cannot_be_rendered_name_the_field(smollm2, kw, field):
    with pytest.raises(RenderError) as e:
        render(request(**kw), smollm2)
    assert e.value.field == field


# --- a template with tools and thinking (Qwen3's) ---------------------------------------


def test_native_tools_go_to_the_template_and_its_markers(qwen):
    r = render(request(tools=[WEATHER]), qwen)
    prompt = qwen.decode(r.prompt)
    assert r.read.tools == "native" and r.read.tool_markers == ("<tool_call>", "</tool_call>") and r.grammar is None
    assert "<tools>" in prompt and "You can call these tools" not in prompt  # the template's own words, not ringd's
    assert r.read.think == ("<think>", "</think>")


def test_a_forced_native_call_lets_the_model_think_first(qwen):
    g = render(request(tools=[WEATHER], tool_choice="required"), qwen).grammar
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(qwen, g, call)
    assert accepts(qwen, g, "<think>\nThe user wants the weather.\n</think>\n\n" + call)
    assert not accepts(qwen, g, "<think>\nhm\n</think>\n\nIt is sunny.")


def test_a_schema_after_thinking(qwen):
    g = render(request(response_format=ResponseFormat("json_object")), qwen).grammar
    assert accepts(qwen, g, '<think>\nJSON, then.\n</think>\n\n{"a": 1}') and accepts(qwen, g, '{"a": 1}')


def test_enable_thinking_false_closes_the_think_block_in_the_prompt(qwen):
    on = render(request(), qwen)
    off = render(request(template_kwargs={"enable_thinking": False}), qwen)
    assert qwen.decode(off.prompt).endswith("<think>\n\n</think>\n\n") and not qwen.decode(on.prompt).endswith("</think>\n\n")
    assert on.read.initial == off.read.initial == "normal"


def test_the_configs_default_template_kwargs_yield_to_the_request(qwen):
    default_off = render(request(), qwen, {"enable_thinking": False})
    request_on = render(request(template_kwargs={"enable_thinking": True}), qwen, {"enable_thinking": False})
    assert qwen.decode(default_off.prompt).endswith("</think>\n\n") and not qwen.decode(request_on.prompt).endswith("</think>\n\n")


def test_past_native_calls_render_through_the_template(qwen):
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
    ]
    prompt = qwen.decode(render(request(messages=history, tools=[WEATHER]), qwen).prompt)
    assert json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
