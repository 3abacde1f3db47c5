"""Every model this node could serve, found where people keep them: the list ``/v1/models``,
``/api/tags`` and ``ringctl models`` show, and the one a request's ``model`` names.

Three places are looked in: the Ollama store (each pulled name, ``ollama:NAME:TAG``), the
Hugging Face cache (each GGUF repository's quants as ``OWNER/REPO:QUANT``, each mlx-lm
repository as ``OWNER/REPO``) and the node's ``models_dir`` (GGUF files and mlx-lm
directories a few folders deep, by their path relative to it: ``vendor/m.gguf``, ``tiny-a``).
Each entry says what a request names it by, what ``--model`` takes for it (``ref``), its
size on disk, quant, architecture and layers, and why it cannot be served when it
cannot (an architecture or tensor type ringd refuses, a partial download);
its ``info`` is what placement needs to say whether the cluster's memory holds it.

The work is bounded whatever the disk holds: a scan looks at no more than
``MAX_SCAN_ENTRIES`` directory entries and lists at most ``MAX_MODELS`` models that serve and
``MAX_UNSERVABLE`` that do not (the listing says when it stopped short or left some out); a GGUF is read for its header only (``gguf/reader.py``),
an mlx-lm directory for its config and safetensors headers, and what was read is kept by
(path, size, mtime) so the next scan reads only what changed. One scan runs at a time and
its listing is kept ``SCAN_TTL_S``, shared by ``listing()`` (async, off the event loop) and
``current()`` (blocking, for a caller already off it).

``find`` and ``lookup`` say which listed model a name means (``match``): the name exactly,
an Ollama model by any spelling ``ollama run`` takes, a models_dir GGUF without its
``.gguf``. A name is only ever compared with what was listed, never opened as a path: a
request's ``model`` comes from any HTTP client, and only what the catalogue found may be
loaded.

It ignores what is loaded and what the cluster holds: marking the one served and the
fit are the views' (``http/``), from the ``info`` each entry carries.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ringd.models.remote import hubref
from ringd.models.ollama import store as ollama
from ringd.models.checkpoint import ModelInfo, WeightBytes, check_supported, read_config, weight_bytes
from ringd.models.errors import ModelError
from ringd.models.naming import LATEST, gguf_stem, ollama_key
from ringd.models.gguf.reader import GgufFile, is_gguf
from ringd.models.source import PEER_RECORD, hf_snapshot

# Directory entries one scan looks at, over all three places: a models_dir of 10k files or a store
# of thousands of names costs a bounded few hundred milliseconds, not a stall.
MAX_SCAN_ENTRIES = 20_000
# Models one listing holds: more than anyone reads in a model picker, and each costs a header read.
MAX_MODELS = 500
# Of them, files that cannot be served (a broken download, an architecture ringd refuses): enough
# to say what is wrong with them, too few for a folder of broken files to crowd out the models
# that serve (they count apart from MAX_MODELS; past this many, the rest are left out).
MAX_UNSERVABLE = 50
# How deep models_dir is searched: DIR/model.gguf, DIR/vendor/model.gguf, DIR/vendor/family/model.gguf.
MAX_DEPTH = 3
# A listing is reused this long: clients poll /v1/models, and disks change on a human scale.
SCAN_TTL_S = 10.0
# What was read of files is kept for this many at most; past it, only what the last scan read is
# kept (files gone or changed since are forgotten), so a folder of broken files is not read again
# each scan.
MAX_CACHED_FACTS = 2 * MAX_MODELS
# A name longer than a path (PATH_MAX) names nothing listed: every listed name is shorter (a models_dir
# name is at most MAX_DEPTH + 1 file names of 255 bytes, an Ollama name 600 characters), so a longer
# one is refused before it is parsed.
MAX_NAME_CHARS = 4096

OLLAMA = "ollama"
HUGGING_FACE = "huggingface"
MODELS_DIR = "models_dir"


@dataclass(frozen=True)
class Facts:
    """What reading a model's header says: format, quant, architecture, layers, and its info
    (None, with ``error`` saying why, when ringd cannot serve it)."""

    format: str  # "gguf" or "mlx"
    quant: str  # Q4_K_M, Q8_0, F16, Q4 (an mlx-lm quantized checkpoint), BF16, ...
    arch: str  # the model_type: llama, qwen3, ... ("" when unreadable)
    layers: int
    info: ModelInfo | None
    error: str = ""


@dataclass(frozen=True)
class Entry:
    name: str  # what a request names it by (a models_dir model: its path relative to models_dir)
    source: str  # OLLAMA, HUGGING_FACE or MODELS_DIR
    path: Path  # absolute
    size: int  # bytes on disk (all parts)
    modified: float  # mtime, seconds since the epoch
    facts: Facts

    @property
    def ref(self) -> str:
        """What ``--model`` (``source.model_info``) takes to load it: its name, but a models_dir
        model's path (its relative name would be read from the working directory, or as a Hub repo id)."""
        return str(self.path) if self.source == MODELS_DIR else self.name

    def to_wire(self) -> dict:
        f = self.facts
        return {
            "name": self.name, "source": self.source, "path": str(self.path), "size": self.size, "modified": self.modified,
            "format": f.format, "quant": f.quant, "architecture": f.arch, "layers": f.layers, "error": f.error,
        }  # fmt: skip


