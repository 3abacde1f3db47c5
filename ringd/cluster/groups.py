"""Whether the ring's Macs should split its layers into tensor-parallel groups, and which
(``tensor_parallel: auto``): pure functions of the ring's order, its measured links and each
Mac's measured compute speed.

A group of k Macs computes a layer in ``c / k + 2 a``, where ``c`` is the layer's compute on
one of them and ``a`` an all-reduce between them (two a layer), so a group pays where
``c > 2 a k / (k - 1)``. One stream's token then costs, over the model's ``L`` layers and the
ring's stages, ``L (c / k + 2 a) + hops``: ``choose_groups`` takes the size k (dividing the
ring) and the groups (k consecutive Macs of the ring's order, at the offset whose slowest
all-reduce is cheapest) with the smallest such cost, and k = 1 (no groups) unless a grouping
saves GROUPS_MARGIN of it. The layout (``topology.choose``) already orders the ring by its
links, so Macs with fast links between them sit side by side.

``c`` is estimated from the model's bytes per layer and the Mac's probed matmul speed
(``device.probe_speed``): a layer's decode is about two operations per parameter. On a Mac's
GPU a decode is bound by memory bandwidth rather than arithmetic, so the estimate is low there
and ``auto`` errs towards no groups. ``a`` is half the link's measured round trip, a hidden
state's bytes over its measured bandwidth, and ALL_REDUCE_OVERHEAD_US.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

from ringd.cluster.linkcost import Measured

# What a ringd all-reduce costs beyond its link: the handoffs between each member's compute
# thread, event loop and MLX's stream thread (tools/bench --tensor-parallel, loopback, this
# project's two-core VM: 272-330 us a call, a loopback round trip being tens of microseconds).
ALL_REDUCE_OVERHEAD_US = 300
# A grouping must save this share of a token's time over no groups (and a new grouping over the
# running one, unless that was chosen before the links were measured): every re-plan reloads
# layers, and the estimates are rough.
GROUPS_MARGIN = 0.2
# Groups past this size are not tried: heads rarely divide further, and each all-reduce waits
# for the slowest of more Macs.
MAX_AUTO_GROUP = 8
# An all-reduce over a link nobody has measured yet: no group forms on a guess (the leader
# measures the links while the ring is idle, and groups the Macs then).
UNMEASURED_US = 10**9


@dataclass(frozen=True)
class Grouping:
    """The chosen groups in stage order (each k consecutive Macs of the ring; k = 1: no groups),
    the estimated cost of a token with them, and why, in words for ``ringctl plan``."""

    groups: tuple[tuple[str, ...], ...]
    token_us: int
    why: str
    measured: bool = True  # False: chosen before every link among its Macs was measured (no reason to keep it)

    @property
    def size(self) -> int:
        return len(self.groups[0]) if self.groups else 1


def all_reduce_us(members: tuple[str, ...], links: Mapping[frozenset[str], Measured], hidden_bytes: int) -> int:
    """An all-reduce among ``members``: its slowest pair's one-way trip and a hidden state's bytes
    over that link, and the handoffs on each end."""
    worst = 0
    for i, a in enumerate(members):
        for b in members[i + 1 :]:
            m = links.get(frozenset((a, b)))
            if m is None:
                return UNMEASURED_US
            over = hidden_bytes * 1_000_000 // m.bandwidth if m.bandwidth else 0
            worst = max(worst, m.rtt_us // 2 + over)
    return worst + ALL_REDUCE_OVERHEAD_US


def choose_groups(
    ring: tuple[str, ...],
    links: Mapping[frozenset[str], Measured],
    layer_us: Mapping[str, float],
    layers: int,
    hidden_bytes: int,
    allowed: Collection[int] = range(1, MAX_AUTO_GROUP + 1),
    current: Grouping | None = None,
) -> Grouping:
    """The groups that make one stream fastest over ``ring`` (ring order), by the estimate in the
    module's docstring. ``layer_us``: a layer's compute on each Mac, in microseconds. ``allowed``:
    the group sizes the model can be split into (its heads divide). ``current``: the running
    grouping, kept unless another saves GROUPS_MARGIN of its estimated cost."""
    n = len(ring)
    hop = lambda a, b: _one_way(links, a, b, hidden_bytes)  # noqa: E731
    options = []
    # Sizes that divide the ring into stages of a layer or more each (k = n: one stage).
    for k in [k for k in range(1, min(n, MAX_AUTO_GROUP) + 1) if (k == 1 or k in allowed) and n % k == 0 and n // k <= layers] or [n]:
        offsets = [tuple(tuple(ring[(r + i + j) % n] for j in range(k)) for i in range(0, n, k)) for r in range(k)]
        options.append(min((_cost(g, links, layer_us, layers, hidden_bytes, hop) for g in offsets), key=lambda o: o.token_us))
    alone = options[0]  # the fewest Macs a group: no groups where the ring has a layer for each Mac
    best = min(options, key=lambda o: o.token_us)
    if best is not alone and best.token_us > (1 - GROUPS_MARGIN) * alone.token_us:
        best = alone
    if current is not None and current.measured and set(m for g in current.groups for m in g) == set(ring):
        kept = _cost(current.groups, links, layer_us, layers, hidden_bytes, hop)
        if best.token_us > (1 - GROUPS_MARGIN) * kept.token_us:
            best = kept
    measured = all(frozenset((a, b)) in links for i, a in enumerate(ring) for b in ring[i + 1 :])
    return Grouping(best.groups, best.token_us, _why(best, alone, options, links, layer_us, hidden_bytes), measured)


def _one_way(links: Mapping[frozenset[str], Measured], a: str, b: str, hidden_bytes: int) -> int:
    if a == b:
        return 0
    m = links.get(frozenset((a, b)))
    if m is None:
        return 0  # a hop nobody has measured: counted alike (as nothing) in every option
    return m.rtt_us // 2 + (hidden_bytes * 1_000_000 // m.bandwidth if m.bandwidth else 0)


def _cost(groups, links, layer_us, layers, hidden_bytes, hop) -> Grouping:
    """A token's estimated microseconds with ``groups`` as the stages (in ring order): each stage's
    share of the layers at its slowest member's pace, its all-reduces, and the hops between stages."""
    k = len(groups[0])
    per_layer = []
    for g in groups:
        c = max(layer_us[m] for m in g)
        per_layer.append(c / k + (2 * all_reduce_us(g, links, hidden_bytes) if k > 1 else 0))
    compute = layers * sum(per_layer) / len(per_layer)  # the layers split evenly over the stages
    hops = sum(hop(g[0], groups[(i + 1) % len(groups)][0]) for i, g in enumerate(groups)) if len(groups) > 1 else 0
    return Grouping(tuple(groups), int(compute + hops), "")


