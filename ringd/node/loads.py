"""A model's load, as a state machine: which models are loading, which requests wait on each, and
what ends each wait. Sans-I/O (as ``leader/scheduler.py``): events in, commands out, no asyncio.

A name (a model's key, ``naming.tagged``) is either loading or not. A request that names a model
no instance serves yet asks (``ask``): it waits on the load under way, or one starts (``Start``,
which the pool carries out). The load ends however it ends (its instance serves, it failed, the
pool closed and gave it up: ``ended``), and every request waiting on it is answered then, once;
each goes on with its answer, or leaves before it (its client went), and is done (``done``).
A model is busy (neither evicted nor expired by keep_alive) while it loads and until each of its
waiters is done: a load that has just ended is not idle before the requests that asked for it
are routed to it.

What must hold, whatever the order (``tests/node/test_loads.py``, Hypothesis): a request waits
only on a load under way (no state holds a request nothing will answer); a load that ends answers
every request still waiting on it, and none twice; one load at a time a name.

``node/pool.py`` is its asyncio shell: a task per load started, a future per waiter answered.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

@dataclass(frozen=True)
class Start:
    """Start loading ``key``: its end is ``ended(key)``."""

    key: str


class Loads:
    def __init__(self):
        self._loading: set[str] = set()
        self._waiters: dict[int, str] = {}  # waiter -> the key it asked for, until it is done
        self._waiting: dict[str, set[int]] = {}  # key -> its waiters not answered yet
        self._held: dict[str, int] = {}  # key -> its waiters not done yet (answered or not)
        self._ids = itertools.count(1)

    def loading(self, key: str) -> bool:
        """Whether a load of ``key`` is under way."""
        return key in self._loading

    def busy(self, key: str) -> bool:
        """Whether ``key`` loads, or a request that asked for it is not done with its answer yet."""
        return key in self._loading or key in self._held

    def waiting(self, key: str) -> int:
        """Requests waiting on the load of ``key`` (not answered yet)."""
        return len(self._waiting.get(key, ()))

    def ask(self, key: str) -> tuple[int, list[Start]]:
        """A request waits for ``key`` to load: its waiter id, and the load to start if none is under way."""
        waiter = next(self._ids)
        self._waiters[waiter] = key
        self._waiting.setdefault(key, set()).add(waiter)
        self._held[key] = self._held.get(key, 0) + 1
        if key in self._loading:
            return waiter, []
        self._loading.add(key)
        return waiter, [Start(key)]

    def ended(self, key: str) -> list[int]:
        """The load of ``key`` ended (served, failed or given up): the waiters to answer with its
        outcome, in the order they asked."""
        self._loading.discard(key)
        return sorted(self._waiting.pop(key, ()))

    def done(self, waiter: int) -> None:
        """The request went on with its answer, or left without one (its client went)."""
        key = self._waiters.pop(waiter, None)
        if key is None:
            return
        waiting = self._waiting.get(key)
        if waiting is not None:
            waiting.discard(waiter)
            if not waiting:
                del self._waiting[key]
        if self._held[key] == 1:
            del self._held[key]
        else:
            self._held[key] -= 1
