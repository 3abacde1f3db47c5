"""Faults done to live daemons from outside: a ring link's sockets destroyed, an event loop stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time


def ring_links(pid_a: int, port_a: int, pid_b: int, port_b: int) -> list[tuple[str, str]]:
    """The TCP connections of the ring link between two daemons: (local, peer) address pairs of a's sockets."""
    out = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 5 or f"pid={pid_a}," not in line:
            continue
        local, peer = fields[2], fields[3]
        local_port, peer_port = int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
        if peer_port == port_b:  # a dialed b
            pairs.append((local, peer))
        elif local_port == port_a:  # b dialed a: is the peer end b's?
            if f"pid={pid_b}," in _socket_owner(out, peer, local):
                pairs.append((local, peer))
    return pairs


def _socket_owner(ss_out: str, local: str, peer: str) -> str:
    for line in ss_out.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[2] == local and fields[3] == peer:
            return line
    return ""


def drop_ring_link(pid_a: int, port_a: int, pid_b: int, port_b: int) -> int:
    """Destroy the link's sockets in the kernel (`ss -K`), as a Wi-Fi drop or a NAT timeout ends a
    connection: both processes see it reset. Their dial loops make a new one. Returns how many."""
    pairs = ring_links(pid_a, port_a, pid_b, port_b)
    for local, peer in pairs:
        lh, lp = local.rsplit(":", 1)
        ph, pp = peer.rsplit(":", 1)
        subprocess.run(["ss", "-K", "src", lh, "sport", "=", lp, "dst", ph, "dport", "=", pp], capture_output=True, check=True)
    return len(pairs)


# ptrace(2) requests, and the syscalls (x86-64, aarch64) an idle uvloop thread waits in.
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 17, 0x4206, 0x4207
_WALL = 0x40000000  # waitpid(2)'s __WALL: wait for a thread, not only a process
_POLL_SYSCALLS = {"x86_64": {"232", "281", "441"}, "aarch64": {"22", "441"}}  # epoll_wait, epoll_pwait, epoll_pwait2
# Catching the loop between two callbacks takes a few tries at most on an idle node.
_FREEZE_ATTEMPTS = 500


def block_event_loop(pid: int, seconds: float) -> None:
    """Block a live daemon's event loop (its main thread) for ``seconds``, from outside: the compute
    and executor threads run on, as when a blocking call (a sleep, a disk read) stalls the loop.

    The main thread alone is stopped with ptrace (a thread is its own tracee, so the others
    run on), caught while it waits in epoll, where uvloop has released the GIL: it stalls
    as the loop does in a blocking call that releases the GIL. (gdb calling time.sleep in
    the process did this before; its inferior calls fail on some VMs' CPUs, "Couldn't write
    extended state status".) Returns when the loop runs again.
    """
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long

    def ptrace(request: int) -> None:
        if libc.ptrace(request, pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace({request:#x}) of thread {pid}")

    polls = _POLL_SYSCALLS[platform.machine()]
    for _ in range(_FREEZE_ATTEMPTS):
        ptrace(_PTRACE_SEIZE)
        ptrace(_PTRACE_INTERRUPT)
        os.waitpid(pid, _WALL)
        with open(f"/proc/{pid}/task/{pid}/syscall") as f:
            waiting = f.read().split()[0] in polls
        if waiting:
            break
        ptrace(_PTRACE_DETACH)  # caught running Python (holding the GIL): let it go, try again
        time.sleep(0.001)
    else:
        raise AssertionError(f"the event loop of {pid} was never caught waiting in epoll in {_FREEZE_ATTEMPTS} tries")
    try:
        time.sleep(seconds)
    finally:
        ptrace(_PTRACE_DETACH)


class SignalAt:
    """An ``on_chunk`` for ``devkit.clients.stream_text``: ``sig`` to ``pid`` once, as the
    ``chunk``-th chunk of the stream arrives (``fired`` is set then); with ``resume_after_s``, a
    SIGCONT that long after (a SIGSTOP's: a Mac that sleeps and wakes)."""

    def __init__(self, pid: int, sig: int, chunk: int, resume_after_s: float | None = None):
        self.pid, self.sig, self.chunk, self.resume_after_s = pid, sig, chunk, resume_after_s
        self.fired = threading.Event()

    def __call__(self, i: int) -> None:
        if i == self.chunk and not self.fired.is_set():
            os.kill(self.pid, self.sig)
            self.fired.set()
            if self.resume_after_s is not None:
                threading.Timer(self.resume_after_s, os.kill, (self.pid, signal.SIGCONT)).start()
