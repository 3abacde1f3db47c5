"""A holder of a model's files for tests: ringd's own file routes (http/files.py), served by
aiohttp on a loopback port, as a daemon that holds the model serves them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from ringd.http.api import error_answers
from ringd.http.files import FileServer, Holding
from ringd.base.metrics import Metrics
from ringd.models.peers import Holder
from ringd.models.source import model_info
from ringd.security.tls import TlsSettings, server_context

SECRET = b"s" * 32
CLUSTER = "ringd"
# What a node of this cluster with ``tls: auto`` serves and trusts.
TLS = TlsSettings("auto", CLUSTER, SECRET)


@dataclass
class HolderNode:
    name: str
    secret: bytes
    metrics: Metrics
    files: Holding | None

    def holding(self, fingerprint: str) -> Holding | None:
        return None  # one model's files only


@contextlib.asynccontextmanager
async def holder(name: str, path: Path, cache: Path, fingerprint: str | None = None, sealed: bool = False, tls: bool = False):
    """ringd's file routes for the model at ``path`` (served as ``fingerprint``, if given; sealed only,
    as with ring_encryption, if ``sealed``; over https with a certificate of the cluster CA of
    SECRET and CLUSTER, as with ``tls: auto``, if ``tls``), on a loopback port: (Holder, its node)."""
    info = model_info(str(path))
    fingerprint = fingerprint or info.fingerprint
    node = HolderNode(name, SECRET, Metrics(name), Holding(info.path, fingerprint, info.name, cache, sealed=sealed))
    app = web.Application(middlewares=[error_answers])
    app.add_routes(FileServer(node).routes())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ssl = server_context(TLS, name, "localhost", ["127.0.0.1"]) if tls else None
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield Holder(name, f"127.0.0.1:{port}", fingerprint, https=tls), node
    finally:
        await runner.cleanup()
