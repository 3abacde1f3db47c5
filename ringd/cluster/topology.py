"""Which Macs the ring goes through, and in what order, by what their links cost.

Pure functions of the measured links (``linkcost.Measured``, as each end
reports them), the holders and whether the model fits on a set of them: no
clocks, no randomness, no I/O, so every leader computing it from the same
figures gets the same layout (``place`` in placement.py then splits the layers
over it).

A token's trip is a cycle: the leader, every stage in ring order, and back to
the leader. Each hop costs about half its link's RTT plus a hidden state's
bytes over its bandwidth, so the ring's link cost per token is the sum around
that cycle. ``choose``:

- leaves out a Mac whose links are slow (going through it adds more than
  SLOW_LINK_FACTOR typical hops among the others, and over SLOW_LINK_FLOOR_US,
  to a token's trip) when the model fits on the rest: it stays a member (it serves the API as a follower)
  and holds no layers. A Mac whose memory is needed stays in, wherever its
  links cost least; the leader always stays (tokens come back to it anyway);
- orders the rest for the cheapest cycle: exact (Held-Karp) up to
  MAX_EXACT_NODES, 2-opt from node-name order beyond; never costlier than
  node-name order, and node-name order on a tie;
- is sticky: given the layout of the ring that runs, it keeps it unless the
  new one saves REPLAN_MARGIN of its cost and REPLAN_FLOOR_US a token, and a
  Mac goes out (or comes back) only once its links cross the slow threshold by
  REPLAN_MARGIN: every re-plan reloads layers, which jitter must not cause.

Links nobody has measured yet cost what the typical measured link costs, so a
ring with no figures keeps node-name order.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Mapping

from ringd.cluster.linkcost import Measured
from ringd.base.names import natural_key

# A Mac is "slow" when its detour (what going through it adds to a token's trip
# over going straight from one neighbour to the other) is over this many typical
# hops among the others: a Wi-Fi laptop (1-2.5 ms a hop) beside Thunderbolt or
# 10 GbE minis (0.05-0.15 ms) adds 10-40 hops' worth; a 1 GbE Mac beside 10 GbE
# ones adds 2-3 of theirs but under the floor below. Measured figures carry both
# ends' time to read a beat, which adds to every link alike (on this project's
# shared 2-core VM 1.5-2 ms a hop: a Wi-Fi host's detour read 2.5-3.5 typical hops), so
# the factor is low and the floor does the rest.
SLOW_LINK_FACTOR = 2.0
# ... and this many microseconds a token: below a millisecond a detour costs a few
# percent of a token's compute on a Mac, less than the memory and compute (KV
# room, pipeline stages) a Mac brings.
SLOW_LINK_FLOOR_US = 1000
# A re-plan reloads layers (seconds without service), so a new layout must save
# this share of the running one's link cost per token (and a Mac's links must
# cross the slow threshold by this share before it goes out or comes back): RTT
# jitter of up to 11% on every link (1.118 squared is 1.25) moves no layout ...
REPLAN_MARGIN = 0.25
# ... and at least this much per token: a millisecond a token repays a reload
# within minutes of decoding, and no RTT jitter of a LAN link moves a cycle by it.
REPLAN_FLOOR_US = 1000
# Orders are searched exactly (Held-Karp, n^2 2^n steps) up to this many nodes
# in the cycle: a whole ``choose`` over 8 took 0.6 ms of the leader's loop on this
# project's 2-core VM, once a heartbeat interval; beyond, 2-opt from node-name order.
MAX_EXACT_NODES = 8
# The decode hop's hidden state when the model's width is unknown: a 4096-wide bf16 row.
DEFAULT_HOP_BYTES = 4096 * 2


@dataclass(frozen=True)
class Layout:
    """The ring as links shape it.

    ``ring``: the holders in ring order (the leader first if it holds layers).
    ``left_out``: (node, why) for each holder left out for its links. ``hops``:
    each hop of the token's cycle (from, to, its link as measured or None).
    ``cost_us``: the cycle's link cost per token, in microseconds.
    """

    ring: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    hops: tuple[tuple[str, str, Measured | None], ...] = ()
    cost_us: int = 0

    @property
    def out(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.left_out)

    def to_wire(self) -> dict:
        return {
            "ring": list(self.ring),
            "left_out": [{"node": n, "why": why} for n, why in self.left_out],
            "hops": [[a, b, None if m is None else m.rtt_us, None if m is None else m.bandwidth] for a, b, m in self.hops],
            "cost_us": self.cost_us,
        }


def link_matrix(views: Mapping[str, Mapping[str, Measured]]) -> dict[frozenset[str], Measured]:
    """One figure per pair from both ends' views: RTT the mean of the ends that measured it, the
    slower of their bandwidths (a link is as fast as its slower direction)."""
    pairs: dict[frozenset[str], list[Measured]] = {}
    for a, view in views.items():
        for b, m in view.items():
            if a != b:
                pairs.setdefault(frozenset((a, b)), []).append(m)
    out = {}
    for pair, ms in pairs.items():
        rates = [m.bandwidth for m in ms if m.bandwidth is not None]
        out[pair] = Measured(sum(m.rtt_us for m in ms) // len(ms), min(rates) if rates else None)
    return out


class _Costs:
    """Hop costs in whole microseconds (exact sums, so ties are ties)."""

    def __init__(self, links: Mapping[frozenset[str], Measured], nodes: list[str], hop_bytes: int):
        self.links = links
        known = [m for p, m in links.items() if p <= set(nodes)]
        self.typical = statistics.median_low(sorted(self._hop(m, hop_bytes) for m in known)) if known else 0
        self.typical_rtt = statistics.median_low(sorted(m.rtt_us for m in known)) if known else 0
        self.hop_bytes = hop_bytes
        self._cache: dict[frozenset[str], int] = {}

    @staticmethod
    def _hop(m: Measured, hop_bytes: int) -> int:
        return m.rtt_us // 2 + (hop_bytes * 1_000_000 // m.bandwidth if m.bandwidth else 0)

    def __call__(self, a: str, b: str) -> int:
        if a == b:
            return 0
        pair = frozenset((a, b))
        c = self._cache.get(pair)
        if c is None:
            m = self.links.get(pair)
            c = self._cache[pair] = self.typical if m is None else self._hop(m, self.hop_bytes)
        return c

    def rtt(self, a: str, b: str) -> int:
        m = self.links.get(frozenset((a, b)))
        return self.typical_rtt if m is None else m.rtt_us

    def cycle(self, cycle: list[str]) -> int:
        return sum(self(a, b) for a, b in zip(cycle, cycle[1:] + cycle[:1])) if len(cycle) > 1 else 0


def _held_karp(start: str, rest: list[str], cost: _Costs) -> list[str]:
    """The cheapest cycle from ``start`` through ``rest`` (exact): ``rest`` in its order.
    Ties go to the order built from the earliest nodes of ``rest`` first, deterministically."""
    n = len(rest)
    if n <= 1:
        return list(rest)
    # best[(mask, j)]: cheapest path from start through the nodes of mask, ending at rest[j].
    best: dict[tuple[int, int], tuple[int, int]] = {}
    for j in range(n):
        best[(1 << j, j)] = (cost(start, rest[j]), -1)
    for mask in range(1, 1 << n):
        for j in range(n):
            if not mask & (1 << j) or (mask, j) not in best:
                continue
            c, _ = best[(mask, j)]
            for k in range(n):
                if mask & (1 << k):
                    continue
                key = (mask | (1 << k), k)
                cand = (c + cost(rest[j], rest[k]), j)
                if key not in best or cand < best[key]:
                    best[key] = cand
    full = (1 << n) - 1
    last = min(range(n), key=lambda j: (best[(full, j)][0] + cost(rest[j], start), j))
    order, mask = [], full
    while last != -1:
        order.append(rest[last])
        _, prev = best[(mask, last)]
        mask &= ~(1 << last)
        last = prev
    return order[::-1]


def _two_opt(start: str, rest: list[str], cost: _Costs) -> list[str]:
    """2-opt from ``rest`` as given: reverse a segment while that makes the cycle cheaper.
    Only strict improvements, so never costlier than where it began."""
    order = list(rest)
    current = cost.cycle([start, *order])
    improved = True
    while improved:
        improved = False
        for i in range(len(order) - 1):
            for j in range(i + 1, len(order)):
                cand = order[:i] + order[i : j + 1][::-1] + order[j + 1 :]
                c = cost.cycle([start, *cand])
                if c < current:
                    order, current, improved = cand, c, True
    return order


def _order(leader: str, holders: list[str], cost: _Costs) -> tuple[str, ...]:
    """The holders in their cheapest ring order, the leader first if it holds layers;
    node-name order when nothing is cheaper."""
    by_name = sorted((h for h in holders if h != leader), key=natural_key)
    if len(by_name) + 1 <= MAX_EXACT_NODES:
        found = _held_karp(leader, by_name, cost)
    else:
        found = _two_opt(leader, by_name, cost)
    # A cycle costs the same both ways round (links are symmetric here): take the direction that
    # reads closer to name order.
    found = min(found, found[::-1], key=lambda o: [natural_key(n) for n in o])
    if cost.cycle([leader, *by_name]) <= cost.cycle([leader, *found]):
        found = by_name
    return tuple(([leader] if leader in holders else []) + found)


def ring_cost(leader: str, ring: tuple[str, ...], links: Mapping[frozenset[str], Measured], among: list[str], hop_bytes: int = DEFAULT_HOP_BYTES) -> int:
    """The link cost per token (µs) of the cycle through ``leader`` and ``ring``, links unmeasured
    costing what the typical one among ``among`` does: the figure ``choose`` minimises."""
    cost = _Costs(links, sorted({leader, *among}, key=natural_key), hop_bytes)
    return cost.cycle(list(ring) if leader in ring else [leader, *ring])


def _layout(leader: str, ring: tuple[str, ...], left_out: tuple[tuple[str, str], ...], cost: _Costs) -> Layout:
    cycle = list(ring) if leader in ring else [leader, *ring]
    hops = tuple((a, b, cost.links.get(frozenset((a, b)))) for a, b in zip(cycle, cycle[1:] + cycle[:1])) if len(cycle) > 1 else ()
    return Layout(ring, left_out, hops, cost.cycle(cycle))


def _slowness(node: str, among: list[str], cost: _Costs) -> tuple[float, float]:
    """``node``'s mean hop cost to the others, and a typical hop among the others (their pairs'
    median), in µs. (0, 0) with fewer than two others: no link of theirs to judge its links by.

    Going through ``node`` instead of straight between two others adds about twice its hop less
    one of theirs (its detour). Both figures move no more than the links they are made of, so
    the verdict is as steady as the links are (a detour taken pair by pair, a difference of
    near-equal costs, is not)."""
    others = [n for n in among if n != node]
    if len(others) < 2:
        return 0.0, 0.0
    mine = sum(cost(node, o) for o in others) / len(others)
    return mine, float(statistics.median_low(sorted(cost(a, b) for i, a in enumerate(others) for b in others[i + 1 :])))


def _slow(node: str, among: list[str], cost: _Costs, scale: float = 1.0) -> bool:
    """Whether ``node``'s detour is over SLOW_LINK_FACTOR typical hops and SLOW_LINK_FLOOR_US
    (``scale`` > 1: clearly so; < 1: still so, by a margin)."""
    mine, typical = _slowness(node, among, cost)
    if mine == 0:
        return False
    return mine > (1 + SLOW_LINK_FACTOR) / 2 * scale * typical and 2 * mine - typical > SLOW_LINK_FLOOR_US * scale


def _average_rtt(node: str, among: list[str], cost: _Costs) -> tuple[float, float]:
    """``node``'s links' average RTT, and the others' (µs): what a user reads of why it is out."""
    others = [n for n in among if n != node]
    mine = [cost.rtt(node, o) for o in others]
    theirs = [cost.rtt(a, b) for i, a in enumerate(others) for b in others[i + 1 :]]
    return (sum(mine) / len(mine) if mine else 0.0), (sum(theirs) / len(theirs) if theirs else 0.0)


