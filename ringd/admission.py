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

# mlx-lm's KVCache grows its buffers this many positions at a time
# (KVCache.step), so a request of n tokens holds ceil(n / 256) * 256 of them.
KV_STEP_TOKENS = 256


class AdmissionError(ValueError):
    """A request can never fit the ring's KV capacity; the message says where and by how much."""


def kv_tokens(n: int, max_kv_size: int | None = None) -> int:
    """Positions a cache holding n tokens allocates."""
    if max_kv_size is not None:
        n = min(n, max_kv_size)  # a RotatingKVCache stops growing at max_kv_size
    return -(-n // KV_STEP_TOKENS) * KV_STEP_TOKENS


@dataclass(frozen=True)
class StageKv:
    node: str
    bytes_per_token: int  # KV bytes one position costs across this stage's layers
    capacity: int | None  # KV bytes this stage may hold; None: no limit


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


class KvLedger:
    """Bookings of KV positions per key (a request id or a cached prefix), checked per stage."""

    def __init__(self, stages: list[StageKv], max_kv_size: int | None = None):
        self.stages = stages
        self.max_kv_size = max_kv_size
        self._booked: dict[int, int] = {}  # key -> positions booked on every stage

    def need(self, tokens: int) -> list[int]:
        """Bytes ``tokens`` of context cost on each stage."""
        positions = kv_tokens(tokens, self.max_kv_size)
        return [positions * s.bytes_per_token for s in self.stages]

    def used(self) -> list[int]:
        positions = sum(self._booked.values())
        return [positions * s.bytes_per_token for s in self.stages]

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
        self._booked[key] = kv_tokens(tokens, self.max_kv_size)

    def release(self, key: int) -> None:
        self._booked.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._booked

    def status(self) -> list[dict]:
        return [
            {"node": s.node, "kv_used": u, "kv_capacity": s.capacity}
            for s, u in zip(self.stages, self.used())
        ]
