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


class KvCostError(ValueError):
    """A malformed KV cost (from the network); the message says what."""


# A stage reports at most this many distinct cache windows (one per sliding-window size).
MAX_WINDOWS = 8
# Bytes travel as JSON integers; beyond 2**53 not every reader holds them exactly.
MAX_BYTES = 2**53 - 1


@dataclass(frozen=True)
class KvCost:
    """What one request's caches cost on one stage, by the positions they hold.

    Measured by the stage from its own caches at load (``shard.py``), not from a
    formula over the config: multi-head latent attention caches a compressed
    latent, sliding-window caches stop growing at their window, linear-attention
    state has a constant size.

    ``per_token``: bytes per position of the caches that grow with the context
    (mlx-lm's KVCache, allocated KV_STEP_TOKENS positions at a time).
    ``windows``: (bytes per position, window) of caches that stop growing
    (RotatingKVCache). ``fixed``: bytes whatever the length (ArraysCache state).
    ``itemsize``: bytes of one element of the growing caches, which mlx-lm's
    quantized KV cache (kv_bits) is computed from.
    ``trim_limit``: how far the caches can be trimmed back to a shorter prefix
    (prefix reuse): None at any length, n only while they hold fewer than n
    positions (a rotating cache), 0 never (linear-attention state).
    """

    per_token: int = 0
    windows: tuple[tuple[int, int], ...] = ()
    fixed: int = 0
    itemsize: int = 2
    trim_limit: int | None = None

    def bytes(self, tokens: int, max_kv_size: int | None = None, kv_bits: int | None = None, group_size: int = 64) -> int:
        """Bytes the caches of a request of ``tokens`` positions hold on this stage."""
        positions = kv_tokens(tokens, max_kv_size)
        per = self.per_token
        if kv_bits is not None and per:
            # mlx-lm's QuantizedKVCache: kv_bits per element plus a scale and a bias per group.
            elements = per // self.itemsize
            per = elements * kv_bits // 8 + 2 * (elements // group_size) * self.itemsize
        return per * positions + sum(b * min(positions, w) for b, w in self.windows) + self.fixed

    def to_wire(self) -> dict:
        return {"per_token": self.per_token, "windows": [list(w) for w in self.windows], "fixed": self.fixed, "itemsize": self.itemsize, "trim_limit": self.trim_limit}

    @classmethod
    def from_wire(cls, d: object) -> "KvCost":
        def count(what: str, v: object, allow_none: bool = False) -> int | None:
            if v is None and allow_none:
                return None
            if type(v) is not int or not 0 <= v <= MAX_BYTES:
                raise KvCostError(f"KV cost {what} must be an integer from 0 to {MAX_BYTES}, got {v!r:.40}")
            return v

        keys = {"per_token", "windows", "fixed", "itemsize", "trim_limit"}
        if not isinstance(d, dict) or set(d) != keys:
            raise KvCostError(f"a KV cost has exactly {', '.join(sorted(keys))}; got {d!r:.200}")
        windows = d["windows"]
        if not isinstance(windows, list) or len(windows) > MAX_WINDOWS or not all(isinstance(w, list) and len(w) == 2 for w in windows):
            raise KvCostError(f"KV cost windows must be at most {MAX_WINDOWS} [bytes per position, window] pairs")
        return cls(
            count("per_token", d["per_token"]),
            tuple((count("window bytes", b), count("window", w)) for b, w in windows),
            count("fixed", d["fixed"]),
            count("itemsize", d["itemsize"]) or 1,
            count("trim_limit", d["trim_limit"], allow_none=True),
        )


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
