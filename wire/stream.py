"""asyncio shell for ring links: TCP in, Frames out, and back.

FrameProtocol plugs the sans-I/O FrameDecoder and Handshake into an asyncio
BufferedProtocol: payloads land from the kernel straight into their frame's
buffer, and outgoing payloads are handed to the transport as memoryviews, not
joined to their header (unless the link is encrypted: then as ciphertext). (The
selector loop of Python 3.11 still joins what it is given in writelines;
uvloop and Python 3.12+ write the buffers as they are.)

A frame may also be written from another thread (``write_now``: a stage's compute thread
sends its output as it is computed, with no hop through the event loop): straight to the
socket when nothing is waiting to go before it, else behind what is, which the loop flushes.
Either way frames leave in the order they were sealed, whichever thread wrote them.

A link's reading may be lent to another thread too (``lend``: a stage's compute thread reads the
frames its predecessor sends, computes and sends on, with no wake-up of the event loop per hop).
The borrower offers each frame it decodes to ``take``; from the first it does not take, the
frames and the reading go back to the loop, which handles them in order, as if it had read them.

FrameStream is what the daemon holds: send/recv with deadlines (or ``serve``:
every frame handed to a callback as it is decoded, with no task to wake per
frame, which the ring's hop uses), the peer's authenticated identity and info. `connect` and `serve` hand one out only once
the handshake is complete: both proofs in and the peer's sealed INFO opened.
Until then a connection runs under the handshake's tight limits and nothing
but the handshake is parsed; after the PROOFs every frame both ways is sealed
(wire.seal), and one that fails its check drops the link.

Strangers are bounded: `serve` holds at most MAX_UNAUTHENTICATED connections in
the handshake (MAX_UNAUTHENTICATED_PER_HOST from one address) and closes the
rest at once, and warnings about failed handshakes and dropped links are rate
limited, so a flood costs neither memory nor the log. Members' addresses (the
caller's `trusted`) have slots of their own, MAX_UNAUTHENTICATED_KNOWN, and are
never refused: a flood cannot keep a member out (wire.slots says how).

What the frames mean (membership, plans, tensors) is for the layers above.
"""

import asyncio
import collections
import functools
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable

from wire.frames import (
    DEFAULT_LIMITS,
    Frame,
    FrameDecoder,
    FrameError,
    IntegrityError,
    encode_frame,
)
from wire.handshake import HANDSHAKE_TIMEOUT_S, Handshake, HandshakeError
from wire.slots import HandshakeSlots, SlotLimits, canonical_host

__all__ = [
    "FrameError",
    "FrameStream",
    "HandshakeError",
    "IntegrityError",
    "connect",
    "serve",
]

log = logging.getLogger(__name__)

# A LAN peer accepts a TCP connection in milliseconds. Without a deadline a host
# that is down (SYNs dropped, no RST) keeps connect() waiting for the kernel's
# retries, about two minutes.
CONNECT_TIMEOUT_S = 5.0
# How long one send may wait for the peer to take our bytes. A frame at the
# payload limit (512 MiB) needs about 4.5 s on gigabit Ethernet; the rest covers
# a receiver that stopped reading while its compute thread catches up. A peer
# stuck past this is dropped.
SEND_TIMEOUT_S = 30.0
# Frames decoded but not yet taken by recv(). At this many we stop reading the
# socket, so TCP backpressure slows the sender instead of this process holding
# an unbounded backlog (each frame is within the decoder's limits).
RECV_QUEUE_FRAMES = 64
# What a borrowing thread reads at once when the frame part it is in needs less: a decode step's
# frame whole, with its next header, in one read (a part this size or more is read in place).
LENT_READ_BYTES = 64 * 1024
# Connections from strangers (addresses not known as members') `serve` holds in
# the handshake at once; more are closed at once. They bound a flood's hold to
# the cap times a ~1 KiB decoder for up to HANDSHAKE_TIMEOUT_S. Per address
# there is room for a few nodes behind one NAT (new members are strangers until
# first linked), and redials.
MAX_UNAUTHENTICATED = 64
MAX_UNAUTHENTICATED_PER_HOST = 8
# Connections from members' addresses in the handshake at once, apart from the
# strangers' (wire.slots): never refused, the oldest of the address holding the
# most is closed instead. A ring is a handful of nodes with one or two dials
# each; the rest is room for an attacker on a member's own address to lose
# connections to before an honest handshake (milliseconds) is its oldest.
MAX_UNAUTHENTICATED_KNOWN = 64
# Warnings about failed handshakes and dropped links: the first from each
# address is logged as it happens, later ones are counted and summed up in one
# line per interval, so a peer failing in a loop cannot flood the log.
LOG_SUMMARY_INTERVAL_S = 60.0
# At most this many first-from-an-address warnings per interval (the rest are
# counted), and this many addresses remembered: bounds both lines and memory
# when the failures come from many addresses.
MAX_FIRST_WARNINGS_PER_INTERVAL = 10
MAX_REMEMBERED_ADDRESSES = 1024


