"""ringd.models.catalogue: every model on this machine, found in the Ollama store, the Hugging Face
cache and models_dir, each read for its header once, with the scan's work bounded.

The three places are laid out in tmp_path as Ollama, huggingface_hub and a user lay
them out, holding tiny GGUFs written as llama.cpp writes them (tests/kit/ggufmake.py) and
a tiny mlx-lm directory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from devkit.ggufmake import write_gguf
from hypothesis import given
from hypothesis import strategies as st

from ringd.models import catalogue
from ringd.models.catalogue import HUGGING_FACE, MODELS_DIR, OLLAMA, Catalogue
from ringd.models.ollama.store import MODEL_MEDIA_TYPE


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

    # Files that cannot be served (GGUF headers cut short) before a model that serves, in sort
    # order: at most MAX_UNSERVABLE are listed, and they take no room from the models that serve.
    monkeypatch.setattr(catalogue, "MAX_MODELS", 3)
    monkeypatch.setattr(catalogue, "MAX_CACHED_FACTS", 10)
    broken = tmp_path / "broken"
    broken.mkdir()
    for i in range(60):
        (broken / f"a-broken-{i:02d}.gguf").write_bytes(b"GGUF")
    (broken / "z-tiny.gguf").symlink_to(q4)
    c = Catalogue(broken, hf_cache=tmp_path / "no-cache", ollama_store=tmp_path / "no-store")
    listing = c.scan()
    names = [e.name for e in listing.entries]
    assert "z-tiny.gguf" in names and len(names) == catalogue.MAX_UNSERVABLE + 1 and listing.truncated
    assert catalogue.match(listing.entries, "z-tiny").facts.info is not None
    read = c.headers_read  # 61: past MAX_CACHED_FACTS, the cache keeps what this scan read
    c.scan()
    assert c.headers_read == read == 61
    monkeypatch.setattr(catalogue, "MAX_MODELS", 500)

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


@pytest.fixture(scope="module")
def shelf(tiny_model, tmp_path_factory):
    """A catalogue over the three places, holding the names each rule of ``match`` is about."""
    root = tmp_path_factory.mktemp("shelf")
    model = tiny_model(arch="llama", layers=2)
    q8 = write_gguf(model, root / "Tiny-Q8_0.gguf", qtype="q8_0")
    odd = write_gguf(model, root / "odd.gguf", arch="nosucharch")
    store = root / "ollama"
    for name in ("registry.ollama.ai/library/smollm2/latest", "registry.ollama.ai/library/smollm2/q8",
                 "registry.ollama.ai/someone/tiny/q8", "hf.co/someone/Tiny-GGUF/Q8_0", "registry.ollama.ai/library/mine/latest"):  # fmt: skip
        _ollama_pull(store, name, q8)
    cache = root / "hf"
    _hf_cached(cache, "someone/tiny-mlx", {p.name: p for p in model.iterdir() if p.is_file()})
    models = root / "models"
    (models / "vendor" / "deep").mkdir(parents=True)
    (models / "tiny-a").symlink_to(model, target_is_directory=True)
    (models / "mine").symlink_to(model, target_is_directory=True)
    (models / "vendor" / "m.gguf").symlink_to(q8)
    (models / "vendor" / "deep" / "tiny-b").symlink_to(model, target_is_directory=True)
    (models / "odd.gguf").symlink_to(odd)
    c = Catalogue(models, hf_cache=cache, ollama_store=store)
    return c, models


def test_a_name_finds_the_model_it_means_by_each_rule_and_nothing_else(shelf):
    c, models = shelf
    listed = {e.name for e in c.current().entries}
    assert listed == {
        "ollama:smollm2:latest", "ollama:smollm2:q8", "ollama:someone/tiny:q8", "ollama:hf.co/someone/Tiny-GGUF:Q8_0",
        "ollama:mine:latest", "someone/tiny-mlx", "tiny-a", "mine", "vendor/m.gguf", "vendor/deep/tiny-b", "odd.gguf",
    }  # fmt: skip

    def found(name: str) -> str | None:
        e = c.find(name)
        return e and e.name

    # Exactly its name, whatever the place; an exact name comes before any other rule.
    for name in listed:
        assert found(name) == name
    assert found("mine") == "mine" and found("ollama:mine") == "ollama:mine:latest"
    # Ollama's spellings, as `ollama run` takes them, with or without ollama:.
    for name in ("smollm2", "smollm2:latest", "library/smollm2", "library/smollm2:latest", "registry.ollama.ai/library/smollm2:latest",
                 "https://registry.ollama.ai/library/smollm2:latest", "ollama:smollm2", "ollama:registry.ollama.ai/library/smollm2"):  # fmt: skip
        assert found(name) == "ollama:smollm2:latest", name
    assert found("smollm2:q8") == "ollama:smollm2:q8" and found("someone/tiny:q8") == "ollama:someone/tiny:q8"
    assert found("hf.co/someone/Tiny-GGUF:Q8_0") == "ollama:hf.co/someone/Tiny-GGUF:Q8_0"
    # As spelt: the store's folders are (ollama/store.py); a tag or namespace left out means latest and library only.
    assert found("SmolLM2") is None and found("smollm2:Q8") is None and found("someone/tiny") is None and found("tiny:q8") is None
    # A models_dir GGUF without .gguf; not a Hugging Face or Ollama name, nor a directory.
    assert found("vendor/m") == "vendor/m.gguf" and found("odd") == "odd.gguf"
    assert found("vendor/m.GGUF") is None and found("tiny-a.gguf") is None and found("someone/tiny-mlx.gguf") is None
    # Ollama's clients tag an untagged name: NAME:latest finds what NAME finds, whatever the place.
    assert found("tiny-a:latest") == "tiny-a" and found("vendor/m:latest") == "vendor/m.gguf" and found("someone/tiny:latest") is None
    # A model ringd cannot serve is found all the same, with why.
    odd = c.find("odd.gguf")
    assert odd.facts.info is None and "nosucharch" in odd.facts.error
    # Nothing else: not a path, absolute, relative, home or climbing; not a part of a name.
    for name in (str(models / "vendor" / "m.gguf"), str(models / "tiny-a"), "/etc/passwd", "../../x", "~/model", "./tiny-a",
                 "vendor/../tiny-a", "vendor//m.gguf", "vendor/deep", "deep/tiny-b", "tiny-b", "m.gguf", "m", "tiny",
                 "ollama:../../etc/passwd", "ollama:/etc/passwd", "someone/tiny-mlx:Q8_0", "hf.co/someone/tiny-mlx", "",
                 "x" * (catalogue.MAX_NAME_CHARS + 1)):  # fmt: skip
        assert found(name) is None, name


def test_ambiguous_stems_find_nothing_and_a_name_listed_twice_finds_the_first(shelf):
    c, _ = shelf
    m = c.find("vendor/m.gguf")
    entries = [m, replace(m, name="vendor/m.GGUF", path=m.path.with_suffix(".GGUF"))]
    assert catalogue.match(entries, "vendor/m") is None  # two files it could mean: neither
    assert catalogue.match(entries, "vendor/m.GGUF") is entries[1]
    twice = [replace(m, name="a/b", source=HUGGING_FACE), replace(m, name="a/b")]
    assert catalogue.match(twice, "a/b") is twice[0]  # in the order the model list shows them


# Names as clients send them and as attackers do: paths, Ollama spellings, the listed names bent.
_NAME_PARTS = st.sampled_from(["/", "..", ".", "~", ":", "ollama:", "smollm2", "latest", "library", "vendor", "m", ".gguf",
                               "registry.ollama.ai", "https://", "tiny-a", "\x00", "%2e%2e", "\\", "é", " "])  # fmt: skip


@given(name=st.one_of(st.text(), st.lists(_NAME_PARTS, max_size=8).map("".join), st.integers(), st.none()))
def test_any_name_finds_a_listed_model_or_nothing(shelf, name):
    c, _ = shelf
    entries = c.current().entries
    found = catalogue.match(entries, name)
    assert found is None or any(found is e for e in entries)
    if found is not None and found.name != name:  # found by another rule: never by a path's spelling
        assert isinstance(name, str) and not name.startswith(("/", "~", ".")) and ".." not in name.split("/"), name
    # find and lookup answer the same (equal, not the same object: SCAN_TTL_S may pass and a scan run).
    assert c.find(name) == found and asyncio.run(c.lookup(name)) == found


def test_find_and_listing_share_one_listing_and_one_scan_at_a_time(shelf, monkeypatch):
    _, models = shelf
    c = Catalogue(models, hf_cache=models / "no-hf", ollama_store=models / "no-store")
    with ThreadPoolExecutor(8) as pool:  # callers off the loop at once: one scan, each header read once
        found = list(pool.map(c.find, ["tiny-a", "vendor/m", "odd", "nothing"] * 2))
    listing = c.current()
    assert [e and e.name for e in found] == ["tiny-a", "vendor/m.gguf", "odd.gguf", None] * 2
    assert c.headers_read == len(listing.entries) == 5

    # Within SCAN_TTL_S: the same listing, by either path, and no header read again.
    assert asyncio.run(c.listing()) is listing and c.current() is listing
    assert asyncio.run(c.lookup("vendor/deep/tiny-b")).name == "vendor/deep/tiny-b" and c.headers_read == 5
    # Past it: a new scan, whose facts come from the cache of what was read.
    monkeypatch.setattr(catalogue, "SCAN_TTL_S", 0.0)
    assert c.find("tiny-a").name == "tiny-a" and c.current() is not listing and c.headers_read == 5


def test_a_relative_models_dir_names_relative_and_paths_absolute(shelf, monkeypatch):
    _, models = shelf
    monkeypatch.chdir(models.parent)
    c = Catalogue(Path(models.name), hf_cache=models / "no-hf", ollama_store=models / "no-store")
    e = c.find("vendor/m")
    assert (e.name, e.path, e.ref) == ("vendor/m.gguf", models / "vendor" / "m.gguf", str(models / "vendor" / "m.gguf"))
