"""Which node runs which layers: pure functions from members to a Plan.

A Plan is the ring order and each stage's contiguous layer range, stamped with
the term of the leader that made it. Nothing here touches the network or MLX;
the leader computes a plan and sends ``Plan.to_wire()`` to every member.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class PlacementError(ValueError):
    """No valid plan for these members and this model; the message says why."""


@dataclass(frozen=True)
class Stage:
    node: str
    addr: str  # host:port of the node's ring listener, so stages can dial their successor
    start: int
    end: int

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    term: int
    leader: str  # the node that made the plan, serves the API and receives sampled tokens
    model: str  # the model's fingerprint: every node must have loaded the same model
    num_layers: int
    stages: tuple[Stage, ...]

    def __post_init__(self):
        if not self.stages:
            raise PlacementError("a plan needs at least one stage")
        expected = 0
        for s in self.stages:
            if s.start != expected or s.end <= s.start:
                raise PlacementError(
                    f"stage {s.node} has layers [{s.start}, {s.end}); stages must cover "
                    f"[0, {self.num_layers}) contiguously, each with at least one layer"
                )
            expected = s.end
        if expected != self.num_layers:
            raise PlacementError(f"the stages cover {expected} of {self.num_layers} layers")
        nodes = [s.node for s in self.stages]
        if len(set(nodes)) != len(nodes):
            raise PlacementError(f"a node appears twice in the ring: {nodes}")

    def index_of(self, node: str) -> int | None:
        for i, s in enumerate(self.stages):
            if s.node == node:
                return i
        return None

    def successor(self, node: str) -> Stage | None:
        """The stage after ``node``'s, or None for the last stage."""
        i = self.index_of(node)
        if i is None or i + 1 == len(self.stages):
            return None
        return self.stages[i + 1]

    @property
    def split(self) -> list[int]:
        return [s.layers for s in self.stages]

    def to_wire(self) -> dict:
        return {
            "term": self.term,
            "leader": self.leader,
            "model": self.model,
            "num_layers": self.num_layers,
            "stages": [[s.node, s.addr, s.start, s.end] for s in self.stages],
        }

    @classmethod
    def from_wire(cls, d: object) -> "Plan":
        try:
            stages = tuple(Stage(str(n), str(a), int(s), int(e)) for n, a, s, e in d["stages"])
            return cls(int(d["term"]), str(d["leader"]), str(d["model"]), int(d["num_layers"]), stages)
        except (KeyError, TypeError, ValueError) as e:
            raise PlacementError(f"malformed plan {d!r}: {e}") from None


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage, as even as possible, low stages taking the extra.

    28 layers over 3 stages is [10, 9, 9], as mlx-lm's pipeline splits them.
    """
    if num_stages < 1:
        raise PlacementError("a ring needs at least one node")
    if num_stages > num_layers:
        raise PlacementError(f"{num_stages} nodes cannot each hold a layer of a {num_layers}-layer model")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def parse_split(text: str) -> list[int]:
    """'7,5,1' -> [7, 5, 1]; each count a positive integer."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise PlacementError(f"split {text!r} must be comma-separated layer counts like 10,9,9") from None
    if any(c < 1 for c in counts):
        raise PlacementError(f"split {text!r}: every stage needs at least one layer")
    return counts


def make_plan(
    term: int,
    leader: str,
    model: str,
    num_layers: int,
    members: list[tuple[str, str]],
    split: list[int] | None = None,
) -> Plan:
    """Members (node, addr) in ring order -> a Plan with ``split`` or an even split."""
    counts = split if split is not None else even_split(num_layers, len(members))
    if len(counts) != len(members):
        raise PlacementError(f"split {counts} has {len(counts)} entries for {len(members)} nodes")
    if sum(counts) != num_layers:
        raise PlacementError(f"split {counts} sums to {sum(counts)}, but the model has {num_layers} layers")
    stages, start = [], 0
    for (node, addr), n in zip(members, counts):
        stages.append(Stage(node, addr, start, start + n))
        start += n
    return Plan(term, leader, model, num_layers, tuple(stages))


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
            short.append(
                f"{s.node} needs {need / GIB:.2f} GiB for layers [{s.start}, {s.end}) but its memory budget is "
                f"{budget / GIB:.2f} GiB (short by {(need - budget) / GIB:.2f} GiB)"
            )
    if short:
        raise PlacementError(
            f"the model does not fit these {len(plan.stages)} node(s): " + "; ".join(short)
            + ". Add a node or raise memory_budget_gb."
        )


def natural_key(name: str) -> list:
    """Order node names as people do: node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
