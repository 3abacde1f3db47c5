"""A holder of a model's files for tests: ringd's own file routes (http/files.py), served by
aiohttp on a loopback port, as a daemon that holds the model serves them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from ringd.http.api import error_answers
from ringd.http.files import FileServer, Holding
from ringd.metrics import Metrics
from ringd.models.peers import Holder
from ringd.models.source import model_info

SECRET = b"s" * 32


@dataclass
class HolderNode:
    name: str
    secret: bytes
    metrics: Metrics
    files: Holding | None


@contextlib.asynccontextmanager
async def holder(name: str, path: Path, cache: Path, fingerprint: str | None = None, sealed: bool = False):
    """ringd's file routes for the model at ``path`` (served as ``fingerprint``, if given; sealed only,
    as with ring_encryption, if ``sealed``), on a loopback port: (Holder, its node)."""
    info = model_info(str(path))
    fingerprint = fingerprint or info.fingerprint
    node = HolderNode(name, SECRET, Metrics(name), Holding(info.path, fingerprint, info.name, cache, sealed=sealed))
    app = web.Application(middlewares=[error_answers])
    app.add_routes(FileServer(node).routes())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield Holder(name, f"127.0.0.1:{port}", fingerprint), node
    finally:
        await runner.cleanup()
