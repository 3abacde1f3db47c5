"""The daemon's own messages between nodes (heartbeats, election notes, plan answers), parsed strictly.

Frames on a link come from a member that proved the cluster secret, but
members run other versions, have bugs, or are confused after a partition. So
every descriptor here is parsed into a typed value or refused with
``MessageError`` naming what is wrong, never another exception; the caller
ignores a refused message and keeps the link. And every message is bounded by
construction: a heartbeat the node builds always fits a frame, whatever the
drain list or the gossip hold (a heartbeat that did not fit once killed the
heartbeat task and with it the cluster).

FORWARD, TOKEN and RELEASE belong to the ring's hot path and are parsed in
``stage/runner.py`` and ``engine.py``; PLAN in ``placement.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ringd.cluster.election import Announce, ElectionError, Term
from ringd.cluster.linkcost import Clock, Measured
from ringd.cluster.sharing import MAX_REPLICAS
from ringd.ring.plan import MAX_ADDR_CHARS, MAX_INSTANCE_CHARS
from ringd.cluster.reconcile import Report, ReportError
from ringd.base.names import check_name, parse_hostport

# Peers one heartbeat may tell of: far above any real cluster (a dozen Macs),
# low enough that a confused peer cannot make us dial thousands.
MAX_GOSSIPED_PEERS = 64
# Nodes `ringctl drain` may keep out at once: every node of the largest cluster.
MAX_DRAINED = 64
# Instances a node may hold stages of besides the configured model's: each is a whole model's
# layers range in memory, so a Mac holds a handful; this bounds what a heartbeat carries.
MAX_INSTANCES = 32
# Links a heartbeat reports the cost of, and echoes it carries: one per peer, as many as it gossips.
MAX_LINK_REPORTS = MAX_GOSSIPED_PEERS
# A measured RTT a report may carry, in microseconds: an hour; a link slower than that is dead.
MAX_RTT_US = 3_600_000_000
# A keep_alive a pool model may carry: a year (Ollama's -1, forever, is null).
MAX_KEEP_ALIVE_S = 365 * 86400.0
# Why the leader does not serve, as followers repeat it in /health: one line.
MAX_REASON_CHARS = 300


class MessageError(ValueError):
    """A malformed message from a peer; the message says what. Ignore it, keep the link."""


@dataclass(frozen=True)
class PoolModel:
    """One model the leader keeps loaded besides the configured one (or the configured model's
    replicas), as its heartbeats tell followers, so that a leader elected after it loads them
    again: ``model`` what it was loaded by ("": the configured model), ``keep_alive`` how long it
    stays once idle (None: for good), ``instances`` its instances' names (its replicas)."""

    model: str
    keep_alive: float | None
    instances: tuple[str, ...]

    def __post_init__(self):
        if not isinstance(self.model, str) or len(self.model) > MAX_INSTANCE_CHARS or not self.model.isprintable():
            raise MessageError(f"a pool model's name is a printable string of at most {MAX_INSTANCE_CHARS} characters")
        if self.keep_alive is not None and (
            not isinstance(self.keep_alive, (int, float)) or isinstance(self.keep_alive, bool) or not 0 <= self.keep_alive <= MAX_KEEP_ALIVE_S
        ):
            raise MessageError(f"a pool model's keep_alive is null or seconds from 0 to {MAX_KEEP_ALIVE_S:.0f}, got {self.keep_alive!r:.40}")
        if not isinstance(self.instances, tuple) or not 1 <= len(self.instances) <= MAX_REPLICAS:
            raise MessageError(f"a pool model has 1 to {MAX_REPLICAS} instances")
        for name in self.instances:
            if not isinstance(name, str) or len(name) > MAX_INSTANCE_CHARS or not name.isprintable():
                raise MessageError(f"a pool instance's name is a printable string of at most {MAX_INSTANCE_CHARS} characters")

    def to_wire(self) -> dict:
        return {"model": self.model, "keep_alive": self.keep_alive, "instances": list(self.instances)}

    @classmethod
    def from_wire(cls, d: object) -> "PoolModel":
        if not isinstance(d, dict) or set(d) != {"model", "keep_alive", "instances"} or not isinstance(d["instances"], list):
            raise MessageError(f"a pool model is {{model, keep_alive, instances: [...]}}, got {d!r:.200}")
        keep_alive = d["keep_alive"]
        return cls(d["model"], float(keep_alive) if isinstance(keep_alive, int) and not isinstance(keep_alive, bool) else keep_alive, tuple(d["instances"]))


