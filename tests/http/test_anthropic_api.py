"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``), with the official SDK.

Fast tests first, without a ring: bodies become the one internal request or a
400 (Hypothesis: any JSON body), image blocks (a real, tiny PNG) the request's
images and the image parts of their turns, and the events ringd streams validate as the
SDK's own models and accumulate, with the SDK's own ``accumulate_event``, into
the message ringd sends whole.

Then a ring of three of the tiny llama that speaks through SmolLM2's tokenizer
and template (``tiny_smollm2``, tests/kit/tinysmol.py): greedy answers equal chat
completions' for the same conversation (plain, with a system prompt,
multi-turn, streamed); stop sequences and max_tokens end it with their
stop_reason; tools (generic, ``render.py``) give tool_use blocks whose input
validates, streamed or not, and a tool_result gets an answer; an image to this
model, which has no vision tower, is an Anthropic 400;
output_config.format constrains the answer; count_tokens counts what a message
bills. That a prefill is continued, in words, is the real SmolLM2's to show
(the ring test_smollm2.py shares). Reasoning and native calls use the tiny
qwen3 trained to think (``think_model``).
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import openai
import jsonschema
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from ringd.http.anthropic_api import Blocks, message, parse
from ringd.http.errors import ApiError
from ringd.http.request import CallArguments, CallDone, CallOpened, Output, ToolCall, Usage, whole_call
from ringd.ring.media import MAX_IMAGES

MODEL_ID = "tiny-smollm2"
FRANCE = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The current weather of a city", "input_schema": WEATHER_SCHEMA}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}
TIME = {"name": "get_time", "description": "The local time in a time zone", "input_schema": TIME_SCHEMA}
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
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
GREEDY = {"temperature": 0}  # the SDK's 2.x sends sampling as extra body fields


def png_base64() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = png_base64()


def image(data=PNG, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


# --- bodies -> the internal request (no ring) --------------------------------------------


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400, e.value.body()
    return e.value


def test_blocks_become_the_templates_messages():
    p = parse(
        {
            "model": "m",
            "max_tokens": 50,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Call it.", "signature": "x"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
                {"role": "user", "content": "In Celsius."},
            ],
            "tools": [WEATHER],
            "stop_sequences": ["END"],
            "top_k": 5,
            "temperature": 0.5,
            "thinking": {"type": "enabled", "budget_tokens": 20},
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        }
    )
    r = p.request
    assert r.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Call it.",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1", "name": "get_weather"},
        {"role": "user", "content": "And tomorrow?\n\nIn Celsius."},  # consecutive user turns are joined
    ]
    assert r.stop == ["END"] and r.params.top_k == 5 and r.params.temperature == 0.5 and r.max_tokens == 50
    assert r.tool_choice == "required" and r.parallel_tool_calls is False and r.tools[0].parameters == WEATHER_SCHEMA
    assert r.template_kwargs == {"enable_thinking": True} and not r.prefill and not p.stream


