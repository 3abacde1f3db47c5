"""tools/bench (devkit/bench/): the theory its --link table puts beside each measured figure (pure functions), and its count of context switches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from devkit.bench.measure import switches
from devkit.bench.theory import hops_per_token, one_stream_theory_s, streams_bound_tok_s, unhidden_tok_s

names = st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True)
streams = st.integers(1, 64)
rates = st.floats(1.0, 10_000.0)  # tokens/s
seconds = st.floats(1e-4, 1.0)
one_ways = st.floats(0.0, 0.05)
hop_counts = st.integers(0, 9)


def test_a_step_crosses_a_link_between_every_two_different_nodes_on_its_way_round():
    assert hops_per_token("a", ["a"]) == 0  # one Mac: no link
    assert hops_per_token("a", ["a", "b", "c"]) == 3  # to b, to c, the token back to a
    assert hops_per_token("x", ["a", "b"]) == 3  # a leader outside the ring: to a, to b, back
    assert hops_per_token("a", ["b", "a"]) == 2  # the leader last: to b, to a, and a keeps it


@given(ring=names)
def test_a_ring_led_by_its_first_stage_has_as_many_hops_as_nodes(ring):
    assert hops_per_token(ring[0], ring) == (len(ring) if len(ring) > 1 else 0)


@given(n=streams, loopback=rates, alone=seconds, hops=hop_counts, one_way=one_ways)
def test_the_bound_lies_between_the_links_unhidden_and_the_loopback_rate(n, loopback, alone, hops, one_way):
    bound = streams_bound_tok_s(n, loopback, alone, hops, one_way)
    assert bound <= loopback * (1 + 1e-12)  # links never make the ring faster
    assert bound >= unhidden_tok_s(n, loopback, hops, one_way) * (1 - 1e-12)  # hiding never makes it slower
    assert streams_bound_tok_s(n, loopback, alone, hops, one_way + 1e-3) <= bound  # slower links, no higher bound


@given(loopback=rates, hops=hop_counts, one_way=one_ways)
def test_one_stream_is_bound_by_the_one_stream_theory(loopback, hops, one_way):
    alone = 1 / loopback
    want = 1 / one_stream_theory_s(alone, hops, one_way)
    assert streams_bound_tok_s(1, loopback, alone, hops, one_way) == pytest.approx(want)
    assert unhidden_tok_s(1, loopback, hops, one_way) == pytest.approx(want)


@given(n=streams, loopback=rates, alone=seconds)
def test_without_links_the_bound_is_the_loopback_rate(n, loopback, alone):
    assert streams_bound_tok_s(n, loopback, alone, 0, 0.05) == pytest.approx(loopback)
    assert streams_bound_tok_s(n, loopback, alone, 3, 0.0) == pytest.approx(loopback)


def test_micro_batches_hide_links_shorter_than_what_the_others_compute_meanwhile():
    # 8 streams at 400 tok/s on loopback: 20 ms a stream's token; one alone takes 5 ms, so links
    # of up to 15 ms a trip are hidden, and 4 hops of 5 ms (20 ms) are not, all of them.
    assert streams_bound_tok_s(8, 400.0, 0.005, 3, 0.005) == pytest.approx(400.0)
    assert streams_bound_tok_s(8, 400.0, 0.005, 4, 0.005) == pytest.approx(8 / 0.025)


def test_switches_counts_every_wait_of_every_thread():
    import os
    import threading
    import time

    slept, done = threading.Event(), threading.Event()

    def sleeper():
        for _ in range(20):
            time.sleep(0.001)
        slept.set()
        done.wait()  # counted while it lives: a thread that ended has left /proc

    before = switches([os.getpid()])
    waiter = threading.Thread(target=sleeper)
    waiter.start()
    try:
        assert slept.wait(30)
        # The thread slept 20 times, each a switch away from it.
        assert switches([os.getpid()]) - before >= 20
    finally:
        done.set()
        waiter.join()
