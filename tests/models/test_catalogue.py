"""ringd.models.catalogue: every model on this machine, found in the Ollama store, the Hugging Face
cache and models_dir, each read for its header once, with the scan's work bounded.

The three places are laid out in tmp_path as Ollama, huggingface_hub and a user lay
them out, holding tiny GGUFs written as llama.cpp writes them (tests/ggufmake.py) and
a tiny mlx-lm directory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from pathlib import Path

from ggufmake import write_gguf

from ringd.models import catalogue
from ringd.models.catalogue import HUGGING_FACE, MODELS_DIR, OLLAMA, Catalogue
from ringd.models.ollama import MODEL_MEDIA_TYPE


def _ollama_pull(store: Path, name: str, gguf: Path) -> None:
    """A manifest at manifests/<name> naming ``gguf`` as its model blob, as `ollama pull` writes them."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = store / "manifests" / name
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [{"mediaType": MODEL_MEDIA_TYPE, "digest": f"sha256:{digest}", "size": len(data)}]}))


def _hf_cached(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """``files`` (repository path -> source) in a snapshot of ``repo``, linked into blobs/ as
    huggingface_hub caches them, refs/main naming the snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / ("c0ffee" * 6 + "abcd")
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(snapshot.name)
    (root / "blobs").mkdir()
    for name, source in files.items():
        blob = root / "blobs" / hashlib.sha256(str(source).encode()).hexdigest()
        blob.write_bytes(source.read_bytes())
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(blob)
    return snapshot


def test_the_three_places_listed_once_read_and_bounded(tiny_model, tmp_path, monkeypatch):
    model = tiny_model(arch="llama", layers=2)
    q8 = write_gguf(model, tmp_path / "Tiny-Q8_0.gguf", qtype="q8_0")
    q4 = write_gguf(model, tmp_path / "Tiny-Q4_0.gguf", qtype="q4_0")
    odd = write_gguf(model, tmp_path / "odd.gguf", arch="nosucharch")

    store = tmp_path / "ollama"
    _ollama_pull(store, "registry.ollama.ai/library/tiny/latest", q8)
    _ollama_pull(store, "hf.co/someone/Tiny-GGUF/Q4_0", q4)
    cache = tmp_path / "hf"
    gguf_repo = _hf_cached(cache, "someone/Tiny-GGUF", {"Tiny-Q8_0.gguf": q8, "Tiny-Q4_0.gguf": q4, "mmproj-Tiny-F16.gguf": q8})
    mlx_repo = _hf_cached(cache, "someone/tiny-mlx", {p.name: p for p in model.iterdir() if p.is_file()})
    models = tmp_path / "models"
    (models / "vendor" / "family").mkdir(parents=True)
    (models / "vendor" / "family" / "Tiny-Q4_0.gguf").symlink_to(q4)
    (models / "odd.gguf").symlink_to(odd)
    (models / "mine").symlink_to(model, target_is_directory=True)
    for i in (1, 2):
        (models / f"Big-Q8_0-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    junk = models / "junk"
    junk.mkdir()
    for i in range(2000):  # a folder of other things: looked at (bounded), never read
        (junk / f"notes-{i}.txt").touch()

    c = Catalogue(models, hf_cache=cache, ollama_store=store)
    listing = c.scan()
    by_name = {e.name: e for e in listing.entries}
    assert not listing.truncated and listing.visited > 2000
    assert sorted(by_name) == sorted([
        "ollama:tiny:latest", "ollama:hf.co/someone/Tiny-GGUF:Q4_0",
        "someone/Tiny-GGUF:Q4_0", "someone/Tiny-GGUF:Q8_0", "someone/tiny-mlx",
        "vendor/family/Tiny-Q4_0.gguf", "odd.gguf", "mine", "Big-Q8_0-00001-of-00002.gguf",
    ])  # fmt: skip
    tiny = by_name["ollama:tiny:latest"]
    assert (tiny.source, tiny.facts.format, tiny.facts.quant, tiny.facts.arch, tiny.facts.layers) == (OLLAMA, "gguf", "Q8_0", "llama", 2)
    assert tiny.size == q8.stat().st_size and tiny.facts.info.weights.layers and not tiny.facts.error
    hub = by_name["someone/Tiny-GGUF:Q4_0"]
    assert (hub.source, hub.path, hub.facts.quant) == (HUGGING_FACE, gguf_repo / "Tiny-Q4_0.gguf", "Q4_0")
    mlx = by_name["someone/tiny-mlx"]
    assert (mlx.source, mlx.path, mlx.facts.format, mlx.facts.arch, mlx.facts.layers) == (HUGGING_FACE, mlx_repo, "mlx", "llama", 2)
    assert mlx.size == sum(p.stat().st_size for p in model.glob("*.safetensors"))
    # A models_dir model by its path relative to models_dir; its row keeps the whole path, which
    # --model takes (its ref), as it takes the other places' names.
    mine = by_name["mine"]
    assert (mine.source, mine.path, mine.ref, mine.facts.format) == (MODELS_DIR, models / "mine", str(models / "mine"), "mlx")
    assert by_name["vendor/family/Tiny-Q4_0.gguf"].path == models / "vendor" / "family" / "Tiny-Q4_0.gguf"
    assert (tiny.ref, hub.ref) == ("ollama:tiny:latest", "someone/Tiny-GGUF:Q4_0")
    # What cannot be served is listed with the reason, in one line.
    assert "nosucharch" in by_name["odd.gguf"].facts.error and by_name["odd.gguf"].facts.info is None
    big = by_name["Big-Q8_0-00001-of-00002.gguf"]
    # A split's parts as one model (here two stubs of 4 bytes, which no GGUF reader can read).
    assert big.size == 8 and "not a readable GGUF file" in big.facts.error and big.facts.quant == "Q8_0"
    assert set(tiny.to_wire()) >= {"name", "source", "path", "size", "format", "quant", "architecture", "layers", "error"}

    # The next scan reads no header again; a file that changed is read again, alone.
    read = c.headers_read
    assert [e.name for e in c.scan().entries] == [e.name for e in listing.entries] and c.headers_read == read
    os.utime(models / "vendor" / "family" / "Tiny-Q4_0.gguf", ns=(1, 1))  # the target's mtime: its facts' key
    c.scan()
    assert c.headers_read == read + 1

    # Bounds: past MAX_MODELS or MAX_SCAN_ENTRIES the listing stops, and says so.
    monkeypatch.setattr(catalogue, "MAX_MODELS", 3)
    short = Catalogue(models, hf_cache=cache, ollama_store=store).scan()
    assert short.truncated and len(short.entries) == 3
    monkeypatch.setattr(catalogue, "MAX_MODELS", 500)
    monkeypatch.setattr(catalogue, "MAX_SCAN_ENTRIES", 100)
    short = Catalogue(models, hf_cache=cache, ollama_store=store).scan()
    assert short.truncated and short.visited == 100

    # listing(): the scan runs off the event loop, once for callers that ask at the same time.
    threads = []
    scan = Catalogue.scan

    def recording(self):
        threads.append(threading.current_thread())
        return scan(self)

    monkeypatch.setattr(Catalogue, "scan", recording)
    fresh = Catalogue(None, hf_cache=cache, ollama_store=tmp_path / "no-store")

    async def twice():
        return await asyncio.gather(fresh.listing(), fresh.listing())

    first, second = asyncio.run(twice())
    assert first is second and len(threads) == 1 and threads[0] is not threading.main_thread()
    assert sorted(e.name for e in first.entries) == ["someone/Tiny-GGUF:Q4_0", "someone/Tiny-GGUF:Q8_0", "someone/tiny-mlx"]
