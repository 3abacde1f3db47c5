"""Weights that travel between peers: a node with no model fetches the bytes its stage needs.

With ``model_from_peers``, a node that has no model of its own asks the peers that
hold one (``http/files.py``) for it: first the signed manifest (models/manifest.py),
the config and tokenizer files and every weights file's header, into a directory
under ``models_dir`` named by the model; then, for each plan that gives the node
layers, the bytes of those layers' tensors (and the embeddings or head where its
place in the ring needs them, ``checkpoint.stage_keeps``), before the stage loads.

The files are laid out as the holder's, at the same offsets, sparse: what the node
has not fetched is a hole that takes no disk. So the directory is an mlx-lm
checkpoint (or GGUF file) the stage loads as it loads any other, reading only its
own tensors, and the next plan's layers are added to it. ``ringd-peer.json`` says
whose model it is (its fingerprint, which cannot be read from files with holes). Once the
config and headers are in, the fingerprint is made again, as the holder made it, from them
and the slices of the weights its digest reads (asked of a holder where this node has no
piece there): a manifest that is not the model it names is refused before a byte of it loads.

Every piece (a tensor, or part of a long one: models/manifest.py) is checked against
the manifest's BLAKE3 before it is written; a piece that does not match
is refused, its holder named in the log and asked for nothing more, and the piece
fetched from another holder (the fetch fails, naming the holder, when none is
left). Each file has a journal of the pieces written and checked, appended after
each: a fetch stopped by kill -9 starts again where it was, and a piece not in its
journal is never taken for fetched, whatever the file holds there. Several holders serve at once, a few streams each; the hashing and
writing run off the event loop.

A holder is trusted for nothing it says beyond what is checked: every header acted on
is parsed defensively (Retry-After bounded, ``retry_after``), every step of a request
has a deadline (connecting, the answer's head, each read of the body, each piece at a
floor rate), and a holder that stalls is dropped from the fetch at once, one that fails
MAX_HOLDER_FAILURES requests in a row after them, each with the reason in the log and
its pieces asked of the others; with nobody left the fetch ends in a FetchError that
names each. With ``ring_encryption`` the bytes are asked for sealed (models/sealing.py)
and opened, off the event loop, before a piece is checked.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import os
import re
import socket
import ssl as ssl_lib
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from blake3 import blake3

from ringd.auth import FILES_BODY_SIGNATURE_HEADER, FILES_NONCE_HEADER, AuthError, check_files_body, sign_files
from ringd.models.checkpoint import stage_keeps
from ringd.models.errors import ModelError
from ringd.models.fingerprint import digest_samples, identify
from ringd.models.gguf import GgufFile
from ringd.models.manifest import FILES_PREFIX, MAX_MANIFEST_BYTES, Manifest, ManifestError, merge_ranges, pieces_of, safetensors_ranges, safetensors_stage_ranges
from ringd.models.progress import FETCH, LoadProgress
from ringd.models.sealing import SCHEME, SEAL_CHUNK_BYTES, SEALED_HEADER, Opener, sealed_length
from ringd.models.source import PEER_RECORD, read_record

log = logging.getLogger(__name__)

# Beside the files: each one's journal of pieces written and checked.
JOURNALS = ".ringd-pieces"
# Range requests at once, over all holders, and per holder: a few streams fill a LAN link
# and let the hashing of one piece overlap the arrival of the next; more only split the link.
FETCH_STREAMS = 4
STREAMS_PER_HOLDER = 2
# Streams of one file at once: what a fetch stopped by kill -9 may lose per file is the piece
# each had under way, so one: a model of several files still draws on several holders at once.
STREAMS_PER_FILE = 1
# Pieces one Range request asks for at most: a long run is split, so that holders take turns
# on one file and a failed stream leaves little to ask again.
MAX_RUN_PIECES = 64
# Most a read of a holder's socket takes at once.
RECV_BYTES = 4 * 1024 * 1024
# An answer's status line and headers: a few hundred bytes from a holder; more is not one.
MAX_RESPONSE_HEAD_BYTES = 16 * 1024
# Deadlines. Connecting to a holder on the LAN (its address looked up too); the answer's status
# and headers, which a holder sends before its first byte of a file (a 503 at once when busy).
CONNECT_TIMEOUT_S = 5.0
HEAD_TIMEOUT_S = 10.0
# Silence within a body: a holder that sends no byte for this long has stalled (a LAN holder
# sends megabytes a second; its disk pausing takes well under a second) and is dropped.
STALL_S = 10.0
# The slowest a piece may arrive, on top of STALL_S: a holder that trickles a byte now and then
# is a staller too. A LAN stream carries tens of MiB/s; a tenth of a slow Wi-Fi's share is this.
MIN_PIECE_BYTES_PER_S = 1024 * 1024
# A holder hashes every byte of its model for the first manifest it is asked for: minutes
# for hundreds of GB. How long a fetcher waits for it, asking again every Retry-After.
MANIFEST_WAIT_S = 1800.0
# A holder that failed a request (not a bad piece: the link, a restart) is asked again after this.
HOLDER_RETRY_S = 2.0
# Retry-After, in seconds, is the holder's word: a value that is not a number of seconds or an
# HTTP date (RFC 9110 10.2.3) counts as HOLDER_RETRY_S, and any is taken as at most this (a
# holder serving others frees a stream within seconds; one building its manifest is asked again).
MAX_RETRY_AFTER_S = 30.0
# Failed requests in a row to one holder after which it is dropped from the fetch (a restart
# takes one or two; a holder that errs on every request is not asked the whole fetch long).
MAX_HOLDER_FAILURES = 3
# Failed requests in a row, over all holders, after which a fetch gives up (each one re-queues its pieces).
MAX_FAILED_REQUESTS = 20


class FetchError(ModelError):
    """The model's bytes could not be had from any peer; the message says why and from whom."""


