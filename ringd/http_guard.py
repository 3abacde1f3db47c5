"""The HTTP listener's guards: a cap on open connections, deadlines, file descriptors, body bytes.

aiohttp parses HTTP; what it leaves to its user is how many connections one
node keeps open, how long a client may take to send a request, and how much
memory bodies being read may hold. Without these, 2,100 half-sent requests
took every file descriptor a node had and each new request was refused with
no word in the log; four 16 MiB bodies at once cost gigabytes.

    - The process's file-descriptor limit is raised to what the caps need (the
      soft limit, up to the hard one: macOS and mlx start processes at a few
      thousand at most).
    - At most MAX_HTTP_CONNECTIONS are open; a connection past that is closed
      at once, and the log says so (once per LOG_INTERVAL_S, with a count).
    - A connection that has not sent a whole request line and headers within
      HTTP_IDLE_TIMEOUT_S of opening (or of its last response) is closed:
      aiohttp's keep-alive timer does it, given that value.
    - Request bodies: ``BodyBudget`` books each body's bytes before reading it,
      out of BODY_BYTES_IN_FLIGHT for the whole node; a body that does not
      arrive within BODY_READ_TIMEOUT_S is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time

from aiohttp import web

log = logging.getLogger(__name__)

# Connections one node serves at once: far past what a LAN's clients open (each
# streamed completion holds one), each costs a descriptor and a few KiB.
MAX_HTTP_CONNECTIONS = 4096
# Descriptors besides HTTP: ring links (a dozen), model files kept open by MLX,
# mDNS sockets, the executor's pipes. Generous: running out breaks everything.
FD_HEADROOM = 1024
# A client sends a request's line and headers in milliseconds; one still
# sending after this is stuck or hostile. The same bounds an idle keep-alive.
HTTP_IDLE_TIMEOUT_S = 30.0
# The largest body (16 MiB) arrives in well under a second on a LAN; a minute
# covers Wi-Fi at its worst.
BODY_READ_TIMEOUT_S = 60.0
# Request bodies being read at once, in bytes, across all connections: a dozen
# of the largest allowed, a few hundred MiB at most, never gigabytes.
BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
# Refused connections are counted and reported at most this often.
LOG_INTERVAL_S = 60.0


def raise_fd_limit(need: int = MAX_HTTP_CONNECTIONS + FD_HEADROOM) -> int:
    """Raise the soft RLIMIT_NOFILE toward ``need`` (never past the hard limit); returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    for attempt in (target, 10240):  # macOS refuses more than OPEN_MAX (10240) however high the hard limit
        if attempt <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
            return attempt
        except (ValueError, OSError):
            continue
    log.warning(
        "could not raise the open-file limit from %d toward %d (hard limit %s): at most about %d HTTP connections can be served",
        soft, need, hard, max(soft - FD_HEADROOM, 0),
    )  # fmt: skip
    return soft


class _Refused(asyncio.Protocol):
    """Stands in for a connection over the cap: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()


class ConnectionCap:
    """A protocol factory for ``loop.create_server`` that serves at most ``cap`` connections of ``server``."""

    def __init__(self, server: web.Server, cap: int = MAX_HTTP_CONNECTIONS):
        self.server = server
        self.cap = cap
        self.refused = 0
        self._unreported = 0
        self._last_report = -LOG_INTERVAL_S

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.server.connections) < self.cap:
            return self.server()
        self.refused += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_report >= LOG_INTERVAL_S:
            log.warning(
                "HTTP connection cap reached: %d open (MAX_HTTP_CONNECTIONS); refused %d new connection(s) since the last report",
                len(self.server.connections), self._unreported,
            )  # fmt: skip
            self._last_report, self._unreported = now, 0
        return _Refused()


async def listen(runner: web.AppRunner, host: str, port: int, cap: int = MAX_HTTP_CONNECTIONS) -> tuple[asyncio.AbstractServer, ConnectionCap]:
    """Serve ``runner``'s app on host:port behind the connection cap."""
    guard = ConnectionCap(runner.server, cap)
    server = await asyncio.get_running_loop().create_server(guard, host, port, reuse_address=True, backlog=1024, family=socket.AF_INET if ":" not in host else socket.AF_INET6)
    return server, guard


class BodyTooLarge(Exception):
    pass


class BodyBudget:
    """Bytes of request bodies being read, node-wide, within BODY_BYTES_IN_FLIGHT."""

    def __init__(self, limit: int = BODY_BYTES_IN_FLIGHT):
        self.limit = limit
        self.in_flight = 0

    @contextlib.contextmanager
    def book(self, nbytes: int):
        """Hold ``nbytes`` while reading; False (and nothing held) if they do not fit now."""
        if self.in_flight + nbytes > self.limit:
            yield False
            return
        self.in_flight += nbytes
        try:
            yield True
        finally:
            self.in_flight -= nbytes
