"""Tasks that run as long as the node does, supervised: none dies silently.

A daemon left running for weeks has loops that must never stop: heartbeats,
reconciliation, dial loops, session expiry. An exception nobody expected
(a bug, a peer's odd message that slipped past a check) would end such a task
without a word, and the node would carry on half alive: a follower that stops
heart-beating is declared dead every few seconds by everyone else, forever.

``Supervisor.forever`` runs a loop; if it raises, the traceback is logged with
the task's name and the loop is started again after a backoff that grows while
it keeps failing. ``Supervisor.once`` runs a one-shot coroutine and logs its
exception instead of leaving it to "Task exception was never retrieved".
Cancellation (stopping the node) passes through both.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

# A failing loop is restarted at once the first time (most failures are one bad
# input), then ever more slowly, so a loop that fails at every start costs a
# log line every few seconds rather than the CPU.
RESTART_BACKOFF_INITIAL_S = 0.05
RESTART_BACKOFF_MAX_S = 5.0
# A loop that ran this long before failing was healthy: its backoff starts over.
HEALTHY_RUN_S = 30.0


class Supervisor:
    def __init__(self, logger: logging.Logger = log):
        self._log = logger
        self._tasks: set[asyncio.Task] = set()
        self.restarts: dict[str, int] = {}  # name -> restarts so far, for status and tests

    def forever(self, name: str, loop: Callable[[], Awaitable[None]], *, restart_on_return: bool = True) -> asyncio.Task:
        """Run ``loop()`` until the node stops, restarting it whenever it raises.

        A loop that returns was done (``restart_on_return=False``: a dial loop
        whose node is closing) or should not have (the default: logged, restarted).
        """
        return self._spawn(self._supervise(name, loop, restart_on_return), name)

    def once(self, name: str, coro: Awaitable[None]) -> asyncio.Task:
        """Run ``coro`` in a task of its own; an exception is logged, never lost."""
        return self._spawn(self._run_once(name, coro), name)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task:
        # A context of its own: a task started while serving a request (a dial, a
        # load) must not name that request in every line it logs for the node's life.
        task = asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _supervise(self, name: str, loop: Callable[[], Awaitable[None]], restart_on_return: bool) -> None:
        backoff = RESTART_BACKOFF_INITIAL_S
        while True:
            started = time.monotonic()
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception("task %s failed; restarting it", name)
            else:
                if not restart_on_return:
                    return
                self._log.error("task %s returned, but it should run as long as the node does; restarting it", name)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff = RESTART_BACKOFF_INITIAL_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    async def _run_once(self, name: str, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("task %s failed", name)
