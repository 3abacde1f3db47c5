"""One signed GET of a byte range from a holder, its body landing in the caller's buffers."""

from __future__ import annotations

import asyncio
import socket
import ssl as ssl_lib

from ringd.models.peers.client import CONNECT_TIMEOUT_S, HEAD_TIMEOUT_S, MIN_PIECE_BYTES_PER_S, STALL_S, Holder, HolderFailed, Stalled
from ringd.models.peers.sealing import SCHEME, SEAL_CHUNK_BYTES, SEALED_HEADER, Opener, sealed_length

# Most a read of a holder's socket takes at once.
RECV_BYTES = 4 * 1024 * 1024
# An answer's status line and headers: a few hundred bytes from a holder; more is not one.
MAX_RESPONSE_HEAD_BYTES = 16 * 1024


class RangeReader:
    """One GET of a byte range, HTTP/1.1, whose body lands straight in the caller's buffers: a
    fetch reads gigabytes, and a stream of small ``bytes`` through a general client costs more
    time than the bytes themselves. Measured against the fetch's aiohttp session (its body read
    chunk by chunk, as the socket gave it, into the same buffers): aiohttp's parser copies every
    256 KiB read once more, and the fetch took half again as much CPU per GB (the reader alone
    nearly twice as much), so the bytes stay on the socket's own reads. Every wait has a deadline: CONNECT_TIMEOUT_S to connect,
    HEAD_TIMEOUT_S for the answer's head, STALL_S for each read of the body (``Stalled``).

    With an ``opener`` the body is sealed (models/peers/sealing.py): read a chunk at a time, opened off
    the loop. With ``ssl`` the connection speaks TLS (through asyncio's streams: a copy more)."""

    def __init__(self, holder: Holder, path: str, headers: dict[str, str], count: int, opener: Opener | None = None, ssl: ssl_lib.SSLContext | None = None):
        self.holder, self.path, self.headers, self.count = holder, path, headers, count
        self.opener, self.ssl = opener, ssl
        self.status, self.length = 0, 0
        self.sock: socket.socket | None = None
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None  # with ssl
        self._early = b""  # body bytes that came with the headers
        self._plain = memoryview(b"")  # opened bytes not yet given out (sealed)
        self._chunk = 0  # the next sealed chunk's index

    async def __aenter__(self) -> "RangeReader":
        try:
            return await self._open()
        except BaseException:
            self.close()
            raise

    async def _open(self) -> "RangeReader":
        loop = asyncio.get_running_loop()
        host, port = self.holder.http.rsplit(":", 1)
        request = "\r\n".join([f"GET {self.path} HTTP/1.1", f"Host: {self.holder.http}", "Connection: close", *(f"{k}: {v}" for k, v in self.headers.items())])
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if self.ssl is not None:
                    self._streams = await asyncio.open_connection(host.strip("[]"), int(port), ssl=self.ssl)
                else:
                    infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
                    family, kind, proto, _, addr = infos[0]
                    self.sock = socket.socket(family, kind, proto)
                    self.sock.setblocking(False)
                    await loop.sock_connect(self.sock, addr)
        except TimeoutError:
            raise HolderFailed(f"connecting to {self.holder.http} took over {CONNECT_TIMEOUT_S:.0f} s") from None
        head = b""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await self._send((request + "\r\n\r\n").encode())
                while b"\r\n\r\n" not in head:
                    if len(head) > MAX_RESPONSE_HEAD_BYTES:
                        raise HolderFailed(f"an answer whose headers run past {MAX_RESPONSE_HEAD_BYTES} bytes")
                    data = bytearray(16384)
                    n = await self._recv_into(memoryview(data))
                    if not n:
                        raise HolderFailed("the holder closed the connection before answering")
                    head += data[:n]
        except TimeoutError:
            raise Stalled(f"no answer's head within {HEAD_TIMEOUT_S:.0f} s") from None
        head, self._early = head.split(b"\r\n\r\n", 1)
        status, *fields = head.decode("latin-1").split("\r\n")
        try:
            self.status = int(status.split()[1])
        except (IndexError, ValueError):
            raise HolderFailed(f"a status line that does not parse: {status[:80]!r}") from None
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
        length = self.headers.get("content-length", "")
        self.length = int(length) if length.isdigit() and len(length) < 20 else -1
        return self

    async def check(self, status: int, what: str) -> None:
        """HolderFailed unless the answer is ``status`` with the body this request asked for."""
        if self.status != status:
            raise HolderFailed(f"HTTP {self.status} for {what}: {await self.text()}")
        sealed = self.headers.get(SEALED_HEADER.lower())
        if (sealed == SCHEME) != (self.opener is not None):
            raise HolderFailed(f"an answer for {what} {'not sealed' if self.opener is not None else f'sealed ({sealed!r:.40})'}, asked for {'sealed' if self.opener else 'in the clear'}")
        want = sealed_length(self.count) if self.opener is not None else self.count
        if self.length != want:
            raise HolderFailed(f"a Content-Length of {self.length} for {what}, not the {want} bytes asked for")

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self._streams is not None:
            self._streams[1].close()

    async def _send(self, data: bytes) -> None:
        if self._streams is not None:
            self._streams[1].write(data)
            await self._streams[1].drain()
        else:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _recv_into(self, buf: memoryview) -> int:
        if self._streams is not None:
            data = await self._streams[0].read(len(buf))
            buf[: len(data)] = data
            return len(data)
        return await asyncio.get_running_loop().sock_recv_into(self.sock, buf)

    async def fill(self, buf: memoryview, what: str, deadline_s: float) -> None:
        """Body bytes into all of ``buf`` within ``deadline_s``; HolderFailed naming ``what`` if the
        body ends first, Stalled if it does not come in time."""
        got = 0
        try:
            async with asyncio.timeout(deadline_s):
                while got < len(buf):
                    n = await self.read_into(buf[got:])
                    if not n:
                        raise HolderFailed(f"the stream ended in {what}, after {got} of {len(buf)} bytes")
                    got += n
        except TimeoutError:
            raise Stalled(f"{what} not in within {deadline_s:.0f} s ({got} of {len(buf)} bytes; the floor is {MIN_PIECE_BYTES_PER_S // 1024} KiB/s)") from None

    async def read_into(self, buf: memoryview) -> int:
        """Body bytes into ``buf`` (as many as came, at most its size, opened if sealed); 0 at the end."""
        if self.opener is None:
            return await self._raw_into(buf)
        if not self._plain:
            if self._chunk * SEAL_CHUNK_BYTES >= self.count:
                return 0
            sealed = memoryview(bytearray(self.opener.chunk_bytes(self._chunk)))
            got = 0
            while got < len(sealed):
                n = await self._raw_into(sealed[got:])
                if not n:
                    return 0  # cut short: the caller says where
                got += n
            self._plain = memoryview(await asyncio.to_thread(self.opener.open, self._chunk, sealed))
            self._chunk += 1
        n = min(len(self._plain), len(buf))
        buf[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    async def _raw_into(self, buf: memoryview) -> int:
        """Bytes of the body as they come on the wire; Stalled after STALL_S without one."""
        if self._early:
            n = min(len(self._early), len(buf))
            buf[:n] = self._early[:n]
            self._early = self._early[n:]
            return n
        try:
            async with asyncio.timeout(STALL_S):
                return await self._recv_into(buf[:RECV_BYTES])
        except TimeoutError:
            raise Stalled(f"no byte for {STALL_S:.0f} s mid-piece") from None

    async def text(self) -> str:
        """The start of an error answer's body, for a message (within STALL_S; it may be sealed garbage)."""
        buf = memoryview(bytearray(300))
        try:
            n = await self._raw_into(buf)
        except (Stalled, OSError):
            return ""
        return bytes(buf[:n]).decode(errors="replace")
