"""Patterns the grammar's lexer cannot follow are refused before any token (issue 28, item 5).

The bound is llguidance's, measured here on the real lexer: a pattern over MAX_NESTED_REPEATS
runs the lexer out of expressions mid-answer, and the largest shapes under it are followed to
the end. The reading of patterns (``nested_repeats``) is checked on its own with Hypothesis.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llguidance import LLMatcher

from ringd.stage import grammar
from ringd.stage.patterns import MAX_NESTED_REPEATS, nested_repeats, schema_patterns, too_costly

from test_grammar import model, tokenizer, vocab_size  # noqa: F401  (fixtures)

# The issue's pattern: 20 x 50 = 1,000.
HOSTILE = "^([a-z]{1,20}){1,50}$"


def schema(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}


def lexer_error_after(pattern: str, tokenizer, vocab_size: int, letters: int = 600) -> str | None:
    """Drive ``pattern``'s grammar through a string of ``letters`` letters; llguidance's error, if any."""
    g = grammar.from_json_schema(schema(pattern), "response_format")
    grammar.check(g, tokenizer, vocab_size, "response_format")  # it compiles: the failure would come later
    ll = grammar.ll_tokenizer(tokenizer, vocab_size)
    m = LLMatcher(ll, g, log_level=0, limits=grammar._LIMITS)
    for t in tokenizer.encode('{"a": "' + "abcdefghij" * (letters // 10), add_special_tokens=False):
        if not m.consume_token(t) or m.is_error():
            return m.get_error()
    return None


def test_the_refused_pattern_runs_the_lexer_out_mid_answer_and_the_largest_allowed_do_not(tokenizer, vocab_size):  # noqa: F811
    assert nested_repeats(HOSTILE) == 1000 > MAX_NESTED_REPEATS
    assert "too many expressions" in (lexer_error_after(HOSTILE, tokenizer, vocab_size) or "")
    for allowed in ("^([a-z]{1,25}){1,20}$", "^(([a-z]{1,5}){1,5}){1,20}$", "^([a-z]{1,10}){1,50}$"):
        assert nested_repeats(allowed) <= MAX_NESTED_REPEATS, allowed
        error = lexer_error_after(allowed, tokenizer, vocab_size)
        # Followed to its end: the letters past what it accepts are refused as letters, not by the lexer.
        assert error is None or "too many expressions" not in error, (allowed, error)


@pytest.mark.parametrize(
    "pattern, product",
    [
        (HOSTILE, 1000),
        ("^([a-z]{0,20}){0,50}$", 1000),
        ("^[a-z]{1,100000}$", 1),  # one repetition, however long: no product
        ("^([a-z]{1,100})+$", 1),  # unbounded outside: derivatives fold it
        ("^(([a-z]{1,5}){1,5}){1,20}$", 500),
        ("^(?:\\d{3}-){2}\\d{4}$", 6),  # a phone number: nested, and small
        ("^(a|(b{1,30}){1,40})$", 1200),  # inside a branch too
        ("^(?=(a{1,30}){1,40})a$", 1200),  # and inside a lookahead
        ("(unclosed", 1),  # unreadable here: llguidance says what it makes of it
    ],
)
def test_nested_repeats_multiplies_the_bounds_along_a_nesting(pattern, product):
    assert nested_repeats(pattern) == product


@given(st.integers(2, 60), st.integers(2, 60), st.integers(0, 3))
def test_the_product_of_two_nested_bounds(inner, outer, extra_groups):
    pattern = "(" * extra_groups + f"([a-z]{{1,{inner}}}){{1,{outer}}}" + ")" * extra_groups
    assert nested_repeats(pattern) == inner * outer


def test_patterns_are_found_wherever_a_schema_holds_them():
    s = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "x"}, "b": {"type": "array", "items": {"pattern": "y"}}},
        "patternProperties": {"^z+$": {"type": "string"}},
        "anyOf": [{"properties": {"pattern": {"type": "string"}}}],  # a property called "pattern" is not one
    }
    assert sorted(p for _, p in schema_patterns(s)) == ["^z+$", "x", "y"]
    assert too_costly(s) is None
    why = too_costly({"type": "object", "properties": {"c": {"items": {"pattern": HOSTILE}}}})
    assert why is not None and why.startswith("properties.c.items.pattern") and "1000" in why and str(MAX_NESTED_REPEATS) in why