def test_image_blocks_are_the_requests_images_in_order_and_parts_of_their_turns():
    body = {
        "model": "m",
        "max_tokens": 50,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What differs?"}, image(), {"type": "text", "text": "and"}, image(media_type="image/jpeg")]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}, image(), {"type": "text", "text": "This?"}]},
            {"role": "user", "content": "In Celsius."},  # joined to the turn before, its text to that turn's last text
            {"role": "user", "content": [image("not base64, but a decoder's to refuse, not the parser's")]},
        ],
        "tools": [WEATHER],
    }
    for r in (parse(body).request, parse(body, count_only=True).request):
        assert [p.where for p in r.images] == [
            "messages[0].content[1].source.data", "messages[0].content[3].source.data", "messages[2].content[1].source.data",
            "messages[4].content[0].source.data",
        ]  # fmt: skip
        assert [p.data for p in r.images[:3]] == [PNG] * 3
        assert r.messages == [
            {"role": "user", "content": [{"type": "text", "text": "What differs?"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1", "name": "get_weather"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "This?\n\nIn Celsius."}, {"type": "image"}]},
        ]
    two = [image(), {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": two}]}).request.messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a\n\nb"}]}
    ]  # text blocks are paragraphs, with an image as without


def test_a_final_assistant_message_is_a_prefill_and_settings_map():
    r = parse({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}).request
    assert r.prefill and r.messages[-1] == {"role": "assistant", "content": "Hello"}
    r = parse({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}}).request
    assert r.template_kwargs == {"enable_thinking": False} and r.tool_choice == "auto"
    r = parse(
        {
            "model": "m",
            "max_tokens": 9,
            "messages": [{"role": "user", "content": "Hi"}],
            "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": PERSON}},
        }
    ).request
    assert r.response_format.schema == PERSON and r.response_format.strict and r.template_kwargs == {"reasoning_effort": "high"}
    assert r.name("response_format") == "output_config.format" and r.name("stop") == "stop_sequences"
    r = parse(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
        count_only=True,
    ).request
    assert r.tool_choice == "function" and r.tool_name == "get_weather" and r.max_tokens is None


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"max_tokens": None}, "max_tokens", "max_tokens is required"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "system"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type", "document block"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope"}]}]},
            "messages[0].content[0].tool_use_id",
            "tool_use",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                ]
            },
            "messages[1]",
            "tool_result",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": "and?"},
                ]
            },
            "messages[2]",
            "t1",
        ),  # fmt: skip
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "web_search_20250305"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "input_schema is required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name", "nope"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": ["get_weather"]}}, "tool_choice.name", "['get_weather']"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens", "less than max_tokens"),
        ({"stop_sequences": "END"}, "stop_sequences", "list"),
        ({"temperature": 3}, "temperature", "temperature"),
        ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format", "json_schema"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers", "MCP"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]}, "messages[0].content[0].source.url", "an http(s) URL"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, "messages[0].content[0].source", "keeps no files"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "text", "data": "x"}}]}]}, "messages[0].content[0].source.type", "'text'"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0].source", "'base64'"),
        ({"messages": [{"role": "user", "content": [image(media_type="image/tiff")]}]}, "messages[0].content[0].source.media_type", "image/tiff"),
        ({"messages": [{"role": "user", "content": [image("")]}]}, "messages[0].content[0].source.data", "messages[0].content[0].source.data: the image is empty"),
        ({"messages": [{"role": "user", "content": [image(None)]}]}, "messages[0].content[0].source.data", "base64 text"),
        (
            {"messages": [{"role": "user", "content": [image()] * (MAX_IMAGES - 1)}, {"role": "user", "content": [image(), image()]}]},
            "messages",
            f"{MAX_IMAGES + 1} images in one request; at most {MAX_IMAGES}",
        ),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [image()]}]}, "messages[1].content[0].type", "user messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image()]}]},
                ]
            },
            "messages[2].content[0].content[0].type",
            "image block of the user message, after the tool_result",
        ),
    ],
)
def test_bad_bodies_are_400s_naming_anthropics_fields(extra, param, needle):
    body = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": FRANCE}], **extra}
    e = refused({k: v for k, v in body.items() if v is not None})
    assert e.param == param and needle in e.message, e.body()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    [
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "stop_sequences",
        "temperature",
        "top_k",
        "output_config",
        "stream",
        "metadata",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(FIELDS, JSON, max_size=8), with_model=st.booleans())
def test_any_json_body_is_a_request_or_a_400(body, with_model):
    if with_model:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **body}
    try:
        parse(body)
    except ApiError as e:
        assert e.status == 400 and e.message


# --- events -> the SDK's own models (no ring) --------------------------------------------


def events_of(outputs: list[Output], blocks: Blocks | None = None, streamed: bool = True) -> tuple[list[dict], Blocks]:
    blocks = blocks or Blocks()
    return [e for out in outputs for e in blocks.feed(out)] + blocks.finish(streamed), blocks


PARIS = ToolCall("call_1", "get_weather", '{"city": "a city with a long name, Paris"}')
ROME = ToolCall("call_2", "get_weather", '{"city": "Rome"}')


