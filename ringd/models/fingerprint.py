"""What identifies a model: the fingerprint plans name it by, from its config and a digest of its weights.

Two nodes serve one model in one ring only if their fingerprints agree, so a
fine-tune and its base model (same config, other weights) never share one. The
weights' digest is a Hugging Face snapshot's commit, or a checkpoint directory's
weight files (names, sizes, safetensors headers and slices of the data:
``samples.py``), or a GGUF file's (``gguf/reader.py`` digests it). A model fetched from
peers checks itself against its fingerprint with the same functions, the slices
read from where its bytes are (``peers.py``).

It ignores what the weights compute and where the model comes from
(``source.py``); reading the files is ``checkpoint.py``'s and ``gguf/reader.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ringd.models.checkpoint import read_config, safetensors_header_bytes
from ringd.models.gguf.reader import GgufFile
from ringd.models.samples import SampleReader, sample_spans

# Weight digests read this many slices of this many bytes from each weight file.
SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 16 * 1024


def model_fingerprint(config: dict, weights: str) -> str:
    """The fingerprint plans name a model by: its config and its weights' digest."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(weights.encode())
    return digest.hexdigest()[:16]


def weights_digest(path: Path, read: SampleReader | None = None) -> str:
    """What identifies the weights, so that a fine-tune and its base model never share a ring.

    A Hugging Face snapshot is named by its commit, which fixes every file (and a
    node that fetched only its own layers' files still knows it). A local directory:
    each weight file's name, size and header, and SAMPLES_PER_FILE slices of its
    data spread over the file: a fine-tune changes nearly every weight, and reading
    a few hundred KiB per file keeps this instant on a model of hundreds of GB.
    ``read(name, start, end)`` gives the slices where the files are not whole (a model
    fetched from peers, which checks itself against its fingerprint this way).
    """
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return f"hub:{parts[-3]}@{parts[-1]}"
    h = hashlib.sha256()
    for file in sorted(path.glob("model*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            raw = safetensors_header_bytes(f, file, size)
            h.update(raw)
            for a, b in sample_spans(size, 8 + len(raw), SAMPLES_PER_FILE, SAMPLE_BYTES):
                h.update(read(file.name, a, b) if read is not None else os.pread(f.fileno(), b - a, a))
    return "local:" + h.hexdigest()


def identify(path: Path, read: SampleReader | None = None, digest: str | None = None) -> tuple[str, str]:
    """(fingerprint, weights digest) of the checkpoint at ``path`` (a directory or a GGUF file),
    read from its files as ``source.model_info`` reads them, slices from ``read`` where given, or
    with ``digest`` as the weights' digest (a Hub snapshot's names its commit, not bytes). Blocking."""
    if path.is_file():
        g = GgufFile.open(path)
        digest = digest or g.digest(read)
        return model_fingerprint(g.config, digest), digest
    digest = digest or weights_digest(path, read)
    return model_fingerprint(read_config(path), digest), digest


def digest_samples(path: Path) -> dict[str, list[tuple[int, int]]]:
    """The slices of each weight file ``weights_digest`` reads (blocking: reads the headers)."""
    out = {}
    for file in sorted(path.glob("model*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            out[file.name] = sample_spans(size, 8 + len(safetensors_header_bytes(f, file, size)), SAMPLES_PER_FILE, SAMPLE_BYTES)
    return out
