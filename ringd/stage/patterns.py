"""Which regular expressions a grammar's lexer can follow to the end of an answer.

llguidance's lexer builds the states of a schema's ``pattern`` lazily, as the answer
reaches them, out of a fixed budget of expressions. Bounded repetitions nested in one
another (``^([a-z]{1,20}){1,50}$``) make as many states as the product of their
bounds, and ambiguous ones far more: compiling such a pattern succeeds, and the lexer
runs out mid-answer ("too many expressions constructed", measured: after 137 tokens),
a failure the request could not have been told about. So a pattern is read here at
request time, before any token, and one whose nested bounds multiply past
MAX_NESTED_REPEATS is refused by name.

Measured with llguidance 1.9 on SmolLM2's tokenizer, driving each pattern through 600
letters: nested products of 400, 500 and 600 are followed to the end; 1,000 is not
(``{1,20}`` in ``{1,50}``, and ``{0,20}`` in ``{0,50}``). A single repetition, however
long (``[a-z]{1,100000}``), and unbounded ones (``([a-z]{1,100})+``) cost no such thing.

Patterns are JSON Schema's (ECMA-262); Python's own parser reads them here (its dialect
is close: what it cannot read is left to llguidance, which refuses what it cannot compile).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

try:  # Python 3.11+: the parser behind ``re``, whose tree says how repetitions nest
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - older interpreters
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# The product of nested repetitions' upper bounds a pattern may hold (see above: 600 passed, 1,000 failed).
MAX_NESTED_REPEATS = 500
# Patterns longer than this are not analysed (nor, at 32 KiB a grammar, could many of them fit).
MAX_PATTERN_CHARS = 4096
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, *([_sre.POSSESSIVE_REPEAT] if hasattr(_sre, "POSSESSIVE_REPEAT") else [])}


def nested_repeats(pattern: str) -> int:
    """The largest product of upper bounds along a chain of two or more nested bounded
    repetitions in ``pattern`` (1 when it has no such chain, or cannot be read here)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return 1
    try:
        tree = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return 1
    worst = 1

    def chain(p) -> int:
        """The largest product of bounded repetitions nested along one path inside ``p``."""
        nonlocal worst
        best = 1
        for op, av in p:
            inner = 1
            if op in _REPEATS:
                lo, hi, sub = av
                inside = chain(sub)
                if hi == _sre.MAXREPEAT or hi <= 1:
                    inner = inside  # unbounded (derivatives fold it) or at most once: no product
                else:
                    inner = hi * inside
                    if inside > 1:
                        worst = max(worst, inner)
            elif op == _sre.SUBPATTERN:
                inner = chain(av[-1])
            elif op == _sre.BRANCH:
                inner = max((chain(b) for b in av[1]), default=1)
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                inner = chain(av[1])
            elif op == getattr(_sre, "ATOMIC_GROUP", None):
                inner = chain(av)
            best = max(best, inner)
        return best

    try:
        chain(tree)
    except RecursionError:  # a pattern nested thousands deep: the grammar's own limits refuse it
        return 1
    return worst


def schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """(path, pattern) of each regular expression in a JSON schema: ``pattern`` values and
    ``patternProperties`` keys, wherever they nest. Iterative; the caller bounds the schema's size."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "pattern" and isinstance(v, str):
                    yield f"{path}.pattern", v
                elif k == "patternProperties" and isinstance(v, dict):
                    yield from ((f"{path}.patternProperties", key) for key in v)
                stack.append((f"{path}.{k}", v))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))


def too_costly(schema: Any) -> str | None:
    """Why a pattern in ``schema`` cannot be followed to the end of an answer (None: none is so)."""
    for path, pattern in schema_patterns(schema):
        product = nested_repeats(pattern)
        if product > MAX_NESTED_REPEATS:
            shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
            return (
                f"{path.lstrip('.')} {shown!r} nests bounded repetitions whose bounds multiply to {product}, "
                f"over the {MAX_NESTED_REPEATS} the grammar's lexer can follow: bound the outer repetition "
                "less (or leave it unbounded, e.g. + or *), or check the length with maxLength instead"
            )
    return None
