"""A follower's /v1: pass each request to the leader, and carry a stream over when the leader dies.

Any node answers the OpenAI API; a follower forwards to the leader, marking the
request (FORWARDED_HEADER) so that two nodes that each think the other leads
never bounce it between them. The mark is a credential (it lets the request
carry a stream over, RESUME_FIELD), so the follower signs each forward with the
cluster secret for the leader it means (``auth.sign_forward``), afresh on
every attempt, and the leader refuses a mark without that proof. For a
forwarded stream, the leader puts each token's id in an SSE comment line
(``: ringd-token 123``) beside the chunk that carries its text; the follower
keeps the ids and strips the comments, so the client sees OpenAI's stream and
nothing else. A client that hangs up (most often the moment it has
``data: [DONE]``) ends the stream quietly: it is no leader lost.

When the leader dies mid-stream (its connection breaks, or the election moves
away from it: a stalled leader never closes its socket), the follower waits
for a leader that serves, up to ``failover_wait_s``, and sends it the same request
with the ids already streamed (RESUME_FIELD). The new leader replays them as a
stage failure is replayed (``engine.py``), so the client sees a pause, then the
rest of the text, no token lost or repeated. A request whose response had not
started is simply sent again. When no leader serves in time, a started stream
ends with an OpenAI error event and ``data: [DONE]``, never broken chunking or
a hang. So does every stream this node forwards when it stops (``stop``): it
neither waits for a leader any more nor retries one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

from ringd.base import logs
from ringd.security.auth import FORWARDED_BY_HEADER, body_sha256, sign_forward
from ringd.http.errors import ApiError

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

FORWARDED_HEADER = FORWARDED_BY_HEADER  # with the proof auth.sign_forward adds
REQUEST_ID_HEADER = "X-Request-Id"
TOKEN_COMMENT = b": ringd-token "
# The body field a follower adds to carry a stream over: the ids already
# streamed, and the response's id and creation time so the chunks keep them.
RESUME_FIELD = "ringd_resume"
# A follower's resumed stream names at most this many tokens already streamed:
# no stream is longer than a context.
MAX_RESUME_TOKENS = 1 << 20
# Headers a follower passes to the leader: the API key goes along (as Bearer or x-api-key).
_PASSED_HEADERS = ("Authorization", "x-api-key", "anthropic-version", "Content-Type", REQUEST_ID_HEADER)


@dataclass(frozen=True)
class Resume:
    """A stream carried over (RESUME_FIELD, as the leader reads it): the ids of the tokens the
    client has, and the response's id and creation time, which its chunks keep."""

    tokens: list[int]
    id: str | None
    created: int | None


def read_resume(v, vocab_size: int) -> Resume:
    """A follower's RESUME_FIELD, checked (up to MAX_RESUME_TOKENS ids: run it off the event loop)."""
    if not isinstance(v, dict) or set(v) != {"tokens", "id", "created"}:
        raise ApiError(400, f"{RESUME_FIELD} must hold tokens, id and created", RESUME_FIELD)
    tokens, rid, created = v["tokens"], v["id"], v["created"]
    if not isinstance(tokens, list) or len(tokens) > MAX_RESUME_TOKENS or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"{RESUME_FIELD}.tokens must be token ids below {vocab_size}", RESUME_FIELD)
    if not (rid is None or isinstance(rid, str) and len(rid) <= 64) or not (created is None or type(created) is int):
        raise ApiError(400, f"{RESUME_FIELD}.id must be a short string and created an integer", RESUME_FIELD)
    return Resume(tokens, rid, created)


def _untrusted(e: Exception, url: str) -> ApiError | None:
    """The error for a leader whose certificate this node does not trust, which no retry mends
    (waiting failover_wait_s for another leader would only hide it); None for any other failure."""
    if not isinstance(e, aiohttp.ClientConnectorCertificateError):
        return None
    log.error("the leader at %s serves a certificate this node does not trust: %s", url, e.certificate_error)
    return ApiError(
        502,
        f"this node cannot forward to the leader at {url}: its certificate is not trusted here ({e.certificate_error}); "
        "with tls: auto every node needs the same secret and cluster name, with tls_cert set tls_ca to the CA that issued "
        "the leader's certificate",
        code="leader_untrusted",
    )  # fmt: skip


