"""The one thread of a node that runs MLX.

Model loading and every forward pass happen here, in submission order, so the
event loop never blocks on MLX and frames of one request are computed in the
order they arrived. One thread, not a pool: the stage's work on different
requests shares its caches and MLX's allocator, and order is the contract.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

# A node that stops waits this long for the MLX work under way (a forward pass is
# milliseconds to seconds; a load is given up at its next step). MLX work still
# running when the interpreter exits aborts the process (exit status 134).
STOP_TIMEOUT_S = 10.0


class ComputeThread:
    def __init__(self, name: str = "ringd-compute"):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn``; the returned future completes on the compute thread."""
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` after everything queued before it and await its result."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Drop what is queued, let the job that runs finish (within ``timeout_s``), then leave
        MLX idle (its streams synchronized), so no MLX thread is busy as the interpreter exits."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.to_thread(self._executor.shutdown, True)  # joins the worker
                await asyncio.to_thread(_synchronize)
        except TimeoutError:
            log.warning("MLX work still running after %.0f s of stopping; exiting anyway", timeout_s)


def _synchronize() -> None:
    import mlx.core as mx

    mx.synchronize()
