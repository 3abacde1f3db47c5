"""Prompt chunks sized to a time (``pacing.py``), against a simulated pipeline.

The simulated ring has P stages, each computing one micro-batch at a time: a chunk of n
tokens takes ``fixed + n * per_token`` at a stage (each stage its own cost), and up to P
micro-batches are in flight, a new one sent as each comes back (a long prompt's chunks,
now and then a decode micro-batch between them). The pacer sees only when each went and
came back, as the engine does. What must hold: whatever it is told, a chunk stays within
its bounds; and once a long prompt has gone round a while, a chunk keeps the slowest
stage about ``target_s``, or is at a bound that keeps it nearer.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.leader.pacing import CHUNK_QUANTUM, MIN_PACED_CHUNK, ChunkPacer


def run_pipeline(pacer: ChunkPacer, fixed_s: float, per_token_s: list[float], chunks: int, decode_every: int = 0) -> list[int]:
    """A long prompt's ``chunks`` chunks around a pipeline of ``len(per_token_s)`` stages (a
    decode micro-batch of one token after every ``decode_every`` chunks); the sizes sent."""
    stages = len(per_token_s)
    free = [0.0] * stages  # when each stage is next free
    in_flight: list[tuple[float, float, int]] = []  # (comes back at, sent at, prompt tokens)
    now, sent, sizes, decoded_after = 0.0, 0, [], 0

    def send(tokens: int, prompt: bool) -> None:
        t = now
        for k in range(stages):
            t = free[k] = max(t, free[k]) + fixed_s + tokens * per_token_s[k]
        in_flight.append((t, now, tokens if prompt else 0))

    while sent < chunks or in_flight:
        while sent < chunks and len(in_flight) < stages:
            if decode_every and sent % decode_every == 0 and decoded_after < sent:
                send(1, prompt=False)
                decoded_after = sent
                continue
            sizes.append(pacer.chunk)
            send(pacer.chunk, prompt=True)
            sent += 1
        in_flight.sort()
        back, went, tokens = in_flight.pop(0)
        now = back
        pacer.came_back(back - went, tokens, len(in_flight) + 1)
    return sizes


@settings(max_examples=200, deadline=None)
@given(
    target_s=st.floats(0.01, 2.0),
    most=st.integers(1, 4096),
    events=st.lists(st.tuples(st.floats(-1e3, 1e3), st.integers(0, 10**6), st.integers(-1, 8)), max_size=50),
)
def test_a_chunk_stays_within_its_bounds_whatever_it_is_told(target_s, most, events):
    pacer = ChunkPacer(target_s, most)
    for trip, tokens, in_flight in events:
        chunk = pacer.came_back(trip, tokens, in_flight)
        assert chunk == pacer.chunk and min(most, MIN_PACED_CHUNK) <= chunk <= most
        assert chunk == most or chunk % CHUNK_QUANTUM == 0
    pacer.reset()
    assert pacer.chunk == most and pacer.token_s is None


@settings(max_examples=200, deadline=None)
@given(
    target_s=st.floats(0.05, 1.0),
    fixed_s=st.floats(0.0, 0.01),
    slowest=st.floats(1e-5, 3e-3),
    shares=st.lists(st.floats(0.5, 1.0), min_size=0, max_size=3),
    decode_every=st.sampled_from([0, 1, 3]),
)
def test_a_long_prompt_s_chunks_settle_where_the_slowest_stage_takes_the_target(target_s, fixed_s, slowest, shares, decode_every):
    # Placement balances the stages' compute: the others within half the slowest's time.
    per_token_s = [slowest] + [slowest * share for share in shares]
    most = 512
    pacer = ChunkPacer(target_s, most)
    sizes = run_pipeline(pacer, fixed_s, per_token_s, chunks=40, decode_every=decode_every)
    ideal = (target_s - fixed_s) / slowest  # the chunk whose time at the slowest stage is the target
    # Near it, give or take a quantum (chunks are whole multiples): a decode micro-batch in flight
    # beside a chunk counts as one in the ring's share, and the trip of a chunk beside it weighs
    # every stage alike, not the slowest alone. Within the bounds: a ring fast enough that even
    # the low end of that band is past the configured chunk keeps its full chunks.
    low = min(most, max(MIN_PACED_CHUNK, ideal / 2 - CHUNK_QUANTUM))
    high = min(most, max(MIN_PACED_CHUNK, ideal * 1.6 + CHUNK_QUANTUM))
    for n in sizes[-10:]:
        if ideal <= MIN_PACED_CHUNK:
            assert n == MIN_PACED_CHUNK
        else:
            assert low <= n <= high, (n, ideal, sizes)


def test_a_slow_ring_shrinks_the_chunks_and_a_new_ring_starts_them_full():
    # Two stages taking 1.2 ms a token: a 512-token chunk would keep each 0.6 s.
    pacer = ChunkPacer(0.2, 512)
    sizes = run_pipeline(pacer, 0.001, [1.2e-3, 1.2e-3], chunks=20)
    assert sizes[0] == 512 and sizes[-1] in (128, 160)  # 0.2 s / 1.2 ms = 166 tokens, quantized
    pacer.reset()
    assert run_pipeline(pacer, 0.001, [1e-5, 1e-5], chunks=10) == [512] * 10  # a fast one keeps them full


def test_a_chunk_alone_counts_its_whole_trip_and_one_among_others_its_share():
    pacer = ChunkPacer(0.2, 512)
    assert pacer.came_back(0.1, 256, 1) == 512  # alone, 0.1 s for 256 tokens: 512 fit in 0.2 s
    assert pacer.token_s == pytest.approx(0.1 / 256)
    pacer.reset()
    assert pacer.came_back(0.4, 256, 1) == 128  # 0.4 s alone: 128 fit in 0.2 s
    pacer.reset()
    assert pacer.came_back(0.4, 256, 2) == 256  # 0.4 s around, but the ring shared between two
    assert pacer.token_s == pytest.approx(0.2 / 256)


def test_a_prompt_s_short_tail_and_a_clock_that_did_not_move_change_nothing():
    pacer = ChunkPacer(0.2, 512)
    assert pacer.came_back(5.0, MIN_PACED_CHUNK - 1, 1) == 512
    assert pacer.came_back(0.0, 512, 1) == 512
    assert pacer.token_s is None


def test_growth_is_bounded_per_measure():
    pacer = ChunkPacer(0.2, 4096)
    assert pacer.came_back(1.0, 512, 1) == 96  # 1 s for 512 tokens: 102 fit, quantized to 96
    assert pacer.came_back(0.001, 512, 1) == 192  # suddenly fast: twice the chunk, no more


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="above 0 s"):
        ChunkPacer(0, 512)
    with pytest.raises(ValueError, match="room for a token"):
        ChunkPacer(0.2, 0)
