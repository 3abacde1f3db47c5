"""The HTTP face of a node, with aiohttp: OpenAI endpoints, health, status, metrics.

The leader serves ``/v1/*`` through its ``Engine``; every node answers
``/health``, ``/cluster/status`` and ``/metrics`` about itself. Errors have
OpenAI's shape and status; a malformed request is answered and forgotten, and
nothing a client sends can take the node down. A client that goes away
mid-stream cancels its request, which frees its caches on every stage.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .engine import EngineError
from .openai_types import ApiError, CompletionRequest, envelope, new_id, now, parse_json, parse_request, usage

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger(__name__)

# Largest request body: a long chat history is a few MB of JSON; more is abuse.
MAX_BODY_BYTES = 16 * 1024 * 1024
# A follower forwards /v1/* to the leader: a leader that does not accept the
# connection this fast is down; once connected, it may take as long between two
# streamed chunks as the engine itself allows a step.
PROXY_CONNECT_TIMEOUT_S = 5.0
PROXY_READ_TIMEOUT_S = 130.0
# Set on a forwarded request, so that two nodes that each think the other leads
# (for the moment an election takes) never bounce a request between them.
FORWARDED_HEADER = "X-Ringd-Forwarded-By"


def _error(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after or 1)} if e.status in (429, 503) else None
    return web.json_response(e.body(), status=e.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except web.HTTPRequestEntityTooLarge:
        return _error(ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes"))
    except web.HTTPException as e:
        if e.status == 404:
            return _error(ApiError(404, f"no route {request.method} {request.path}", code="not_found"))
        if e.status == 405:
            return _error(ApiError(405, f"{request.method} is not allowed on {request.path}", type_="invalid_request_error"))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error(ApiError(500, "internal error; the node's log has the details"))


class Api:
    def __init__(self, daemon: "Daemon"):
        self.d = daemon
        self.app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/cluster/status", self.cluster_status),
                web.post("/cluster/leader", self.set_leader),
                web.post("/cluster/drain", self.drain),
                web.get("/metrics", self.metrics),
            ]
        )
        self._runner: web.AppRunner | None = None
        self._client: aiohttp.ClientSession | None = None

    async def start(self, host: str, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler at
        # once, which releases its request's caches instead of generating on.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    # --- forwarding to the leader ---------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        """Answer a /v1 request on a follower by passing it to the leader, streams included."""
        leader = self.d.leader_http()
        if leader is None or request.headers.get(FORWARDED_HEADER):
            raise ApiError(503, "no leader is elected right now (an election is under way); retry in a moment")
        if self._client is None:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=PROXY_CONNECT_TIMEOUT_S, sock_read=PROXY_READ_TIMEOUT_S)
            )
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"), FORWARDED_HEADER: self.d.name}
        try:
            async with self._client.request(request.method, leader + request.path_qs, data=await request.read(), headers=headers) as up:
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "application/json")})
                if "Retry-After" in up.headers:
                    resp.headers["Retry-After"] = up.headers["Retry-After"]
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise ApiError(503, f"the leader at {leader} did not answer ({type(e).__name__}); retry in a moment") from None

    async def set_leader(self, request: web.Request) -> web.Response:
        """`ringctl leader set NODE` ({"node": NODE}) or `leader auto` ({"node": null})."""
        body = parse_json(await request.read())
        node = body.get("node")
        known = set(self.d.election.members)
        if node is not None and node not in known:
            raise ApiError(400, f"node {node!r} is not a live member; live: {', '.join(sorted(known))}", "node")
        self.d.set_pin(node)
        return web.json_response({"pin": self.d.election.pin.to_wire(), "leader": self.d.election.leader})

    async def drain(self, request: web.Request) -> web.Response:
        """`ringctl drain NODE`: the leader plans rings without it ({"undo": true} takes it back)."""
        if not self.d.leading:
            return await self._forward(request)
        body = parse_json(await request.read())
        node, undo = body.get("node"), body.get("undo", False)
        if not isinstance(node, str) or not isinstance(undo, bool):
            raise ApiError(400, "drain takes {\"node\": NAME, \"undo\": false}", "node")
        if node == self.d.name and not undo:
            raise ApiError(400, f"{node} leads; move leadership first (ringctl leader set OTHER), then drain it", "node")
        self.d.drain(node, undo)
        return web.json_response({"drained": sorted(self.d.drained)})

    # --- status -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        ready, reason = self.d.readiness()
        body = {"status": "ok" if ready else "unavailable", "reason": reason, **self.d.local_status()}
        return web.json_response(body, status=200 if ready else 503)

    async def cluster_status(self, request: web.Request) -> web.Response:
        return web.json_response(await self.d.cluster_status())

    async def metrics(self, request: web.Request) -> web.Response:
        self.d.metrics.refresh()
        return web.Response(body=generate_latest(self.d.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.d.model_id, "object": "model", "created": self.d.started, "owned_by": "ringd"}]}
        )

    # --- completions ----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        engine = self.d.engine
        if engine is None:
            return await self._forward(request)
        req = parse_request(parse_json(await request.read()), chat)
        if req.model != self.d.model_id:
            raise ApiError(404, f"model {req.model!r} is not served here; this ring serves {self.d.model_id!r}", "model", "model_not_found")
        ready, reason = self.d.readiness()
        if not ready:
            raise ApiError(503, f"the ring is not ready: {reason}")
        # Templates and tokenizers take milliseconds per long prompt: not on the loop.
        prompt = await asyncio.get_running_loop().run_in_executor(None, self._tokenize, req)
        try:
            req.params.check_vocab(self.d.info.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), "logit_bias") from None
        context = self.d.info.context_length
        if len(prompt) >= context:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; the model's context is {context}", "messages" if chat else "prompt", "context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise ApiError(
                400,
                f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the model's context of {context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        self.d.metrics.prompt_tokens.inc(len(prompt))
        events = engine.generate(prompt, req.params, max_tokens, req.stop)
        try:
            if req.stream:
                return await self._stream(request, req, events, len(prompt))
            return await self._whole(req, events, len(prompt))
        except EngineError as e:
            raise ApiError(e.status, str(e), retry_after=e.retry_after) from None
        finally:
            # However the handler ends (done, failed, cancelled by a disconnect),
            # closing the generator sends the RELEASE that frees every stage.
            await events.aclose()

    def _tokenize(self, req: CompletionRequest) -> list[int]:
        tok = self.d.tokenizer
        if req.chat:
            try:
                return list(tok.apply_chat_template(req.messages, add_generation_prompt=True))
            except Exception as e:  # jinja raises for conversations its template rejects
                raise ApiError(400, f"the model's chat template rejected these messages: {e}", "messages") from None
        if isinstance(req.prompt, list):
            vocab = self.d.info.vocab_size
            if any(t >= vocab for t in req.prompt):
                raise ApiError(400, f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
            return req.prompt
        return tok.encode(req.prompt)

    async def _whole(self, req: CompletionRequest, events, prompt_tokens: int) -> web.Response:
        text, logprobs, n, finish, cached = [], _Logprobs(self.d.tokenizer, req), 0, None, 0
        async for ev in events:
            n += 1
            cached = ev.cached_tokens
            text.append(ev.text)
            logprobs.add(ev)
            finish = ev.finish_reason
        self.d.metrics.completion_tokens.inc(n)
        content = "".join(text)
        choice = {"index": 0, "logprobs": logprobs.whole(), "finish_reason": finish}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        body = envelope(req, new_id(req.chat), now(), self.d.model_id, chunk=False)
        body.update(choices=[choice], usage=usage(prompt_tokens, n, cached))
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: CompletionRequest, events, prompt_tokens: int) -> web.StreamResponse:
        # Pull the first event before answering 200, so a ring that fails at once
        # still gets a proper error status.
        first = await anext(events, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = envelope(req, new_id(req.chat), now(), self.d.model_id, chunk=True)
        lp = _Logprobs(self.d.tokenizer, req)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        def choice(ev, finish):
            c = {"index": 0, "logprobs": lp.chunk(ev), "finish_reason": finish}
            if req.chat:
                c["delta"] = {"content": ev.text} if ev is not None else {}
            else:
                c["text"] = ev.text if ev is not None else ""
            return c

        n = 0
        try:
            if req.chat:
                await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            ev, cached = first, first.cached_tokens if first is not None else 0
            while ev is not None:
                n += 1
                await send({**head, "choices": [choice(ev, ev.finish_reason)]})
                ev = await anext(events, None)
            if req.include_usage:
                await send({**head, "choices": [], "usage": usage(prompt_tokens, n, cached)})
            await resp.write(b"data: [DONE]\n\n")
        except EngineError as e:
            # The stream has started: report the failure in-band, as OpenAI does.
            await send(ApiError(e.status, str(e)).body())
        finally:
            self.d.metrics.completion_tokens.inc(n)
        await resp.write_eof()
        return resp


class _Logprobs:
    """OpenAI's logprobs objects: chat's ``content`` list or completions' parallel lists."""

    def __init__(self, tokenizer, req: CompletionRequest):
        self.tok = tokenizer
        self.req = req
        self.on = req.params.logprobs
        self.entries: list = []

    def _text(self, token: int) -> str:
        return f"token_id:{token}" if self.req.tokens_as_ids else self.tok.decode([token])

    def _entry(self, ev) -> dict:
        text = self._text(ev.token)
        if self.req.chat:
            return {
                "token": text,
                "logprob": ev.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": self._text(t), "logprob": v, "bytes": list(self._text(t).encode())} for t, v in ev.top_logprobs
                ],
            }
        return {"token": text, "logprob": ev.logprob, "top": {self._text(t): v for t, v in ev.top_logprobs}}

    def add(self, ev) -> None:
        if self.on:
            self.entries.append(self._entry(ev))

    def _shape(self, entries: list) -> dict:
        if self.req.chat:
            return {"content": entries}
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries],
        }

    def whole(self) -> dict | None:
        return self._shape(self.entries) if self.on else None

    def chunk(self, ev) -> dict | None:
        return self._shape([self._entry(ev)]) if self.on and ev is not None else None
