"""The cluster heals itself: real daemons, real faults, streams open (coordinator.py, reconcile.py, proxy.py).

Three `ringd serve` processes on 127.0.0.1, the real tiny llama, streams read
as a client reads them. The faults are the real thing: SIGSTOP and SIGCONT (a
Mac asleep), `ss -K` destroying a link's TCP socket in the kernel (a Wi-Fi drop,
a NAT timeout), ptrace stopping a live daemon's event loop thread while its other
threads run on. After each, the cluster must serve again, and every stream that
was open must end (complete, or a clean OpenAI error and ``data: [DONE]``): no
hang, no broken chunking. How soon is a figure each test prints (the issue asked
for 20 s and 30 s); the deadlines here are generous, so that a loaded two-core
machine fails only what never heals.

A stalled node stays stopped until the others have shown they noticed (their
status says so: the node declared dead, a ring served without it), not for a
fixed time; the blocked event loop's 5 s is what the issue names; the chaos test
shrinks heartbeats and stalls so that its twelve rounds fit the suite.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from devkit.clients import Stream
from devkit.faults import block_event_loop, drop_ring_link
from devkit.clients import chat
from devkit.cluster import serving_leader

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me everything about rings."}]
STREAM_TOKENS = 200  # still running when the fault lands, a few chunks in
# Deadlines, not figures: a cluster that has not healed after these has not healed. (What it
# takes is printed: 1-10 s here, against the 20 s to serve and 30 s for streams to end.)
SERVE_AGAIN_S = 120.0
STREAMS_END_S = 120.0
# How long a stopped node may take to be noticed: declared dead after 2 s of silence, a ring made
# without it. A deadline, not a figure; what it took is printed.
NOTICED_S = 60.0


def serves_again(c, t0: float, via: int = 0) -> float:
    """Seconds from t0 until a chat completion through node `via` answers 200."""
    deadline = t0 + SERVE_AGAIN_S
    while time.monotonic() < deadline:
        status, _ = chat(c.url(via), timeout=10)
        if status == 200:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"the cluster did not serve again within {SERVE_AGAIN_S:.0f} s\n{c.log_tails()}")


def stall_until(c, i: int, noticed, what: str) -> float:
    """Stop node i (SIGSTOP: a Mac asleep) until ``noticed()`` (the others' status shows it), then
    continue it; the seconds it was stopped."""
    t0 = time.monotonic()
    c.signal(i, signal.SIGSTOP)
    try:
        c.wait(noticed, NOTICED_S, what)
    finally:
        c.signal(i, signal.SIGCONT)
    return time.monotonic() - t0


def check_streams(c, streams: list[Stream], t0: float) -> None:
    for s in streams:
        assert s.join(max(0.0, t0 + STREAMS_END_S - time.monotonic())), f"a stream still runs {STREAMS_END_S} s after the fault: {s}\n{c.log_tails()}"
        assert s.clean, f"the stream did not end cleanly: {s}\n{c.log_tails()}"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="llama", layers=6)


@pytest.fixture(scope="module")
def shared(model, tmp_path_factory):
    """One cluster of three for the fault tests that follow: each leaves it healed, node0 leading."""
    from devkit.cluster import Cluster

    c = Cluster(model, 3, tmp_path_factory.mktemp("healing"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def c(shared):
    shared.wait(lambda: serving_leader(shared, range(3)) == "node0", 60, "node0 to lead a ring of three")
    return shared


@pytest.fixture(scope="module")
def uninterrupted(shared):
    """The text of an uninterrupted greedy stream, for comparisons."""
    shared.wait(lambda: serving_leader(shared, range(3)) == "node0", 60, "node0 to lead")
    s = Stream(shared.url(0), MESSAGES, STREAM_TOKENS)
    assert s.join(120) and s.clean and s.finish == "length", s
    return s.text


def test_the_leader_stalls_until_the_others_serve_without_it_with_streams_open(c, uninterrupted):
    direct, via_follower = Stream(c.url(0), MESSAGES, STREAM_TOKENS), Stream(c.url(2), MESSAGES, STREAM_TOKENS)
    direct.wait_started()
    via_follower.wait_started()
    # Asleep until the followers have declared it dead and lead a ring of their own.
    stalled = stall_until(c, 0, lambda: serving_leader(c, [1, 2]) not in (None, "node0"), "the followers to serve without node0")
    t0 = time.monotonic()
    took = serves_again(c, t0)
    print(f"\nleader stalled {stalled:.1f} s: served again {took:.2f} s after SIGCONT")
    check_streams(c, [direct, via_follower], t0)
    # Nothing was lost: the leader replayed its own, the follower carried its stream over.
    assert direct.text == uninterrupted and via_follower.text == uninterrupted
    assert c.wait(lambda: serving_leader(c, range(3)), what="one leader") == "node0"


def test_a_follower_stalls_until_the_leader_serves_without_it_with_streams_open(c, uninterrupted):
    streams = [Stream(c.url(0), MESSAGES, STREAM_TOKENS), Stream(c.url(2), MESSAGES, STREAM_TOKENS)]
    for s in streams:
        s.wait_started()

    def ring_without_node1() -> bool:
        s = c.status(0)
        return bool(s and s.get("ready") and s.get("plan") and "node1" not in [st[0] for st in s["plan"]["stages"]])

    # Asleep until the leader has declared it dead and serves a ring without it.
    stalled = stall_until(c, 1, ring_without_node1, "node0 to serve a ring without node1")
    t0 = time.monotonic()
    took = serves_again(c, t0, via=1)
    print(f"\nfollower stalled {stalled:.1f} s: served again through it {took:.2f} s after SIGCONT")
    check_streams(c, streams, t0)
    assert all(s.text == uninterrupted for s in streams)
    c.wait(lambda: (c.status(0) or {}).get("ready") and [s[0] for s in c.status(0)["plan"]["stages"]] == ["node0", "node1", "node2"], 30, "node1 back in the ring")


@pytest.mark.parametrize("pair", [(1, 2), (0, 1)], ids=["between-followers", "leader-follower"])
def test_a_link_dropped_and_remade_at_once(c, uninterrupted, pair):
    term = c.status(0)["plan"]["term"]
    stream = Stream(c.url(0), MESSAGES, STREAM_TOKENS)
    stream.wait_started(10)
    a, b = pair
    assert drop_ring_link(c.procs[a].pid, c.ring_ports[a], c.procs[b].pid, c.ring_ports[b]) >= 1
    t0 = time.monotonic()
    # The dial loops re-make it within a fraction of a second; the frames it carried are lost,
    # which the leader must notice (for a link between followers, from the stage's report).
    c.wait(lambda: (c.status(0) or {}).get("ready") and c.status(0)["plan"]["term"] > term, SERVE_AGAIN_S, "a fresh plan")
    took = serves_again(c, t0)
    print(f"\nlink node{a}-node{b} dropped: served again {took:.2f} s later")
    check_streams(c, [stream], t0)
    assert stream.text == uninterrupted


def test_the_leaders_event_loop_blocked_for_5_s(c, uninterrupted):
    streams = [Stream(c.url(0), MESSAGES, STREAM_TOKENS), Stream(c.url(1), MESSAGES, STREAM_TOKENS)]
    for s in streams:
        s.wait_started()
    block_event_loop(c.procs[0].pid, 5)  # returns when the loop runs again
    t0 = time.monotonic()
    took = serves_again(c, t0)
    print(f"\nleader's loop blocked 5 s: served again {took:.2f} s later")
    check_streams(c, streams, t0)
    assert all(s.text == uninterrupted for s in streams)


CHAOS_FAULTS = ["stall leader", "stall follower", "drop link", "block leader loop"]
# Each fault three times, in a shuffled order: every kind lands on a cluster that healed from
# each of the others (twenty random picks took 80 s and could leave a kind out).
CHAOS_EACH = 3
# Faster than the defaults so the rounds fit: a peer silent 1 s is dead.
CHAOS_TIMING = ["--heartbeat-interval-s", "0.2", "--dead-after-s", "1.0"]


def test_chaos_every_fault_thrice_in_random_order_and_the_cluster_heals_after_each(model, cluster_factory):
    rng = random.Random(7)
    rounds = CHAOS_FAULTS * CHAOS_EACH
    rng.shuffle(rounds)
    c = cluster_factory(model, 3, extra=CHAOS_TIMING)
    c.wait(lambda: serving_leader(c, range(3)), 60, what="a leader")
    faults, took = [], []
    for fault in rounds:
        leader = int(c.wait(lambda: serving_leader(c, range(3)), 60, what="a serving leader").removeprefix("node"))
        followers = [i for i in range(3) if i != leader]
        stream = Stream(c.url(rng.randrange(3)), MESSAGES, 200)
        stream.wait_started(2)
        if fault == "stall leader" or fault == "stall follower":
            victim = leader if fault == "stall leader" else rng.choice(followers)
            c.signal(victim, signal.SIGSTOP)
            time.sleep(rng.uniform(1.5, 3.0))
            c.signal(victim, signal.SIGCONT)
        elif fault == "drop link":
            a, b = rng.sample(range(3), 2)
            drop_ring_link(c.procs[a].pid, c.ring_ports[a], c.procs[b].pid, c.ring_ports[b])
        else:
            block_event_loop(c.procs[leader].pid, 2)
        t0 = time.monotonic()
        faults.append(fault)
        took.append(serves_again(c, t0, via=rng.randrange(3)))
        check_streams(c, [stream], t0)
    print(f"\nchaos: {', '.join(f'{f} (served again after {s:.1f} s)' for f, s in zip(faults, took))}")
