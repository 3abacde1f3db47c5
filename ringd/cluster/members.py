"""Who is in the cluster and who leads: links, election, the pin and term on disk, drains, gossip.

This node's view of the cluster, from the links up: ``Links`` says who is live,
``Election`` turns that into a leader, and heartbeats carry what every peer
should hear often (election state, whom we know, our stage's report, and from
the leader the drain list and whether it serves). The pin and the term are
kept on disk, so a manual pin and the term a node claimed outlive a restart.

It knows nothing of plans or models beyond the ``Report`` its owner hands it,
and it decides nothing about them: ``on_leadership`` tells the owner when this
node starts or stops leading, ``on_change`` when anything the leader
reconciles against may have changed.

Leaving is a protocol step: a node that stops sends LEAVE on every link and from
then on holds its view still (it neither elects, nor follows a new leader, nor
dials). A peer that hears LEAVE takes the leaver out after LEAVE_SETTLE_S: long
enough that when a whole cluster is stopped at once, every node is leaving itself
before it would re-plan or elect over the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Protocol

from ringd.cluster.election import Election, ElectionError, Pin, Term
from ringd.cluster.linkcost import LinkMeter, Measured
from ringd.cluster.links import DEAD_AFTER_S, HEARTBEAT_INTERVAL_S, LinkError, Links
from ringd.cluster.memberinfo import MemberInfo
from ringd.cluster.messages import MAX_DRAINED, MAX_GOSSIPED_PEERS, MAX_INSTANCES, MAX_LINK_REPORTS, Heartbeat, MessageError, PoolModel, clip, parse_control
from ringd.ring.plan import MAX_ADDR_CHARS
from ringd.cluster.reconcile import Report
from ringd.base.names import natural_key, parse_hostport
from ringd.base.tasks import Supervisor
from wire.frames import Frame, MsgType
from wire.slots import canonical_host
from wire.stream import Lent

log = logging.getLogger(__name__)

# A peer that said LEAVE is taken out this long after (its link closed, the view
# recomputed, the leader re-planning): signals sent to every node of a ring at
# once (Ctrl-C of `ringd local`, a shutdown) reach each within milliseconds, and
# a node that starts leaving meanwhile re-plans nothing. Short next to a
# heartbeat timeout (dead_after_s), which is what a leaver would otherwise cost.
LEAVE_SETTLE_S = 0.3


def _dialable(addr: object) -> bool:
    """An address a heartbeat may carry: one whose receivers will not refuse the whole heartbeat."""
    try:
        parse_hostport(addr)
    except ValueError:
        return False
    return isinstance(addr, str) and len(addr) <= MAX_ADDR_CHARS


class DrainError(ValueError):
    """A drain request that cannot be honoured; the message says why."""


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """Who this node is among its peers, and how fast it hears of them (cut from a Config)."""

    node: str
    cluster: str
    state_file: Path  # the pin and the term this node claimed, kept across restarts
    priority: int = 0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    dead_after_s: float = DEAD_AFTER_S
    encrypt: bool = False  # ring_encryption: AEAD on every link


class Owner(Protocol):
    """The node a ``Cluster`` belongs to: what the cluster tells it, and the little it asks of it."""

    def on_frame(self, peer: str, frame: Frame) -> None:
        """A frame that is not the cluster's own (heartbeats, elections, LEAVE are), from ``peer``."""

    def on_leadership(self, leading: bool) -> None:
        """This node starts (True) or stops (False) leading."""

    def on_change(self) -> None:
        """Something the leader reconciles against may have changed (a link, a report, the leader)."""

    def reports(self) -> tuple[Report, tuple[Report, ...]]:
        """What its heartbeats say of this node's stages: the configured model's, and the other instances'."""

    def serving(self) -> tuple[Term | None, str]:
        """While leading: the term of the ring that serves, or None and why not."""

    def kept_models(self) -> tuple[PoolModel, ...]:
        """The models the leader keeps loaded besides the configured one: its own while it leads
        (its heartbeats tell them), else as the leader said."""

    def sent(self, seconds: float) -> None:
        """A frame took ``seconds`` to hand to its link (for metrics)."""


