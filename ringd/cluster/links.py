"""The peer table: one authenticated link per peer, by node id.

A node listens on its ring port and dials the peers it is told about; every
connection starts with the cluster-secret handshake (``wire.handshake``), which
also tells each side the other's node id. When two nodes dial each other at
once, both keep the connection dialed by the node with the smaller id, so they
agree without talking about it. A dialed peer that goes away is dialed again
with backoff; every attempt has a deadline.

Every link carries a PING every ``heartbeat_interval_s``, with whatever the
daemon wants its peers to hear that often (``heartbeat()``: election state,
whom it knows, the clock its peers measure their RTT by) and now and then a
payload (``probe()``) to measure bandwidth by. A peer silent for ``dead_after_s`` is dead: its link is
closed, which a closed socket does at once anyway. A dead peer that comes back
(a SIGSTOP'd process resumed, a cable replugged) is linked again by the dial
loops and counts as a new arrival.

Frames from any link go to one ``on_frame(peer, frame)`` callback in arrival
order. ``on_change`` is called when a peer joins or leaves. A node that is
stopping ``leave``s: it takes no more links and dials no more, and keeps the links
it has (and their heartbeats) until ``close``. This module knows nothing of plans
or models.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from ringd.cluster.memberinfo import MemberInfo
from ringd.base.names import parse_hostport
from ringd.base.tasks import Supervisor
from wire import stream as wire_stream
from wire.frames import Frame, MsgType
from wire.slots import canonical_host

log = logging.getLogger(__name__)

# Redial backoff for a peer that is down: fast at first (daemons of one cluster
# usually start within seconds of each other), then every few seconds.
DIAL_BACKOFF_INITIAL_S = 0.1
DIAL_BACKOFF_MAX_S = 3.0
# When two nodes dial each other at once, the losing connection is still read
# this long before it is closed: frames the peer sent on it before it learned
# of the winner must not be lost.
LINK_SWAP_GRACE_S = 2.0
# Heartbeats: a PING per link every half second; two seconds of silence (four
# missed beats) is a dead peer. Fast enough that a ring recovers within a few
# seconds, slow enough that a busy event loop never trips it.
HEARTBEAT_INTERVAL_S = 0.5
DEAD_AFTER_S = 2.0
# Addresses learned from the network (Bonjour adverts, gossip, plans) that are
# dialed at once: a dozen Macs with a few addresses each, with room to spare.
# Any device on the LAN can advertise; it must not make us dial thousands.
MAX_LEARNED_DIALS = 64
# A learned address whose handshakes fail this many times in a row holds no node
# of this cluster (another secret, another cluster, a stranger): stop dialing it.
MAX_FAILED_HANDSHAKES = 3
# A learned address with no link this long is given up; its node, when back,
# advertises again (or a member gossips it), which starts a new dial.
LEARNED_DIAL_GIVE_UP_S = 600.0
# How often the log may say that learned dials were refused.
REFUSAL_LOG_INTERVAL_S = 60.0
# Addresses of members linked before, whose dials our listener takes apart from
# strangers' (wire.slots): a dozen Macs with a few addresses each, re-linking
# from new ones (DHCP) over weeks. Only a secret holder adds one; past this
# the one linked longest ago is forgotten (configured peers never are).
MAX_KNOWN_HOSTS = 256


class LinkError(ConnectionError):
    """No usable link to a peer."""


@dataclass
class Peer:
    node: str
    stream: "wire_stream.FrameStream"
    outbound: bool
    info: MemberInfo  # what it said of itself in the handshake
    # A number of its own for every link ever made: a peer that re-linked (a
    # dropped socket re-made, a process stalled past dead_after) has a new one,
    # which tells the leader that frames on the old link may be lost.
    number: int = 0
    last_heard: float = field(default_factory=time.monotonic)
    # Set once this link has left the peer table. (Not the stream's own
    # wait_closed: a stream can be closed while its reader has not yet removed
    # it, and waiting on an event that is already set never yields.)
    gone: asyncio.Event = field(default_factory=asyncio.Event)


class Links:
    def __init__(
        self,
        node: str,
        cluster: str,
        secret: bytes,
        info: MemberInfo,
        on_frame: Callable[[str, Frame], None],
        on_change: Callable[[], None] = lambda: None,
        heartbeat: Callable[[], dict] = dict,
        probe: Callable[[], int] = lambda: 0,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        dead_after_s: float = DEAD_AFTER_S,
        encrypt: bool = False,
        supervisor: Supervisor | None = None,
    ):
        self.node = node
        self.cluster = cluster
        self._secret = secret
        self.info = info
        self.on_frame = on_frame
        self.on_change = on_change
        self.heartbeat = heartbeat
        # Bytes of payload this round's PING carries (called right after ``heartbeat``): a
        # bandwidth probe (cluster/linkcost.py); receivers, older ones too, ignore a PING's payload.
        self.probe = probe
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        self.encrypt = encrypt
        self.peers: dict[str, Peer] = {}
        self._server: asyncio.AbstractServer | None = None
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor(log)
        self._numbers = itertools.count(1)
        self._learned = 0  # dial loops of learned (not configured) addresses
        self._last_refusal_log = -REFUSAL_LOG_INTERVAL_S
        self._dialing: set[tuple[str, int]] = set()
        # Every authenticated connection, current or draining after a lost tie.
        self._streams: set = set()
        self._closing = False
        # Members' addresses: a flood of strangers on our port never keeps their dials out.
        self._configured_hosts: set[str] = set()
        self._linked_hosts: dict[str, None] = {}  # oldest link first, at most MAX_KNOWN_HOSTS
        # Dial loops that wait because the node at their address is linked already (it dialed us).
        self.waiting_on: dict[tuple[str, int], str] = {}
        # Peers that left (said LEAVE): not dialed back, until one links again.
        self._departed: set[str] = set()
        # Rounds of the heartbeat loop so far: each PINGs every peer and declares dead those silent
        # past dead_after_s (what an operator, or a test, reads to know the loop is alive).
        self.heartbeat_rounds = 0

    async def listen(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Start accepting peers on host:port, or on ``sock`` (a listening socket handed down by a
        launcher); returns the bound port (useful with port 0)."""
        self._server = await wire_stream.serve(
            host, port, self._accepted, secret=self._secret, node_id=self.node, cluster=self.cluster, info=self.info.to_wire(),
            encrypt=self.encrypt, trusted=self._known_host, sock=sock,
        )  # fmt: skip
        self._supervisor.forever("heartbeats", self._heartbeat_loop)
        return self._server.sockets[0].getsockname()[1]

    def dial(self, host: str, port: int, persistent: bool = False) -> None:
        """Keep a link to host:port, redialing with backoff whenever it is down.

        ``persistent`` (a configured peer): for as long as the node runs. Otherwise
        (an address learned from an advert, a peer's gossip or a plan, which anyone
        on the LAN can make us learn) at most MAX_LEARNED_DIALS at once, each given
        up after MAX_FAILED_HANDSHAKES failed handshakes in a row (not one of ours)
        or LEARNED_DIAL_GIVE_UP_S without a link; a later advert or gossip starts it again.
        A configured peer's address is a member's from the start (see ``_known_host``).
        """
        if persistent:
            self._configured_hosts.add(canonical_host(host))
        if (host, port) in self._dialing or self._closing:
            return  # dialed already, or this node is stopping: a leaving node never dials
        if not persistent and self._learned >= MAX_LEARNED_DIALS:
            now = time.monotonic()
            if now - self._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
                self._last_refusal_log = now
                log.warning("not dialing %s:%d: %d learned addresses are being dialed already (MAX_LEARNED_DIALS)", host, port, self._learned)
            return
        self._dialing.add((host, port))
        self._learned += not persistent

        def done(_task):
            self._dialing.discard((host, port))
            self._learned -= not persistent

        task = self._supervisor.forever(f"dial {host}:{port}", lambda: self._dial_loop(host, port, persistent), restart_on_return=False)
        task.add_done_callback(done)

    def send(self, node: str, frame: Frame) -> None:
        """Queue ``frame`` on the link to ``node`` without waiting; order is kept per link."""
        self._stream_to(node).write(frame)

    def send_now(self, node: str, frame: Frame) -> None:
        """``send`` from any thread (a stage's compute thread): the frame leaves at once, with no
        hop through the event loop, in order with the link's other frames."""
        self._stream_to(node).write_now(frame)

    def lend(self, node: str, take: Callable[[Frame], bool], returned: Callable[[], None], wake: Callable[[], None]) -> "wire_stream.Lent | None":
        """The reading of the link from ``node``, lent to another thread (wire.stream's ``Lent``):
        what it takes counts as heard from ``node``, as what the loop reads does. None if there
        is no live link to ``node``, or its reading is lent already."""
        peer = self.peers.get(node)
        if peer is None or peer.stream.closed:
            return None

        def heard(frame: Frame) -> bool:
            peer.last_heard = time.monotonic()
            return take(frame)

        return peer.stream.lend(heard, returned, wake)

    def _stream_to(self, node: str) -> "wire_stream.FrameStream":
        """The live link to ``node`` (a dict read: safe off the event loop too), else LinkError."""
        peer = self.peers.get(node)
        if peer is None or peer.stream.closed:
            raise LinkError(f"no link to node {node!r}")
        return peer.stream

    def addr_of(self, node: str) -> str | None:
        peer = self.peers.get(node)
        return peer.info.addr if peer else None

    def leave(self) -> None:
        """This node is stopping: accept no link and dial no more (the dial loops end at their next
        step); the links up stay, heart-beating, until ``close``."""
        self._closing = True
        if self._server is not None:
            self._server.close()

    def forget(self, node: str) -> None:
        """Close the link to ``node`` (it said it is leaving); on_change follows as it closes.
        It is not dialed again (unless configured): it links again itself when it is back."""
        self._departed.add(node)
        peer = self.peers.get(node)
        if peer is not None:
            peer.stream.close()
            self._forget(peer)

    async def close(self) -> None:
        self.leave()
        for stream in list(self._streams):
            stream.close()
        if self._own_supervisor:
            await self._supervisor.stop()

    # --- internals --------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            beat = Frame(MsgType.PING, 0, self.heartbeat(), bytes(self.probe()))
            for peer in list(self.peers.values()):
                if peer.stream.reading_held:  # its heartbeats wait for a busy compute thread to read them
                    peer.last_heard = now
                silent = now - peer.last_heard
                if silent > self.dead_after_s:
                    log.warning("%s silent for %.1f s (dead_after_s %.1f): declaring it dead", peer.node, silent, self.dead_after_s)
                    peer.stream.close()
                    self._forget(peer)
                    continue
                try:
                    peer.stream.write(beat)
                except ConnectionError:
                    pass  # its reader notices and forgets it
            self.heartbeat_rounds += 1

    def _forget(self, peer: Peer) -> None:
        if self.peers.get(peer.node) is peer:
            del self.peers[peer.node]
            self.on_change()
        peer.gone.set()

    async def _accepted(self, stream) -> None:
        await self._run_link(stream, outbound=False)
        # A member that dialed us is dialed back once its link is lost, so the link is
        # re-made from both ends: if a flood holds our listener, our dial out does
        # not wait behind it (and theirs, if theirs is flooded too).
        if self._closing or stream.peer_id in (self.node, *self.peers, *self._departed):
            return
        try:
            self.dial(*parse_hostport(MemberInfo.parse(stream.peer_info).addr))
        except ValueError:
            pass  # it gave no address we can dial (a test's bare Links): it redials us

    def _known_host(self, host: str) -> bool:
        """Whether ``host`` (canonical) is a member's: a configured peer's, or one linked before."""
        return host in self._configured_hosts or host in self._linked_hosts

    def _remember(self, stream) -> None:
        """A member linked: where it dials from and where it listens are members' addresses now."""
        hosts = [stream.peername[0]]
        try:
            hosts.append(parse_hostport(MemberInfo.parse(stream.peer_info).addr)[0])
        except ValueError:
            pass
        for host in map(canonical_host, hosts):
            self._linked_hosts.pop(host, None)  # to the newest end
            self._linked_hosts[host] = None
            if len(self._linked_hosts) > MAX_KNOWN_HOSTS:
                del self._linked_hosts[next(iter(self._linked_hosts))]

    async def _dial_loop(self, host: str, port: int, persistent: bool) -> None:
        backoff = DIAL_BACKOFF_INITIAL_S
        failed_handshakes, linked_at = 0, time.monotonic()
        while not self._closing:
            # The node at this address dialed us while we waited to dial again (it started
            # later and our first dial found no listener): a second link would only lose or win
            # a tie, and a won tie swaps the link a loaded ring runs on, which breaks the ring.
            if (other := self._linked_to(host, port)) is not None:
                self.waiting_on[(host, port)] = other.node
                await other.gone.wait()
                self.waiting_on.pop((host, port), None)
                linked_at = time.monotonic()
                continue
            if not persistent and time.monotonic() - linked_at > LEARNED_DIAL_GIVE_UP_S:
                log.info("giving up dialing %s:%d: no link for %.0f s", host, port, LEARNED_DIAL_GIVE_UP_S)
                return
            try:
                stream = await wire_stream.connect(
                    host, port, secret=self._secret, node_id=self.node, cluster=self.cluster, info=self.info.to_wire(),
                    encrypt=self.encrypt,
                )  # fmt: skip
            except (OSError, asyncio.TimeoutError, wire_stream.HandshakeError) as e:
                log.debug("dial %s:%d failed: %s", host, port, e)
                if isinstance(e, wire_stream.HandshakeError):
                    failed_handshakes += 1
                    if not persistent and failed_handshakes >= MAX_FAILED_HANDSHAKES:
                        log.info("giving up dialing %s:%d: %d handshakes failed (%s)", host, port, failed_handshakes, e)
                        return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, DIAL_BACKOFF_MAX_S)
                continue
            backoff, failed_handshakes = DIAL_BACKOFF_INITIAL_S, 0
            peer_id = stream.peer_id
            await self._run_link(stream, outbound=True)
            if not persistent and peer_id in self._departed:
                return  # it left: it dials us when it is back
            # The link ended. If another link to the same node is up (the one it
            # dialed to us won the tie), wait for that one to end before redialing.
            while not self._closing and (other := self.peers.get(peer_id)) is not None:
                await other.gone.wait()
            linked_at = time.monotonic()
            await asyncio.sleep(backoff)

    def _linked_to(self, host: str, port: int) -> Peer | None:
        """The live peer that listens at host:port (by the address its handshake gave), if any."""
        for peer in self.peers.values():
            try:
                addr = parse_hostport(peer.info.addr)
            except ValueError:
                continue
            if not peer.stream.closed and addr[1] == port and canonical_host(addr[0]) == canonical_host(host):
                return peer
        return None

    def _prefer(self, new_outbound: bool, peer_id: str) -> bool:
        # Both ends keep the connection dialed by the smaller node id.
        dialed_by_us_wins = self.node < peer_id
        return new_outbound == dialed_by_us_wins

    async def _run_link(self, stream, outbound: bool) -> None:
        peer_id = stream.peer_id
        if self._closing:  # a handshake that finished as this node began to leave
            stream.close()
            return
        if (stream.peer_info or {}).get("probe") is True:
            # A node with no model yet asking who holds one (cluster/holders.py): it has read our
            # INFO in the handshake, and is no member of the ring.
            stream.close()
            return
        if peer_id == self.node:
            log.warning("dropping a link to ourselves (a peer address points at this node)")
            stream.close()
            return
        self._remember(stream)
        self._departed.discard(peer_id)  # back
        peer = Peer(peer_id, stream, outbound, MemberInfo.parse(stream.peer_info), next(self._numbers))
        self._streams.add(stream)
        current = self.peers.get(peer_id)
        later = asyncio.get_running_loop().call_later
        # Two live links in opposite directions (both nodes dialed at once): both ends keep the
        # one dialed by the smaller id. In the same direction, the newer wins: the dialing side
        # dialed again because it gave the older one up, even if this side has not noticed yet.
        tie = current is not None and not current.stream.closed and current.outbound != outbound
        if tie and not self._prefer(outbound, peer_id):
            later(LINK_SWAP_GRACE_S, stream.close)  # the other link wins; drain this one
        else:
            if current is not None:
                later(LINK_SWAP_GRACE_S, current.stream.close)
            self.peers[peer_id] = peer
            log.info("linked with %s (%s)", peer_id, "dialed" if outbound else "accepted")
            self.on_change()
        def on_frame(frame: Frame) -> None:
            peer.last_heard = time.monotonic()
            self.on_frame(peer_id, frame)

        try:
            # Each frame is handled as it is decoded: no task wakes per frame (a ring hop's cost).
            await stream.serve(on_frame)
        except (ConnectionError, asyncio.IncompleteReadError, wire_stream.FrameError) as e:
            current = self.peers.get(peer_id) is peer
            log.log(logging.INFO if current else logging.DEBUG, "link to %s closed: %s", peer_id, e or type(e).__name__)
        finally:
            stream.close()
            self._streams.discard(stream)
            self._forget(peer)
