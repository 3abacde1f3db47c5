"""The engine's per-request text (``engine._Text``): detokenized, stop strings held back, the one that matched named.

The ring itself is exercised end to end elsewhere (test_ring, test_failover);
here only what a stop string does to the text, with a detokenizer that spells
each token as given, so a stop can straddle tokens.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ringd.engine import _Text

EOS = 0


class Spelling:
    """mlx-lm's detokenizer interface over a fixed spelling of each token id."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.pieces[token]

    def finalize(self) -> None:
        self.last_segment = ""


def run(pieces: list[str], stop: list[str], max_tokens: int = 100) -> tuple[str, str | None, str | None]:
    """The text emitted, the finish reason, and the stop string named."""
    text = _Text(Spelling(dict(enumerate(pieces, start=1))), stop, {EOS}, max_tokens)
    out, finish = [], None
    for token in [*range(1, len(pieces) + 1), EOS]:
        piece, finish = text.next(token)
        out.append(piece)
        if finish is not None:
            break
    return "".join(out), finish, text.matched


def test_the_stop_that_ends_the_text_is_named_even_across_tokens():
    assert run(["The cap", "ital is Pa", "ris. More"], ["Paris", "Rome"]) == ("The capital is ", "stop", "Paris")
    assert run(["a", "b", "c"], ["x"]) == ("abc", "stop", None)  # ended by its end token: no stop named
    assert run(["ab", "cd"], ["cd"], max_tokens=2) == ("ab", "stop", "cd")
    assert run(["xbab"], ["ab", "bab"]) == ("x", "stop", "bab")  # two end at once: the longest, as the matcher strips it


@given(
    words=st.lists(st.sampled_from(["a", "b", "ab", "ba", "END", "E", "ND", " "]), max_size=12),
    stops=st.lists(st.sampled_from(["END", "ab", "bab", "DE"]), min_size=1, max_size=3, unique=True),
)
def test_the_text_stops_at_the_first_stop_and_names_one_that_ends_there(words, stops):
    whole = "".join(words)
    text, finish, matched = run(words, stops)
    ends = [(whole.find(s) + len(s), s) for s in stops if s in whole]
    if not ends:
        assert (text, finish, matched) == (whole, "stop", None)
        return
    end = min(e for e, _ in ends)
    assert finish == "stop" and matched is not None and whole[:end].endswith(matched)
    assert text == whole[: end - len(matched)]
