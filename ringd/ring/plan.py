"""A plan: the ring's order and each stage's contiguous layer range, stamped with a term.

The leader makes a plan (``cluster/placement.py`` decides the split) and sends
``Plan.to_wire()`` to every member; a stage loads what its range asks, and
frames of another term are not its ring's. Every field from the network is
checked against a named limit here. A plain value: no MLX, no I/O.

A stage may be a tensor-parallel group: ``Stage.node`` is where frames enter and
leave it, and ``Stage.group`` names the other Macs that hold a slice of each of
its layers (``stage/tensorgroup.py``). The ring around a group is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringd.base.names import check_name

# Bounds on a plan from the network (checked before anything is built from it):
# far above any real model or cluster, low enough that a bad plan is cheap to refuse.
MAX_LAYERS = 10_000  # the deepest mlx-lm models have about 100
MAX_STAGES = 256  # a ring of a dozen Macs, with room to spare
# Macs in one tensor-parallel group: mlx-lm's shard() splits heads evenly, and models have
# 8 to 128 of them; past a few Macs the all-reduces cost more than the slices save.
MAX_GROUP = 16
MAX_TERM = 2**53 - 1  # terms travel in JSON; beyond this not every reader holds them exactly
MAX_FINGERPRINT_CHARS = 256
MAX_ADDR_CHARS = 64  # "[ipv6]:port"
# An instance's name and the model name its nodes resolve: what a request's ``model`` may be
# (an Ollama name, OWNER/REPO:QUANT, a path under models_dir), with a replica's "#N".
MAX_INSTANCE_CHARS = 300


class PlacementError(ValueError):
    """No valid plan for these members and this model; the message says why."""


@dataclass(frozen=True)
class Stage:
    node: str
    addr: str  # host:port of the node's ring listener, so stages can dial their successor
    start: int
    end: int
    # A tensor-parallel group's other members (node, addr), in rank order after ``node`` (rank 0):
    # each holds a 1/k slice of every layer in [start, end). Empty: the stage is one Mac.
    group: tuple[tuple[str, str], ...] = ()

    @property
    def layers(self) -> int:
        return self.end - self.start

    @property
    def members(self) -> tuple[str, ...]:
        """The stage's Macs in rank order: ``node`` first (frames enter and leave there)."""
        return (self.node, *(n for n, _ in self.group))