# Every misbehaving-peer event of this process since it started, by kind ("failed
# handshakes", "dropped links", "connections refused over the handshake caps",
# "handshakes closed to make room for members"), logged or not: what a node's
# metrics count.
EVENTS: collections.Counter[str] = collections.Counter()


class _RateLimitedLog:
    """Warnings about misbehaving peers, first per address then summed per interval."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._warned: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._first_warnings = 0
        self._counts: collections.Counter[str] = collections.Counter()
        self._sources: set[str] = set()
        self._summary: asyncio.TimerHandle | None = None

    def warn(self, kind: str, host: str, message: str):
        """Log `message` if it is the first from `host`; else count it under `kind`."""
        self._start_interval()
        if host not in self._warned and self._first_warnings < MAX_FIRST_WARNINGS_PER_INTERVAL:
            EVENTS[kind] += 1
            self._warned[host] = None
            if len(self._warned) > MAX_REMEMBERED_ADDRESSES:
                self._warned.popitem(last=False)  # forgotten: its next failure is logged again
            self._first_warnings += 1
            log.warning("%s", message)
        else:
            self.count(kind, host)

    def count(self, kind: str, host: str):
        """Count an event under `kind` for the next summary line, without logging it now."""
        EVENTS[kind] += 1
        self._start_interval()
        self._counts[kind] += 1
        if len(self._sources) < MAX_REMEMBERED_ADDRESSES:
            self._sources.add(host)

    def _start_interval(self):
        if self._summary is None:
            self._summary = self.loop.call_later(LOG_SUMMARY_INTERVAL_S, self._summarize)

    def _summarize(self):
        if self._counts:
            counted = ", ".join(f"{kind}: {n}" for kind, n in sorted(self._counts.items()))
            log.warning(
                "not logged one by one in the last %g s: %s (from %d address%s)",
                LOG_SUMMARY_INTERVAL_S, counted, len(self._sources),
                "" if len(self._sources) == 1 else "es",
            )  # fmt: skip
        self._summary = None
        self._first_warnings = 0
        self._counts.clear()
        self._sources.clear()


_log: _RateLimitedLog | None = None


def _rate_limited_log() -> _RateLimitedLog:
    """The running loop's rate-limited log: one per process in the daemon."""
    global _log
    loop = asyncio.get_running_loop()
    if _log is None or _log.loop is not loop:
        _log = _RateLimitedLog(loop)
    return _log