def _node(what: str, v: object) -> str:
    try:
        return check_name(v)
    except ValueError as e:
        raise MessageError(f"{what} {v!r:.80}: {e}") from None


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Heartbeat:
    """What a node tells every peer every heartbeat (and what a lost message repeats).

    ``election``: its election state. ``report``: which plan its stage runs.
    ``knows``: whom it is linked with (node -> ring address), so that one static
    peer is enough to find the whole cluster. From the leader only: ``drained``
    (followers keep it, so a new leader keeps it too), and ``serving`` (the plan
    it serves, None if it does not) with ``reason`` (why not), for followers'
    /health.
    """

    election: Announce
    report: Report
    knows: dict[str, str]
    drained: tuple[str, ...] | None = None
    serving: Term | None = None
    reason: str = ""
    instances: tuple[Report, ...] = ()  # its stages of the leader's other instances (``report`` is the configured model's)
    # Both optional (a node of an older version sends neither): ``clock``, the send time and
    # echoes its peers measure their RTT to it by (cluster/linkcost.py); ``links``, its measured
    # links, which the leader places the ring by.
    clock: Clock | None = None
    links: dict[str, Measured] = field(default_factory=dict)
    # From the leader (optional too): the models it keeps loaded besides the configured one.
    pool: tuple[PoolModel, ...] | None = None

    def __post_init__(self):
        if self.pool is not None and sum(len(m.instances) for m in self.pool) > MAX_INSTANCES:
            raise MessageError(f"a heartbeat's pool names at most {MAX_INSTANCES} instances")
        if len(self.instances) > MAX_INSTANCES:
            raise MessageError(f"a heartbeat reports at most {MAX_INSTANCES} instances, not {len(self.instances)}")
        if len(self.knows) > MAX_GOSSIPED_PEERS:
            raise MessageError(f"a heartbeat tells of at most {MAX_GOSSIPED_PEERS} peers, not {len(self.knows)}")
        if self.drained is not None and len(self.drained) > MAX_DRAINED:
            raise MessageError(f"at most {MAX_DRAINED} nodes may be drained, not {len(self.drained)}")
        if len(self.reason) > MAX_REASON_CHARS:
            raise MessageError(f"a heartbeat's reason is at most {MAX_REASON_CHARS} characters")
        if len(self.links) > MAX_LINK_REPORTS or (self.clock is not None and len(self.clock.echo) > MAX_LINK_REPORTS):
            raise MessageError(f"a heartbeat reports and echoes at most {MAX_LINK_REPORTS} links")

    def to_wire(self) -> dict:
        d = {"election": self.election.to_wire(), "report": self.report.to_wire(), "knows": self.knows}
        if self.instances:
            d["instances"] = [r.to_wire() for r in self.instances]
        if self.clock is not None:
            d["clock"] = {"t": self.clock.t, "echo": {p: list(e) for p, e in self.clock.echo.items()}}
        if self.links:
            d["links"] = {p: [m.rtt_us, m.bandwidth] for p, m in self.links.items()}
        if self.drained is not None:
            d.update(drained=list(self.drained), serving=self.serving.to_wire() if self.serving else None, reason=self.reason)
        if self.pool is not None:
            d["pool"] = [m.to_wire() for m in self.pool]
        return d

    @classmethod
    def from_wire(cls, d: object) -> "Heartbeat":
        if not isinstance(d, dict):
            raise MessageError(f"a heartbeat is an object, got {type(d).__name__}")
        required, leader_keys = {"election", "report", "knows"}, {"drained", "serving", "reason"}
        if not required <= set(d) <= required | leader_keys | {"instances", "clock", "links", "pool"} or (set(d) & leader_keys and not leader_keys <= set(d)):
            raise MessageError(f"a heartbeat has keys election, report, knows (and from a leader drained, serving, reason); got {sorted(map(str, d))!r:.200}")
        try:
            election = Announce.from_wire(d["election"])
            report = Report.from_wire(d["report"])
            instances = d.get("instances", [])
            if not isinstance(instances, list) or len(instances) > MAX_INSTANCES:
                raise MessageError(f"heartbeat instances must be a list of at most {MAX_INSTANCES} reports")
            others = tuple(Report.from_wire(r) for r in instances)
            serving = Term.from_wire(d["serving"]) if d.get("serving") is not None else None
        except (ElectionError, ReportError) as e:
            raise MessageError(f"heartbeat: {e}") from None
        knows = d["knows"]
        if not isinstance(knows, dict) or len(knows) > MAX_GOSSIPED_PEERS:
            raise MessageError(f"heartbeat knows must be an object of at most {MAX_GOSSIPED_PEERS} node: address entries")
        for node, addr in knows.items():
            _node("heartbeat knows node", node)
            if not isinstance(addr, str) or len(addr) > MAX_ADDR_CHARS:
                raise MessageError(f"heartbeat knows {node}: the address must be IP:PORT")
            try:
                parse_hostport(addr)
            except ValueError as e:
                raise MessageError(f"heartbeat knows {node}: {e}") from None
        drained = None
        if "drained" in d:
            if not isinstance(d["drained"], list) or len(d["drained"]) > MAX_DRAINED:
                raise MessageError(f"heartbeat drained must be a list of at most {MAX_DRAINED} node names")
            drained = tuple(_node("drained node", n) for n in d["drained"])
            if not isinstance(d["reason"], str) or len(d["reason"]) > MAX_REASON_CHARS:
                raise MessageError(f"heartbeat reason must be a string of at most {MAX_REASON_CHARS} characters")
        clock = _clock(d["clock"]) if "clock" in d else None
        links = _links(d["links"]) if "links" in d else {}
        pool = None
        if "pool" in d:
            if not isinstance(d["pool"], list) or len(d["pool"]) > MAX_INSTANCES:
                raise MessageError(f"heartbeat pool must be a list of at most {MAX_INSTANCES} models")
            pool = tuple(PoolModel.from_wire(m) for m in d["pool"])
        return cls(election, report, dict(knows), drained, serving, d.get("reason", ""), others, clock, links, pool)