@pytest.mark.parametrize("cut", [False, True])
def test_streamed_events_are_the_sdks_and_accumulate_to_the_whole_message(cut):
    outputs = [
        Output(1, 0.0, [], reasoning="Think"), Output(2, 0.0, [], reasoning="ing."), Output(3, 0.0, [], text="\n\n"),
        Output(4, 0.0, [], text="Let me see."), Output(5, 0.0, [], pieces=[CallOpened(0, PARIS.id, PARIS.name)]),
        Output(6, 0.0, [], pieces=[CallArguments(0, '{"city": "a city')]),
        Output(7, 0.0, [], pieces=[CallArguments(0, ' with a long name, Paris"}'), CallDone(0, PARIS), CallOpened(1, ROME.id, ROME.name)]),
        Output(8, 0.0, [], pieces=[CallArguments(1, ROME.arguments), CallDone(1, ROME)], finish_reason="tool_calls"),
    ]  # fmt: skip
    if cut:  # max_tokens cut a third call, whose start went out
        outputs[-1].finish_reason = None
        outputs.append(Output(9, 0.0, [], pieces=[CallOpened(2, "call_3", "get_weather"), CallArguments(2, '{"ci')], finish_reason="tool_calls"))
    events, blocks = events_of(outputs)
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"][:3] == [
        '{"city": "a city', ' with a long name, Paris"}', '{"city": "Rome"}'
    ]  # as written, not at the end
    u = Usage(5, 6, 2, 2)
    whole = message("msg_1", "m", blocks.content, "length" if cut else "tool_calls", None, u)
    start = message("msg_1", "m", [], None, None, u)
    tail = [
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens" if cut else "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 6}},
        {"type": "message_stop"},
    ]
    snapshot, bufs = None, {}
    for e in [{"type": "message_start", "message": start}, *events, *tail]:
        snapshot = accumulate_event(event=EVENTS.validate_python(e), current_snapshot=snapshot, json_bufs=bufs)
    assert blocks.cut == cut
    if cut:
        # Streamed, the cut block was stopped where it was cut; a whole answer drops it, the two complete calls kept.
        assert snapshot.content[-1].type == "tool_use" and len(snapshot.content) == 5
        _, blocks = events_of(outputs, streamed=False)
        whole = message("msg_1", "m", blocks.content, "tool_calls", None, u)
    Message.model_validate(whole)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert [b.model_dump(exclude_none=True) for b in snapshot.content[:4]] == [
        Message.model_validate(whole).content[i].model_dump(exclude_none=True) for i in range(4)
    ]
    assert whole["content"][1]["text"] == "\n\nLet me see." and whole["content"][2]["input"] == {"city": "a city with a long name, Paris"}
    assert whole["stop_reason"] == "tool_use" and whole["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2,
        "output_tokens": 6,
    }
    assert whole["content"][2]["id"].startswith("toolu_")


def test_blank_text_before_a_call_opens_no_block_and_omitted_thinking_is_empty():
    _, blocks = events_of([Output(1, 0.0, [], text="\n"), Output(2, 0.0, [], pieces=whole_call(ToolCall("call_1", "f", "{}"), 0), finish_reason="tool_calls")])
    assert [b["type"] for b in blocks.content] == ["tool_use"]
    events, blocks = events_of(
        [Output(1, 0.0, [], reasoning="secret"), Output(2, 0.0, [], text="Paris.", finish_reason="stop")], Blocks(show_thinking=False)
    )
    assert blocks.content == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "Paris."}]
    assert "secret" not in json.dumps(events)
    stopped = message("msg_1", "m", blocks.content, "stop", "END", Usage(1, 2))
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "END"
    assert message("msg_1", "m", [], "length", None, Usage(1, 2))["stop_reason"] == "max_tokens"


# --- a ring of the tiny SmolLM2 ----------------------------------------------------------


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(tiny_smollm2_ring):
    return anthropic_client(tiny_smollm2_ring.url)


def create(client, content=FRANCE, max_tokens: int = 60, extra: dict | None = None, **kw) -> Message:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.messages.create(
        model=kw.pop("model", MODEL_ID), max_tokens=max_tokens, messages=messages, extra_body={**GREEDY, **(extra or {})}, **kw
    )


