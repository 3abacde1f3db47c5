"""Ring links over real TCP on loopback, with asyncio's loop and with uvloop."""

import asyncio
import threading
import contextlib
import dataclasses
import logging
import re
import socket
import time

import mlx.core as mx
import numpy as np
import pytest
import uvloop

import wire.stream
from wire.frames import (
    DEFAULT_LIMITS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    MsgType,
    encode_frame,
)
from wire.handshake import Handshake, HandshakeError
from wire.seal import MAC_BYTES, TAG_BYTES, IntegrityError
from wire.stream import FrameStream, connect, serve
from wire.tensors import tensor_descriptor, tensor_from_buffer, tensor_to_buffer

pytestmark = pytest.mark.timeout(60)

SECRET = b"loopback-secret"
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    return LOOPS[request.param]


@contextlib.asynccontextmanager
async def server(on_stream=None, *, secret=SECRET, cluster="lab", encrypt=False, trusted=None):
    """A `serve` on an ephemeral port; yields (port, queue of accepted streams).

    With `on_stream` given, that handles the streams instead of the queue. On
    exit every accepted stream is closed, so no test leaks a socket.
    `trusted`: the addresses `serve` takes for members' (none by default).
    """
    accepted: asyncio.Queue[FrameStream] = asyncio.Queue()
    streams: list[FrameStream] = []

    async def handle(stream: FrameStream):
        streams.append(stream)
        await (on_stream or accepted.put)(stream)

    srv = await serve(
        "127.0.0.1",
        0,
        handle,
        secret=secret,
        node_id="server",
        cluster=cluster,
        info={"ring_port": 1234},
        encrypt=encrypt,
        trusted=lambda host: host in (trusted or ()),
    )
    try:
        yield srv.sockets[0].getsockname()[1], accepted
    finally:
        srv.close()
        await srv.wait_closed()
        for stream in streams:
            stream.close()
            await stream.wait_closed()
            await stream.wait_closed()


class Recorder(list):
    """An on_stream that only remembers who it was called for."""

    async def __call__(self, stream: FrameStream):
        self.append(stream)


def dial(port, **kwargs):
    args = {"secret": SECRET, "node_id": "client", "cluster": "lab", **kwargs}
    return connect("127.0.0.1", port, **args)


async def raw_handshake(port: int, encrypt: bool = False):
    """A client that speaks the handshake by hand, then whatever the test likes.

    Returns the reader, the writer and the session, whose sealer seals what the
    test sends next.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    handshake = Handshake(
        secret=SECRET, node_id="raw", cluster="lab", initiator=True, encrypt=encrypt
    )
    decoder = FrameDecoder(handshake.limits)

    def send(frames):
        sealer = handshake.session.sealer if handshake.session else None
        for frame in frames:
            writer.writelines(encode_frame(frame, DEFAULT_LIMITS, sealer))

    send(handshake.start())
    while not handshake.done:
        buf = decoder.get_buffer()
        # At most what the current part needs: read nothing past the server's INFO.
        chunk = await reader.read(len(buf))
        if not chunk:
            raise ConnectionError("the server closed the connection in the handshake")
        buf[: len(chunk)] = chunk
        for frame in decoder.buffer_updated(len(chunk)):
            replies = handshake.receive(frame)
            if handshake.session is not None and decoder.opener is None:
                decoder.opener = handshake.session.opener
            decoder.limits = handshake.limits
            send(replies)
    return reader, writer, handshake.session


async def until(condition, timeout: float = 10.0, what: str = "condition"):
    """Wait for `condition()` to hold, checking often; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.01)


def stream_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "wire.stream" and r.levelno >= logging.WARNING
    ]