def retry_after(value: str | None, now: float | None = None) -> float:
    """Seconds to wait by a Retry-After header, whatever a holder put there: delay-seconds or an
    HTTP date (RFC 9110 10.2.3), clamped to [0, MAX_RETRY_AFTER_S]; anything else (none, "soon",
    "nan", "1e308", a date that does not parse) is HOLDER_RETRY_S. Never raises."""
    if value is None:
        return HOLDER_RETRY_S
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,6})?", value):  # delay-seconds (a fraction allowed)
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
            seconds = when.timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError, OverflowError):
            return HOLDER_RETRY_S
    if not math.isfinite(seconds):
        return HOLDER_RETRY_S
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


@dataclass(frozen=True)
class Holder:
    node: str
    http: str  # host:port of its HTTP API
    model: str  # the fingerprint of the model it serves
    https: bool = False  # its API speaks TLS (the INFO it sent says so): fetched with the node's client context


def model_dir_name(manifest: Manifest) -> str:
    """The directory a fetched model gets under models_dir: its label and fingerprint."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", manifest.label).strip("-.")[:80] or "model"
    return f"{label}-{manifest.fingerprint.replace(':', '-')}"


class Journal:
    """Which pieces of one file are written and checked: one index a line, appended after each."""

    def __init__(self, path: Path):
        self.path = path
        self.done: set[int] = set()
        try:
            for line in path.read_text().splitlines():
                if line.isdigit():  # a line cut short by a kill is not a piece
                    self.done.add(int(line))
        except OSError:
            pass

    def add(self, index: int) -> None:
        """Record a piece (its bytes are written already): one small append, whole or not at all."""
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{index}\n".encode())
        finally:
            os.close(fd)
        self.done.add(index)


class _Run:
    """Pieces of one file to fetch in one Range request: consecutive indices."""

    def __init__(self, file: str, pieces: list[int]):
        self.file, self.pieces = file, pieces


class PeerModel:
    """A model fetched from peers into ``root``: its manifest, its sparse files and their journals."""

    def __init__(self, root: Path, manifest: Manifest, secret: bytes, node: str, metrics=None, checked: bool = False, sealed: bool = False, ssl: ssl_lib.SSLContext | None = None):
        self.root = root
        self.sealed = sealed  # ring_encryption: its bytes are asked for sealed (models/sealing.py)
        self.ssl = ssl  # a TLS context for holders' HTTP APIs; None: plain HTTP
        self.checked = checked  # found to be the model its fingerprint names (check_fingerprint)
        self.manifest = manifest
        self.secret = secret
        self.node = node
        self.metrics = metrics
        self.journals = {f.name: Journal(root / JOURNALS / f"{f.name.replace('/', '%')}.log") for f in manifest.files}
        self.refused: dict[str, str] = {}  # holders that served a bad piece -> what they served
        self.vouched: set[str] = set()  # holders whose manifest is this one
        self.dropped: dict[str, str] = {}  # holders the last fetch gave up on (stalled, failing) -> why

    @property
    def path(self) -> Path:
        """The model as ``model_info`` and ``Shard.load`` take it: the directory, or the GGUF file."""
        return self.root / self.manifest.files[0].name if self.manifest.gguf else self.root

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @classmethod
    def open(cls, root: Path, secret: bytes, node: str, metrics=None, only_checked: bool = True, sealed: bool = False, ssl: ssl_lib.SSLContext | None = None) -> "PeerModel | None":
        """The model fetched into ``root`` before, or None if there is none (or its record is bad,
        or, with ``only_checked``, it was never found to be the model its fingerprint names)."""
        record = read_record(root)
        if record is None or only_checked and record.get("checked") is not True:
            return None
        try:
            manifest = Manifest.from_wire(record.get("manifest"))
        except ManifestError as e:
            log.warning("%s: the record of a fetched model does not parse (%s); fetching it again", root, e)
            return None
        return cls(root, manifest, secret, node, metrics, checked=record.get("checked") is True, sealed=sealed, ssl=ssl)

    @classmethod
    async def bootstrap(
        cls, models_dir: Path, holders: list[Holder], secret: bytes, node: str, metrics=None, fingerprint: str | None = None,
        sealed: bool = False, ssl: ssl_lib.SSLContext | None = None,
    ) -> "PeerModel":
        """The model the holders serve (``fingerprint``, if given), with its config, tokenizer and
        every weights file's header fetched: enough to know the model and plan it; layers follow."""
        if not holders:
            raise FetchError("model_from_peers: no peer holding a model was found; start a node with the model (model: PATH or repo id), or give this node one")
        async with _client(ssl) as http:
            manifest = await _manifest(http, holders, secret, node, fingerprint, ssl)
        holders = [h for h in holders if h.model == manifest.fingerprint]
        model = await asyncio.to_thread(cls._lay_out, models_dir / model_dir_name(manifest), manifest, secret, node, metrics, sealed, ssl)
        ranges = {f.name: [(0, f.head)] for f in manifest.files if f.head}
        for name, a, b in manifest.always:
            ranges.setdefault(name, []).append((a, b))
        await model.fetch({k: merge_ranges(v) for k, v in ranges.items()}, holders, LoadProgress(0, 0))
        if not model.checked:  # once per model: the slices it asks for are not its share
            await model.check_fingerprint(holders)
        return model

    @classmethod
    def _lay_out(cls, root: Path, manifest: Manifest, secret: bytes, node: str, metrics, sealed: bool, ssl: ssl_lib.SSLContext | None) -> "PeerModel":
        """The directory for ``manifest``: as it was, if it was fetched by the same manifest; else
        its record written anew and its journals emptied (nothing recorded holds for other bytes).
        Every file at its size, holes until fetched (blocking: off the event loop)."""
        existing = cls.open(root, secret, node, metrics, only_checked=False, sealed=sealed, ssl=ssl)
        if existing is not None and existing.manifest == manifest:
            model = existing
        else:
            (root / JOURNALS).mkdir(parents=True, exist_ok=True)
            for j in (root / JOURNALS).iterdir():
                j.unlink()
            model = cls(root, manifest, secret, node, metrics, sealed=sealed, ssl=ssl)
            model._record(checked=False)
        for f in manifest.files:
            os.close(_open_sparse(root / f.name, f.size))
        return model

    def _record(self, checked: bool) -> None:
        """Write ``ringd-peer.json``: whose model this is, its manifest, and whether it was found
        to be the model its fingerprint names (a restart with no holder takes only such a one)."""
        m = self.manifest
        tmp = self.root / f".{PEER_RECORD}.tmp"
        tmp.write_text(json.dumps({"fingerprint": m.fingerprint, "label": m.label, "checked": checked, "manifest": m.to_wire()}))
        os.replace(tmp, self.root / PEER_RECORD)

    # --- is it the model it says -------------------------------------------------------------

    async def check_fingerprint(self, holders: list[Holder]) -> None:
        """Make the model's fingerprint again, as its holder made it when it loaded the model: from
        the config and weights headers fetched (every piece checked against the manifest) and the
        slices of every weights file the digest reads, here where this node fetched them, asked
        of a holder where it did not (of each in turn, until one's make the fingerprint: a slice
        is checked by what it makes, not by a piece's hash). A manifest whose files are not the
        model it names stops here (FetchError): its record goes, so nothing of it is loaded or
        taken at a restart."""
        m = self.manifest
        if m.digest.startswith("hub:"):  # a Hub snapshot's digest names its commit: the config is what is made again
            now, digest = await asyncio.to_thread(identify, self.path, None, m.digest)
            made = [f"its config makes {now}"] if (now, digest) != (m.fingerprint, m.digest) else []
        else:
            spans = await asyncio.to_thread(self._digest_spans)
            needed = [(name, a, b) for name, ss in spans.items() for a, b in ss if a < b and self.missing({name: [(a, b)]}).get(name)]
            made = []
            asked = sorted((h for h in holders if h.node not in self.refused), key=lambda h: h.node in self.dropped)  # a staller last
            for holder in asked if needed else [None]:
                try:
                    slices = {k: await self._fetch_slice(holder, *k) for k in needed}
                except Exception as e:  # whatever a holder answers: said, and the next asked
                    made.append(f"{holder.node}: {_reason(e)}")
                    continue
                now, digest = await asyncio.to_thread(identify, self.path, lambda name, a, b: slices.get((name, a, b)) or _pread(self.root / name, a, b))
                if (now, digest) == (m.fingerprint, m.digest):
                    made = []
                    break
                made.append(f"{holder.node if holder else 'this node'}: its files make {now}")
            else:
                made = made or ["no holder to ask for the slices"]
        if made:
            (self.root / PEER_RECORD).unlink(missing_ok=True)
            raise FetchError(f"the files served as model {m.fingerprint} are not that model ({'; '.join(made)}); nothing of it is loaded")
        await asyncio.to_thread(self._record, True)
        self.checked = True

    def _digest_spans(self) -> dict[str, list[tuple[int, int]]]:
        if self.manifest.gguf:
            return {self.path.name: GgufFile.open(self.path).digest_samples()}
        return digest_samples(self.root)

    async def _fetch_slice(self, holder: Holder, name: str, a: int, b: int) -> bytes:
        """Bytes [a, b) of a file from ``holder`` (waiting its turn while it serves others)."""
        path = f"{FILES_PREFIX}/{self.fingerprint}/data/{name}"
        deadline = time.monotonic() + MAX_RETRY_AFTER_S
        while True:
            async with self._range(holder, path, a, b) as r:
                if r.status == 503 and time.monotonic() < deadline:  # serving others: its turn comes
                    await asyncio.sleep(min(max(retry_after(r.headers.get("retry-after")), 0.1), HOLDER_RETRY_S))
                    continue
                await r.check(206, f"{name} bytes {a}-{b - 1}")
                buf = memoryview(bytearray(b - a))
                await r.fill(buf, f"{name} bytes {a}-{b - 1}", piece_deadline(b - a))
                return bytes(buf)

    def _range(self, holder: Holder, path: str, a: int, b: int) -> "_RangeReader":
        """A signed GET of bytes [a, b) of ``path`` from ``holder``, sealed if this node asks so."""
        headers = {**sign_files(self.secret, "GET", path, self.node, holder.node, time.time()), "Range": f"bytes={a}-{b - 1}"}
        opener = None
        if self.sealed:
            headers[SEALED_HEADER] = SCHEME
            opener = Opener(self.secret, headers[FILES_NONCE_HEADER], path, a, b - a)
        return _RangeReader(holder, path, headers, b - a, opener, _tls(holder, self.ssl))

    # --- what a stage needs ------------------------------------------------------------------

    def stage_ranges(self, start: int, end: int, num_layers: int) -> dict[str, list[tuple[int, int]]]:
        """The bytes of each file the stage holding layers [start, end) reads (blocking: reads the
        files' headers; run it off the event loop)."""
        if self.manifest.gguf:
            import mlx.core as mx
            from mlx.utils import tree_flatten

            g = GgufFile.open(self.path)
            params = [name for name, _ in tree_flatten(g.build_model().parameters())]
            mx.synchronize()  # the placeholders' lazy work done here, not left to the interpreter's exit
            untied = any("lm_head" in n for n in params)
            spans = set()
            for name in params:
                if stage_keeps(name, start, end, num_layers, untied):
                    spans |= {span for t in g.tensors_for(name) for span in t.spans}
            return {self.manifest.files[0].name: merge_ranges(spans)}
        tables = {}
        for f in self.manifest.files:
            if f.weights:
                with open(self.root / f.name, "rb") as fh:
                    tables[f.name] = safetensors_ranges(fh.read(f.head), f.head)
        return safetensors_stage_ranges(tables, start, end, num_layers)

    def missing(self, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, list[int]]:
        """The pieces of ``ranges`` not yet written and checked."""
        return {name: [i for i in pieces if i not in self.journals[name].done] for name, pieces in pieces_of(self.manifest, ranges).items()}

    def held_bytes(self) -> int:
        """Bytes of the model on this node's disk (the pieces fetched)."""
        total = 0
        for name, journal in self.journals.items():
            f = self.manifest.file(name)
            for i in journal.done:
                a, b = f.span(i)
                total += b - a
        return total

    async def ensure(self, start: int, end: int, num_layers: int, holders: list[Holder], progress: LoadProgress) -> None:
        """Fetch what the stage holding layers [start, end) reads and this node lacks."""
        ranges = await asyncio.to_thread(self.stage_ranges, start, end, num_layers)
        await self.fetch(ranges, holders, progress)

    # --- fetching --------------------------------------------------------------------------

    async def fetch(self, ranges: dict[str, list[tuple[int, int]]], holders: list[Holder], progress: LoadProgress) -> None:
        """Fetch the pieces of ``ranges`` this node lacks from ``holders``, checked, written, journaled."""
        todo = {name: pieces for name, pieces in self.missing(ranges).items() if pieces}
        if not todo:
            return
        good = [h for h in holders if h.node not in self.refused]
        if not good:
            raise FetchError(self._nobody_left(holders))
        size = lambda name, i: (lambda s: s[1] - s[0])(self.manifest.file(name).span(i))  # noqa: E731
        progress.begin(FETCH, {name: sum(size(name, i) for i in pieces) for name, pieces in todo.items()})
        started, total = time.monotonic(), sum(size(n, i) for n, ps in todo.items() for i in ps)
        fds = {}
        try:
            for name in todo:
                fds[name] = _open_sparse(self.root / name, self.manifest.file(name).size)
                await asyncio.to_thread(_reserve, fds[name], [self.manifest.file(name).span(i) for i in todo[name]])
            async with _client(self.ssl) as http:
                await _Fetch(self, http, fds, good, progress, holders).run(todo)
        finally:
            for fd in fds.values():
                os.close(fd)
        left = {name: pieces for name, pieces in self.missing(ranges).items() if pieces}
        if left:  # never a stage over holes
            raise FetchError(f"pieces of {', '.join(left)} are still missing after the fetch ended")
        progress.end()
        elapsed = time.monotonic() - started
        log.info("fetched %.1f MiB of %s from peers in %.1f s (%.1f MiB/s)", total / 2**20, self.manifest.label, elapsed, total / 2**20 / max(elapsed, 1e-6))

    def _nobody_left(self, holders: list[Holder], dropped: dict[str, str] | None = None) -> str:
        bad = "; ".join([f"{node} refused ({why})" for node, why in self.refused.items()] + [f"{node} dropped ({why})" for node, why in (dropped or {}).items()])
        if not holders:
            return f"no peer holds model {self.fingerprint} to fetch it from"
        return f"no holder of model {self.fingerprint} is left to fetch from: {bad}"


