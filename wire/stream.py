"""asyncio shell for ring links: TCP in, Frames out, and back.

FrameProtocol plugs the sans-I/O FrameDecoder and Handshake into an asyncio
BufferedProtocol: payloads land from the kernel straight into their frame's
buffer, and outgoing payloads are handed to the transport as memoryviews, not
joined to their header. (The selector loop of Python 3.11 still joins what it
is given in writelines; uvloop and Python 3.12+ write the buffers as they are.)

FrameStream is what the daemon holds: send/recv with deadlines, the peer's
authenticated identity. `connect` and `serve` hand one out only after the peer
has proved the cluster secret; until then a connection runs under
HANDSHAKE_LIMITS and nothing but the handshake is parsed.

What the frames mean (membership, plans, tensors) is for the layers above.
"""

import asyncio
import collections
import functools
import logging
import socket
from collections.abc import Awaitable, Callable

from wire.frames import (
    DEFAULT_LIMITS,
    HANDSHAKE_LIMITS,
    Frame,
    FrameDecoder,
    FrameError,
    encode_frame,
)
from wire.handshake import HANDSHAKE_TIMEOUT_S, Handshake, HandshakeError

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


class FrameProtocol(asyncio.BufferedProtocol):
    """One connection: runs the handshake, then queues frames in and writes frames out."""

    def __init__(self, handshake: Handshake):
        self.handshake = handshake
        # Resolves once the peer has proved the secret; fails with why it did not.
        self.authenticated: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoder = FrameDecoder(HANDSHAKE_LIMITS)
        self._transport: asyncio.Transport | None = None
        self.peername: tuple[str, int] = ("", 0)
        self._handshake_deadline: asyncio.TimerHandle | None = None
        self._frames: collections.deque[Frame] = collections.deque()
        self._reading_paused = False
        self._frame_arrived = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._error: Exception | None = None  # why the connection ended; first reason wins
        self._lost = asyncio.Event()

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
        self.peername = transport.get_extra_info("peername")[:2]
        # One small frame per generated token: Nagle's delay would stall the ring.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        timeout = HANDSHAKE_TIMEOUT_S
        self._handshake_deadline = asyncio.get_running_loop().call_later(
            timeout,
            self.fail,
            TimeoutError(f"handshake with {self.address} took longer than {timeout} s"),
        )
        self._write(self.handshake.start())

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int):
        try:
            for frame in self._decoder.buffer_updated(nbytes):
                if self.handshake.done:
                    self._deliver(frame)
                else:
                    self._handshake_step(frame)
        except FrameError as e:  # HandshakeError included
            if self.handshake.done:
                self.fail(FrameError(f"{self.address} sent a malformed frame: {e}"))
            else:
                self.fail(HandshakeError(f"handshake with {self.address} failed: {e}"))

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
        if self._error is not None:
            raise ConnectionError(str(self._error)) from self._error
        self._write([frame])

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
            log.warning("dropping %s (%s): %s", self.handshake.peer_id, self.address, error)
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

    # -- internals

    def _write(self, frames: list[Frame]):
        for frame in frames:
            self._transport.writelines(encode_frame(frame, self._decoder.limits))

    def _handshake_step(self, frame: Frame):
        self._write(self.handshake.receive(frame))
        if self.handshake.done:
            # Only now may the peer send more than HELLO and PROOF. The decoder
            # has read nothing past this frame, so the next header meets the new limits.
            self._decoder.limits = DEFAULT_LIMITS
            self._handshake_deadline.cancel()
            if not self.authenticated.done():  # connect() may have been cancelled
                self.authenticated.set_result(None)

    def _deliver(self, frame: Frame):
        self._frames.append(frame)
        self._frame_arrived.set()
        if len(self._frames) >= RECV_QUEUE_FRAMES and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()

    def _end(self, error: Exception):
        """Record why the connection ended and wake everyone waiting on it."""
        if self._error is None:
            self._error = error
        if self._handshake_deadline is not None:
            self._handshake_deadline.cancel()
        if not self.authenticated.done():
            self.authenticated.set_exception(self._error)
        self._frame_arrived.set()
        self._can_write.set()


class FrameStream:
    """An authenticated ring link: send and receive frames, every wait with a deadline."""

    def __init__(self, protocol: FrameProtocol):
        self._protocol = protocol

    def __repr__(self) -> str:
        return f"<FrameStream {self.peer_id} at {self._protocol.address}>"

    @property
    def peer_id(self) -> str:
        return self._protocol.handshake.peer_id

    @property
    def peer_info(self) -> dict:
        return self._protocol.handshake.peer_info

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

    async def send(self, frame: Frame, timeout: float = SEND_TIMEOUT_S):
        """Write `frame` and wait until the transport can take more.

        The payload is not copied: leave its buffer untouched until it is sent.
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
    timeout: float = CONNECT_TIMEOUT_S,
) -> FrameStream:
    """Dial a peer and authenticate as initiator.

    `timeout` bounds the TCP connect, HANDSHAKE_TIMEOUT_S the handshake after it.
    Raises ConnectionError, TimeoutError or HandshakeError, naming the address.
    """
    handshake = Handshake(
        secret=secret, node_id=node_id, cluster=cluster, initiator=True, info=info
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
) -> asyncio.AbstractServer:
    """Listen for peers; run `on_stream` in a task for each one that authenticates.

    A peer that fails the handshake, or does not finish it within
    HANDSHAKE_TIMEOUT_S, is disconnected with one warning line.
    """
    new_handshake = functools.partial(
        Handshake, secret=secret, node_id=node_id, cluster=cluster, initiator=False, info=info
    )
    new_handshake()  # bad arguments fail here, not at the first connection
    handlers: set[asyncio.Task] = set()  # strong references, so tasks are not collected

    def on_handshake_over(protocol: FrameProtocol, authenticated: asyncio.Future):
        if authenticated.exception() is not None:
            log.warning("%s", authenticated.exception())
            return
        task = asyncio.create_task(_run_handler(on_stream, FrameStream(protocol)))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    def new_protocol() -> FrameProtocol:
        protocol = FrameProtocol(new_handshake())
        protocol.authenticated.add_done_callback(functools.partial(on_handshake_over, protocol))
        return protocol

    return await asyncio.get_running_loop().create_server(new_protocol, host, port)


async def _run_handler(on_stream: Callable[[FrameStream], Awaitable[None]], stream: FrameStream):
    try:
        await on_stream(stream)
    except Exception:
        log.exception("handler for %r failed; closing the connection", stream)
        stream.close()
