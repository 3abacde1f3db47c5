"""How instances share the Macs: memory room, KV shares, keep_alive expiry, eviction, replicas.

The leader may keep several models loaded at once, and replicas of one, each an
instance with its own plan over some nodes. Every rule about how they share is
here, as pure functions over plain values: what a node's memory budget leaves
for a new instance, how the KV room an instance's admission may book on a node
is split between the instances it holds, which idle instances keep_alive
unloads now and when the next one is due, which instances to unload (least
recently used first) to make room for another, and which replica takes a
request.

It deliberately ignores how any of this is measured or carried out: byte sizes
come from placement (``ModelCost``), time is passed in as monotonic seconds (no
clock is read here), and loading, unloading, timers and the network belong to
the coordinator that calls these functions. No asyncio, no MLX, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# Replicas one model may have: each is a ring of at least one Mac, and a cluster is a dozen.
MAX_REPLICAS = 16


@dataclass(frozen=True)
class Held:
    """What one instance holds on one node, in bytes: its layers' weights, and the KV room
    placement reserved beside them (kv_reserve_tokens of its layers)."""

    weights: int
    reserve: int

    def __post_init__(self):
        if self.weights < 0 or self.reserve < 0:
            raise ValueError(f"Held needs byte counts >= 0, got weights={self.weights} reserve={self.reserve}")

    @property
    def claim(self) -> int:
        """The bytes this instance keeps from every other on its node."""
        return self.weights + self.reserve


def room_left(budget: int | None, held: Iterable[Held]) -> int | None:
    """What a node's budget leaves for a new instance after the claims of those it holds (None:
    no budget, no limit). May be negative (over-committed by a config change): callers treat <= 0
    as no room."""
    if budget is None:
        return None
    return budget - sum(h.claim for h in held)


def kv_shares(budget: int | None, held: Mapping[str, Held]) -> dict[str, int | None]:
    """Each instance's KV capacity on one node, in bytes: its own reserve plus an equal share of
    what no claim holds.

    free = max(0, budget - sum of claims) is split floor(free / k) each, the remainder one byte
    apiece to the first instances in sorted name order, so the shares sum exactly to
    sum(reserves) + free. With one instance this is budget - weights, as before instances
    existed. None for every instance when budget is None (no limit).

    Invariants: whenever budget >= sum(claims), sum(shares) <= budget - sum(weights) (equal, in
    fact); each share >= its reserve always, so an over-committed node still lets every instance
    book the reserve placement promised it.
    """
    if budget is None:
        return {name: None for name in held}
    if not held:
        return {}
    names = sorted(held)
    free = max(0, budget - sum(h.claim for h in held.values()))
    each, extra = divmod(free, len(names))
    return {name: held[name].reserve + each + (1 if i < extra else 0) for i, name in enumerate(names)}


@dataclass(frozen=True)
class Usage:
    """An instance as eviction and keep_alive see it."""

    name: str
    pinned: bool  # the model the cluster was started with: never unloaded by keep_alive or eviction
    active: int  # requests queued or in flight on it
    last_used: float  # monotonic seconds of its last request's end (or its load)
    keep_alive: float | None  # seconds it stays loaded idle after last_used; None: forever

    def __post_init__(self):
        if self.active < 0:
            raise ValueError(f"instance {self.name!r}: active requests must be >= 0, got {self.active}")
        if self.keep_alive is not None and not self.keep_alive >= 0:  # `not >=` refuses NaN too
            raise ValueError(f"instance {self.name!r}: keep_alive must be seconds >= 0 or None (forever), got {self.keep_alive}")

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight: keep_alive's clock runs, eviction may take it."""
        return self.active == 0

    @property
    def expires_at(self) -> float | None:
        """When keep_alive unloads it if nothing comes (None: never: pinned, busy or forever)."""
        if self.pinned or not self.idle or self.keep_alive is None:
            return None
        return self.last_used + self.keep_alive


