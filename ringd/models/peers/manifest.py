"""A model's files as a holder serves them to its peers, and the byte ranges a stage needs of them.

The manifest lists every file of a checkpoint (an mlx-lm directory, or one GGUF
file) with its size, the bytes at its start that every fetcher takes (a weights
file's header: what it holds and where; any other file, config or tokenizer,
whole), and its pieces, each with a BLAKE3 hash: a weights file is cut where its
tensors start (so a stage fetches its own tensors and not a byte more, however
the file orders them), and no piece is longer than MAX_PIECE_BYTES. A fetcher
checks each piece against its hash before the piece is written, so a byte that
went bad on a holder's disk never reaches a stage. The holder makes it once per checkpoint (reading
every byte: minutes for a model of hundreds of GB) and keeps it in ringd's cache
while the files keep their sizes and times.

Which bytes a stage needs (``stage_ranges``) follows the rule a stage loads by
(``checkpoint.stage_keeps``): the tensors of its layers, and the embeddings,
final norm or head where its place in the ring needs them. Everything here but
``build`` and ``cached`` (which read files: run them off the event loop) is
pure, and ``Manifest.from_wire`` refuses anything a holder would not write.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from blake3 import blake3

from ringd.models.checkpoint import NON_WEIGHT_PATTERNS, stage_keeps
from ringd.models.errors import ModelError
from ringd.models.fingerprint import identify
from ringd.models.gguf.reader import CONFIG_TENSORS, GgufFile

# A piece is what a fetcher checks, writes and records at once, and what a fetch stopped
# by kill -9 may have to fetch again per file: a tensor, or MAX_PIECE_BYTES of a longer one
# or of another file (tens of milliseconds of a LAN and of SHA-256, and what a fetcher
# holds in memory per stream). A holder's manifest may cut pieces up to
# MAX_ACCEPTED_PIECE_BYTES; a fetcher refuses longer ones.
MAX_PIECE_BYTES = 16 * 1024 * 1024
MAX_ACCEPTED_PIECE_BYTES = 64 * 1024 * 1024
# Bounds on what a manifest may declare (from_wire): far past any checkpoint.
MAX_FILES = 4096
MAX_FILE_BYTES = 2**44  # 16 TiB
MAX_PIECES = 2_000_000  # all files together: a model of tens of thousands of tensors, split
MAX_NAME_CHARS = 255
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MANIFEST_VERSION = 2  # 2: the weights' digest
# A weights digest: "local:" or "gguf:" and a SHA-256, or "hub:" and a repo's cache folder and commit.
MAX_DIGEST_CHARS = 512
# Each piece's hash: BLAKE3, 32 bytes in hex. A fetcher hashes every byte it receives; BLAKE3
# does it several times as fast as SHA-256, so on a fast link checking costs little throughput.
HASH = "blake3"
# Where holders serve the manifest and the files, on their HTTP port (http/files.py).
FILES_PREFIX = "/cluster/files"

# A file's name in a manifest: a relative path of plain segments, so a fetcher can write it
# under its models_dir and nowhere else.
_NAME = re.compile(r"[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*")
_HASH = re.compile(r"[0-9a-f]{64}")


class ManifestError(ModelError):
    """A manifest that is malformed, or names something no holder writes."""


@dataclass(frozen=True)
class FileEntry:
    name: str  # relative to the checkpoint (a GGUF: its file name)
    size: int
    head: int  # bytes at the start every fetcher takes: a weights file's header, else the whole file
    bounds: tuple[int, ...]  # where its pieces start, and its size: 0 = bounds[0] < ... < bounds[-1] = size
    hashes: tuple[str, ...]  # BLAKE3 (hex) of each piece
    weights: bool  # tensors, fetched by the ranges a stage needs; else fetched whole

    def pieces(self, start: int, end: int) -> range:
        """The pieces that hold bytes [start, end) of this file."""
        if start >= end:
            return range(0)
        return range(bisect.bisect_right(self.bounds, start) - 1, bisect.bisect_left(self.bounds, end))

    def span(self, index: int) -> tuple[int, int]:
        """Piece ``index``'s bytes [start, end) in the file."""
        return self.bounds[index], self.bounds[index + 1]