class ProxyNode(Protocol):
    name: str
    secret: bytes  # the cluster secret: it signs each forward
    failover_wait_s: float  # how long to wait for a new leader that serves (config failover_wait_s)
    client_ssl: ssl.SSLContext | None  # whom an https leader is trusted as (tls.client_context); None: the system's store

    @property
    def leader(self) -> str | None: ...
    def leader_http(self) -> str | None: ...
    def readiness(self) -> tuple[bool, str]: ...
    async def leader_changed(self) -> None: ...


class _LeaderLost(Exception):
    """The leader went away (or stopped being the leader) mid-request."""


class _Stopping(Exception):
    """This node is stopping: what it forwards ends here, with the reason."""


class Proxy:
    def __init__(self, node: ProxyNode):
        self.node = node
        self._client: aiohttp.ClientSession | None = None
        self._stopping = asyncio.Event()  # set (once) when this node stops: every forward ends
        self.stop_reason = ""

    def stop(self, reason: str) -> None:
        """This node is stopping: end what it forwards (a started stream with an error event and
        ``data: [DONE]``, anything else with a 503) and wait for no leader any more."""
        self.stop_reason = reason
        self._stopping.set()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=PROXY_CONNECT_TIMEOUT_S, sock_read=PROXY_READ_TIMEOUT_S),
                auto_decompress=False,
                # A leader that serves https (its INFO says so) is checked against the cluster CA
                # (or tls_ca); the connect timeout bounds its handshake too.
                connector=aiohttp.TCPConnector(ssl=self.node.client_ssl or True),
            )
        return self._client

    async def _leader(self, deadline: float | None) -> str | None:
        """The leader's URL once one serves; None if none does by ``deadline`` (no deadline: only now)."""
        while True:
            if self._stopping.is_set():
                raise _Stopping(self.stop_reason)
            url = self.node.leader_http()
            ready, _ = self.node.readiness()
            if url is not None and ready:
                return url
            if deadline is None or time.monotonic() >= deadline:
                return url if deadline is None else None
            await asyncio.sleep(FAILOVER_POLL_S)

    def _headers(self, request: web.Request, url: str, digest: str) -> dict:
        """The headers of one attempt to forward ``request`` to the leader at ``url``, signed for it
        (``digest``: auth.body_sha256 of the body sent)."""
        leader = self.node.leader
        if leader is None or self.node.leader_http() != url:
            # The proof names the leader; which one serves at ``url`` changed since it was chosen.
            raise ConnectionError("the leader changed while the request was on its way")
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        headers.setdefault("Content-Type", "application/json")
        request_id = logs.REQUEST_ID.get()
        if request_id is not None:  # the one this node gave it, when the client gave none
            headers[REQUEST_ID_HEADER] = request_id
        headers.update(sign_forward(self.node.secret, request.method, request.path_qs, self.node.name, leader, digest, time.time()))
        return headers

    async def forward(self, request: web.Request, body: bytes, stream: bool, resumable: bool = True) -> web.StreamResponse:
        """Send the request to the leader and answer with what it answers.

        ``resumable``: the stream is OpenAI's chat or completions SSE, which a new
        leader can carry on (RESUME_FIELD). Other streams (Anthropic's and
        Responses' events, Ollama's NDJSON) are relayed byte for byte; a leader
        lost before they start is waited for as for a whole answer, and one lost
        midway ends the stream (``_Relay``).
        """
        if request.headers.get(FORWARDED_HEADER):
            raise ApiError(503, "no leader is elected right now (an election is under way); retry in a moment")
        log.debug("forwarding %s %s to the leader at %s", request.method, request.path, self.node.leader_http())
        if stream and resumable:
            return await _Stream(self, request, body).run()
        if stream:
            return await _Relay(self, request, body).run()
        try:
            return await self._whole(request, body)
        except _Stopping as e:
            raise ApiError(503, str(e)) from None

    async def control(self, request: web.Request, url: str, body: bytes, signed: dict[str, str]) -> web.Response:
        """A control request for the leader (drain): sent on once, with this node's own signature."""
        headers = {"Content-Type": "application/json", FORWARDED_HEADER: self.node.name, **signed}
        try:
            return await self._post_whole(url, request, body, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise ApiError(503, f"the leader at {url} did not answer ({type(e).__name__}); retry in a moment") from None

    async def _whole(self, request: web.Request, body: bytes) -> web.Response:
        deadline = None
        digest = await asyncio.get_running_loop().run_in_executor(None, body_sha256, body)  # up to 16 MiB: off the loop
        while True:
            url = await self._leader(deadline)
            if url is None:
                if deadline is None:
                    raise ApiError(503, "no leader is elected right now (an election is under way); retry in a moment")
                raise ApiError(503, f"the leader was lost and no new one served within {self.node.failover_wait_s:.0f} s; retry")
            try:
                return await _race(self, self._post_whole(url, request, body, self._headers(request, url, digest)))
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, _LeaderLost) as e:
                if (untrusted := _untrusted(e, url)) is not None:
                    raise untrusted from None
                log.warning("forwarding %s to %s failed (%s); waiting for a leader that serves", request.path, url, type(e).__name__)
                deadline = deadline or time.monotonic() + self.node.failover_wait_s
                await asyncio.sleep(FAILOVER_POLL_S)

    async def _post_whole(self, url: str, request: web.Request, body: bytes, headers: dict) -> web.Response:
        # The method the client used: a GET asked of the leader (/api/ps) stays a GET.
        async with self._session().request(request.method, url + request.path_qs, data=body if request.method != "GET" else None, headers=headers) as up:
            data = await up.read()
            headers = {"Content-Type": up.headers.get("Content-Type", "application/json")}
            for h in ("Retry-After", REQUEST_ID_HEADER):
                if h in up.headers:
                    headers[h] = up.headers[h]
            return web.Response(status=up.status, body=data, headers=headers)