class _Gate:
    """A server's handshake slots (wire.slots), applied to its connections."""

    def __init__(self, trusted: Callable[[str], bool]):
        self.trusted = trusted
        self.slots: HandshakeSlots[FrameProtocol] = HandshakeSlots(
            SlotLimits(MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_HOST, MAX_UNAUTHENTICATED_KNOWN)
        )

    def admit(self, protocol: "FrameProtocol") -> bool:
        """Take a slot for `protocol`, closing the known connection it evicts, if any."""
        host = canonical_host(protocol.peername[0])
        admission = self.slots.admit(protocol, host, self.trusted(host))
        if admission.evict is not None:
            victim = admission.evict
            victim.evicted = True
            victim.fail(ConnectionRefusedError(
                f"{victim.address} closed in the handshake to make room for a newer connection "
                f"from a member's address ({MAX_UNAUTHENTICATED_KNOWN} were in the handshake)"
            ))  # fmt: skip
        return admission.admitted

    def release(self, protocol: "FrameProtocol"):
        self.slots.release(protocol)


class FrameProtocol(asyncio.BufferedProtocol):
    """One connection: runs the handshake, then queues frames in and writes frames out.

    With a `gate` (serve's), the connection holds a handshake slot until its
    handshake ends, and is closed at once if it gets none.
    """

    def __init__(self, handshake: Handshake, gate: _Gate | None = None):
        self.handshake = handshake
        # Resolves once the handshake is complete (the peer's INFO verified);
        # fails with why it did not.
        self.authenticated: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = FrameDecoder(handshake.limits)
        self._sealer = None  # the session's, from the peer's PROOF on
        self._gate = gate
        self.refused = False  # closed at once: over the gate's caps
        self.evicted = False  # closed in the handshake: its slot went to a newer member's dial
        self._transport: asyncio.Transport | None = None
        self.peername: tuple[str, int] = ("", 0)
        self._handshake_deadline: asyncio.TimerHandle | None = None
        self._frames: collections.deque[Frame] = collections.deque()
        # Set by FrameStream.serve: takes each frame as it is decoded, instead of the queue.
        self._handler: Callable[[Frame], None] | None = None
        self._reading_paused = False
        self._frame_arrived = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._error: Exception | None = None  # why the connection ended; first reason wins
        self._lost = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        # Writes from any thread: a frame's seal and its bytes reaching the socket happen under
        # this lock, in one order. ``_fd`` duplicates the socket's descriptor once the handshake
        # is done (a thread writes to it; it is closed with the connection, under the lock, so a
        # thread never writes to a descriptor the loop has closed and the kernel reused);
        # ``_behind`` holds what a thread could not write at once, in order, until the loop
        # flushes it to the transport, and every write meanwhile goes behind it.
        self._write_lock = threading.Lock()
        self._fd: int | None = None
        self._behind: collections.deque[list] = collections.deque()
        # The reading, while another thread has it (``lend``): the loop reads nothing meanwhile.
        self._lent: Lent | None = None

    @property
    def address(self) -> str:
        """The peer as "host:port" ("[v6]:port"), for messages."""
        host, port = self.peername
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def closed(self) -> bool:
        return self._error is not None

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.Transport):
        self._transport = transport
        self.peername = (transport.get_extra_info("peername") or ("", 0))[:2]
        if self._gate is not None and not self._gate.admit(self):
            self.refused = True
            self._end(ConnectionRefusedError(
                f"{self.address} refused: {MAX_UNAUTHENTICATED} connections from strangers "
                f"are in the handshake, or {MAX_UNAUTHENTICATED_PER_HOST} from its address"
            ))  # fmt: skip
            transport.close()
            return
        # One small frame per generated token: Nagle's delay would stall the ring.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        timeout = HANDSHAKE_TIMEOUT_S
        self._handshake_deadline = asyncio.get_running_loop().call_later(
            timeout,
            self.fail,
            TimeoutError(f"handshake with {self.address} took longer than {timeout} s"),
        )
        self._write_handshake(self.handshake.start())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int):
        try:
            for frame in self._decoder.buffer_updated(nbytes):
                if self.handshake.done:
                    self._deliver(frame)
                else:
                    self._handshake_step(frame)
        except FrameError as e:  # HandshakeError and IntegrityError included
            self._reading_failed(e)

    def _reading_failed(self, e: FrameError):
        if not self.handshake.done:
            error = HandshakeError(f"handshake with {self.address} failed: {e}")
        elif isinstance(e, IntegrityError):
            error = IntegrityError(f"{self.address} sent a frame that failed its check: {e}")
        else:
            error = FrameError(f"{self.address} sent a malformed frame: {e}")
        error.__cause__ = e
        self.fail(error)

    def eof_received(self) -> bool:
        return False  # the peer is done sending; close our side too

    def connection_lost(self, exc: Exception | None):
        stage = "" if self.handshake.done else " during the handshake"
        detail = f": {exc}" if exc else ""
        self._end(ConnectionError(f"{self.address} closed the connection{stage}{detail}"))
        self._lost.set()

    def pause_writing(self):
        self._can_write.clear()

    def resume_writing(self):
        self._can_write.set()

    # -- used by FrameStream

    def write(self, frame: Frame):
        """On the event loop."""
        with self._write_lock:
            if self._error is not None:
                raise ConnectionError(str(self._error)) from self._error
            # Sealing takes the frame's sequence number: encode and hand over in one go.
            data = encode_frame(frame, DEFAULT_LIMITS, self._sealer)
            if self._behind:
                self._behind.append(data)
            else:
                self._transport.writelines(data)

    def write_now(self, frame: Frame):
        """From any thread: ``frame`` to the socket now if nothing waits to go before it and
        the socket takes it whole; else (or what it did not take) behind what waits, for the
        loop to flush. ConnectionError if the connection has ended."""
        with self._write_lock:
            if self._error is not None:
                raise ConnectionError(str(self._error)) from self._error
            data = encode_frame(frame, DEFAULT_LIMITS, self._sealer)
            if not self._behind and self._fd is not None and not self._transport.get_write_buffer_size():
                try:
                    sent = os.writev(self._fd, data)
                except BlockingIOError:
                    sent = 0
                except OSError as e:  # the peer is gone; the loop hears it on its side too
                    raise ConnectionError(f"writing to {self.address} failed: {e}") from e
                size = sum(memoryview(part).nbytes for part in data)
                if sent == size:
                    return
                data = [b"".join(data)[sent:]]  # the socket's buffer is full: rare, so copied
            self._behind.append(data)
            if len(self._behind) == 1:
                try:
                    self._loop.call_soon_threadsafe(self._flush)
                except RuntimeError as e:  # the loop has closed: so has the connection
                    raise ConnectionError(f"writing to {self.address}: {e}") from e

    def _flush(self):
        """On the event loop: what threads left waiting, to the transport, in order."""
        with self._write_lock:
            while self._behind:
                data = self._behind.popleft()
                if self._error is None:
                    self._transport.writelines(data)

    def lend(self, take: Callable[[Frame], bool], returned: Callable[[], None], wake: Callable[[], None]) -> "Lent | None":
        """On the event loop: the reading of this connection, lent to another thread (``Lent``),
        or None where it cannot be (ended, lent already, not serving a handler). The loop reads
        nothing until it comes back; then it delivers what the borrower did not take, goes on
        reading, and calls ``returned``. ``wake``: what makes the borrower look at it again (the
        loop asks for the reading back: the connection ends)."""
        if self._error is not None or self._lent is not None or self._handler is None or self._fd is None:
            return None
        self._transport.pause_reading()
        self._lent = Lent(self, take, returned, wake)
        return self._lent

    def _given_back(self, lent: "Lent", frames: list[Frame], error: Exception | None):
        """On the event loop: ``lent`` came back with ``frames`` its borrower did not take (in
        order) and why its reading stopped, if it failed (None: taken back, or asked for)."""
        self._lent = None
        for frame in frames:
            self._deliver(frame)
        if isinstance(error, FrameError):
            self._reading_failed(error)
        elif error is not None:
            self._end(error)
            self._transport.abort()
        elif self._error is None:
            self._transport.resume_reading()
        lent.returned()

    async def drain(self):
        await self._can_write.wait()
        if self._error is not None:
            raise ConnectionError(str(self._error)) from self._error

    async def read_frame(self) -> Frame:
        while not self._frames:
            if self._error is not None:
                raise ConnectionError(str(self._error)) from self._error
            self._frame_arrived.clear()
            await self._frame_arrived.wait()
        frame = self._frames.popleft()
        backlog = len(self._frames)
        if self._reading_paused and self._error is None and backlog < RECV_QUEUE_FRAMES:
            self._reading_paused = False
            self._transport.resume_reading()
        return frame

    def fail(self, error: Exception):
        """Drop the connection because of `error`.

        That is a malformed frame, a failed or slow handshake, or a stuck send.
        """
        if self._error is not None:
            return
        self._end(error)
        if self.handshake.done:
            _rate_limited_log().warn(
                "dropped links", self.peername[0],
                f"dropping {self.handshake.peer_id} ({self.address}): {error}",
            )  # fmt: skip
            # Don't flush our backlog to a peer we gave up on: it may never read it.
            self._transport.abort()
        else:
            # Our last handshake frame is small and already with the kernel;
            # closing (not aborting) lets the peer read it and see why.
            self._transport.close()

    def close(self):
        self._end(ConnectionError(f"connection to {self.address} was closed by this node"))
        self._transport.close()

    async def wait_closed(self):
        await self._lost.wait()

    async def serve(self, handler: Callable[[Frame], None]):
        """Hand every frame to ``handler`` as it is decoded, in order: first those queued, then
        each as it arrives (on the event loop, from the protocol's callback). Raises
        ConnectionError, saying why, once the connection has ended."""
        while self._frames:
            self._handle(handler, self._frames.popleft())
        if self._reading_paused and self._error is None:
            self._reading_paused = False
            self._transport.resume_reading()
        self._handler = handler
        try:
            while self._error is None:  # only the connection's end sets the event now
                self._frame_arrived.clear()
                await self._frame_arrived.wait()
        finally:
            self._handler = None
        raise ConnectionError(str(self._error)) from self._error

    def _handle(self, handler: Callable[[Frame], None], frame: Frame):
        try:
            handler(frame)
        except Exception:  # the handler's bug must not stop this connection's reading
            log.exception("handling a %s frame from %s failed", frame.type.name, self.address)

    # -- internals

    def _write_handshake(self, frames: list[Frame]):
        for frame in frames:
            # The handshake has checked its frames' sizes against their own limits.
            self._transport.writelines(encode_frame(frame, DEFAULT_LIMITS, self._sealer))

    def _handshake_step(self, frame: Frame):
        handshake = self.handshake
        replies = handshake.receive(frame)
        if self._sealer is None and (session := handshake.session) is not None:
            # The peer's PROOF verified: from here on every frame both ways is
            # sealed, our INFO (in `replies`) first. The decoder has read nothing
            # past this frame, so the next header is the first sealed one.
            self._sealer = session.sealer
            self._decoder.opener = session.opener
        # Tight until the peer's INFO is in, then the protocol's own.
        self._decoder.limits = handshake.limits
        self._write_handshake(replies)
        if handshake.done:
            self._handshake_deadline.cancel()
            self._leave_gate()
            with self._write_lock:
                if self._error is None:
                    self._fd = os.dup(self._transport.get_extra_info("socket").fileno())
            if not self.authenticated.done():  # connect() may have been cancelled
                self.authenticated.set_result(None)

    def _leave_gate(self):
        # At once, not in a callback later: a slot still held by a connection whose
        # handshake is over could be picked for eviction, and that would drop a link.
        if self._gate is not None:
            self._gate.release(self)

    def _deliver(self, frame: Frame):
        if self._handler is not None:
            self._handle(self._handler, frame)
            return
        self._frames.append(frame)
        self._frame_arrived.set()
        if len(self._frames) >= RECV_QUEUE_FRAMES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def _end(self, error: Exception):
        """Record why the connection ended and wake everyone waiting on it."""
        with self._write_lock:
            if self._error is None:
                self._error = error
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._behind.clear()
        if self._lent is not None:
            self._lent.ask_back()
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
        self._leave_gate()
        if not self.authenticated.done():
            self.authenticated.set_exception(self._error)
        self._frame_arrived.set()
        self._can_write.set()


