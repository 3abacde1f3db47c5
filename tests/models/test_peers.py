"""ringd.models.peers against real holders: a stage's share of the real SmolLM2, checked and resumed.

Holders are ringd's own file routes (http/files.py) served by aiohttp on loopback,
under uvloop as a daemon runs them;
the fetcher is ``PeerModel`` as a daemon runs it (and, for kill -9, in a process of
its own). The model is the real SmolLM2, as its GGUF file and as the mlx-lm
directory ``ringd convert`` makes of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
import uvloop
from devkit.fileholder import SECRET, TLS, HolderNode, holder

from ringd.security.auth import sign_files
from ringd.base.metrics import Metrics
from ringd.models.peers.manifest import FILES_PREFIX
from ringd.models.peers import FetchError, Holder, PeerModel
from ringd.models.progress import LoadProgress
from ringd.stage.shard import Shard
from ringd.security.tls import client_context, trusting

LAYERS = 30  # SmolLM2's
MIDDLE = (10, 20)  # the middle stage of three


def served(node: HolderNode) -> float:
    return node.metrics.registry.get_sample_value("ringd_files_served_bytes_total", {"node": node.name}) or 0.0


def disk_bytes(root: Path) -> int:
    """What a directory's files take on disk (holes take nothing)."""
    return sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())


@pytest.fixture(params=["gguf", "dir"])
def model(request, smollm2_gguf, smollm2_dir) -> Path:
    return smollm2_gguf if request.param == "gguf" else smollm2_dir


def test_a_stage_fetches_its_share_checked_and_loads_what_the_whole_model_computes(model, tmp_path):
    async def main():
        async with holder("node0", model, tmp_path / "cache") as (h, node):
            fetched = await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1")
            await fetched.ensure(*MIDDLE, LAYERS, [h], LoadProgress(*MIDDLE))
            return fetched, served(node)

    fetched, sent = uvloop.run(main())
    # Its share: the stage's tensors, and the header and metadata files.
    need = fetched.stage_ranges(*MIDDLE, LAYERS)
    share = sum(b - a for spans in need.values() for a, b in spans)
    meta = sum(f.head for f in fetched.manifest.files)
    whole = fetched.manifest.total_bytes
    assert fetched.held_bytes() <= 1.2 * (share + meta), (fetched.held_bytes(), share, meta)
    assert disk_bytes(fetched.root) <= 1.2 * (share + meta) + 1_000_000 and disk_bytes(fetched.root) < whole / 2
    assert sent <= 1.2 * (share + meta)
    # Every byte of its share is the holder's, and the stage computes what the whole model's does.
    src = model if model.is_dir() else model.parent
    for name, spans in need.items():
        with open(src / name, "rb") as a, open(fetched.root / name, "rb") as b:
            for x, y in spans:
                a.seek(x), b.seek(x)
                assert a.read(y - x) == b.read(y - x), f"{name} [{x}, {y})"
    mine, theirs = Shard.load(str(fetched.path), *MIDDLE), Shard.load(str(model), *MIDDLE)
    h = mx.random.normal((1, 5, mine.info.hidden_size), key=mx.random.key(1)).astype(mx.float32)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    assert mx.array_equal(mine(tokens, h, mine.make_cache()), theirs(tokens, h, theirs.make_cache()))
    assert mine.info.fingerprint == theirs.info.fingerprint


