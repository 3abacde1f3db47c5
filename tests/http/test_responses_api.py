"""OpenAI's Responses API (``/v1/responses``), with the official SDK.

Fast tests first, without a ring: bodies become the one internal request or a
400 (Hypothesis: any JSON body), input_image parts (a real, tiny PNG) the
request's images and the image parts of their messages, and the events ringd streams validate as the
SDK's own pydantic models and accumulate, in the SDK's own stream state, into
the response ringd sends whole.

Then a ring of three of the tiny llama that speaks through SmolLM2's tokenizer
and template (``tiny_smollm2``, tests/kit/tinysmol.py): greedy answers equal chat
completions' for the same conversation (plain, with
instructions, as input items, streamed); max_output_tokens cuts an answer to
"incomplete"; function tools go the generic way (``render.py``) and their
calls validate, streamed or not, and a call's output sent back gets an answer;
text.format constrains the answer; an image to this model, which has no vision
tower, is an OpenAI 400. Reasoning uses the tiny qwen3 trained to
think (``think_model``).
"""

from __future__ import annotations

import base64
import io
import json

import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from ringd.http.errors import ApiError
from ringd.http.request import CallArguments, CallDone, CallOpened, Output, ToolCall, Usage, whole_call
from ringd.http.responses_api import OutputItems, parse, response_object
from ringd.ring.media import MAX_IMAGES

MODEL_ID = "tiny-smollm2"
FRANCE = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city", "parameters": WEATHER_SCHEMA}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TIME = {"type": "function", "name": "get_time", "description": "The local time in a time zone", "parameters": TIME_SCHEMA}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = "What is the weather in Paris right now?"
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
DESCRIBE = "Describe a French person as JSON with name, age and languages."
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


PNG_URL = png_data_url()


def image(url: str = PNG_URL) -> dict:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


# --- bodies -> the internal request (no ring) --------------------------------------------


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400, e.value.body()
    return e.value


def test_input_items_become_the_templates_messages():
    p = parse(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 18 C.", "annotations": []}]},
                {"role": "user", "content": "Thanks"},
            ],
        }
    )
    assert p.request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call it.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "assistant", "content": "It is 18 C."},
        {"role": "user", "content": "Thanks"},
    ]
    assert not p.stream