@dataclass
class Listing:
    entries: list[Entry] = field(default_factory=list)
    truncated: bool = False  # a bound was reached: more models may be on disk than are listed
    visited: int = 0  # directory entries looked at
    servable: int = 0  # entries whose facts have an info (the rest say why not)

    def add(self, entry: Entry) -> None:
        """``entry`` listed, unless it cannot be served and MAX_UNSERVABLE such are listed already."""
        if entry.facts.info is not None:
            self.servable += 1
        elif len(self.entries) - self.servable >= MAX_UNSERVABLE:
            self.truncated = True
            return
        self.entries.append(entry)


class Catalogue:
    """The models under ``models_dir``, in the Hugging Face cache ``hf_cache`` and the Ollama store
    ``ollama_store`` (None: where huggingface_hub and Ollama keep them; a place that does not exist
    is skipped)."""

    def __init__(self, models_dir: Path | None, hf_cache: Path | None = None, ollama_store: Path | None = None):
        self.models_dir = models_dir
        self.hf_cache = hf_cache
        self.ollama_store = ollama_store
        self.headers_read = 0  # files read for their facts (the rest came from the cache): for tests
        self._facts: dict[tuple, Facts] = {}
        self._seen: set[tuple] = set()  # the keys of _facts the scan under way read
        self._listing: Listing | None = None
        self._listed_at = -SCAN_TTL_S
        # One scan at a time, whichever thread asks (the loop's worker for listing(), a loader's for
        # find()): a scan fills _facts and the listing. Reentrant: current() holds it around scan().
        self._scan_lock = threading.RLock()
        # Callers on the loop wait here rather than each in a worker thread of its own.
        self._lock = asyncio.Lock()

    async def listing(self) -> Listing:
        """The models, scanned off the event loop (one scan at a time), reused for SCAN_TTL_S."""
        fresh = self._fresh()
        if fresh is not None:
            return fresh
        async with self._lock:
            return await asyncio.to_thread(self.current)

    def current(self) -> Listing:
        """The listing if it is younger than SCAN_TTL_S, else a scan's (blocking: run it off the
        loop); the same listing ``listing()`` answers."""
        with self._scan_lock:
            fresh = self._fresh()
            if fresh is None:
                fresh = self._listing = self.scan()
                self._listed_at = time.monotonic()  # after the listing: see _fresh
            return fresh

    def _fresh(self) -> Listing | None:
        # Lock-free for the loop's fast path: the time is read before the listing, and written after
        # it, so a fresh time never comes with an older listing.
        listed_at = self._listed_at
        listing = self._listing
        return listing if listing is not None and time.monotonic() - listed_at < SCAN_TTL_S else None

    def scan(self) -> Listing:
        """Look in the three places now (blocking: run it off the loop)."""
        with self._scan_lock:
            out = Listing()
            self._seen: set[tuple] = set()
            for place in (self._scan_ollama, self._scan_hf, self._scan_models_dir):
                if not self._room(out):
                    break
                place(out)
            if len(self._facts) > MAX_CACHED_FACTS:
                self._facts = {key: self._facts[key] for key in self._seen}
            return out

    def find(self, name: str) -> Entry | None:
        """The listed model ``name`` means (``match``), from a listing at most SCAN_TTL_S old
        (blocking: a scan may run; call it off the loop). A model put on disk after that listing
        was made is found once the listing is SCAN_TTL_S old: a name not found never starts a
        scan, so any number of unknown names costs no more than one scan each SCAN_TTL_S."""
        return match(self.current().entries, name)

    async def lookup(self, name: str) -> Entry | None:
        """``find`` for a caller on the event loop: the scan and the matching run off it."""
        listing = await self.listing()
        return await asyncio.to_thread(match, listing.entries, name)

    # --- the places -------------------------------------------------------------------

    def _scan_ollama(self, out: Listing) -> None:
        store = self.ollama_store
        if store is None:
            try:
                store = ollama.store_dir()
            except ModelError:
                return  # no Ollama here
        top = store / "manifests"
        for host in self._dirs(top, out):
            for namespace in self._dirs(host, out):
                for model in self._dirs(namespace, out):
                    for tag in self._files(model, out):
                        if not self._room(out):
                            return
                        name = _ollama_name(host.name, namespace.name, model.name, tag.name)
                        try:
                            blob = ollama.resolve(f"{ollama.PREFIX}{host.name}/{namespace.name}/{model.name}:{tag.name}", models_dir=store)
                        except ModelError:
                            continue  # not a model (a manifest of something else, or broken: `ollama list` shows it)
                        self._add_gguf(out, name, OLLAMA, blob, [blob])

    def _scan_hf(self, out: Listing) -> None:
        cache = self.hf_cache
        if cache is None:
            from huggingface_hub import constants

            cache = Path(constants.HF_HUB_CACHE)
        for repo_dir in self._dirs(cache, out):
            if not repo_dir.name.startswith("models--") or not self._room(out):
                continue
            repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
            snapshot = hf_snapshot(repo_dir)
            if snapshot is None:
                continue
            if (snapshot / "config.json").is_file():
                self._add_dir(out, repo, HUGGING_FACE, snapshot)
                continue
            ggufs = [p.relative_to(snapshot).as_posix() for p in self._walk(snapshot, out, 2) if p.name.lower().endswith(".gguf")]
            for first in sorted(f for f in ggufs if hubref.is_model_file(f) and (s := hubref.split_info(f)) and s.index == 1):
                try:
                    parts = hubref.parts(ggufs, first)
                except ModelError:
                    continue  # a split not fully fetched: nothing to serve yet
                quant = hubref.split_info(first).quant
                self._add_gguf(out, f"{repo}:{quant}" if quant else repo, HUGGING_FACE, snapshot / first, [snapshot / p for p in parts])

    def _scan_models_dir(self, out: Listing) -> None:
        if self.models_dir is None:
            return
        root = self.models_dir.absolute()
        for path in self._walk(root, out, MAX_DEPTH, stop_at_models=True):
            if not self._room(out):
                return
            if ((path if path.is_dir() else path.parent) / PEER_RECORD).exists():
                continue  # layers fetched from peers, the rest holes: its fetch serves it, never the list
            # Named as a user names it in a request: relative to models_dir, "/" between folders.
            name = path.relative_to(root).as_posix()
            if path.is_dir():
                self._add_dir(out, name, MODELS_DIR, path)
            elif hubref.is_model_file(path.name) and (s := hubref.split_info(path.name)) and s.index == 1:
                # A split's other parts by their names (not by listing the folder again).
                parts = [path.with_name(f"{s.prefix}-{i:05d}-of-{s.count:05d}{path.suffix}") for i in range(1, s.count + 1)]
                if s.count == 1 or all(p.is_file() for p in parts):
                    self._add_gguf(out, name, MODELS_DIR, path, parts if s.count > 1 else [path])

    # --- bounded walking ---------------------------------------------------------------

    def _room(self, out: Listing) -> bool:
        if out.servable >= MAX_MODELS or out.visited >= MAX_SCAN_ENTRIES:
            out.truncated = True
            return False
        return True

    def _entries(self, folder: Path, out: Listing) -> list[os.DirEntry]:
        found = []
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    if out.visited >= MAX_SCAN_ENTRIES:
                        out.truncated = True
                        break
                    out.visited += 1
                    if not entry.name.startswith("."):
                        found.append(entry)
        except OSError:
            return []
        return sorted(found, key=lambda e: e.name)

    def _dirs(self, folder: Path, out: Listing) -> list[Path]:
        return [Path(e.path) for e in self._entries(folder, out) if e.is_dir()]

    def _files(self, folder: Path, out: Listing) -> list[Path]:
        return [Path(e.path) for e in self._entries(folder, out) if e.is_file()]

    def _walk(self, root: Path, out: Listing, depth: int, stop_at_models: bool = False) -> list[Path]:
        """Files under ``root`` to ``depth`` folders deep; with ``stop_at_models``, a folder holding
        config.json is returned itself (an mlx-lm directory) and not entered."""
        found, level = [], [root]
        for _ in range(depth):
            below = []
            for folder in level:
                entries = self._entries(folder, out)
                if stop_at_models and folder != root and any(e.name == "config.json" for e in entries):
                    found.append(folder)
                    continue
                for e in entries:
                    (below if e.is_dir() else found).append(Path(e.path))
            level = below
        if stop_at_models:  # the deepest level: model directories only
            found += [d for d in level if (d / "config.json").is_file()]
        return found

    # --- reading a model's facts ---------------------------------------------------------

    def _add_gguf(self, out: Listing, name: str, source: str, first: Path, parts: list[Path]) -> None:
        if not self._room(out):
            return
        try:
            stats = [p.stat() for p in parts]
        except OSError:
            return
        if not is_gguf(first):
            return  # no GGUF at all (empty, another format named .gguf): no model to list, nor room to take
        key = ("gguf", str(first), *((s.st_size, s.st_mtime_ns) for s in stats))
        self._seen.add(key)
        facts = self._facts.get(key)
        if facts is None:
            facts = self._facts[key] = self._read_gguf(first)
        out.add(Entry(name, source, first, sum(s.st_size for s in stats), max(s.st_mtime for s in stats), facts))

    def _add_dir(self, out: Listing, name: str, source: str, path: Path) -> None:
        if not self._room(out):
            return
        try:
            weights = sorted(path.glob("*.safetensors"))
            stats = [(path / "config.json").stat(), *(w.stat() for w in weights)]
        except OSError:
            return
        key = ("mlx", str(path), *((s.st_size, s.st_mtime_ns) for s in stats))
        self._seen.add(key)
        facts = self._facts.get(key)
        if facts is None:
            facts = self._facts[key] = self._read_dir(path)
        out.add(Entry(name, source, path, sum(s.st_size for s in stats[1:]), max(s.st_mtime for s in stats), facts))

    def _read_gguf(self, path: Path) -> Facts:
        self.headers_read += 1
        try:
            g = GgufFile.open(path)
            text = check_supported(g.config, path)
        except (ModelError, OSError) as e:
            return Facts("gguf", hubref.split_info(path.name).quant, "", 0, None, str(e))
        layers, embed, norm, head = g.part_bytes()
        info = ModelInfo(
            path=g.path, config=g.config, model_type=g.config["model_type"], num_layers=text["num_hidden_layers"],
            hidden_size=text["hidden_size"], vocab_size=text["vocab_size"],
            context_length=int(text.get("max_position_embeddings") or 4096), fingerprint="",
            weights=WeightBytes(tuple(layers), embed, norm, head),
        )  # fmt: skip
        return Facts("gguf", gguf_quant(g), info.model_type, info.num_layers, info)

    def _read_dir(self, path: Path) -> Facts:
        self.headers_read += 1
        try:
            config = read_config(path)
            text = check_supported(config, path / "config.json")
            info = ModelInfo(
                path=path, config=config, model_type=config.get("model_type", "?"), num_layers=text["num_hidden_layers"],
                hidden_size=text["hidden_size"], vocab_size=text["vocab_size"],
                context_length=int(text.get("max_position_embeddings") or 4096), fingerprint="",
                weights=weight_bytes(path, text["num_hidden_layers"]),
            )  # fmt: skip
        except (ModelError, OSError, ValueError) as e:
            return Facts("mlx", "", "", 0, None, str(e))
        return Facts("mlx", mlx_quant(config), info.model_type, info.num_layers, info)