def streamed(client, content=FRANCE, max_tokens: int = 60, extra: dict | None = None, **kw) -> tuple[Message, list]:
    """The SDK's accumulated message, and every raw event."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    with client.messages.stream(
        model=kw.pop("model", MODEL_ID), max_tokens=max_tokens, messages=messages, extra_body={**GREEDY, **(extra or {})}, **kw
    ) as s:
        events = list(s)
        final = s.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    return final, events


def text_of(m: Message) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def chat(oai, messages: list[dict], max_tokens: int = 60, **kw) -> str:
    return oai.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=max_tokens, **kw).choices[0].message.content


def test_the_greedy_answer_is_chat_completions(client, tiny_smollm2_client):
    m = create(client)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL_ID
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and [b.type for b in m.content] == ["text"]
    assert text_of(m) == chat(tiny_smollm2_client, [{"role": "user", "content": FRANCE}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens > 0


def test_streamed_the_same_answer(client):
    whole = create(client)
    final, events = streamed(client)
    assert text_of(final) == text_of(whole) and final.stop_reason == "end_turn"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(whole)
    assert {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"} <= {
        e.type for e in events
    }
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == whole.usage.output_tokens


def test_a_system_prompt_and_turns_are_chat_completions(client, tiny_smollm2_client):
    system = "You answer in one word."
    assert text_of(create(client, system=system, max_tokens=20)) == chat(
        tiny_smollm2_client, [{"role": "system", "content": system}, {"role": "user", "content": FRANCE}], 20
    )
    turns = [
        {"role": "user", "content": FRANCE},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    blocks = [turns[0], {"role": "assistant", "content": [{"type": "text", "text": turns[1]["content"]}]}, turns[2]]
    assert text_of(create(client, blocks)) == chat(tiny_smollm2_client, turns)


def test_a_stop_sequence_ends_it_and_is_named(client):
    whole = text_of(create(client))
    stop = whole[20:23]  # a piece of what it says when nothing stops it, and one it never says
    assert len(whole) > 30 and "Rome" not in whole, whole
    for m in (create(client, stop_sequences=[stop, "Rome"]), streamed(client, stop_sequences=[stop, "Rome"])[0]):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert text_of(m) == whole[: whole.index(stop)]


def test_max_tokens_ends_it(client):
    m = create(client, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    final, _ = streamed(client, max_tokens=3)
    assert final.stop_reason == "max_tokens" and text_of(final) == text_of(m)


def test_a_final_assistant_message_is_continued(smollm2_ring):
    """In words: the real SmolLM2, on the ring test_smollm2.py shares."""
    real = anthropic_client(smollm2_ring.url)
    prefix = "The capital of France is"
    m = create(real, [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": prefix}], max_tokens=8, model="smollm2")
    text = text_of(m)
    assert "Paris" in text and not text.startswith(prefix), text


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"])
def test_a_forced_call_is_a_tool_use_whose_input_validates(client, choice):
    m = create(client, ASK, tools=[WEATHER, TIME], tool_choice={**choice, "disable_parallel_tool_use": True})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use" and text_of(m) == ""
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMAS[use.name])
    # One call (parallel use disabled), of the named tool; with "any", of either (the tiny model's
    # greedy pick between them is no answer to the question).
    assert len(uses) == 1 and (choice["type"] == "any" or uses[0].name == "get_weather"), uses


def test_a_streamed_call_assembles_to_the_same_input(client):
    kw = {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    whole = [b for b in create(client, ASK, **kw).content if b.type == "tool_use"]
    final, events = streamed(client, ASK, **kw)
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1 and [(u.name, u.input) for u in uses] == [(w.name, w.input) for w in whole]
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(pieces) == uses[0].input and final.stop_reason == "tool_use"


def test_a_tool_result_gets_an_answer(client):
    m = create(client, ASK, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert any(b.type == "tool_use" for b in m.content)
    # The call's id is in the prompt (the generic format names each result's call), and a new
    # one is made at random each run: one fixed id keeps the answer the same run after run.
    called = [{**b.model_dump(exclude_none=True), "id": "toolu_weather"} if b.type == "tool_use" else b.model_dump(exclude_none=True) for b in m.content]
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": called},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_weather", "content": "18 C and sunny"}]},
    ]
    answer = create(client, history, tools=[WEATHER], tool_choice={"type": "none"})
    # A text answer, not another call (the tiny model's text: it may end its turn or run to max_tokens).
    assert text_of(answer) and answer.stop_reason in ("end_turn", "max_tokens") and not [b for b in answer.content if b.type == "tool_use"]
    # The result reached the prompt: with another, the same request answers otherwise.
    other = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_weather", "content": "3 C and snowing"}]}]
    assert text_of(create(client, other, tools=[WEATHER], tool_choice={"type": "none"})) != text_of(answer)


def test_an_output_format_answer_validates_plain_and_streamed(client):
    fmt = {"format": {"type": "json_schema", "schema": PERSON}}
    m = create(client, DESCRIBE, max_tokens=120, output_config=fmt)
    assert m.stop_reason == "end_turn", m
    jsonschema.validate(json.loads(text_of(m)), PERSON)
    final, _ = streamed(client, DESCRIBE, max_tokens=120, output_config=fmt)
    assert text_of(final) == text_of(m)


def test_count_tokens_counts_what_a_message_bills(client):
    kw = {"system": "Be brief.", "tools": [WEATHER]}
    m = create(client, ASK, max_tokens=5, **kw)
    count = client.messages.count_tokens(model=MODEL_ID, messages=[{"role": "user", "content": ASK}], **kw)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": ASK}])


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 10**9}, "context"),
        ({"tools": [WEATHER], "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}, "output_config.format"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(unclosed"}}}}, "output_config.format"),
        # Taken by the parser; the model has no vision tower (serving.py).
        ({"messages": [{"role": "user", "content": [image(), {"type": "text", "text": "What is it?"}]}]}, f"{MODEL_ID} does not take images: it has no vision tower"),
    ],
)
def test_bad_requests_are_anthropic_errors(client, kw, needle):
    body = {"model": MODEL_ID, "max_tokens": 20, "messages": [{"role": "user", "content": FRANCE}], **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**body)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"], err
    assert set(err) == {"type", "error"}  # Anthropic's shape has no param: the message names the field


def test_models_list_and_retrieve_are_anthropics_and_openais(client, tiny_smollm2_client):
    model = client.models.list().data[0]  # the loaded model first; then what else the machine holds
    assert model.id == MODEL_ID and model.type == "model" and model.display_name == MODEL_ID and model.created_at.year >= 2026
    assert [m.id for m in tiny_smollm2_client.models.list()][0] == MODEL_ID
    assert client.models.retrieve(MODEL_ID) == model
    one = tiny_smollm2_client.models.retrieve(MODEL_ID)
    assert one.id == MODEL_ID and one.object == "model" and one.owned_by == "ringd" and one.created > 0
    # Another id: a 404 in each client's own shape (the header Anthropic's SDK sends says whose).
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert set(e.value.body) == {"type", "error"} and e.value.body["error"]["type"] == "not_found_error", e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        tiny_smollm2_client.models.retrieve("org/gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model" and "org/gpt-4o" in e.value.body["message"]


def test_an_unknown_model_is_an_anthropic_error(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="nope")
    assert e.value.body["error"]["type"] == "not_found_error" and "nope" in e.value.body["error"]["message"]


def test_a_follower_passes_requests_and_streams_to_the_leader(tiny_smollm2_ring, client):
    import urllib.request

    with urllib.request.urlopen(tiny_smollm2_ring.url + "/cluster/status", timeout=10) as r:
        nodes = json.loads(r.read())["nodes"]
    follower = next(n["http"] for n in nodes if n["role"] == "follower")
    via = anthropic_client(f"http://{follower}")
    want = text_of(create(client))
    assert text_of(create(via)) == want
    assert text_of(streamed(via)[0]) == want
    assert via.messages.count_tokens(model=MODEL_ID, messages=[{"role": "user", "content": FRANCE}]).input_tokens > 0
    with pytest.raises(anthropic.BadRequestError):
        create(via, [{"role": "system", "content": "x"}])


# --- reasoning and native calls: the tiny qwen3 that thinks -------------------------------


THINK_WEATHER = "What is the weather in Paris?"
THINK_TOOL = {"name": "get_weather", "description": "The current weather of a city", "input_schema": WEATHER_SCHEMA}


def test_thinking_is_a_block_before_the_text(think_ring):
    client = anthropic_client(think_ring.url)
    m = create(client, model="think")
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert m.content[0].thinking.strip() and text_of(m).strip() == "Paris." and "<think>" not in text_of(m)
    reasoning = think_ring.client().chat.completions.create(model="think", messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=60)
    assert m.content[0].thinking == reasoning.choices[0].message.model_extra["reasoning_content"]
    final, events = streamed(client, model="think")
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta") == m.content[0].thinking
    assert text_of(final) == text_of(m)


def test_thinking_disabled_gives_no_thinking_block(think_ring):
    m = create(anthropic_client(think_ring.url), model="think", thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"] and text_of(m).strip() == "Paris."


def test_a_native_call_is_a_tool_use_then_the_result_gets_an_answer(think_ring):
    client = anthropic_client(think_ring.url)
    m = create(client, THINK_WEATHER, model="think", tools=[THINK_TOOL])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})], m.content
    assert "<tool_call>" not in text_of(m)
    history = [
        {"role": "user", "content": THINK_WEATHER},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 C and sunny"}]},
    ]
    answer = create(client, history, model="think", tools=[THINK_TOOL])
    assert text_of(answer).strip() == "It is 18 C and sunny in Paris." and answer.stop_reason == "end_turn"