async def read_until_eof(reader: asyncio.StreamReader, timeout: float) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk
    return data


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
def test_tensor_frames_round_trip_bit_exactly(run, encrypt):
    arrays = [
        mx.random.normal((1, 7, 64)).astype(mx.bfloat16),
        mx.array([[np.nan, -0.0], [np.inf, 1e-40]], dtype=mx.float32),
        mx.array(np.frombuffer(np.arange(1, 17, dtype=np.uint16).tobytes(), np.uint16)).view(
            mx.bfloat16
        ),  # NaN and subnormal bfloat16 bit patterns
        mx.arange(12, dtype=mx.int64).reshape(3, 4).T,
        mx.array([True, False, True]),
        mx.array([1 + 2j, -3j], dtype=mx.complex64),
        mx.zeros((0, 5), dtype=mx.float16),
        mx.array(7, dtype=mx.uint8),
    ]

    async def echo(stream: FrameStream):
        while True:
            try:
                frame = await stream.recv(None)
            except ConnectionError:
                return
            await stream.send(frame)

    async def main():
        async with server(echo) as (port, _):
            stream = await dial(port, encrypt=encrypt)
            assert (stream.peer_id, stream.peer_info) == ("server", {"ring_port": 1234})
            assert stream.peername == ("127.0.0.1", port)
            assert stream.encrypted == encrypt
            for i, arr in enumerate(arrays):
                desc = {"tensor": tensor_descriptor(arr)}
                await stream.send(Frame(MsgType.CONTROL, i, desc, tensor_to_buffer(arr)))
            for i, arr in enumerate(arrays):
                frame = await stream.recv(5)
                assert frame.request_id == i
                back = tensor_from_buffer(frame.descriptor["tensor"], frame.payload)
                assert back.dtype == arr.dtype and back.shape == arr.shape
                assert bytes(tensor_to_buffer(back)) == bytes(tensor_to_buffer(arr))
            stream.close()
            await stream.wait_closed()
            await stream.wait_closed()
            assert stream.closed

    run(main())


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
def test_large_payload_arrives_intact(run, encrypt):
    payload = np.random.default_rng(0).integers(0, 256, 64 * 1024 * 1024, np.uint8).tobytes()

    async def main():
        async with server() as (port, accepted):
            stream = await dial(port, encrypt=encrypt)
            # Sent at once: the server may not have seen our INFO yet.
            await stream.send(Frame(MsgType.CONTROL, 1, {"n": len(payload)}, payload))
            theirs = await accepted.get()
            frame = await theirs.recv(10)
            assert frame.descriptor == {"n": len(payload)} and frame.payload == payload
            stream.close()
            await stream.wait_closed()

    run(main())


def test_many_frames_arrive_in_order_through_backpressure(monkeypatch):
    monkeypatch.setattr(wire.stream, "RECV_QUEUE_FRAMES", 4)  # reading pauses often
    count = 2000

    async def main():
        async with server() as (port, accepted):
            stream = await dial(port)
            theirs = await accepted.get()
            payload = bytes(range(256)) * 64

            async def sender():
                for i in range(count):
                    await stream.send(Frame(MsgType.CONTROL, i, {"i": i}, payload))

            sending = asyncio.create_task(sender())
            # The receiver stops reading, so the sender's transport fills and it waits to write.
            deadline = asyncio.get_running_loop().time() + 10
            while stream._protocol._can_write.is_set() or not theirs._protocol._reading_paused:
                assert asyncio.get_running_loop().time() < deadline, "the receiver never stopped reading, or the sender never had to wait"
                await asyncio.sleep(0.01)
            assert not sending.done()
            for i in range(count):
                frame = await theirs.recv(5)
                assert (frame.request_id, frame.descriptor, frame.payload) == (i, {"i": i}, payload)
            await sending
            stream.close()
            await stream.wait_closed()
            # Our close reaches the peer once it has read everything before it.
            with pytest.raises(ConnectionError, match="closed the connection"):
                await theirs.recv(5)

    asyncio.run(main())


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
def test_frames_written_from_a_thread_and_the_loop_arrive_sealed_and_in_each_writers_order(run, encrypt, monkeypatch):
    """A stage's compute thread writes its frames with ``write_now`` while the event loop writes
    its own on the same link: each writer's frames arrive in its order, every seal checks out
    (one out of order would drop the link), through a peer that stops reading for a while so
    the thread's writes must wait behind what the socket did not take."""
    flushes = []
    flush = wire.stream.FrameProtocol._flush
    monkeypatch.setattr(wire.stream.FrameProtocol, "_flush", lambda self: (flushes.append(len(self._behind)), flush(self)))
    count, payload = 300, bytes(range(256)) * 256  # 64 KiB a frame: the kernel's buffers fill

    async def main():
        async with server(encrypt=encrypt) as (port, accepted):
            stream = await dial(port, encrypt=encrypt)
            theirs = await accepted.get()
            theirs._protocol._transport.pause_reading()  # the peer stops reading

            def thread_writes():
                for i in range(count):
                    stream.write_now(Frame(MsgType.CONTROL, i, {"w": "thread"}, payload))

            writer = threading.Thread(target=thread_writes)
            writer.start()
            for i in range(count):  # the loop's frames on the same link meanwhile
                stream.write(Frame(MsgType.CONTROL, i, {"w": "loop"}))
                await asyncio.sleep(0)
            await asyncio.to_thread(writer.join, 30)
            theirs._protocol._transport.resume_reading()
            seen = {"thread": [], "loop": []}
            for _ in range(2 * count):
                frame = await theirs.recv(10)
                seen[frame.descriptor["w"]].append(frame.request_id)
                assert frame.descriptor["w"] == "loop" or frame.payload == payload
            assert seen == {"thread": list(range(count)), "loop": list(range(count))}
            assert flushes, "the socket took everything at once: the test did not fill it"
            stream.close()
            with pytest.raises(ConnectionError):
                stream.write_now(Frame(MsgType.CONTROL, 0, {"w": "thread"}))

    run(main())


