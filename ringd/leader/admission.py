"""KV-cache capacity of the ring, as the leader books it.

Every stage's KV budget is what its memory budget leaves after its weights.
Before a request enters the ring, the leader books its whole context (prompt
plus max_tokens, as mlx-lm's KVCache grows it: in steps of 256 positions) on
every stage at once; a request that does not fit waits, and one that could
never fit is refused. Cached prefixes kept for reuse (``prefix.py``) are
booked the same way, so they are what gets evicted first when room is needed.

Sans-I/O and pure bookkeeping: no clocks, no asyncio, no MLX. The engine
decides what to do when ``fits`` says no (evict, queue, 429).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringd.ring.kvcost import KvCost

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

    def release(self, key: int) -> None:
        self._booked.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._booked

    def status(self) -> list[dict]:
        return [
            {"node": s.node, "kv_used": u, "kv_capacity": s.capacity}
            for s, u in zip(self.stages, self.used())
        ]
