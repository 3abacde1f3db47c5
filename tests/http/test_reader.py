"""reader.Reader: what the model writes, split into answer, reasoning and tool calls, however it arrives.

The model's text comes a token at a time, and a marker's characters may be
split across tokens any which way; so the property under test is that any
split of a text gives the same answer, reasoning and calls as the whole text.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools

from ringd.http.reader import Reader
from ringd.http.render import ReadPlan
from ringd.http.request import CallArguments, CallDone, CallOpened

THINK = ("<think>", "</think>")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def native(**kw) -> ReadPlan:
    return ReadPlan(think=THINK, tools="native", tool_markers=("<tool_call>", "</tool_call>"), tool_parser=json_tools.parse_tool_call, template_tools=WEATHER, **kw)


def read(plan: ReadPlan, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    """The answer, reasoning and calls that ``pieces`` read to; and each call as streamed agrees."""
    r = Reader(plan)
    text, reasoning, calls, streamed = [], [], [], {}
    for i, piece in enumerate(pieces):
        t, z, c = r.feed(piece, final=i == len(pieces) - 1)
        text.append(t)
        reasoning.append(z)
        for p in c:
            if isinstance(p, CallOpened):
                assert p.index == len(streamed), "calls are numbered in the order they open"
                streamed[p.index] = (p.id, p.name, [])
            elif isinstance(p, CallArguments):
                streamed[p.index][2].append(p.text)
            else:
                call_id, name, args = streamed[p.index]
                assert (p.call.id, p.call.name) == (call_id, name)
                assert json.loads("".join(args)) == json.loads(p.call.arguments), "the streamed arguments join to the call's"
                calls.append((p.call.name, json.loads(p.call.arguments)))
    return "".join(text), "".join(reasoning), calls


def done(pieces) -> list:
    return [p.call for p in pieces if isinstance(p, CallDone)]


def splits(text: str):
    """Strategy: ``text`` cut into pieces at arbitrary places (the last may be empty, as an EOS token's)."""
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])] + [""]
    )


QWEN_ANSWER = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_of_a_thinking_tool_call_reads_the_same(data):
    pieces = data.draw(splits(QWEN_ANSWER))
    text, reasoning, calls = read(native(), pieces)
    assert reasoning == "\nThe user wants weather.\n"
    assert calls == [("get_weather", {"city": "Paris"})]
    assert text.strip() == ""


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_prompt_that_opened_the_think_block_starts_in_reasoning(data):
    answer = "I should say hello.</think>\n\nHello!"
    text, reasoning, calls = read(native(initial="reasoning"), data.draw(splits(answer)))
    assert (text, reasoning, calls) == ("\n\nHello!", "I should say hello.", [])


def test_a_call_that_does_not_parse_comes_back_as_text_not_lost():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    text, _, calls = read(native(), [broken, ""])
    assert calls == [] and text == broken


def test_a_call_cut_off_by_max_tokens_comes_back_as_text():
    text, _, calls = read(native(), ['<tool_call>\n{"name": "get_wea', ""])
    assert calls == [] and text == '<tool_call>\n{"name": "get_wea</tool_call>'


def test_without_tools_markers_are_plain_text():
    text, reasoning, calls = read(ReadPlan(), [QWEN_ANSWER])
    assert text == QWEN_ANSWER and reasoning == "" and calls == []


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
GENERIC_CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]}'


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_generic_format_streams_each_call_as_it_is_written(data):
    pieces = data.draw(splits(GENERIC_CALL))
    text, _, calls = read(ReadPlan(tools="generic"), pieces)
    assert text == "" and calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    # Not held to the end: the first call opens once its name is written, and is complete
    # with the piece that closes its object.
    r, fed, out = Reader(ReadPlan(tools="generic")), "", []
    for piece in pieces:
        out += r.feed(piece)[2]
        fed += piece
        if len(fed) > GENERIC_CALL.index('"get_weather"') + len('"get_weather"'):
            assert isinstance(out[0], CallOpened) and out[0].name == "get_weather"
        if len(fed) > GENERIC_CALL.index("}}") + 1:
            assert len(done(out)) >= 1
            break


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1).filter(lambda t: not t.startswith("{")), st.data())
def test_generic_format_passes_text_through_as_it_comes(answer, data):
    r = Reader(ReadPlan(tools="generic"))
    pieces = data.draw(splits(answer))
    got = [r.feed(p, final=i == len(pieces) - 1)[0] for i, p in enumerate(pieces)]
    assert got == pieces  # streamed as it comes: nothing held back