def test_input_images_are_the_requests_images_in_order_and_parts_of_their_messages():
    r = parse(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "What differs?"}, image(), {"type": "input_text", "text": "and"}, image()]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "The colour.", "annotations": []}]},
                {"role": "user", "content": [image("data:image/webp;base64,bm90IGEgd2VicA==")]},  # the decoder's to refuse, not the parser's
                {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
            ],
        }
    ).request
    assert [p.where for p in r.images] == ["input[0].content[1].image_url", "input[0].content[3].image_url", "input[2].content[0].image_url"]
    assert [p.data[p.start :] for p in r.images[:2]] == [PNG_URL.partition(",")[2]] * 2
    assert r.messages == [
        {"role": "user", "content": [{"type": "text", "text": "What differs?"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "The colour."},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "user", "content": "Thanks"},
    ]


def test_fields_map_onto_the_request_and_errors_use_responses_names():
    p = parse(
        {
            "model": "m", "input": "hi", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5, "store": True,
            "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
            "reasoning": {"effort": "minimal"}, "metadata": {"k": "v"}, "user": "u",
        }
    )  # fmt: skip
    r = p.request
    assert (r.max_tokens, r.params.temperature, r.params.top_p, r.tool_choice, r.tool_name, r.parallel_tool_calls) == (7, 0, 0.5, "function", "get_weather", False)
    assert r.tools[0].strict, "Responses' function tools are strict unless they say otherwise"
    assert r.template_kwargs == {"enable_thinking": False}
    assert (r.name("max_tokens"), r.name("messages"), r.name("response_format")) == ("max_output_tokens", "input", "text.format")
    fmt = parse({"model": "m", "input": "hi", "text": PERSON_FORMAT}).request.response_format
    assert (fmt.kind, fmt.schema, fmt.strict) == ("json_schema", PERSON, True)
    assert parse({"model": "m", "input": "hi", "reasoning": {"effort": "high"}}).request.template_kwargs["enable_thinking"] is True
    allowed = parse({"model": "m", "input": "hi", "tools": [WEATHER, TIME], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}})
    assert [t.name for t in allowed.request.tools] == ["get_time"] and allowed.request.tool_choice == "required"
    for parsed in (p, allowed, parse({"model": "m", "input": "hi", "text": PERSON_FORMAT})):
        echoed = Response.model_validate(response_object(parsed, "resp_1", 1, "m", [], "completed", Usage(1)))
        assert echoed.store is False and echoed.parallel_tool_calls is parsed.request.parallel_tool_calls


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation in input"),
        ({"conversation": "conv_1"}, "conversation", "send the whole conversation in input"),
        ({"background": True}, "background", "background"),
        ({"include": ["message.output_text.logprobs"]}, "include", "reasoning.encrypted_content"),
        ({"input": [{"type": "reasoning", "encrypted_content": "ringd-reasoning:!!"}, {"role": "user", "content": "x"}]}, "input[0].encrypted_content", "as it came"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": []}]}, "tools[1]", "'file_search'"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": ["get_weather"]}}, "tool_choice", "['get_weather']"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": {"n": 1}}]}}, "tool_choice.tools", "{'n': 1}"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]}}, "tool_choice.tools", "'nope'"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": []}, "input", "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "send the item itself"),
        ({"input": [{"role": "user", "content": [image("x")]}]}, "input[0].content[0].image_url", "takes a data URL"),
        ({"input": [{"role": "user", "content": [image("data:image/png;base64,")]}]}, "input[0].content[0].image_url", "the image is empty"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input[0].content[0].file_id", "ringd keeps no files; send the image as a data URL"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url", "image_url is required"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]}, "input[0].content[0]", "'input_file'"),
        ({"input": [{"role": "assistant", "content": [image()]}]}, "input[0].content[0]", "user messages only"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [image()]}]}, "input[0].output[0]", "user messages only"),
        ({"input": [{"role": "user", "content": [image()] * (MAX_IMAGES + 1)}]}, "input", f"{MAX_IMAGES + 1} images in one request; at most {MAX_IMAGES}"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments", "JSON object"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000}]}, "input[0].arguments", "JSON object"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "extreme"),
        ({"temperature": 3}, "temperature", "temperature"),
    ],
)
def test_what_a_stateless_ring_cannot_do_is_a_400_naming_the_field(extra, param, needle):
    e = refused({"model": "m", "input": "hi", **extra})
    assert e.param == param and needle in e.message, e.body()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens", "temperature", "top_p",
          "stream", "store", "include", "background", "parallel_tool_calls", "truncation", "metadata"]  # fmt: skip
ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "summary", "text", "format", "schema", "effort", "mode", "tools"]
ITEMS = st.dictionaries(st.sampled_from(ITEM_KEYS), JSON | st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "user", "assistant", "input_text", "function", "json_schema"]), max_size=5)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON | ITEMS | st.lists(ITEMS, max_size=4), max_size=8), st.booleans())
def test_any_json_body_is_a_request_or_a_400(body, with_model):
    if with_model:
        body["model"] = "m"
        body.setdefault("input", "hi")
    try:
        p = parse(body)
    except ApiError as e:
        assert e.status == 400 and e.body()["error"]["message"]
        return
    assert p.request.messages and all(isinstance(m["content"], str) for m in p.request.messages)


# --- events -> the SDK's own models (no ring) --------------------------------------------


def events_of(outputs: list[Output], finish: str, streamed: bool = True) -> tuple[list[dict], OutputItems]:
    items = OutputItems()
    events = [e for out in outputs for e in items.feed(out)] + items.finish(finish, streamed)
    for i, e in enumerate(events):
        e["sequence_number"] = i + 2
    return events, items


PARIS = ToolCall("call_1", "get_weather", '{"city": "a city with a long name, Paris"}')
ROME = ToolCall("call_2", "get_weather", '{"city": "Rome"}')
# Two calls as the model writes them: each named, its arguments in pieces, complete.
CALLS = [
    Output(5, 0.0, [], pieces=[CallOpened(0, PARIS.id, PARIS.name)]), Output(6, 0.0, [], pieces=[CallArguments(0, '{"city": "a city')]),
    Output(7, 0.0, [], pieces=[CallArguments(0, ' with a long name, Paris"}'), CallDone(0, PARIS), CallOpened(1, ROME.id, ROME.name)]),
    Output(8, 0.0, [], pieces=[CallArguments(1, ROME.arguments), CallDone(1, ROME)]),
]  # fmt: skip