def test_wrong_secret_is_refused_on_both_sides(caplog):
    called = Recorder()

    async def main():
        async with server(called, secret=b"other") as (port, _):
            with pytest.raises(HandshakeError, match=f"127.0.0.1:{port}.*different cluster secret"):
                await dial(port)
            await until(lambda: stream_warnings(caplog), what="the server's warning")

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    assert called == []
    [warning] = stream_warnings(caplog)
    assert "handshake with 127.0.0.1:" in warning
    assert "different cluster secret" in warning
    assert SECRET.decode() not in warning and "other" not in warning


def test_a_stranger_without_the_secret_learns_no_info():
    """The server's INFO goes out only after the peer's PROOF has verified."""

    async def main():
        async with server(Recorder()) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            stranger = Handshake(secret=b"guess", node_id="x", cluster="lab", initiator=True)
            hello = stranger.start()
            proof = stranger.receive(await read_hello(reader))
            for frame in hello + proof:
                writer.writelines(encode_frame(frame))
            seen = await read_until_eof(reader, timeout=5)
            writer.close()
            with contextlib.suppress(ConnectionResetError):
                await writer.wait_closed()
            return seen

    seen = asyncio.run(main())
    assert seen  # the server's PROOF, before it read ours
    assert b"ring_port" not in seen and b"1234" not in seen


async def read_hello(reader: asyncio.StreamReader) -> Frame:
    head = await reader.readexactly(HEADER_BYTES)
    descriptor_len = HEADER.unpack(head)[5]
    [hello] = FrameDecoder().feed(head + await reader.readexactly(descriptor_len))
    return hello


@pytest.mark.parametrize("dialer, listener", [(True, False), (False, True), (True, True)])
def test_encryption_is_on_if_either_side_asks(dialer, listener):
    async def main():
        async with server(encrypt=listener) as (port, accepted):
            stream = await dial(port, encrypt=dialer)
            theirs = await accepted.get()
            assert stream.encrypted and theirs.encrypted
            await stream.send(Frame(MsgType.CONTROL, 1, {"k": "v"}, b"secret bytes"))
            frame = await theirs.recv(5)
            assert (frame.descriptor, bytes(frame.payload)) == ({"k": "v"}, b"secret bytes")
            stream.close()
            await stream.wait_closed()

    asyncio.run(main())


def test_other_cluster_is_refused(caplog):
    async def main():
        async with server(cluster="prod") as (port, accepted):
            with pytest.raises(HandshakeError, match="peer is in cluster 'prod'"):
                await dial(port)
            # The server refuses it too, and says so: it is done with the connection then.
            await until(lambda: stream_warnings(caplog), what="the server's refusal")
            assert accepted.empty()

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    [warning] = stream_warnings(caplog)
    assert re.fullmatch(r"handshake with 127\.0\.0\.1:\d+ failed: peer is in cluster 'lab', this node in 'prod'", warning), warning


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic b'GET '"),
        (b"", "took longer than 0.3 s"),  # says nothing at all
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, 0, 0, 0, 1 << 20), "limit of 0"),
    ],
)
def test_strangers_are_dropped_and_why_is_logged(monkeypatch, caplog, garbage, reason):
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 0.3)
    called = Recorder()

    async def main():
        async with server(called) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(garbage)
            # The server hangs up (a generous deadline that raises; the logged reason says
            # which rule dropped it, the handshake timeout for the one that says nothing).
            await read_until_eof(reader, timeout=30)
            writer.close()
            # The server closed with our garbage unread: the kernel may answer with a reset.
            with contextlib.suppress(ConnectionResetError):
                await writer.wait_closed()

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    assert called == []
    [warning] = stream_warnings(caplog)
    assert "127.0.0.1:" in warning and reason in warning