class Lent:
    """A link's reading, lent by the event loop to another thread (``FrameProtocol.lend``).

    The borrower calls ``read`` whenever ``fileno`` may be readable (and once ``asked_back``):
    it reads what has arrived, decodes it with the link's own decoder, and offers each frame to
    ``take`` on its own thread. The first frame not taken goes back to the loop with the rest
    and the reading itself; so does the reading when the loop asks for it (the connection
    ended), and when the peer closed or sent a frame that fails, for the loop to end the link
    as it would have. ``read`` says False once the reading has gone back.
    """

    def __init__(self, protocol: FrameProtocol, take: Callable[[Frame], bool], returned: Callable[[], None], wake: Callable[[], None]):
        self._protocol = protocol
        self._take = take
        self.returned = returned
        self._wake = wake
        self.asked_back = False
        # Set by the borrower while it waits on the socket: the only time what arrives is read
        # at once. Otherwise (it computes) frames wait in the kernel, and the link's silence
        # says nothing of the peer (``FrameStream.reading_held``).
        self.waiting = False
        self._chunk = bytearray(LENT_READ_BYTES)

    def fileno(self) -> int | None:
        return self._protocol._fd

    def ask_back(self):
        """On the event loop: the borrower gives the reading back at its next look."""
        self.asked_back = True
        self._wake()

    def read(self) -> bool:
        """On the borrowing thread: read, decode and offer what has arrived. False once the reading
        went back to the loop (the borrower forgets this then)."""
        protocol, decoder = self._protocol, self._protocol._decoder
        with protocol._write_lock:  # the loop closes the descriptor under it: never read a reused one
            fd = protocol._fd
            if self.asked_back or fd is None:
                return self._give_back([], None)
            try:
                view = decoder.get_buffer()
                into = view if len(view) >= LENT_READ_BYTES else self._chunk
                n = os.readv(fd, [into])
            except BlockingIOError:
                return True  # woken for nothing: another time
            except OSError as e:
                return self._give_back([], ConnectionError(f"{protocol.address} closed the connection: {e}"))
        if n == 0:
            return self._give_back([], ConnectionError(f"{protocol.address} closed the connection"))
        frames: list[Frame] = []
        error = None
        try:
            if into is view:
                frames += decoder.buffer_updated(n)
            else:  # into the decoder's parts as it asks for them, as the loop's reads would
                data = memoryview(self._chunk)[:n]
                while data:
                    part = decoder.get_buffer()
                    k = min(len(part), len(data))
                    part[:k] = data[:k]
                    data = data[k:]
                    frames += decoder.buffer_updated(k)
        except FrameError as e:  # the frames before it count, as on the loop
            error = e
        for i, frame in enumerate(frames):
            if self.asked_back:
                return self._give_back(frames[i:], error)
            try:
                taken = self._take(frame)
            except Exception:  # the borrower's bug must not stop this connection's reading
                log.exception("handling a %s frame from %s failed", frame.type.name, protocol.address)
                taken = True
            if not taken:
                return self._give_back(frames[i:], error)
        return self._give_back([], error) if error is not None else True

    def _give_back(self, frames: list[Frame], error: Exception | None) -> bool:
        try:
            self._protocol._loop.call_soon_threadsafe(self._protocol._given_back, self, frames, error)
        except RuntimeError:  # the loop has closed, and the connection with it
            pass
        return False


