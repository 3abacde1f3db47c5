"""A follower's /v1: pass each request to the leader, and carry a stream over when the leader dies.

Any node answers the OpenAI API; a follower forwards to the leader, marking the
request (FORWARDED_HEADER) so that two nodes that each think the other leads
never bounce it between them. For a forwarded stream, the leader puts each
token's id in an SSE comment line (``: ringd-token 123``) beside the chunk that
carries its text; the follower keeps the ids and strips the comments, so the
client sees OpenAI's stream and nothing else.

When the leader dies mid-stream (its connection breaks, or the election moves
away from it: a stalled leader never closes its socket), the follower waits
for a leader that serves, up to ``failover_wait_s``, and sends it the same request
with the ids already streamed (RESUME_FIELD). The new leader replays them as a
stage failure is replayed (``engine.py``), so the client sees a pause, then the
rest of the text, no token lost or repeated. A request whose response had not
started is simply sent again. When no leader serves in time, a started stream
ends with an OpenAI error event and ``data: [DONE]``, never broken chunking or
a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Protocol

import aiohttp
from aiohttp import web

from . import logs
from .openai_types import ApiError

log = logging.getLogger(__name__)

# A follower forwards to the leader: a leader that does not accept the
# connection this fast is down; once connected, it may take as long between two
# streamed chunks as the engine itself allows a step (STEP_TIMEOUT_S, 120 s).
PROXY_CONNECT_TIMEOUT_S = 5.0
PROXY_READ_TIMEOUT_S = 130.0
# How often the follower looks whether a new leader serves.
FAILOVER_POLL_S = 0.1
# An SSE event larger than this from the leader is not ringd's: drop the stream.
MAX_SSE_EVENT_BYTES = 1024 * 1024

FORWARDED_HEADER = "X-Ringd-Forwarded-By"
REQUEST_ID_HEADER = "X-Request-Id"
TOKEN_COMMENT = b": ringd-token "
# The body field a follower adds to carry a stream over: the ids already
# streamed, and the response's id and creation time so the chunks keep them.
RESUME_FIELD = "ringd_resume"
# Headers a follower passes to the leader: the API key goes along.
_PASSED_HEADERS = ("Authorization", "Content-Type", REQUEST_ID_HEADER)


class ProxyNode(Protocol):
    name: str
    failover_wait_s: float  # how long to wait for a new leader that serves (config failover_wait_s)

    def leader_http(self) -> str | None: ...
    def readiness(self) -> tuple[bool, str]: ...
    async def leader_changed(self) -> None: ...


class _LeaderLost(Exception):
    """The leader went away (or stopped being the leader) mid-request."""


class Proxy:
    def __init__(self, node: ProxyNode):
        self.node = node
        self._client: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=PROXY_CONNECT_TIMEOUT_S, sock_read=PROXY_READ_TIMEOUT_S),
                auto_decompress=False,
            )
        return self._client

    async def _leader(self, deadline: float | None) -> str | None:
        """The leader's URL once one serves; None if none does by ``deadline`` (no deadline: only now)."""
        while True:
            url = self.node.leader_http()
            ready, _ = self.node.readiness()
            if url is not None and ready:
                return url
            if deadline is None or time.monotonic() >= deadline:
                return url if deadline is None else None
            await asyncio.sleep(FAILOVER_POLL_S)

    def _headers(self, request: web.Request) -> dict:
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        headers.setdefault("Content-Type", "application/json")
        request_id = logs.REQUEST_ID.get()
        if request_id is not None:  # the one this node gave it, when the client gave none
            headers[REQUEST_ID_HEADER] = request_id
        headers[FORWARDED_HEADER] = self.node.name
        return headers

    async def forward(self, request: web.Request, body: bytes, stream: bool) -> web.StreamResponse:
        if request.headers.get(FORWARDED_HEADER):
            raise ApiError(503, "no leader is elected right now (an election is under way); retry in a moment")
        log.debug("forwarding %s %s to the leader at %s", request.method, request.path, self.node.leader_http())
        if stream:
            return await _Stream(self, request, body).run()
        return await self._whole(request, body)

    async def control(self, request: web.Request, url: str, body: bytes, signed: dict[str, str]) -> web.Response:
        """A control request for the leader (drain): sent on once, with this node's own signature."""
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: self.node.name, **signed}
        try:
            return await self._post_whole(url, request, body, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise ApiError(503, f"the leader at {url} did not answer ({type(e).__name__}); retry in a moment") from None

    async def _whole(self, request: web.Request, body: bytes) -> web.Response:
        deadline = None
        while True:
            url = await self._leader(deadline)
            if url is None:
                if deadline is None:
                    raise ApiError(503, "no leader is elected right now (an election is under way); retry in a moment")
                raise ApiError(503, f"the leader was lost and no new one served within {self.node.failover_wait_s:.0f} s; retry")
            try:
                return await _race(self.node, self._post_whole(url, request, body))
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, _LeaderLost) as e:
                log.warning("forwarding %s to %s failed (%s); waiting for a leader that serves", request.path, url, type(e).__name__)
                deadline = deadline or time.monotonic() + self.node.failover_wait_s
                await asyncio.sleep(FAILOVER_POLL_S)

    async def _post_whole(self, url: str, request: web.Request, body: bytes, headers: dict | None = None) -> web.Response:
        async with self._session().post(url + request.path_qs, data=body, headers=headers or self._headers(request)) as up:
            data = await up.read()
            headers = {"Content-Type": up.headers.get("Content-Type", "application/json")}
            for h in ("Retry-After", REQUEST_ID_HEADER):
                if h in up.headers:
                    headers[h] = up.headers[h]
            return web.Response(status=up.status, body=data, headers=headers)


