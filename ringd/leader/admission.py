"""KV-cache capacity of the ring, as the leader books it.

Every stage's KV budget is what its memory budget leaves after its weights.
Before a request enters the ring, the leader books its whole context (prompt
plus max_tokens, as mlx-lm's KVCache grows it: in steps of 256 positions) on
every stage at once; a request that does not fit waits, and one that could
never fit is refused. Cached prefixes kept for reuse (``prefix.py``) are
booked the same way, so they are what gets evicted first when room is needed.

``KvLedger`` is sans-I/O and pure bookkeeping: no clocks, no asyncio, no MLX.
``Admission`` is the line in front of it: a request books its room, or waits
in a bounded FIFO line (asyncio futures, a deadline) while the engine makes
room (``make_room``: it evicts cached prefixes, oldest first), or is told to
come back (429). The engine calls it; it knows nothing of the ring.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Callable

from ringd.leader.errors import RETRY_AFTER_S, EngineError
from ringd.base.logs import about
from ringd.ring.kvcost import KvCost

log = logging.getLogger(__name__)

# Requests waiting for KV room. Past this a client is better off told to come
# back (429) than kept waiting behind a long queue.
MAX_QUEUED_REQUESTS = 32
# Longest a request waits for KV room before a 429; generating a long answer
# takes about this long, so waiting longer rarely pays off.
QUEUE_TIMEOUT_S = 60.0
# Longest a request that arrives while a lost ring is being re-planned waits for the
# next: re-planning over the survivors takes a few heartbeats (links.py), a stage
# that loads new layers from disk tens of seconds.
FAILOVER_WAIT_S = 60.0


class AdmissionError(ValueError):
    """A request can never fit the ring's KV capacity; the message says where and by how much."""


@dataclass(frozen=True)
class StageKv:
    node: str
    cost: KvCost  # what a request's caches cost on this stage
    capacity: int | None  # KV bytes this stage may hold; None: no limit


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class KvLedger:
    """Bookings of KV positions per key (a request id or a cached prefix), checked per stage."""

    def __init__(self, stages: list[StageKv], max_kv_size: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64):
        self.stages = stages
        self.max_kv_size = max_kv_size
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self._booked: dict[int, int] = {}  # key -> tokens booked on every stage

    def _bytes(self, stage: StageKv, tokens: int) -> int:
        return stage.cost.bytes(tokens, self.max_kv_size, self.kv_bits, self.kv_group_size)

    def need(self, tokens: int) -> list[int]:
        """Bytes ``tokens`` of context cost on each stage."""
        return [self._bytes(s, tokens) for s in self.stages]

    def used(self) -> list[int]:
        return [sum(self._bytes(s, t) for t in self._booked.values()) for s in self.stages]

    def check_possible(self, tokens: int) -> None:
        """Raise AdmissionError if ``tokens`` of context exceed some stage's whole KV capacity."""
        for s, need in zip(self.stages, self.need(tokens)):
            if s.capacity is not None and need > s.capacity:
                raise AdmissionError(
                    f"a context of {tokens} tokens needs {_mib(need)} of KV cache on {s.node}, "
                    f"which has {_mib(max(s.capacity, 0))} left after its weights; "
                    "lower max_tokens, shorten the prompt, or raise memory_budget_gb"
                )

    def fits(self, tokens: int) -> bool:
        return all(
            s.capacity is None or u + n <= s.capacity for s, u, n in zip(self.stages, self.used(), self.need(tokens))
        )

    def book(self, key: int, tokens: int) -> None:
        self._booked[key] = tokens

    def resize(self, capacities: list[int | None]) -> None:
        """New capacities per stage (another instance came to share, or left, a node): bookings stay;
        while some stage holds more than its new capacity, new requests wait for room."""
        self.stages = [StageKv(s.node, s.cost, c) for s, c in zip(self.stages, capacities, strict=True)]

    def release(self, key: int) -> None:
        self._booked.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._booked

    def status(self) -> list[dict]:
        return [
            {"node": s.node, "kv_used": u, "kv_capacity": s.capacity}
            for s, u in zip(self.stages, self.used())
        ]


class Admission:
    """Requests booking their KV room on the ring's ledger, or waiting in line for it.

    ``make_room(need)``: whether ``need`` positions fit the ledger once the engine has
    evicted what it may (cached prefixes); it is asked before each booking.
    """

    def __init__(self, make_room: Callable[[int], bool], max_queued: int = MAX_QUEUED_REQUESTS, queue_timeout_s: float = QUEUE_TIMEOUT_S):
        self.make_room = make_room
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.ledger: KvLedger | None = None  # the serving ring's; None: no limit
        self._waiting: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()

    @property
    def queued(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    async def admit(self, rid: int, need: int, request_id: str | None) -> None:
        """Book ``need`` positions on every stage, waiting in line for room if there is none:
        an EngineError 400 if they could never fit, 429 if the line is full or the wait too long."""
        ledger = self.ledger
        if ledger is None:
            return
        try:
            ledger.check_possible(need)
        except AdmissionError as e:
            raise EngineError(str(e), 400) from None
        if not self._waiting and self.make_room(need):
            ledger.book(rid, need)
            return
        if self.queued >= self.max_queued:
            raise EngineError(
                f"the ring's KV cache is full and {self.max_queued} requests are already waiting; retry shortly",
                429, RETRY_AFTER_S,
            )  # fmt: skip
        fut = asyncio.get_running_loop().create_future()
        entry = (rid, need, fut)
        self._waiting.append(entry)
        log.info("req=%x: waiting for KV room (%d queued)", rid, self.queued, extra=about(request_id, rid=f"{rid:x}", queued=self.queued))
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # booked just as the time ran out
            raise EngineError(
                f"no KV room for this request within {self.queue_timeout_s:.0f} s; retry shortly", 429, RETRY_AFTER_S
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled() and self.ledger is ledger:
                ledger.release(rid)  # booked just as the client left
                self.wake()
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def wake(self) -> None:
        """Admit waiting requests, in order, while they fit."""
        while self._waiting and self.ledger is not None:
            rid, need, fut = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self.make_room(need):
                return
            self.ledger.book(rid, need)
            fut.set_result(None)
            self._waiting.popleft()

    def release(self, key: int) -> None:
        """``key``'s booking goes (a request's, or a cached prefix's)."""
        if self.ledger is not None:
            self.ledger.release(key)

    def book(self, key: int, tokens: int) -> None:
        if self.ledger is not None:
            self.ledger.book(key, tokens)
