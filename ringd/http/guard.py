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
    - Request bodies: booked, paced and inflated within bounds by ``bodies.py``.
    - Headers: a request line or header aiohttp's parser refuses (a control
      byte, a bad name, a line over its limit) is answered 400 by aiohttp
      before any route sees it; aiohttp logs each with a traceback that quotes
      the offending line, which put a whole API key into the log, at the pace of
      the client. ``MalformedRequests`` makes those records one line, no
      traceback and no header bytes, at most once per LOG_INTERVAL_S with a
      count (``AIOHTTP_LOG`` is the logger given to aiohttp). A header the
      parser lets through but that is not UTF-8 (a byte 0xFF) is refused by the
      routes with a 400 naming it (``undecodable_header``).

What this ignores: which routes need which key (``auth.py``), the shape of
an error (the API's), and what a body says (``openai_types.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

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
# Refused connections and malformed requests are counted and reported at most this often.
LOG_INTERVAL_S = 60.0
# What of aiohttp's reason for refusing a request goes into the log: its leading
# words ("Invalid header value char"), never the bytes it quotes after them.
_REASON_WORDS = re.compile(r"[A-Za-z][A-Za-z ]{0,79}")


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
        self.count_refused()
        return _Refused()

    def count_refused(self, being_opened: int = 0) -> None:
        """One connection refused over the cap: counted, and said at most once per LOG_INTERVAL_S.
        ``being_opened``: connections an HTTPS listener holds before they are served (tlslisten.py)."""
        self.refused += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_report >= LOG_INTERVAL_S:
            opening = f" and {being_opened} being opened" if being_opened else ""
            log.warning(
                "HTTP connection cap reached: %d open%s (MAX_HTTP_CONNECTIONS); refused %d new connection(s) since the last report",
                len(self.server.connections), opening, self._unreported,
            )  # fmt: skip
            self._last_report, self._unreported = now, 0


async def listen(
    runner: web.AppRunner, host: str, port: int, cap: int = MAX_HTTP_CONNECTIONS, sock: socket.socket | None = None
) -> tuple[asyncio.AbstractServer, ConnectionCap]:
    """Serve ``runner``'s app on host:port, or on ``sock`` (a listening socket handed down by a
    launcher), behind the connection cap."""
    guard = ConnectionCap(runner.server, cap)
    loop = asyncio.get_running_loop()
    if sock is not None:
        return await loop.create_server(guard, sock=sock), guard
    server = await loop.create_server(guard, host, port, reuse_address=True, backlog=1024, family=socket.AF_INET if ":" not in host else socket.AF_INET6)
    return server, guard


class MalformedRequests(logging.Filter):
    """On the logger aiohttp's server writes to: its records of a request its parser refused
    become one line with a count, no traceback and none of the request's bytes, at most once
    per ``interval_s``; every other record (a real server error) passes as aiohttp wrote it.

    aiohttp logs a refused request with ``exc_info`` set to the parser's HttpProcessingError
    ("Error handling request from %s", web_protocol.RequestHandler.handle_error), whose
    message quotes the line it could not parse: a header's whole value, an API key too.
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        super().__init__()
        self.interval_s = interval_s
        self.refused = 0  # since the process started
        self._unreported = 0
        self._last_report = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.refused += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_report < self.interval_s:
            return False
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "an unknown address"
        record.msg = "refused %d malformed HTTP request(s) with 400 since the last report (%s), the latest from %s"
        record.args = (self._unreported, _refusal_reason(exc), peer)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        # aiohttp logs these at ERROR; they are a client's mistake, not the node's. (A
        # first request that is not HTTP at all it logs at DEBUG, which stays so.)
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        self._last_report, self._unreported = now, 0
        return True


def _refusal_reason(exc: HttpProcessingError) -> str:
    """What aiohttp found wrong with a request, without the bytes it quotes (they may hold a key)."""
    if isinstance(exc, LineTooLong):
        return f"a line over aiohttp's limit of {exc.args[1]} bytes"
    words = _REASON_WORDS.match(exc.message or "")
    return words.group(0).strip() if words else type(exc).__name__


# The logger aiohttp's server is given (``logger=`` of web.AppRunner): what it logs of
# requests its parser refused goes through MalformedRequests; its other lines, as they are.
AIOHTTP_LOG = log.getChild("aiohttp")
MALFORMED = MalformedRequests()
AIOHTTP_LOG.addFilter(MALFORMED)


def undecodable_header(headers) -> str | None:
    """The name of the first header whose value is not UTF-8, else None.

    aiohttp's parser lets any byte from 0x80 up through (RFC 9110's obs-text) and
    hands it on as a lone surrogate ("\\xff" -> "\\udcff"), which every ``encode()``
    after that raises on: a 500 and a traceback in the log, on routes open to all.
    """
    for name, value in headers.items():
        if value.isascii():
            continue
        try:
            value.encode()
        except UnicodeEncodeError:
            return name
    return None
