"""Child processes as the tests watch them: a line a process prints, how several at once exit."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    """The first line of proc's stdout containing needle; AssertionError with the output otherwise."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            seen += line
            if needle in line:
                return line
    raise AssertionError(f"no {needle!r} within {timeout} s (exit code {proc.poll()}); output so far:\n{seen}")


def exits_of(script: str, n: int, timeout: float = 60) -> list[tuple[int, str]]:
    """Each exit code and output of ``n`` Python processes running ``script`` at once: how a test
    of how a process ends catches a race that shows in some exits only."""
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(n)]
    return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=timeout)]]


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """End the process group ``proc`` leads (it was started with ``start_new_session``: the child
    and its children): SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)
    except ProcessLookupError:
        pass  # gone between the poll and the signal
