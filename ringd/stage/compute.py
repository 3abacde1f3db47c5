"""The one thread of a node that runs MLX.

Model loading and every forward pass happen here, in submission order, so the
event loop never blocks on MLX and frames of one request are computed in the
order they arrived. One thread, not a pool: the stage's work on different
requests shares its caches and MLX's allocator, and order is the contract.

Every decode frame crosses into this thread and back, so the handoff is a bare
``queue.SimpleQueue`` (C; a job is a tuple): a loop-to-thread-to-loop round trip
of ~15 us here, against ~40 us through a ThreadPoolExecutor, which builds a
Future and takes a lock and a semaphore per job. A job whose result nobody awaits
(``submit``) and that raises is logged: nothing fails silently.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

# A node that stops waits this long for the MLX work under way (a forward pass is
# milliseconds to seconds; a load is given up at its next step). MLX work still
# running when the interpreter exits aborts the process (exit status 134).
STOP_TIMEOUT_S = 10.0

_STOP = object()  # the last item of the queue: the thread ends there
_PARK = object()  # the last item at the interpreter's exit: the thread blocks there for good
_running: weakref.WeakSet[ComputeThread] = weakref.WeakSet()


class ComputeThread:
    def __init__(self, name: str = "ringd-compute"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._parked = threading.Event()
        # A daemon, so a node that never called ``stop`` still exits; ``_at_exit`` lets its job
        # finish first, as the executor's own exit hook did.
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        _running.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn``; nobody waits for it (an exception it raises is logged)."""
        self._jobs.put((fn, args, None))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` after everything queued before it and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            raise RuntimeError("the compute thread is stopping")
        self._jobs.put((fn, args, future))
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

    def _work(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            if fn is _STOP:
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
