"""What one request's KV caches cost on a stage: measured by the stage, read by the leader.

A stage measures the cost from its own caches when it loads its layers
(``stage/shard.py``) and reports it with its status; the leader books requests
against it (``leader/admission.py``) and the coordinator checks it came whole
(``cluster/reconcile.py``). A plain value: no MLX, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# mlx-lm's KVCache grows its buffers this many positions at a time
# (KVCache.step), so a request of n tokens holds ceil(n / 256) * 256 of them.
KV_STEP_TOKENS = 256


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
