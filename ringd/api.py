"""The HTTP face of a node, with aiohttp: OpenAI endpoints, health, status, control, metrics.

The leader serves ``/v1/*`` through its ``Engine``; a follower forwards them
(``proxy.py``). Every node answers ``/health``, ``/cluster/status`` and
``/metrics`` about itself. Errors have OpenAI's shape and status; a malformed
request is answered and forgotten, and nothing a client sends can take the
node down. A client that goes away mid-stream cancels its request, which frees
its caches on every stage.

Who may do what (``auth.py``): with ``api_keys_file`` set, ``/v1/*`` needs a
key on every node, and ``/cluster/status`` a key or a request signed with the
cluster secret; ``/health`` stays open. Control routes (leader pin, drain)
always need a request signed with the cluster secret, and a request marked as
forwarded by a follower the follower's own proof of it (a client's mark is refused).

Work per request is bounded before it is paid for (``http_guard.py``): a body's
bytes are booked against the node's budget before it is read, it is parsed off
the event loop, its character count is checked against the model's context
before it is tokenized, and tokenizing runs off the loop a few at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from . import logs
from .auth import AuthError, ControlAuth, ForwardAuth, body_sha256, check_api_key, is_signed, sign
from .config import check_name
from .engine import EngineError
from .http_guard import AIOHTTP_LOG, BODY_READ_TIMEOUT_S, HTTP_IDLE_TIMEOUT_S, BodyBudget, listen, raise_fd_limit, undecodable_header
from .openai_types import ApiError, CompletionRequest, envelope, new_id, now, parse_json, parse_request, prompt_chars, usage
from .proxy import FORWARDED_HEADER, REQUEST_ID_HEADER, RESUME_FIELD, TOKEN_COMMENT, Proxy
from .sampling import SamplingError

if TYPE_CHECKING:
    from .engine import Engine
    from .metrics import Metrics
    from .checkpoint import ModelInfo

log = logging.getLogger(__name__)

# A node that stops gives its HTTP handlers this long to finish (their streams have
# been told to end: an error event and data: [DONE] take milliseconds), then cancels
# them. aiohttp's default, 60 s, kept a stopping node alive for as long as a stream ran.
HTTP_SHUTDOWN_GRACE_S = 3.0

# The routes described for clients and for the HTTP fuzz test.
OPENAPI = Path(__file__).with_name("openapi.json")
# The dashboard's page, script and style.
WEB_DIR = Path(__file__).with_name("web")

# Where a request's id is kept on the aiohttp request.
REQUEST_ID_KEY = "ringd_request_id"

# Largest request body: a long chat history is a few MB of JSON; more is abuse.
MAX_BODY_BYTES = 16 * 1024 * 1024
# Bodies parsed and prompts tokenized at once: each is CPU-bound work off the
# event loop that holds a copy of the body (json holds the GIL while it parses),
# so a burst of giant requests waits its turn instead of taking all memory.
MAX_CONCURRENT_PARSES = 2
MAX_CONCURRENT_TOKENIZATIONS = 2
# A resumed stream (a follower carrying it over to a new leader) names at most
# this many tokens already streamed: no stream is longer than a context.
MAX_RESUME_TOKENS = 1 << 20


class ApiNode(Protocol):
    """What the HTTP face needs of its node (``daemon.Daemon`` provides it)."""

    name: str
    model_id: str
    started: int
    info: "ModelInfo"
    tokenizer: object
    secret: bytes
    api_keys: frozenset[str]
    metrics: "Metrics"

    @property
    def engine(self) -> "Engine | None": ...
    @property
    def leading(self) -> bool: ...
    @property
    def drained(self) -> set[str]: ...
    @property
    def leader(self) -> str | None: ...
    def readiness(self) -> tuple[bool, str]: ...
    def local_status(self) -> dict: ...
    async def cluster_status(self) -> dict: ...
    def leader_http(self) -> str | None: ...
    async def leader_changed(self) -> None: ...
    def members(self) -> set[str]: ...
    def set_pin(self, node: str | None) -> dict: ...
    def drain(self, node: str, undo: bool) -> None: ...


def _error(e: ApiError) -> web.Response:
    headers = {"Retry-After": str(e.retry_after or 1)} if e.status in (429, 503) else None
    return web.json_response(e.body(), status=e.status, headers=headers)


# The status counted for a request whose client went away before an answer (nginx's).
CLIENT_CLOSED_STATUS = 499


def _endpoint(request: web.Request) -> str:
    """The route a request matched, as a metric label: few values, whatever the path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _context(metrics) -> Callable:
    """Outermost middleware: the request's id (the client's x-request-id, or a new one) for
    every line logged while serving it, and the request counted by endpoint and status."""

    @web.middleware
    async def context(request: web.Request, handler):
        status = 500
        try:
            given = request.headers.get(REQUEST_ID_HEADER)
            try:
                request_id = logs.check_request_id(given) if given is not None else logs.new_request_id()
            except logs.RequestIdError as e:
                request_id = logs.new_request_id()
                request[REQUEST_ID_KEY] = request_id
                response = _error(ApiError(400, str(e), REQUEST_ID_HEADER.lower()))
                status = response.status
                return response
            request[REQUEST_ID_KEY] = request_id
            token = logs.REQUEST_ID.set(request_id)
            try:
                response = await handler(request)
            finally:
                logs.REQUEST_ID.reset(token)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED_STATUS
            raise
        finally:
            metrics.request(_endpoint(request), status)

    return context