def _flip_every_piece(path: Path, bounds: tuple[int, ...], spans: list[tuple[int, int]]) -> None:
    """Bit rot: a byte of every piece of ``spans`` changed, the file's times kept (its manifest stands)."""
    st = path.stat()
    with open(path, "r+b") as f:
        for a, b in spans:
            for at in [x for x in bounds if a <= x < b] or [a]:
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_holder_that_serves_a_bad_byte_is_refused_named_and_another_asked(smollm2_gguf, tmp_path, caplog):
    good_copy, bad_copy = tmp_path / "good" / smollm2_gguf.name, tmp_path / "bad" / smollm2_gguf.name
    for copy in (good_copy, bad_copy):
        copy.parent.mkdir()
        shutil.copy2(smollm2_gguf, copy)

    async def main():
        async with holder("rotten", bad_copy, tmp_path / "cache-bad") as (bad, bad_node), holder("sound", good_copy, tmp_path / "cache-good") as (good, _):
            alone = await PeerModel.bootstrap(tmp_path / "models-a", [bad], SECRET, "node1")  # headers: not rotten
            need = alone.stage_ranges(*MIDDLE, LAYERS)
            _flip_every_piece(bad_copy, alone.manifest.file(bad_copy.name).bounds, need[bad_copy.name])
            # The rotten holder alone: nothing bad is written, and the fetch names it.
            with pytest.raises(FetchError, match="rotten"):
                await alone.ensure(*MIDDLE, LAYERS, [bad], LoadProgress(*MIDDLE))
            assert not alone.missing(need) == {} and all(i not in alone.journals[bad_copy.name].done for i in alone.missing(need)[bad_copy.name])
            # With a sound holder beside it: the rotten one is tried first, refused, and the sound one serves.
            both = await PeerModel.bootstrap(tmp_path / "models-b", [bad, good], SECRET, "node1")
            await both.ensure(*MIDDLE, LAYERS, [bad, good], LoadProgress(*MIDDLE))
            return both, need

    with caplog.at_level(logging.ERROR, logger="ringd.models.peers"):
        both, need = uvloop.run(main())
    assert "rotten" in both.refused and any("rotten served a piece" in r.getMessage() for r in caplog.records)
    with open(smollm2_gguf, "rb") as a, open(both.path, "rb") as b:
        for x, y in need[smollm2_gguf.name]:
            a.seek(x), b.seek(x)
            assert a.read(y - x) == b.read(y - x)


