"""Holders that lie, for a real `ringd serve --model-from-peers` to fetch from.

Each holder is a node of the cluster as a probe sees it (a ring port that completes the
handshake with the cluster secret and answers with an INFO saying it serves files, where
its HTTP API is, and which model), in front of ringd's own file routes for the model
(tests/kit/fileholder.py). An honest one's INFO points at its routes; a liar's at a proxy that
passes each request on to them and lies as its script says:

    ("manifest" | "data", "503 VALUE")  answer that request with a 503 and Retry-After: VALUE
    ("data", "stall")                   send the head and the body's first byte, then nothing

one line of the script for each such request in turn; past the script, it passes
everything through. Everything runs on an event loop of its own, in a thread.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

from wire import stream as wire_stream

from devkit.fileholder import SECRET, holder


class LiarHolders:
    def __init__(self, model: Path, cache: Path, cluster: str, nodes: dict[str, list[tuple[str, str]] | None]):
        """``nodes``: each holder's name and its script (None: honest)."""
        self.model, self.cache, self.cluster, self.nodes = model, cache, cluster, nodes
        self.ring_ports: dict[str, int] = {}
        self.lies: list[tuple[str, str, str]] = []  # (node, request kind, what it did), as done
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "LiarHolders":
        self.thread.start()
        self._stop = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self):
        import contextlib

        stack = contextlib.AsyncExitStack()
        stopping = asyncio.Event()
        session = await stack.enter_async_context(aiohttp.ClientSession(auto_decompress=False))
        for name, script in self.nodes.items():
            h, _ = await stack.enter_async_context(holder(name, self.model, self.cache))
            http = h.http if script is None else await self._liar(stack, session, name, h.http, list(script), stopping)
            info = {"files": True, "http": http, "model": h.model}

            async def hang_up(stream):  # a probe reads the INFO and goes; a link is not kept
                stream.close()

            server = await wire_stream.serve("127.0.0.1", 0, hang_up, secret=SECRET, node_id=name, cluster=self.cluster, info=info)
            self.ring_ports[name] = server.sockets[0].getsockname()[1]
            stack.push_async_callback(server.wait_closed)
            stack.callback(server.close)

        async def stop():
            stopping.set()
            await stack.aclose()

        return stop

    async def _liar(self, stack, session: aiohttp.ClientSession, name: str, target: str, script: list, stopping: asyncio.Event) -> str:
        async def handle(request: web.Request) -> web.StreamResponse:
            kind = "manifest" if request.path.endswith("/manifest") else "data"
            lie = next((s for s in script if s[0] == kind), None)
            if lie is not None:
                script.remove(lie)
                self.lies.append((name, kind, lie[1]))
                if lie[1].startswith("503 "):
                    return web.Response(status=503, text="busy", headers={"Retry-After": lie[1][4:]})
            headers = {k: v for k, v in request.headers.items() if k.lower().startswith("x-ringd") or k.lower() == "range"}
            async with session.get(f"http://{target}{request.path}", headers=headers) as r:
                out = web.StreamResponse(status=r.status, headers={k: v for k, v in r.headers.items() if k.lower() not in ("transfer-encoding", "connection")})
                await out.prepare(request)
                if lie is not None and lie[1] == "stall":
                    await out.write(await r.content.readexactly(1))
                    await stopping.wait()  # the head and a byte, then nothing until the test ends
                    return out
                try:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        await out.write(chunk)
                    await out.write_eof()
                except ConnectionError:  # the fetcher hung up (it stopped, or dropped this holder)
                    pass
                return out

        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stack.push_async_callback(runner.cleanup)
        return f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