async def _race(proxy: Proxy, coro):
    """Run ``coro``; if the leader changes first, cancel it and raise _LeaderLost; if this node
    starts stopping, cancel it and raise _Stopping."""
    work = asyncio.ensure_future(coro)
    moved = asyncio.ensure_future(proxy.node.leader_changed())
    stopping = asyncio.ensure_future(proxy._stopping.wait())
    try:
        done, _ = await asyncio.wait({work, moved, stopping}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        moved.cancel()
        stopping.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    if proxy._stopping.is_set():
        raise _Stopping(proxy.stop_reason)
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
        try:
            try:
                return await self._run()
            except _Stopping as e:
                return await self._give_up(str(e))
        except _ClientGone:
            # Most often right after data: [DONE], which is all a client waits for: the
            # normal end of a stream, nothing to log above debug.
            log.debug("the client closed the stream after %d token(s)", len(self.tokens))
            return self.resp

    async def _run(self) -> web.StreamResponse:
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
                await _race(self.proxy, self._attempt(url))
                if self.done:
                    return await self._end()
                raise ConnectionError("the leader's stream ended without data: [DONE]")
            except _Relayed as r:
                return r.response
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, _LeaderLost, ValueError) as e:
                if (untrusted := _untrusted(e, url)) is not None:
                    if self.resp is None:
                        raise untrusted from None
                    return await self._give_up(untrusted.message)
                if self.finished:  # every token is out; only the end was lost
                    await self._write(b"data: [DONE]\n\n")
                    return await self._end()
                log.warning(
                    "stream via %s broke after %d token(s) (%s: %s); carrying it over to the next leader",
                    url, len(self.tokens), type(e).__name__, e,
                )  # fmt: skip
                deadline = deadline or time.monotonic() + self.proxy.node.failover_wait_s
                await asyncio.sleep(FAILOVER_POLL_S)

    def _body(self) -> tuple[bytes, str]:
        """The body to send (with the ids already streamed, once there are some) and its digest."""
        body = self.body
        if self.tokens:
            doc = json.loads(self.body)
            doc[RESUME_FIELD] = {"tokens": self.tokens, "id": self.id, "created": self.created}
            body = json.dumps(doc).encode()
        return body, body_sha256(body)

    async def _attempt(self, url: str) -> None:
        proxy = self.proxy
        # A long chat, or a long stream's ids, is megabytes of JSON: not on the loop (no
        # token is relayed meanwhile, so the ids stay put).
        body, digest = await asyncio.get_running_loop().run_in_executor(None, self._body)
        headers = proxy._headers(self.request, url, digest)
        async with proxy._session().post(url + self.request.path_qs, data=body, headers=headers) as up:
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
        try:
            await self.resp.write(data)
        except ConnectionResetError:  # aiohttp's "Cannot write to closing transport"
            # Not a ClientError of the leader's connection: no leader to carry it over to.
            raise _ClientGone() from None

    async def _end(self) -> web.StreamResponse:
        try:
            await self.resp.write_eof()
        except ConnectionResetError:
            pass  # the client closed once it had data: [DONE], before the last empty chunk: done all the same
        return self.resp

    async def _give_up(self, message: str) -> web.StreamResponse:
        if self.resp is None:
            raise ApiError(503, message)
        log.warning("stream ended after %d token(s): %s", len(self.tokens), message)
        error = ApiError(503, message).body()
        await self._write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        return await self._end()


