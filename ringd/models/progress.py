"""How far a node is in bringing in its layers: downloading their files, then reading them into memory.

A ``LoadProgress`` is written by the thread doing the work (the compute thread,
which runs ``Shard.load`` and the Hub downloads in it) and read by the event loop
(a node's status, every time someone asks); a lock keeps the two apart, and every
call is a few additions under it. It counts bytes per file, and the rate over the
last few seconds (a download that stalls shows 0 B/s within RATE_WINDOW_S, not a
slowly sinking average since the start). It logs a line now and then, and one at
the end of each phase.

It ignores where the bytes come from: ``source.py`` feeds it from
huggingface_hub's progress bars, ``shard.py`` as groups of parameters are
evaluated. ``describe`` turns its wire form into a line, for the log and for
``ringd local``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Mapping

log = logging.getLogger(__name__)

DOWNLOAD = "download"  # fetching the stage's weight files from the Hugging Face Hub
FETCH = "fetch"  # fetching the stage's bytes of the model's files from peers that hold it
LOAD = "load"  # reading the stage's parameters from the files into memory
PHASES = (DOWNLOAD, FETCH, LOAD)

# The rate is over the last this many seconds: long enough to smooth the bursts of a
# download (huggingface_hub reports in chunks of 10 MiB), short enough that a stall
# or a change of speed (network, then disk) shows within a few status polls.
RATE_WINDOW_S = 5.0
# A rate sample is kept at most this often, so a window holds at most
# RATE_WINDOW_S / RATE_SAMPLE_S samples however small and frequent the updates are.
RATE_SAMPLE_S = 0.25
# A progress line in the node's log at most this often while a phase runs (and one
# at its end): often enough to see that a 20 GB download moves, rarely enough that
# the log stays readable.
PROGRESS_LOG_INTERVAL_S = 5.0

_VERBS = {DOWNLOAD: ("downloading", "downloaded"), FETCH: ("fetching from peers", "fetched from peers"), LOAD: ("loading", "loaded")}


class LoadCancelled(Exception):
    """The load was given up (the node is stopping); raised in the thread doing it, at its next step."""


class LoadProgress:
    """The progress of one load of layers [start, end): its current phase, per file, bytes, rate.

    ``begin`` starts a phase over a set of files and their sizes (None when not known
    yet: the total then grows with what arrives, so bytes never exceed it);
    ``start_file`` names the file being worked on; ``advance`` adds bytes to a file
    (negative when a retried download starts over); ``finish_file`` counts a file
    complete; ``end`` logs the phase's last line. Before any ``begin`` (the model's
    config is still being read) the phase is "load" with nothing to count yet.
    ``cancel`` (from any thread) makes the next ``start_file`` or ``advance`` raise
    LoadCancelled: that is how a download of many GB stops when its node does.
    ``clock`` is injectable so tests step time instead of sleeping. ``subject`` names what is
    brought in when it is not a stage's layers (a whole GGUF file fetched at start: its model).
    """

    def __init__(self, start: int, end: int, *, clock: Callable[[], float] = time.monotonic, subject: str = ""):
        self.layers = (start, end)
        self.subject = subject
        self._clock = clock
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        with self._lock:
            self._reset(LOAD, {})

    def cancel(self) -> None:
        """Give the load up: the thread doing it raises LoadCancelled at its next step."""
        self._cancelled.set()

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise LoadCancelled(f"the load of {self._what()} was given up")

    def _reset(self, phase: str, sizes: Mapping[str, int | None]) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        now = self._clock()
        self._phase = phase
        self._sizes: dict[str, int | None] = dict(sizes)
        self._done: dict[str, int] = dict.fromkeys(self._sizes, 0)
        self._finished: set[str] = set()
        self._file = ""
        self._bytes = 0
        self._known_total = sum(s for s in self._sizes.values() if s is not None)
        self._began = now
        self._logged_at = now
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])

    def begin(self, phase: str, sizes: Mapping[str, int | None]) -> None:
        """Start ``phase`` over these files (name -> size in bytes), in the order they will come."""
        with self._lock:
            self._reset(phase, sizes)

    def set_size(self, file: str, size: int) -> None:
        """A file's size, learnt once its transfer started (it was not known at ``begin``)."""
        with self._lock:
            self._add_file(file)
            if self._sizes[file] is None:
                self._sizes[file] = max(0, int(size))
                self._known_total += self._sizes[file]
                self._set_done(file, self._done[file])  # what already came may be more than the size said

    def start_file(self, file: str) -> None:
        """``file`` is the one being worked on now (before any of its bytes are counted)."""
        self._check_cancelled()
        with self._lock:
            self._add_file(file)
            self._file = file

    def advance(self, file: str, n: int) -> None:
        """``n`` more bytes of ``file`` (negative: a retried download rolled back)."""
        self._check_cancelled()
        with self._lock:
            self._add_file(file)
            self._file = file
            self._set_done(file, self._done[file] + int(n))
            now = self._clock()
            if now - self._samples[-1][0] >= RATE_SAMPLE_S:
                self._samples.append((now, self._bytes))
            if now - self._logged_at < PROGRESS_LOG_INTERVAL_S:
                return
            self._logged_at = now
            line = describe(self._wire(now))
        log.info("%s", line)

    def finish_file(self, file: str) -> None:
        """``file`` is complete: all its bytes count, whatever the updates added up to."""
        with self._lock:
            self._add_file(file)
            self._file = file
            size = self._sizes[file]
            if size is not None:
                self._set_done(file, size)
            self._finished.add(file)

    def end(self) -> None:
        """The phase is over: log what it did, in how long."""
        with self._lock:
            now = self._clock()
            elapsed = max(now - self._began, 0.0)
            done, files = self._bytes, len(self._sizes)
            phase = self._phase
        rate = f", {format_bytes(done / elapsed)}/s" if elapsed > 0 else ""
        log.info(
            "%s %s: %s in %d file%s, %.1f s%s",
            _VERBS[phase][1], self._what(), format_bytes(done), files, "" if files == 1 else "s", elapsed, rate,
        )  # fmt: skip

    def _what(self) -> str:
        start, end = self.layers
        return self.subject or f"layers [{start}, {end})"

    def _add_file(self, file: str) -> None:
        if file not in self._sizes:  # a file the phase did not announce: counted, size unknown
            self._sizes[file] = None
            self._done[file] = 0

    def _set_done(self, file: str, n: int) -> None:
        size = self._sizes[file]
        n = max(0, n if size is None else min(n, size))
        self._bytes += n - self._done[file]
        self._done[file] = n

    def _total(self) -> int:
        # Files of unknown size count what has arrived of them.
        return self._known_total + sum(d for f, d in self._done.items() if self._sizes[f] is None)

    def _rate(self, now: float) -> float:
        samples = self._samples
        # Drop samples older than the window, keeping the newest of them as the baseline.
        while len(samples) > 1 and samples[1][0] <= now - RATE_WINDOW_S:
            samples.popleft()
        t0, b0 = samples[0]
        return max(0.0, (self._bytes - b0) / (now - t0)) if now > t0 else 0.0

    def _wire(self, now: float) -> dict:
        return {
            "phase": self._phase,
            "file": self._file,
            "files_done": len(self._finished),
            "files_total": len(self._sizes),
            "bytes": self._bytes,
            "total_bytes": self._total(),
            "rate_bytes_s": round(self._rate(now), 1),
            "layers": list(self.layers),
            **({"subject": self.subject} if self.subject else {}),
        }

    def to_wire(self) -> dict:
        """What a node's status shows while it loads (``StageHost.status()["progress"]``)."""
        with self._lock:
            return self._wire(self._clock())

    def file_bytes(self) -> dict[str, tuple[int, int | None]]:
        """Each file of the phase: (bytes done, its size)."""
        with self._lock:
            return {f: (self._done[f], self._sizes[f]) for f in self._sizes}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def verb(phase) -> str:
    """What a node in this phase is doing, as people say it ("downloading"); any other value as given."""
    return _VERBS[phase][0] if phase in _VERBS else str(phase or "loading")


def describe(p: Mapping) -> str:
    """One line from a progress's wire form, e.g. ``downloading layers [3, 6): 1.2 GiB of 3.4 GiB
    (35%), 80.0 MiB/s, model-00002-of-00004.safetensors (2 of 4 files)``."""
    layers = p.get("layers") or ["?", "?"]
    what = p.get("subject") if isinstance(p.get("subject"), str) and p.get("subject") else f"layers [{layers[0]}, {layers[1]})"
    done, total = p.get("bytes") or 0, p.get("total_bytes") or 0
    line = f"{verb(p.get('phase'))} {what}: {format_bytes(done)} of {format_bytes(total)}"
    if total:
        line += f" ({100 * done // total}%)"
    line += f", {format_bytes(p.get('rate_bytes_s') or 0)}/s"
    files_total = p.get("files_total") or 0
    if p.get("file"):
        current = min((p.get("files_done") or 0) + 1, files_total)
        line += f", {p['file']} ({current} of {files_total} file{'' if files_total == 1 else 's'})"
    return line