def _ms(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us < 10_000 else f"{us / 1000:.1f} ms"


def _span(nodes: list[str]) -> str:
    nodes = sorted(nodes, key=natural_key)
    return f"{nodes[0]}-{nodes[-1]}" if len(nodes) > 2 else ", ".join(nodes)


def choose(
    leader: str,
    holders: list[str],
    links: Mapping[frozenset[str], Measured],
    fits: Callable[[tuple[str, ...]], str | None],
    hop_bytes: int = DEFAULT_HOP_BYTES,
    current: Layout | None = None,
) -> Layout:
    """The ring over ``holders`` (the members that may hold layers) that its links favour.

    ``links``: pair -> measured link (``link_matrix``). ``fits(nodes)``: None when
    the model does not fit on ``nodes``, else a note of how it fits ("needs X of
    Y"), which the reason for leaving a Mac out quotes. ``current``: the layout of
    the ring that runs (kept unless a new one is clearly better; see the module).
    """
    among = sorted({leader, *holders}, key=natural_key)
    cost = _Costs(links, among, hop_bytes)
    best_out = _leave_out(leader, holders, among, cost, fits)
    if current is None or set(current.ring) | current.out != set(holders) or not current.ring:
        return _with(leader, holders, best_out, cost, fits, among)
    out = current.out
    if out != frozenset(n for n, _ in best_out):
        # A Mac goes out (or comes back) only on a clear verdict: its links crossed the threshold by the margin.
        # One more goes out only if the model fits without it as well (not for a swap: which of
        # two slow Macs whose memory is needed stays is no reason to reload).
        stays_out = all(_slow(n, among, cost, 1 / (1 + REPLAN_MARGIN)) for n in out)
        newly = frozenset(n for n, _ in best_out) - out
        clearly = any(
            _slow(n, among, cost, 1 + REPLAN_MARGIN) and fits(tuple(h for h in current.ring if h != n)) is not None
            for n in newly
        )
        if not stays_out or clearly or fits(current.ring) is None:
            return _with(leader, holders, best_out, cost, fits, among)
    kept = _layout(leader, current.ring, _reasons(leader, holders, out, among, cost, fits), cost)
    better = _with(leader, holders, kept.left_out, cost, fits, among)
    if kept.cost_us - better.cost_us > max(REPLAN_FLOOR_US, REPLAN_MARGIN * kept.cost_us):
        return better
    return kept


def _leave_out(leader, holders, among, cost, fits) -> tuple[tuple[str, str], ...]:
    """Slow Macs the model does not need, slowest first, each with why."""
    slow = [n for n in holders if n != leader and _slow(n, among, cost)]
    slow.sort(key=lambda n: (-_slowness(n, among, cost)[0], natural_key(n)))
    out: set[str] = set()
    for n in slow:
        rest = tuple(h for h in holders if h not in out and h != n)
        if rest and fits(rest) is not None:
            out.add(n)
    return _reasons(leader, holders, frozenset(out), among, cost, fits)


def _reasons(leader, holders, out, among, cost, fits) -> tuple[tuple[str, str], ...]:
    rest = tuple(h for h in holders if h not in out)
    note = fits(rest) if rest else None
    reasons = []
    for n in sorted(out, key=natural_key):
        avg, others = _average_rtt(n, among, cost)
        mine, typical = _slowness(n, among, cost)
        detour = 2 * mine - typical
        reasons.append(
            (n, f"{n} left out: its links average {_ms(avg)} against {_ms(others)} (RTT), adding {_ms(detour)} a token, "
                f"and the model fits on {_span(list(rest))}"
             + (f" ({note})" if note else ""))
        )  # fmt: skip
    return tuple(reasons)


def _with(leader, holders, left_out, cost, fits, among) -> Layout:
    out = frozenset(n for n, _ in left_out)
    ring = _order(leader, [h for h in holders if h not in out], cost)
    return _layout(leader, ring, left_out, cost)