def test_connect_to_a_silent_server_times_out(monkeypatch):
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 0.3)

    async def main():
        writers = []
        silent = await asyncio.start_server(lambda r, w: writers.append(w), "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        with pytest.raises(TimeoutError, match=f"handshake with 127.0.0.1:{port} took longer"):
            await dial(port)
        for writer in writers:
            writer.close()
            await writer.wait_closed()
        silent.close()
        await silent.wait_closed()

    asyncio.run(main())


def test_connect_to_a_closed_port_fails_with_the_refusal_and_no_retry():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once it is closed

    with pytest.raises(ConnectionError, match=f"cannot connect to 127.0.0.1:{port}") as e:
        asyncio.run(dial(port))
    # The kernel's refusal itself, passed on: not a timeout, nor the last of several tries.
    assert type(e.value.__cause__) is ConnectionRefusedError, repr(e.value.__cause__)


def test_oversized_header_after_the_handshake_drops_the_peer(caplog):
    async def main():
        async with server() as (port, accepted):
            reader, writer, _ = await raw_handshake(port)
            theirs = await accepted.get()
            # A header no honest node writes (encode_frame refuses it).
            too_big = MAX_PAYLOAD_BYTES + 1
            writer.write(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, 0, 9, 0, too_big))
            with pytest.raises(ConnectionError, match=f"limit of {MAX_PAYLOAD_BYTES} bytes"):
                await theirs.recv(5)
            assert theirs.closed
            assert await read_until_eof(reader, timeout=5) == b""
            writer.close()
            await writer.wait_closed()

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    assert any("dropping raw (127.0.0.1:" in r.message for r in caplog.records)


def test_deadlines_and_closed_streams():
    async def main():
        async with server() as (port, accepted):
            stream = await dial(port)
            theirs = await accepted.get()
            with pytest.raises(TimeoutError, match=r"no frame from server .* within 0\.05 s"):
                await stream.recv(0.05)
            await theirs.send(Frame(MsgType.ERROR, 3, {"message": "bye"}))
            theirs.close()
            # Frames sent before the close are still delivered, then the close.
            assert (await stream.recv(5)).descriptor == {"message": "bye"}
            with pytest.raises(ConnectionError, match="closed the connection"):
                await stream.recv(5)
            with pytest.raises(ConnectionError):
                await stream.send(Frame(MsgType.PING))
            with pytest.raises(ConnectionError, match="closed by this node"):
                await theirs.recv(None)

    asyncio.run(main())


def test_send_to_a_peer_that_stopped_reading_times_out():
    async def main():
        async with server() as (port, accepted):
            _, writer, _ = await raw_handshake(port)  # and then never reads again
            theirs = await accepted.get()
            big = Frame(MsgType.CONTROL, 1, payload=bytes(64 * 1024 * 1024))
            with pytest.raises(TimeoutError, match=r"took longer than 0\.2 s"):
                await theirs.send(big, timeout=0.2)
            assert theirs.closed
            with pytest.raises(ConnectionError, match="the peer stopped reading"):
                await theirs.recv(1)
            writer.close()
            await writer.wait_closed()

    asyncio.run(main())


# -- a relay that knows no secret, between a real `connect` and a real `serve`


@dataclasses.dataclass
class Cut:
    """A relay's answer: send `to_server`, close the dialer's side, pass nothing more."""

    to_server: bytes = b""


class Relay:
    """A TCP proxy in the middle: dialer <-> relay <-> server, knowing no secret.

    It splits each direction into frames (headers are in the clear; from the
    third frame on, HELLO and PROOF being the first two, each carries a
    `trailer`) and passes each one through `tamper(direction, index, frame,
    seen)`, which returns the bytes to pass on or a Cut; `seen` is every frame
    of that direction so far ("up" is dialer to server, "down" the other way).
    """

    def __init__(self, target_port: int, trailer: int, tamper=None):
        self.target_port, self.trailer = target_port, trailer
        self.tamper = tamper or (lambda direction, index, frame, seen: frame)
        self.seen: dict[str, list[bytes]] = {"up": [], "down": []}
        self.tasks: set[asyncio.Task] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> int:
        self.listener = await asyncio.start_server(self._on_dialer, "127.0.0.1", 0)
        return self.listener.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc):
        self.listener.close()
        await self.listener.wait_closed()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _on_dialer(self, dialer_r, dialer_w):
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [dialer_w, server_w]
        cut = asyncio.Event()
        for args in ((dialer_r, server_w, "up"), (server_r, dialer_w, "down")):
            task = asyncio.create_task(self._pump(*args, cut, dialer_w, server_w))
            self.tasks.add(task)

    async def _pump(self, reader, writer, direction, cut, dialer_w, server_w):
        index = 0
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while not cut.is_set():
                head = await reader.readexactly(HEADER_BYTES)
                descriptor_len, payload_len = HEADER.unpack(head)[5:]
                trailer = self.trailer if index >= 2 else 0
                frame = head + await reader.readexactly(descriptor_len + payload_len + trailer)
                self.seen[direction].append(frame)
                out = self.tamper(direction, index, frame, self.seen[direction])
                index += 1
                if cut.is_set():
                    return
                if isinstance(out, Cut):
                    cut.set()
                    server_w.write(out.to_server)
                    dialer_w.close()  # and hold the server's connection open, silent
                    return
                writer.write(out)
        if not cut.is_set():
            writer.close()  # a plain proxy passes an end on


