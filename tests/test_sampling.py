"""ringd.sampling's parameter checks: every flaw is a SamplingError that names its field.

(The sampler's arithmetic against mlx-lm is tested through the ring, in test_ring.py.)
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.sampling import MAX_LOGIT_BIAS_ENTRIES, SamplingError, SamplingParams


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


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, 2**63, -1]) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
names = st.sampled_from(["temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs",
                         "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"])  # fmt: skip


@given(st.dictionaries(names | st.text(max_size=6), values, max_size=6) | values)
@settings(max_examples=300)
def test_from_wire_raises_only_sampling_errors(d):
    # A stage reads these from a frame; pipeline.py fails the request on a SamplingError.
    try:
        SamplingParams.from_wire(d)
    except SamplingError as e:
        assert str(e)
