"""Models the tests build, built once and kept: shared by every test process and by later runs.

Each lives in ringd's cache (``RINGD_CACHE`` or ``~/.cache/ringd``) under
``test-models/``, in a folder named by a hash of the source files that build it
and of the MLX, mlx-lm and gguf versions that run them: a change to the builder
or a library makes a new folder, never a stale model. It is built into a
temporary folder and renamed into place under an exclusive lock on a file
beside it, so pytest-xdist workers that want the same model build it once (the
others wait for it) and a process never sees half a model. On a clean machine
(CI) the first test that asks builds it; a developer's next run finds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from devkit import REPO

LIBRARIES = ("mlx", "mlx-lm", "gguf", "transformers", "tokenizers")


def root() -> Path:
    from ringd.app.cli import cache_dir

    return cache_dir() / "test-models"


def digest(files: list[Path], *extra: str) -> str:
    """A hash of ``files``' bytes (paths relative to the repository), the libraries' versions and ``extra``."""
    h = hashlib.sha256()
    for name in LIBRARIES:
        h.update(f"{name}={version(name)}\n".encode())
    for f in sorted(files):
        h.update(str(f.relative_to(REPO)).encode() + b"\n" + f.read_bytes())
    for e in extra:
        h.update(e.encode() + b"\n")
    return h.hexdigest()[:16]


def built(name: str, builders: list[Path], build: Callable[[Path], None], *extra: str) -> Path:
    """The folder ``build(tmp)`` writes, for these ``builders`` (their sources) and ``extra`` keys."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    out = base / f"{name}-{digest(builders, *extra)}"
    if out.is_dir():
        return out
    with open(base / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then take its result
        if out.is_dir():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=base))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the model is not
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def sources(*globs: str) -> list[Path]:
    """Files of the repository matching ``globs`` (relative to it)."""
    return sorted({p for g in globs for p in REPO.glob(g)})