TRAILERS = {False: MAC_BYTES, True: TAG_BYTES}


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
def test_a_relay_passing_bytes_through_is_just_a_proxy(encrypt):
    async def main():
        async with server() as (port, accepted), Relay(port, TRAILERS[encrypt]) as relay_port:
            stream = await dial(relay_port, encrypt=encrypt)
            theirs = await accepted.get()
            assert (stream.peer_id, theirs.peer_id, theirs.peer_info) == ("server", "client", {})
            for i in range(3):
                await stream.send(Frame(MsgType.CONTROL, i, {"i": i}, bytes([i]) * 1000))
                await theirs.send(Frame(MsgType.STATUS, i, {"token": i}))
            for i in range(3):
                assert (await theirs.recv(5)).descriptor == {"i": i}
                assert (await stream.recv(5)).descriptor == {"token": i}
            stream.close()
            await stream.wait_closed()

    asyncio.run(main())


def flip_a_byte(frame: bytes) -> bytes:
    middle = len(frame) // 2
    return frame[:middle] + bytes([frame[middle] ^ 0x10]) + frame[middle + 1 :]


def sealed_looking_ping(trailer: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PING, 0, 0, 0, 0) + bytes(trailer)


# What the relay does to the data frames after the handshake: frame 2 of each
# direction is INFO, so 3 and 4 are the two FORWARDs the test sends.
TAMPERING = {
    "inject a frame": lambda seen, i, f, t: sealed_looking_ping(t) + f if i == 3 else f,
    "inject junk bytes": lambda seen, i, f, t: b"\0junk" + f if i == 4 else f,
    "replay a frame": lambda seen, i, f, t: f + seen[3] if i == 4 else f,
    "replay the INFO": lambda seen, i, f, t: seen[2] + f if i == 3 else f,
    "flip one byte": lambda seen, i, f, t: flip_a_byte(f) if i == 3 else f,
    "swap two frames": lambda seen, i, f, t: b"" if i == 3 else (f + seen[3] if i == 4 else f),
    "drop a frame": lambda seen, i, f, t: b"" if i == 3 else f,
}


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("tampering", sorted(TAMPERING))
def test_a_relay_that_tampers_after_the_handshake_gets_the_link_closed(
    caplog, tampering, direction, encrypt
):
    change = TAMPERING[tampering]
    trailer = TRAILERS[encrypt]

    def tamper(way, index, frame, seen):
        return change(seen, index, frame, trailer) if way == direction else frame

    async def main():
        async with server() as (port, accepted), Relay(port, trailer, tamper) as relay_port:
            client = await dial(relay_port, encrypt=encrypt)
            serving = await accepted.get()
            sender, receiver = (client, serving) if direction == "up" else (serving, client)
            sent = [Frame(MsgType.CONTROL, i, {"i": i}, bytes([i]) * 64) for i in (1, 2)]
            for frame in sent:
                await sender.send(frame)
            got = []
            with pytest.raises(ConnectionError) as closed:
                while True:
                    got.append(await receiver.recv(5))
            assert isinstance(closed.value.__cause__, IntegrityError), closed.value
            assert "failed its" in str(closed.value)
            assert got == sent[: len(got)]  # what came through is what was sent
            assert receiver.closed
            # The other end sees the link go, too.
            with pytest.raises(ConnectionError):
                await sender.recv(5)

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    peer = "client" if direction == "up" else "server"
    assert any(
        f"dropping {peer} (127.0.0.1:" in w and "failed its" in w for w in stream_warnings(caplog)
    )


# What the relay sends the server in place of the dialer's INFO, and how the
# server ends the handshake: waiting out its deadline, or on a failed MAC.
FORGED_INFOS = {
    "nothing": "took longer than 0.5 s",
    "an unsealed INFO": "took longer than 0.5 s",  # the server waits for a MAC that never comes
    "an INFO with a made-up MAC": "INFO frame failed its MAC check as frame 0",
    "the dialer's INFO, altered": "INFO frame failed its MAC check as frame 0",
}


