"""The status document: what ``GET /cluster/status`` and ``/health`` say, written and read here.

A node writes its own (``node/status.py``), the one it asks answers with its peers' and
the plan; ``ringctl``, ``ringd local``, the benches and the tests read them back. Both
sides go through these types, so a key is named once. Reading is forgiving: a
document from a node of another version, or one that did not answer, is a status with
less said (a field missing or of the wrong type reads as unknown: None, or empty), never
an error, and no reader checks types again. The dashboard (``http/web/``) reads the same JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    node: str
    ready: bool = False
    reason: str = ""
    error: str = ""  # the node did not answer, and why ("" when it did): nothing else is known
    role: str = ""  # "leader" or "follower"
    leader: str | None = None
    election_term: list | None = None  # [number, node]
    pin: str | None = None  # the node pinned to lead (ringctl leader set)
    term: int = 0  # the plan it runs
    # What the node knows of itself.
    addr: str = ""  # its ring port, host:port
    http: str = ""  # its API, host:port
    model: str = ""  # the model id it serves
    speed: float | None = None  # measured, GFLOP/s
    device: dict | None = None  # its chip and memory (device.DeviceProfile.to_wire)
    discovery: dict | None = None  # enabled, advertising, found
    ring_encryption: bool = False
    tls: str = "off"
    instances: list[dict] = dataclasses.field(default_factory=list)  # the leader's models now (ringctl ps)
    instance_stages: list[dict] = dataclasses.field(default_factory=list)  # its stages of those
    # The models the leader keeps loaded, as its heartbeats say: what the next leader loads again.
    kept_models: list[dict] = dataclasses.field(default_factory=list)
    budget: int | None = None  # bytes for weights + KV cache
    task_restarts: dict = dataclasses.field(default_factory=dict)  # supervised task -> restarts
    # Its stage of the configured model.
    stage: int | None = None  # index in the plan; None: outside it
    layers: list[int] | None = None  # [start, end)
    engine: str | None = None  # a tensor-parallel group's collective (stage/groupengine.py)
    sessions: int | None = None
    kv_bytes: int | None = None
    parameter_bytes: int | None = None
    prefix_entries: int | None = None
    kv_cost: dict | None = None  # what a request's caches cost here, measured at load
    report: dict | None = None  # what its heartbeats say of the stage (reconcile.Report)
    progress: dict | None = None  # while it downloads or reads its layers (models/progress.py)
    kv_capacity: int | None = None  # KV bytes its budget leaves beside its layers
    # The leader's.
    prefix_reuse: str = ""  # why cached prefixes are off or limited for this model, else ""
    prefill_chunk: int | None = None  # prompt tokens a chunk takes now (sized to prefill_chunk_s)
    queued_requests: int | None = None
    active_requests: int | None = None
    peers: list[str] = dataclasses.field(default_factory=list)
    links: dict = dataclasses.field(default_factory=dict)  # peer -> {number, encrypted}
    drained: list[str] = dataclasses.field(default_factory=list)
    stats: dict | None = None  # live figures: tokens/s, time to first token (ringctl top, the dashboard)
    layout: dict | None = None  # the ring as its links shape it (ringctl plan)

    def to_wire(self) -> dict:
        if self.error:
            return {"node": self.node, "ready": False, "error": self.error}
        d = dataclasses.asdict(self)
        del d["error"]
        return d

    @classmethod
    def parse(cls, d: Any) -> NodeStatus:
        d = d if isinstance(d, dict) else {}
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in d and _fits(d[f.name], _KINDS[f.name]):
                values[f.name] = d[f.name]
        values["node"] = d["node"] if isinstance(d.get("node"), str) else "?"
        return cls(**values)

    @property
    def leading(self) -> bool:
        return self.role == "leader"


@dataclasses.dataclass(frozen=True)
class ClusterStatus:
    """``GET /cluster/status``: the node asked, whom it follows, the plan, and every node's status
    (the ring's in ring order, then everyone else linked)."""

    node: str
    leader: str | None = None
    ready: bool = False
    reason: str = ""
    plan: dict | None = None  # ring.plan.Plan.to_wire
    nodes: list[NodeStatus] = dataclasses.field(default_factory=list)

    def to_wire(self) -> dict:
        return {
            "node": self.node, "leader": self.leader, "ready": self.ready, "reason": self.reason, "plan": self.plan,
            "nodes": [n.to_wire() for n in self.nodes],
        }  # fmt: skip

    @classmethod
    def parse(cls, d: Any) -> ClusterStatus:
        d = d if isinstance(d, dict) else {}
        nodes = d.get("nodes") if isinstance(d.get("nodes"), list) else []
        return cls(
            node=d["node"] if isinstance(d.get("node"), str) else "?",
            leader=d["leader"] if isinstance(d.get("leader"), str) else None,
            ready=d.get("ready") is True, reason=d["reason"] if isinstance(d.get("reason"), str) else "",
            plan=d["plan"] if isinstance(d.get("plan"), dict) else None,
            nodes=[NodeStatus.parse(n) for n in nodes if isinstance(n, dict)],
        )  # fmt: skip

    def status_of(self, node: str | None) -> NodeStatus | None:
        return next((n for n in self.nodes if n.node == node), None)


def _fits(value: Any, kind: tuple) -> bool:
    """Whether a value read from JSON is of ``kind`` (bool is no number; None only where allowed)."""
    if value is None:
        return type(None) in kind
    if isinstance(value, bool):
        return bool in kind
    if isinstance(value, int) and float in kind:
        return True
    return isinstance(value, tuple(k for k in kind if k is not type(None)))


def _kinds() -> dict[str, tuple]:
    """Each field's JSON kinds, from its annotation."""
    names = {"str": str, "bool": bool, "int": int, "float": float, "dict": dict, "list": list, "None": type(None)}
    out = {}
    for f in dataclasses.fields(NodeStatus):
        parts = [p.strip().split("[")[0] for p in str(f.type).split("|")]
        out[f.name] = tuple(names[p] for p in parts)
    return out


_KINDS = _kinds()