def match(entries: Sequence[Entry], name: str) -> Entry | None:
    """The entry ``name`` means, by the first rule that finds one: an entry named exactly ``name``
    (the first listed, if two are); an Ollama model by any spelling Ollama takes for it (``smollm2``,
    ``library/smollm2:latest``, ``registry.ollama.ai/library/smollm2:latest``, each with or without
    ``ollama:``); a models_dir GGUF by its name without ``.gguf`` (``vendor/m`` for ``vendor/m.gguf``),
    when only one has that name; and by each of these, ``NAME:latest`` what ``NAME`` finds (Ollama's
    clients tag an untagged name). Else None. An entry ringd cannot serve (``facts.info`` None) is
    found all the same: its ``facts.error`` says why, which the caller reports.

    ``name`` comes from any HTTP client. It is only compared with the names listed, never made
    into a path or looked up on disk: ``/etc/passwd``, ``../x`` or ``~/m`` finds nothing (no
    listed name is absolute or has ``..`` in it), so only what the catalogue found can be loaded.
    """
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        return None
    found = _match(entries, name)
    if found is None and name.endswith(LATEST):
        found = _match(entries, name.removesuffix(LATEST))
    return found


def _match(entries: Sequence[Entry], name: str) -> Entry | None:
    for e in entries:
        if e.name == name:
            return e
    wanted = ollama_key(name)
    if wanted is not None:
        for e in entries:
            if e.source == OLLAMA and ollama_key(e.name) == wanted:
                return e
    stems = [e for e in entries if e.source == MODELS_DIR and gguf_stem(e.name) == name]
    return stems[0] if len(stems) == 1 else None


def gguf_quant(g: GgufFile) -> str:
    """A GGUF's quant as llama.cpp names file types (Q4_K_M): its general.file_type, else the type
    most of its weight matrices have."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(g.meta["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (KeyError, ValueError, TypeError):
        kinds = Counter(t.type for t in g.tensors.values() if len(t.shape) >= 2)
        return kinds.most_common(1)[0][0] if kinds else ""


def mlx_quant(config: dict) -> str:
    """An mlx-lm checkpoint's quantization as Ollama names levels (Q4), or its float type (BF16)."""
    q = config.get("quantization")
    if isinstance(q, dict) and isinstance(q.get("bits"), int):
        return f"Q{q['bits']}"
    dtype = config.get("torch_dtype") or config.get("dtype")
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(str(dtype), "")


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """``ollama:`` and the name as ``ollama list`` shows it: the default host and namespace left out."""
    name = f"{model}:{tag}"
    if host != ollama.DEFAULT_HOST:
        name = f"{host}/{namespace}/{name}"
    elif namespace != ollama.DEFAULT_NAMESPACE:
        name = f"{namespace}/{name}"
    return ollama.PREFIX + name