class FrameStream:
    """An authenticated ring link: send and receive frames, every wait with a deadline.

    Every frame is sealed (a MAC, or AES-GCM when `encrypted`); one that fails
    its check ends the link, and recv() then raises ConnectionError whose
    __cause__ is the IntegrityError.
    """

    def __init__(self, protocol: FrameProtocol):
        self._protocol = protocol

    def __repr__(self) -> str:
        return f"<FrameStream {self.peer_id} at {self._protocol.address}>"

    @property
    def peer_id(self) -> str:
        return self._protocol.handshake.peer_id

    @property
    def peer_info(self) -> dict:
        """What the peer said about itself in its INFO, after proving the secret."""
        return self._protocol.handshake.peer_info

    @property
    def encrypted(self) -> bool:
        """True if frames are encrypted (either side asked), else only authenticated."""
        return self._protocol.handshake.encrypted

    @property
    def peername(self) -> tuple[str, int]:
        return self._protocol.peername

    @property
    def closed(self) -> bool:
        return self._protocol.closed

    def write(self, frame: Frame):
        """Queue `frame` on the transport now, without waiting for it to drain.

        Frames written this way leave in call order; the ring's hot path uses it
        so a stage never waits on a slow peer while holding the event loop.
        """
        self._protocol.write(frame)

    @property
    def reading_held(self) -> bool:
        """Whether the link's reading is lent to a thread that is not waiting on it (it computes):
        what the peer sends meanwhile waits unread, so no silence counts against the peer."""
        lent = self._protocol._lent
        return lent is not None and not lent.waiting

    def lend(self, take: Callable[[Frame], bool], returned: Callable[[], None], wake: Callable[[], None]) -> Lent | None:
        """The link's reading, for another thread to do (``Lent``); None where it cannot be lent.
        Only while ``serve`` hands frames to its handler: what the borrower does not take, the
        handler gets, in order."""
        return self._protocol.lend(take, returned, wake)

    def write_now(self, frame: Frame):
        """``write`` from any thread (a stage's compute thread): to the socket at once when
        nothing waits before it, else in order behind what does. Frames leave in the order of
        the calls, whichever threads made them; ConnectionError once the link has ended."""
        self._protocol.write_now(frame)

    async def send(self, frame: Frame, timeout: float = SEND_TIMEOUT_S):
        """Write `frame` and wait until the transport can take more.

        Unless the link is encrypted the payload is not copied: leave its buffer
        untouched until it is sent.
        If the peer does not take our bytes within `timeout`, the connection is
        dropped and TimeoutError raised.
        """
        self._protocol.write(frame)
        try:
            async with asyncio.timeout(timeout):
                await self._protocol.drain()
        except TimeoutError:
            error = TimeoutError(
                f"sending to {self.peer_id} ({self._protocol.address}) took longer than "
                f"{timeout} s: the peer stopped reading"
            )
            self._protocol.fail(error)
            raise error from None

    async def serve(self, handler: Callable[[Frame], None]):
        """Call ``handler(frame)`` for every frame, in order, as it is decoded (on the event loop:
        it must be quick), until the connection ends: then ConnectionError, whose message says
        why. A handler that raises is logged and the link carries on. No task wakes per frame,
        as one does for ``recv``: the ring's hop uses this."""
        await self._protocol.serve(handler)

    async def recv(self, timeout: float | None) -> Frame:
        """The next frame.

        ConnectionError once the connection has ended and no frames are left;
        TimeoutError if none arrives within `timeout` seconds (None: no deadline).
        """
        try:
            async with asyncio.timeout(timeout):
                return await self._protocol.read_frame()
        except TimeoutError:
            raise TimeoutError(
                f"no frame from {self.peer_id} ({self._protocol.address}) within {timeout} s"
            ) from None

    def close(self):
        self._protocol.close()

    async def wait_closed(self):
        await self._protocol.wait_closed()