@dataclass(frozen=True)
class Manifest:
    fingerprint: str  # the model's (checkpoint.ModelInfo.fingerprint), which plans name
    label: str  # what the API calls the model
    gguf: bool  # the checkpoint is one GGUF file, files[0]
    files: tuple[FileEntry, ...]
    # Bytes of weights files every stage takes besides their heads: a GGUF's tensors its
    # config is read from (gguf.CONFIG_TENSORS: rope_freqs, LongRoPE's factors). (file, start, end)
    always: tuple[tuple[str, int, int], ...] = ()
    # What the fingerprint was made of besides the config (fingerprint.identify): a fetcher
    # makes it again from what it fetched and the same slices of the holder's files.
    digest: str = ""

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise ManifestError(f"the manifest of {self.fingerprint} has no file {name!r}")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_wire(self) -> dict:
        return {
            "version": MANIFEST_VERSION, "hash": HASH, "fingerprint": self.fingerprint, "label": self.label, "gguf": self.gguf,
            "digest": self.digest, "always": [list(a) for a in self.always],
            "files": [
                {"name": f.name, "size": f.size, "head": f.head, "weights": f.weights, "bounds": list(f.bounds), "hashes": list(f.hashes)}
                for f in self.files
            ],
        }  # fmt: skip

    @classmethod
    def from_wire(cls, d: object) -> "Manifest":
        """A manifest from a holder, every field checked; ManifestError names what is wrong."""
        keys = {"version", "hash", "fingerprint", "label", "gguf", "digest", "always", "files"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ManifestError(f"a manifest must have exactly the keys {sorted(keys)}")
        if d["version"] != MANIFEST_VERSION or d["hash"] != HASH:
            raise ManifestError(f"manifest version {d['version']!r:.20} of {d['hash']!r:.20} hashes; this node reads version {MANIFEST_VERSION} of {HASH}: run the same ringd on every node")
        fingerprint, label, gguf = d["fingerprint"], d["label"], d["gguf"]
        if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 128 or not isinstance(label, str) or len(label) > MAX_NAME_CHARS:
            raise ManifestError("a manifest's fingerprint and label must be short strings")
        if not isinstance(gguf, bool):
            raise ManifestError("a manifest's gguf must be true or false")
        digest = d["digest"]
        if not isinstance(digest, str) or not 0 < len(digest) <= MAX_DIGEST_CHARS:
            raise ManifestError(f"a manifest's digest must be a string of 1 to {MAX_DIGEST_CHARS} characters")
        files = d["files"]
        if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
            raise ManifestError(f"a manifest lists 1 to {MAX_FILES} files")
        entries = tuple(_file_from_wire(f) for f in files)
        if sum(len(f.hashes) for f in entries) > MAX_PIECES:
            raise ManifestError(f"a manifest may cut its files into {MAX_PIECES} pieces at most")
        names = [f.name for f in entries]
        if len(set(names)) != len(names):
            raise ManifestError("a manifest names a file twice")
        if gguf and (len(entries) != 1 or not entries[0].weights):
            raise ManifestError("a GGUF model's manifest lists its one weights file")
        always = d["always"]
        if not isinstance(always, list) or len(always) > 64:
            raise ManifestError("a manifest's always must be a list of at most 64 [file, start, end]")
        ranges = []
        for a in always:
            if not (isinstance(a, list) and len(a) == 3 and a[0] in names and all(type(v) is int for v in a[1:])):
                raise ManifestError(f"a manifest's always entries are [file, start, end], got {a!r:.80}")
            if not 0 <= a[1] <= a[2] <= entries[names.index(a[0])].size:
                raise ManifestError(f"a manifest's always range {a!r:.80} is not inside its file")
            ranges.append((a[0], a[1], a[2]))
        return cls(fingerprint, label, gguf, entries, tuple(ranges), digest)


def _file_from_wire(f: object) -> FileEntry:
    if not isinstance(f, dict) or set(f) != {"name", "size", "head", "weights", "bounds", "hashes"}:
        raise ManifestError("a manifest's file must have exactly name, size, head, weights, bounds and hashes")
    name, size, head, weights, bounds, hashes = f["name"], f["size"], f["head"], f["weights"], f["bounds"], f["hashes"]
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name) or any(p in (".", "..") for p in name.split("/")):
        raise ManifestError(f"a manifest's file name must be a relative path of plain names, got {name!r:.80}")
    if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES or type(head) is not int or not 0 <= head <= size:
        raise ManifestError(f"{name}: size must be 0 to {MAX_FILE_BYTES} and head within it")
    if not isinstance(weights, bool) or (not weights and head != size):
        raise ManifestError(f"{name}: a file other than weights is taken whole (head == size)")
    if (
        not isinstance(bounds, list) or not bounds or len(bounds) > MAX_PIECES + 1 or not all(type(b) is int for b in bounds)
        or bounds[0] != 0 or bounds[-1] != size
        or not all(0 < b - a <= MAX_ACCEPTED_PIECE_BYTES for a, b in zip(bounds, bounds[1:]))
    ):  # fmt: skip
        raise ManifestError(f"{name}: bounds must rise from 0 to its size, in pieces of 1 to {MAX_ACCEPTED_PIECE_BYTES} bytes")
    if not isinstance(hashes, list) or len(hashes) != len(bounds) - 1 or not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes):
        raise ManifestError(f"{name}: hashes must be one {HASH} hash in hex per piece")
    return FileEntry(name, size, head, tuple(bounds), tuple(hashes), weights)


