"""A holder's file routes (ringd/http/files.py) against fetchers that misbehave or ask for sealed bytes.

The holder is ringd's own routes served by aiohttp on loopback under uvloop, as a daemon
runs them (tests/kit/fileholder.py); the fetchers are raw sockets, so that a test can stop
reading, or look at the bytes on the wire. The model is the real SmolLM2 as a GGUF file
(~100 MB: more than loopback's socket buffers hold, so a fetcher that stops reading stops
the holder's sends).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
from devkit.fileholder import SECRET, holder

from ringd.security.auth import FILES_NONCE_HEADER, sign_files
from ringd.http import files
from ringd.models.peers.manifest import FILES_PREFIX
from ringd.models.peers.sealing import SCHEME, SEAL_CHUNK_BYTES, SEALED_HEADER, Opener, SealError, sealed_length


async def ask(http: str, path: str, node: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], asyncio.StreamReader, asyncio.StreamWriter]:
    """A signed GET on a raw socket: its status and headers; the body left unread on the reader."""
    host, port = http.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [f"GET {path} HTTP/1.1", f"Host: {http}", "Connection: close", *(f"{k}: {v}" for k, v in {**sign_files(SECRET, "GET", path, "fetcher", node, time.time()), **(headers or {})}.items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    async with asyncio.timeout(30):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status, *fields = head.strip().split("\r\n")
    return int(status.split()[1]), {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}, reader, writer


async def built(http: str, fingerprint: str, node: str) -> None:
    """Wait (a generous deadline) for the holder's manifest, built at the first request."""
    async with asyncio.timeout(120):
        while True:
            status, _, _, w = await ask(http, f"{FILES_PREFIX}/{fingerprint}/manifest", node)
            w.close()
            if status == 200:
                return
            await asyncio.sleep(0.2)


def test_fetchers_that_never_read_lose_their_streams_and_the_next_is_served(smollm2_gguf, tmp_path, monkeypatch, caplog):
    """MAX_FILE_STREAMS signed fetchers ask for the whole file and read nothing: each loses its stream
    after SEND_STALL_S (1 s here), and a fetcher that reads is served. Before, they held the holder's
    streams for as long as they kept their sockets open: 503 for everyone else."""
    monkeypatch.setattr(files, "SEND_STALL_S", 1.0, raising=False)
    size = smollm2_gguf.stat().st_size

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache") as (h, _):
            await built(h.http, h.model, "node0")
            path = f"{FILES_PREFIX}/{h.model}/data/{smollm2_gguf.name}"
            idle = [await ask(h.http, path, "node0", {"Range": f"bytes=0-{size - 1}"}) for _ in range(files.MAX_FILE_STREAMS)]
            assert [status for status, *_ in idle] == [206] * files.MAX_FILE_STREAMS
            statuses = []
            async with asyncio.timeout(30):  # generous: each idle stream goes after SEND_STALL_S
                while not statuses or statuses[-1] != 206:
                    status, _, _, w = await ask(h.http, path, "node0", {"Range": "bytes=0-99"})
                    w.close()
                    statuses.append(status)
                    if status != 206:
                        await asyncio.sleep(0.1)
            assert set(statuses[:-1]) <= {503}, statuses
            for *_, w in idle:
                w.close()

    with caplog.at_level("WARNING", logger="ringd.http.files"):
        uvloop.run(main())
    assert any("a fetcher read nothing of" in r.getMessage() and "its stream is closed" in r.getMessage() for r in caplog.records)


def test_with_ring_encryption_the_bytes_on_the_wire_are_sealed_and_open_only_in_order(smollm2_gguf, tmp_path):
    """A sealed holder refuses a request for clear bytes (403, saying what to do); a sealed answer is
    not the file's bytes, opens to them chunk by chunk, and a chunk moved or changed does not open."""
    data = smollm2_gguf.read_bytes()
    start, count = 12345, 2 * SEAL_CHUNK_BYTES + 777  # three chunks, the last one short

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache", sealed=True) as (h, _):
            await built(h.http, h.model, "node0")
            path = f"{FILES_PREFIX}/{h.model}/data/{smollm2_gguf.name}"
            rng = {"Range": f"bytes={start}-{start + count - 1}"}
            status, _, reader, w = await ask(h.http, path, "node0", rng)
            assert status == 403 and "ring_encryption" in (await reader.read()).decode(), status
            w.close()
            host, port = h.http.rsplit(":", 1)
            headers = {**sign_files(SECRET, "GET", path, "fetcher", "node0", time.time()), **rng, SEALED_HEADER: SCHEME}
            reader, writer = await asyncio.open_connection(host, int(port))
            lines = [f"GET {path} HTTP/1.1", f"Host: {h.http}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            async with asyncio.timeout(30):
                wire = await reader.read()
            writer.close()
            return headers[FILES_NONCE_HEADER], path, wire

    nonce, path, wire = uvloop.run(main())
    head, body = wire.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 206") and f"{SEALED_HEADER}: {SCHEME}".encode() in head, head
    plain = data[start : start + count]
    assert len(body) == sealed_length(count)
    assert plain[:4096] not in body and plain[-4096:] not in body  # not the file's bytes, anywhere
    opener = Opener(SECRET, nonce, path, start, count)
    chunks, at = [], 0
    for i in range(3):
        n = opener.chunk_bytes(i)
        chunks.append(body[at : at + n])
        at += n
    assert b"".join(opener.open(i, c) for i, c in enumerate(chunks)) == plain
    with pytest.raises(SealError):  # a chunk in another's place
        opener.open(0, chunks[1])
    with pytest.raises(SealError):  # a byte changed
        opener.open(2, chunks[2][:-1] + bytes([chunks[2][-1] ^ 1]))
    with pytest.raises(SealError):  # the answer to another request (its nonce)
        Opener(SECRET, "0" * 32, path, start, count).open(0, chunks[0])
    with pytest.raises(SealError):  # the first chunk alone taken for a shorter answer: the Range is in the key
        Opener(SECRET, nonce, path, start, SEAL_CHUNK_BYTES).open(0, chunks[0])
