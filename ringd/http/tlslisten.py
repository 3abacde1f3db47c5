"""A node's HTTPS listener: TLS connections go to the app; plain HTTP gets a 400 that says how to connect.

A client that sends plain HTTP to an HTTPS port would otherwise see the
connection drop mid-handshake ("wrong version number", "connection reset") and
no hint why. So the listener accepts each connection itself and peeks at its
first byte without taking it: a TLS ClientHello starts with 0x16 (a handshake
record, RFC 8446 5.1); such a connection is handed to the event loop with the
node's ``ssl`` context (``loop.connect_accepted_socket``), the bytes still
waiting. Anything else is answered with a plain-text 400 naming the https URL
and how to trust the certificate, then closed.

Every wait has a deadline (the first byte, the handshake, the refusal), and
connections being peeked at count against the same cap as those being served
(``guard.ConnectionCap``). The accept loop runs as long as the node does,
supervised (``tasks.Supervisor``). What this ignores: certificates
(``tls.py``), what the app does with a request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import ssl

from ringd.http.guard import HTTP_IDLE_TIMEOUT_S, ConnectionCap
from ringd.base.listeners import BACKLOG

log = logging.getLogger(__name__)

# The first byte of a TLS record that carries a handshake: every ClientHello starts so.
TLS_HANDSHAKE_BYTE = 0x16
# A client sends its first bytes as soon as it connects; one silent this long is
# stuck or hostile (the same bound as a request's head on plain HTTP).
FIRST_BYTE_TIMEOUT_S = HTTP_IDLE_TIMEOUT_S
# A handshake is two round trips and one ECDSA signature: milliseconds on a LAN.
# Ten seconds covers Wi-Fi at its worst and a client busy starting up.
TLS_HANDSHAKE_TIMEOUT_S = 10.0
# A plain-HTTP request's head, read to find the Host it asked for before the 400:
# a browser's is a few hundred bytes. The rest is not read.
MAX_PLAIN_HEAD_BYTES = 8192
# Reading that head, writing the 400 and waiting for the client to close, together.
PLAIN_REFUSAL_TIMEOUT_S = 5.0
# Out of descriptors (EMFILE): accepting again at once would spin; asyncio's own
# servers wait a second too.
ACCEPT_RETRY_DELAY_S = 1.0
_HOST = re.compile(rb"^host:[ \t]*([A-Za-z0-9.:\[\]%-]{1,262})[ \t]*\r?$", re.IGNORECASE | re.MULTILINE)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for host:port, as ``guard.listen`` would bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.setblocking(False)
    return sock


def refusal(host: str, trust: str) -> bytes:
    """The 400 a plain-HTTP client gets; ``host``: HOST:PORT as it asked for it."""
    text = f"this node speaks HTTPS: use https://{host}/ ({trust})\n".encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + text


def asked_host(head: bytes) -> str | None:
    """The Host header of a request head, when it is a plain host[:port] (it goes into the answer)."""
    m = _HOST.search(head)
    return m.group(1).decode("ascii") if m else None


class TlsListener:
    """Serves ``guard``'s app over TLS on ``sock``; ``trust`` says how a client trusts the certificate."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, guard: ConnectionCap, trust: str):
        self.sock, self.ctx, self.guard, self.trust = sock, ctx, guard, trust
        self._peeking: set[asyncio.Task] = set()
        self.plain_refused = 0  # plain-HTTP connections answered with the 400, for tests
        self.handshakes_failed = 0

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.sock]

    def close(self) -> None:
        """Accept no more (the accept loop's task is cancelled by its owner); connections being
        peeked at are dropped; those being served stay the app's."""
        for task in list(self._peeking):
            task.cancel()
        if self.sock.fileno() >= 0:
            self.sock.close()

    async def accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("HTTPS: cannot accept a connection (%s); trying again in %.0f s", e.strerror, ACCEPT_RETRY_DELAY_S)
                    await asyncio.sleep(ACCEPT_RETRY_DELAY_S)
                    continue
                if e.errno == errno.ECONNABORTED:
                    continue
                raise
            if len(self.guard.server.connections) + len(self._peeking) >= self.guard.cap:
                # Over the cap (MAX_HTTP_CONNECTIONS), before any work: as guard.ConnectionCap does.
                conn.close()
                self.guard.count_refused(len(self._peeking))
                continue
            conn.setblocking(False)
            task = loop.create_task(self._take(conn))
            self._peeking.add(task)
            task.add_done_callback(self._peeking.discard)

    async def _take(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            first = await asyncio.wait_for(_peek(conn), FIRST_BYTE_TIMEOUT_S)
            if first and first[0] == TLS_HANDSHAKE_BYTE:
                # Handed over: from here the transport owns the socket, and closes it on failure.
                owned, conn = conn, None
                await loop.connect_accepted_socket(self.guard, owned, ssl=self.ctx, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
            elif first:
                await asyncio.wait_for(self._refuse(conn), PLAIN_REFUSAL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            # A client that gave up, a port scanner, a client that does not trust the
            # certificate (it says so itself): nothing the node can do about.
            self.handshakes_failed += conn is None
            log.debug("HTTPS connection dropped: %s", e)
        finally:
            if conn is not None:
                conn.close()

    async def _refuse(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        head = b""
        while b"\r\n\r\n" not in head and len(head) < MAX_PLAIN_HEAD_BYTES:
            chunk = await loop.sock_recv(conn, MAX_PLAIN_HEAD_BYTES - len(head))
            if not chunk:
                break
            head += chunk
        name, port = conn.getsockname()[:2]
        host = asked_host(head) or (f"[{name}]:{port}" if ":" in name else f"{name}:{port}")
        await loop.sock_sendall(conn, refusal(host, self.trust))
        self.plain_refused += 1
        conn.shutdown(socket.SHUT_WR)
        # Read what else the client sent (a body) until it closes: closing with unread
        # bytes would reset the connection, and the client might lose the 400 with it.
        while await loop.sock_recv(conn, MAX_PLAIN_HEAD_BYTES):
            pass


async def _peek(conn: socket.socket) -> bytes:
    """The connection's first byte, left for whoever reads it next (b"" if it closed first)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
