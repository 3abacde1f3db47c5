"""ringd.models.gguf.blocks: every GGUF block type as MLX's quantized arrays, against gguf-py.

gguf-py's ``gguf.quants.dequantize`` is the reference llama.cpp's authors publish. For
any block of a type (any bytes, with finite float16 scales), ``mx.dequantize`` of what
ringd makes of it must give the reference's float32 values bit for bit where the form
is exact, and stay within the measured bound where it is not (Q6_K, Q2_K); and a
tensor's cost in memory must be what its arrays hold.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringd.models.gguf.blocks import FORMS, GROUP_SIZE, to_mlx

# Where each type's float16 fields (d, dmin or m) sit in its block (block_q*_* in
# ggml-common.h); every other byte of a block may hold anything.
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q3_K": (108,), "Q6_K": (208,), "Q2_K": (80, 82),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": (),
}  # fmt: skip

# The requantized types' worst error, as a share of the largest |weight| of its 32-group:
# 8 bits from the group's minimum to its maximum round by half of 1/255 of the range, which
# is at most twice the largest weight (and a little float32 rounding).
REQUANTIZED_ERROR = 1.001 / 255


def _blocks(qtype: str, data: bytes, scales: list[float]) -> np.ndarray:
    form = FORMS[qtype]
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, form.block_bytes).copy()
    fields = F16_FIELDS[qtype]
    d = np.array(scales[: len(b) * len(fields)], dtype=np.float16).reshape(len(b), len(fields))
    for i, at in enumerate(fields):
        b[:, at : at + 2] = d[:, i : i + 1].view(np.uint8)
    return b


def _dequantized(b: np.ndarray, qtype: str) -> np.ndarray:
    """What ringd's arrays hold, dequantized by MLX in float32."""
    form = FORMS[qtype]
    packed, scales, biases = to_mlx(b, qtype)
    w = mx.array(packed.view(np.uint32))
    if form.mode == "affine":
        got = mx.dequantize(w, mx.array(scales).astype(mx.float32), mx.array(biases).astype(mx.float32), group_size=GROUP_SIZE, bits=form.bits)
    else:
        got = mx.dequantize(w, mx.array(scales), group_size=GROUP_SIZE, bits=form.bits, mode=form.mode).astype(mx.float32)
    return np.array(got)


@st.composite
def blocks(draw, qtype: str) -> np.ndarray:
    n = draw(st.integers(1, 4))
    data = draw(st.binary(min_size=n * FORMS[qtype].block_bytes, max_size=n * FORMS[qtype].block_bytes))
    # Scales of any sign and size a model's weights have, and zero (float16 subnormals too).
    scale = st.floats(-4.0, 4.0, width=16, allow_nan=False, allow_infinity=False)
    scales = draw(st.lists(scale, min_size=2 * n, max_size=2 * n))
    b = _blocks(qtype, data, scales)
    if qtype == "MXFP4":  # the exponent byte, up to 2**70 (255 is NaN, and 2**128 overflows float32)
        b[:, 0] = np.minimum(b[:, 0], 197)
    return b


@pytest.mark.parametrize("qtype", [t for t, f in FORMS.items() if f.exact])
@settings(deadline=None)
@given(data=st.data())
def test_an_exact_form_dequantizes_to_gguf_pys_values_bit_for_bit(qtype, data):
    b = data.draw(blocks(qtype))
    want = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype]).reshape(len(b), -1)
    got = _dequantized(b, qtype)
    assert np.array_equal(got, want), f"{qtype}: max error {np.abs(got - want).max()}"


@pytest.mark.parametrize("qtype", [t for t, f in FORMS.items() if not f.exact])
@settings(deadline=None)
@given(data=st.data())
def test_a_requantized_form_stays_within_its_measured_error(qtype, data):
    b = data.draw(blocks(qtype))
    want = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype]).reshape(len(b), -1, GROUP_SIZE)
    got = _dequantized(b, qtype).reshape(want.shape)
    largest = np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(got - want) <= REQUANTIZED_ERROR * largest).all()


@pytest.mark.parametrize("qtype", list(FORMS))
def test_the_cost_in_memory_is_what_the_arrays_hold(qtype):
    form = FORMS[qtype]
    b = np.zeros((6, form.block_bytes), dtype=np.uint8)
    packed, scales, biases = to_mlx(b, qtype)
    held = packed.nbytes + scales.nbytes + (0 if biases is None else biases.nbytes)
    assert held == form.mlx_bytes(6 * form.block)
    assert packed.shape == (6, form.block * form.bits // 8) and scales.shape == (6, form.block // GROUP_SIZE)


def test_blocks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match="Q4_K blocks are 144 bytes; got an array of shape"):
        to_mlx(np.zeros((2, 18), dtype=np.uint8), "Q4_K")
