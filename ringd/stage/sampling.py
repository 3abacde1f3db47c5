"""Turn the last stage's logits into tokens, one request at a time.

The parameters travel with a request's first frame as a plain dict
(``ring/sampling.py``); the last stage keeps a ``RequestSampler`` per request. The arithmetic is mlx-lm's ``generate_step``:
logits processors over the token history, then log-softmax, then the sampler,
with mlx-lm's own processors and filters, and between the two, for a request
with a grammar, ``grammar.Constraint``'s mask (so logprobs are those of the
constrained distribution). The one departure is the random key:
mlx-lm draws from MLX's global generator, which requests interleaved on one
compute thread would share, so each request here carries a key of its own
(from its ``seed``, or random) and a seeded request is reproducible whatever
else the ring is doing.

A grammar follows the tokens generated: those observed after the first
``sample``. Tokens observed before it are the prompt (or a reused prefix). So a
failover replay, which sends the prompt and then every generated token as a
silent sampling step, rebuilds the grammar's state exactly.

A verify row (speculative decoding) is drawn at every position at once
(``RequestSampler.verify``), as mlx-lm's ``speculative_generate_step`` samples
its ``num_draft + 1`` positions: a greedy request keeps the proposals that equal
the argmax; a sampled one keeps proposal x with probability min(1, p(x)/q(x)),
p the target's distribution and q the draft's, both after the request's own
transforms (``sampling_filters``, temperature), and after the first rejection
draws from norm(max(0, p - q)), or after the last proposal from p (Leviathan et
al. 2023, Chen et al. 2023): the tokens are distributed as plain sampling's.
Its random key advances once per token produced, as plain sampling's does, so
a seeded request's replay (one silent draw per token) leaves it where it was.

It knows nothing of the network or of text.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ringd.ring.sampling import SamplingError, SamplingParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer

# mlx-lm's penalties look at the last 20 tokens by default; keep its behaviour.
PENALTY_CONTEXT_TOKENS = 20


@dataclass(frozen=True)
class Sample:
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    mask_s: float | None = None  # waiting for and applying the grammar's mask; None without a grammar


@dataclass(frozen=True)
class Draw:
    """A sample as lazy arrays (``RequestSampler.draw``): evaluate ``arrays``, then read ``result``."""

    token: mx.array  # [1]
    logprob: mx.array  # [1, 1]
    top: mx.array | None  # [1, k] token ids, or None
    top_values: mx.array | None  # [1, k] their logprobs
    mask_s: float | None

    @property
    def arrays(self) -> list[mx.array]:
        return [self.token, self.logprob] + ([self.top, self.top_values] if self.top is not None else [])

    def result(self) -> Sample:
        """The sample, once ``arrays`` are evaluated."""
        top_pairs: list[tuple[int, float]] = []
        if self.top is not None:
            # A grammar may allow fewer than k tokens: the rest (-inf) are no alternatives.
            pairs = zip(self.top[0].tolist(), self.top_values[0].tolist())
            top_pairs = sorted(((i, v) for i, v in pairs if v > -math.inf), key=lambda p: -p[1])
        return Sample(self.token.item(), self.logprob.item(), top_pairs, self.mask_s)


def sampling_filters(params: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    """mlx-lm's make_sampler chain over logprobs [n, V], in its order: top_p, min_p, top_k. The
    leader's draft model proposes through the same chain (leader/draft.py), so q is the
    distribution the request itself asks for."""
    filters = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    return filters


def sampled_logits(params: SamplingParams, logprobs: mx.array, filters=None) -> mx.array:
    """The logits a sampled request draws from (``mx.random.categorical``): its filters, then its temperature."""
    for f in sampling_filters(params) if filters is None else filters:
        logprobs = f(logprobs)
    return logprobs * (1 / params.temperature)


def acceptance(p_x: mx.array, q_x: mx.array) -> mx.array:
    """Speculative sampling keeps a proposal x when a uniform draw is below this (so with
    probability min(1, p(x)/q(x))). A module function so a test can swap in a wrong rule
    and see its distribution test fail."""
    return p_x / q_x


def residual(p: mx.array, q: mx.array) -> mx.array:
    """What a rejected position draws from, unnormalized (``mx.random.categorical`` normalizes):
    the target's mass the draft under-proposed. (A test swaps it too.)"""
    return mx.maximum(p - q, 0)


