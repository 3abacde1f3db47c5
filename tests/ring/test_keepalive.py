"""ringd.models.ollama.keepalive: Ollama's keep_alive, checked against Ollama's and Go's own tables.

The tables are copied from Ollama's api/types_test.go (TestKeepAliveParsingFromJSON) and
docs/faq.mdx, and from Go's src/time/time_test.go (parseDurationTests,
parseDurationErrorTests, durationTests); the properties compare the scanner with Go's grammar
written as a regular expression (fine here: the test's inputs are short and its own).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.models.ollama.keepalive import (
    FOREVER,
    MAX_DURATION_CHARS,
    MAX_KEEP_ALIVE_S,
    KeepAliveError,
    format_keep_alive,
    go_duration_string,
    parse_go_duration,
    parse_keep_alive,
)

S, MS, US, NS = 10**9, 10**6, 10**3, 1
MIN, H = 60 * S, 3600 * S

# Ollama's api/types_test.go, TestKeepAliveParsingFromJSON, and the FAQ's examples
# (negative: Ollama's math.MaxInt64, forever here).
OLLAMA = [
    (42, 42.0),
    (42.5, 42.5),
    ("42m", 42 * 60.0),
    (-1, FOREVER),
    (-3.14, FOREVER),
    ("-1m", FOREVER),
    ("10m", 600.0),
    ("24h", 86400.0),
    (3600, 3600.0),
    (0, 0.0),  # unload as soon as the request ends
    ("0", 0.0),  # Go's ParseDuration: a lone 0 needs no unit
    ("5m", 300.0),
    ("1h30m", 5400.0),
    ("300ms", 0.3),
    ("1.5h", 5400.0),
]


@pytest.mark.parametrize("value, seconds", OLLAMA)
def test_ollamas_examples(value, seconds):
    assert parse_keep_alive(value) == seconds


# Go's parseDurationTests, in nanoseconds.
GO_PARSE = [
    ("0", 0), ("5s", 5 * S), ("30s", 30 * S), ("1478s", 1478 * S),
    ("-5s", -5 * S), ("+5s", 5 * S), ("-0", 0), ("+0", 0),
    ("5.0s", 5 * S), ("5.6s", 5 * S + 600 * MS), ("5.s", 5 * S), (".5s", 500 * MS), ("1.0s", S), ("1.00s", S),
    ("1.004s", S + 4 * MS), ("1.0040s", S + 4 * MS), ("100.00100s", 100 * S + MS),
    ("10ns", 10 * NS), ("11us", 11 * US), ("12µs", 12 * US), ("12μs", 12 * US), ("13ms", 13 * MS),
    ("14s", 14 * S), ("15m", 15 * MIN), ("16h", 16 * H),
    ("3h30m", 3 * H + 30 * MIN), ("10.5s4m", 4 * MIN + 10 * S + 500 * MS), ("-2m3.4s", -(2 * MIN + 3 * S + 400 * MS)),
    ("1h2m3s4ms5us6ns", H + 2 * MIN + 3 * S + 4 * MS + 5 * US + 6 * NS), ("39h9m14.425s", 39 * H + 9 * MIN + 14 * S + 425 * MS),
    ("52763797000ns", 52763797000), ("0.3333333333333333333h", 20 * MIN), ("9007199254740993ns", 2**53 + 1),
    ("9223372036854775807ns", 2**63 - 1), ("9223372036854775.807us", 2**63 - 1), ("9223372036s854ms775us807ns", 2**63 - 1),
    ("-9223372036854775808ns", -(2**63)), ("-9223372036854775.808us", -(2**63)), ("-9223372036s854ms775us808ns", -(2**63)),
    ("-2562047h47m16.854775808s", -(2**63)),
    ("0.100000000000000000000h", 6 * MIN), ("0.830103483285477580700h", 49 * MIN + 48 * S + 372539827),
]  # fmt: skip


@pytest.mark.parametrize("text, ns", GO_PARSE)
def test_gos_parse_duration_table(text, ns):
    assert parse_go_duration(text) == ns


# Go's parseDurationErrorTests (the invalid UTF-8 ones as the U+FFFD a JSON decoder makes of
# them), and a bare number of seconds as a string, which Ollama's API refuses the same way.
GO_ERRORS = [
    "", "3", "-", "s", ".", "-.", ".s", "+.s", "1d", "\ufffd", "\ufffd hello \ufffd world", "hello \ufffdff world",
    "9223372036854775810ns", "9223372036854775808ns", "-9223372036854775809ns", "9223372036854776us", "3000000h",
    "9223372036854775.808us", "9223372036854ms775us808ns",
    "300", "1.5", " 5m", "5m ", "5 m", "5M", "1y", "٣s",
]  # fmt: skip


@pytest.mark.parametrize("text", GO_ERRORS)
def test_gos_refusals_are_keep_alive_errors(text):
    with pytest.raises(KeepAliveError) as e:
        parse_keep_alive(text)
    assert "keep_alive" in str(e.value) and '"5m"' in str(e.value)  # names the field, shows what works


def test_bare_number_string_says_to_send_a_number():
    with pytest.raises(KeepAliveError, match="missing unit.*JSON number"):
        parse_keep_alive("300")


# Go's durationTests: Duration.String.
GO_STRING = [
    ("0s", 0), ("1ns", 1), ("1.1µs", 1100), ("2.2ms", 2200 * US), ("3.3s", 3300 * MS), ("4m5s", 4 * MIN + 5 * S),
    ("4m5.001s", 4 * MIN + 5001 * MS), ("5h6m7.001s", 5 * H + 6 * MIN + 7001 * MS), ("8m0.000000001s", 8 * MIN + 1),
    ("2562047h47m16.854775807s", 2**63 - 1), ("-2562047h47m16.854775808s", -(2**63)),
]  # fmt: skip


@pytest.mark.parametrize("text, ns", GO_STRING)
def test_gos_duration_string_table(text, ns):
    assert go_duration_string(ns) == text
    if ns > 0:
        assert go_duration_string(-ns) == "-" + text


def test_format_examples():
    assert format_keep_alive(FOREVER) == "forever"
    assert format_keep_alive(300) == "5m0s"
    assert format_keep_alive(5400.0) == "1h30m0s"
    assert format_keep_alive(0.3) == "300ms"
    assert format_keep_alive(0) == "0s"
    assert format_keep_alive(1e-9) == "1ns"
    assert format_keep_alive(245.001) == "4m5.001s"
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="seconds >= 0"):
            format_keep_alive(bad)


def test_numbers():
    assert parse_keep_alive(0.0) == 0.0
    assert parse_keep_alive(-0.0) == 0.0
    assert parse_keep_alive(1e-10) == 0.0  # Ollama truncates to whole nanoseconds
    assert parse_keep_alive(MAX_KEEP_ALIVE_S) == MAX_KEEP_ALIVE_S
    assert parse_keep_alive(MAX_KEEP_ALIVE_S + 1) is FOREVER  # longer than a year: forever
    assert parse_keep_alive(99999999) is FOREVER
    assert parse_keep_alive(10**400) is FOREVER  # no float overflow on the way
    assert parse_keep_alive(-(10**400)) is FOREVER
    assert parse_keep_alive("8760h") == MAX_KEEP_ALIVE_S
    assert parse_keep_alive("8761h") is FOREVER
    assert parse_keep_alive("2562047h") is FOREVER  # Go's longest, still a duration to Ollama
    assert parse_keep_alive("-0s") == 0.0


@pytest.mark.parametrize("value, says", [
    (True, "boolean"), (False, "boolean"), (None, "null"), ([], "array"), ({}, "object"),
    (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"),
])  # fmt: skip
def test_non_numbers_refused(value, says):
    with pytest.raises(KeepAliveError, match=says):
        parse_keep_alive(value, where="options.keep_alive")


def test_long_strings_refused_before_parsing():
    parse_keep_alive("0." + "0" * (MAX_DURATION_CHARS - 4) + "s")  # at the limit: fine
    with pytest.raises(KeepAliveError, match=f"{MAX_DURATION_CHARS + 1} characters"):
        parse_keep_alive("1" * MAX_DURATION_CHARS + "s")
    with pytest.raises(KeepAliveError, match="characters") as e:
        parse_keep_alive("9" * 10**6)
    assert len(str(e.value)) < 400  # the message does not quote what it refused


# --- properties ------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(json_values)
def test_any_json_value_is_seconds_forever_or_keep_alive_error(value):
    try:
        seconds = parse_keep_alive(value)
    except KeepAliveError as e:
        assert "keep_alive" in str(e)
        return
    assert seconds is FOREVER or (isinstance(seconds, float) and 0 <= seconds <= MAX_KEEP_ALIVE_S)


# Go's grammar, to check the hand-written scanner against: [-+]? then "0" alone, or parts of
# digits with an optional fraction and a unit.
_GO_GRAMMAR = re.compile(r"[-+]?(?:0|(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h))+)")
_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?(ns|us|µs|μs|ms|s|m|h)")
_UNIT = {"ns": NS, "us": US, "µs": US, "μs": US, "ms": MS, "s": S, "m": MIN, "h": H}

duration_ish = st.text(alphabet="0123456789..+-nsuµμmhd ٣²", max_size=24)  # ٣ ²: digits to str.isdigit, not to Go
duration_parts = st.lists(
    st.tuples(st.integers(0, 10**6), st.none() | st.text("0123456789", min_size=1, max_size=12), st.sampled_from(sorted(_UNIT))),
    min_size=1,
    max_size=4,
).map(lambda parts: "".join(f"{w}{'' if f is None else '.' + f}{u}" for w, f, u in parts)).filter(
    lambda text: len(text) < MAX_DURATION_CHARS  # a "-" before it still fits; longer is refused unread (tested above)
)


def _exact_ns(text: str) -> Fraction:
    sign = -1 if text.startswith("-") else 1
    total = Fraction(0)
    for whole, frac, unit in _PART.findall(text.lstrip("+-")):
        total += (int(whole or "0") + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)) * _UNIT[unit]
    return sign * total


@given(duration_ish | duration_parts | st.builds("-{}".format, duration_parts))
def test_scanner_agrees_with_gos_grammar(text):
    try:
        ns = parse_go_duration(text)
    except KeepAliveError as e:
        if len(text) > MAX_DURATION_CHARS:  # refused for its length before it is scanned
            assert "characters" in str(e)
        elif _GO_GRAMMAR.fullmatch(text):
            assert "longest duration" in str(e) and abs(_exact_ns(text)) >= 2**63 - 5
        return
    assert _GO_GRAMMAR.fullmatch(text), f"{text!r} parsed to {ns} but is no Go duration"
    # Go adds each part's fraction through a float64, truncated: at most a nanosecond a part.
    assert abs(ns - _exact_ns(text)) <= len(_PART.findall(text))


@given(st.integers(0, MAX_KEEP_ALIVE_S * S))
def test_format_then_parse_gives_the_seconds_back(ns):
    seconds = ns / S
    assert parse_keep_alive(format_keep_alive(seconds)) == seconds
    assert parse_go_duration(go_duration_string(ns)) == ns


@given(st.integers(-(2**63), 2**63 - 1))
def test_go_string_round_trips_every_go_duration(ns):
    assert parse_go_duration(go_duration_string(ns)) == ns


@given(st.floats(0, MAX_KEEP_ALIVE_S))
def test_format_is_within_a_nanosecond(seconds):
    back = parse_keep_alive(format_keep_alive(seconds))
    assert abs(back - seconds) <= 0.5e-9 + math.ulp(seconds)
    assert parse_keep_alive(format_keep_alive(back)) == back  # and stable from then on


@given(duration_parts)
def test_parsed_strings_format_and_parse_back(text):
    try:
        seconds = parse_keep_alive(text)
    except KeepAliveError as e:  # past Go's longest duration (the parts may add up past it): Go refuses it too
        assert "longest duration" in str(e) and _exact_ns(text) >= 2**63 - 5
        return
    if seconds is FOREVER:
        assert format_keep_alive(seconds) == "forever" and parse_go_duration(text) > MAX_KEEP_ALIVE_S * S
        return
    assert parse_keep_alive(format_keep_alive(seconds)) == seconds
