"""ringd.stage.grammar: grammars that do not compile are the client's error, and a grammar's mask
keeps every sampled answer inside it, through a ring of stages too.

Real llguidance over the real byte-level BPE tokenizer of a tiny mlx-lm model
(``tinymodel``); logits are seeded random numbers, so every token the grammar allows
gets its chance and the grammar alone keeps the text valid.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLTokenizer
from devkit.stagering import StageRing

from ringd.stage import grammar
from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.stage.compute import ComputeThread
from ringd.ring.sampling import MAX_GRAMMAR_BYTES, wire_bytes
from ringd.stage.grammar import Constraint, GrammarError
from ringd.base.metrics import Metrics
from ringd.ring.plan import Plan, Stage
from ringd.cluster.reconcile import LOADED
from ringd.ring.sampling import SamplingParams
from ringd.node.stagehost import StageHost, StageSource
from ringd.ring.steps import Open, Row

# Random logits are sharp enough (std) that a few tokens dominate each step, as a model's
# do; every answer of the schemas below ends well within this many tokens.
LOGIT_STD = 3.0
MAX_STEPS = 400

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["name", "age", "color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 4},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        },
        "required": ["user", "scores", "note"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": [1, 2, "three"]}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model_info(str(model)))


@pytest.fixture(scope="module")
def vocab_size(model) -> int:
    return model_info(str(model)).vocab_size


# --- compiling -------------------------------------------------------------------


def test_a_schema_that_does_not_compile_names_its_field(tokenizer, vocab_size):
    where = "response_format.json_schema"
    g = grammar.from_json_schema({"type": "object", "properties": {"a": {"type": "intger"}}}, where)
    with pytest.raises(GrammarError) as e:
        grammar.check(g, tokenizer, vocab_size, where)
    assert e.value.where == where
    assert str(e.value).startswith(f"{where} could not be compiled: ") and "intger" in str(e.value), e.value
    assert "<state>" not in str(e.value) and "<grammar>" not in str(e.value)  # no parser dump in a 400


def test_a_lark_grammar_that_does_not_compile_names_its_field(tokenizer, vocab_size):
    g = grammar.from_lark("start: missing_rule\n", "tools")
    with pytest.raises(GrammarError) as e:
        grammar.check(g, tokenizer, vocab_size, "tools")
    assert e.value.where == "tools" and "missing_rule" in str(e.value)


def test_a_schema_that_is_not_an_object_is_refused():
    with pytest.raises(GrammarError) as e:
        grammar.from_json_schema(["type", "object"], "response_format")  # type: ignore[arg-type]
    assert e.value.where == "response_format"


def test_good_grammars_check(tokenizer, vocab_size):
    for schema in SCHEMAS:
        grammar.check(grammar.from_json_schema(schema, "response_format"), tokenizer, vocab_size, "response_format")
    grammar.check(grammar.json_object(), tokenizer, vocab_size, "response_format")
    grammar.check(grammar.from_lark('start: "yes" | "no"\n', "x"), tokenizer, vocab_size, "x")


def test_the_byte_limit_is_checked_before_compiling():
    # Just under the limit as a schema: fits. Over it (as a frame spells it): refused, with the limit.
    big = {"enum": ["v" * 100] * (MAX_GRAMMAR_BYTES // 110)}
    assert wire_bytes(grammar.from_json_schema(big, "response_format")) <= MAX_GRAMMAR_BYTES
    huge = {"enum": ["v" * 100] * (MAX_GRAMMAR_BYTES // 100)}
    for make in (lambda: grammar.from_json_schema(huge, "response_format"), lambda: grammar.from_lark("start: " + json.dumps("é" * MAX_GRAMMAR_BYTES), "response_format")):
        with pytest.raises(GrammarError) as e:
            make()
        assert e.value.where == "response_format" and str(MAX_GRAMMAR_BYTES) in str(e.value)


def test_the_llguidance_tokenizer_is_built_once_and_ends_on_every_end_token(tokenizer, vocab_size):
    ll = grammar.ll_tokenizer(tokenizer, vocab_size)
    assert isinstance(ll, LLTokenizer) and grammar.ll_tokenizer(tokenizer, vocab_size) is ll
    assert ll.vocab_size == vocab_size
    assert sorted(ll.eos_tokens) == sorted(tokenizer.eos_token_ids) and len(ll.eos_tokens) >= 2
    with pytest.raises(GrammarError):
        grammar.ll_tokenizer(None, vocab_size)


# --- following -------------------------------------------------------------------


def allowed(masked: mx.array) -> set[int]:
    return {i for i, ok in enumerate(mx.isfinite(masked[0]).tolist()) if ok}


@given(schema=st.sampled_from(SCHEMAS), seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.5, 1.0, 2.0]))
@settings(max_examples=24, deadline=None)
def test_sampling_from_masked_random_logits_always_gives_valid_json(tokenizer, vocab_size, schema, seed, temperature):
    ll = grammar.ll_tokenizer(tokenizer, vocab_size)
    constraint = Constraint(ll, grammar.from_json_schema(schema, "response_format"))
    eos = set(tokenizer.eos_token_ids)
    key = mx.random.key(seed)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        key, k1, k2 = mx.random.split(key, 3)
        logits = mx.random.normal((1, vocab_size), key=k1) * LOGIT_STD
        mx.async_eval(logits)
        masked = constraint.mask(logits)
        ok = allowed(masked)
        assert ok, "the grammar allowed no token"
        # An end token is allowed exactly when what came so far is a whole answer.
        assert bool(ok & eos) == constraint.accepting, (tokenizer.decode(out), ok & eos)
        token = mx.random.categorical(masked * (1 / temperature), key=k2).item()
        assert token in ok
        if token in eos:
            break
        out.append(token)
        constraint.consume([token])
    else:
        pytest.fail(f"no end token within {MAX_STEPS} tokens: {tokenizer.decode(out)!r}")
    text = tokenizer.decode(out)
    jsonschema.validate(json.loads(text), schema)
    # ringd's layout: one line, ", " and ": " between items, nothing around.
    assert "\n" not in text and text == text.strip()
    if schema == SCHEMAS[-1]:
        assert text == '{"ok": true}'


def test_a_token_outside_the_grammar_puts_the_constraint_in_error(tokenizer, vocab_size):
    constraint = Constraint(grammar.ll_tokenizer(tokenizer, vocab_size), grammar.json_object())
    constraint.consume(tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(GrammarError) as e:
        constraint.mask(mx.zeros((1, vocab_size)))
    assert e.value.where == "grammar" and "left its grammar" in str(e.value)


# --- on the stages ---------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS[:2], ids=["flat", "nested"])
def test_a_two_stage_ring_with_a_json_schema_answers_valid_json(model, tokenizer, schema):
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}], add_generation_prompt=True))
    g = grammar.from_json_schema(schema, "response_format")

    async def main():
        ring = StageRing(model, [1], tokenizer)
        try:
            answers = []
            for seed in (1, 2):
                out = await ring.generate(prompt, SamplingParams(temperature=1.0, seed=seed, grammar=g, logprobs=True, top_logprobs=5), MAX_STEPS)
                answers.append(tokenizer.decode(out))
            return answers, ring.metrics.grammar_mask._sum.get()
        finally:
            await ring.stop()

    answers, mask_seconds = asyncio.run(main())
    for text in answers:
        jsonschema.validate(json.loads(text), schema)
    assert mask_seconds > 0  # ringd_grammar_mask_seconds observed on the last stage


def test_a_grammar_on_a_stage_without_a_tokenizer_fails_that_request_only(model, tokenizer):
    async def main():
        ring = StageRing(model, [1], tokenizer)
        last = ring.runners[ring.stages[-1].node]
        last.grammar_tokenizer = None
        try:
            prompt = tokenizer.encode("hi", add_special_tokens=False)
            ring.forward([Row(9, 0, tuple(prompt), True, open=Open(SamplingParams(grammar=grammar.json_object()).to_wire()))])
            error = await ring.answer()
            free = await ring.generate(prompt, SamplingParams(temperature=0), 3)
            return error, free
        finally:
            await ring.stop()

    error, free = asyncio.run(main())
    # That row failed, named in the micro-batch's answer; the next request is served.
    assert not error.rows and [rid for rid, _ in error.failed] == [9] and "grammar" in error.failed[0][1], error
    assert len(free) == 3


def test_the_stage_host_gives_its_last_stage_the_tokenizer(model, tokenizer):
    info = model_info(str(model))

    class Node:  # what the stage host asks of its node (stagehost.StageOwner), on a ring of one
        def send(self, node, frame): ...
        def send_now(self, node, frame): return False
        def lend(self, node, take, returned): return None
        def grouped(self): return False
        def reported(self): ...
        def departed(self, node): return False
        def dial(self, host, port): ...
        def holders(self, fingerprint): return []
        async def resolve(self, plan): return StageSource(str(model), info)
        def tokenizer_of(self, info): return tokenizer

    async def main():
        compute = ComputeThread()
        host = StageHost("node0", "", Node(), compute, Metrics("node0"))
        try:
            plan = Plan(1, "node0", info.fingerprint, info.num_layers, (Stage("node0", "127.0.0.1:1", 0, info.num_layers),))
            await host.load(host.take("node0", plan.to_wire(), "node0"))
            assert host.report.state == LOADED, host.report
            return host.stage.grammar_tokenizer()
        finally:
            await compute.stop()

    assert asyncio.run(main()) is grammar.ll_tokenizer(tokenizer, info.vocab_size)