def test_files_that_are_not_the_model_their_fingerprint_names_are_refused_before_anything_loads(smollm2_dir, tmp_path, monkeypatch):
    """A member serving other weights as a model (a fine-tune as its base, say): its manifest is
    true to its bytes, its fingerprint is not. ringd's own holder will not (manifest.build checks
    its files against the fingerprint it loaded), so this one's build is told they match."""
    from ringd.models.peers import manifest as manifests
    from ringd.models.fingerprint import digest_samples, identify
    from ringd.models.source import read_record

    other = tmp_path / "other"
    shutil.copytree(smollm2_dir, other)
    for name, spans in digest_samples(other).items():  # a byte of weights where the digest reads
        _flip_every_piece(other / name, (), [spans[len(spans) // 2]])
    claimed = identify(smollm2_dir)
    assert identify(other) != claimed
    monkeypatch.setattr(manifests, "identify", lambda path, read=None, digest=None: claimed)

    async def main():
        async with holder("liar", other, tmp_path / "cache", fingerprint=claimed[0]) as (h, _):
            with pytest.raises(FetchError, match="liar: its files make") as e:
                await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1", fingerprint=claimed[0])
            return str(e.value)

    message = uvloop.run(main())
    assert claimed[0] in message and "nothing of it is loaded" in message
    [root] = (tmp_path / "models").iterdir()
    assert read_record(root) is None and PeerModel.open(root, SECRET, "node1") is None  # nor taken at a restart


def test_a_hub_snapshot_is_checked_by_its_commit_and_config(tiny_model, tmp_path):
    """A holder that fetched the model from the Hub fingerprinted it by the snapshot's commit, not
    by bytes: a fetcher makes that fingerprint again from the config it fetched."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model(arch="llama"), snapshot)

    async def main():
        async with holder("node0", snapshot, tmp_path / "cache") as (h, _):
            return await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1")

    fetched = uvloop.run(main())
    assert fetched.manifest.digest == "hub:models--org--tiny@0123abcd" and fetched.checked
    assert PeerModel.open(fetched.root, SECRET, "node1") is not None


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_without_the_cluster_secret_no_byte_of_any_file(smollm2_gguf, tmp_path):
    data = smollm2_gguf.read_bytes()

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache") as (h, _):
            fp = h.model
            manifest = f"{FILES_PREFIX}/{fp}/manifest"
            file = f"{FILES_PREFIX}/{fp}/data/{smollm2_gguf.name}"
            url = lambda path: f"http://{h.http}{path}"  # noqa: E731
            answers = {}
            run = lambda *a: asyncio.to_thread(_get, *a)  # noqa: E731
            answers["no proof"] = await run(url(file), {"Range": "bytes=0-1000000"})
            answers["manifest, no proof"] = await run(url(manifest))
            answers["another secret"] = await run(url(file), {**sign_files(b"t" * 32, "GET", file, "x", "node0", time.time()), "Range": "bytes=0-100"})
            answers["for another node"] = await run(url(file), {**sign_files(SECRET, "GET", file, "x", "node9", time.time()), "Range": "bytes=0-100"})
            answers["stale"] = await run(url(file), {**sign_files(SECRET, "GET", file, "x", "node0", time.time() - 3600), "Range": "bytes=0-100"})
            signed = sign_files(SECRET, "GET", manifest, "x", "node0", time.time())
            async with asyncio.timeout(120):  # a generous deadline for the holder to build the manifest
                while (ok := await run(url(manifest), signed))[0] == 503:  # building it; the nonce may be reused only while refused
                    await asyncio.sleep(0.2)
                    signed = sign_files(SECRET, "GET", manifest, "x", "node0", time.time())
            answers["replayed"] = await run(url(manifest), signed)
            return ok, answers

    ok, answers = uvloop.run(main())
    assert ok[0] == 200
    statuses = {k: v[0] for k, v in answers.items()}
    assert statuses == {"no proof": 401, "manifest, no proof": 401, "another secret": 403, "for another node": 403, "stale": 401, "replayed": 401}
    for status, body in answers.values():  # an error in words; never a byte of the file
        assert len(body) < 1000 and body[:64] not in data and json.loads(body)["error"]["message"]


FETCHER = """
import asyncio, sys, uvloop
from pathlib import Path
from ringd.models.peers import Holder, PeerModel
from ringd.models.progress import LoadProgress
h = Holder("node0", sys.argv[1], sys.argv[2])
async def main():
    m = await PeerModel.bootstrap(Path(sys.argv[3]), [h], b"s" * 32, "node1")
    await m.ensure(10, 20, 30, [h], LoadProgress(10, 20))
uvloop.run(main())
print("done")
# Ended as ringd serve ends (cli.py): the GGUF layout was built on an executor thread, whose
# MLX state torn down as the interpreter finalizes would abort the process.
from ringd.app.cli import _exit_stopped
_exit_stopped(0)
"""


class Throttle:
    """A TCP relay toward a port that passes the answers at ``rate`` bytes/s, ``chunk`` bytes
    at a time, and counts them. With ``hold_at``, it stops passing answers before their count
    would pass that many bytes (``holding`` is set) until ``release()``."""

    def __init__(self, target: int, rate: float, chunk: int = 64 * 1024, hold_at: float | None = None):
        self.target, self.rate, self.chunk, self.bytes, self.hold_at = target, rate, chunk, 0, hold_at
        self.holding = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    async def _listen(self) -> int:
        self._released = asyncio.Event()
        self.server = await asyncio.start_server(self._on, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def release(self):
        """Pass answers again, with no more holding."""
        self.loop.call_soon_threadsafe(self._released.set)

    async def _on(self, r, w):
        tr, tw = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src, dst, slow):
            try:
                while data := await src.read(self.chunk if slow else 64 * 1024):
                    if slow:
                        if self.hold_at is not None and not self._released.is_set() and self.bytes + len(data) > self.hold_at:
                            self.holding.set()
                            await self._released.wait()
                        self.bytes += len(data)
                        await asyncio.sleep(len(data) / self.rate)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(r, tw, False), pipe(tr, w, True))

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)


def test_a_manifest_that_arrives_in_pieces_is_read_whole_before_its_signature_is_checked(smollm2_dir, tmp_path):
    """An answer split over many TCP segments (a slow link; a CI run lost a node to a manifest
    read in part and so 'not signed') is read to its end, then checked."""

    async def main():
        async with holder("node0", smollm2_dir, tmp_path / "cache") as (h, _):
            throttle = Throttle(int(h.http.rsplit(":", 1)[1]), rate=2e6, chunk=512)
            try:
                relayed = Holder(h.node, f"127.0.0.1:{throttle.port}", h.model)
                return h, await PeerModel.bootstrap(tmp_path / "models", [relayed], SECRET, "node1"), throttle.bytes
            finally:
                throttle.close()

    h, fetched, relayed = uvloop.run(main())
    assert fetched.manifest.fingerprint == h.model and relayed > 4 * 512


def test_kill_9_halfway_and_the_restart_fetches_only_what_is_missing(smollm2_gguf, tmp_path):
    """The bytes the holder sends over both runs are the stage's share and at most a piece per file more."""
    ready, stop = threading.Event(), threading.Event()
    box = {}

    def serve_holder():
        async def main():
            async with holder("node0", smollm2_gguf, tmp_path / "cache") as (h, node):
                box["holder"], box["node"] = h, node
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.05)

        uvloop.run(main())

    threading.Thread(target=serve_holder, daemon=True).start()
    assert ready.wait(60)
    h = box["holder"]
    # 20 MB/s, and nothing past about half of the middle stage's share (SmolLM2: ~24 MB) until
    # the first fetcher is killed: it is killed halfway however slowly or quickly it runs.
    throttle = Throttle(int(h.http.rsplit(":", 1)[1]), rate=20e6, hold_at=12e6)
    models = tmp_path / "models"
    cmd = [sys.executable, "-c", FETCHER, f"127.0.0.1:{throttle.port}", h.model, str(models)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    try:
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not throttle.holding.wait(0.05):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the fetch did not get halfway"
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        halfway = throttle.bytes
        throttle.release()
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0 and "done" in second.stdout, second.stderr[-3000:]
    finally:
        throttle.close()
        stop.set()
    fetched = PeerModel.open(next(models.iterdir()), SECRET, "node1")
    share = sum(b - a for spans in fetched.stage_ranges(*MIDDLE, LAYERS).values() for a, b in spans) + sum(f.head for f in fetched.manifest.files)
    piece = max(b - a for f in fetched.manifest.files for a, b in zip(f.bounds, f.bounds[1:]))
    total = throttle.bytes
    assert halfway < share < total, (halfway, share, total)
    # The share, and one piece per file again at most (the one under way when it was killed);
    # the slices the fingerprint's check reads, asked once; HTTP's own bytes besides.
    slices = sum(b - a for spans in fetched._digest_spans().values() for a, b in spans)
    assert fetched.checked and slices <= 300_000
    assert total <= share + piece * len(fetched.manifest.files) + slices + 200_000, (total, share, piece)
    assert fetched.missing(fetched.stage_ranges(*MIDDLE, LAYERS)) == {smollm2_gguf.name: []}


def fetcher_config(models: Path):
    """node1's config as ``ringd serve --model-from-peers true`` reads it: no model, models kept in
    ``models``, no discovery, one peer where nobody listens (holders come from the test)."""
    import argparse

    from ringd.node import config
    from devkit.ports import port

    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    argv = ["--name", "node1", "--model-from-peers", "true", "--models-dir", str(models), "--discovery", "off", "--peer", f"127.0.0.1:{port()}"]
    return config.load(parser.parse_args(argv), {})


def test_a_node_restarted_while_no_holder_answers_starts_with_what_it_fetched(smollm2_gguf, tmp_path):
    from ringd.node.holders import model_from_peers

    async def fetch_once():
        async with holder("node0", smollm2_gguf, tmp_path / "cache") as (h, _):
            m = await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1")
            await m.ensure(*MIDDLE, LAYERS, [h], LoadProgress(*MIDDLE))
            return m

    fetched = uvloop.run(fetch_once())
    again = uvloop.run(model_from_peers(fetcher_config(tmp_path / "models"), SECRET, Metrics("node1")))
    assert again is not None and again.root == fetched.root and again.manifest == fetched.manifest
    assert again.missing(again.stage_ranges(*MIDDLE, LAYERS)) == {smollm2_gguf.name: []}


def test_a_fetch_that_fails_is_said_and_tried_again_and_the_node_carries_on(smollm2_gguf, tmp_path, monkeypatch, caplog):
    """The holder a probe found is gone when its manifest is asked for (its Mac went to sleep):
    the node says why and asks again, and fetches from the holder found next."""
    from ringd.node import holders
    from devkit.ports import port

    cfg = fetcher_config(tmp_path / "models")
    monkeypatch.setattr(holders, "PROBE_RETRY_S", 0.1)

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache") as (h, _):
            asleep = Holder(h.node, f"127.0.0.1:{port()}", h.model)  # nobody listens there
            found = iter([[asleep], [h]])

            async def find(*_args, **_kw):  # the probe's answers (real probes: tests/cluster/test_holders.py)
                return next(found)

            monkeypatch.setattr(holders, "find_holders", find)
            return h, await holders.model_from_peers(cfg, SECRET, Metrics("node1"))

    with caplog.at_level(logging.WARNING, logger="ringd.node.holders"):
        h, fetched = uvloop.run(main())
    assert fetched is not None and fetched.manifest.fingerprint == h.model
    assert any("no holder answered with the model's manifest: node0" in r.getMessage() and "asking again" in r.getMessage() for r in caplog.records)


def test_a_retry_after_is_taken_as_seconds_or_a_date_bounded_and_anything_else_as_the_default():
    """Whatever a holder puts in Retry-After: a number of seconds in [0, MAX_RETRY_AFTER_S], never an
    exception (before, "soon" raised, "nan" never came round, "1e308" slept forever)."""
    from email.utils import format_datetime
    from datetime import datetime, timezone

    from ringd.models.peers import HOLDER_RETRY_S, MAX_RETRY_AFTER_S, retry_after

    now = 1_800_000_000.0
    date = lambda s: format_datetime(datetime.fromtimestamp(now + s, timezone.utc), usegmt=True)  # noqa: E731
    assert retry_after("3", now) == 3.0 and retry_after(" 0.5 ", now) == 0.5 and retry_after("0", now) == 0.0
    assert retry_after("86400", now) == MAX_RETRY_AFTER_S and retry_after("9" * 12, now) == MAX_RETRY_AFTER_S
    assert retry_after(date(7), now) == 7.0 and retry_after(date(-60), now) == 0.0 and retry_after(date(10**6), now) == MAX_RETRY_AFTER_S
    for lie in [None, "", "soon", "nan", "NaN", "inf", "-inf", "-1", "1e308", "1e3", "0x10", "3 s", "1" * 400, "Sun, 99 Foo 2026 99:99:99 GMT", "\x00", "٣"]:
        assert retry_after(lie, now) == HOLDER_RETRY_S, lie


def test_with_ring_encryption_a_stage_fetches_its_share_sealed_and_a_fetcher_without_it_is_told(smollm2_gguf, tmp_path):
    """A holder with ring_encryption sends a fetcher with it the stage's share sealed, opened and checked
    piece by piece; a fetcher without it gets nothing, and a FetchError that says to turn it on."""

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache", sealed=True) as (h, _):
            fetched = await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1", sealed=True)
            await fetched.ensure(*MIDDLE, LAYERS, [h], LoadProgress(*MIDDLE))
            with pytest.raises(FetchError, match="turn ring_encryption on on the fetching node too"):
                await PeerModel.bootstrap(tmp_path / "clear", [h], SECRET, "node2")
            return fetched

    fetched = uvloop.run(main())
    need = fetched.stage_ranges(*MIDDLE, LAYERS)
    assert fetched.missing(need) == {name: [] for name in need}
    with open(smollm2_gguf, "rb") as a, open(fetched.path, "rb") as b:
        for x, y in need[smollm2_gguf.name]:
            a.seek(x), b.seek(x)
            assert a.read(y - x) == b.read(y - x), f"[{x}, {y})"


def test_from_a_holder_whose_api_speaks_tls_a_stage_fetches_over_https_checked_by_the_cluster_ca(smollm2_gguf, tmp_path):
    """A holder with ``tls: auto`` serves its files on its https API: the fetcher reaches it with
    the node's client context (the cluster CA), sealed as well with ring_encryption; a context that
    trusts another CA gets no byte."""

    async def main():
        async with holder("node0", smollm2_gguf, tmp_path / "cache", tls=True, sealed=True) as (h, node):
            assert h.https
            with pytest.raises(FetchError, match="(?i)certificate"):
                await PeerModel.bootstrap(tmp_path / "untrusting", [h], SECRET, "node2", sealed=True, ssl=trusting(b""))
            fetched = await PeerModel.bootstrap(tmp_path / "models", [h], SECRET, "node1", sealed=True, ssl=client_context(TLS))
            await fetched.ensure(*MIDDLE, LAYERS, [h], LoadProgress(*MIDDLE))
            return fetched, served(node)

    fetched, sent = uvloop.run(main())
    need = fetched.stage_ranges(*MIDDLE, LAYERS)
    assert fetched.missing(need) == {name: [] for name in need} and sent > 0
    with open(smollm2_gguf, "rb") as a, open(fetched.path, "rb") as b:
        for x, y in need[smollm2_gguf.name]:
            a.seek(x), b.seek(x)
            assert a.read(y - x) == b.read(y - x), f"[{x}, {y})"
