"""ringd.stage.sampling's parameter checks: every flaw is a SamplingError that names its field;
and a sampler's grammar: what it follows, and that a replay rebuilds it exactly.

(The sampler's arithmetic against mlx-lm is tested through the ring, in test_ring.py;
grammars themselves in test_grammar.py.)
"""

from __future__ import annotations

import json
import math
from collections import Counter

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.stage import grammar
from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.ring.sampling import MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS_ENTRIES, SamplingError, SamplingParams
from ringd.stage.sampling import RequestSampler
from mlx_lm.utils import load as mlx_load


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


# --- speculative sampling preserves the distribution -------------------------------------------

# Seeded requests per run of the distribution test: with this draft and target, a rule that
# is wrong moves the chi-square statistic by about 60 or more (its noncentrality), far past the
# critical value at SIGNIFICANCE, while a run stays a few seconds.
SPECULATED_REQUESTS = 600
# The test's significance: a correct rule fails it with this probability at most (for fixed
# seeds: never, once it passes), a wrong one passes it with a chance this small.
SIGNIFICANCE = 1e-3
SPECULATIVE_PARAMS = dict(temperature=1.0, top_k=4)  # four tokens per position: every cell well filled
# A first token after which the draft and the target agree about two times in three: the test
# and the residual draw both count.
FIRST_TOKEN = 85
# Requests drawn in one evaluation.
EVALUATED_TOGETHER = 300


def chi_square_tail(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with ``dof`` degrees of freedom, in closed form (no SciPy here):
    Poisson terms for even dof, erfc and half-integer gamma terms for odd."""
    half = x / 2
    if math.isinf(x):
        return 0.0
    if dof % 2 == 0:
        return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))
    return math.erfc(math.sqrt(half)) + math.exp(-half) * sum(half ** (i - 0.5) / math.gamma(i + 0.5) for i in range(1, (dof + 1) // 2))


class Logits:
    """A model's logits [1, V] after each context, computed once (few contexts recur: four tokens
    a position)."""

    def __init__(self, path):
        self.model, self.seen = mlx_load(str(path))[0], {}

    def __call__(self, context: tuple[int, ...]) -> mx.array:
        if context not in self.seen:
            self.seen[context] = self.model(mx.array([context]))[:, -1, :].astype(mx.float32)
            mx.eval(self.seen[context])
        return self.seen[context]


def plain_distribution(target: Logits) -> dict[tuple[int, int], float]:
    """The first two tokens' joint distribution under plain sampling (mlx-lm's own top_k filter,
    then the temperature): exactly, from the model's logits."""
    from mlx_lm.sample_utils import apply_top_k

    def dist(context: tuple[int, ...]) -> list[float]:
        logits = target(context)
        filtered = apply_top_k(logits - mx.logsumexp(logits, axis=-1, keepdims=True), SPECULATIVE_PARAMS["top_k"])
        return mx.softmax(filtered / SPECULATIVE_PARAMS["temperature"], axis=-1)[0].tolist()

    first = dist((FIRST_TOKEN,))
    return {(a, b): pa * pb for a, pa in enumerate(first) if pa > 0 for b, pb in enumerate(dist((FIRST_TOKEN, a))) if pb > 0}


def speculated(target: Logits, draft: Logits, requests: int) -> tuple[Counter, float]:
    """The first two tokens of ``requests`` sampled requests (seeds 0, 1, ...), each speculating as
    the ring does: the leader's draft (``draft.draw``) proposes two tokens after FIRST_TOKEN, the
    last stage's sampler tests them against the target's logits at the three positions
    (``RequestSampler.verify``); a step whose first proposal is rejected gives one token, and a
    second step (one proposal) the next. Also the share of proposals kept."""
    from ringd.leader.draft import draw
    from ringd.ring.steps import dense_draft

    V = target((FIRST_TOKEN,)).shape[-1]  # the vocabulary the distributions are densified over
    counts, made, kept = Counter(), 0, 0
    for start in range(0, requests, EVALUATED_TOGETHER):
        samplers = {start + i: RequestSampler(SamplingParams(**SPECULATIVE_PARAMS, seed=start + i)) for i in range(min(EVALUATED_TOGETHER, requests - start))}
        firsts: dict[int, tuple[int, ...]] = {}
        for k, todo in ((2, list(samplers)), (1, None)):
            todo = list(firsts) if todo is None else todo
            sequences = {seed: (FIRST_TOKEN, *firsts.get(seed, ())) for seed in todo}
            proposals = {seed: () for seed in todo}
            probs = {seed: [] for seed in todo}
            for i in range(k):  # each proposal of every request drawn at once, as the draft would one by one
                drawn = {seed: draw(samplers[seed].params, draft(sequences[seed] + proposals[seed]), seed, len(sequences[seed]) + i) for seed in todo}
                mx.eval([token for token, _ in drawn.values()])
                for seed, (token, cut) in drawn.items():
                    proposals[seed] += (token.item(),)
                    probs[seed].append(dense_draft(*cut, V))  # as the last stage rebuilds it
            checks = {}
            for seed in todo:
                logits = mx.concatenate([target(sequences[seed] + proposals[seed][:i]) for i in range(k + 1)])
                checks[seed] = samplers[seed].verify(logits, proposals[seed], mx.concatenate(probs[seed]))
            mx.eval([a for v in checks.values() for a in v.arrays])
            for seed, verification in checks.items():
                accepted, sample = verification.result(samplers[seed])
                made, kept = made + k, kept + accepted
                tokens = firsts.pop(seed, ()) + proposals[seed][:accepted] + (sample.token,)
                if len(tokens) >= 2:
                    counts[tokens[:2]] += 1
                else:
                    firsts[seed] = tokens
        assert not firsts
    return counts, kept / made