def expired(instances: Iterable[Usage], now: float) -> list[str]:
    """Names of instances to unload now: idle (active == 0), not pinned, keep_alive not None and
    last_used + keep_alive <= now. Sorted by name."""
    return sorted(u.name for u in instances if (t := u.expires_at) is not None and t <= now)


def next_expiry(instances: Iterable[Usage]) -> float | None:
    """The earliest time some idle unpinned instance with a keep_alive expires (None: none will),
    so a timer can sleep until then. A busy instance is not counted: its request's end sets a new
    last_used, and the caller asks again then."""
    return min((t for u in instances if (t := u.expires_at) is not None), default=None)


def eviction_order(instances: Iterable[Usage]) -> list[str]:
    """Idle, unpinned instances, least recently used first (ties: by name). A busy (active > 0)
    or pinned one is never in it; one kept forever (keep_alive None) is, last as its age says:
    keep_alive is how long an instance may stay, not a claim on room another model needs."""
    return [u.name for u in sorted((u for u in instances if u.idle and not u.pinned), key=lambda u: (u.last_used, u.name))]


def victims(order: Sequence[str], fits_without: Callable[[frozenset[str]], bool]) -> list[str] | None:
    """The shortest prefix of ``order`` whose removal makes ``fits_without(removed)`` true ([] if
    it fits already, None if even removing all of them does not). Calls fits_without at most
    len(order) + 1 times, each prefix once, shortest first; it need not be monotonic."""
    for n in range(len(order) + 1):
        removed = list(order[:n])
        if fits_without(frozenset(removed)):
            return removed
    return None


def pick_replica(replicas: Sequence[tuple[str, int]]) -> str:
    """The replica (name, outstanding work) with the least outstanding work; ties to the first in
    the given order. ValueError on an empty sequence."""
    if not replicas:
        raise ValueError("pick_replica: no replicas to choose from (an instance routed to has at least one; load one first)")
    name, _ = min(replicas, key=lambda r: r[1])  # min keeps the first of equals
    return name


def regroup(groups: Sequence[frozenset[str]], live: Sequence[str], replicas: int) -> list[frozenset[str]]:
    """Which nodes each of ``replicas`` replicas of one model may place its ring over.

    ``groups``: the last answer ([] at first); ``live``: the nodes that may hold layers now,
    in ring order. When the number of replicas changed, the live nodes are cut anew into
    that many contiguous groups, as even as possible (earlier groups take the extra node).
    Otherwise the groups stick: a node that left drops out of its group only, so the other
    replicas keep their rings, and a node that came goes to the smallest group (ties: the
    first). A group may be empty when there are fewer nodes than replicas.
    """
    if replicas < 1:
        raise ValueError(f"a model has at least one replica, not {replicas}")
    if len(groups) != replicas:
        base, extra = divmod(len(live), replicas)
        out, start = [], 0
        for k in range(replicas):
            n = base + (1 if k < extra else 0)
            out.append(frozenset(live[start : start + n]))
            start += n
        return out
    alive = set(live)
    out = [frozenset(g & alive) for g in groups]
    placed = set().union(*out)
    for node in live:
        if node not in placed:
            k = min(range(replicas), key=lambda i: len(out[i]))
            out[k] = out[k] | {node}
            placed.add(node)
    return out


def fewest_nodes(rooms: Sequence[tuple[str, int | None]], holds: Callable[[Sequence[str]], bool]) -> list[str] | None:
    """The fewest nodes a model loaded on demand should be placed over: the shortest run of the
    nodes with the most room (None: no limit, first; ties in the given order) that ``holds``
    the model. One Mac alone when the model fits there: no hop is the cheapest hop. None when
    not even all of them hold it."""
    order = [node for node, _ in sorted(rooms, key=lambda r: -(float("inf") if r[1] is None else r[1]))]
    for k in range(1, len(order) + 1):
        if holds(order[:k]):
            return order[:k]
    return None
