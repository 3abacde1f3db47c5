"""ringd.stage.sampling's parameter checks: every flaw is a SamplingError that names its field;
and a sampler's grammar: what it follows, and that a replay rebuilds it exactly.

(The sampler's arithmetic against mlx-lm is tested through the ring, in test_ring.py;
grammars themselves in test_grammar.py.)
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.stage import grammar
from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.ring.sampling import MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS_ENTRIES, SamplingError, SamplingParams
from ringd.stage.sampling import RequestSampler


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 2.5),
        ("temperature", 10**400),  # an int too large for math.isfinite
        ("temperature", float("nan")),
        ("top_p", 0),
        ("top_k", -1),
        ("top_k", True),
        ("min_p", float("inf")),
        ("seed", 2**63),
        ("seed", False),
        ("logprobs", 1),
        ("top_logprobs", 21),
        ("presence_penalty", -(10**300)),
        ("frequency_penalty", "high"),
        ("repetition_penalty", 11),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: 101}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
        ("grammar", 5),
        ("grammar", "x" * MAX_GRAMMAR_BYTES),  # over the limit once JSON-quoted, as a frame carries it
        ("grammar", "é" * (MAX_GRAMMAR_BYTES // 6 + 1)),  # six bytes each in a frame
    ],
)
def test_each_bad_parameter_names_its_field(field, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and field in str(e.value)


def test_check_vocab_refuses_top_k_at_or_above_the_vocabulary():
    SamplingParams(top_k=99).check_vocab(100)
    SamplingParams(top_k=0).check_vocab(100)  # 0 is off
    for top_k in (100, 101, 10**30):
        with pytest.raises(SamplingError) as e:
            SamplingParams(top_k=top_k).check_vocab(100)
        assert e.value.field == "top_k" and "vocabulary size 100" in str(e.value)
    with pytest.raises(SamplingError) as e:
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
    assert e.value.field == "logit_bias"


def test_wire_round_trip():
    p = SamplingParams(temperature=0.5, top_k=3, seed=9, logit_bias={7: -2.0}, logprobs=True, top_logprobs=4)
    assert SamplingParams.from_wire(p.to_wire()) == p
    assert "grammar" not in p.to_wire()  # frames without a grammar are as they were
    g = grammar.from_json_schema({"type": "object", "properties": {"é": {"const": "\"q\""}}}, "response_format")
    with_grammar = SamplingParams(seed=9, grammar=g)
    assert SamplingParams.from_wire(json.loads(json.dumps(with_grammar.to_wire()))) == with_grammar


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, 2**63, -1]) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
names = st.sampled_from(["temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs",
                         "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "grammar"])  # fmt: skip


@given(st.dictionaries(names | st.text(max_size=6), values, max_size=6) | values)
@settings(max_examples=300)
def test_from_wire_raises_only_sampling_errors(d):
    # A stage reads these from a frame; stage/runner.py fails the request on a SamplingError.
    try:
        SamplingParams.from_wire(d)
    except SamplingError as e:
        assert str(e)


# --- grammars ----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}, "more": {"type": "array", "items": {"type": "boolean"}}},
    "required": ["word", "n", "more"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def info(tiny_model):
    return model_info(str(tiny_model(arch="qwen3", layers=2)))


@pytest.fixture(scope="module")
def tokenizer(info):
    return load_tokenizer(info)


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer, info):
    return lambda: grammar.ll_tokenizer(tokenizer, info.vocab_size)


def step_logits(vocab_size: int, step: int) -> mx.array:
    """The model's logits at a step: the same for the same step, as a model's are for the same tokens."""
    return mx.random.normal((1, vocab_size), key=mx.random.key(1000 + step)) * 3


def allowed(sampler: RequestSampler, vocab_size: int) -> list[int]:
    return [i for i, ok in enumerate(mx.isfinite(sampler.constraint.mask(mx.zeros((1, vocab_size)))[0]).tolist()) if ok]


def test_tokens_before_the_first_sample_are_prompt_and_after_it_are_followed(tokenizer, grammar_tokenizer, info):
    V = info.vocab_size
    sampler = RequestSampler(SamplingParams(temperature=0, logprobs=True, top_logprobs=5, grammar=grammar.json_object()), grammar_tokenizer)
    # The prompt, and a reused prefix, are observed before any sample: not JSON, and no matter.
    sampler.observe(mx.array(tokenizer.encode("Say something, not JSON.", add_special_tokens=False)))
    sampler.observe(mx.array(tokenizer.encode(" Then more prompt", add_special_tokens=False)))
    first = sampler.sample(mx.zeros((1, V)))
    assert tokenizer.decode([first.token]).startswith("{")
    # The only token the grammar allows has all the probability; the others are no alternatives.
    assert allowed(sampler, V) == [first.token] and first.logprob == 0.0 and first.top_logprobs == [(first.token, 0.0)]
    assert first.mask_s is not None and first.mask_s >= 0
    sampler.observe(mx.array([first.token]))  # fed back: followed
    assert first.token not in allowed(sampler, V)
    sampler.observe(mx.array(tokenizer.encode("zz", add_special_tokens=False)))  # not JSON after "{"
    with pytest.raises(SamplingError) as e:
        sampler.sample(mx.zeros((1, V)))
    assert e.value.field == "grammar"


def test_a_replay_rebuilds_the_grammar_and_samples_the_same_next_token(tokenizer, grammar_tokenizer, info):
    """As the engine replays on a new ring: prompt chunks, then the last prompt token and every
    generated token as a silent sampling step; then the next token is the one the old ring would give."""
    V, eos = info.vocab_size, tokenizer.eos_token_ids
    params = SamplingParams(temperature=1.0, seed=3, grammar=grammar.from_json_schema(SCHEMA, "response_format"))
    prompt = tokenizer.encode("Write JSON please", add_special_tokens=False)

    original = RequestSampler(params, grammar_tokenizer)
    original.observe(mx.array(prompt[:-1]))
    fed = [prompt[-1]]
    for step in range(14):
        original.observe(mx.array(fed[-1:]))
        token = original.sample(step_logits(V, step)).token
        assert token not in eos, "the answer ended too early for the test"
        fed.append(token)
    original.observe(mx.array(fed[-1:]))
    want = original.sample(step_logits(V, len(fed) - 1))

    replayed = RequestSampler(params, grammar_tokenizer)
    replayed.observe(mx.array(prompt[:-1]))
    for step, token in enumerate(fed[:-1]):
        replayed.observe(mx.array([token]))
        assert replayed.sample(step_logits(V, step)).token == fed[step + 1]  # silent: its key advances
    replayed.observe(mx.array(fed[-1:]))
    assert allowed(replayed, V) == allowed(original, V)
    assert replayed.constraint.accepting == original.constraint.accepting
    got = replayed.sample(step_logits(V, len(fed) - 1))
    assert (got.token, got.logprob) == (want.token, want.logprob)


def test_a_grammar_needs_a_tokenizer_and_must_compile(grammar_tokenizer):
    with pytest.raises(SamplingError) as e:
        RequestSampler(SamplingParams(grammar=grammar.json_object()))
    assert e.value.field == "grammar" and "tokenizer" in str(e.value)
    with pytest.raises(SamplingError) as e:
        RequestSampler(SamplingParams(grammar=grammar.from_lark("start: nowhere\n", "grammar")), grammar_tokenizer)
    assert e.value.field == "grammar" and "nowhere" in str(e.value)
