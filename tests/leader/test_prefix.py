"""Prefix reuse: the leader's index (pure), and a chat's next turn served from cached KV on a real ring."""

from __future__ import annotations

from devkit.reference import reference, tokenizer_of

from ringd.leader.prefix import MIN_REUSE_TOKENS, PrefixIndex, common_prefix


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_take_finds_the_longest_shared_prefix_and_leaves_the_last_prompt_token():
    index = PrefixIndex(4)
    index.add(1, list(range(30)))
    index.add(2, list(range(20)) + [99, 98])
    assert index.take(list(range(40))) == (1, 30)
    assert 1 not in index  # taken: one request at a time uses an entry
    # The whole prompt is cached: all but its last token are reused.
    index.add(3, list(range(30)))
    assert index.take(list(range(30))) == (3, 29)
    # Too short a share (a chat template's opening) is not worth an entry.
    assert MIN_REUSE_TOKENS > 4
    assert index.take(list(range(MIN_REUSE_TOKENS - 1)) + [50] * 10) is None
    assert index.take(list(range(MIN_REUSE_TOKENS)) + [50] * 10) == (2, MIN_REUSE_TOKENS)


def test_a_short_share_of_a_long_entry_leaves_it_for_its_own_conversation():
    """A system prompt in common with another conversation's cache does not use that cache up."""
    index = PrefixIndex(4)
    conversation = list(range(100))
    index.add(1, conversation)
    stranger = conversation[:40] + [500] * 20  # the same 40-token system prompt, then its own question
    assert index.take(stranger) is None and 1 in index
    assert index.take(conversation + [7, 8]) == (1, 100)  # the conversation's next turn reuses all of it


def test_entries_past_the_limit_are_evicted_oldest_first():
    index = PrefixIndex(2)
    assert index.add(1, [1] * 20) == []
    assert index.add(2, [2] * 20) == []
    assert index.add(3, [3] * 20) == [1]
    assert index.pop_oldest() == 2 and index.keys() == [3]
    assert PrefixIndex(0).add(7, [1] * 8) == [7]  # off: kept nowhere
    assert index.clear() == [3] and len(index) == 0


def chat(ring, messages, max_tokens=24):
    r = ring.client().chat.completions.create(model=ring.model_id, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage


def test_a_chat_continuation_reuses_the_cached_prefix_and_equals_a_cold_run(tiny_model, ring_pool):
    model = tiny_model(arch="qwen3", layers=6)
    ring = ring_pool(model, 3)
    tok = tokenizer_of(model)
    first = [{"role": "user", "content": "Tell me a story about a ring of small computers."}]
    reply, usage1 = chat(ring, first)
    assert reply
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then what happened?"}]
    text, usage2 = chat(ring, second)

    prompt2 = list(tok.apply_chat_template(second, add_generation_prompt=True))
    cached = usage2.prompt_tokens_details.cached_tokens
    print(f"\nturn 2: {usage2.prompt_tokens} prompt tokens, {cached} of them from the cached prefix")
    assert usage2.prompt_tokens == len(prompt2)
    assert cached >= usage1.prompt_tokens, (cached, usage1.prompt_tokens)  # at least the first turn's prompt
    assert cached < len(prompt2)
    # A cold run of the same conversation: single-process mlx-lm from nothing.
    ref_tokens, _ = reference(model, prompt2, 24)
    assert len(set(ref_tokens)) >= 10
    cold = tok.decode([t for t in ref_tokens if t not in tok.eos_token_ids])
    assert text == cold

    # A request that shares nothing reports no cached tokens.
    _, usage3 = chat(ring, [{"role": "user", "content": "Something else entirely, please."}])
    assert usage3.prompt_tokens_details.cached_tokens == 0