@pytest.mark.parametrize("forged", sorted(FORGED_INFOS))
def test_a_relay_that_drops_the_dialer_after_the_proofs_gets_no_stream(monkeypatch, caplog, forged):
    """The proofs pass through a relay; the INFO it needs cannot be made without the secret."""
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 0.5)
    info = Frame(MsgType.INFO, descriptor={"info": {"addr": "10.6.6.6:1"}})
    unsealed = b"".join(bytes(b) for b in encode_frame(info))

    def tamper(direction, index, frame, seen):
        if index < 2:
            return frame  # HELLO and PROOF, both ways
        if direction == "down":
            return b""  # the server's INFO: the dialer is about to be dropped anyway
        # The dialer's INFO, sent once it had the server's PROOF, is held back.
        return Cut({
            "nothing": b"",
            "an unsealed INFO": unsealed,
            "an INFO with a made-up MAC": unsealed + bytes(MAC_BYTES),
            "the dialer's INFO, altered": flip_a_byte(frame),
        }[forged])  # fmt: skip

    called = Recorder()

    async def main():
        async with server(called) as (port, _), Relay(port, MAC_BYTES, tamper) as relay_port:
            with pytest.raises((ConnectionError, HandshakeError)):
                await dial(relay_port)
            await until(lambda: stream_warnings(caplog), what="the server giving up")
            assert called == []

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    [warning] = stream_warnings(caplog)
    assert "handshake with 127.0.0.1:" in warning and FORGED_INFOS[forged] in warning, warning


# -- bounds on strangers


async def admitted(port: int, host: str) -> asyncio.StreamWriter:
    """A silent connection from `host`, taken into the handshake (the server sent its HELLO)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    await read_hello(reader)
    return writer


async def refused(port: int, host: str) -> bool:
    """Whether a connection from `host` is closed at once, without a HELLO."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    data = await read_until_eof(reader, timeout=5)
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return data == b""


def test_connections_over_the_handshake_caps_are_closed_at_once(monkeypatch, caplog):
    monkeypatch.setattr(wire.stream, "MAX_UNAUTHENTICATED", 3)
    monkeypatch.setattr(wire.stream, "MAX_UNAUTHENTICATED_PER_HOST", 2)
    monkeypatch.setattr(wire.stream, "LOG_SUMMARY_INTERVAL_S", 0.5)
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 30.0)  # strangers stay while we look

    async def main():
        async with server() as (port, accepted):
            silent = [await admitted(port, "127.0.0.1"), await admitted(port, "127.0.0.1")]
            assert await refused(port, "127.0.0.1")  # the per-address cap
            silent.append(await admitted(port, "127.0.0.2"))
            assert await refused(port, "127.0.0.3")  # the total cap
            with pytest.raises(ConnectionError, match="closed the connection during the handshake"):
                await dial(port)
            assert not any("refused" in w for w in stream_warnings(caplog))  # counted, not logged

            for writer in silent:
                writer.close()
                await writer.wait_closed()

            # Once the strangers are gone, an honest peer gets in again.
            async def honest_dial_works() -> FrameStream:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        return await dial(port)
                    except ConnectionError:
                        assert time.monotonic() < deadline, "the caps were never released"

            stream = await honest_dial_works()
            assert stream.peer_id == "server" and (await accepted.get()).peer_id == "client"
            stream.close()
            await stream.wait_closed()
            await until(
                lambda: any("refused" in w for w in stream_warnings(caplog)), what="the summary"
            )

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    [summary] = [w for w in stream_warnings(caplog) if "refused" in w]
    refusals = int(re.search(r"connections refused over the handshake caps: (\d+)", summary)[1])
    assert refusals >= 3  # 127.0.0.1, 127.0.0.3, the early dial (and retries of the last)


async def stalled(port: int, host: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Like `admitted`, keeping the reader: whether the server closes it is what a test looks at."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    await read_hello(reader)
    return reader, writer


def test_a_members_address_gets_in_while_a_flood_holds_every_handshake_slot(run, monkeypatch):
    """Strangers fill their slots, an attacker on the member's own address (one NAT) fills the
    members' slots, and the member's dials still get in, each closing the flood's oldest."""
    monkeypatch.setattr(wire.stream, "MAX_UNAUTHENTICATED", 4)
    monkeypatch.setattr(wire.stream, "MAX_UNAUTHENTICATED_PER_HOST", 2)
    monkeypatch.setattr(wire.stream, "MAX_UNAUTHENTICATED_KNOWN", 3)
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 30.0)  # the flood stays while we look
    member = "127.0.0.1"  # where `dial` comes from
    evictions = "handshakes closed to make room for members"

    async def main():
        before = wire.stream.EVENTS[evictions]
        async with server(trusted={member}) as (port, accepted):
            hosts = ["127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"]
            strangers = [await admitted(port, host) for host in hosts]
            assert await refused(port, "127.0.0.4")  # the strangers' slots are all taken
            flood = [await stalled(port, member) for _ in range(3)]  # and so are the members'

            first = await dial(port)
            assert first.peer_id == "server"
            first_theirs = await accepted.get()
            # The flood's oldest made room; a new flood connection takes the slot back.
            assert await read_until_eof(flood[0][0], timeout=5) == b""
            flood.append(await stalled(port, member))
            second = await dial(port)
            second_theirs = await accepted.get()
            assert await read_until_eof(flood[1][0], timeout=5) == b""
            await until(lambda: wire.stream.EVENTS[evictions] - before == 2, what="the evictions")
            # Strangers got nothing from it: every slot of theirs is still taken.
            assert await refused(port, "127.0.0.4")
            # A link is never evicted, however the flood goes on: it left the slots at its end.
            flood.append(await stalled(port, member))
            flood.append(await stalled(port, member))  # the pool is full again: evicts flood[2]
            assert await read_until_eof(flood[2][0], timeout=5) == b""
            for ours, theirs in [(first, first_theirs), (second, second_theirs)]:
                await ours.send(Frame(MsgType.CONTROL, 1, {"still": "linked"}))
                assert (await theirs.recv(5)).descriptor == {"still": "linked"}
                ours.close()
                await ours.wait_closed()
            for writer in strangers + [writer for _, writer in flood]:
                writer.close()

    run(main())


