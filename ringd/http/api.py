"""The HTTP face of a node, with aiohttp: the routes and the app, health, status, control, metrics.

Which route runs what: each route that generates runs the endpoint driver
(``endpoint.py``: the one request lifecycle) with its API's translation
(``openai_api.py``, ``responses_api.py``, ``anthropic_api.py``,
``ollama_api.py``); the leader serves them through its ``Engine``, a follower
forwards them (``proxy.py``). Every node answers ``/health``, ``/cluster/status``,
``/metrics`` and the model list (``/v1/models``, ``/api/tags``, ``/cluster/models``:
``models_list.py``) about itself. Errors have each API's own shape and status
(``ERROR_SHAPES``); a malformed request is answered and forgotten, and nothing
a client sends can take the node down. A client that goes away mid-stream
cancels its request, which frees its caches on every stage.

Who may do what (``auth.py``): with ``api_keys_file`` set, ``/v1/*`` needs a
key on every node, and ``/cluster/status`` a key or a request signed with the
cluster secret; ``/health`` stays open. Control routes (leader pin, drain)
always need a request signed with the cluster secret, and a request marked as
forwarded by a follower the follower's own proof of it (a client's mark is refused).

Work per request is bounded before it is paid for (``http/guard.py``,
``intake.py``): a body's bytes are booked against the node's budget before it is
read, it is parsed off the event loop, its character count is checked against
the model's context before it is tokenized, and tokenizing runs off the loop a
few at a time (``serving.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from ringd.base import logs
from ringd.security.auth import AuthError, ControlAuth, is_signed, sign
from ringd.http import anthropic_api, embeddings, models_list, ollama_api, openai_api, responses_api
from ringd.http.endpoint import Endpoint
from ringd.http.errors import ApiError
from ringd.http.fields import MAX_MODEL_CHARS, keep_alive_field
from ringd.leader.errors import EngineError
from ringd.models.naming import same_model
from ringd.http.files import FileServer
from ringd.http.bodies import MAX_BODY_BYTES
from ringd.http.guard import AIOHTTP_LOG, HTTP_IDLE_TIMEOUT_S, ConnectionCap, listen, raise_fd_limit, undecodable_header
from ringd.http.intake import REQUEST_ID_KEY, Intake
from ringd.http.proxy import REQUEST_ID_HEADER, Proxy
from ringd.http.serving import Serving
from ringd.http.tlslisten import TlsListener, bind
from ringd.base.names import check_name
from ringd.ring.sampling import brief_repr
from ringd.base.tasks import Supervisor

if TYPE_CHECKING:
    from ringd.http.node import ApiNode

log = logging.getLogger(__name__)

# A node that stops gives its HTTP handlers this long to finish (their streams have
# been told to end: an error event and data: [DONE] take milliseconds), then cancels
# them. aiohttp's default, 60 s, kept a stopping node alive for as long as a stream ran.
HTTP_SHUTDOWN_GRACE_S = 3.0

# The routes described for clients and for the HTTP fuzz test.
OPENAPI = Path(__file__).with_name("openapi.json")
# The dashboard's page, script and style.
WEB_DIR = Path(__file__).with_name("web")

# Each API's own error shape, by path prefix; OpenAI's (Responses' too) for the rest.
ERROR_SHAPES: list[tuple[str, Callable[[ApiError], dict]]] = [
    ("/v1/messages", anthropic_api.error_body),
    ("/api/", ollama_api.error_body),
]
# Routes OpenAI's and Anthropic's clients share: the header Anthropic's SDKs send says whose.
SHARED_PREFIX = "/v1/models"
ANTHROPIC_HEADER = "anthropic-version"


def _error(e: ApiError, request: web.Request) -> web.Response:
    headers = {"Retry-After": str(e.retry_after or 1)} if e.status in (429, 503) else None
    path = request.path
    if path.startswith(SHARED_PREFIX) and ANTHROPIC_HEADER in request.headers:
        shape = anthropic_api.error_body
    else:
        shape = next((f for prefix, f in ERROR_SHAPES if path.startswith(prefix)), ApiError.body)
    return web.json_response(shape(e), status=e.status, headers=headers)


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
                response = _error(ApiError(400, str(e), REQUEST_ID_HEADER.lower()), request)
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
async def error_answers(request: web.Request, handler):
    """Every refusal answered in its API's shape (``ERROR_SHAPES``); anything unforeseen a 500 and a logged traceback."""
    try:
        if (bad := undecodable_header(request.headers)) is not None:
            # Named, never echoed: it may be an Authorization header, a key and all.
            raise ApiError(400, f"the {bad} header is not text: it holds a byte that is not UTF-8; send it as ASCII", bad.lower(), "invalid_header")
        return await handler(request)
    except ApiError as e:
        return _error(e, request)
    except AuthError as e:
        return _error(ApiError(e.status, str(e), code="invalid_api_key" if e.status == 401 else "forbidden", type_="authentication_error"), request)
    except web.HTTPRequestEntityTooLarge:
        return _error(ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes"), request)
    except web.HTTPException as e:
        if e.status == 404:
            return _error(ApiError(404, f"no route {request.method} {request.path}", code="not_found"), request)
        if e.status == 405:
            return _error(ApiError(405, f"{request.method} is not allowed on {request.path}", type_="invalid_request_error"), request)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error(ApiError(500, "internal error; the node's log has the details"), request)


class Api:
    def __init__(self, node: "ApiNode"):
        self.d = node
        self.app = web.Application(middlewares=[_context(node.metrics), error_answers, self._while_stopping], client_max_size=MAX_BODY_BYTES)
        self._stopping = ""  # why this node takes no more requests ("" while it serves)
        self.app.on_response_prepare.append(_send_request_id)
        self.proxy = Proxy(node)
        self.intake = Intake(node)
        self.serving = Serving(node)
        # Each route that generates: the one lifecycle, with its API's translation.
        endpoint = Endpoint(node, self.intake, self.serving, self.proxy)
        generating, counting, embedding = endpoint.generating, endpoint.counting, endpoint.embedding
        ollama = ollama_api.Models(node, self.intake, self.proxy.forward)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", generating(openai_api.Completions(chat=True))),
                web.post("/v1/completions", generating(openai_api.Completions(chat=False))),
                web.post("/v1/responses", generating(responses_api.Responses())),
                web.post("/v1/messages", generating(anthropic_api.Messages())),
                web.post("/v1/messages/count_tokens", counting(anthropic_api.CountTokens())),
                web.post("/api/chat", generating(ollama_api.Generate(node, chat=True))),
                web.post("/api/generate", generating(ollama_api.Generate(node, chat=False))),
                web.post("/v1/embeddings", embedding(embeddings.OpenAIEmbeddings())),
                web.post("/api/embed", embedding(embeddings.OllamaEmbed())),
                web.post("/api/embeddings", embedding(embeddings.OllamaEmbed(legacy=True))),
                web.get("/api/tags", ollama.tags),
                web.post("/api/show", ollama.show),
                web.get("/api/ps", ollama.ps),
                web.post("/api/pull", ollama.pull),
                web.get("/api/version", ollama.version),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.get("/health", self.health),
                web.get("/cluster/status", self.cluster_status),
                web.get("/cluster/models", self.cluster_models),
                web.post("/cluster/leader", self.set_leader),
                web.post("/cluster/drain", self.drain),
                web.post("/cluster/load", self.load),
                web.post("/cluster/unload", self.unload),
                *FileServer(node).routes(),
                web.get("/metrics", make_aiohttp_handler(node.metrics.registry)),
                web.get("/openapi.json", self.openapi),
                web.get("/", self.dashboard),
                web.get("/dashboard", self.dashboard),
                # The dashboard's own files, served by every node: no CDN, no build step.
                web.static("/static", WEB_DIR, append_version=False, show_index=False, follow_symlinks=False),
            ]
        )
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | TlsListener | None = None
        self._accepting: asyncio.Task | None = None  # an HTTPS listener's accept loop
        self._control: ControlAuth | None = None
        # Read once: no file I/O on the event loop per request.
        self._page = (WEB_DIR / "index.html").read_bytes()
        self._openapi = OPENAPI.read_bytes()

    async def start(
        self, host: str, port: int, sock: socket.socket | None = None,
        tls: ssl.SSLContext | None = None, supervisor: Supervisor | None = None, trust: str = "",
    ) -> int:
        """Serve on host:port (or ``sock``, handed down); with ``tls``, HTTPS only, its accept loop
        run by ``supervisor``, and ``trust`` (how a client trusts the certificate) in the 400 that
        plain HTTP gets."""
        raise_fd_limit()
        # handler_cancellation: a client that disconnects cancels its handler at
        # once, which releases its request's caches instead of generating on.
        # keepalive_timeout also bounds how long a new connection may take to
        # send its request (aiohttp arms it when the connection opens).
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, keepalive_timeout=HTTP_IDLE_TIMEOUT_S,
            shutdown_timeout=HTTP_SHUTDOWN_GRACE_S,
            # Bodies are inflated by intake (bodies.py), bounded and off the loop; aiohttp's own
            # inflating runs on the loop as the bytes arrive, without a bound.
            auto_decompress=False,
            # What aiohttp logs of requests its parser refuses: one line, without their bytes.
            logger=AIOHTTP_LOG,
        )  # fmt: skip
        await self._runner.setup()
        if tls is None:
            self._server, _ = await listen(self._runner, host, port, sock=sock)
        else:
            listener = TlsListener(sock if sock is not None else bind(host, port), tls, ConnectionCap(self._runner.server), trust)
            self._server = listener
            self._accepting = (supervisor or Supervisor(log)).forever("https accept", listener.accept_loop)
        return self._server.sockets[0].getsockname()[1]

    def stop_serving(self, reason: str) -> None:
        """The node is stopping: listen no more, refuse new requests on open connections (503,
        ``reason``), end what this node forwards. What it serves itself the engine ends."""
        self._stopping = reason
        self._close_listener()
        self.proxy.stop(reason)

    def _close_listener(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        self._close_listener()
        if self._runner is not None:
            # Handlers have HTTP_SHUTDOWN_GRACE_S to write their last words (an error event and
            # data: [DONE]); then they are cancelled.
            await self._runner.cleanup()
        await self.proxy.close()

    @web.middleware
    async def _while_stopping(self, request: web.Request, handler):
        if self._stopping and request.path.startswith(("/v1/", "/api/", "/cluster/")):
            response = _error(ApiError(503, self._stopping), request)
            response.force_close()  # no keep-alive: the client's next request goes to another node
            return response
        return await handler(request)

    # --- who may ------------------------------------------------------------------

    async def _need_secret(self, request: web.Request, body: bytes) -> None:
        if self._control is None:
            self._control = ControlAuth(self.d.secret, self.d.name)
        self._control.verify(request.method, request.path_qs, request.headers, body, time.time())

    async def _control_body(self, request: web.Request) -> tuple[bytes, dict]:
        """A control request's body, as bytes and JSON, once its signature with the secret holds."""
        raw = await self.intake.read(request)
        await self._need_secret(request, raw)
        return raw, await self.intake.json(raw)

    async def _to_leader(self, request: web.Request, raw: bytes) -> web.Response:
        """A control request for the leader, sent on once with this node's own signature."""
        url, leader = self.d.leader_http(), self.d.leader
        if url is None or leader is None:
            raise ApiError(503, "no leader is elected right now; retry in a moment")
        signed = sign(self.d.secret, request.method, request.path_qs, leader, raw, time.time())
        return await self.proxy.control(request, url, raw, signed)

    # --- control --------------------------------------------------------------------

    async def set_leader(self, request: web.Request) -> web.Response:
        """`ringctl leader set NODE` ({"node": NODE}) or `leader auto` ({"node": null})."""
        _, body = await self._control_body(request)
        node = body.get("node")
        if node is not None and not isinstance(node, str):
            raise ApiError(400, 'leader takes {"node": NAME} or {"node": null} for auto', "node")
        known = self.d.members()
        if node is not None and node not in known:
            raise ApiError(400, f"node {node!r:.80} is not a live member; live: {', '.join(sorted(known))}", "node")
        return web.json_response(self.d.set_pin(node))

    async def drain(self, request: web.Request) -> web.Response:
        """`ringctl drain NODE`: the leader plans rings without it ({"undo": true} takes it back)."""
        raw, body = await self._control_body(request)
        node, undo = body.get("node"), body.get("undo", False)
        if not isinstance(undo, bool):
            raise ApiError(400, 'drain takes {"node": NAME, "undo": false}', "undo")
        try:
            check_name(node)
        except ValueError as e:
            raise ApiError(400, f"node {node!r:.80} is not a node name: {e}", "node") from None
        if not self.d.leading:
            return await self._to_leader(request, raw)
        if node == self.d.name and not undo:
            raise ApiError(400, f"{node} leads; move leadership first (ringctl leader set OTHER), then drain it", "node")
        try:
            self.d.drain(node, undo)
        except ValueError as e:
            raise ApiError(400, str(e), "node") from None
        return web.json_response({"drained": sorted(self.d.drained)})

    async def load(self, request: web.Request) -> web.Response:
        """`ringctl load MODEL [--replicas N] [--keep-alive D]`: the leader loads it (N instances),
        answering once one serves."""
        raw, body = await self._control_body(request)
        model, replicas = body.get("model"), body.get("replicas", 1)
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
            raise ApiError(400, 'load takes {"model": NAME, "replicas": 1, "keep_alive": "5m"}', "model")
        if type(replicas) is not int:
            raise ApiError(400, "replicas must be an integer", "replicas")
        keep_alive = keep_alive_field(body)
        if not self.d.leading:
            return await self._to_leader(request, raw)
        try:
            await self.d.load(model, replicas, keep_alive)
        except EngineError as e:
            raise ApiError(e.status, str(e), "model" if e.status in (400, 404) else None) from None
        return web.json_response({"instances": self.d.instances()})

    async def unload(self, request: web.Request) -> web.Response:
        """`ringctl unload MODEL`: every instance of it goes, now if idle, else once its requests
        end (never the configured model)."""
        raw, body = await self._control_body(request)
        model = body.get("model")
        if not isinstance(model, str) or not model or len(model) > MAX_MODEL_CHARS:
            raise ApiError(400, 'unload takes {"model": NAME}', "model")
        if not self.d.leading:
            return await self._to_leader(request, raw)
        return web.json_response({"unloaded": self.d.unload(model), "instances": self.d.instances()})

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
                self.intake.need_key(request)
        except AuthError:
            return False
        return True

    async def cluster_status(self, request: web.Request) -> web.Response:
        if self.d.api_keys:  # a key, or a request signed with the cluster secret (ringctl)
            if is_signed(request.headers):
                await self._need_secret(request, b"")
            else:
                self.intake.need_key(request)
        return web.json_response(await self.d.cluster_status())

    async def cluster_models(self, request: web.Request) -> web.Response:
        """The model list with every fact, paths too (``ringctl models``); guarded as /cluster/status."""
        if self.d.api_keys:
            if is_signed(request.headers):
                await self._need_secret(request, b"")
            else:
                self.intake.need_key(request)
        rows, truncated = await models_list.rows(self.d)
        return web.json_response({"node": self.d.name, "models": rows, "truncated": truncated})

    async def dashboard(self, request: web.Request) -> web.Response:
        """The page that draws the ring live (ringd/http/web/); it reads /cluster/status like ringctl does."""
        return web.Response(body=self._page, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        """Every model the node could serve (``models_list.py``), the loaded one first."""
        self.intake.need_key(request)
        rows, truncated = await models_list.rows(self.d)
        data = [models_list.openai_model(rows[0], self.d.started), *map(models_list.openai_model, rows[1:])]
        # has_more: the model list stopped short (MAX_MODELS, or the scan's bound): more files are on disk.
        return web.json_response({"object": "list", "data": data, "has_more": truncated, "first_id": data[0]["id"], "last_id": data[-1]["id"]})

    async def model(self, request: web.Request) -> web.Response:
        self.intake.need_key(request)
        asked = request.match_info["model"]
        rows, _ = await models_list.rows(self.d)
        if asked == self.d.model_id:
            return web.json_response(models_list.openai_model(rows[0], self.d.started))
        # Any other model of the list (loaded or not: a request naming it loads it), by its name there
        # (Ollama's NAME:latest too).
        row = next((r for r in rows[1:] if same_model(r["name"], asked)), None)
        if row is None:
            raise ApiError(404, f"model {brief_repr(asked)} is not in the model list (GET /v1/models lists it)", "model", "model_not_found")
        return web.json_response(models_list.openai_model(row))
