"""A fetched model's files on disk: laid out sparse at the holder's offsets, and a journal per
file of the pieces written and checked.

What the node has not fetched is a hole that takes no disk; a piece is hashed before it is
written, and recorded after, so a fetch stopped by kill -9 starts again where it was and a
piece not in its journal is never taken for fetched, whatever the file holds there. All of
it blocking: run off the event loop.
"""

from __future__ import annotations

import os
from pathlib import Path

from blake3 import blake3

from ringd.models.peers.manifest import merge_ranges

# Beside the files: each one's journal of pieces written and checked.
JOURNALS = ".ringd-pieces"


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


def open_sparse(path: Path, size: int) -> int:
    """The file, created at its full size with nothing written (a hole) if new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)
    return fd


def reserve(fd: int, spans: list[tuple[int, int]]) -> None:
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


def check_and_write(fd: int, journal: Journal, index: int, offset: int, piece: memoryview, expected: str) -> bool:
    """Check a piece against its hash; if it holds, write it where it goes, then record it. One
    thread hop per piece: BLAKE3 on every core takes a 16 MiB piece in a few milliseconds."""
    if blake3(piece, max_threads=blake3.AUTO).hexdigest() != expected:
        return False
    os.pwrite(fd, piece, offset)
    journal.add(index)
    return True


def pread(path: Path, a: int, b: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), b - a, a)