@dataclass(frozen=True)
class Plan:
    term: int
    leader: str  # the node that made the plan, serves the API and receives sampled tokens
    model: str  # the model's fingerprint: every node must have loaded the same model
    num_layers: int
    stages: tuple[Stage, ...]
    # Which of the leader's instances this plan is the ring of ("": the model the cluster was
    # started with), and the name each node finds that instance's model by in its own model list
    # ("": its configured model). Plans of different instances are independent; their terms differ.
    instance: str = ""
    source: str = ""

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
        nodes = self.nodes
        if len(set(nodes)) != len(nodes):
            raise PlacementError(f"a node appears twice in the ring: {list(nodes)}")

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every Mac that holds layers: each stage's members, in ring order."""
        return tuple(n for s in self.stages for n in s.members)

    def index_of(self, node: str) -> int | None:
        """The stage ``node`` holds layers of (as a group's member too), or None."""
        for i, s in enumerate(self.stages):
            if node in s.members:
                return i
        return None

    def successor(self, node: str) -> Stage | None:
        """The stage after ``node``'s, or None for the last stage."""
        i = self.index_of(node)
        if i is None or i + 1 == len(self.stages):
            return None
        return self.stages[i + 1]

    def predecessor(self, node: str) -> str | None:
        """The one node ``node``'s stage takes FORWARD and RELEASE frames from: the one before it
        in the ring (the leader, for stage 0), or for a tensor-parallel group's other members, the
        group's first (it relays them). None when ``node`` holds no stage."""
        i = self.index_of(node)
        if i is None:
            return None
        first = self.stages[i].node
        return first if node != first else self.leader if i == 0 else self.stages[i - 1].node

    @property
    def split(self) -> list[int]:
        return [s.layers for s in self.stages]

    def to_wire(self) -> dict:
        d = {
            "term": self.term,
            "leader": self.leader,
            "model": self.model,
            "num_layers": self.num_layers,
            "stages": [[s.node, s.addr, s.start, s.end] + ([[list(m) for m in s.group]] if s.group else []) for s in self.stages],
        }
        if self.instance or self.source:
            d.update(instance=self.instance, source=self.source)
        return d

    @classmethod
    def from_wire(cls, d: object) -> "Plan":
        """A plan from the network: every field checked, any flaw a PlacementError."""
        def count(what: str, v: object, limit: int) -> int:
            if type(v) is not int or not 0 <= v <= limit:
                raise PlacementError(f"plan {what} must be an integer from 0 to {limit}, got {v!r:.40}")
            return v

        def name(what: str, v: object) -> str:
            try:
                return check_name(v)
            except ValueError as e:
                raise PlacementError(f"plan {what} {v!r:.80}: {e}") from None

        keys = {"term", "leader", "model", "num_layers", "stages"}
        if not isinstance(d, dict) or set(d) not in (keys, keys | {"instance", "source"}):
            raise PlacementError(f"a plan has exactly term, leader, model, num_layers and stages (and instance, source); got {d!r:.200}")
        instance, source = d.get("instance", ""), d.get("source", "")
        for what, v in (("instance", instance), ("source", source)):
            if not isinstance(v, str) or len(v) > MAX_INSTANCE_CHARS or not v.isprintable():
                raise PlacementError(f"plan {what} must be a printable string of at most {MAX_INSTANCE_CHARS} characters")
        model, stages = d["model"], d["stages"]
        if not isinstance(model, str) or len(model) > MAX_FINGERPRINT_CHARS:
            raise PlacementError(f"plan model must be a fingerprint of at most {MAX_FINGERPRINT_CHARS} characters")
        if not isinstance(stages, list) or not 1 <= len(stages) <= MAX_STAGES:
            raise PlacementError(f"plan stages must be a list of 1 to {MAX_STAGES} stages")
        num_layers = count("num_layers", d["num_layers"], MAX_LAYERS)
        def address(what: str, v: object) -> str:
            if not isinstance(v, str) or len(v) > MAX_ADDR_CHARS:
                raise PlacementError(f"plan {what}: the address must be a string of at most {MAX_ADDR_CHARS} characters")
            return v

        parsed = []
        for i, stage in enumerate(stages):
            if not isinstance(stage, list) or len(stage) not in (4, 5):
                raise PlacementError(f"plan stage {i} must be [node, address, start, end] or with [[node, address], ...] of its group, got {stage!r:.100}")
            node, addr, start, end = stage[:4]
            members = stage[4] if len(stage) == 5 else []
            if not isinstance(members, list) or not 1 <= len(members) + 1 <= MAX_GROUP or (len(stage) == 5 and not members):
                raise PlacementError(f"plan stage {i}: a group is a list of 1 to {MAX_GROUP - 1} [node, address] beside its first node")
            group = []
            for j, m in enumerate(members):
                if not isinstance(m, list) or len(m) != 2:
                    raise PlacementError(f"plan stage {i} group member {j} must be [node, address], got {m!r:.100}")
                group.append((name(f"stage {i} group member {j}", m[0]), address(f"stage {i} group member {j}", m[1])))
            parsed.append(Stage(
                name(f"stage {i} node", node), address(f"stage {i}", addr), count(f"stage {i} start", start, num_layers),
                count(f"stage {i} end", end, num_layers), tuple(group),
            ))  # fmt: skip
        return cls(count("term", d["term"], MAX_TERM), name("leader", d["leader"]), model, num_layers, tuple(parsed), instance, source)


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
    instance: str = "",
    source: str = "",
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
    return Plan(term, leader, model, num_layers, tuple(stages), instance, source)


def with_groups(plan: Plan, groups: dict[str, tuple[tuple[str, str], ...]]) -> Plan:
    """``plan`` with each stage whose node heads a tensor-parallel group given the group's other
    members (node, addr), in rank order."""
    stages = tuple(replace(s, group=tuple(groups.get(s.node, ()))) for s in plan.stages)
    return replace(plan, stages=stages)
