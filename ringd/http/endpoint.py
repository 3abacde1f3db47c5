"""The one lifecycle of a request that generates, whatever API it came by.

    API key -> body (within the node's budget) -> a follower's proof -> JSON (off the loop)
    -> on a follower: proxied to the leader, and that is all
    -> on the leader: the API's parse -> ``Serving.open`` -> a stream or a whole answer
    -> completion tokens counted -> the generation closed, its caches freed on every stage

Each API is a ``Translation`` (``openai_api.py``, ``responses_api.py``,
``anthropic_api.py``, ``ollama_api.py``): it parses its body into the one
internal request, and writes the one stream of ``Output`` events in its own
shape, through an ``Answer`` per request, as plain data. It does no I/O and
knows nothing of keys, bodies, followers, framing or metrics; this module knows
no API (``api.py`` says which route runs which translation).

A stream: the first event is awaited before the response starts, so a ring
that fails at once still gets a proper error status; the events are framed as
the API frames them (``framing.py``); an error once the stream has started is
reported in-band, as the API reports one, and the stream ends properly. A
client that goes away mid-stream (a write meets ``ConnectionResetError``, or
aiohttp cancels the handler) ends the request quietly: the generation is closed,
which frees the request's caches on every stage.

A route that embeds (``embeddings.py``) has the same first steps (key, body, proof,
JSON, a follower's forward) and then its own: the translation's request, the vectors
through the ring, the answer written off the loop.

A follower carries an OpenAI stream over to a new leader when its leader dies
(``proxy.py``): for a proven forward of a resumable translation, each token's id
goes out in a comment line (TOKEN_COMMENT) before that token's events, and a
request that brings the ids already streamed (RESUME_FIELD) continues the same
response, its tokens replayed, not sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from aiohttp import web

from ringd.http import embeddings
from ringd.http.errors import ApiError
from ringd.http.fields import KEEP_ALIVE_UNSET, MAX_MODEL_CHARS, keep_alive_field
from ringd.http.framing import Joined
from ringd.leader.errors import EngineError
from ringd.http.intake import Intake, request_id
from ringd.http.proxy import RESUME_FIELD, TOKEN_COMMENT, Proxy, Resume, read_resume
from ringd.http.serving import Generation, Serving

if TYPE_CHECKING:
    from ringd.http.framing import Framing
    from ringd.http.node import ApiNode, Served
    from ringd.http.request import Output, Request

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Answer(Protocol):
    """One request of an API, parsed: the internal request, and its answer as it is written.

    Events are dicts the translation's ``Framing`` writes; a whole answer calls
    ``feed`` for every output, drops what it returns, then asks for ``whole``.
    """

    # The one internal request; None when there is nothing to generate (Ollama's
    # "load the model" call): ``whole(None)`` is then the answer.
    request: "Request | None"
    stream: bool

    def start(self, gen: Generation, resume: Resume | None) -> list[dict]:
        """The events before the first token's (``resume``: a stream carried over, which goes on)."""

    def feed(self, out: "Output") -> list[dict]:
        """What one token adds to the answer, as events."""

    def end(self, gen: Generation) -> list[dict]:
        """The events after the last token's."""

    def error(self, e: ApiError) -> list[dict]:
        """The events that report ``e`` once the stream has started."""

    def whole(self, gen: Generation | None) -> dict:
        """The whole answer's body, once every output was fed."""


class Translation(Protocol):
    """One API's side of a route that generates."""

    framing: "Framing"  # how its streams are written
    resumable: bool  # a follower can carry its streams over to a new leader (OpenAI's SSE)
    keep_alive: bool  # its body may say how long the model stays loaded (Ollama's keep_alive)

    def streams(self, body: dict) -> bool:
        """Whether ``body`` asks for a stream, before it is parsed (a follower forwards it so)."""

    def parse(self, body: dict, served: "Served") -> Answer:
        """The body as the one internal request to ``served`` (the model it names), or a 400 ``ApiError``."""

    def unloaded(self, body: dict) -> dict | None:
        """The answer if ``body`` only asks to unload its model (Ollama's keep_alive 0 with no
        prompt), else None."""


class Count(Protocol):
    """One API's side of a route that counts a request's prompt tokens (Anthropic's count_tokens)."""

    def parse(self, body: dict) -> "Request": ...
    def counted(self, tokens: int) -> dict: ...


