"""Ollama's ``keep_alive``: how long a model stays loaded after a request, parsed as Ollama parses it.

Ollama's ``api.Duration.UnmarshalJSON`` (api/types.go) takes a JSON number of
seconds (a fraction allowed) or a Go duration string (``time.ParseDuration``:
"5m", "1h30m", "300ms", "1.5h"); anything negative, number or string, means
forever, and 0 means unload as soon as the request ends. A string is always a
Go duration: a bare "300" has no unit and Ollama answers 400 (only its
OLLAMA_KEEP_ALIVE environment variable falls back to whole seconds), as here.

This turns either form into seconds (a float) or FOREVER, and seconds back into
Go's form for logs and status. It ignores what a missing or null keep_alive
defaults to (the caller's), and what expires when (``cluster/sharing.py``).
Plain values: no clock, no MLX, no I/O.
"""

from __future__ import annotations

import math
from fractions import Fraction

FOREVER = None  # what parse_keep_alive returns for "never unload"
# How long a model loaded on demand stays once idle when nothing says otherwise: Ollama's default (5m).
DEFAULT_KEEP_ALIVE_S = 300.0

NS_PER_S = 10**9
# Go's time.Duration is int64 nanoseconds: ParseDuration refuses a longer one
# (about 292 years) and so does Ollama (400), so this refuses it too.
GO_MAX_NS = 2**63 - 1
# Longer than a year is forever: no daemon idles that long between restarts, and
# clients that write "8760h" or 99999999 mean "keep it". Ollama keeps such values
# as they are, but clamping gives them one meaning here and keeps every expiry
# time a monotonic-clock float can hold to the microsecond (a year is 3.2e7 s).
MAX_KEEP_ALIVE_S = 365 * 24 * 3600
# A client sends the string: it is bounded before it is scanned. Go's longest
# duration prints in 24 characters ("2562047h47m16.854775807s"); 64 leaves room
# for long fractions and many parts ("1h2m3s4ms5us6ns") and no more.
MAX_DURATION_CHARS = 64
# How much of a refused value an error message quotes.
_QUOTE_CHARS = 40

# time.ParseDuration's units, in nanoseconds (both micro signs, as Go accepts).
_UNITS_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": NS_PER_S, "m": 60 * NS_PER_S, "h": 3600 * NS_PER_S}
_EXAMPLES = 'seconds as a JSON number (300, 0.5; 0 unloads after the request, -1 keeps it forever) or a Go duration string ("5m", "1h30m", "300ms", "-1m")'
_JSON_TYPES = {bool: "a boolean", list: "an array", dict: "an object", type(None): "null"}


class KeepAliveError(ValueError):
    """A keep_alive that is neither seconds nor a duration; the message says what and what works."""


def parse_keep_alive(v: object, where: str = "keep_alive") -> float | None:
    """Seconds to stay loaded after the request (0: unload at once), or None (FOREVER).

    ``v`` is a JSON value: an int or float is seconds (negative: forever; NaN and
    infinities refused; a bool is not a number), a str a Go duration (bounded to
    MAX_DURATION_CHARS first). Anything past MAX_KEEP_ALIVE_S is forever. Null is
    refused: Ollama reads a null keep_alive as absent (the server's default),
    which the caller decides before calling this. Every flaw is a KeepAliveError
    naming ``where``.
    """
    if isinstance(v, str):
        return _clamp(parse_go_duration(v, where))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        kind = _JSON_TYPES.get(type(v), type(v).__name__)
        hint = " (leave it out for the default)" if v is None else ""
        raise KeepAliveError(f"{where} is {kind}{hint}: it takes {_EXAMPLES}")
    if isinstance(v, float) and not math.isfinite(v):
        raise KeepAliveError(f"{where} is {v}, not a number of seconds: it takes {_EXAMPLES}")
    if v < 0:
        return FOREVER
    if v > MAX_KEEP_ALIVE_S:  # before converting: an int may be too large for a float
        return FOREVER
    # Ollama: time.Duration(t * float64(time.Second)), truncated to whole nanoseconds.
    return _clamp(v * NS_PER_S if isinstance(v, int) else int(v * NS_PER_S))


def format_keep_alive(seconds: float | None) -> str:
    """Go's form of a keep_alive ("5m0s", "1h30m0s", "300ms", "0s"), or "forever", for logs and status.

    Rounded to whole nanoseconds, so parse_keep_alive(format_keep_alive(s)) gives s back for
    every s that parse_keep_alive returns.
    """
    if seconds is FOREVER:
        return "forever"
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"format_keep_alive takes seconds >= 0 or None (forever), got {seconds!r}")
    return go_duration_string(round(Fraction(seconds) * NS_PER_S))