async def connect(
    host: str,
    port: int,
    *,
    secret: bytes,
    node_id: str,
    cluster: str,
    info: dict | None = None,
    encrypt: bool = False,
    timeout: float = CONNECT_TIMEOUT_S,
) -> FrameStream:
    """Dial a peer and authenticate as initiator.

    `info` is read when it is sent, once the peer has proved the secret.
    `encrypt` asks for AES-GCM on this link (the peer may ask too).
    `timeout` bounds the TCP connect, HANDSHAKE_TIMEOUT_S the handshake after it.
    Raises ConnectionError, TimeoutError or HandshakeError, naming the address.
    """
    handshake = Handshake(
        secret=secret, node_id=node_id, cluster=cluster, initiator=True, info=info, encrypt=encrypt
    )
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            transport, protocol = await loop.create_connection(
                lambda: FrameProtocol(handshake), host, port
            )
    except TimeoutError:
        raise TimeoutError(f"connecting to {host}:{port} took longer than {timeout} s") from None
    except OSError as e:
        raise ConnectionError(f"cannot connect to {host}:{port}: {e}") from e
    try:
        await protocol.authenticated  # failures have already closed the transport
    except asyncio.CancelledError:
        transport.abort()
        raise
    return FrameStream(protocol)


async def serve(
    host: str,
    port: int,
    on_stream: Callable[[FrameStream], Awaitable[None]],
    *,
    secret: bytes,
    node_id: str,
    cluster: str,
    info: dict | None = None,
    encrypt: bool = False,
    trusted: Callable[[str], bool] = lambda host: False,
    sock: socket.socket | None = None,
) -> asyncio.AbstractServer:
    """Listen for peers; run `on_stream` in a task for each one that completes the handshake.

    `sock`: a listening socket to accept on instead of binding host:port (one a
    launcher bound and handed down, so nobody can take its port in between).

    `info` is read each time it is sent, once a peer has proved the secret.
    `encrypt` makes every accepted link encrypted; without it a link is
    encrypted if the dialer asks.
    `trusted(host)`: whether a connection from `host` (an IP address, spelled
    as wire.slots.canonical_host does) is a member's, asked as it arrives. Such
    connections take slots of their own and are never refused (wire.slots).
    It must be quick: it runs on the event loop for every connection.

    A peer that fails the handshake, or does not finish it within
    HANDSHAKE_TIMEOUT_S, is disconnected, and a warning logged (rate limited:
    see LOG_SUMMARY_INTERVAL_S). Connections over the caps on strangers still
    in the handshake are closed at once, and those closed to make room for a
    member's, only counted.
    """
    new_handshake = functools.partial(
        Handshake, secret=secret, node_id=node_id, cluster=cluster, initiator=False, info=info,
        encrypt=encrypt,
    )  # fmt: skip
    new_handshake()  # bad arguments fail here, not at the first connection
    handlers: set[asyncio.Task] = set()  # strong references, so tasks are not collected
    gate = _Gate(trusted)

    def on_handshake_over(protocol: FrameProtocol, authenticated: asyncio.Future):
        host, error = protocol.peername[0], authenticated.exception()
        if protocol.refused:
            _rate_limited_log().count("connections refused over the handshake caps", host)
            return
        if protocol.evicted:
            _rate_limited_log().count("handshakes closed to make room for members", host)
            return
        if error is not None:
            _rate_limited_log().warn("failed handshakes", host, str(error))
            return
        task = asyncio.create_task(_run_handler(on_stream, FrameStream(protocol)))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    def new_protocol() -> FrameProtocol:
        protocol = FrameProtocol(new_handshake(), gate)
        protocol.authenticated.add_done_callback(functools.partial(on_handshake_over, protocol))
        return protocol

    if sock is not None:
        return await asyncio.get_running_loop().create_server(new_protocol, sock=sock)
    return await asyncio.get_running_loop().create_server(new_protocol, host, port)


async def _run_handler(on_stream: Callable[[FrameStream], Awaitable[None]], stream: FrameStream):
    try:
        await on_stream(stream)
    except Exception:
        log.exception("handler for %r failed; closing the connection", stream)
        stream.close()