def chi_square(counts: Counter, expected: dict[tuple[int, int], float]) -> tuple[float, int]:
    """The statistic and degrees of freedom of ``counts`` against ``expected`` probabilities, the
    cells expected fewer than 5 times pooled into one (so the chi-square law holds); infinite
    where a count falls where plain sampling never draws."""
    n = sum(counts.values())
    if not set(counts) <= set(expected):
        return math.inf, len(expected) - 1
    cells, rest = [], [0, 0.0]
    for cell, p in expected.items():
        if n * p >= 5:
            cells.append((counts[cell], n * p))
        else:
            rest[0] += counts[cell]
            rest[1] += n * p
    if rest[1] > 0:
        cells.append(tuple(rest))
    return sum((seen - e) ** 2 / e for seen, e in cells), len(cells) - 1


@pytest.fixture(scope="module")
def speculating_pair(tiny_model):
    """A target and a draft that agree about two times in three after FIRST_TOKEN (the draft has
    the target's seed and half its layers), their logits computed once for every test."""
    return Logits(tiny_model(arch="llama", layers=4, dtype="float32")), Logits(tiny_model(arch="llama", layers=2, dtype="float32"))


@pytest.mark.parametrize("rule", ["as written", "a draft cut to its 2 likeliest tokens", "accepts with min(1, q/p)", "redraws from p, not the residual"])
def test_speculative_sampling_draws_the_first_tokens_as_plain_sampling_does(speculating_pair, monkeypatch, rule):
    """Over many seeded requests, the first two tokens speculative sampling gives (the leader's
    draft proposing, the last stage's sampler testing) are distributed as plain sampling's: a
    chi-square test at SIGNIFICANCE against the exact joint distribution, from the target's own
    logits. So they are with the draft's q cut to fewer tokens than the request's filters leave
    (as a large vocabulary's q travels, steps.cut_draft: the rest of its mass spread evenly over
    every other token, most of which the target never draws): only fewer proposals are kept.
    The negative controls, a wrong acceptance rule and a redraw that ignores what the draft
    proposed, fail the same test: it can tell."""
    from ringd.ring import steps
    from ringd.stage import sampling

    if rule == "a draft cut to its 2 likeliest tokens":
        monkeypatch.setattr(steps, "DRAFT_SUPPORT", 2)
    elif rule == "accepts with min(1, q/p)":
        monkeypatch.setattr(sampling, "acceptance", lambda p_x, q_x: q_x / p_x)
    elif rule == "redraws from p, not the residual":
        monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    target, draft = speculating_pair
    counts, kept = speculated(target, draft, SPECULATED_REQUESTS)
    statistic, dof = chi_square(counts, plain_distribution(target))
    p_value = chi_square_tail(statistic, dof)
    if rule == "as written":
        assert 0.3 < kept < 0.9, f"the draft should agree some of the time, not always: {kept:.2f} of proposals kept"
        assert p_value > SIGNIFICANCE, (statistic, dof, p_value, counts.most_common(8))
    elif rule == "a draft cut to its 2 likeliest tokens":
        assert 0.1 < kept < 0.9, f"{kept:.2f} of proposals kept"
        assert p_value > SIGNIFICANCE, (statistic, dof, p_value, counts.most_common(8))
    else:
        assert p_value < SIGNIFICANCE, (statistic, dof, p_value)


def test_a_seeded_request_speculates_the_same_tokens_every_time(speculating_pair):
    """Seeds keep a speculating request reproducible: the draft's key is its seed's and the
    position's, the last stage's its seed's."""
    target, draft = speculating_pair
    assert speculated(target, draft, 40) == speculated(target, draft, 40)


def test_a_verify_step_moves_the_key_as_many_plain_draws_as_tokens_it_gives(speculating_pair):
    """A failover replays a speculating request's tokens one silent draw each: its key must then
    be where the verify steps left it, so the stream carries on as it would have."""
    from ringd.stage.sampling import sampled_logits

    target, _ = speculating_pair
    params = SamplingParams(**SPECULATIVE_PARAMS, seed=5)
    first = int(mx.argmax(target((FIRST_TOKEN,))).item())
    second = int(mx.argmax(target((FIRST_TOKEN, first))).item())
    logits = mx.concatenate([target((FIRST_TOKEN,)), target((FIRST_TOKEN, first)), target((FIRST_TOKEN, first, second))])
    p = mx.softmax(sampled_logits(params, logits - mx.logsumexp(logits, axis=-1, keepdims=True)), axis=-1)
    outside = int(mx.argmin(p[0]).item())  # a token the target never draws there
    kepts = []
    for proposals, q in (((first, second), p[:2]), ((outside, second), mx.eye(p.shape[-1])[mx.array([outside, second])])):  # kept; not
        speculating, replaying = RequestSampler(params), RequestSampler(params)
        verification = speculating.verify(logits, proposals, q)
        mx.eval(verification.arrays)
        kept, _ = verification.result(speculating)
        kepts.append(kept)
        for _ in range(kept + 1):
            replaying.draw(logits[:1])
        assert mx.array_equal(speculating._key, replaying._key), kept
    assert kepts == [2, 0], kepts
