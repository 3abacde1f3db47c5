"""Request bodies: how many bytes a node reads at once, whose they are, how fast they come, what they inflate to.

Every route that takes a body reads it here (``intake.py``), and pays for it before it is read:

- its bytes are booked (``BodyBudget``) out of a node-wide pool, BODY_BYTES_IN_FLIGHT, with
  SMALL_BODIES_RESERVE kept for bodies of at most SMALL_BODY_BYTES (a chat turn, a tool result:
  most requests), so large uploads, however many, never lock the small ones out; one client
  address holds at most CLIENT_BODY_BYTES of the pool and a quarter of the reserve (a 429 past
  that), so one host cannot take either. A body of unknown length (chunked) is booked as it arrives.
- it arrives at MIN_UPLOAD_BYTES_PER_S at least after UPLOAD_GRACE_S, and whole within
  BODY_READ_TIMEOUT_S: a client that trickles a byte every two seconds loses its booking in
  seconds, not at the minute's end (16 such uploads held every POST of a node off for 60 s).
- ``Content-Encoding: gzip`` or ``deflate`` is inflated here, off the event loop, to at most
  MAX_BODY_BYTES (aiohttp's own inflating ran on the loop, unbounded: 1 MB of gzip on the wire
  held the loop for seconds while it grew to 1 GiB); any other coding is a 415.

What this ignores: keys and proofs (``intake.py``, ``auth.py``), what a body says (the APIs).
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from ringd.http.errors import ApiError

# Largest request body, on the wire and inflated: a long chat history is a few MB of JSON; more is abuse.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Request bodies being read at once, in bytes, across all connections: a dozen of the largest
# allowed, a few hundred MiB at most, never gigabytes.
BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
# A small body: a chat request with a few turns, a tool result, a control call.
SMALL_BODY_BYTES = 64 * 1024
# Kept for small bodies whatever large ones hold: 256 of the largest small bodies at once.
SMALL_BODIES_RESERVE = 16 * 1024 * 1024
# One client address's share of the large bodies being read: four of the largest at once; and of
# the reserve, a quarter. (A follower forwards its clients' bodies from its own address; it has
# held each to these limits already.)
CLIENT_BODY_BYTES = 4 * MAX_BODY_BYTES
CLIENT_RESERVE_SHARE = 4
# A body's first bytes may take this long (a client's connection warming up, a laptop waking);
# after it, bytes must keep coming at MIN_UPLOAD_BYTES_PER_S on average. 32 KiB/s is a fraction
# of the worst Wi-Fi; a 16 MiB body at that pace would take 9 minutes, so the deadline below wins.
UPLOAD_GRACE_S = 5.0
MIN_UPLOAD_BYTES_PER_S = 32 * 1024
# The largest body (16 MiB) arrives in well under a second on a LAN; a minute covers Wi-Fi at its worst.
BODY_READ_TIMEOUT_S = 60.0
# Content codings inflated here (zlib reads both, its header says which); the rest are refused.
INFLATED_CODINGS = ("gzip", "x-gzip", "deflate")
_IDENTITY = ("", "identity")
# zlib's window bits: 32 + 15 reads a gzip or zlib header, whichever the body has.
_GZIP_OR_ZLIB = 32 + 15


class BodyBudget:
    """Bytes of request bodies being read: a shared pool and a reserve for small bodies, each with
    a share per client address."""

    def __init__(self, limit: int = BODY_BYTES_IN_FLIGHT, reserve: int = SMALL_BODIES_RESERVE, per_client: int = CLIENT_BODY_BYTES):
        self.shared = _Pool(limit, per_client)
        self.reserve = _Pool(reserve, reserve // CLIENT_RESERVE_SHARE)

    @property
    def in_flight(self) -> int:
        return self.shared.held + self.reserve.held

    def booking(self, client: str) -> "Booking":
        return Booking(self, client)


class _Pool:
    def __init__(self, limit: int, per_client: int):
        self.limit = limit
        self.per_client = per_client
        self.held = 0
        self.clients: dict[str, int] = {}

    def why_not(self, client: str, extra: int) -> str | None:
        """Why ``extra`` more bytes for ``client`` do not fit: "client" or "node"; None if they do."""
        if self.clients.get(client, 0) + extra > self.per_client:
            return "client"
        return "node" if self.held + extra > self.limit else None

    def take(self, client: str, nbytes: int) -> None:
        self.held += nbytes
        self.clients[client] = self.clients.get(client, 0) + nbytes

    def give(self, client: str, nbytes: int) -> None:
        self.held -= nbytes
        left = self.clients.pop(client, 0) - nbytes
        if left > 0:
            self.clients[client] = left


class Booking:
    """One body's bytes, held while it is read; grown as it is known to need more."""

    def __init__(self, budget: BodyBudget, client: str):
        self.budget = budget
        self.client = client
        self.shared = 0
        self.reserved = 0

    @property
    def held(self) -> int:
        return self.shared + self.reserved

    def hold(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all (booking what is not held yet), or an ApiError: a 429 when the
        client's share is used, a 503 when the node's is; nothing more is held then."""
        extra = nbytes - self.held
        if extra <= 0:
            return
        b = self.budget
        # A small body from the reserve while it has room (and the client its share of it);
        # anything else from the shared pool.
        if nbytes <= SMALL_BODY_BYTES and b.reserve.why_not(self.client, extra) is None:
            b.reserve.take(self.client, extra)
            self.reserved += extra
            return
        why = b.shared.why_not(self.client, extra)
        if why == "client":
            raise ApiError(
                429,
                f"this address is sending {b.shared.clients.get(self.client, 0)} bytes of large request bodies already; "
                f"at most {b.shared.per_client} at once",
                retry_after=2,
            )
        if why == "node":
            raise ApiError(503, "this node is reading too many large requests right now; retry in a moment", retry_after=2)
        b.shared.take(self.client, extra)
        self.shared += extra

    def release(self) -> None:
        self.budget.shared.give(self.client, self.shared)
        self.budget.reserve.give(self.client, self.reserved)
        self.shared = self.reserved = 0


def deadline_for(received: int, started: float) -> float:
    """When a body that began at ``started`` and has ``received`` bytes so far is too slow:
    the grace, and then a second for each MIN_UPLOAD_BYTES_PER_S it has sent, within the whole deadline."""
    return min(started + UPLOAD_GRACE_S + received / MIN_UPLOAD_BYTES_PER_S, started + BODY_READ_TIMEOUT_S)


async def read_body(request: web.Request, budget: BodyBudget) -> bytes:
    """The body of ``request`` as sent (before any inflating), booked while it is read."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
    booking = budget.booking(request.remote or "unknown")
    try:
        # A declared length is booked whole before a byte is read; a chunked body as it arrives.
        booking.hold(declared if declared is not None else min(SMALL_BODY_BYTES, MAX_BODY_BYTES))
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks: list[bytes] = []
        received = 0
        while True:
            deadline = deadline_for(received, started)
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body came too slowly: {received} bytes in {loop.time() - started:.0f} s "
                    f"(at least {MIN_UPLOAD_BYTES_PER_S // 1024} KiB/s after the first {UPLOAD_GRACE_S:.0f} s, "
                    f"and all of it within {BODY_READ_TIMEOUT_S:.0f} s)",
                ) from None
            if not chunk:
                return b"".join(chunks)
            received += len(chunk)
            if received > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes, the most accepted")
            booking.hold(received)
            chunks.append(chunk)
    finally:
        booking.release()