class Endpoint:
    def __init__(self, node: "ApiNode", intake: Intake, serving: Serving, proxy: Proxy):
        self.d = node
        self.intake = intake
        self.serving = serving
        self.proxy = proxy
        self.embedder = embeddings.Embedder(serving)

    def generating(self, api: Translation) -> Handler:
        """The aiohttp handler of a route that generates through ``api``."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, api)

        return handler

    def counting(self, api: Count) -> Handler:
        """The aiohttp handler of a route that counts prompt tokens through ``api``."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.count(request, api)

        return handler

    def embedding(self, api: "embeddings.Translation") -> Handler:
        """The aiohttp handler of a route that embeds through ``api``."""

        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.embed(request, api)

        return handler

    async def _receive(self, request: web.Request) -> tuple[bytes, dict, bool]:
        """The body as bytes and as JSON, and whether a follower (proven) forwarded it."""
        self.intake.need_key(request)
        raw = await self.intake.read(request)
        forwarded = await self.intake.forwarded_by(request, raw) is not None
        return raw, await self.intake.json(raw), forwarded

    async def count(self, request: web.Request, api: Count) -> web.StreamResponse:
        raw, body, _ = await self._receive(request)
        if not self.d.leading:
            return await self.proxy.forward(request, raw, False, resumable=False)
        req = await self.intake.off_loop(api.parse, body)
        served = await self.served(body, api)
        try:
            return web.json_response(api.counted(await self.serving.count_tokens(req, served)))
        finally:
            served.release()

    async def served(self, body: dict, api: "Translation | Count") -> "Served":
        """The model ``body`` names, loaded if need be (a malformed name: the configured model's,
        and the API's parse refuses the name in its own words)."""
        name = body.get("model")
        keep_alive = keep_alive_field(body) if getattr(api, "keep_alive", False) else KEEP_ALIVE_UNSET
        try:
            return await self.d.served(name if isinstance(name, str) and 0 < len(name) <= MAX_MODEL_CHARS else None, keep_alive)
        except EngineError as e:
            raise ApiError(e.status, str(e), "model" if e.status in (400, 404) else None, "model_not_found" if e.status == 404 else None, retry_after=e.retry_after) from None

    async def embed(self, request: web.Request, api: "embeddings.Translation") -> web.StreamResponse:
        raw, body, _ = await self._receive(request)
        if not self.d.leading:
            return await self.proxy.forward(request, raw, False, resumable=False)
        loop = asyncio.get_running_loop()
        served = await self.served(body, api)  # the pool's model of that name, loaded if need be
        try:
            # Up to MAX_INPUTS inputs of token ids each checked: not on the loop.
            req = await self.intake.off_loop(api.parse, body, served)
            done = await self.embedder.embed(req, request_id(request), served)
            # Thousands of vectors are megabytes of JSON: written off the loop.
            answer = await loop.run_in_executor(None, api.answer, req, done)
        finally:
            served.release()
        return web.Response(body=answer, content_type="application/json")

    async def generate(self, request: web.Request, api: Translation) -> web.StreamResponse:
        received_ns = time.monotonic_ns()
        raw, body, forwarded = await self._receive(request)
        if not self.d.leading:
            return await self.proxy.forward(request, raw, api.streams(body), resumable=api.resumable)
        unloaded = api.unloaded(body)
        if unloaded is not None:
            self.d.unload(body["model"])
            return web.json_response(unloaded)
        served = await self.served(body, api)
        try:
            return await self._generate(request, api, body, served, forwarded, received_ns)
        finally:
            served.release()  # its replica's outstanding work, counted from the routing on

    async def _generate(
        self, request: web.Request, api: Translation, body: dict, served: "Served", forwarded: bool, received_ns: int
    ) -> web.StreamResponse:
        # Messages, tools and schemas checked: work that grows with the body, not on the loop.
        answer = await self.intake.off_loop(api.parse, body, served)
        if answer.request is None:
            return web.json_response(answer.whole(None))
        resume = None
        if api.resumable and forwarded and body.get(RESUME_FIELD) is not None:
            if not answer.stream:  # followers carry streams over; anything else is sent again whole
                raise ApiError(400, f"{RESUME_FIELD} carries a stream over; this request does not stream", RESUME_FIELD)
            # Up to MAX_RESUME_TOKENS ids, each checked: tens of milliseconds, not on the loop.
            resume = await asyncio.get_running_loop().run_in_executor(None, read_resume, body[RESUME_FIELD], served.info.vocab_size)
        gen = await self.serving.open(answer.request, served, request_id(request), resume.tokens if resume else (), received_ns)
        try:
            if answer.stream:
                return await self._stream(request, api.framing, answer, gen, resume, token_ids=forwarded and api.resumable)
            return await self._whole(answer, gen)
        finally:
            # However it ends (done, failed, cancelled by a disconnect): the RELEASE that frees every stage.
            await gen.aclose()

    async def _whole(self, answer: Answer, gen: Generation) -> web.Response:
        try:
            async for out in gen:
                answer.feed(out)
        finally:
            self.d.metrics.completion_tokens.inc(gen.usage.completion_tokens)
        return web.json_response(answer.whole(gen))

    async def _stream(
        self, request: web.Request, framing: "Framing", answer: Answer, gen: Generation, resume: Resume | None, token_ids: bool
    ) -> web.StreamResponse:
        events = aiter(gen)
        # Pull the first event before answering 200, so a ring that fails at once
        # still gets a proper error status.
        first = await anext(events, None)
        resp = web.StreamResponse(headers={"Content-Type": framing.content_type, "Cache-Control": "no-cache"})
        await resp.prepare(request)
        resumed = len(resume.tokens) if resume is not None else 0

        joined = Joined()

        async def send(batch: list[dict], token: int | None = None, more: bool = False) -> None:
            data = b"".join(framing.frame(ev) for ev in batch)
            if token_ids and token is not None:
                # For the follower that proxies this stream: the token's id, so it can
                # carry the stream over to another leader (proxy.py strips the line). A
                # token with no events of its own still has its id, as an event by itself.
                data = TOKEN_COMMENT + str(token).encode() + b"\n" + (data or b"\n")
            # A client that lags has the next token's events waiting: one write for both.
            data = joined.add(data, more)
            if data:
                await resp.write(data)

        try:
            await send(answer.start(gen, resume))
            out = first
            while out is not None:
                await send(answer.feed(out), out.token, gen.backlog > 0)
                out = await anext(events, None)
            await send(answer.end(gen))
        except ApiError as e:
            # The stream has started: report the failure in-band, as the API does, and end it properly.
            await send(answer.error(e))
        except ConnectionResetError:  # aiohttp's "Cannot write to closing transport"
            log.debug("the client closed the stream after %d token(s)", gen.usage.completion_tokens)
            return resp  # the caller's gen.aclose() frees the ring
        finally:
            # The tokens a carried-over stream replayed were counted where they were first sent.
            self.d.metrics.completion_tokens.inc(gen.usage.completion_tokens - resumed)
        try:
            if framing.done:
                await resp.write(framing.done)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client closed once it had the answer's end, before the last empty chunk: done all the same
        return resp