def _why(best: Grouping, alone: Grouping, options: list[Grouping], links, layer_us, hidden_bytes) -> str:
    c = max(layer_us.values())
    ring = [m for g in best.groups for m in g]
    if len(ring) > 1 and any(frozenset((a, b)) not in links for i, a in enumerate(ring) for b in ring[i + 1 :]):
        unmeasured = "links not measured yet"
        return f"no groups: {unmeasured}" if best.size == 1 else f"groups of {best.size} ({', '.join('+'.join(g) for g in best.groups)}): the ring has too few layers for a stage a Mac, and {unmeasured}"
    if best.size == 1:
        tried = [o for o in options if o.size > 1]
        if not tried:
            return f"no groups: {len(alone.groups)} Mac(s) make no group"
        o = min(tried, key=lambda t: t.token_us)
        a = max(all_reduce_us(g, links, hidden_bytes) for g in o.groups)
        return (
            f"no groups: a layer computes in ~{c / 1000:.2f} ms on one Mac, and the cheapest groups "
            f"({', '.join('+'.join(g) for g in o.groups)}) all-reduce in ~{a / 1000:.2f} ms, twice a layer: "
            f"~{o.token_us / 1000:.1f} ms a token against ~{alone.token_us / 1000:.1f} ms without"
        )  # fmt: skip
    k = best.size
    a = max(all_reduce_us(g, links, hidden_bytes) for g in best.groups)
    return (
        f"groups of {k} ({', '.join('+'.join(g) for g in best.groups)}): a layer computes in ~{c / 1000:.2f} ms "
        f"on one Mac, ~{c / k / 1000 + 2 * a / 1000:.2f} ms split {k} ways with two all-reduces of ~{a / 1000:.2f} ms "
        f"over their links (a group of {k} pays above {2 * a * k / (k - 1) / 1000:.2f} ms a layer): "
        f"~{best.token_us / 1000:.1f} ms a token against ~{alone.token_us / 1000:.1f} ms without"
    )  # fmt: skip