def _open_sparse(path: Path, size: int) -> int:
    """The file, created at its full size with nothing written (a hole) if new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    return fd


def _reserve(fd: int, spans: list[tuple[int, int]]) -> None:
    """Allocate the disk the pieces will take, before they come (where the system can): a write
    into allocated blocks is several times as fast as one that allocates them, and the rest of
    the file stays a hole."""
    if not hasattr(os, "posix_fallocate"):  # macOS: APFS allocates as it goes
        return
    for a, b in merge_ranges(spans):
        try:
            os.posix_fallocate(fd, a, b - a)
        except OSError:  # a file system that cannot: the writes allocate
            return


def _client(ssl: ssl_lib.SSLContext | None = None) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=STALL_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(ssl=ssl if ssl is not None else True))


def _url(holder: Holder, path: str, ssl: ssl_lib.SSLContext | None = None) -> str:
    return f"{'https' if _tls(holder, ssl) is not None else 'http'}://{holder.http}{path}"


def _tls(holder: Holder, ssl: ssl_lib.SSLContext | None) -> ssl_lib.SSLContext | None:
    """The context to reach ``holder`` with: the node's, where the holder's API speaks TLS; a
    holder with TLS and a node with no context is a failed request that says so."""
    if not holder.https:
        return None
    if ssl is None:
        raise FetchError(f"{holder.node} serves its API over https, and this fetch has no TLS context to check it with")
    return ssl


def piece_deadline(nbytes: int) -> float:
    """Seconds ``nbytes`` of a body may take: STALL_S, and the bytes at MIN_PIECE_BYTES_PER_S."""
    return STALL_S + nbytes / MIN_PIECE_BYTES_PER_S


def _reason(e: BaseException) -> str:
    """What failed, for a log line: the message, and the exception's type where it says more."""
    if isinstance(e, (_HolderFailed, _BadHolder, _BadPiece, FetchError)) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def _read_at_most(r: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or its first ``limit + 1`` bytes if it is longer: ``StreamReader.read(n)``
    gives what has arrived (up to n), so one call may end a body split over TCP segments early."""
    body = bytearray()
    while len(body) <= limit and (chunk := await r.content.read(limit + 1 - len(body))):
        body += chunk
    return bytes(body)


async def _manifest(http: aiohttp.ClientSession, holders: list[Holder], secret: bytes, node: str, fingerprint: str | None, ssl: ssl_lib.SSLContext | None = None) -> Manifest:
    """The signed manifest of the first holder that answers (waiting while it builds it)."""
    errors = []
    deadline = time.monotonic() + MANIFEST_WAIT_S
    pending = list(holders)
    while pending:
        holder = pending.pop(0)
        fp = fingerprint or "any"
        path = f"{FILES_PREFIX}/{fp}/manifest"
        try:
            headers = sign_files(secret, "GET", path, node, holder.node, time.time())
            async with asyncio.timeout(CONNECT_TIMEOUT_S + HEAD_TIMEOUT_S + piece_deadline(MAX_MANIFEST_BYTES)), http.get(_url(holder, path, ssl), headers=headers) as r:
                body = await _read_at_most(r, MAX_MANIFEST_BYTES)
                if r.status == 503 and time.monotonic() < deadline:
                    await asyncio.sleep(retry_after(r.headers.get("Retry-After")))
                    pending.insert(0, holder)  # building: ask it again
                    continue
                if r.status != 200:
                    errors.append(f"{holder.node}: HTTP {r.status} {body[:200].decode(errors='replace')}")
                    continue
                if len(body) > MAX_MANIFEST_BYTES:
                    errors.append(f"{holder.node}: a manifest over {MAX_MANIFEST_BYTES} bytes")
                    continue
                check_files_body(secret, headers[FILES_NONCE_HEADER], body, r.headers.get(FILES_BODY_SIGNATURE_HEADER))
                manifest = Manifest.from_wire(json.loads(body))
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            errors.append(f"{holder.node}: {_reason(e)}")
            continue
        except (AuthError, ManifestError, ValueError) as e:
            errors.append(f"{holder.node}: {e}")
            continue
        except Exception as e:  # whatever else a holder's answer makes of the parsing: said, and the next asked
            errors.append(f"{holder.node}: {_reason(e)}")
            continue
        if fingerprint is not None and manifest.fingerprint != fingerprint:
            errors.append(f"{holder.node}: its manifest is of model {manifest.fingerprint}, not {fingerprint}")
            continue
        return manifest
    raise FetchError("no holder answered with the model's manifest: " + "; ".join(errors))


class _Fetch:
    """One fetch: runs of pieces handed to streams, holders chosen, pieces checked and written."""

    def __init__(self, model: PeerModel, http: aiohttp.ClientSession, fds: dict[str, int], holders: list[Holder], progress: LoadProgress, asked: list[Holder]):
        self.m, self.http, self.fds, self.progress, self.asked = model, http, fds, progress, asked
        self.holders = list(holders)
        self.busy: dict[str, int] = {h.node: 0 for h in holders}  # streams per holder
        self.resting: dict[str, float] = {}  # holder -> until when it is not asked (it failed a request)
        self.failed: dict[str, int] = {}  # holder -> its failed requests in a row
        self.dropped: dict[str, str] = {}  # holder -> why it is asked for nothing more in this fetch
        self.files_busy: dict[str, int] = {}
        self.queue: list[_Run] = []
        self.failures = 0
        self.changed = asyncio.Event()

    async def run(self, todo: dict[str, list[int]]) -> None:
        for name, pieces in todo.items():
            self.queue += [_Run(name, run) for run in _consecutive(pieces)]
        streams: set[asyncio.Task] = set()
        try:
            while self.queue or streams:
                if not self.holders:
                    raise FetchError(self.m._nobody_left(self.asked, self.dropped))
                for run in list(self.queue):
                    holder = self._pick(run.file)
                    if holder is None or len(streams) >= FETCH_STREAMS:
                        continue
                    self.queue.remove(run)
                    self.busy[holder.node] += 1
                    self.files_busy[run.file] = self.files_busy.get(run.file, 0) + 1
                    task = asyncio.ensure_future(self._stream(holder, run))
                    task.add_done_callback(lambda _t: self.changed.set())
                    streams.add(task)
                self.changed.clear()
                if not any(t.done() for t in streams):
                    wake = min(self.resting.values(), default=time.monotonic() + 1.0) - time.monotonic()
                    try:
                        async with asyncio.timeout(min(max(wake, 0.01), 1.0)):
                            await self.changed.wait()
                    except TimeoutError:
                        pass
                for t in [t for t in streams if t.done()]:
                    streams.discard(t)
                    t.result()  # a FetchError from a stream ends the fetch
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    def _pick(self, file: str) -> Holder | None:
        if self.files_busy.get(file, 0) >= STREAMS_PER_FILE:
            return None
        now = time.monotonic()
        ready = [h for h in self.holders if self.busy[h.node] < STREAMS_PER_HOLDER and self.resting.get(h.node, 0) <= now]
        return min(ready, key=lambda h: self.busy[h.node], default=None)

    async def _stream(self, holder: Holder, run: _Run) -> None:
        m, f = self.m, self.m.manifest.file(run.file)
        first, last = run.pieces[0], run.pieces[-1]
        start, end = f.span(first)[0], f.span(last)[1]
        path = f"{FILES_PREFIX}/{m.fingerprint}/data/{run.file}"
        done = 0
        try:
            if holder.node not in m.vouched:
                await self._vouch(holder)
            async with m._range(holder, path, start, end) as r:
                if r.status == 503:  # busy: serving others, or building its manifest
                    raise _HolderBusy(retry_after(r.headers.get("retry-after")))
                await r.check(206, f"{run.file} bytes {start}-{end - 1}")
                # One buffer for the stream's pieces (each is written before the next arrives): no
                # fresh pages to fault in per piece.
                buf = memoryview(bytearray(max(f.span(i)[1] - f.span(i)[0] for i in run.pieces)))
                for index in run.pieces:
                    await self._piece(run.file, index, r, buf)
                    done += 1
            self.failures = 0
            self.failed[holder.node] = 0
        except _BadPiece as e:
            log.error("%s served a piece that does not match its manifest (%s); it is asked for nothing more", holder.node, e)
            self._refuse(holder, f"it served {e}, which does not match the manifest")
            self._requeue(run, done)
        except _BadHolder as e:
            log.error("%s: %s; it is asked for nothing more", holder.node, e)
            self._refuse(holder, str(e))
            self._requeue(run, done)
        except _HolderBusy as e:
            self.resting[holder.node] = time.monotonic() + max(e.retry_after, 0.1)
            self._requeue(run, done)
        except _Stalled as e:
            # Its socket is open and silent: asking it again costs the same wait, so it is dropped.
            self._drop(holder, run, done, _reason(e))
        except Exception as e:  # the link, a restart, or an answer that parses as nothing: whatever a holder sends
            why = _reason(e)
            self.failures += 1
            self.failed[holder.node] = self.failed.get(holder.node, 0) + 1
            if self.failures >= MAX_FAILED_REQUESTS:
                raise FetchError(f"{MAX_FAILED_REQUESTS} requests for the model's bytes failed in a row; the last, to {holder.node}: {why}") from None
            if self.failed[holder.node] >= MAX_HOLDER_FAILURES:
                self._drop(holder, run, done, f"{MAX_HOLDER_FAILURES} requests failed in a row, the last: {why}")
            else:
                log.warning("fetching %s from %s failed: %s; asking again", run.file, holder.node, why)
                self.resting[holder.node] = time.monotonic() + HOLDER_RETRY_S
                self._requeue(run, done)
        finally:
            self.busy[holder.node] -= 1
            self.files_busy[run.file] -= 1

    def _drop(self, holder: Holder, run: _Run, done: int, why: str) -> None:
        """Ask ``holder`` for nothing more in this fetch (a later fetch asks it again), its pieces of the others."""
        others = ", ".join(h.node for h in self.holders if h.node != holder.node) or "none is left"
        log.warning("fetching %s from %s failed: %s; it is asked for nothing more in this fetch (its pieces go to: %s)", run.file, holder.node, why, others)
        self.dropped[holder.node] = self.m.dropped[holder.node] = why
        self.holders = [h for h in self.holders if h.node != holder.node]
        self._requeue(run, done)

    def _refuse(self, holder: Holder, why: str) -> None:
        self.m.refused[holder.node] = why
        self.holders = [h for h in self.holders if h.node != holder.node]

    async def _vouch(self, holder: Holder) -> None:
        """Ask a holder for its manifest before its bytes: it must be ours, piece for piece (and the
        asking starts its building, if it never built it)."""
        try:
            theirs = await _manifest(self.http, [holder], self.m.secret, self.m.node, self.m.fingerprint, self.m.ssl)
        except FetchError as e:
            raise _HolderFailed(str(e)) from None
        if theirs != self.m.manifest:
            raise _BadHolder(f"its manifest of model {self.m.fingerprint} differs from the one this node fetches by")
        self.m.vouched.add(holder.node)

    def _requeue(self, run: _Run, done: int) -> None:
        rest = run.pieces[done:]
        if rest:
            self.queue.append(_Run(run.file, rest))

    async def _piece(self, file: str, index: int, r: "_RangeReader", into: memoryview) -> None:
        """Receive one piece into ``into``; then, off the loop and in one go, hash it (BLAKE3 on
        every core) and, if it is the manifest's, write and record it."""
        m, f = self.m, self.m.manifest.file(file)
        a, b = f.span(index)
        buf = into[: b - a]
        await r.fill(buf, f"piece {index} of {file}", piece_deadline(b - a))
        ok = await asyncio.to_thread(_check_and_write, self.fds[file], m.journals[file], index, a, buf, f.hashes[index])
        if m.metrics is not None:
            m.metrics.files_fetched(ok, b - a)
        if not ok:
            raise _BadPiece(f"piece {index} of {file}")
        self.progress.advance(file, b - a)


class _RangeReader:
    """One GET of a byte range, HTTP/1.1, whose body lands straight in the caller's buffers: a
    fetch reads gigabytes, and a stream of small ``bytes`` through a general client costs more
    time than the bytes themselves. Every wait has a deadline: CONNECT_TIMEOUT_S to connect,
    HEAD_TIMEOUT_S for the answer's head, STALL_S for each read of the body (``_Stalled``).

    With an ``opener`` the body is sealed (models/sealing.py): read a chunk at a time, opened off
    the loop. With ``ssl`` the connection speaks TLS (through asyncio's streams: a copy more)."""

    def __init__(self, holder: Holder, path: str, headers: dict[str, str], count: int, opener: Opener | None = None, ssl: ssl_lib.SSLContext | None = None):
        self.holder, self.path, self.headers, self.count = holder, path, headers, count
        self.opener, self.ssl = opener, ssl
        self.status, self.length = 0, 0
        self.sock: socket.socket | None = None
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None  # with ssl
        self._early = b""  # body bytes that came with the headers
        self._plain = memoryview(b"")  # opened bytes not yet given out (sealed)
        self._chunk = 0  # the next sealed chunk's index

    async def __aenter__(self) -> "_RangeReader":
        try:
            return await self._open()
        except BaseException:
            self.close()
            raise

    async def _open(self) -> "_RangeReader":
        loop = asyncio.get_running_loop()
        host, port = self.holder.http.rsplit(":", 1)
        request = "\r\n".join([f"GET {self.path} HTTP/1.1", f"Host: {self.holder.http}", "Connection: close", *(f"{k}: {v}" for k, v in self.headers.items())])
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if self.ssl is not None:
                    self._streams = await asyncio.open_connection(host.strip("[]"), int(port), ssl=self.ssl)
                else:
                    infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
                    family, kind, proto, _, addr = infos[0]
                    self.sock = socket.socket(family, kind, proto)
                    self.sock.setblocking(False)
                    await loop.sock_connect(self.sock, addr)
        except TimeoutError:
            raise _HolderFailed(f"connecting to {self.holder.http} took over {CONNECT_TIMEOUT_S:.0f} s") from None
        head = b""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                await self._send((request + "\r\n\r\n").encode())
                while b"\r\n\r\n" not in head:
                    if len(head) > MAX_RESPONSE_HEAD_BYTES:
                        raise _HolderFailed(f"an answer whose headers run past {MAX_RESPONSE_HEAD_BYTES} bytes")
                    data = bytearray(16384)
                    n = await self._recv_into(memoryview(data))
                    if not n:
                        raise _HolderFailed("the holder closed the connection before answering")
                    head += data[:n]
        except TimeoutError:
            raise _Stalled(f"no answer's head within {HEAD_TIMEOUT_S:.0f} s") from None
        head, self._early = head.split(b"\r\n\r\n", 1)
        status, *fields = head.decode("latin-1").split("\r\n")
        try:
            self.status = int(status.split()[1])
        except (IndexError, ValueError):
            raise _HolderFailed(f"a status line that does not parse: {status[:80]!r}") from None
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
        length = self.headers.get("content-length", "")
        self.length = int(length) if length.isdigit() and len(length) < 20 else -1
        return self

    async def check(self, status: int, what: str) -> None:
        """_HolderFailed unless the answer is ``status`` with the body this request asked for."""
        if self.status != status:
            raise _HolderFailed(f"HTTP {self.status} for {what}: {await self.text()}")
        sealed = self.headers.get(SEALED_HEADER.lower())
        if (sealed == SCHEME) != (self.opener is not None):
            raise _HolderFailed(f"an answer for {what} {'not sealed' if self.opener is not None else f'sealed ({sealed!r:.40})'}, asked for {'sealed' if self.opener else 'in the clear'}")
        want = sealed_length(self.count) if self.opener is not None else self.count
        if self.length != want:
            raise _HolderFailed(f"a Content-Length of {self.length} for {what}, not the {want} bytes asked for")

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self._streams is not None:
            self._streams[1].close()

    async def _send(self, data: bytes) -> None:
        if self._streams is not None:
            self._streams[1].write(data)
            await self._streams[1].drain()
        else:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _recv_into(self, buf: memoryview) -> int:
        if self._streams is not None:
            data = await self._streams[0].read(len(buf))
            buf[: len(data)] = data
            return len(data)
        return await asyncio.get_running_loop().sock_recv_into(self.sock, buf)

    async def fill(self, buf: memoryview, what: str, deadline_s: float) -> None:
        """Body bytes into all of ``buf`` within ``deadline_s``; _HolderFailed naming ``what`` if the
        body ends first, _Stalled if it does not come in time."""
        got = 0
        try:
            async with asyncio.timeout(deadline_s):
                while got < len(buf):
                    n = await self.read_into(buf[got:])
                    if not n:
                        raise _HolderFailed(f"the stream ended in {what}, after {got} of {len(buf)} bytes")
                    got += n
        except TimeoutError:
            raise _Stalled(f"{what} not in within {deadline_s:.0f} s ({got} of {len(buf)} bytes; the floor is {MIN_PIECE_BYTES_PER_S // 1024} KiB/s)") from None

    async def read_into(self, buf: memoryview) -> int:
        """Body bytes into ``buf`` (as many as came, at most its size, opened if sealed); 0 at the end."""
        if self.opener is None:
            return await self._raw_into(buf)
        if not self._plain:
            if self._chunk * SEAL_CHUNK_BYTES >= self.count:
                return 0
            sealed = memoryview(bytearray(self.opener.chunk_bytes(self._chunk)))
            got = 0
            while got < len(sealed):
                n = await self._raw_into(sealed[got:])
                if not n:
                    return 0  # cut short: the caller says where
                got += n
            self._plain = memoryview(await asyncio.to_thread(self.opener.open, self._chunk, sealed))
            self._chunk += 1
        n = min(len(self._plain), len(buf))
        buf[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    async def _raw_into(self, buf: memoryview) -> int:
        """Bytes of the body as they come on the wire; _Stalled after STALL_S without one."""
        if self._early:
            n = min(len(self._early), len(buf))
            buf[:n] = self._early[:n]
            self._early = self._early[n:]
            return n
        try:
            async with asyncio.timeout(STALL_S):
                return await self._recv_into(buf[:RECV_BYTES])
        except TimeoutError:
            raise _Stalled(f"no byte for {STALL_S:.0f} s mid-piece") from None

    async def text(self) -> str:
        """The start of an error answer's body, for a message (within STALL_S; it may be sealed garbage)."""
        buf = memoryview(bytearray(300))
        try:
            n = await self._raw_into(buf)
        except (_Stalled, OSError):
            return ""
        return bytes(buf[:n]).decode(errors="replace")


def _check_and_write(fd: int, journal: Journal, index: int, offset: int, piece: memoryview, expected: str) -> bool:
    """Check a piece against its hash; if it holds, write it where it goes, then record it. One
    thread hop per piece: BLAKE3 on every core takes a 16 MiB piece in a few milliseconds."""
    if blake3(piece, max_threads=blake3.AUTO).hexdigest() != expected:
        return False
    os.pwrite(fd, piece, offset)
    journal.add(index)
    return True


def _pread(path: Path, a: int, b: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), b - a, a)


def _consecutive(pieces: list[int]) -> list[list[int]]:
    """Runs of consecutive pieces, MAX_RUN_PIECES at most each."""
    runs: list[list[int]] = []
    for i in pieces:
        if runs and i == runs[-1][-1] + 1 and len(runs[-1]) < MAX_RUN_PIECES:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class _BadPiece(Exception):
    pass


class _BadHolder(Exception):
    pass


class _HolderBusy(Exception):
    def __init__(self, retry_after: float):
        super().__init__(f"busy; retry after {retry_after} s")
        self.retry_after = retry_after


class _HolderFailed(Exception):
    pass


class _Stalled(_HolderFailed):
    """A holder whose socket is open and silent (or too slow): dropped from the fetch at once."""
