"""A model fetched from peers (``PeerModel``) and one fetch of its pieces (``_Fetch``).

``PeerModel`` is the directory under ``models_dir``: the signed manifest it was fetched by,
the config and tokenizer files and every weights file's header (``bootstrap``), then, per
plan, the bytes of the node's layers (``ensure``); its fingerprint made again from what
came before a byte of it loads (``check_fingerprint``). ``_Fetch`` hands runs of pieces to
a few streams over several holders at once, each piece checked and written off the event
loop (peers/journal.py), and answers each holder's failure (peers/client.py): a stall
drops it at once, a failed request rests it, MAX_HOLDER_FAILURES in a row drop it, a bad
piece refuses it; with nobody left the fetch ends in a FetchError that names each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl as ssl_lib
import time
from pathlib import Path

import aiohttp

from ringd.security.auth import FILES_NONCE_HEADER, sign_files
from ringd.models.checkpoint import stage_keeps
from ringd.models.fingerprint import digest_samples, identify
from ringd.models.gguf.reader import GgufFile
from ringd.models.peers.manifest import FILES_PREFIX, Manifest, ManifestError, merge_ranges, pieces_of, safetensors_ranges, safetensors_stage_ranges
from ringd.models.peers.client import HOLDER_RETRY_S, MAX_RETRY_AFTER_S, BadHolder, BadPiece, FetchError, Holder, HolderBusy, HolderFailed, Stalled, client_session, fetch_manifest, holder_tls, piece_deadline, reason, retry_after
from ringd.models.peers.journal import JOURNALS, Journal, check_and_write, open_sparse, pread, reserve
from ringd.models.peers.ranges import RangeReader
from ringd.models.progress import FETCH, LoadProgress
from ringd.models.peers.sealing import SCHEME, SEALED_HEADER, Opener
from ringd.models.source import PEER_RECORD, read_record

log = logging.getLogger(__name__)

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
# Failed requests in a row to one holder after which it is dropped from the fetch (a restart
# takes one or two; a holder that errs on every request is not asked the whole fetch long).
MAX_HOLDER_FAILURES = 3
# Failed requests in a row, over all holders, after which a fetch gives up (each one re-queues its pieces).
MAX_FAILED_REQUESTS = 20


def model_dir_name(manifest: Manifest) -> str:
    """The directory a fetched model gets under models_dir: its label and fingerprint."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", manifest.label).strip("-.")[:80] or "model"
    return f"{label}-{manifest.fingerprint.replace(':', '-')}"


class _Run:
    """Pieces of one file to fetch in one Range request: consecutive indices."""

    def __init__(self, file: str, pieces: list[int]):
        self.file, self.pieces = file, pieces


class PeerModel:
    """A model fetched from peers into ``root``: its manifest, its sparse files and their journals."""

    def __init__(self, root: Path, manifest: Manifest, secret: bytes, node: str, metrics=None, checked: bool = False, sealed: bool = False, ssl: ssl_lib.SSLContext | None = None):
        self.root = root
        self.sealed = sealed  # ring_encryption: its bytes are asked for sealed (models/peers/sealing.py)
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
        async with client_session(ssl) as http:
            manifest = await fetch_manifest(http, holders, secret, node, fingerprint, ssl)
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
            os.close(open_sparse(root / f.name, f.size))
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
                    made.append(f"{holder.node}: {reason(e)}")
                    continue
                now, digest = await asyncio.to_thread(identify, self.path, lambda name, a, b: slices.get((name, a, b)) or pread(self.root / name, a, b))
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

    def _range(self, holder: Holder, path: str, a: int, b: int) -> "RangeReader":
        """A signed GET of bytes [a, b) of ``path`` from ``holder``, sealed if this node asks so."""
        headers = {**sign_files(self.secret, "GET", path, self.node, holder.node, time.time()), "Range": f"bytes={a}-{b - 1}"}
        opener = None
        if self.sealed:
            headers[SEALED_HEADER] = SCHEME
            opener = Opener(self.secret, headers[FILES_NONCE_HEADER], path, a, b - a)
        return RangeReader(holder, path, headers, b - a, opener, holder_tls(holder, self.ssl))

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
                fds[name] = open_sparse(self.root / name, self.manifest.file(name).size)
                await asyncio.to_thread(reserve, fds[name], [self.manifest.file(name).span(i) for i in todo[name]])
            async with client_session(self.ssl) as http:
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
                    raise HolderBusy(retry_after(r.headers.get("retry-after")))
                await r.check(206, f"{run.file} bytes {start}-{end - 1}")
                # One buffer for the stream's pieces (each is written before the next arrives): no
                # fresh pages to fault in per piece.
                buf = memoryview(bytearray(max(f.span(i)[1] - f.span(i)[0] for i in run.pieces)))
                for index in run.pieces:
                    await self._piece(run.file, index, r, buf)
                    done += 1
            self.failures = 0
            self.failed[holder.node] = 0
        except BadPiece as e:
            log.error("%s served a piece that does not match its manifest (%s); it is asked for nothing more", holder.node, e)
            self._refuse(holder, f"it served {e}, which does not match the manifest")
            self._requeue(run, done)
        except BadHolder as e:
            log.error("%s: %s; it is asked for nothing more", holder.node, e)
            self._refuse(holder, str(e))
            self._requeue(run, done)
        except HolderBusy as e:
            self.resting[holder.node] = time.monotonic() + max(e.retry_after, 0.1)
            self._requeue(run, done)
        except Stalled as e:
            # Its socket is open and silent: asking it again costs the same wait, so it is dropped.
            self._drop(holder, run, done, reason(e))
        except Exception as e:  # the link, a restart, or an answer that parses as nothing: whatever a holder sends
            why = reason(e)
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
            theirs = await fetch_manifest(self.http, [holder], self.m.secret, self.m.node, self.m.fingerprint, self.m.ssl)
        except FetchError as e:
            raise HolderFailed(str(e)) from None
        if theirs != self.m.manifest:
            raise BadHolder(f"its manifest of model {self.m.fingerprint} differs from the one this node fetches by")
        self.m.vouched.add(holder.node)

    def _requeue(self, run: _Run, done: int) -> None:
        rest = run.pieces[done:]
        if rest:
            self.queue.append(_Run(run.file, rest))

    async def _piece(self, file: str, index: int, r: "RangeReader", into: memoryview) -> None:
        """Receive one piece into ``into``; then, off the loop and in one go, hash it (BLAKE3 on
        every core) and, if it is the manifest's, write and record it."""
        m, f = self.m, self.m.manifest.file(file)
        a, b = f.span(index)
        buf = into[: b - a]
        await r.fill(buf, f"piece {index} of {file}", piece_deadline(b - a))
        ok = await asyncio.to_thread(check_and_write, self.fds[file], m.journals[file], index, a, buf, f.hashes[index])
        if m.metrics is not None:
            m.metrics.files_fetched(ok, b - a)
        if not ok:
            raise BadPiece(f"piece {index} of {file}")
        self.progress.advance(file, b - a)


def _consecutive(pieces: list[int]) -> list[list[int]]:
    """Runs of consecutive pieces, MAX_RUN_PIECES at most each."""
    runs: list[list[int]] = []
    for i in pieces:
        if runs and i == runs[-1][-1] + 1 and len(runs[-1]) < MAX_RUN_PIECES:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