def parse_go_duration(s: str, where: str = "duration") -> int:
    """Go's time.ParseDuration (go/src/time/format.go), step by step, in nanoseconds: a possibly
    signed sequence of decimal numbers, each with an optional fraction and a unit ("-1.5h",
    "2h45m", "300ms"); a lone "0" needs no unit. A KeepAliveError names ``where`` and the flaw.

    One pass, left to right, over at most MAX_DURATION_CHARS characters: no regular expression,
    no backtracking. Go's overflow rules are kept (each part, and the sum, within 2**63 ns).
    """
    if len(s) > MAX_DURATION_CHARS:
        raise KeepAliveError(f"{where} is a string of {len(s)} characters, more than any duration needs ({MAX_DURATION_CHARS}): it takes {_EXAMPLES}")

    def bad(why: str) -> KeepAliveError:
        return KeepAliveError(f"{where} {_quote(s)} is not a duration ({why}): it takes {_EXAMPLES}")

    rest, neg = s, False
    if rest[:1] in ("-", "+"):
        neg, rest = rest[0] == "-", rest[1:]
    if rest == "0":  # Go's special case: a lone 0 needs no unit
        return 0
    if not rest:
        raise bad("nothing after the sign" if s else "empty")
    total, i, n = 0, 0, len(rest)
    while i < n:
        if not (rest[i] == "." or _digit(rest[i])):
            raise bad(f"a number must come where {_quote(rest[i:])} is")
        start = i
        while i < n and _digit(rest[i]):
            i += 1
        whole = int(rest[start:i] or "0")  # at most MAX_DURATION_CHARS digits
        pre = i > start
        frac, scale, post = 0, 1.0, False
        if i < n and rest[i] == ".":
            i += 1
            fstart, overflow = i, False
            while i < n and _digit(rest[i]):
                # Go's leadingFraction: digits count while they fit in 63 bits, the rest are ignored.
                if not overflow:
                    longer = frac * 10 + ord(rest[i]) - ord("0")
                    if frac > (2**63 - 1) // 10 or longer > 2**63:
                        overflow = True
                    else:
                        frac, scale = longer, scale * 10
                i += 1
            post = i > fstart
        if not pre and not post:
            raise bad("a '.' with no digits")
        ustart = i
        while i < n and rest[i] != "." and not _digit(rest[i]):
            i += 1
        unit = rest[ustart:i]
        if not unit:
            raise bad('missing unit: a string needs one ("300s", "5m"); a bare number of seconds goes as a JSON number, 300')
        if unit not in _UNITS_NS:
            raise bad(f"unknown unit {_quote(unit)}; units are ns, us, ms, s, m, h")
        u = _UNITS_NS[unit]
        if whole > 2**63 // u:
            raise bad("longer than Go's longest duration, about 292 years")
        part = whole * u
        if frac:
            # Go adds the fraction through a float64, truncated: the same arithmetic here.
            part += int(float(frac) * (float(u) / scale))
        total += part
        if part > 2**63 or total > 2**63:
            raise bad("longer than Go's longest duration, about 292 years")
    if not neg and total > GO_MAX_NS:
        raise bad("longer than Go's longest duration, about 292 years")
    return -total if neg else total


def go_duration_string(ns: int) -> str:
    """Go's time.Duration.String: "1h2m3.5s", "4m0s", "1.5ms", "12µs", "0s", "-1m0s"."""
    if ns < 0:
        return "-" + go_duration_string(-ns)
    if ns == 0:
        return "0s"
    if ns < NS_PER_S:  # under a second: the largest unit below it that keeps a whole number
        for unit, size, digits in (("ms", 10**6, 6), ("µs", 10**3, 3), ("ns", 1, 0)):
            if ns >= size:
                return f"{ns // size}{_fraction(ns % size, digits)}{unit}"
    whole_s, frac = divmod(ns, NS_PER_S)
    out = f"{whole_s % 60}{_fraction(frac, 9)}s"
    minutes = whole_s // 60
    if minutes:
        out = f"{minutes % 60}m{out}"
        if minutes // 60:
            out = f"{minutes // 60}h{out}"
    return out


def _fraction(value: int, digits: int) -> str:
    """Go's fmtFrac: ".ddd" with trailing zeros dropped, or "" when value is 0."""
    if not value:
        return ""
    return "." + str(value).rjust(digits, "0").rstrip("0")


def _clamp(ns: int) -> float | None:
    if ns < 0 or ns > MAX_KEEP_ALIVE_S * NS_PER_S:
        return FOREVER
    return ns / NS_PER_S  # int / int: the nearest float


def _quote(s: str) -> str:
    return repr(s) if len(s) <= _QUOTE_CHARS else repr(s[:_QUOTE_CHARS]) + "..."


def _digit(c: str) -> bool:
    return "0" <= c <= "9"  # ASCII only: str.isdigit takes other scripts' digits too