class Cluster:
    def __init__(self, settings: ClusterSettings, secret: bytes, info: MemberInfo, supervisor: Supervisor, owner: Owner):
        node = settings.node
        self.node = node
        self.priority = settings.priority
        self._state_file = settings.state_file
        self._owner = owner
        self.election = Election(node, settings.priority, *self._restore_state())
        self.leading = False
        self.drained: set[str] = set()  # nodes `ringctl drain` keeps out of the ring (followers copy the leader's)
        self.reports: dict[str, Report] = {}  # what each linked peer last said of its stage
        # ... and of its stages of the leader's other instances: peer -> instance -> report.
        self.instance_reports: dict[str, dict[str, Report]] = {}
        self.leader_serving: tuple[Term | None, str] = (None, "no word from the leader yet")
        # The models the leader keeps loaded (its heartbeats say; kept when it dies, so the next
        # leader, whichever node it is, loads them again): None until a leader said.
        self.pool: tuple[PoolModel, ...] | None = None
        self._leader_moved = asyncio.Event()  # set, then replaced, whenever the leader changes
        self._last_leader: str | None = None
        self.leader_changes = 0  # elections this node saw decided (for metrics)
        self.leaving = False  # this node is stopping: its view holds still
        # Peers that said LEAVE, by the number of the link they said it on (a node that
        # comes back re-links with a new one, and counts again).
        self.left: dict[str, int] = {}
        self._settle: asyncio.TimerHandle | None = None  # a view change held back while a leaver settles
        self._settle_until = 0.0
        # RTT and bandwidth of our links, measured by our heartbeats' echoes; and each peer's
        # measurements of its own, as its heartbeats report them (the leader places by them).
        self.meter = LinkMeter(node, MAX_LINK_REPORTS)
        self.peer_links: dict[str, dict[str, Measured]] = {}
        self._probe = 0  # payload bytes of the heartbeat being sent (a bandwidth probe)
        self.links = Links(
            node, settings.cluster, secret, info, self._on_frame, self.view_changed,
            heartbeat=self._heartbeat, probe=lambda: self._probe, heartbeat_interval_s=settings.heartbeat_interval_s,
            dead_after_s=settings.dead_after_s, encrypt=settings.encrypt, supervisor=supervisor,
        )  # fmt: skip

    # --- views ------------------------------------------------------------------------

    @property
    def peers(self) -> dict:
        return self.links.peers

    @property
    def leader(self) -> str | None:
        return self.election.leader

    async def leader_changed(self) -> None:
        """Returns once the node this node follows (or leads as) changes."""
        await self._leader_moved.wait()

    @property
    def settling(self) -> float:
        """Seconds until a peer that said LEAVE is taken out (0: none is settling)."""
        return max(0.0, self._settle_until - asyncio.get_running_loop().time())

    def leader_linked(self) -> bool:
        leader = self.election.leader
        return leader == self.node or (leader is not None and leader in self.links.peers)

    def link_views(self) -> dict[str, dict[str, Measured]]:
        """Each live node's measurements of its links (this node's own included): node -> peer -> figures.

        Only links between two machines: two nodes that listen on one host (``ringd local``, a
        test's ring) talk over loopback, whose round trip is how soon each process is scheduled,
        not a network, and placement must not read a loaded machine's delays as a slow link."""
        views = {p: dict(v) for p, v in self.peer_links.items() if p in self.links.peers}
        views[self.node] = self.meter.view()
        hosts = {node: self._host(node) for node in {*views, *(b for view in views.values() for b in view)}}
        return {a: {b: m for b, m in view.items() if hosts[a] is None or hosts[a] != hosts[b]} for a, view in views.items()}

    def _host(self, node: str) -> str | None:
        """The host a node listens on (its handshake's advertised address), or None if unknown."""
        addr = self.links.info.addr if node == self.node else self.links.addr_of(node)
        try:
            return canonical_host(parse_hostport(addr)[0])
        except ValueError:
            return None

    def member_infos(self) -> dict[str, MemberInfo]:
        """Every member of the current view, this node too, and what each said of itself."""
        return {node: self.info_of(node) for node in self.election.members}

    def info_of(self, node: str) -> MemberInfo:
        """What ``node`` said of itself: this node's own, a linked peer's, or nothing known."""
        if node == self.node:
            return self.links.info
        peer = self.links.peers.get(node)
        return peer.info if peer else MemberInfo()

    # --- sending ----------------------------------------------------------------------

    def send(self, node: str, frame: Frame) -> None:
        """Deliver to ``node``: over its link, or straight back in for this node itself."""
        if node == self.node:
            self._owner.on_frame(self.node, frame)
        else:
            started = time.perf_counter()
            self.links.send(node, frame)
            self._owner.sent(time.perf_counter() - started)

    def send_now(self, node: str, frame: Frame) -> bool:
        """``send`` from any thread, over ``node``'s link; False for this node itself (a frame
        to it is handled on the event loop: ``send`` there)."""
        if node == self.node:
            return False
        started = time.perf_counter()
        self.links.send_now(node, frame)
        self._owner.sent(time.perf_counter() - started)
        return True

    def lend(self, node: str, take: Callable[[Frame], bool], returned: Callable[[], None], wake: Callable[[], None]) -> Lent | None:
        """The reading of ``node``'s link, lent to another thread (``Links.lend``); None for this
        node itself, or where it cannot be. Nothing it takes reaches ``_on_frame``: only a stage's
        FORWARD and RELEASE frames are for a borrower to take, and it takes none as this node leaves."""
        if node == self.node or self.leaving:
            return None
        return self.links.lend(node, take, returned, wake)

    # --- pin and drain ------------------------------------------------------------------

    def set_pin(self, node: str | None) -> None:
        """`ringctl leader set NODE` / `leader auto`, on whichever node it reached."""
        self._elect(self.election.set_pin(self.election.pin.next(node)))

    def leave(self) -> None:
        """This node is stopping: LEAVE on every link, then no more elections, dials or links."""
        if self.leaving:
            return
        self.leaving = True
        log.info("leaving the cluster: telling %s", ", ".join(sorted(self.links.peers, key=natural_key)) or "nobody (no links)")
        for peer in list(self.links.peers):
            try:
                self.links.send(peer, Frame(MsgType.LEAVE, 0, {}))
            except LinkError:
                pass
        self.links.leave()

    def drain(self, node: str, undo: bool) -> None:
        if not undo and node not in self.drained and len(self.drained) >= MAX_DRAINED:
            raise DrainError(f"{MAX_DRAINED} nodes are drained already (the most a heartbeat carries); undo one first")
        (self.drained.discard if undo else self.drained.add)(node)
        log.info("%s %s", "undrained" if undo else "draining", node)
        self._owner.on_change()

    # --- incoming -------------------------------------------------------------------------

    def _on_frame(self, peer: str, frame: Frame) -> None:
        try:
            if self.leaving:
                # A leaving node acts on nothing more: its view holds still, its stage computes
                # no more steps (the leader replays them on the ring it plans without it).
                return
            if frame.type == MsgType.LEAVE:
                self._on_leave(peer)
            elif peer in self.left:
                pass  # it is on its way out: its heartbeats and election notes no longer count
            elif frame.type == MsgType.PING:
                self._on_heartbeat(peer, Heartbeat.from_wire(frame.descriptor))
            elif frame.type == MsgType.CONTROL:
                self._elect(self.election.receive(peer, parse_control(frame.descriptor)))
            else:
                self._owner.on_frame(peer, frame)
        except MessageError as e:
            log.warning("ignoring a malformed %s frame from %s: %s", frame.type.name, peer, e)
        except Exception:  # one bad frame must not end the link or the node
            log.exception("error handling %s frame from %s", frame.type.name, peer)

    def _on_heartbeat(self, peer: str, beat: Heartbeat) -> None:
        if beat.clock is not None:
            self.meter.heard(peer, time.monotonic(), beat.clock)
        self.peer_links[peer] = beat.links
        for node, addr in beat.knows.items():
            if node != self.node and node not in self.links.peers:
                self.links.dial(*parse_hostport(addr))
        if peer == self.election.leader and beat.drained is not None:
            self.drained = set(beat.drained)
            self.leader_serving = (beat.serving, beat.reason)
            if beat.pool is not None and beat.pool != self.pool:
                self.pool = beat.pool
                self._owner.on_change()  # stages of instances the leader no longer keeps may go
        others = {r.instance: r for r in beat.instances}
        changed = self.reports.get(peer) != beat.report or self.instance_reports.get(peer, {}) != others
        self.reports[peer] = beat.report
        self.instance_reports[peer] = others
        self._elect(self.election.receive(peer, beat.election))
        if changed:
            self._owner.on_change()

    def _on_leave(self, peer: str) -> None:
        link = self.links.peers.get(peer)
        if link is None or self.left.get(peer) == link.number:
            return
        self.left[peer] = link.number
        log.info("%s is leaving the cluster", peer)
        now = asyncio.get_running_loop().time()
        self._settle_until = max(self._settle_until, now + LEAVE_SETTLE_S)
        asyncio.get_running_loop().call_later(LEAVE_SETTLE_S, self._take_out, peer, link.number)

    def _take_out(self, peer: str, number: int) -> None:
        """LEAVE_SETTLE_S after a peer said LEAVE: close its link, unless this node is leaving too."""
        if self.leaving:
            return
        link = self.links.peers.get(peer)
        if link is not None and link.number == number:
            self.links.forget(peer)  # on_change: the view without it
        else:
            self.view_changed()

    def take_report(self, peer: str, report: Report) -> None:
        """A LOADED frame: the same word a heartbeat carries, sent at once."""
        if report.instance:
            held = self.instance_reports.setdefault(peer, {})
            if held.get(report.instance) != report:
                held[report.instance] = report
                self._owner.on_change()
        elif self.reports.get(peer) != report:
            self.reports[peer] = report
            self._owner.on_change()

    def report_of(self, peer: str, instance: str) -> Report | None:
        """What ``peer`` last said of its stage of ``instance`` (None: nothing yet)."""
        return self.reports.get(peer) if not instance else self.instance_reports.get(peer, {}).get(instance)

    def view_changed(self) -> None:
        if self.leaving:
            return  # a leaving node elects and re-plans nothing
        loop = asyncio.get_running_loop()
        wait = self.settling
        if wait > 0:
            # A leaver is settling (and may have closed its links already): act once it has,
            # unless this node starts leaving by then.
            if self._settle is None or self._settle.cancelled():
                self._settle = loop.call_later(wait, self._settled)
            return
        for node, number in list(self.left.items()):
            link = self.links.peers.get(node)
            if link is not None and link.number != number:
                del self.left[node]  # it came back: a new link, a member again
        for gone in set(self.reports) - set(self.links.peers):
            del self.reports[gone]
        for gone in set(self.instance_reports) - set(self.links.peers):
            del self.instance_reports[gone]
        for gone in set(self.peer_links) - set(self.links.peers):
            del self.peer_links[gone]
            self.meter.forget(gone)
        members = {self.node: self.priority}
        for p, peer in self.links.peers.items():
            members[p] = peer.info.priority
        self._elect(self.election.view(members))
        self._owner.on_change()

    def _settled(self) -> None:
        self._settle = None
        self.view_changed()

    # --- outgoing -------------------------------------------------------------------------

    def _heartbeat(self) -> dict:
        known = {}
        for p, peer in self.links.peers.items():
            addr = peer.info.addr
            if len(known) < MAX_GOSSIPED_PEERS and _dialable(addr):
                known[p] = addr
        report, instances = self._owner.reports()
        instances = instances[:MAX_INSTANCES]
        clock = self.meter.stamp(time.monotonic())
        self._probe = clock.probe
        beat = Heartbeat(self.election.announcement(), report, known, instances=instances, clock=clock, links=self.meter.view())
        if self.leading:
            serving, reason = self._owner.serving()
            drained = tuple(sorted(self.drained, key=natural_key))
            beat = dataclasses.replace(beat, drained=drained, serving=serving, reason=clip(reason), pool=self._owner.kept_models())
        return beat.to_wire()

    def claim_plan_term(self) -> Term:
        """A fresh term for the leader's next plan, persisted and announced before the plan goes out."""
        self._elect(self.election.next_term())
        return self.election.term

    def _elect(self, msgs: list) -> None:
        """Persist, announce, then act on what the election decided."""
        if self.leaving:
            return  # a leaving node runs for nothing and follows no one new
        if msgs:
            self._save_state()  # before the messages: a term is on disk before anyone hears of it
            for msg in msgs:
                for peer in list(self.links.peers):
                    try:
                        self.links.send(peer, Frame(MsgType.CONTROL, 0, {"election": msg.to_wire()}))
                    except LinkError:
                        pass
        leader = self.election.leader
        if leader == self.node and not self.leading:
            log.info("leading the cluster (term %s)", self.election.term.to_wire())
            self.leading = True
            self._owner.on_leadership(True)
        elif leader != self.node and self.leading:
            log.info("following %s", leader or "nobody yet")
            self.leading = False
            self._owner.on_leadership(False)
        if leader != self._last_leader:
            self._last_leader = leader
            self.leader_changes += 1
            self.leader_serving = (None, f"waiting for word from {leader or 'a new leader'}")
            self._leader_moved.set()
            self._leader_moved = asyncio.Event()

    # --- state on disk ----------------------------------------------------------------------

    def _restore_state(self) -> tuple[Pin, Term | None]:
        """The pin and term this node had before a restart (a pin outlives restarts)."""
        try:
            d = json.loads(self._state_file.read_text())
            return Pin.from_wire(d["pin"]), Term.from_wire(d["term"])
        except FileNotFoundError:
            return Pin(), None
        except (OSError, ValueError, KeyError, TypeError, ElectionError) as e:
            log.warning("ignoring unreadable state file %s: %s", self._state_file, e)
            return Pin(), None

    def _save_state(self) -> None:
        path = self._state_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pin": self.election.pin.to_wire(), "term": self.election.term.to_wire()}))
        os.replace(tmp, path)