# --- a holder's side: make the manifest ---------------------------------------------------


def checkpoint_files(path: Path) -> list[tuple[str, bool]]:
    """(name, is weights) of every file a peer needs of the checkpoint at ``path``: for a GGUF
    file, itself; for an mlx-lm directory, its weight files and the files beside them
    (config, tokenizer, chat template: checkpoint.NON_WEIGHT_PATTERNS)."""
    if path.is_file():
        return [(path.name, True)]
    out = {}
    for pattern in NON_WEIGHT_PATTERNS:
        for f in path.glob(pattern):
            if f.is_file():
                out[f.name] = False
    for f in path.glob("model*.safetensors"):
        out[f.name] = True
    return sorted(out.items())


def _head(file: Path, weights: bool, gguf: bool) -> int:
    size = file.stat().st_size
    if not weights:
        return size
    if gguf:
        return GgufFile.open(file).data_offset
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return min(8 + n, size)


def _stats(path: Path) -> dict[str, list[int]]:
    """Size and modification time of every file: what a cached manifest must still match."""
    base = path if path.is_dir() else path.parent
    return {name: [(base / name).stat().st_size, (base / name).stat().st_mtime_ns] for name, _ in checkpoint_files(path)}


def _tensor_starts(file: Path, gguf: bool, head: int) -> list[int]:
    """Where each tensor of a weights file starts."""
    if gguf:
        return [a for t in GgufFile.open(file).tensors.values() for a, _ in t.spans]
    with open(file, "rb") as f:
        return [a for a, _ in safetensors_ranges(f.read(head), head).values()]


def cut(size: int, starts: Iterable[int], max_piece: int = MAX_PIECE_BYTES) -> tuple[int, ...]:
    """Piece bounds for a file of ``size`` bytes: at each of ``starts`` (inside the file), and
    every ``max_piece`` bytes within a longer stretch."""
    marks = sorted({0, size, *(s for s in starts if 0 < s < size)})
    bounds = [0]
    for a, b in zip(marks, marks[1:]):
        bounds += list(range(a + max_piece, b, max_piece)) + [b]
    return tuple(bounds) if size else (0,)