def test_failed_handshakes_are_logged_rate_limited(monkeypatch, caplog):
    monkeypatch.setattr(wire.stream, "LOG_SUMMARY_INTERVAL_S", 1.0)
    attempts = {"127.0.0.1": 12, "127.0.0.2": 3}

    async def main():
        async with server(Recorder()) as (port, _):

            async def fail(host):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                await read_until_eof(reader, timeout=30)
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

            for host, count in attempts.items():
                for _ in range(count):
                    await fail(host)
            # The summary comes at the end of the interval; the events are all in by now.
            suppressed = sum(attempts.values()) - len(attempts)  # all but one per address
            await until(
                lambda: sum(counted(w) for w in stream_warnings(caplog)) == suppressed,
                what="the summary of suppressed failures",
            )
            # One more from an address logged before, after a summary: counted in the next one,
            # which comes an interval after it at the soonest.
            await fail("127.0.0.1")
            await until(
                lambda: sum(counted(w) for w in stream_warnings(caplog)) == suppressed + 1,
                what="the next summary",
            )

    def counted(line: str) -> int:
        match = re.search(r"failed handshakes: (\d+)", line)
        return int(match[1]) if match and "not logged one by one" in line else 0

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    lines = stream_warnings(caplog)
    firsts = [w for w in lines if "not logged one by one" not in w]
    assert len(firsts) == 2  # one per address
    assert {re.search(r"handshake with (127\.0\.0\.\d):", w)[1] for w in firsts} == set(attempts)
    assert all("bad magic" in w for w in firsts)
    summaries = [r.created for r in caplog.records if r.name == "wire.stream" and "not logged one by one" in r.getMessage()]
    # At most one summary line per interval, however many failures: consecutive ones an interval
    # apart at least. (Records carry the wall clock and the loop times by the monotonic one: they
    # may disagree by a millisecond over an interval, hence the 10 ms.)
    assert len(summaries) >= 2 and all(b - a >= wire.stream.LOG_SUMMARY_INTERVAL_S - 0.01 for a, b in zip(summaries, summaries[1:])), summaries
    assert all(SECRET.decode() not in w for w in lines)


def test_serve_hands_every_frame_to_the_handler_in_order_and_says_why_the_link_ended(run, caplog):
    """Frames queued before ``serve`` come first, then each as it is decoded; a handler that
    raises is logged and the link carries on; the end of the link is a ConnectionError."""

    async def main():
        async with server() as (port, accepted):
            stream = await dial(port)
            theirs = await accepted.get()
            for i in range(3):  # before anyone serves: queued
                await stream.send(Frame(MsgType.CONTROL, i, {"i": i}))
            await until(lambda: len(theirs._protocol._frames) == 3, what="three frames queued")
            got = []

            def handler(frame):
                got.append(frame.request_id)
                if frame.request_id == 4:
                    raise RuntimeError("a handler's bug")

            serving = asyncio.create_task(theirs.serve(handler))
            for i in range(3, 8):
                await stream.send(Frame(MsgType.CONTROL, i, {"i": i}))
            await until(lambda: len(got) == 8, what="eight frames handled")
            assert got == list(range(8))
            stream.close()
            with pytest.raises(ConnectionError, match="closed the connection"):
                await asyncio.wait_for(serving, 10)

    with caplog.at_level(logging.ERROR, logger="wire.stream"):
        run(main())
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]  # the handler's bug, once
    assert record.name == "wire.stream" and re.fullmatch(r"handling a CONTROL frame from 127\.0\.0\.1:\d+ failed", record.getMessage()), record.getMessage()
    assert record.exc_info[0] is RuntimeError and str(record.exc_info[1]) == "a handler's bug"


