"""The one thread of a node that runs MLX.

Model loading and every forward pass happen here, in submission order, so the
event loop never blocks on MLX and frames of one request are computed in the
order they arrived. One thread, not a pool: the stage's work on different
requests shares its caches and MLX's allocator, and order is the contract.

What the event loop hands this thread goes through a bare ``queue.SimpleQueue``
(C; a job is a tuple): a loop-to-thread-to-loop round trip of ~15 us here, against
~40 us through a ThreadPoolExecutor, which builds a Future and takes a lock and a
semaphore per job. A job whose result nobody awaits
(``submit``) and that raises is logged: nothing fails silently.

MLX's CPU backend runs an evaluation on a thread of its own (the stream's), one queued task
an operation, and that thread sleeps each time it has caught up. Left to Linux's defaults,
each task the compute thread queues wakes it and, on a busy core, preempts the compute
thread mid-way through queuing: a decode step crossed between the two once an operation,
twenty to thirty times a stage, where its design needs once (docs/benchmarks.md,
"Thread switches per token"). Both are therefore batch threads (``SCHED_BATCH``: woken, they
never preempt the thread that woke them): MLX's runs a step once it has been queued and the
compute thread waits for it, and the compute thread runs a frame once the event loop that
handed it over has gone back to waiting. Each is named (``ringd-compute``, ``ringd-mlx``) so
that /proc, ``top -H`` and the bench tell them apart. On macOS there is no such policy, and
with Metal a step runs on the GPU's queue rather than on a stream thread.

The thread may also read links it was lent (``watch``: a stage's link from the node before it,
wire.stream's ``Lent``): between jobs it waits on those sockets as well as on its queue, and
a decode frame is read, computed and sent on from here, with no event loop woken on the way.
While it watches any, a job queued wakes it through a pipe (``nudge``) rather than the queue.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import queue
import re
import select
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)

# A node that stops waits this long for the MLX work under way (a forward pass is
# milliseconds to seconds; a load is given up at its next step). MLX work still
# running when the interpreter exits aborts the process (exit status 134).
STOP_TIMEOUT_S = 10.0

_STOP = object()  # the last item of the queue: the thread ends there
_PARK = object()  # the last item at the interpreter's exit: the thread blocks there for good
_running: weakref.WeakSet[ComputeThread] = weakref.WeakSet()
# The names /proc shows (whatever a compute thread's Python name): what the bench counts by.
COMPUTE_THREAD_NAME, MLX_THREAD_NAME = "ringd-compute", "ringd-mlx"
# Two compute threads starting at once must not take each other's MLX thread for their own.
_starting = threading.Lock()


class ComputeThread:
    def __init__(self, name: str = "ringd-compute"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        # Links lent to this thread (``watch``), and how a job queued wakes it while it polls them:
        # a byte down the pipe, once per wait (``_polling``, ``_nudged``: under ``_nudge_lock``).
        self._watched: set[Reading] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._nudge_lock = threading.Lock()
        self._polling = False
        self._nudged = False
        # Closed with the object, when no thread can nudge it any more (a descriptor closed
        # earlier could be reused by the time a late nudge wrote to it); at exit, by the OS.
        weakref.finalize(self, _close, self._wake_r, self._wake_w).atexit = False
        self._parked = threading.Event()
        # A daemon, so a node that never called ``stop`` still exits; ``_at_exit`` lets its job
        # finish first, as the executor's own exit hook did.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        # The thread ids of this thread and of MLX's stream thread that serves it, once known
        # (Linux; None elsewhere): what the bench and a reader of /proc count per thread.
        self.thread_ids: tuple[int, int | None] | None = None
        self._thread.start()
        _running.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn``; nobody waits for it (an exception it raises is logged)."""
        self._jobs.put((fn, args, None))
        self.nudge()

    def watch(self, reading: Reading) -> None:
        """Read ``reading`` on this thread from now on (after the jobs queued before), whenever
        its socket is readable, until its ``read`` says it has gone back."""
        self.submit(self._watched.add, reading)

    def nudge(self) -> None:
        """From any thread: a thread waiting on its watched sockets looks at its queue (and at
        them) again. A job queued before this is seen: the thread checks the queue after
        saying it polls, under the same lock."""
        if self._polling:
            with self._nudge_lock:
                if self._polling and not self._nudged:
                    self._nudged = True
                    try:
                        os.write(self._wake_w, b"\0")
                    except OSError:  # closed: the thread has ended
                        pass

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` after everything queued before it and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            raise RuntimeError("the compute thread is stopping")
        self._jobs.put((fn, args, future))
        self.nudge()
        return await asyncio.wrap_future(future)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Drop what is queued, let the job that runs finish (within ``timeout_s``), then leave
        MLX idle (its streams synchronized), so no MLX thread is busy as the interpreter exits."""
        self._end()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.to_thread(self._thread.join)
                await asyncio.to_thread(_synchronize)
        except TimeoutError:
            log.warning("MLX work still running after %.0f s of stopping; exiting anyway", timeout_s)

    def _end(self, last: object = _STOP) -> None:
        """No job starts from now on: what is queued is dropped (its awaiters cancelled) at once,
        even while the job under way still runs; ``last`` is what the thread does after it."""
        if self._stopping:
            return
        self._stopping = True
        while True:
            try:
                _, _, future = self._jobs.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        self._jobs.put((last, (), None))
        self.nudge()

    def _next(self) -> tuple:
        """The next job; while links are watched, the sockets read meanwhile, as they get data."""
        while self._watched:
            for reading in [r for r in self._watched if r.asked_back]:
                reading.read()  # back to the loop before any job: the job may wait on what it reads
                self._watched.discard(reading)
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            with self._nudge_lock:
                self._polling = True
            if not self._jobs.empty():  # queued before ``_polling`` was seen: no byte coming for it
                with self._nudge_lock:
                    self._polling = False
                continue
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            due = []  # a reading with no socket left, or asked back: read at once, which gives it back
            for reading in self._watched:
                fd = reading.fileno()
                if fd is None or reading.asked_back:
                    due.append(reading)
                else:
                    poller.register(fd, select.POLLIN)
            for reading in self._watched:
                reading.waiting = True
            ready = {fd for fd, _ in poller.poll(0 if due else None)}
            for reading in self._watched:
                reading.waiting = False
            with self._nudge_lock:
                self._polling = False
                if self._nudged:
                    self._nudged = False
                    try:
                        while os.read(self._wake_r, 256):
                            pass
                    except BlockingIOError:
                        pass
            for reading in list(self._watched):
                if reading in due or reading.fileno() in ready:
                    if not reading.read():
                        self._watched.discard(reading)
        return self._jobs.get()

    def _work(self) -> None:
        try:
            self.thread_ids = _as_batch_threads()
        except Exception:  # a scheduling hint: a node computes without it
            log.warning("could not make the compute thread and MLX's a batch pair", exc_info=True)
        while True:
            fn, args, future = self._next()
            if fn is _STOP:
                for reading in self._watched:  # back to the loop, which ends its links as the node stops
                    reading.ask_back()
                    reading.read()
                return
            if fn is _PARK:
                self._parked.set()
                threading.Event().wait()  # never set: the process ends around this thread
            if self._stopping:  # queued before the stop: dropped
                if future is not None:
                    future.cancel()
                continue
            if future is not None and not future.set_running_or_notify_cancel():
                continue  # its awaiter left
            try:
                result = fn(*args)
            except BaseException as e:
                if future is not None:
                    future.set_exception(e)
                else:
                    log.exception("compute job %s failed", getattr(fn, "__qualname__", fn))
            else:
                if future is not None:
                    future.set_result(result)


class Reading(Protocol):
    """A socket this thread reads when it is readable (wire.stream's ``Lent``)."""

    asked_back: bool
    waiting: bool  # set while this thread waits on it (and reads what comes at once)

    def ask_back(self) -> None:
        """Its next ``read`` gives it back (and says False)."""

    def fileno(self) -> int | None:
        """The socket's descriptor; None once it has none (it is read at once then)."""

    def read(self) -> bool:
        """Read and handle what has arrived; False once this thread is to forget it."""


def _as_batch_threads() -> tuple[int, int | None] | None:
    """On this (new) thread, before any other MLX work: start MLX's CPU stream thread for this
    thread's default stream (MLX gives each thread its own, and its thread with the stream's
    first task), then name both threads and make them batch threads. This thread's id and
    MLX's (None if it could not be told from threads started meanwhile); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import mlx.core as mx

    def step() -> None:
        mx.eval(mx.add(mx.array(0), mx.array(1), stream=mx.cpu))

    own = threading.get_native_id()
    with _starting:
        before = set(os.listdir("/proc/self/task"))
        step()
        born = set(os.listdir("/proc/self/task")) - before - {str(t.native_id) for t in threading.enumerate()}
        # MLX's thread is among those born (this thread's stream is new); another native thread
        # may have started meanwhile (the event loop's resolver pool, say): MLX's is the one
        # that woke for each of a few evaluations of this thread's.
        mlx_thread = int(born.pop()) if len(born) == 1 else _woken_by(step, [int(t) for t in born])
    for tid, label in [(own, COMPUTE_THREAD_NAME), (mlx_thread, MLX_THREAD_NAME)]:
        if tid is not None:
            _name_thread(tid, label)
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    if mlx_thread is None:
        log.debug("MLX's stream thread not told apart from %d threads started with it", len(born))
    return own, mlx_thread


# Evaluations that tell MLX's stream thread apart: it sleeps after nearly each (not each: on a
# busy machine the next step may be queued before it has gone to sleep), another thread hardly.
PROBES = 32


def _woken_by(step: Callable[[], None], tids: list[int]) -> int | None:
    """The one thread of ``tids`` that slept after at least half of ``PROBES`` runs of ``step``,
    while every other slept less than a quarter as often; else None."""

    def waits() -> dict[int, int]:
        found = {}
        for tid in tids:
            try:
                status = Path(f"/proc/self/task/{tid}/status").read_text()
            except FileNotFoundError:
                continue  # ended: not MLX's
            found[tid] = int(re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)[1])
        return found

    before = waits()
    for _ in range(PROBES):
        step()
    after = waits()
    slept = {tid: after[tid] - before[tid] for tid in after if tid in before}
    woken = [tid for tid, n in slept.items() if n >= PROBES // 2]
    if len(woken) != 1 or any(n >= PROBES // 4 for tid, n in slept.items() if tid != woken[0]):
        return None
    return woken[0]


def _name_thread(tid: int, name: str) -> None:
    """The name /proc and ``top -H`` show for thread ``tid`` of this process (at most 15 bytes)."""
    with open(f"/proc/self/task/{tid}/comm", "w") as f:
        f.write(name)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _synchronize() -> None:
    import mlx.core as mx

    mx.synchronize()


@atexit.register
def _at_exit() -> None:
    """An interpreter that exits with a compute thread still up (its node never stopped) lets
    the job under way finish first, so no MLX call is cut off mid-way; the thread then parks
    rather than ends. A thread that has run MLX and ends while the interpreter finalizes aborts
    the process: its thread-local MLX state's destructor takes the GIL, which then ends the
    thread by ``pthread_exit`` through a ``noexcept`` frame (``ringd serve`` skips finalization
    for this reason: cli.py, ``_exit_stopped``)."""
    for compute in list(_running):
        if not compute._stopping:
            compute._end(_PARK)
            compute._parked.wait(STOP_TIMEOUT_S)
        elif compute._thread.is_alive():  # a stop under way: it ends as that stop asked
            compute._thread.join(STOP_TIMEOUT_S)