def coding_of(request: web.Request) -> str:
    """The body's content coding, checked: "" for none; a 415 for one not inflated here."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding in _IDENTITY:
        return ""
    if coding not in INFLATED_CODINGS:
        raise ApiError(
            415,
            f"Content-Encoding {coding[:32]!r} is not accepted; send the body as it is, or as gzip or deflate",
            "Content-Encoding",
        )
    return coding


def inflate(raw: bytes) -> bytes:
    """A gzip or deflate (zlib) body, inflated to at most MAX_BODY_BYTES: CPU-bound, call it off the loop."""
    inflater = zlib.decompressobj(_GZIP_OR_ZLIB)
    try:
        body = inflater.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error:
        try:  # deflate as some clients send it: raw, with no zlib header
            inflater = zlib.decompressobj(-15)
            body = inflater.decompress(raw, MAX_BODY_BYTES + 1)
        except zlib.error as e:
            raise ApiError(400, f"the request body is not valid gzip or deflate: {e}", "Content-Encoding") from None
    if len(body) > MAX_BODY_BYTES or inflater.unconsumed_tail:
        raise ApiError(413, f"the request body inflates past {MAX_BODY_BYTES} bytes, the most accepted")
    if not inflater.eof:
        raise ApiError(400, "the request body's gzip or deflate stream is cut short", "Content-Encoding")
    return body