class Borrower:
    """A thread that reads a lent link as a stage's compute thread does: ``read`` whenever the
    socket is readable or the loop asked for the reading back, until it has gone back."""

    def __init__(self, stream: FrameStream, take, loop: asyncio.AbstractEventLoop):
        self.taken: list[int] = []
        self.woken = threading.Event()
        self.returned = asyncio.Event()
        self.take = take
        self.lent = stream.lend(self._take, lambda: self.returned.set(), self.woken.set)
        assert self.lent is not None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _take(self, frame: Frame) -> bool:
        assert threading.current_thread() is self.thread
        if not self.take(frame):
            return False
        self.taken.append(frame.request_id)
        return True

    def _read(self):
        import select

        while True:
            fd = self.lent.fileno()
            if fd is not None and not self.lent.asked_back:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                poller.poll(20)
            if not self.lent.read():
                return


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encryption"])
def test_a_lent_reading_takes_frames_on_a_thread_and_gives_the_rest_back_to_the_loop_in_order(run, encrypt):
    """A stage's compute thread reads its link itself: it takes the frames it wants, on its own
    thread; the first it does not take goes back to the loop's handler with every frame after it,
    in order, and the loop reads on; lent again, the thread takes the next ones. Nothing is lost
    or reordered, a frame of 64 KiB (read in place) as well as small ones."""

    async def main():
        async with server(encrypt=encrypt) as (port, accepted):
            stream = await dial(port, encrypt=encrypt)
            theirs = await accepted.get()
            handled = []
            serving = asyncio.create_task(theirs.serve(lambda frame: handled.append(frame.request_id)))
            await until(lambda: theirs._protocol._handler is not None, what="serving")
            data = lambda frame: frame.descriptor.get("k") == "data"  # noqa: E731
            borrower = Borrower(theirs, data, asyncio.get_running_loop())
            assert theirs.lend(data, lambda: None, lambda: None) is None  # lent once at a time
            big = bytes(range(256)) * 256
            for i in range(200):
                stream.write(Frame(MsgType.CONTROL, i, {"k": "data"}, big if i % 50 == 7 else b""))
            stream.write(Frame(MsgType.CONTROL, 200, {"k": "control"}))
            for i in range(201, 210):
                stream.write(Frame(MsgType.CONTROL, i, {"k": "data"}))
            await asyncio.wait_for(borrower.returned.wait(), 10)
            await until(lambda: len(handled) == 10, what="the frames given back handled")
            assert borrower.taken == list(range(200)) and handled == list(range(200, 210))
            again = Borrower(theirs, data, asyncio.get_running_loop())
            for i in range(210, 220):
                stream.write(Frame(MsgType.CONTROL, i, {"k": "data"}))
            await until(lambda: len(again.taken) == 10, what="the frames read by the thread lent it again")
            assert again.taken == list(range(210, 220)) and handled == list(range(200, 210))
            stream.close()  # the peer closes while the thread reads: the loop ends the link
            await asyncio.wait_for(again.returned.wait(), 10)
            with pytest.raises(ConnectionError, match="closed the connection"):
                await asyncio.wait_for(serving, 10)
            again.thread.join(10)
            assert not again.thread.is_alive()

    run(main())


def test_a_lent_reading_comes_back_when_the_loop_ends_the_link_or_the_peer_sends_garbage(run):
    """The loop closing a link whose reading is lent asks for it back (wakes the thread), and gets
    it; bytes that are no frame, read by the thread, end the link as they would on the loop."""

    async def main():
        async with server() as (port, accepted):
            for ending in ("closed here", "garbage"):
                stream = await dial(port)
                theirs = await accepted.get()
                serving = asyncio.create_task(theirs.serve(lambda frame: None))
                await until(lambda: theirs._protocol._handler is not None, what="serving")
                borrower = Borrower(theirs, lambda frame: True, asyncio.get_running_loop())
                await stream.send(Frame(MsgType.CONTROL, 1, {}))
                await until(lambda: borrower.taken == [1], what="a frame taken on the thread")
                if ending == "closed here":
                    theirs.close()
                    assert borrower.woken.is_set()
                    match = "closed by this node"
                else:
                    stream._protocol._transport.write(b"not a frame at all, but long enough" * 4)
                    match = "failed its check"
                await asyncio.wait_for(borrower.returned.wait(), 10)
                with pytest.raises(ConnectionError, match=match):
                    await asyncio.wait_for(serving, 10)
                borrower.thread.join(10)
                assert not borrower.thread.is_alive()
                stream.close()

    run(main())
