"""ringd.leader.draft: the leader's draft model proposes what mlx-lm's greedy decoding of it would, and
keeps its cache in step with a request whose proposals were kept in part.

In-process, on the node's compute thread as the daemon runs it; the ring's side of speculative
decoding is in test_pipeline, test_engine and test_ring.
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_load

from ringd.models.source import model_info
from ringd.models.errors import ModelError
from ringd.stage.compute import ComputeThread
from ringd.leader.draft import Drafter


def greedy(model, sequence: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(sequence), model, max_tokens=n)]


def test_proposals_are_the_drafts_greedy_tokens_whatever_was_kept_before(tiny_model):
    path = tiny_model(arch="llama", layers=2, dtype="float32")
    model, _ = mlx_load(str(path))
    prompt = [5, 17, 200, 33, 9, 41]

    async def main():
        compute = ComputeThread()
        try:
            drafter = await Drafter.load(str(path), compute, model_info(str(path)))
            first = (await drafter.propose(1, tuple(prompt), 3)).tokens
            # Two of three kept, then a token of the big model's own: the draft's cache must drop
            # its third proposal and go on from the sequence as it is now.
            sequence = prompt + list(first[:2]) + [(first[2] + 1) % 700]
            second = (await drafter.propose(1, tuple(sequence), 4)).tokens
            # All kept, and the big model's token after them.
            sequence += list(second) + [7]
            third = (await drafter.propose(1, tuple(sequence), 2)).tokens
            drafter.forget(1)
            await compute.run(lambda: None)
            return first, second, third, sequence, dict(drafter._states)
        finally:
            await compute.stop()

    first, second, third, sequence, left = asyncio.run(main())
    assert list(first) == greedy(model, prompt, 3)
    assert list(second) == greedy(model, sequence[: len(sequence) - 5], 4)
    assert list(third) == greedy(model, sequence, 2)
    assert left == {}


def test_a_draft_with_another_vocabulary_is_refused_by_name(tiny_model):
    target = tiny_model(arch="llama", layers=2, dtype="float32")
    other = tiny_model(arch="llama", layers=1, dtype="float32", vocab_size=1024)

    async def main():
        compute = ComputeThread()
        try:
            with pytest.raises(ModelError, match="vocabulary has 1024 tokens.*must share the served model's tokenizer"):
                await Drafter.load(str(other), compute, model_info(str(target)))
            with pytest.raises(ModelError, match="^draft_model: "):
                await Drafter.load("/nonexistent/draft", compute, model_info(str(target)))
        finally:
            await compute.stop()

    asyncio.run(main())


def test_a_sampled_requests_proposals_come_with_their_distributions_and_follow_its_seed(tiny_model):
    """For a sampled request the draft draws through the request's own filters (top_k here) and
    hands back each proposal's distribution q; a seeded request proposes the same tokens however
    often it is asked, whatever its draft cache held before."""
    import numpy as np

    from ringd.ring.sampling import SamplingParams
    from ringd.ring.steps import DRAFT_SUPPORT

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    prompt = (5, 17, 200, 33, 9, 41)
    params = SamplingParams(temperature=0.9, top_k=5, seed=11)

    async def main():
        compute = ComputeThread()
        try:
            drafter = await Drafter.load(str(path), compute, model_info(str(path)))
            first = await drafter.propose(1, prompt, 4, params)
            again = await drafter.propose(1, prompt, 4, params)  # its cache holds the proposals now: trimmed back
            other = await drafter.propose(2, prompt, 4, SamplingParams(temperature=0.9, top_k=5, seed=12))
            greedy = await drafter.propose(3, prompt, 4, SamplingParams(temperature=0))
            return first, again, other, greedy
        finally:
            await compute.stop()

    first, again, other, greedy = asyncio.run(main())
    assert first.tokens == again.tokens and np.array_equal(first.probs, again.probs) and np.array_equal(first.ids, again.ids)
    # q travels cut: the DRAFT_SUPPORT likeliest of the 704 tokens (ids, probabilities) and a tail.
    assert first.ids.shape == first.probs.shape == (4, DRAFT_SUPPORT) and first.tails.shape == (4,)
    assert first.probs.dtype == first.tails.dtype == np.float32 and first.ids.dtype == np.uint32
    assert (np.sort(first.ids, axis=1)[:, 1:] != np.sort(first.ids, axis=1)[:, :-1]).all()  # each id once
    # top_k=5 leaves 5 tokens, all within the support: nothing is left for the tail.
    assert np.allclose(first.probs.sum(axis=1), 1, atol=1e-5) and ((first.probs > 0).sum(axis=1) == 5).all() and (first.tails < 1e-8).all()
    assert all(first.probs[i][first.ids[i] == t][0] > 0 for i, t in enumerate(first.tokens))  # each drawn from its own q
    assert np.array_equal(first.probs[0], other.probs[0]) and np.array_equal(first.ids[0], other.ids[0])  # q is the context's; the draw is the seed's
    assert greedy.probs is None and greedy.ids is None and greedy.tails is None and len(greedy.tokens) == 4
