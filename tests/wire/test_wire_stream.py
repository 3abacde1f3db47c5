"""Ring links over real TCP on loopback, with asyncio's loop and with uvloop."""

import asyncio
import contextlib
import logging
import socket
import time

import mlx.core as mx
import numpy as np
import pytest
import uvloop

import wire.stream
from wire.frames import (
    HANDSHAKE_LIMITS,
    HEADER,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    MsgType,
    encode_frame,
)
from wire.handshake import Handshake, HandshakeError
from wire.stream import FrameStream, connect, serve
from wire.tensors import tensor_descriptor, tensor_from_buffer, tensor_to_buffer

pytestmark = pytest.mark.timeout(60)

SECRET = b"loopback-secret"
LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    return LOOPS[request.param]


@contextlib.asynccontextmanager
async def server(on_stream=None, *, secret=SECRET, cluster="lab"):
    """A `serve` on an ephemeral port; yields (port, queue of accepted streams).

    With `on_stream` given, that handles the streams instead of the queue. On
    exit every accepted stream is closed, so no test leaks a socket.
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


async def raw_handshake(port: int):
    """A client that speaks the handshake by hand, then whatever the test likes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    handshake = Handshake(secret=SECRET, node_id="raw", cluster="lab", initiator=True)
    decoder = FrameDecoder(HANDSHAKE_LIMITS)
    for frame in handshake.start():
        writer.writelines(encode_frame(frame, HANDSHAKE_LIMITS))
    while not handshake.done:
        # One byte at a time: read nothing past the server's PROOF.
        for frame in decoder.feed(await reader.readexactly(1)):
            for reply in handshake.receive(frame):
                writer.writelines(encode_frame(reply, HANDSHAKE_LIMITS))
    return reader, writer


async def read_until_eof(reader: asyncio.StreamReader, timeout: float) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                data += chunk
    return data


def test_tensor_frames_round_trip_bit_exactly(run):
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
            stream = await dial(port)
            assert (stream.peer_id, stream.peer_info) == ("server", {"ring_port": 1234})
            assert stream.peername == ("127.0.0.1", port)
            for i, arr in enumerate(arrays):
                desc = {"tensor": tensor_descriptor(arr)}
                await stream.send(Frame(MsgType.FORWARD, i, desc, tensor_to_buffer(arr)))
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


def test_large_payload_arrives_intact(run):
    payload = np.random.default_rng(0).integers(0, 256, 64 * 1024 * 1024, np.uint8).tobytes()

    async def main():
        async with server() as (port, accepted):
            stream = await dial(port)
            # Sent at once: the server may not have seen our PROOF yet.
            await stream.send(Frame(MsgType.FORWARD, 1, {"n": len(payload)}, payload))
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
                    await stream.send(Frame(MsgType.FORWARD, i, {"i": i}, payload))

            sending = asyncio.create_task(sender())
            await asyncio.sleep(0.2)
            assert not sending.done(), "the receiver should have stopped reading"
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


def test_wrong_secret_is_refused_on_both_sides(caplog):
    called = Recorder()

    async def main():
        async with server(called, secret=b"other") as (port, _):
            with pytest.raises(HandshakeError, match=f"127.0.0.1:{port}.*different cluster secret"):
                await dial(port)
            await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    assert called == []
    [warning] = caplog.records
    assert "handshake with 127.0.0.1:" in warning.message
    assert "different cluster secret" in warning.message


def test_other_cluster_is_refused():
    async def main():
        async with server(cluster="prod") as (port, accepted):
            with pytest.raises(HandshakeError, match="peer is in cluster 'prod'"):
                await dial(port)
            assert accepted.empty()

    asyncio.run(main())


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic b'GET '"),
        (b"", "took longer than 0.3 s"),  # says nothing at all
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.FORWARD, 0, 0, 0, 1 << 20), "limit of 0"),
    ],
)
def test_strangers_are_dropped_within_the_handshake_timeout(monkeypatch, caplog, garbage, reason):
    monkeypatch.setattr(wire.stream, "HANDSHAKE_TIMEOUT_S", 0.3)
    called = Recorder()

    async def main():
        async with server(called) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(garbage)
            start = time.monotonic()
            await read_until_eof(reader, timeout=5)
            assert time.monotonic() - start < 2
            writer.close()
            # The server closed with our garbage unread: the kernel may answer with a reset.
            with contextlib.suppress(ConnectionResetError):
                await writer.wait_closed()

    with caplog.at_level(logging.WARNING, "wire.stream"):
        asyncio.run(main())
    assert called == []
    [warning] = caplog.records
    assert "127.0.0.1:" in warning.message and reason in warning.message


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


def test_connect_to_a_closed_port_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once it is closed

    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"cannot connect to 127.0.0.1:{port}"):
        asyncio.run(dial(port))
    assert time.monotonic() - start < 1


def test_oversized_header_after_the_handshake_drops_the_peer(caplog):
    async def main():
        async with server() as (port, accepted):
            reader, writer = await raw_handshake(port)
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
            _, writer = await raw_handshake(port)  # and then never reads again
            theirs = await accepted.get()
            big = Frame(MsgType.FORWARD, 1, payload=bytes(64 * 1024 * 1024))
            with pytest.raises(TimeoutError, match=r"took longer than 0\.2 s"):
                await theirs.send(big, timeout=0.2)
            assert theirs.closed
            with pytest.raises(ConnectionError, match="the peer stopped reading"):
                await theirs.recv(1)
            writer.close()
            await writer.wait_closed()

    asyncio.run(main())
