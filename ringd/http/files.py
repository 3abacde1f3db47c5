"""A holder's side of weights between peers: the model's files, to members of the cluster only.

A node that holds its model whole (a directory or GGUF file of its own, not one
fetched from peers), and a leader the models it loaded on demand from its own model
list, answers, on its HTTP port:

    GET /cluster/files/{fingerprint}/manifest     the manifest (models/peers/manifest.py), signed
                                                  ("any" for a fingerprint: the model it holds)
    GET /cluster/files/{fingerprint}/data/{name}  bytes of one file, a Range at a time

Every request must prove the cluster secret (``auth.FilesAuth``: signed for this
node, fresh, never replayed): anyone else gets a 401 or 403 and no byte. The
manifest is built the first time it is asked for (every byte read and hashed,
off the event loop; meanwhile a 503 with Retry-After) and kept in ringd's cache.
File bytes go out with the kernel's sendfile, MAX_FILE_STREAMS at once: serving
files costs the event loop next to nothing, and the ring's frames go first.

Files travel authenticated and verified (each piece against the signed manifest).
Where the fetcher asks (``SEALED_HEADER``: its ``ring_encryption`` is on) they are
also encrypted, sealed in AES-GCM chunks for that one request (models/peers/sealing.py),
read and sealed off the event loop (no sendfile for sealed bytes); a holder whose own
``ring_encryption`` is on serves nothing in the clear (403: the fetcher is told to
turn its own on).

A fetcher that stops reading holds a stream only so long: each chunk written (in the
clear or sealed) has SEND_STALL_S to leave, or the connection is closed and its
stream slot freed, so a few fetchers that never read cannot keep the others out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from ringd.security.auth import FILES_NONCE_HEADER, FilesAuth, body_sha256, files_body_signature
from ringd.http.errors import ApiError
from ringd.models.peers import manifest as manifests
from ringd.models.peers.manifest import FILES_PREFIX
from ringd.models.peers.sealing import SCHEME, SEAL_CHUNK_BYTES, SEALED_HEADER, Sealer, sealed_length

if TYPE_CHECKING:
    from ringd.base.metrics import Metrics

log = logging.getLogger(__name__)

# File streams served at once: a few fetchers each pulling from several holders. More wait
# for a 503's Retry-After; the kernel's sendfile does the copying, so these cost sockets, not CPU.
MAX_FILE_STREAMS = 4
# Bytes read and written at once where the loop has no sendfile (uvloop): a thread hop per
# few MiB, and no more held in memory per stream.
SEND_CHUNK_BYTES = 4 * 1024 * 1024
# How long one chunk written to a fetcher may take to leave: a fetcher that does not read for
# this long loses its stream. SEND_CHUNK_BYTES in SEND_STALL_S is a floor of ~270 KiB/s per
# stream, a hundredth of what a LAN carries; a fetcher that stalls gives up at its own deadline
# (models/peers/client.py: STALL_S), well before.
SEND_STALL_S = 15.0
# Retry-After while the manifest is being built (reading and hashing every byte of the model).
MANIFEST_RETRY_S = 2


@dataclass(frozen=True)
class Holding:
    """The checkpoint this node serves to its peers."""

    path: Path  # the mlx-lm directory, or the GGUF file
    fingerprint: str
    label: str
    cache_dir: Path  # where the manifest is kept
    sealed: bool = False  # ring_encryption: its bytes go to peers encrypted only


class FilesNode(Protocol):
    name: str
    secret: bytes
    metrics: "Metrics"
    files: Holding | None  # its configured model's (None: it holds none whole)

    def holding(self, fingerprint: str) -> Holding | None:
        """Another model it serves the files of (a leader's model loaded on demand), or None."""
        ...


@dataclass
class _Built:
    """One holding's manifest: built once, when first asked for."""

    manifest: manifests.Manifest | None = None
    signed: bytes | None = None  # the manifest's body as sent
    building: asyncio.Task | None = None


class FileServer:
    def __init__(self, node: FilesNode):
        self.d = node
        self._auth: FilesAuth | None = None
        # By fingerprint: the configured model's, and those of models a leader loaded on demand
        # (a handful: each is a model in the pool, MAX_POOL_INSTANCES at most).
        self._built: dict[str, _Built] = {}
        self._streams = asyncio.Semaphore(MAX_FILE_STREAMS)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(FILES_PREFIX + "/{fingerprint}/manifest", self.manifest),
            web.get(FILES_PREFIX + "/{fingerprint}/data/{name:.+}", self.data),
        ]

    def _check(self, request: web.Request, any_model: bool = False) -> Holding:
        """The holding, once the request proves the secret and names it; else an HTTP error."""
        if self._auth is None:
            self._auth = FilesAuth(self.d.secret, self.d.name)
        fetcher = self._auth.verify(request.method, request.path, request.headers, b"", time.time())  # AuthError: 401, 403
        asked = request.match_info["fingerprint"]
        holding = self.d.files
        if holding is None or asked != holding.fingerprint and not (any_model and asked == "any"):
            holding = self.d.holding(asked)
        if holding is None:
            raise ApiError(404, f"node {self.d.name} serves no files of model {asked!r:.80}", code="not_found")
        log.debug("%s asks for %s", fetcher, request.path)
        return holding

    async def manifest(self, request: web.Request) -> web.Response:
        holding = self._check(request, any_model=True)
        built = self._built.setdefault(holding.fingerprint, _Built())
        if built.signed is None:
            if built.building is None:
                built.building = asyncio.ensure_future(self._build(holding, built))
            if not built.building.done():
                raise ApiError(503, "the holder is reading and hashing the model's files for its manifest; retry shortly", retry_after=MANIFEST_RETRY_S)
            if built.building.exception() is not None:
                built.building = None  # tried again by the next request
                raise ApiError(500, "the holder could not build its manifest; its log says why")
        body = built.signed
        signature = files_body_signature(self.d.secret, request.headers[FILES_NONCE_HEADER], body_sha256(body))
        return web.Response(body=body, content_type="application/json", headers={"X-Ringd-Files-Body-Signature": signature})

    async def _build(self, holding: Holding, state: _Built) -> None:
        import json

        started = time.monotonic()
        log.info("building the manifest of %s (reading and hashing every file) for a peer", holding.label)
        try:
            built = await asyncio.to_thread(manifests.cached, holding.path, holding.fingerprint, holding.label, holding.cache_dir)
        except Exception:
            log.exception("could not build the manifest of %s", holding.path)
            raise
        state.manifest = built
        state.signed = json.dumps(built.to_wire(), separators=(",", ":")).encode()
        log.info("manifest of %s ready: %d files, %.1f GB, in %.1f s", holding.label, len(built.files), built.total_bytes / 1e9, time.monotonic() - started)

    async def data(self, request: web.Request) -> web.StreamResponse:
        holding = self._check(request)
        built = self._built.setdefault(holding.fingerprint, _Built())
        if built.manifest is None:
            if built.building is None or built.building.done():
                built.building = asyncio.ensure_future(self._build(holding, built))
            raise ApiError(503, "the holder is reading and hashing the model's files for its manifest; retry shortly", retry_after=MANIFEST_RETRY_S)
        name = request.match_info["name"]
        try:
            entry = built.manifest.file(name)
        except manifests.ManifestError:
            raise ApiError(404, f"the model has no file {name!r:.80}", code="not_found") from None
        try:
            rng = request.http_range
        except ValueError:
            rng = slice(None, None)
        if rng.start is None or rng.stop is None or not 0 <= rng.start < rng.stop <= entry.size:
            raise ApiError(416, f"ask for one Range inside {name}'s {entry.size} bytes (bytes=START-END)", "Range")
        if self._streams.locked():
            raise ApiError(503, f"{MAX_FILE_STREAMS} file streams are being served; retry shortly", retry_after=1)
        sealed = request.headers.get(SEALED_HEADER)
        if sealed is not None and sealed != SCHEME:
            raise ApiError(400, f"{SEALED_HEADER}: this holder seals with {SCHEME}, not {sealed!r:.40}", SEALED_HEADER)
        if holding.sealed and sealed is None:
            raise ApiError(403, f"node {self.d.name} has ring_encryption on and sends a model's bytes encrypted only; turn ring_encryption on on the fetching node too", code="forbidden")
        base = holding.path.parent if holding.path.is_file() else holding.path
        async with self._streams:
            start, count = rng.start, rng.stop - rng.start
            headers = {"Content-Type": "application/octet-stream", "Content-Range": f"bytes {start}-{rng.stop - 1}/{entry.size}"}
            headers["Content-Length"] = str(sealed_length(count) if sealed else count)
            if sealed:
                headers[SEALED_HEADER] = SCHEME
            response = web.StreamResponse(status=206, headers=headers)
            f = await asyncio.to_thread(open, base / entry.name, "rb")
            try:
                await response.prepare(request)
                if sealed:
                    sealer = Sealer(self.d.secret, request.headers[FILES_NONCE_HEADER], request.path, start, count)
                    await self._send_sealed(response, f.fileno(), start, count, sealer)
                else:
                    await self._send(request, response, f, start, count)
                async with asyncio.timeout(SEND_STALL_S):  # what is still buffered, drained too
                    await response.write_eof()
            except (ConnectionError, TimeoutError) as e:  # the fetcher hung up (a bad piece, it stopped) or stopped reading
                if isinstance(e, TimeoutError):
                    log.warning("%s: a fetcher read nothing of %s for %.0f s; its stream is closed", self.d.name, request.path, SEND_STALL_S)
                else:
                    log.debug("%s: the fetcher hung up during %s", self.d.name, request.path)
                if request.transport is not None:
                    request.transport.abort()
                return response
            finally:
                f.close()
            self.d.metrics.files_served.inc(count)
            return response

    async def _send(self, request: web.Request, response: web.StreamResponse, f, start: int, count: int) -> None:
        """Bytes [start, start + count) of ``f`` in the clear, SEND_CHUNK_BYTES at a time, each within
        SEND_STALL_S: the kernel's sendfile where the loop has it, else read off the loop."""
        loop, native = asyncio.get_running_loop(), True
        for at in range(start, start + count, SEND_CHUNK_BYTES):
            n = min(SEND_CHUNK_BYTES, start + count - at)
            async with asyncio.timeout(SEND_STALL_S):
                if native:
                    try:
                        await loop.sendfile(request.transport, f, at, n)
                        continue
                    except NotImplementedError:  # uvloop has none: chunks read off the loop, written on it
                        native = False
                await response.write(await asyncio.to_thread(os.pread, f.fileno(), n, at))

    async def _send_sealed(self, response: web.StreamResponse, fd: int, start: int, count: int, sealer: Sealer) -> None:
        """The same bytes sealed, SEAL_CHUNK_BYTES a chunk: each read and sealed off the loop, and
        written within SEND_STALL_S."""

        def read_and_seal(index: int) -> bytes:
            at = start + index * SEAL_CHUNK_BYTES
            return sealer.seal(index, os.pread(fd, min(SEAL_CHUNK_BYTES, start + count - at), at))

        for index in range(-(-count // SEAL_CHUNK_BYTES)):
            chunk = await asyncio.to_thread(read_and_seal, index)
            async with asyncio.timeout(SEND_STALL_S):
                await response.write(chunk)
