"""The leader's draft model: it proposes the tokens a speculative step asks the ring to verify.

Speculative decoding as mlx-lm's ``speculative_generate_step`` does it, on a
ring: a small model that shares the big one's vocabulary runs whole on the
leader and proposes the next few tokens greedily; one trip around the ring
computes every proposal's position at once, and the last stage keeps those
that agree with what the big model samples (``stage/runner.py``). A ring pays one
traversal per step, so each proposal kept saves a whole trip.

The draft keeps its own KV cache per request: for each ask it trims the cache
to what it shares with the request's sequence (proposals that were not kept
leave), computes the tokens it has not seen in one pass, then proposes. Its
MLX work runs on the node's compute thread, as every other.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ringd.models.checkpoint import ModelInfo
from ringd.models.errors import ModelError
from ringd.models.source import model_info
from ringd.stage.compute import ComputeThread
from ringd.stage.shard import Shard

log = logging.getLogger(__name__)

# Tokens the draft computes in one pass when it catches up with a request's sequence
# (its prompt, at first), as mlx-lm's prefill_step_size.
CATCH_UP_CHUNK = 512
# Requests whose draft caches are kept; the engine forgets a request when it ends, so
# this only bounds what a leak could hold (the engine's MAX_ACTIVE_REQUESTS is below it).
MAX_DRAFT_SESSIONS = 256


class Drafter:
    def __init__(self, shard: Shard, compute: ComputeThread, name: str):
        self.shard = shard
        self.compute = compute
        self.name = name
        self._states: OrderedDict[int, tuple[list[Any], list[int]]] = OrderedDict()  # rid -> (cache, tokens it holds)

    @classmethod
    async def load(cls, path_or_repo: str, compute: ComputeThread, target: ModelInfo) -> "Drafter":
        """The draft model, whole, on the compute thread; a ModelError says why it cannot draft for ``target``."""

        def load() -> Drafter:
            try:
                info = model_info(path_or_repo)
            except ModelError as e:
                raise ModelError(f"draft_model: {e}") from None
            if info.vocab_size != target.vocab_size:
                raise ModelError(
                    f"draft model {info.name}: its vocabulary has {info.vocab_size} tokens, the model served "
                    f"({target.name}) {target.vocab_size}; a draft must share the served model's tokenizer"
                )
            shard = Shard.load(path_or_repo, 0, info.num_layers)
            if not can_trim_prompt_cache(shard.make_cache(None)):
                raise ModelError(
                    f"draft model {info.name}: its caches cannot be trimmed (sliding windows or recurrent state); pick a draft without them"
                )
            return cls(shard, compute, info.name)

        drafter = await compute.run(load)
        log.info("draft model %s loaded: the leader proposes tokens for speculative decoding", drafter.name)
        return drafter

    async def propose(self, rid: int, sequence: tuple[int, ...], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens the draft expects after ``sequence`` (request ``rid``'s prompt and tokens)."""
        return await self.compute.run(self._propose, rid, sequence, k)

    def forget(self, rid: int) -> None:
        """The request ended: its draft cache goes (after whatever is queued for it)."""
        try:
            self.compute.submit(self._states.pop, rid, None)
        except RuntimeError:  # the compute thread has stopped: the node is going, and its caches with it
            pass

    # --- compute thread -------------------------------------------------------

    def _propose(self, rid: int, sequence: tuple[int, ...], k: int) -> tuple[int, ...]:
        cache, held = self._states.pop(rid, (None, []))
        if cache is None:
            cache = self.shard.make_cache(None)
        # What the cache holds that the sequence shares (a proposal not kept does not).
        common, limit = 0, min(len(held), len(sequence) - 1)
        while common < limit and held[common] == sequence[common]:
            common += 1
        trim_prompt_cache(cache, len(held) - common)
        rest = sequence[common:-1]
        for i in range(0, len(rest), CATCH_UP_CHUNK):
            self.shard(mx.array([rest[i : i + CATCH_UP_CHUNK]], dtype=mx.int32), None, cache)
            mx.eval([c.state for c in cache])
        held = list(sequence) if k > 0 else list(sequence[:-1])
        token, proposals = sequence[-1], []
        for i in range(k):
            logits = self.shard(mx.array([[token]], dtype=mx.int32), None, cache)
            token = int(mx.argmax(logits[0, -1]).item())
            proposals.append(token)
            if i < k - 1:
                held.append(token)
        self._states[rid] = (cache, held)
        while len(self._states) > MAX_DRAFT_SESSIONS:
            self._states.popitem(last=False)
        return tuple(proposals)
