"""ringd.steps: the ring's per-request messages round-trip, fit a frame, and refuse what no leader or stage sends.

Random messages built from the dataclasses go through a real frame encoding and
decoding (``wire.frames``) and come back equal. FORWARD and TOKEN descriptors are
binary: random and mutated bytes are fuzzed here; the JSON messages (ERROR, RELEASE
and the daemon's own) are fuzzed in tests/cluster/test_messages.py.
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.ring.steps import (
    _FAILED, _FORWARD, _ROW, _SAMPLED, _TOKENS, MAX_EMBEDDING_WIDTH, MAX_ROWS, MAX_STEP_TOKENS, Embedded, Failure, Forward, KvOptions, Open, Row, Sampled,
    Tokens, parse_release, release, term_of,
)  # fmt: skip
from wire.frames import MAX_DESCRIPTOR_BYTES, Frame, FrameDecoder, FrameError, MsgType, encode_frame
from wire.tensors import DTYPE_CODES, tensor_to_buffer

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


@given(forwards())
def test_a_forward_handed_over_in_process_is_what_its_bytes_would_parse_to(fwd):
    """The leader's FORWARD to its own stage 0 skips the parse: the stage gets the same micro-batch,
    so it computes and passes on the same rows, and the frame's bytes are a link's."""
    handed = fwd.handed()
    assert b"".join(bytes(b) for b in encode_frame(handed)) == b"".join(bytes(b) for b in encode_frame(fwd.frame()))
    assert Forward.parse(handed, VOCAB) is fwd and Forward.parse(through_the_wire(handed), VOCAB) == fwd
    assert term_of(handed) == fwd.term


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


def test_hidden_states_round_trip_and_must_fit_the_rows():
    rows = (Row(1, 4, (5, 6, 7), False), Row(2, 9, (8,), True))
    h = mx.random.normal((1, 4, 16)).astype(mx.bfloat16)
    back = Forward.parse(through_the_wire(Forward(3, 2, rows).frame(h, tensor_to_buffer(h))), VOCAB)
    assert back.dtype_code == DTYPE_CODES[mx.bfloat16] and back.hidden_size == 16
    assert mx.array_equal(back.hidden(through_the_wire(Forward(3, 2, rows).frame(h, tensor_to_buffer(h))).payload), h)
    short = Forward(3, 2, rows[:1]).frame(h, tensor_to_buffer(h))  # 3 positions, 4 sent
    with pytest.raises(FrameError, match=r"hidden states \[1, 3, 16\] \(96 bytes\).*not 128 bytes"):
        Forward.parse(short, VOCAB)


def test_term_of_reads_every_ring_message():
    assert term_of(Forward(1, 77, ()).frame()) == 77
    assert term_of(Tokens(1, 78, ()).frame()) == 78
    assert term_of(Failure(1, 79, "n", "m").frame()) == 79
    assert term_of(release(1, 80)) == 80
    assert term_of(Frame(MsgType.FORWARD, 1, b"\x01")) is None


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
        assert len(fwd.frame().descriptor) < MAX_DESCRIPTOR_BYTES


def forward(rows: list, failed: list = (), term: int = 1, code: int = 0, size: int = 0, tail: bytes = b"") -> Frame:
    """A FORWARD frame written byte by byte: rows as (rid, offset, tokens, flags, open: dict | bytes | None)."""
    out = [_FORWARD.pack(term, len(rows), len(failed), code, size)]
    for rid, offset, tokens, flags, opened in rows:
        opened = json.dumps(opened).encode() if isinstance(opened, dict) else opened or b""
        out += [_ROW.pack(rid, offset, len(tokens), flags, len(opened)), struct.pack(f"<{len(tokens)}I", *tokens), opened]
    for rid, why in failed:
        out += [_FAILED.pack(rid, len(why)), why]
    return Frame(MsgType.FORWARD, 1, b"".join(out) + tail)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([(1, 0, [1], 0, None), (1, 1, [2], 1, None)], "two rows of one request"),
        ([(1, 0, [VOCAB], 1, None)], "ids in"),
        ([(1, 0, [], 1, None)], "1 to"),
        ([(1, 0, [1], 2, None)], "flags"),
        ([(1, 0, [1, 2], 4, None)], "flags"),
        ([(1, 0, [1, 2], 7, None)], "flags"),
        ([(1, 0, [1], 5, None)], "carries none"),
        ([(1, 0, [1], 1, {"params": {}, "reuse": [3, 5]})], "reuse"),
        ([(1, 0, [1], 1, {"params": {}, "request_id": "a b"})], "request_id"),
        ([(1, 0, [1], 1, b"{not json")], "not JSON"),
        ([(1, 0, [1], 1, b"\xff\xfe")], "not JSON"),
        ([(1, 0, [1] * 5000, 0, None), (2, 0, [1] * 5000, 0, None)], "in all"),
        ([(i, 0, [1], 1, None) for i in range(MAX_ROWS + 1)], "more than"),
    ],
)
def test_forwards_no_leader_sends_are_refused_by_name(rows, match):
    with pytest.raises(FrameError, match=match):
        Forward.parse(forward(rows), VOCAB)


def test_a_row_both_sent_and_failed_is_refused():
    with pytest.raises(FrameError, match="both"):
        Forward.parse(forward([(1, 0, [1], 1, None)], [(1, b"x")]), VOCAB)


def test_a_failed_rows_reason_is_cut_to_its_limit_and_must_be_utf8():
    fwd = Forward.parse(forward([], [(1, b"x" * 10_000)]), VOCAB)
    assert len(fwd.failed[0][1]) == 500
    with pytest.raises(FrameError, match="UTF-8"):
        Forward.parse(forward([], [(1, b"\xff")]), VOCAB)


@pytest.mark.parametrize(
    "frame, match",
    [
        (forward([(1, 0, [1], 1, None)], tail=b"\x00"), "past its end"),
        (Frame(MsgType.FORWARD, 1, forward([(1, 0, [1, 2, 3], 1, None)]).descriptor[:-4]), "runs past"),
        (Frame(MsgType.FORWARD, 1, b"\x01\x00"), "ends early"),
        (Frame(MsgType.FORWARD, 1, forward([]).descriptor, b"\x00" * 8), "declares no hidden states"),
        (forward([(1, 0, [1], 1, None)], code=99, size=4), "dtype code 99"),
        (Frame(MsgType.FORWARD, 1, {"term": 1, "rows": []}), "binary"),
    ],
)
def test_forwards_of_the_wrong_shape_are_refused(frame, match):
    with pytest.raises(FrameError, match=match):
        Forward.parse(frame, VOCAB)


@pytest.mark.parametrize(
    "descriptor, match",
    [
        (_TOKENS.pack(1, 1, 0, 0, 0) + _SAMPLED.pack(1, 0, 5, float("nan"), 0, 0), "finite"),
        (_TOKENS.pack(1, 1, 0, 0, 0) + _SAMPLED.pack(1, 0, 5, -1.0, 0, 21), "at most 20"),
        (_TOKENS.pack(1, 1, 0, 0, 0) + _SAMPLED.pack(1, 0, 5, -1.0, MAX_STEP_TOKENS + 1, 0), "accepted"),
        (_TOKENS.pack(1, MAX_ROWS + 1, 0, 0, 0), "more than"),
        (_TOKENS.pack(1, 1, 0, 0, 0), "ends early"),
    ],
)
def test_tokens_no_last_stage_sends_are_refused_by_name(descriptor, match):
    with pytest.raises(FrameError, match=match):
        Tokens.parse(Frame(MsgType.TOKEN, 1, descriptor))


def _mutations(data: bytes):
    return st.one_of(
        st.binary(max_size=200),
        st.integers(0, max(0, len(data) - 1)).map(lambda i: data[:i]),  # cut short
        st.tuples(st.integers(0, max(0, len(data) - 1)), st.integers(0, 255)).map(lambda p: data[: p[0]] + bytes([p[1]]) + data[p[0] + 1 :]),  # a byte changed
        st.tuples(st.integers(0, len(data)), st.binary(min_size=1, max_size=8)).map(lambda p: data[: p[0]] + p[1] + data[p[0] :]),  # bytes inserted
    )


VALID_FORWARD = Forward(3, 7, (Row(5, 0, (1, 2, 3), False, open=Open({"temperature": 0.0}, KvOptions(None, 4), None, "r-1")), Row(6, 9, (4,), True, True)), ((8, "node2: no such request"),)).frame().descriptor
VALID_TOKENS = Tokens(3, 7, (Sampled(5, 3, 17, -0.5, ((17, -0.5), (3, -1.25))), Sampled(6, 10, 2, 0.0, (), 1)), ((8, "why"),)).frame().descriptor


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_and_mutated_binary_descriptors_raise_only_frame_errors(data):
    for raw, parse in ((VALID_FORWARD, lambda d: Forward.parse(Frame(MsgType.FORWARD, 3, d), 1000)), (VALID_TOKENS, lambda d: Tokens.parse(Frame(MsgType.TOKEN, 3, d)))):
        doc = data.draw(_mutations(raw))
        try:
            parse(doc)
        except FrameError:
            pass


@given(
    ids, st.integers(1, 2**40), st.lists(sampled, max_size=4).map(tuple),
    st.integers(1, 64).flatmap(lambda width: st.lists(st.tuples(ids, st.integers(1, 2**40), st.lists(st.floats(-1e6, 1e6, width=32), min_size=width, max_size=width)), max_size=4)),
)  # fmt: skip
def test_embeddings_ride_a_tokens_frame_as_float32(batch, term, rows_, embedded):
    sent = Tokens(batch, term, rows_, (), tuple(Embedded(rid, offset, np.array(v, dtype=np.float32)) for rid, offset, v in embedded))
    back = Tokens.parse(through_the_wire(sent.frame()))
    assert (back.rows, [(e.rid, e.offset) for e in back.embedded]) == (rows_, [(rid, offset) for rid, offset, _ in embedded])
    assert all(np.array_equal(a.vector, np.array(v, dtype=np.float32)) for a, (_, _, v) in zip(back.embedded, embedded))


def test_embeddings_that_do_not_fit_their_frame_are_refused_by_name():
    frame = Tokens(1, 7, (), (), (Embedded(5, 3, np.ones(4, np.float32)),)).frame()
    with pytest.raises(FrameError, match="1 embedding\\(s\\) of 4 float32, not 12 bytes"):
        Tokens.parse(Frame(MsgType.TOKEN, 1, frame.descriptor, bytes(frame.payload)[:12]))
    with pytest.raises(FrameError, match="must be finite"):
        Tokens.parse(Frame(MsgType.TOKEN, 1, frame.descriptor, np.array([1, np.nan, 0, 0], "<f4").tobytes()))
    wide = _TOKENS.pack(7, 0, 0, 1, MAX_EMBEDDING_WIDTH + 1) + struct.pack("<QQ", 5, 3)
    with pytest.raises(FrameError, match="1 to 65536 wide"):
        Tokens.parse(Frame(MsgType.TOKEN, 1, wide))
    with pytest.raises(FrameError, match="TOKEN carries 0 rows and 65"):
        Tokens.parse(Frame(MsgType.TOKEN, 1, _TOKENS.pack(7, 0, 0, MAX_ROWS + 1, 4)))


def test_an_embeddings_open_names_a_known_pooling_and_no_cached_prefix():
    assert Open.from_wire({"params": {}, "pool": "cls"}, 0).pool == "cls"
    with pytest.raises(FrameError, match="'pool' must be one of"):
        Open.from_wire({"params": {}, "pool": "max"}, 0)
    with pytest.raises(FrameError, match="cannot start from a cached prefix"):
        Open.from_wire({"params": {}, "pool": "mean", "reuse": [9, 4]}, 4)


def test_draft_distributions_ride_after_the_hidden_states_and_must_fit_their_rows(monkeypatch):
    """A sampled request's verify row (PROBS) carries q after the hidden states: for each
    proposal the ids of its likeliest tokens, their probabilities and its tail, rebuilt whole at
    the last stage. A vocabulary within DRAFT_SUPPORT travels whole; a larger one cut."""
    from ringd.ring import steps
    from ringd.ring.steps import draft_distribution, pack_draft

    vocab = 8
    rows = (Row(1, 4, (5, 6, 7), True, verify=True, probs=True), Row(2, 9, (3,), True), Row(3, 2, (1, 2), True, verify=True, probs=True))
    h = mx.random.normal((1, 6, 16)).astype(mx.bfloat16)
    q = np.random.default_rng(0).dirichlet(np.ones(vocab), size=3).astype("<f4")  # 2 proposals of row 1, 1 of row 3
    ids, tails = np.tile(np.arange(vocab), (3, 1)), np.zeros(3)
    one, three = pack_draft(ids[:2], q[:2], tails[:2]), pack_draft(ids[2:], q[2:], tails[2:])
    fwd = Forward(3, 2, rows)
    frame = through_the_wire(fwd.frame(h, bytes(tensor_to_buffer(h)) + one + three))
    back = Forward.parse(frame, vocab)
    assert back.rows == rows and back.drafted == 3
    assert mx.array_equal(back.hidden(frame.payload), h)
    drafts = back.draft_probs(frame.payload, vocab)
    assert np.array_equal(np.array(draft_distribution(drafts[1], 2, vocab)), q[:2])
    assert np.array_equal(np.array(draft_distribution(drafts[3], 1, vocab)), q[2:])
    # From the leader (no hidden states), the payload is the distributions alone.
    assert Forward.parse(through_the_wire(fwd.frame(payload=one + three)), vocab).drafted == 3
    with pytest.raises(FrameError, match="3 draft distributions of 8 token ids and probabilities"):
        Forward.parse(through_the_wire(fwd.frame(payload=one)), vocab)
    with pytest.raises(FrameError, match="hidden states"):
        Forward.parse(through_the_wire(fwd.frame(h, bytes(tensor_to_buffer(h)) + one)), vocab)
    with pytest.raises(FrameError, match="finite and not negative"):
        draft_distribution(pack_draft(ids[:1], -q[:1], tails[:1]), 1, vocab)
    with pytest.raises(FrameError, match="finite and not negative"):
        draft_distribution(pack_draft(ids[:1], q[:1], [np.nan]), 1, vocab)
    with pytest.raises(FrameError, match="past the vocabulary"):
        draft_distribution(pack_draft(ids[:1] + 1, q[:1], tails[:1]), 1, vocab)
    # Past DRAFT_SUPPORT tokens, a proposal's q travels cut: 3 ids of 8 here, the rest of its
    # mass spread evenly over the 5 others; the draft draws from what the last stage rebuilds.
    monkeypatch.setattr(steps, "DRAFT_SUPPORT", 3)
    full = mx.array([[0.1, 0.02, 0.03, 0.2, 0.05, 0.0, 0.5, 0.1]])
    cut = [np.array(a) for a in steps.cut_draft(full)]
    assert sorted(cut[0][0].tolist()) == [0, 3, 6] or sorted(cut[0][0].tolist()) == [3, 6, 7]  # 0.1 twice: either
    assert cut[2][0] == pytest.approx(0.2 / 5)
    assert steps.draft_bytes(1, vocab) == 3 * 8 + 4 == len(pack_draft(*cut))
    dense = np.array(draft_distribution(pack_draft(*cut), 1, vocab))
    assert np.array_equal(dense, np.array(steps.dense_draft(*(mx.array(a) for a in cut), vocab)))
    assert dense[0, 6] == np.float32(0.5) and dense[0, 3] == np.float32(0.2) and dense.sum() == pytest.approx(1)
    assert sorted({round(x, 6) for x in dense[0].tolist()}) == [0.04, 0.1, 0.2, 0.5]  # the 5 others share the tail