def build(path: Path, fingerprint: str, label: str, max_piece: int = MAX_PIECE_BYTES) -> Manifest:
    """Read and hash every file of the checkpoint at ``path`` (blocking: off the event loop).
    The files must still be the model this node loaded, by its fingerprint."""
    now, digest = identify(path)
    if now != fingerprint:
        raise ManifestError(f"{path}: its files are not the model this node loaded (fingerprint {fingerprint}, the files' now {now}): restart the node to serve them")
    gguf = path.is_file()
    if gguf and len(parts := GgufFile.open(path).parts) > 1:
        raise ManifestError(
            f"{path}: a GGUF split in {len(parts)} parts is not served to peers: give each node the parts "
            "(or join them with `llama-gguf-split --merge`: one file is served)"
        )
    base = path.parent if gguf else path
    entries = []
    for name, weights in checkpoint_files(path):
        file = base / name
        size = file.stat().st_size
        head = _head(file, weights, gguf)
        bounds = cut(size, [head, *_tensor_starts(file, gguf, head)] if weights else [], max_piece)
        with open(file, "rb") as f:
            hashes = tuple(blake3(os.pread(f.fileno(), b - a, a), max_threads=blake3.AUTO).hexdigest() for a, b in zip(bounds, bounds[1:]))
        entries.append(FileEntry(name, size, head, bounds, hashes, weights))
    always = ()
    if gguf:
        g = GgufFile.open(path)
        always = tuple((path.name, a, b) for name in sorted(CONFIG_TENSORS) if name in g.tensors for a, b in g.tensors[name].spans)
    return Manifest(fingerprint, label, gguf, tuple(entries), always, digest)


def cached(path: Path, fingerprint: str, label: str, cache_dir: Path) -> Manifest:
    """``build``'s manifest, kept under ``cache_dir`` while every file keeps its size and time."""
    store = cache_dir / "manifests" / f"{fingerprint.replace(':', '-')}.json"
    stats = _stats(path)
    try:
        saved = json.loads(store.read_text())
        if saved.get("stats") == stats:
            return Manifest.from_wire(saved["manifest"])
    except (OSError, ValueError, KeyError, ManifestError):
        pass
    manifest = build(path, fingerprint, label)
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"stats": stats, "manifest": manifest.to_wire()}))
    os.replace(tmp, store)
    return manifest


# --- a fetcher's side: what a stage needs ---------------------------------------------------


def safetensors_ranges(header: bytes, head: int) -> dict[str, tuple[int, int]]:
    """Every tensor of a safetensors file, as [start, end) in the file, from its header bytes
    (``head`` = 8 + the header's length); ManifestError if they do not parse."""
    try:
        table = json.loads(header[8:head])
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"a safetensors header does not parse: {e}") from None
    if not isinstance(table, dict):
        raise ManifestError("a safetensors header is not a JSON object")
    out = {}
    for key, v in table.items():
        if key == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise ManifestError(f"tensor {key!r:.80}: data_offsets must be [start, end]")
        out[key] = (head + offsets[0], head + offsets[1])
    return out


def safetensors_stage_ranges(tables: dict[str, dict[str, tuple[int, int]]], start: int, end: int, num_layers: int) -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of the tensors the stage holding layers [start, end) takes (``stage_keeps``),
    by file; ``tables``: each weights file's ``safetensors_ranges``."""
    untied = any("lm_head" in key for table in tables.values() for key in table)
    out: dict[str, list[tuple[int, int]]] = {}
    for file, table in tables.items():
        spans = [span for key, span in table.items() if stage_keeps(key, start, end, num_layers, untied)]
        if spans:
            out[file] = merge_ranges(spans)
    return out


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with overlapping and touching ranges joined; empty ones dropped."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def pieces_of(manifest: Manifest, ranges: dict[str, list[tuple[int, int]]]) -> dict[str, list[int]]:
    """The pieces, by file, that hold ``ranges`` (sorted, each once)."""
    out = {}
    for name, spans in ranges.items():
        f = manifest.file(name)
        out[name] = sorted({i for a, b in spans for i in f.pieces(a, b)})
    return out