class _Relay:
    """A stream passed through as it is, from whichever leader first answers it."""

    def __init__(self, proxy: Proxy, request: web.Request, body: bytes):
        self.proxy = proxy
        self.request = request
        self.body = body
        self.resp: web.StreamResponse | None = None

    async def run(self) -> web.StreamResponse:
        digest = await asyncio.get_running_loop().run_in_executor(None, body_sha256, self.body)
        deadline = None
        while True:
            url = await self.proxy._leader(deadline)
            if url is None:
                raise ApiError(503, "no leader served this request in time; retry in a moment")
            try:
                await _race(self.proxy, self._attempt(url, digest))
                return await self._end()
            except _Relayed as r:
                return r.response
            except _ClientGone:
                log.debug("the client closed a relayed stream")
                return self.resp
            except _Stopping as e:
                if self.resp is None:
                    raise ApiError(503, str(e)) from None
                return await self._end()
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, _LeaderLost) as e:
                if (untrusted := _untrusted(e, url)) is not None and self.resp is None:
                    raise untrusted from None
                if self.resp is not None:
                    # Started: these formats cannot be carried over; the client sees the stream end early.
                    log.warning("relayed stream via %s broke (%s); ending it", url, type(e).__name__)
                    return await self._end()
                deadline = deadline or time.monotonic() + self.proxy.node.failover_wait_s
                await asyncio.sleep(FAILOVER_POLL_S)

    async def _attempt(self, url: str, digest: str) -> None:
        headers = self.proxy._headers(self.request, url, digest)
        async with self.proxy._session().post(url + self.request.path_qs, data=self.body, headers=headers) as up:
            if up.status != 200:
                data = await up.read()
                if up.status == 503:
                    raise ConnectionError(f"the leader answered {up.status}")
                out = {"Content-Type": up.headers.get("Content-Type", "application/json")}
                for h in ("Retry-After", REQUEST_ID_HEADER):
                    if h in up.headers:
                        out[h] = up.headers[h]
                raise _Relayed(web.Response(status=up.status, body=data, headers=out))
            self.resp = web.StreamResponse(headers={"Content-Type": up.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)
            async for chunk in up.content.iter_any():
                try:
                    await self.resp.write(chunk)
                except ConnectionResetError:
                    raise _ClientGone() from None

    async def _end(self) -> web.StreamResponse:
        try:
            await self.resp.write_eof()
        except ConnectionResetError:
            pass
        return self.resp


class _ClientGone(Exception):
    """The client of a forwarded stream closed its connection."""


class _Relayed(Exception):
    """The leader answered with an error before streaming: pass it on as it is."""

    def __init__(self, response: web.Response):
        self.response = response