async def _race(node: ProxyNode, coro):
    """Run ``coro``; if the leader changes first, cancel it and raise _LeaderLost."""
    work = asyncio.ensure_future(coro)
    moved = asyncio.ensure_future(node.leader_changed())
    try:
        done, _ = await asyncio.wait({work, moved}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        moved.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise _LeaderLost()


class _Stream:
    """One streamed request through this follower, across as many leaders as it takes."""

    def __init__(self, proxy: Proxy, request: web.Request, body: bytes):
        self.proxy = proxy
        self.request = request
        self.body = body
        self.resp: web.StreamResponse | None = None
        self.tokens: list[int] = []  # ids of the tokens whose chunks the client has
        self.id: str | None = None
        self.created: int | None = None
        self.finished = False  # a chunk with a finish_reason went out
        self.done = False  # data: [DONE] went out

    async def run(self) -> web.StreamResponse:
        deadline = None
        while True:
            url = await self.proxy._leader(deadline)
            if url is None:
                return await self._give_up(
                    "no leader is elected right now (an election is under way); retry in a moment"
                    if deadline is None
                    else f"the leader was lost mid-stream and no new one served within {self.proxy.node.failover_wait_s:.0f} s"
                )
            try:
                await _race(self.proxy.node, self._attempt(url))
                if self.done:
                    return await self._end()
                raise ConnectionError("the leader's stream ended without data: [DONE]")
            except _Relayed as r:
                return r.response
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, _LeaderLost, ValueError) as e:
                if self.finished:  # every token is out; only the end was lost
                    await self._write(b"data: [DONE]\n\n")
                    return await self._end()
                log.warning(
                    "stream via %s broke after %d token(s) (%s: %s); carrying it over to the next leader",
                    url, len(self.tokens), type(e).__name__, e,
                )  # fmt: skip
                deadline = deadline or time.monotonic() + self.proxy.node.failover_wait_s
                await asyncio.sleep(FAILOVER_POLL_S)

    def _body(self) -> bytes:
        if not self.tokens:
            return self.body
        doc = json.loads(self.body)
        doc[RESUME_FIELD] = {"tokens": self.tokens, "id": self.id, "created": self.created}
        return json.dumps(doc).encode()

    async def _attempt(self, url: str) -> None:
        proxy = self.proxy
        async with proxy._session().post(url + self.request.path_qs, data=self._body(), headers=proxy._headers(self.request)) as up:
            if up.status != 200:
                data = await up.read()
                if self.resp is not None or up.status == 503:
                    # Mid-failover a new leader may not serve yet: try again.
                    raise ConnectionError(f"the leader answered {up.status}")
                headers = {"Content-Type": up.headers.get("Content-Type", "application/json")}
                for h in ("Retry-After", REQUEST_ID_HEADER):
                    if h in up.headers:
                        headers[h] = up.headers[h]
                raise _Relayed(web.Response(status=up.status, body=data, headers=headers))
            if self.resp is None:
                self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await self.resp.prepare(self.request)
            buffer = b""
            async for chunk in up.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    await self._relay(event)
                if len(buffer) > MAX_SSE_EVENT_BYTES:
                    raise ConnectionError("the leader sent an SSE event over MAX_SSE_EVENT_BYTES")
                if self.done:
                    return

    async def _relay(self, event: bytes) -> None:
        lines = event.split(b"\n")
        kept = []
        token = None
        for line in lines:
            if line.startswith(TOKEN_COMMENT):
                token = int(line[len(TOKEN_COMMENT) :])
            else:
                kept.append(line)
        for line in kept:
            if line == b"data: [DONE]":
                self.done = True
            elif line.startswith(b"data: "):
                obj = json.loads(line[6:])
                error = obj.get("error") if isinstance(obj, dict) else None
                if isinstance(error, dict) and error.get("type") == "service_unavailable":
                    # The leader gave the stream up (it lost the lead, or its ring):
                    # another leader can carry it on, so the client need not hear of it.
                    raise ConnectionError(f"the leader ended the stream: {error.get('message')}")
                if isinstance(obj, dict):
                    self.id = self.id or obj.get("id")
                    self.created = self.created or obj.get("created")
                    for choice in obj.get("choices") or []:
                        if isinstance(choice, dict) and choice.get("finish_reason"):
                            self.finished = True
        if kept:
            await self._write(b"\n".join(kept) + b"\n\n")
        if token is not None:
            self.tokens.append(token)  # after the chunk is out: the client has it

    async def _write(self, data: bytes) -> None:
        await self.resp.write(data)

    async def _end(self) -> web.StreamResponse:
        await self.resp.write_eof()
        return self.resp

    async def _give_up(self, message: str) -> web.StreamResponse:
        if self.resp is None:
            raise ApiError(503, message)
        log.warning("stream ended after %d token(s): %s", len(self.tokens), message)
        error = ApiError(503, message).body()
        await self._write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        return await self._end()


class _Relayed(Exception):
    """The leader answered with an error before streaming: pass it on as it is."""

    def __init__(self, response: web.Response):
        self.response = response
