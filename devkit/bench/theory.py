"""The theory the --link tables put beside each measured figure: the links a decode step crosses, one
stream's time per token over links, and N streams' bound when micro-batches in flight hide the
links. Pure functions (tests/test_bench.py checks them with Hypothesis)."""

from __future__ import annotations


def hops_per_token(leader: str, stages: list[str]) -> int:
    """Links one decode step crosses: the leader's row to stage 0, each stage's output to the
    next, the last stage's token back to the leader; a step between two stages of one node
    (or the leader's own stage) crosses none."""
    path = [leader, *stages, leader]
    return sum(a != b for a, b in zip(path, path[1:]))


def one_stream_theory_s(compute_s: float, hops: int, one_way_s: float) -> float:
    """One stream's time per token over links: what the same ring takes on loopback (compute, and
    the ring's own work) plus each hop's one-way time on the link; nothing else is added."""
    return compute_s + hops * one_way_s


def streams_bound_tok_s(streams: int, loopback_tok_s: float, alone_s: float, hops: int, one_way_s: float) -> float:
    """The most ``streams`` streams can make over links, in aggregate tokens/s.

    A stream's micro-batch comes back no sooner than its own trip (``alone_s``, one stream's time
    per token on loopback) plus the links' time, and the ring computes no faster than on loopback
    with as many streams (``loopback_tok_s``). Micro-batches in flight hide the links as long as
    the second is the longer: then the bound is the loopback rate itself."""
    loopback_s = streams / loopback_tok_s  # each stream's time per token on loopback
    trip_s = min(alone_s, loopback_s) + hops * one_way_s
    return streams / max(loopback_s, trip_s)


def unhidden_tok_s(streams: int, loopback_tok_s: float, hops: int, one_way_s: float) -> float:
    """Aggregate tokens/s if nothing hid the links: every stream's token waits for them in full."""
    return streams / (streams / loopback_tok_s + hops * one_way_s)