@pytest.mark.parametrize("finish", ["tool_calls", "length", "cut"])
def test_streamed_events_are_the_sdks_and_build_the_whole_response(finish):
    p = parse({"model": "m", "input": "hi", "tools": [WEATHER]})
    outputs = [
        Output(1, 0.0, [], reasoning="Think"), Output(2, 0.0, [], reasoning="ing."), Output(3, 0.0, [], text="\n\n"),
        Output(4, 0.0, [], text="Let me see."), *CALLS,
    ]  # fmt: skip
    if finish == "cut":  # max_tokens cut a third call: its start went out
        outputs += [Output(9, 0.0, [], pieces=[CallOpened(2, "call_3", "get_weather"), CallArguments(2, '{"ci')], finish_reason="tool_calls")]
    else:
        outputs[-1].finish_reason = finish
    events, items = events_of(outputs, outputs[-1].finish_reason)
    for e in events:
        EVENTS.validate_python(e)  # strict: every field the SDK's model requires, of its type
    start = response_object(p, "resp_1", 1, "m", [], "in_progress", None)
    whole = response_object(p, "resp_1", 1, "m", items.output, items.status, Usage(5, 6, 0, 2))
    Response.model_validate(whole)
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for e in [{"type": "response.created", "response": start, "sequence_number": 0}, {"type": "response.in_progress", "response": start, "sequence_number": 1}, *events]:
        state.handle_event(EVENTS.validate_python(e))
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas[:3] == ['{"city": "a city', ' with a long name, Paris"}', '{"city": "Rome"}']  # as written, not at the end
    if finish == "tool_calls":
        assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call", "function_call"]
        state.handle_event(EVENTS.validate_python({"type": "response.completed", "response": whole, "sequence_number": len(events) + 2}))
        final = state._completed_response
        assert final.output_text == "\n\nLet me see." and final.status == "completed" and final.usage.output_tokens_details.reasoning_tokens == 2
        assert [json.loads(o.arguments) for o in final.output if o.type == "function_call"] == [{"city": "a city with a long name, Paris"}, {"city": "Rome"}]
    else:
        # Streamed, a cut call ends the response as a cut one; a whole answer drops it and keeps the two it completed.
        assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    if finish == "cut":
        assert whole["output"][-1]["status"] == "incomplete" and whole["output"][-1]["arguments"] == '{"ci'
        _, items = events_of(outputs, "tool_calls", streamed=False)
        assert [(o["type"], o.get("arguments")) for o in items.output][2:] == [("function_call", PARIS.arguments), ("function_call", ROME.arguments)]
        assert items.status == "completed"


def test_included_encrypted_reasoning_comes_back_as_the_turns_reasoning():
    # Stateless clients (Codex) ask for it and send the items back next turn.
    p = parse({"model": "m", "input": "hi", "include": ["reasoning.encrypted_content"]})
    items = OutputItems(p.encrypted_reasoning)
    events = [e for out in [Output(1, 0.0, [], reasoning="Think é."), Output(2, 0.0, [], text="Paris.", finish_reason="stop")] for e in items.feed(out)]
    events += items.finish("stop", True)
    reasoning = items.output[0]
    assert reasoning["encrypted_content"].startswith("ringd-reasoning:")
    Response.model_validate(response_object(p, "resp_1", 1, "m", items.output, items.status, Usage(1, 2)))
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"]["encrypted_content"] == reasoning["encrypted_content"]
    sealed = {k: v for k, v in reasoning.items() if k != "content"}  # what a client that drops the text sends back
    again = parse({"model": "m", "input": [{"role": "user", "content": "hi"}, sealed, items.output[1], {"role": "user", "content": "and?"}]})
    assert again.request.messages[1] == {"role": "assistant", "content": "Paris.", "reasoning_content": "Think é."}


