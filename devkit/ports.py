"""Ports for the daemons a test starts by hand, from a range this test process owns.

``ringd local`` needs none of these: it binds port 0 and hands its sockets down
(ringd/base/listeners.py). A test that runs ``ringd serve`` itself names its ports up
front (peers are given as addresses, and a node that comes back after kill -9
comes back on its port). Those come from a slice of 20000-32767, below every
OS's ephemeral range (Linux 32768-60999, macOS 49152-65535), so no port the
kernel picks (a listener on port 0, an outbound connection) lands there; each
test process holds a slice of its own for its whole life, by an exclusive lock
on a file named after the slice, so pytest-xdist workers and two suites run at
once never share one; and within its slice a process hands out each port once.
Nothing is checked and then bound: nobody else binds in the slice.
"""

from __future__ import annotations

import fcntl
import tempfile
from pathlib import Path

OWNED = range(20000, 32768)
SLICE_PORTS = 800  # a suite starts a few hundred daemons: two ports each, and peers nobody runs
SLICES = len(OWNED) // SLICE_PORTS

_lock = None  # the open, locked file: the slice is this process's until it exits
_ports = None


def _claim() -> range:
    global _lock
    for i in range(SLICES):
        f = open(Path(tempfile.gettempdir()) / f"ringd-test-ports-{i}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        _lock = f
        start = OWNED.start + i * SLICE_PORTS
        return range(start, start + SLICE_PORTS)
    raise RuntimeError(f"all {SLICES} port slices of {OWNED.start}-{OWNED.stop - 1} are held by other test processes")


def port() -> int:
    """A port of this process's slice, never handed out before: for a daemon to listen on, or
    for a peer address where nobody listens (a connection there is refused)."""
    global _ports
    if _ports is None:
        _ports = iter(_claim())
    try:
        return next(_ports)
    except StopIteration:
        raise RuntimeError(f"this test process has used all {SLICE_PORTS} ports of its slice") from None


def ports(n: int) -> list[int]:
    return [port() for _ in range(n)]
