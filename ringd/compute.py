"""The one thread of a node that runs MLX.

Model loading and every forward pass happen here, in submission order, so the
event loop never blocks on MLX and frames of one request are computed in the
order they arrived. One thread, not a pool: the stage's work on different
requests shares its caches and MLX's allocator, and order is the contract.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable


class ComputeThread:
    def __init__(self, name: str = "ringd-compute"):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn``; the returned future completes on the compute thread."""
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` after everything queued before it and await its result."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
