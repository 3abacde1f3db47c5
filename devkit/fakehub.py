"""A Hugging Face Hub on 127.0.0.1 serving model directories, as huggingface_hub 2.4 talks to the real one.

There is no internet here, and a download's progress is what is under test, so
this answers the requests huggingface_hub's ``snapshot_download`` and
``hf_hub_download`` make (read from its ``hf_api.py``, ``file_download.py`` and
``_snapshot_download.py``), with the headers they read:

- ``GET /api/models/{owner}/{name}/revision/{rev}``: the repo's info: ``id``,
  ``sha`` (the commit every file is served at), ``siblings``.
- ``GET /api/models/{owner}/{name}/tree/{rev}``: every file (one page, no
  ``Link`` header): ``type``, ``path``, ``size``, ``oid`` (the git blob sha1), and
  for weight files ``lfs`` (sha256, size, pointer size).
- ``HEAD``/``GET /{owner}/{name}/resolve/{rev}/{file}``: a small file is answered
  in place with ``ETag`` (its blob sha1), ``X-Repo-Commit`` and
  ``Content-Length``; a weight file (LFS) as the Hub answers it: a 302 to a CDN on
  another origin (here another port; huggingface_hub then stops following and
  reads the metadata off the redirect) with ``X-Linked-Etag`` (its sha256),
  ``X-Linked-Size`` and ``X-Repo-Commit``. The "CDN" serves the bytes, in chunks
  of ``chunk_bytes`` with ``delay_s`` between them when a test wants a download
  that takes a moment.
- Unknown repo, revision or file: 404 with the ``X-Error-Code`` the Hub sends.

Not served: xet (no ``X-Xet-Hash`` header, so huggingface_hub downloads over plain
HTTP as it does for any non-xet repo), tokens, pagination. Every request is
recorded (method, path) so a test can tell what was fetched.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

from aiohttp import web

# Files the Hub stores in LFS (served through the CDN redirect), as a repo's .gitattributes says.
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
# The "CDN" answers in chunks of this size by default: huggingface_hub reads in 10 MiB
# chunks, so a file of several chunks gives several progress updates.
CHUNK_BYTES = 64 * 1024


class _File:
    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        data = path.read_bytes()
        self.size = len(data)
        self.sha1 = hashlib.sha1(b"blob %d\0" % self.size + data).hexdigest()  # git's blob id
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.lfs = name.endswith(LFS_SUFFIXES)


class _Repo:
    def __init__(self, repo_id: str, directory: Path):
        self.id = repo_id
        self.files = {
            p.relative_to(directory).as_posix(): _File(p, p.relative_to(directory).as_posix())
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
        # A commit id that changes with any file, as a real one does.
        self.sha = hashlib.sha1("".join(f"{n}:{f.sha1}" for n, f in self.files.items()).encode()).hexdigest()


class FakeHub:
    """``with FakeHub({"owner/name": model_dir}) as hub:``, then a process with ``hub.env(home)``.

    huggingface_hub reads its endpoint and cache folders from the environment when it is
    imported, so the client runs in a process of its own, as a node does.
    """

    def __init__(self, repos: dict[str, Path], chunk_bytes: int = CHUNK_BYTES, delay_s: float = 0.0):
        self.repos = {rid: _Repo(rid, Path(d)) for rid, d in repos.items()}
        self.chunk_bytes, self.delay_s = chunk_bytes, delay_s
        self.requests: list[tuple[str, str]] = []  # (method, path), as they came
        self.url = self.cdn_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fakehub", daemon=True)
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/models/{owner}/{name}/revision/{revision}", self._info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{revision}", self._tree)
        app.router.add_route("HEAD", "/{owner}/{name}/resolve/{revision}/{file:.+}", self._resolve)
        app.router.add_get("/{owner}/{name}/resolve/{revision}/{file:.+}", self._resolve, allow_head=False)
        app.router.add_get("/cdn/{owner}/{name}/{sha256}", self._cdn)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        hub, cdn = web.TCPSite(self._runner, "127.0.0.1", 0), web.TCPSite(self._runner, "127.0.0.1", 0)
        await hub.start()
        await cdn.start()
        self.url = f"http://127.0.0.1:{hub._server.sockets[0].getsockname()[1]}"
        self.cdn_url = f"http://127.0.0.1:{cdn._server.sockets[0].getsockname()[1]}"

    def env(self, home: Path) -> dict[str, str]:
        """This process's environment for a process that uses this hub (and a cache in ``home``),
        as a user sets it: HF_ENDPOINT, HF_HOME, HF_HUB_CACHE; no offline mode, token or mirror."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
        return env | {"HF_ENDPOINT": self.url, "HF_HOME": str(home), "HF_HUB_CACHE": str(Path(home) / "hub")}

    def fetched(self) -> list[str]:
        """The files whose bytes were served (GET of a small file, or of a weight file from the CDN)."""
        out = []
        for method, path in self.requests:
            parts = path.split("/")
            if method == "GET" and len(parts) > 5 and parts[3] == "resolve":
                out.append("/".join(parts[5:]))
            elif method == "GET" and parts[1:2] == ["cdn"]:
                repo = self.repos.get(f"{parts[2]}/{parts[3]}")
                out += [n for n, f in (repo.files.items() if repo else ()) if f.sha256 == parts[4]]
        return out

    # ------------------------------------------------------------- handlers

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))
        return await handler(request)

    def _repo(self, request: web.Request) -> _Repo:
        repo = self.repos.get(f"{request.match_info['owner']}/{request.match_info['name']}")
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        if request.match_info.get("revision", "main") not in ("main", repo.sha):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="Invalid rev id")
        return repo

    async def _info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        return web.json_response({"id": repo.id, "sha": repo.sha, "siblings": [{"rfilename": n} for n in repo.files]})

    async def _tree(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        entries = []
        for name, f in repo.files.items():
            entry = {"type": "file", "path": name, "size": f.size, "oid": f.sha1}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        f = repo.files.get(request.match_info["file"])
        if f is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha}, text="Entry not found")
        if f.lfs:
            location = f"{self.cdn_url}/cdn/{repo.id}/{f.sha256}"
            headers = {"Location": location, "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size), "X-Repo-Commit": repo.sha}
            return web.Response(status=302, headers=headers)
        # To a HEAD, aiohttp sends the headers of this answer (Content-Length too) without the body.
        return web.Response(body=f.path.read_bytes(), headers={"ETag": f'"{f.sha1}"', "X-Repo-Commit": repo.sha})

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        f = next((f for f in repo.files.values() if f.sha256 == request.match_info["sha256"]), None)
        if f is None:
            raise web.HTTPNotFound()
        data = f.path.read_bytes()
        response = web.StreamResponse(headers={"ETag": f'"{f.sha256}"'})
        response.content_length = len(data)
        await response.prepare(request)
        try:
            for i in range(0, len(data), self.chunk_bytes):
                if i and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await response.write(data[i : i + self.chunk_bytes])
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-file (a test stopped it): as a CDN, nothing to do
        return response