def test_blank_text_before_a_call_opens_no_message_and_an_empty_answer_has_one():
    _, items = events_of([Output(1, 0.0, [], text="\n"), Output(2, 0.0, [], pieces=whole_call(ToolCall("call_1", "f", "{}"), 0), finish_reason="tool_calls")], "tool_calls")
    assert [o["type"] for o in items.output] == ["function_call"]
    _, items = events_of([Output(1, 0.0, [], finish_reason="stop")], "stop")
    assert [(o["type"], o["content"][0]["text"]) for o in items.output] == [("message", "")]


# --- a ring of the tiny SmolLM2 ----------------------------------------------------------


def respond(client, **kw):
    kw.setdefault("model", MODEL_ID)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 60)
    return client.responses.create(**kw)


def chat(client, messages: list[dict], max_tokens: int = 60) -> str:
    return client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=max_tokens).choices[0].message.content


def streamed(client, **kw) -> tuple[str, dict[str, str], Response, list]:
    """The text deltas joined, each call's argument deltas joined, the response.completed response, and every event."""
    text, args, final, events = [], {}, None, []
    for ev in respond(client, stream=True, **kw):
        events.append(ev)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
        elif ev.type == "response.function_call_arguments.delta":
            args[ev.item_id] = args.get(ev.item_id, "") + ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and final is not None
    return "".join(text), args, final, events