def _seconds(what: str, v: object) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise MessageError(f"heartbeat {what} must be a finite number of seconds, got {v!r:.40}")
    return float(v)


def _clock(d: object) -> Clock:
    if not isinstance(d, dict) or set(d) != {"t", "echo"} or not isinstance(d["echo"], dict):
        raise MessageError(f"heartbeat clock is {{'t': seconds, 'echo': {{node: [t, held]}}}}, got {d!r:.200}")
    if len(d["echo"]) > MAX_LINK_REPORTS:
        raise MessageError(f"heartbeat clock echoes at most {MAX_LINK_REPORTS} peers")
    echo = {}
    for node, e in d["echo"].items():
        _node("heartbeat echo node", node)
        if not isinstance(e, list) or len(e) != 2:
            raise MessageError(f"heartbeat echo for {node} must be [t, held], got {e!r:.80}")
        echo[node] = (_seconds("echo t", e[0]), _seconds("echo held", e[1]))
    return Clock(_seconds("clock t", d["t"]), echo)


def _links(d: object) -> dict[str, Measured]:
    if not isinstance(d, dict) or len(d) > MAX_LINK_REPORTS:
        raise MessageError(f"heartbeat links must be an object of at most {MAX_LINK_REPORTS} node: [rtt_us, bytes/s] entries")
    out = {}
    for node, m in d.items():
        _node("heartbeat links node", node)
        ok = isinstance(m, list) and len(m) == 2 and _whole(m[0]) and 0 < m[0] <= MAX_RTT_US
        if not ok or not (m[1] is None or (_whole(m[1]) and m[1] > 0)):
            raise MessageError(f"heartbeat links {node} must be [rtt_us in (0, {MAX_RTT_US}], bytes/s > 0 or null], got {m!r:.80}")
        out[node] = Measured(m[0], m[1])
    return out


def _whole(v: object) -> bool:
    """An integer, and not a bool (which JSON's true would be)."""
    return isinstance(v, int) and not isinstance(v, bool)


def parse_control(d: object) -> Announce:
    """A CONTROL frame: an election message sent the moment the state changed."""
    if not isinstance(d, dict) or set(d) != {"election"}:
        raise MessageError(f"a CONTROL frame holds exactly {{'election': ...}}, got {d!r:.200}")
    try:
        return Announce.from_wire(d["election"])
    except ElectionError as e:
        raise MessageError(f"control: {e}") from None


def parse_loaded(d: object) -> Report:
    """A LOADED frame: a node's report on the plan it was sent."""
    try:
        return Report.from_wire(d)
    except ReportError as e:
        raise MessageError(f"LOADED: {e}") from None
