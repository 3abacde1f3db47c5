"""The leader's draft model: it proposes the tokens a speculative step asks the ring to verify.

Speculative decoding as mlx-lm's ``speculative_generate_step`` does it, on a
ring: a small model that shares the big one's vocabulary runs whole on the
leader and proposes the next few tokens; one trip around the ring computes
every proposal's position at once, and the last stage keeps those it accepts
(``stage/sampling.py``). A ring pays one traversal per step, so each proposal
kept saves a whole trip.

For a greedy request the draft proposes its own greedy tokens. For a sampled
one it samples them, through the request's own filters and temperature, from q
as it travels (``steps.cut_draft``: its likeliest tokens and an even tail), and
hands back that q for each: the last stage's test min(1, p/q) needs it. Its random key for a position comes from the request's
seed and that position alone, so a seeded request proposes the same tokens
however often it is asked (a replay, an answer that came too late).

The draft keeps its own KV cache per request: for each ask it trims the cache
to what it shares with the request's sequence (proposals that were not kept
leave), computes the tokens it has not seen in one pass, then proposes. Its
MLX work runs on the node's compute thread, as every other.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from ringd.models.checkpoint import ModelInfo
from ringd.models.errors import ModelError
from ringd.models.source import model_info
from ringd.ring import steps
from ringd.ring.sampling import SamplingParams
from ringd.stage.compute import ComputeThread
from ringd.stage.sampling import sampling_filters, sampled_logits
from ringd.stage.shard import Shard

log = logging.getLogger(__name__)

# Tokens the draft computes in one pass when it catches up with a request's sequence
# (its prompt, at first), as mlx-lm's prefill_step_size.
CATCH_UP_CHUNK = 512
# Requests whose draft caches are kept; the engine forgets a request when it ends, so
# this only bounds what a leak could hold (the engine's MAX_ACTIVE_REQUESTS is below it).
MAX_DRAFT_SESSIONS = 256


@dataclass(frozen=True)
class Proposal:
    """A draft's tokens and, for a sampled request, the distribution each was drawn from, as the
    ring carries it (``steps.cut_draft``, ``steps.pack_draft``): its support's token ids
    (``ids``: [len(tokens), S] uint32), their probabilities (``probs``: [len(tokens), S]
    float32) and its tail (``tails``: [len(tokens)] float32)."""

    tokens: tuple[int, ...]
    ids: np.ndarray | None = None
    probs: np.ndarray | None = None
    tails: np.ndarray | None = None


def position_key(seed: int, position: int) -> mx.array:
    """The draft's random key for the proposal at ``position`` of a request seeded ``seed``: a
    function of the two alone, and apart from the last stage's key (stage/sampling.py)."""
    digest = hashlib.blake2b(f"ringd draft {seed} {position}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little") >> 1)


def draw(params: SamplingParams, logits: mx.array, seed: int, position: int, filters=None) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array]]:
    """A sampled request's proposal at ``position`` after the draft's ``logits`` [1, V], lazily:
    the token [1], and the distribution q it is drawn from as the ring carries it (``steps.cut_draft``:
    ids [1, S], probabilities [1, S], tail [1], float32): the request's own filters and temperature
    over the logits, its likeliest tokens kept, the rest of its mass spread evenly."""
    logits = logits.astype(mx.float32)
    q = mx.softmax(sampled_logits(params, logits - mx.logsumexp(logits, axis=-1, keepdims=True), filters), axis=-1)
    cut = steps.cut_draft(q)
    drawn_from = steps.dense_draft(*cut, q.shape[-1])  # what the last stage rebuilds, bit for bit
    return mx.random.categorical(mx.log(drawn_from), key=position_key(seed, position)), cut


class Drafter:
    def __init__(self, shard: Shard, compute: ComputeThread, name: str):
        self.shard = shard
        self.compute = compute
        self.name = name
        self._states: OrderedDict[int, tuple[list[Any], list[int], int]] = OrderedDict()  # rid -> (cache, tokens it holds, seed)

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

    async def propose(self, rid: int, sequence: tuple[int, ...], k: int, params: SamplingParams | None = None) -> Proposal:
        """Up to ``k`` tokens the draft proposes after ``sequence`` (request ``rid``'s prompt and
        tokens): greedy ones, or drawn as ``params`` asks (temperature above 0) with their distributions."""
        return await self.compute.run(self._propose, rid, sequence, k, params)

    def forget(self, rid: int) -> None:
        """The request ended: its draft cache goes (after whatever is queued for it)."""
        try:
            self.compute.submit(self._states.pop, rid, None)
        except RuntimeError:  # the compute thread has stopped: the node is going, and its caches with it
            pass

    # --- compute thread -------------------------------------------------------

    def _propose(self, rid: int, sequence: tuple[int, ...], k: int, params: SamplingParams | None = None) -> Proposal:
        sampled = params is not None and params.temperature > 0
        cache, held, seed = self._states.pop(rid, (None, [], None))
        if cache is None:
            cache = self.shard.make_cache(None)
        if seed is None:
            seed = params.seed if params is not None and params.seed is not None else secrets.randbits(63)
        # What the cache holds that the sequence shares (a proposal not kept does not).
        common, limit = 0, min(len(held), len(sequence) - 1)
        while common < limit and held[common] == sequence[common]:
            common += 1
        trim_prompt_cache(cache, len(held) - common)
        rest = sequence[common:-1]
        for i in range(0, len(rest), CATCH_UP_CHUNK):
            self.shard(mx.array([rest[i : i + CATCH_UP_CHUNK]], dtype=mx.int32), None, cache)
            mx.eval([c.state for c in cache])
        filters = sampling_filters(params) if sampled else []
        # Each step's token feeds the next without being read: one evaluation for the k of them.
        # (mlx-lm's _draft_generate also hands each to async_eval; on MLX's CPU backend that
        # is a thread handoff per step, and the proposals are read only together anyway.)
        y, tokens, cuts = mx.array([[sequence[-1]]], dtype=mx.int32), [], []
        for i in range(k):
            logits = self.shard(y, None, cache)[:, -1, :]
            if sampled:
                token, cut = draw(params, logits, seed, len(sequence) + i, filters)
                cuts.append(cut)
            else:
                token = mx.argmax(logits, axis=-1)
            tokens.append(token)
            y = token[:, None].astype(mx.int32)
        mx.eval(tokens, cuts)
        proposals = tuple(int(t.item()) for t in tokens)
        held = list(sequence) + list(proposals[:-1]) if k > 0 else list(sequence[:-1])
        self._states[rid] = (cache, held, seed)
        while len(self._states) > MAX_DRAFT_SESSIONS:
            self._states.popitem(last=False)
        if not (sampled and k):
            return Proposal(proposals)
        ids, probs, tails = (np.array(mx.concatenate(part)) for part in zip(*cuts))
        return Proposal(proposals, ids, probs, tails)
