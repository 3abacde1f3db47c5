"""A request's way in: its API key, its body within the node's budget, a follower's proof, its JSON.

Every route that takes a body reads it here, and every ``/v1/*`` and
``/api/*`` route checks its key here, the same way whatever API it serves:

- the key: one of ``api_keys_file``'s, as a Bearer token or as Anthropic's
  ``x-api-key`` (``auth.check_api_key``);
- the body: its bytes booked against the node's budget before it is read
  (``guard.BodyBudget``), a declared length over MAX_BODY_BYTES refused before
  a byte is read, and the whole of it within BODY_READ_TIMEOUT_S;
- a follower's mark (FORWARDED_HEADER) holds only with the follower's proof of
  the cluster secret over this body (``auth.ForwardAuth``): a client that sends
  the mark without it is refused, not served as if it had not;
- the JSON: parsed off the event loop, MAX_CONCURRENT_PARSES at once
  (``fields.parse_json``).

What is done with the body is the endpoint driver's (``endpoint.py``) or the route's.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import web

from ringd.auth import AuthError, ForwardAuth, body_sha256, check_api_key
from ringd.http.errors import ApiError
from ringd.http.fields import parse_json
from ringd.http.guard import BODY_READ_TIMEOUT_S, BodyBudget
from ringd.http.proxy import FORWARDED_HEADER

if TYPE_CHECKING:
    from ringd.http.node import ApiNode

# Anthropic's SDKs send the API key in this header instead of Authorization.
API_KEY_HEADER = "x-api-key"
# Where a request's id is kept on the aiohttp request (api.py's middleware puts it there).
REQUEST_ID_KEY = "ringd_request_id"

# Largest request body: a long chat history is a few MB of JSON; more is abuse.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Bodies parsed at once: each is CPU-bound work off the event loop that holds a
# copy of the body (json holds the GIL while it parses), so a burst of giant
# requests waits its turn instead of taking all memory.
MAX_CONCURRENT_PARSES = 2


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
        """The body, its bytes booked against the node's budget and read within a deadline."""
        declared = request.content_length
        if declared is not None and declared > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
        with self.bodies.book(declared if declared is not None else MAX_BODY_BYTES) as booked:
            if not booked:
                raise ApiError(503, "this node is reading too many large requests right now; retry in a moment", retry_after=2)
            try:
                async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                    return await request.read()
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:.0f} s") from None

    async def json(self, raw: bytes) -> dict:
        async with self._parses:
            return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)

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