@dataclass(frozen=True)
class Verification:
    """A verify row's draws as lazy arrays (``RequestSampler.verify``): evaluate ``arrays``, then
    read ``result``. Greedy: ``tokens`` the argmax at every position. Sampled: ``accepted``
    [k] whether each proposal passed its test, ``tokens`` [k + 1] what each position draws
    if it is the first rejected (the residual's draw) or, the last, after every proposal."""

    proposals: tuple[int, ...]
    tokens: mx.array  # [k + 1]
    logprobs: mx.array  # [k + 1]: each of ``tokens``' log probability (before the filters)
    accepted: mx.array | None  # [k] bool; None: greedy
    key: mx.array | None = None  # sampled: the request's key after the step's first split

    @property
    def arrays(self) -> list[mx.array]:
        return [self.tokens, self.logprobs] + ([self.accepted] if self.accepted is not None else [])

    def result(self, sampler: "RequestSampler") -> tuple[int, Sample]:
        """How many proposals were kept, and the token after them; the sampler's key moves past
        the positions produced (one split each, as plain draws)."""
        tokens = self.tokens.tolist()
        if self.accepted is None:
            agree = [t == x for t, x in zip(tokens, self.proposals)]
        else:
            agree = self.accepted.tolist()
        kept = agree.index(False) if False in agree else len(self.proposals)
        if self.key is not None:  # one split per token produced, lazily: the next draw evaluates them
            key = self.key
            for _ in range(kept):
                key, _ = mx.random.split(key)
            sampler._key = key
        return kept, Sample(tokens[kept], self.logprobs[kept].item(), [])


