"""ringd.steps: the ring's per-request messages round-trip, fit a frame, and refuse what no leader or stage sends.

Random messages built from the dataclasses go through a real frame encoding and
decoding (``wire.frames``) and come back equal; the fuzzing of every parser with
random and mutated documents is in test_messages.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.steps import MAX_ROWS, MAX_STEP_TOKENS, Failure, Forward, KvOptions, Open, Row, Sampled, Tokens, parse_release, release
from wire.frames import MAX_DESCRIPTOR_BYTES, Frame, FrameDecoder, FrameError, MsgType, encode_frame

VOCAB = 50_000
ids = st.integers(0, 2**64 - 1)
opens = st.builds(
    Open,
    st.just({"temperature": 0.7, "seed": 3}),
    st.none()
    | st.builds(KvOptions, st.none() | st.integers(1, 4096), st.none() | st.sampled_from([4, 8]), st.sampled_from([32, 64]), st.integers(0, 99)),
    st.none(),
    st.none() | st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True),
)


@st.composite
def rows(draw, rid):
    sample = draw(st.booleans())
    tokens = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
    silent = sample and draw(st.booleans())
    verify = sample and not silent and len(tokens) > 1 and draw(st.booleans())
    return Row(rid, draw(st.integers(0, 2**31)), tokens, sample, silent, draw(st.none() | opens), verify)


@st.composite
def forwards(draw):
    rids = draw(st.lists(ids, max_size=12, unique=True))
    failed = draw(st.lists(st.tuples(ids, st.text(max_size=60)), max_size=3, unique_by=lambda p: p[0]))
    failed = tuple((rid, why) for rid, why in failed if rid not in rids)
    return Forward(draw(ids), draw(st.integers(1, 2**40)), tuple(draw(rows(rid)) for rid in rids), failed)


tops = st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(-1e4, 0)), max_size=20).map(tuple)
sampled = st.builds(Sampled, ids, st.integers(0, 2**31), st.integers(0, VOCAB - 1), st.floats(-1e4, 0), tops, st.integers(0, 8))


def through_the_wire(frame: Frame) -> Frame:
    [back] = FrameDecoder().feed(b"".join(bytes(b) for b in encode_frame(frame)))
    return back


@given(forwards())
def test_forwards_round_trip(fwd):
    back = Forward.parse(through_the_wire(fwd.frame()), VOCAB)
    assert back == fwd
    assert back.positions == sum(len(r.tokens) for r in fwd.rows)


@given(ids, st.integers(1, 2**40), st.lists(sampled, max_size=12).map(tuple), st.lists(st.tuples(ids, st.text(max_size=60)), max_size=3).map(tuple))
def test_tokens_round_trip(batch, term, rows_, failed):
    assert Tokens.parse(through_the_wire(Tokens(batch, term, rows_, failed).frame())) == Tokens(batch, term, rows_, failed)


@given(ids, st.none() | st.integers(1, 2**40), st.text(max_size=64), st.text(max_size=400), st.sampled_from([500, 503]))
def test_failures_round_trip(batch, term, node, message, status):
    f = Failure(batch, term, node, message, status)
    assert Failure.parse(through_the_wire(f.frame())) == f


@pytest.mark.parametrize("action", ["release", "keep", "evict"])
def test_releases_round_trip(action):
    frame = through_the_wire(release(9, 4, action))
    assert frame.request_id == 9 and parse_release(frame.descriptor) == (4, action)


def test_the_largest_micro_batch_a_leader_builds_fits_a_frame():
    """MAX_ROWS decode rows, each opening its request, and a prompt chunk of MAX_STEP_TOKENS
    of the largest ids: within the descriptor limit the wire enforces."""
    opened = Open(
        {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 2**62, "logit_bias": {str(i): -100.0 for i in range(20)}},
        KvOptions(4096, 8, 64, 0),
        None,
        "x" * 64,
    )
    decode = Forward(2**64 - 1, 2**40, tuple(Row(2**64 - 1 - i, 2**31, (VOCAB - 1,), True, False, opened) for i in range(MAX_ROWS)))
    prefill = Forward(1, 1, (Row(1, 0, (VOCAB - 1,) * MAX_STEP_TOKENS, False, False, opened),))
    for fwd in (decode, prefill):
        encode_frame(fwd.frame())  # raises past MAX_DESCRIPTOR_BYTES
        assert len(str(fwd.frame().descriptor)) < MAX_DESCRIPTOR_BYTES


def frame(d: dict) -> Frame:
    return Frame(MsgType.FORWARD, 1, d)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([[1, 0, [1], 0], [1, 1, [2], 1]], "two rows of one request"),
        ([[1, 0, [VOCAB], 1]], "ids in"),
        ([[1, 0, [], 1]], "1 to"),
        ([[1, 0, [1], 2]], "flags"),
        ([[1, 0, [1, 2], 4]], "flags"),
        ([[1, 0, [1, 2], 7]], "flags"),
        ([[1, 0, [1], 5]], "carries none"),
        ([[1, -1, [1], 1]], "offset"),
        ([[2**64, 0, [1], 1]], "request id"),
        ([[1, 0, [1], 1, {"params": {}, "reuse": [3, 5]}]], "reuse"),
        ([[1, 0, [1], 1, {"params": {}, "request_id": "a b"}]], "request_id"),
        ([[1, 0, [1] * 5000, 0], [2, 0, [1] * 5000, 0]], "in all"),
        ([[i, 0, [1], 1] for i in range(MAX_ROWS + 1)], "at most"),
    ],
)
def test_forwards_no_leader_sends_are_refused_by_name(rows, match):
    with pytest.raises(FrameError, match=match):
        Forward.parse(frame({"term": 1, "rows": rows}), VOCAB)


def test_a_row_both_sent_and_failed_is_refused():
    with pytest.raises(FrameError, match="both"):
        Forward.parse(frame({"term": 1, "rows": [[1, 0, [1], 1]], "failed": [[1, "x"]]}), VOCAB)


def test_a_failed_rows_reason_is_cut_to_its_limit():
    fwd = Forward.parse(frame({"term": 1, "rows": [], "failed": [[1, "x" * 10_000]]}), VOCAB)
    assert len(fwd.failed[0][1]) == 500