async def _send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer names its request (streams too: this runs as their headers go out)."""
    request_id = request.get(REQUEST_ID_KEY)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        if (bad := undecodable_header(request.headers)) is not None:
            # Named, never echoed: it may be an Authorization header, a key and all.
            raise ApiError(400, f"the {bad} header is not text: it holds a byte that is not UTF-8; send it as ASCII", bad.lower(), "invalid_header")
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except AuthError as e:
        return _error(ApiError(e.status, str(e), code="invalid_api_key" if e.status == 401 else "forbidden", type_="authentication_error"))
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


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary entry.

    A text of n characters cannot encode to fewer than n / this tokens, so a
    prompt whose characters exceed context x this cannot fit, and is refused
    before it is tokenized. (Byte-level BPE entries spell one byte a character,
    which is at least one character of text; special tokens count with theirs.)
    """
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 1 << 16  # unknown tokenizer: the check still stops the absurd


class Api:
    def __init__(self, node: ApiNode):
        self.d = node
        self.app = web.Application(middlewares=[_context(node.metrics), _errors, self._while_stopping], client_max_size=MAX_BODY_BYTES)
        self._stopping = ""  # why this node takes no more requests ("" while it serves)
        self.app.on_response_prepare.append(_send_request_id)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/cluster/status", self.cluster_status),
                web.post("/cluster/leader", self.set_leader),
                web.post("/cluster/drain", self.drain),
                web.get("/metrics", make_aiohttp_handler(node.metrics.registry)),
                web.get("/openapi.json", self.openapi),
                web.get("/", self.dashboard),
                web.get("/dashboard", self.dashboard),
                # The dashboard's own files, served by every node: no CDN, no build step.
                web.static("/static", WEB_DIR, append_version=False, show_index=False, follow_symlinks=False),
            ]
        )
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self.proxy = Proxy(node)
        self.bodies = BodyBudget()
        self._parses = asyncio.Semaphore(MAX_CONCURRENT_PARSES)
        self._tokenizations = asyncio.Semaphore(MAX_CONCURRENT_TOKENIZATIONS)
        self._control: ControlAuth | None = None
        self._forwards: ForwardAuth | None = None
        self._chars_per_token: int | None = None
        # Read once: no file I/O on the event loop per request.
        self._page = (WEB_DIR / "index.html").read_bytes()
        self._openapi = OPENAPI.read_bytes()

    async def start(self, host: str, port: int) -> int:
        raise_fd_limit()
        # handler_cancellation: a client that disconnects cancels its handler at
        # once, which releases its request's caches instead of generating on.
        # keepalive_timeout also bounds how long a new connection may take to
        # send its request (aiohttp arms it when the connection opens).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, keepalive_timeout=HTTP_IDLE_TIMEOUT_S,
            shutdown_timeout=HTTP_SHUTDOWN_GRACE_S,
            # What aiohttp logs of requests its parser refuses: one line, without their bytes.
            logger=AIOHTTP_LOG,
        )  # fmt: skip
        await self._runner.setup()
        self._server, _ = await listen(self._runner, host, port)
        return self._server.sockets[0].getsockname()[1]

    def stop_serving(self, reason: str) -> None:
        """The node is stopping: listen no more, refuse new requests on open connections (503,
        ``reason``), end what this node forwards. What it serves itself the engine ends."""
        self._stopping = reason
        if self._server is not None:
            self._server.close()
        self.proxy.stop(reason)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            # Handlers have HTTP_SHUTDOWN_GRACE_S to write their last words (an error event and
            # data: [DONE]); then they are cancelled.
            await self._runner.cleanup()
        await self.proxy.close()

    @web.middleware
    async def _while_stopping(self, request: web.Request, handler):
        if self._stopping and request.path.startswith(("/v1/", "/cluster/")):
            response = _error(ApiError(503, self._stopping))
            response.force_close()  # no keep-alive: the client's next request goes to another node
            return response
        return await handler(request)

    # --- who may ------------------------------------------------------------------

    def _need_key(self, request: web.Request) -> None:
        check_api_key(request.headers.get("Authorization"), self.d.api_keys)

    async def _need_secret(self, request: web.Request, body: bytes) -> None:
        if self._control is None:
            self._control = ControlAuth(self.d.secret, self.d.name)
        self._control.verify(request.method, request.path_qs, request.headers, body, time.time())

    async def _forwarded_by(self, request: web.Request, body: bytes) -> str | None:
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

    # --- reading a request ------------------------------------------------------------

    async def _read(self, request: web.Request) -> bytes:
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

    async def _json(self, raw: bytes) -> dict:
        async with self._parses:
            return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)

    # --- control --------------------------------------------------------------------

    async def set_leader(self, request: web.Request) -> web.Response:
        """`ringctl leader set NODE` ({"node": NODE}) or `leader auto` ({"node": null})."""
        raw = await self._read(request)
        await self._need_secret(request, raw)
        body = await self._json(raw)
        node = body.get("node")
        if node is not None and not isinstance(node, str):
            raise ApiError(400, 'leader takes {"node": NAME} or {"node": null} for auto', "node")
        known = self.d.members()
        if node is not None and node not in known:
            raise ApiError(400, f"node {node!r:.80} is not a live member; live: {', '.join(sorted(known))}", "node")
        return web.json_response(self.d.set_pin(node))

    async def drain(self, request: web.Request) -> web.Response:
        """`ringctl drain NODE`: the leader plans rings without it ({"undo": true} takes it back)."""
        raw = await self._read(request)
        await self._need_secret(request, raw)
        body = await self._json(raw)
        node, undo = body.get("node"), body.get("undo", False)
        if not isinstance(undo, bool):
            raise ApiError(400, 'drain takes {"node": NAME, "undo": false}', "undo")
        try:
            check_name(node)
        except ValueError as e:
            raise ApiError(400, f"node {node!r:.80} is not a node name: {e}", "node") from None
        if not self.d.leading:
            url, leader = self.d.leader_http(), self.d.leader
            if url is None or leader is None:
                raise ApiError(503, "no leader is elected right now; retry in a moment")
            signed = sign(self.d.secret, request.method, request.path_qs, leader, raw, time.time())
            return await self.proxy.control(request, url, raw, signed)
        if node == self.d.name and not undo:
            raise ApiError(400, f"{node} leads; move leadership first (ringctl leader set OTHER), then drain it", "node")
        try:
            self.d.drain(node, undo)
        except ValueError as e:
            raise ApiError(400, str(e), "node") from None
        return web.json_response({"drained": sorted(self.d.drained)})

    # --- status -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Open to all (load balancers, launchd checks); with API keys set, the node's details
        (addresses, device, memory) only for a caller with a key or the secret."""
        ready, reason = self.d.readiness()
        status = self.d.local_status()
        if self.d.api_keys and not await self._authorized(request):
            status = {k: status.get(k) for k in ("node", "role", "leader", "ready")}
        body = {"status": "ok" if ready else "unavailable", **status, "reason": reason}
        return web.json_response(body, status=200 if ready else 503)

    async def _authorized(self, request: web.Request) -> bool:
        try:
            if is_signed(request.headers):
                await self._need_secret(request, b"")
            else:
                self._need_key(request)
        except AuthError:
            return False
        return True

    async def cluster_status(self, request: web.Request) -> web.Response:
        if self.d.api_keys:  # a key, or a request signed with the cluster secret (ringctl)
            if is_signed(request.headers):
                await self._need_secret(request, b"")
            else:
                self._need_key(request)
        return web.json_response(await self.d.cluster_status())


    async def dashboard(self, request: web.Request) -> web.Response:
        """The page that draws the ring live (ringd/web/); it reads /cluster/status like ringctl does."""
        return web.Response(body=self._page, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        self._need_key(request)
        return web.json_response(
            {"object": "list", "data": [{"id": self.d.model_id, "object": "model", "created": self.d.started, "owned_by": "ringd"}]}
        )

    # --- completions ----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self._need_key(request)
        raw = await self._read(request)
        forwarded = await self._forwarded_by(request, raw) is not None
        body = await self._json(raw)
        engine = self.d.engine
        if engine is None:
            return await self.proxy.forward(request, raw, body.get("stream") is True)
        req = parse_request(body, chat)
        resume = None
        if forwarded and body.get(RESUME_FIELD) is not None:
            if not req.stream:  # followers carry streams over; anything else is sent again whole
                raise ApiError(400, f"{RESUME_FIELD} carries a stream over; this request does not stream", RESUME_FIELD)
            async with self._parses:
                # Up to MAX_RESUME_TOKENS ids, each checked: tens of milliseconds, not on the loop.
                resume = await asyncio.get_running_loop().run_in_executor(None, _resume, body[RESUME_FIELD], self.d.info.vocab_size)
        if req.model != self.d.model_id:
            raise ApiError(404, f"model {req.model!r} is not served here; this ring serves {self.d.model_id!r}", "model", "model_not_found")
        ready, reason = self.d.readiness()
        if not ready:
            raise ApiError(503, f"the ring is not ready: {reason}")
        try:
            req.params.check_vocab(self.d.info.vocab_size)
        except SamplingError as e:
            raise ApiError(400, str(e), e.field) from None
        context = self.d.info.context_length
        where = "messages" if chat else "prompt"
        chars = prompt_chars(req)
        if self._chars_per_token is None:
            self._chars_per_token = max_chars_per_token(self.d.tokenizer)
        if chars > context * self._chars_per_token:
            raise ApiError(
                400,
                f"the prompt is {chars} characters, which cannot fit the model's context of {context} tokens "
                f"(a token here spans at most {self._chars_per_token} characters)",
                where,
                "context_length_exceeded",
            )
        async with self._tokenizations:
            # Templates and tokenizers take milliseconds per long prompt: not on the loop.
            prompt = await asyncio.get_running_loop().run_in_executor(None, self._tokenize, req)
        if len(prompt) >= context:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; the model's context is {context}", where, "context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise ApiError(
                400,
                f"{len(prompt)} prompt tokens + max_tokens {max_tokens} exceed the model's context of {context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        resumed = resume["tokens"] if resume else []
        if len(resumed) >= max_tokens:
            raise ApiError(400, f"{RESUME_FIELD} already holds max_tokens ({max_tokens}) tokens", RESUME_FIELD)
        self.d.metrics.prompt_tokens.inc(len(prompt))
        events = engine.generate(prompt, req.params, max_tokens, req.stop, resumed, request[REQUEST_ID_KEY])
        try:
            if req.stream:
                return await self._stream(request, req, events, len(prompt), forwarded, resume)
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
        try:
            return tok.encode(req.prompt)
        except (UnicodeError, ValueError) as e:
            raise ApiError(400, f"the tokenizer could not encode the prompt: {e}", "prompt") from None

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

    async def _stream(self, request: web.Request, req: CompletionRequest, events, prompt_tokens: int, forwarded: bool, resume: dict | None) -> web.StreamResponse:
        # Pull the first event before answering 200, so a ring that fails at once
        # still gets a proper error status.
        first = await anext(events, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = envelope(req, new_id(req.chat), now(), self.d.model_id, chunk=True)
        if resume is not None:  # the same response, carried over: keep its id
            head.update({k: resume[k] for k in ("id", "created") if resume.get(k) is not None})
        lp = _Logprobs(self.d.tokenizer, req)

        async def send(obj: dict, token: int | None = None) -> None:
            data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
            if forwarded and token is not None:
                # For the follower that proxies this stream: the token's id, so it can
                # carry the stream over to another leader (proxy.py strips the line).
                data = TOKEN_COMMENT + str(token).encode() + b"\n" + data
            await resp.write(data)

        def choice(ev, finish):
            c = {"index": 0, "logprobs": lp.chunk(ev), "finish_reason": finish}
            if req.chat:
                c["delta"] = {"content": ev.text} if ev is not None else {}
            else:
                c["text"] = ev.text if ev is not None else ""
            return c

        n = len(resume["tokens"]) if resume else 0
        try:
            if req.chat and resume is None:
                await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            ev, cached = first, first.cached_tokens if first is not None else 0
            while ev is not None:
                n += 1
                await send({**head, "choices": [choice(ev, ev.finish_reason)]}, ev.token)
                ev = await anext(events, None)
            if req.include_usage:
                await send({**head, "choices": [], "usage": usage(prompt_tokens, n, cached)})
            await resp.write(b"data: [DONE]\n\n")
        except EngineError as e:
            # The stream has started: report the failure in-band, as OpenAI does, and end it properly.
            await send(ApiError(e.status, str(e)).body())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # aiohttp's "Cannot write to closing transport"
            log.debug("the client closed the stream after %d token(s)", n)
            return resp  # the caller's events.aclose() frees the ring
        finally:
            self.d.metrics.completion_tokens.inc(n - (len(resume["tokens"]) if resume else 0))
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client closed once it had data: [DONE], before the last empty chunk: done all the same
        return resp


def _resume(v, vocab_size: int) -> dict | None:
    """A follower's RESUME_FIELD: the ids a stream already carried, and its id and time."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"tokens", "id", "created"}:
        raise ApiError(400, f"{RESUME_FIELD} must hold tokens, id and created", RESUME_FIELD)
    tokens, rid, created = v["tokens"], v["id"], v["created"]
    if not isinstance(tokens, list) or len(tokens) > MAX_RESUME_TOKENS or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"{RESUME_FIELD}.tokens must be token ids below {vocab_size}", RESUME_FIELD)
    if not (rid is None or isinstance(rid, str) and len(rid) <= 64) or not (created is None or type(created) is int):
        raise ApiError(400, f"{RESUME_FIELD}.id must be a short string and created an integer", RESUME_FIELD)
    return v


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