def draw_greedy(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy tokens of several plain rows at once (``RequestSampler.plain``), lazily: logits
    [B, V] -> tokens [B] and their logprobs [B, 1], the operations ``draw`` runs on one row,
    batched (as mlx-lm's BatchGenerator samples its batch)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = mx.argmax(logprobs, axis=-1)
    return token, mx.take_along_axis(logprobs, token[:, None], axis=-1).astype(mx.float32)


class RequestSampler:
    """The last stage's sampling state for one request: history, processors, grammar, key.

    ``grammar_tokenizer`` returns llguidance's tokenizer for the model; it is called
    only for a request with a grammar (building it the first time takes a second).
    """

    def __init__(self, params: SamplingParams, grammar_tokenizer: Callable[[], "LLTokenizer"] | None = None):
        self.params = params
        self.constraint = None  # grammar.Constraint, for a request with a grammar
        self._sampled = False  # tokens observed from now on were generated: the grammar follows them
        if params.grammar is not None:
            from ringd.stage.grammar import Constraint, GrammarError

            if grammar_tokenizer is None:
                raise SamplingError("this stage cannot follow a grammar: it was given no tokenizer", "grammar")
            try:
                self.constraint = Constraint(grammar_tokenizer(), params.grammar)
            except GrammarError as e:
                raise SamplingError(str(e), "grammar") from None
        self._processors = make_logits_processors(
            logit_bias=params.logit_bias,
            repetition_penalty=params.repetition_penalty or None,
            repetition_context_size=PENALTY_CONTEXT_TOKENS,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=PENALTY_CONTEXT_TOKENS,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=PENALTY_CONTEXT_TOKENS,
        )
        self._filters = sampling_filters(params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._history: mx.array | None = None

    @property
    def plain(self) -> bool:
        """Greedy, with nothing that follows the request's tokens or asks more than the token
        (penalties, a bias, a grammar, logprobs): its rows may be drawn together (``draw_greedy``)."""
        return self.params.temperature == 0 and not self._processors and self.constraint is None and not self.params.logprobs

    def observe(self, tokens: mx.array) -> None:
        """Tokens that entered the model (prompt chunks, then each fed-back token)."""
        if self._processors:
            self._history = tokens if self._history is None else mx.concatenate([self._history, tokens])
        if self.constraint is not None and self._sampled:
            self.constraint.consume(tokens.tolist())

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` tokens observed (a draft's proposals that were not kept)."""
        if self._history is not None and n > 0:
            self._history = self._history[:-n]

    def sample(self, logits: mx.array) -> Sample:
        """logits: [1, V] for the newest position."""
        draw = self.draw(logits)
        mx.eval(draw.arrays)
        return draw.result()

    def draw(self, logits: mx.array) -> "Draw":
        """The sample after ``logits`` ([1, V], the newest position), lazily: a micro-batch's
        rows are evaluated together, in one ``mx.eval`` (on MLX's CPU backend each is a
        round trip to its thread), and then read with ``Draw.result``."""
        self._sampled = True
        for processor in self._processors:
            logits = processor(self._history, logits)
        mask_s = None
        if self.constraint is not None:
            mx.async_eval(logits)  # MLX computes the step while the mask is waited for
            started = time.perf_counter()
            logits = self._mask(logits)
            mask_s = time.perf_counter() - started
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        if self.params.temperature == 0:
            token = mx.argmax(logprobs, axis=-1)
        else:
            self._key, key = mx.random.split(self._key)
            token = mx.random.categorical(sampled_logits(self.params, logprobs, self._filters), key=key)
        logprob = mx.take_along_axis(logprobs, token[:, None], axis=-1).astype(mx.float32)
        k = self.params.top_logprobs if self.params.logprobs else 0
        if not k:
            return Draw(token, logprob, None, None, mask_s)
        top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
        return Draw(token, logprob, top, mx.take_along_axis(logprobs, top, axis=-1).astype(mx.float32), mask_s)

    def verify(self, logits: mx.array, proposals: tuple[int, ...], draft_probs: mx.array | None) -> Verification:
        """A verify row's draws, lazily: ``logits`` [k + 1, V] after the fed-back token and each of
        the k ``proposals``; ``draft_probs`` [k, V] the draft's distribution q each proposal was
        drawn from (a sampled request's; a greedy one needs none). Only for requests whose
        parameters are ``verifiable`` (no history enters its distribution but logit_bias's, which
        needs none)."""
        if not self.params.verifiable:
            raise SamplingError("a draft's proposals are verified only for requests without penalties or a grammar")
        self._sampled = True
        k = len(proposals)
        for processor in self._processors:
            logits = processor(self._history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.params.temperature == 0:
            tokens = mx.argmax(logprobs, axis=-1)
            return Verification(proposals, tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0].astype(mx.float32), None)
        if draft_probs is None or draft_probs.shape != (k, logits.shape[-1]):
            raise SamplingError("a sampled request's proposals must come with the draft's distribution for each")
        scaled = sampled_logits(self.params, logprobs, self._filters)  # [k + 1, V]
        p = mx.softmax(scaled, axis=-1)
        # The step's randomness comes from the key's next split, as a plain draw's; the key then
        # moves one split per token produced (``Verification.result``), as plain draws move it.
        key, use = mx.random.split(self._key)
        test, redraw, last = mx.random.split(use, 3)
        x = mx.array(proposals, dtype=mx.int32)[:, None]
        p_x = mx.take_along_axis(p[:k], x, axis=-1)[:, 0]
        q_x = mx.take_along_axis(draft_probs, x, axis=-1)[:, 0]
        accepted = mx.random.uniform(shape=(k,), key=test) < acceptance(p_x, q_x)
        rest = residual(p[:k], draft_probs)
        # p and q equal to rounding leave no residual: then p itself (rejection was a rounding's chance).
        rest = mx.where(rest.sum(axis=-1, keepdims=True) > 0, rest, p[:k])
        redrawn = mx.random.categorical(mx.log(rest), key=redraw)  # [k]: after a rejection at each position
        after = mx.random.categorical(scaled[k:], key=last)  # [1]: every proposal kept, one more from p
        tokens = mx.concatenate([redrawn, after])
        lp = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0].astype(mx.float32)
        return Verification(proposals, tokens, lp, accepted, key)

    def _mask(self, logits: mx.array) -> mx.array:
        from ringd.stage.grammar import GrammarError

        try:
            return self.constraint.mask(logits)
        except GrammarError as e:  # fails this request only (runner.py)
            raise SamplingError(str(e), "grammar") from None
