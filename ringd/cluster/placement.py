"""Which node runs which layers: pure functions from members to a Plan (``ring/plan.py``).

Nothing here touches the network or MLX; the leader computes a plan and sends
``Plan.to_wire()`` to every member.

How many layers each node gets is a placement strategy (``STRATEGIES``,
``place``, ``plan_for``): every one is a pure function of the nodes (ring
order, memory budgets, measured speeds) and the model's byte sizes, with no
clocks and no randomness, so every node computing it gets the same plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from ringd.ring.plan import PlacementError, Plan, even_split, make_plan

if TYPE_CHECKING:
    from ringd.models.checkpoint import ModelInfo

GIB = 2**30


def check_budgets(plan: Plan, stage_bytes, budgets: dict[str, int | None]) -> None:
    """Raise PlacementError naming every node whose stage exceeds its memory budget.

    ``stage_bytes(start, end)`` is what a stage holding those layers
    materializes; a budget of None is no limit.
    """
    short = []
    for s in plan.stages:
        budget = budgets.get(s.node)
        need = stage_bytes(s.start, s.end)
        if budget is not None and need > budget:
            short.append(_shortfall(s.node, s.start, s.end, need, budget))
    if short:
        raise PlacementError(
            f"the model does not fit these {len(plan.stages)} node(s): " + "; ".join(short)
            + ". Add a node or raise memory_budget_gb."
        )


# --- sizes in messages -------------------------------------------------------

MIB = 2**20


def _size(n: int) -> str:
    """Bytes as GiB with 2 decimals, plus MiB below 1 GiB, where "0.00 GiB" would say nothing (tiny models)."""
    text = f"{n / GIB:.2f} GiB"
    if abs(n) < GIB:
        text += f" ({n / MIB:.2f} MiB)"
    return text


def _shortfall(node: str, start: int, end: int, need: int, budget: int) -> str:
    return (
        f"{node} needs {_size(need)} for layers [{start}, {end}) but its memory budget is "
        f"{_size(budget)}: short by {_size(need - budget)}"
    )


# --- placement strategies ----------------------------------------------------

# uniform:  even layer counts, mlx-lm's own pipeline split; ignores memory and speed.
# memory:   layers in proportion to each node's memory budget.
# compute:  layers in proportion to each node's measured speed.
# balanced: the default; the smallest possible slowest stage (a token's trip round
#           the ring waits for every stage, so the slowest one sets the pace) that
#           still fits every budget.
# custom:   layers in proportion to the operator's per-node `proportion`.
STRATEGIES = ("uniform", "memory", "compute", "balanced", "custom")

DEFAULT_STRATEGY = "balanced"


@dataclass(frozen=True)
class NodeSpec:
    """One ring member as placement sees it, listed in ring order."""

    node: str
    addr: str
    budget: int | None  # bytes this node may hold: weights + KV reserve; None = no limit
    speed: float = 1.0  # relative compute speed, > 0 (a measured matmul GFLOP/s)
    proportion: float | None = None  # for "custom": this node's share (> 0)
    api_only: bool = False  # holds no layers (serves the API only); excluded from the stages


@dataclass(frozen=True)
class ModelCost:
    """What holding a range of layers costs a node, in bytes."""

    layers: tuple[int, ...]  # weight bytes per transformer layer
    embed: int  # embed_tokens bytes (first stage; also the last stage when tied and head == 0)
    norm: int  # final norm bytes (last stage)
    head: int  # lm_head bytes (last stage); 0 = tied embeddings
    kv_per_layer: int = 0  # KV-cache bytes a stage must keep free per layer it holds (its KV reserve)

    @classmethod
    def of(cls, info: "ModelInfo", kv_reserve_tokens: int, kv_bits: int | None = None, kv_group_size: int = 64) -> "ModelCost":
        """A model's cost: its weights by part, and room for ``kv_reserve_tokens`` positions of KV
        cache per layer (in ``kv_bits`` when the cache is quantized)."""
        w = info.weights
        return cls(tuple(w.layers), w.embed, w.norm, w.head, info.kv_bytes_per_token(kv_bits, kv_group_size) * kv_reserve_tokens)

    def stage_bytes(self, start: int, end: int) -> int:
        """Weight bytes of a stage holding layers [start, end); the rule of ringd.models.checkpoint.WeightBytes.stage."""
        n = sum(self.layers[start:end])
        if start == 0:
            n += self.embed
        if end == len(self.layers):
            # With tied embeddings the last stage needs embed_tokens for as_linear,
            # unless it is also the first stage and holds them already.
            n += self.norm + (self.head or (self.embed if start != 0 else 0))
        return n

    def stage_need(self, start: int, end: int) -> int:
        """What a stage holding layers [start, end) needs within its budget: weights plus KV reserve."""
        return self.stage_bytes(start, end) + self.kv_per_layer * (end - start)

    def per_member(self, size: int) -> "ModelCost":
        """What each member of a tensor-parallel group of ``size`` holds: a 1/size slice of every
        layer and of its KV cache (mlx-lm's shard() splits heads and MLP columns; the layers'
        norms, a small part, are kept whole and counted as sliced), and the embeddings, final
        norm and head whole (shard() leaves them alone)."""
        return ModelCost(tuple(-(-b // size) for b in self.layers), self.embed, self.norm, self.head, -(-self.kv_per_layer // size))


class _Needs:
    """ModelCost.stage_need in O(1) by prefix sums: the searches below ask it O(nodes * layers**2) times."""

    def __init__(self, cost: ModelCost):
        self.cost = cost
        self.num_layers = len(cost.layers)
        self.prefix = [0]
        for b in cost.layers:
            self.prefix.append(self.prefix[-1] + b + cost.kv_per_layer)

    def __call__(self, start: int, end: int) -> int:
        c = self.cost
        n = self.prefix[end] - self.prefix[start]
        if start == 0:
            n += c.embed
        if end == self.num_layers:
            n += c.norm + (c.head or (c.embed if start != 0 else 0))
        return n


def apportion(total: int, weights: list) -> list[int]:
    """``total`` layers in proportion to ``weights``, every node at least one.

    Largest remainder (Hamilton): each node gets the floor of its exact quota,
    the layers left over go to the largest remainders, ties to the earlier node
    in the ring. A node whose quota is under one layer gets exactly one and
    the others share the rest. Arithmetic is exact (Fractions), so the result
    never depends on float rounding. Equal weights give ``even_split``.
    """
    n = len(weights)
    if n < 1:
        raise PlacementError("a ring needs at least one node holding layers")
    if n > total:
        raise PlacementError(f"{n} nodes cannot each hold a layer of a {total}-layer model")
    w = [Fraction(x) for x in weights]
    if any(x < 0 for x in w):
        raise PlacementError(f"weights {list(weights)} must not be negative")
    if sum(w) == 0:
        w = [Fraction(1)] * n
    fixed = [False] * n  # pinned at the one-layer minimum
    while True:
        free = [i for i in range(n) if not fixed[i]]
        seats = total - (n - len(free))
        weight = sum(w[i] for i in free)
        quota = {i: seats * w[i] / weight for i in free}
        low = [i for i in free if quota[i] < 1]
        if not low:
            break
        for i in low:
            fixed[i] = True
    # `free` cannot run empty: the free quotas sum to seats >= len(free) as n <= total.
    counts = [1 if fixed[i] else math.floor(quota[i]) for i in range(n)]
    left = total - sum(counts)
    by_remainder = sorted(free, key=lambda i: (-(quota[i] - math.floor(quota[i])), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


def _fits(needs: _Needs, budgets: list[int | None], caps: list[int]) -> bool:
    """Is there a contiguous split, each node at least one layer and at most caps[i], within every budget?

    Forward reachability over the boundary between stages. A plain greedy
    (each node takes the most it can) is not enough: with uneven layer sizes
    taking more can hand the next, small node a layer too big for it.
    """
    n, total = len(budgets), needs.num_layers
    reach = [False] * (total + 1)
    reach[0] = True
    for i in range(n):
        later = n - 1 - i  # each later node still needs a layer
        nxt = [False] * (total + 1)
        for s in range(i, total - later):
            if not reach[s]:
                continue
            for e in range(s + 1, min(s + caps[i], total - later) + 1):
                if budgets[i] is not None and needs(s, e) > budgets[i]:
                    break  # a stage's need only grows with its end
                nxt[e] = True
        reach = nxt
    return reach[total]


def _closest_fit(needs: _Needs, budgets: list[int | None], caps: list[int], target: list[int]) -> list[int] | None:
    """The split within budgets and caps that moves the fewest layers away from ``target``, or None.

    Exact, by dynamic programming over stage boundaries: cost is
    sum |counts[i] - target[i]|; among equal costs earlier nodes take more
    (as even_split's low stages take the extra), so the answer is deterministic.
    """
    n, total = len(budgets), needs.num_layers
    best: list[list[int | None]] = [[None] * (total + 1) for _ in range(n + 1)]
    best[n][total] = 0
    ends: list[list[list[int]]] = [[[] for _ in range(total + 1)] for _ in range(n)]

    for i in reversed(range(n)):
        later = n - 1 - i
        for s in range(i, total - later):
            options = ends[i][s]
            for e in range(s + 1, min(s + caps[i], total - later) + 1):
                if budgets[i] is not None and needs(s, e) > budgets[i]:
                    break
                if best[i + 1][e] is not None:
                    options.append(e)
            if options:
                best[i][s] = min(abs(e - s - target[i]) + best[i + 1][e] for e in options)
    if best[0][0] is None:
        return None
    counts, s = [], 0
    for i in range(n):
        e = max(e for e in ends[i][s] if abs(e - s - target[i]) + best[i + 1][e] == best[i][s])
        counts.append(e - s)
        s = e
    return counts


def _least_short(needs: _Needs, budgets: list[int | None], target: list[int]) -> list[int]:
    """The split with the least total memory shortfall (then closest to ``target``): what the error reports."""
    n, total = len(budgets), needs.num_layers
    inf = (math.inf, math.inf)
    best = [[inf] * (total + 1) for _ in range(n + 1)]
    best[n][total] = (0, 0)
    choice = [[0] * (total + 1) for _ in range(n)]
    for i in reversed(range(n)):
        later = n - 1 - i
        for s in range(i, total - later):
            for e in range(s + 1, total - later + 1):
                short = 0 if budgets[i] is None else max(0, needs(s, e) - budgets[i])
                rest = best[i + 1][e]
                c = (short + rest[0], abs(e - s - target[i]) + rest[1])
                if c <= best[i][s]:  # `<=` with rising e: ties go to the larger earlier stage
                    best[i][s], choice[i][s] = c, e
    counts, s = [], 0
    for i in range(n):
        counts.append(choice[i][s] - s)
        s = choice[i][s]
    return counts


def _does_not_fit(active: list[NodeSpec], needs: _Needs, counts: list[int], closest: bool) -> PlacementError:
    """The error for ``counts``: each short node with need, budget and shortfall, and the ring's total."""
    short, total_need, s = [], 0, 0
    for spec, c in zip(active, counts):
        need = needs(s, s + c)
        total_need += need
        if spec.budget is not None and need > spec.budget:
            short.append(_shortfall(spec.node, s, s + c, need, spec.budget))
        s += c
    lead = (
        f"the model does not fit these {len(active)} node(s) in any split; in the closest, {counts}, "
        if closest
        else f"split {counts} does not fit these {len(active)} node(s): "
    )
    text = lead + "; ".join(short)
    budgets = [spec.budget for spec in active]
    if closest and all(b is not None for b in budgets):
        have = sum(budgets)
        if have < total_need:
            text += (
                f". In all the model needs {_size(total_need)} (weights + KV reserve) and the budgets add up to "
                f"{_size(have)}: short by {_size(total_need - have)}"
            )
        else:
            text += (
                f". The budgets add up to {_size(have)}, enough for the model's {_size(total_need)} in all, "
                "but no contiguous split of its layers fits every node"
            )
    return PlacementError(text + ". Add a node or raise memory_budget_gb.")


def _check_nodes(nodes: list[NodeSpec], cost: ModelCost) -> list[NodeSpec]:
    """The nodes that hold layers, after refusing what no strategy can place."""
    names = [n.node for n in nodes]
    if len(set(names)) != len(names):
        raise PlacementError(f"a node appears twice in the ring: {names}")
    active = [n for n in nodes if not n.api_only]
    if not active:
        raise PlacementError(f"no node holds layers: all of {names} are api_only")
    total = len(cost.layers)
    if total < 1:
        raise PlacementError("the model has no layers to place")
    if len(active) > total:
        raise PlacementError(
            f"{len(active)} nodes cannot each hold a layer of a {total}-layer model; mark some api_only"
        )
    for n in active:
        if not (isinstance(n.speed, (int, float)) and math.isfinite(n.speed) and n.speed > 0):
            raise PlacementError(f"node {n.node} has speed {n.speed!r}; a speed must be a finite number > 0")
    return active


def _check_split(split: list[int], active: list[NodeSpec], total: int) -> None:
    names = [n.node for n in active]
    if len(split) != len(active):
        raise PlacementError(
            f"split {list(split)} has {len(split)} entries for the {len(active)} node(s) holding layers {names}"
        )
    if any(not isinstance(c, int) or c < 1 for c in split):
        raise PlacementError(f"split {list(split)}: every node holding layers needs at least one")
    if sum(split) != total:
        raise PlacementError(f"split {list(split)} sums to {sum(split)}, but the model has {total} layers")


def _weights(strategy: str, active: list[NodeSpec]) -> list:
    """What each proportional strategy shares the layers by."""
    if strategy == "uniform":
        return [1] * len(active)
    if strategy == "memory":
        finite = [n.budget for n in active if n.budget is not None]
        # No limit shares like the roomiest limited node; with no limits at all, evenly.
        unlimited = max(finite) if finite else 1
        return [unlimited if n.budget is None else max(n.budget, 0) for n in active]
    if strategy in ("compute", "balanced"):
        return [n.speed for n in active]
    if strategy == "custom":
        bad = [
            n.node
            for n in active
            if not (isinstance(n.proportion, (int, float)) and math.isfinite(n.proportion) and n.proportion > 0)
        ]
        if bad:
            raise PlacementError(
                f"strategy custom needs a proportion > 0 for every node holding layers; missing or invalid for {bad}"
            )
        return [n.proportion for n in active]
    raise PlacementError(f"unknown placement strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def _balanced(needs: _Needs, active: list[NodeSpec], target: list[int]) -> list[int] | None:
    """Smallest slowest-stage time within budgets, then the split closest to ``target`` at that time."""
    total = needs.num_layers
    budgets = [n.budget for n in active]
    speeds = [Fraction(n.speed) for n in active]

    def caps(t: Fraction) -> list[int]:
        # The most layers node i can hold in time t: layers / speed <= t.
        return [min(total, math.floor(t * v)) for v in speeds]

    # The optimum is some stage's layers / speed, so it is one of these.
    lower = Fraction(total) / sum(speeds)  # perfect sharing: no split beats it
    candidates = sorted({Fraction(k) / v for v in speeds for k in range(1, total + 1)})
    candidates = [t for t in candidates if t >= lower] or [candidates[-1]]
    if not _fits(needs, budgets, caps(candidates[-1])):
        return None  # not even with no regard for time: memory is the limit
    lo, hi = 0, len(candidates) - 1  # feasibility only grows with time; find the first feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(needs, budgets, caps(candidates[mid])):
            hi = mid
        else:
            lo = mid + 1
    return _closest_fit(needs, budgets, caps(candidates[lo]), target)


def place(strategy: str, nodes: list[NodeSpec], cost: ModelCost, split: list[int] | None = None) -> list[int]:
    """Layer counts per node in the given (ring) order; 0 for api_only nodes.

    ``split``, counts for the nodes holding layers in order, overrides the
    strategy; it is used as given and refused if a stage exceeds its budget.

    - uniform, memory, compute, custom share the layers in proportion to
      their weight (``apportion``: largest remainder, at least one layer each,
      ties to the earlier node). When that split exceeds a budget, the split
      within every budget that moves the fewest layers from it is used instead;
      they raise only when no split fits.
    - balanced minimizes the slowest stage's time, max(layers_i / speed_i),
      subject to every budget; among the optimal splits it takes the one
      closest to proportional-to-speed (equal nodes: exactly even_split).

    Raises PlacementError when nothing fits, naming each node's shortfall in
    the closest split and the ring's total when the budgets cannot add up.
    Deterministic: exact arithmetic, no clocks, no randomness.
    """
    active = _check_nodes(nodes, cost)
    total = len(cost.layers)
    needs = _Needs(cost)
    budgets = [n.budget for n in active]
    if split is not None:
        _check_split(split, active, total)
        counts = list(split)
        s = 0
        for b, c in zip(budgets, counts):
            if b is not None and needs(s, s + c) > b:
                raise _does_not_fit(active, needs, counts, closest=False)
            s += c
    else:
        target = even_split(total, len(active)) if strategy == "uniform" else apportion(total, _weights(strategy, active))
        if strategy == "balanced":
            found = _balanced(needs, active, target)
        else:
            found = _closest_fit(needs, budgets, [total] * len(active), target)
        if found is None:
            raise _does_not_fit(active, needs, _least_short(needs, budgets, target), closest=True)
        counts = found
    it = iter(counts)
    return [0 if n.api_only else next(it) for n in nodes]


def shortfall(nodes: list[NodeSpec], cost: ModelCost) -> str | None:
    """Whether these nodes' memory holds the model: None when some split of its layers fits every
    budget (weights plus KV reserve: the rule ``place`` refuses by, whatever the strategy), else
    why not, in a line. Cheap (no search for the closest split, which ``place``'s error names)
    and remembered for the last SHORTFALLS_KEPT (nodes, model) pairs: a model list asks it for
    every model on disk each time it is read."""
    return _holds(tuple(nodes), cost)


def fit_note(nodes: list[NodeSpec], cost: ModelCost) -> str | None:
    """None when the model does not fit these nodes (``shortfall``), else how it fits, for a reason
    a user reads: "needs 1.20 of 3.00 GiB" (weights + KV reserve of one stage holding every layer,
    against the budgets)."""
    if shortfall(nodes, cost) is not None:
        return None
    budgets = [n.budget for n in nodes if not n.api_only]
    need = cost.stage_need(0, len(cost.layers))
    if any(b is None for b in budgets):
        return f"needs {_size(need)}; some have no memory limit"
    return f"needs {_size(need)} of {_size(sum(budgets))}"


# Answers shortfall keeps: a model list of up to 500 models (models/catalogue.py), twice over.
SHORTFALLS_KEPT = 1024


@functools.lru_cache(maxsize=SHORTFALLS_KEPT)
def _holds(nodes: tuple[NodeSpec, ...], cost: ModelCost) -> str | None:
    try:
        active = _check_nodes(list(nodes), cost)
    except PlacementError as e:
        return str(e)
    needs, budgets = _Needs(cost), [n.budget for n in active]
    if _fits(needs, budgets, [needs.num_layers] * len(active)):
        return None
    # At least what one stage holding every layer needs: more stages only add (a tied head's copy).
    least, have = needs(0, needs.num_layers), sum(b for b in budgets if b is not None)
    if have < least:
        return f"it needs at least {_size(least)} (weights + KV reserve) and the budgets of the {len(active)} node(s) holding layers add up to {_size(have)}: short by {_size(least - have)}"
    return f"the budgets of the {len(active)} node(s) holding layers add up to {_size(have)}, but no split of its layers fits every node's budget"


def tensor_groups(nodes: list[NodeSpec], size: int) -> tuple[list[NodeSpec], dict[str, tuple[tuple[str, str], ...]], list[tuple[str, str]]]:
    """Groups of ``size`` consecutive holders in ring order, each placed as one node: the group's
    first, with the smallest budget among its members (each holds the same slice) and ``size``
    times its slowest member's speed (each computes 1/size of every layer). Returns the nodes as
    placement sees them (API-only ones as they were), each group's other members by its first,
    and the holders left over (fewer than ``size``) with why."""
    holders = [n for n in nodes if not n.api_only]
    whole = len(holders) - len(holders) % size
    out, groups = [n for n in nodes if n.api_only], {}
    for i in range(0, whole, size):
        members = holders[i : i + size]
        budgets = [m.budget for m in members]
        budget = None if all(b is None for b in budgets) else min(b for b in budgets if b is not None)
        first = members[0]
        out.append(NodeSpec(first.node, first.addr, budget, size * min(m.speed for m in members), first.proportion))
        groups[first.node] = tuple((m.node, m.addr) for m in members[1:])
    left = [(n.node, f"{n.node} holds no layers: {len(holders)} nodes do not make whole tensor-parallel groups of {size}") for n in holders[whole:]]
    if not groups:
        raise PlacementError(f"tensor_parallel {size} needs at least {size} nodes that hold layers; there are {len(holders)}")
    return out, groups, left


def plan_for(
    term: int,
    leader: str,
    model: str,
    nodes: list[NodeSpec],
    cost: ModelCost,
    strategy: str = DEFAULT_STRATEGY,
    split: list[int] | None = None,
) -> Plan:
    """place() then a Plan of the nodes holding layers (api_only ones left out), then check the budgets.

    Raises PlacementError.
    """
    counts = place(strategy, nodes, cost, split)
    holders = [(n, c) for n, c in zip(nodes, counts) if not n.api_only]
    plan = make_plan(term, leader, model, len(cost.layers), [(n.node, n.addr) for n, _ in holders], [c for _, c in holders])
    check_budgets(plan, cost.stage_need, {n.node: n.budget for n in nodes})
    return plan