def test_the_greedy_answer_is_chat_completions(tiny_smollm2_client):
    r = respond(tiny_smollm2_client, input=FRANCE)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert r.output_text == chat(tiny_smollm2_client, [{"role": "user", "content": FRANCE}])
    [message] = r.output
    assert message.type == "message" and message.id.startswith("msg_") and message.content[0].annotations == []
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_instructions_are_the_system_message(tiny_smollm2_client):
    r = respond(tiny_smollm2_client, instructions="You answer in one word.", input=FRANCE, max_output_tokens=20)
    assert r.output_text == chat(tiny_smollm2_client, [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": FRANCE}], 20)
    assert r.instructions == "You answer in one word."


def test_input_items_carry_a_conversation(tiny_smollm2_client):
    turns = [
        {"role": "user", "content": FRANCE},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    items = [turns[0], {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": turns[1]["content"]}]}, turns[2]]
    assert respond(tiny_smollm2_client, input=items).output_text == chat(tiny_smollm2_client, turns)


def test_streamed_the_same_answer(tiny_smollm2_client):
    whole = respond(tiny_smollm2_client, input=FRANCE)
    text, _, final, events = streamed(tiny_smollm2_client, input=FRANCE)
    assert text == whole.output_text == final.output_text and final.status == "completed"
    assert {"response.in_progress", "response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.content_part.done", "response.output_item.done"} <= {e.type for e in events}  # fmt: skip
    with tiny_smollm2_client.responses.stream(model=MODEL_ID, input=FRANCE, temperature=0, max_output_tokens=60) as s:
        assert s.get_final_response().output_text == whole.output_text


def test_max_output_tokens_makes_it_incomplete(tiny_smollm2_client):
    r = respond(tiny_smollm2_client, input=FRANCE, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3
    _, _, final, events = streamed(tiny_smollm2_client, input=FRANCE, max_output_tokens=3)
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == r.output_text


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"], ids=["named", "required"])
def test_a_forced_call_is_a_function_call_item_that_validates(tiny_smollm2_client, choice):
    r = respond(tiny_smollm2_client, input=ASK, tools=[WEATHER, TIME], tool_choice=choice)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed" and r.output_text == ""
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # One call (the tiny model's greedy answer), of the named tool; "required", of either.
    assert len(calls) == 1 and (choice == "required" or calls[0].name == "get_weather")


def test_a_streamed_call_joins_to_the_same_arguments(tiny_smollm2_client):
    # One call: offered one tool and free to call it again, a small model may call it until max_output_tokens.
    kw = {"input": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    whole = [o for o in respond(tiny_smollm2_client, **kw).output if o.type == "function_call"]
    text, args, final, events = streamed(tiny_smollm2_client, **kw)
    calls = [o for o in final.output if o.type == "function_call"]
    assert text == "" and len(calls) == 1 and [args[c.id] for c in calls] == [c.arguments for c in calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(w.name, json.loads(w.arguments)) for w in whole]
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [c.arguments for c in calls]


def test_a_function_call_output_gets_an_answer(tiny_smollm2_client):
    r = respond(tiny_smollm2_client, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    # The call's id is in the prompt (the generic format names each result's call), and a new one
    # is made at random each run: one fixed id keeps the answer the same run after run.
    call = next(o for o in r.output if o.type == "function_call").model_copy(update={"call_id": "call_weather"})
    history = [{"role": "user", "content": ASK}, call, {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    answer = respond(tiny_smollm2_client, input=history, tools=[WEATHER], tool_choice="none")
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    # The output reached the prompt: with another, the same request answers otherwise.
    other = [*history[:2], {**history[2], "output": "3 C and snowing"}]
    assert respond(tiny_smollm2_client, input=other, tools=[WEATHER], tool_choice="none").output_text != answer.output_text


def test_json_schema_answers_validate_plain_and_streamed(tiny_smollm2_client):
    r = respond(tiny_smollm2_client, input=DESCRIBE, text=PERSON_FORMAT, max_output_tokens=120)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    text, _, final, _ = streamed(tiny_smollm2_client, input=DESCRIBE, text=PERSON_FORMAT, max_output_tokens=120)
    assert text == r.output_text == final.output_text


def test_json_object_parses(tiny_smollm2_client):
    ask = "Give the capital of France as a JSON object with the key capital."
    r = respond(tiny_smollm2_client, input=ask, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "send the whole conversation in input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
        ({"input": 5}, "input", "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
        ({"max_output_tokens": 10**9}, "max_output_tokens", "context"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}}, "text.format", "text.format"),
        ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "text.format", "text.format"),
        # Taken by the parser; the model has no vision tower (serving.py).
        ({"input": [{"role": "user", "content": [image()]}]}, "input[0].content[0].image_url", f"{MODEL_ID} does not take images: it has no vision tower"),
    ],
)
def test_bad_requests_are_openai_400s_naming_responses_fields(tiny_smollm2_client, extra, param, needle):
    kw = {"input": FRANCE, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        tiny_smollm2_client.responses.create(model=MODEL_ID, **{k: v for k, v in kw.items() if k != "input"}, input=kw["input"])
    err = e.value.body
    assert err["param"] == param and needle in err["message"], err


def test_a_follower_passes_requests_and_streams_to_the_leader(tiny_smollm2_ring, tiny_smollm2_client):
    import urllib.request

    with urllib.request.urlopen(tiny_smollm2_ring.url + "/cluster/status", timeout=10) as r:
        nodes = json.loads(r.read())["nodes"]
    follower = next(n["http"] for n in nodes if n["role"] == "follower")
    via = openai.OpenAI(base_url=f"http://{follower}/v1", api_key="not-needed", max_retries=0, timeout=120)
    want = respond(tiny_smollm2_client, input=FRANCE).output_text
    assert respond(via, input=FRANCE).output_text == want
    text, _, final, _ = streamed(via, input=FRANCE)
    assert text == final.output_text == want
    with pytest.raises(openai.BadRequestError) as e:
        respond(via, input=FRANCE, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"


def test_an_unknown_model_is_a_404(tiny_smollm2_client):
    with pytest.raises(openai.NotFoundError):
        tiny_smollm2_client.responses.create(model="nope", input=FRANCE)


# --- reasoning: the tiny qwen3 that thinks ------------------------------------------------


def test_reasoning_is_an_item_before_the_message(think_client):
    r = respond(think_client, model="think", input=FRANCE)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    reasoning = r.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.content[0].text.strip()
    assert r.output_text.strip() == "Paris." and "<think>" not in r.output_text and r.usage.output_tokens_details.reasoning_tokens > 0
    chat_message = think_client.chat.completions.create(model="think", messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=60).choices[0].message
    assert reasoning.content[0].text == chat_message.model_extra["reasoning_content"] and r.output_text == chat_message.content
    _, _, final, events = streamed(think_client, model="think", input=FRANCE)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert final.output_text == r.output_text


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_an_effort_that_turns_thinking_off_gives_no_reasoning(think_client, effort):
    r = respond(think_client, model="think", input=FRANCE, reasoning={"effort": effort})
    assert [o.type for o in r.output] == ["message"] and r.output_text.strip() == "Paris." and r.reasoning.effort == effort
