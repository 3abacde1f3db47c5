"""A request's way in: its API key, its body within the node's budget, a follower's proof, its JSON.

Every route that takes a body reads it here, and every ``/v1/*`` and
``/api/*`` route checks its key here, the same way whatever API it serves:

- the key: one of ``api_keys_file``'s, as a Bearer token or as Anthropic's
  ``x-api-key`` (``auth.check_api_key``);
- the body: its bytes booked against the node's budget and its client's share
  before it is read, at a minimum pace, inflated within MAX_BODY_BYTES where it
  came as gzip (``bodies.py``);
- a follower's mark (FORWARDED_HEADER) holds only with the follower's proof of
  the cluster secret over this body (``auth.ForwardAuth``): a client that sends
  the mark without it is refused, not served as if it had not;
- the JSON: parsed off the event loop, MAX_CONCURRENT_PARSES at once
  (``fields.parse_json``), and so is each API's reading of it (``off_loop``).

What is done with the body is the endpoint driver's (``endpoint.py``) or the route's.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from aiohttp import web

from ringd.security.auth import AuthError, ForwardAuth, body_sha256, check_api_key
from ringd.http.errors import ApiError
from ringd.http.fields import parse_json
from ringd.http.bodies import BodyBudget, coding_of, inflate, read_body
from ringd.http.proxy import FORWARDED_HEADER

if TYPE_CHECKING:
    from ringd.http.node import ApiNode

# Anthropic's SDKs send the API key in this header instead of Authorization.
API_KEY_HEADER = "x-api-key"
# Where a request's id is kept on the aiohttp request (api.py's middleware puts it there).
REQUEST_ID_KEY = "ringd_request_id"

# Bodies parsed at once: each is CPU-bound work off the event loop that holds a
# copy of the body (json holds the GIL while it parses), so a burst of giant
# requests waits its turn instead of taking all memory.
MAX_CONCURRENT_PARSES = 2


T = TypeVar("T")


def request_id(request: web.Request) -> str | None:
    return request.get(REQUEST_ID_KEY)


class Intake:
    def __init__(self, node: "ApiNode"):
        self.d = node
        self.bodies = BodyBudget()
        self._parses = asyncio.Semaphore(MAX_CONCURRENT_PARSES)
        self._forwards: ForwardAuth | None = None

    def need_key(self, request: web.Request) -> None:
        """A key of ``api_keys_file`` as a Bearer token, or as Anthropic's ``x-api-key``."""
        given = request.headers.get("Authorization")
        if given is None and (key := request.headers.get(API_KEY_HEADER)) is not None:
            given = f"Bearer {key}"
        check_api_key(given, self.d.api_keys)

    async def read(self, request: web.Request) -> bytes:
        """The body, booked against the node's budget while it is read (``bodies.py``), inflated if
        it came as gzip or deflate."""
        coding = coding_of(request)  # a coding not taken is refused before a byte is read
        raw = await read_body(request, self.bodies)
        return await self.off_loop(inflate, raw) if coding else raw

    async def json(self, raw: bytes) -> dict:
        return await self.off_loop(parse_json, raw)

    async def off_loop(self, work: Callable[..., T], *args) -> T:
        """``work(*args)`` on an executor thread, MAX_CONCURRENT_PARSES at once: a body's parse, or
        an API's reading of it, whose cost grows with what the client sent (a 15 MiB schema of tiny
        nodes took seconds to check: on the event loop, heartbeats stopped and the ring re-elected)."""
        async with self._parses:
            return await asyncio.get_running_loop().run_in_executor(None, work, *args)

    async def forwarded_by(self, request: web.Request, body: bytes) -> str | None:
        """The follower that forwarded this request, once its proof of the secret holds; None for a
        client's own request. The mark lets a request carry a stream over (RESUME_FIELD): a client
        that sends it without the proof is refused, not served as if it had not."""
        if FORWARDED_HEADER not in request.headers:
            return None
        if self._forwards is None:
            self._forwards = ForwardAuth(self.d.secret, self.d.name)
        digest = await asyncio.get_running_loop().run_in_executor(None, body_sha256, body)  # up to 16 MiB: off the loop
        try:
            return self._forwards.verify_digest(request.method, request.path_qs, request.headers, digest, time.time())
        except AuthError as e:
            raise ApiError(e.status, str(e), FORWARDED_HEADER.lower(), "forwarding_not_proven", "authentication_error") from None