def test_generic_json_cut_short_keeps_its_complete_calls_and_is_never_text():
    text, _, calls = read(ReadPlan(tools="generic"), ['{"tool_calls": [{"name": "get_w', ""])
    assert calls == [] and text == ""  # the engine's own format reaches no client
    cut = GENERIC_CALL[: GENERIC_CALL.index("Rome")]
    text, _, calls = read(ReadPlan(tools="generic"), [cut, ""])
    assert calls == [("get_weather", {"city": "Paris"})] and text == ""
    # The call it cut had gone out in part: ``cut`` tells a stream to end as a cut answer.
    r = Reader(ReadPlan(tools="generic"))
    r.feed('{"tool_calls": [' + CALL + ', {"name": "get_time", "arguments": {"zone": "Eu')
    assert done(r.feed("", final=True)[2]) == [] and r.cut and r.calls == 1


def test_a_call_that_comes_again_ends_the_answer_and_is_never_streamed():
    """SmolLM2 at temperature 0, forced to call with parallel calls allowed, repeats its call until
    max_tokens: the repeat is dropped unsent and ``repeated`` tells the server to end the answer there."""
    r = Reader(ReadPlan(tools="generic"))
    text, _, first = r.feed('{"tool_calls": [' + CALL + ", ")
    assert [(c.name, c.arguments) for c in done(first)] == [("get_weather", '{"city": "Paris"}')] and not r.repeated
    text, _, again = r.feed(CALL[:-1])
    assert again == [] and not r.repeated  # not yet complete: it may still differ, and is held meanwhile
    text, _, again = r.feed("}, ")
    assert again == [] and r.repeated and r.calls == 1 and text == ""
    # Cut while it could still be a repeat: nothing of it went out, so nothing was cut.
    r = Reader(ReadPlan(tools="generic"))
    r.feed('{"tool_calls": [' + CALL + ", " + CALL[:-3])
    assert done(r.feed("", final=True)[2]) == [] and not r.cut and r.calls == 1


def test_a_call_of_the_same_tool_streams_from_where_it_differs():
    r = Reader(ReadPlan(tools="generic"))
    r.feed('{"tool_calls": [' + CALL + ", ")
    assert r.feed('{"name": "get_weather", "arguments": {"city": "Pa')[2] == []  # so far, the same call
    opened, args = r.feed("m")[2]  # Pamplona: another call, out before it is complete
    assert (opened.index, opened.name) == (1, "get_weather") and args == CallArguments(1, '{"city": "Pam')
    *rest, last = r.feed('plona"}}]}', final=True)[2]
    assert rest == [CallArguments(1, 'plona"}')] and last.call.arguments == '{"city": "Pamplona"}' and not r.repeated
    # Whitespace is no difference: a repeat written with other spacing is still held, then dropped.
    r = Reader(ReadPlan(tools="generic"))
    r.feed('{"tool_calls": [' + CALL + ", ")
    assert r.feed('{"name": "get_weather", "arguments": { "city" :  "Paris" }}')[2] == [] and r.repeated


def test_a_native_call_that_comes_again_ends_the_answer_too():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    r = Reader(native())
    _, _, pieces = r.feed(call + call.replace("Paris", "Rome"))
    assert [c.arguments for c in done(pieces)] == ['{"city": "Paris"}', '{"city": "Rome"}'] and not r.repeated
    assert [p.index for p in pieces] == [0, 0, 0, 1, 1, 1]  # each whole: opened, its arguments, done
    _, _, pieces = r.feed(call)
    assert pieces == [] and r.repeated and r.calls == 2
