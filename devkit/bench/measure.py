"""What the bench reads off the machine: CPU seconds and context switches from /proc (by session,
process and thread), this process's own CPU time, --pin-cores' pinning, and a least-squares slope.

Linux only (/proc, sched_setaffinity); it knows nothing of rings or models beyond their pids.
"""

from __future__ import annotations

import os
from pathlib import Path

from ringd.stage.compute import COMPUTE_THREAD_NAME, MLX_THREAD_NAME


def session_pids(session: int) -> list[int]:
    """The processes of session ``session`` (a ring started by ``start_ring``), by pid."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            # Fields after the command's closing parenthesis: the session is the 4th.
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) == session:
                pids.append(int(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return sorted(pids)


def cpu_seconds(session: int) -> tuple[float, float]:
    """CPU seconds used so far by the processes of session ``session`` (a ring started by
    ``start_ring``): by their main threads (the event loops), and by all their other threads."""
    parts = by_thread(session_pids(session))
    loops = parts.get(LOOP, (0.0, 0))[0]
    return loops, sum(cpu for cpu, _ in parts.values()) - loops


def switches(pids: list[int]) -> int:
    """Context switches so far (voluntary and not) of every thread of ``pids``: each is a thread
    that waited and was woken, the handoffs a token's trip pays (MLX's CPU stream thread
    included, in a ring and in one process alike)."""
    return sum(n for _, n in by_thread(pids).values())


# A thread's part in a ring process: its main thread runs the event loop; compute.py names the
# compute thread and MLX's stream thread that serves it; any other thread (a loader, a resolver,
# the threads mlx-lm's process starts) is "other".
LOOP, OTHER = "event loop", "other"
NAMED = (COMPUTE_THREAD_NAME, MLX_THREAD_NAME)


def by_thread(pids: list[int]) -> dict[str, tuple[float, int]]:
    """CPU seconds and context switches (voluntary and not) so far of every thread of ``pids``,
    summed by the thread's part (``LOOP``, a name in ``NAMED``, ``OTHER``)."""
    tick = os.sysconf("SC_CLK_TCK")
    parts: dict[str, tuple[float, int]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                # utime and stime: the 12th and 13th fields after the command's closing parenthesis.
                t = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended meanwhile
            name = status.split("\n", 1)[0].removeprefix("Name:").strip()
            part = LOOP if int(tid) == pid else name if name in NAMED else OTHER
            n = sum(int(line.split()[1]) for line in status.splitlines() if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))
            cpu, woken = parts.get(part, (0.0, 0))
            parts[part] = (cpu + (int(t[11]) + int(t[12])) / tick, woken + n)
    return parts


# --pin-cores K: this process (mlx-lm, the client) and ``ringd local`` itself (which only
# waits) on cores [0, K), a ring's i-th node on [K(i+1), K(i+2)): each node on its own
# cores, as each Mac has its own.
PIN_CORES: int | None = None


def pin_ring(session: int) -> None:
    """Each node of the ring whose ``ringd local`` is ``session`` on its own cores (by start order)."""
    if not PIN_CORES:
        return
    nodes = [pid for pid in session_pids(session) if pid != session]
    for i, pid in [(-1, session), *enumerate(nodes)]:
        block = set(range(PIN_CORES * (i + 1), PIN_CORES * (i + 2)))
        for tid in os.listdir(f"/proc/{pid}/task"):  # every thread: affinity is per thread
            try:
                os.sched_setaffinity(int(tid), block)
            except ProcessLookupError:
                pass


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all its threads (MLX's included)."""
    t = os.times()
    return t.user + t.system


def processes_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user+system, every thread) used so far by the sessions these processes lead."""
    return sum(sum(cpu_seconds(pid)) for pid in pids)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx_) ** 2 for x in xs)
