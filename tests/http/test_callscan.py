"""callscan reads the generic call format as it is written: every call the moment its object closes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from ringd.http.callscan import Arguments, Called, CallScanner, Named

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
calls = st.lists(st.tuples(st.text(min_size=1, max_size=12), json_values), min_size=1, max_size=4)


def document(items, spaced: bool) -> str:
    sep = (", ", ": ") if spaced else (",", ":")
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in items]}, separators=sep, ensure_ascii=False)


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def scan(parts: list[str]) -> list:
    scanner = CallScanner()
    return [event for part in parts for event in scanner.feed(part)]


@given(calls, st.booleans(), st.lists(st.integers(min_value=0), max_size=12))
def test_each_call_is_named_then_argued_then_complete_however_the_text_is_cut(items, spaced, cuts):
    text = document(items, spaced)
    events = scan(pieces(text, cuts))
    assert [(e.name, e.arguments) for e in events if isinstance(e, Called)] == [(n, json.dumps(a, ensure_ascii=False)) for n, a in items]
    assert [e.name for e in events if isinstance(e, Named)] == [n for n, _ in items]
    for i, (_, a) in enumerate(items):
        sent = "".join(e.text for e in events if isinstance(e, Arguments) and e.index == i)
        assert json.loads(sent) == a  # the pieces join to the arguments as written
        kinds = [type(e) for e in events if getattr(e, "index", None) == i]
        assert kinds[0] is Named and kinds[-1] is Called and set(kinds[1:-1]) <= {Arguments}


@given(calls, st.integers(min_value=0))
def test_a_list_cut_anywhere_keeps_the_calls_it_completed(items, cut):
    text = document(items, spaced=False)
    cut %= len(text) + 1
    done = [e for e in scan([text[:cut]]) if isinstance(e, Called)]
    # A call is complete once its object's closing brace is in (the list's "]}" may be cut).
    closed = sum(1 for n in range(1, len(items) + 1) if len(document(items[:n], spaced=False)) - 2 <= cut)
    assert [(e.name, e.arguments) for e in done] == [(n, json.dumps(a, ensure_ascii=False)) for n, a in items[:closed]]


@given(st.text(max_size=200))
def test_any_text_reads_without_error(text):
    scan(pieces(text, [len(text) // 3, len(text) // 2]))


@given(json_values)
def test_json_of_another_shape_holds_no_call(value):
    assert not any(isinstance(e, Called) for e in scan([json.dumps(value)]))


def test_what_is_not_where_the_format_puts_calls_is_not_a_call():
    assert scan(['{"calls": [{"name": "f", "arguments": {}}]}']) == []
    assert scan(['[{"name": "f", "arguments": {}}]']) == []
    assert scan(['{"tool_calls": [{"name": "f"}, {"arguments": {}}, {"name": 7, "arguments": {}}]}']) == [Named(0, "f")]
    assert [e for e in scan(['{"tool_calls": [{"arguments": {"a": 1}, "name": "f"}]}']) if not isinstance(e, Arguments)] == [Named(0, "f"), Called(0, "f", '{"a": 1}')]
