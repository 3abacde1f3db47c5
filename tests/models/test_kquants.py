"""kquants: the test files' K-quant blocks are llama.cpp's reference quantizers' (a port).

Checked against gguf-py's dequantize (the reference reader): every block reads back
within the rounding its format allows,
each added bit halves the error as llama.cpp's does, and zeros stay zeros.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from devkit.kquants import QUANTIZERS

# Largest error as a share of the largest |weight| of the 256-block: a step of a
# 32-group's (16-group's) grid is its range over 15 (31, 63), and the 6-bit scales
# add one step of their own rounding at most; Q6_K's int8 scales add less.
BOUNDS = {"Q4_K": 2 / 15, "Q5_K": 2 / 31, "Q6_K": 2 / 63}


def _weights(seed: int) -> np.ndarray:
    """Rows as a model's are: Gaussian at a tensor's scale (1e-3 to 1), a few outliers, a zero
    super-block. (Much smaller blocks are beyond the formats: their float16 d underflows.)"""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 1024)) * 10 ** rng.uniform(-3, 0, (16, 1))
    x[rng.random(x.shape) < 0.002] *= 20
    x[0, :256] = 0
    return x.astype(np.float32)


@pytest.mark.parametrize("qtype", list(QUANTIZERS))
@pytest.mark.parametrize("seed", range(4))
def test_blocks_read_back_within_their_rounding(qtype, seed):
    x = _weights(seed)
    b = QUANTIZERS[qtype](x)
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert b.dtype == np.uint8 and b.shape == (x.shape[0], x.shape[1] // 256 * block_bytes)
    y = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
    blocks, got = x.reshape(-1, 256), y.reshape(-1, 256)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    error = np.abs(got - blocks)
    assert (error <= BOUNDS[qtype] * largest).all(), f"{qtype}: {(error / np.maximum(largest, 1e-30)).max()} of the block's largest weight"


@pytest.mark.parametrize("qtype", list(QUANTIZERS))
def test_zeros_read_back_as_zeros(qtype):
    b = QUANTIZERS[qtype](np.zeros((2, 256), np.float32))
    assert not gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype]).any()


def test_more_bits_err_less_as_llama_cpps_own_do():
    x = (np.random.default_rng(0).standard_normal((64, 512)) * 0.05).astype(np.float32)
    rms = {}
    for qtype, quantize in QUANTIZERS.items():
        y = gguf.quants.dequantize(quantize(x), gguf.GGMLQuantizationType[qtype])
        rms[qtype] = float(np.sqrt(((y - x) ** 2).mean()) / x.std())
    # llama.cpp's own figures for Gaussian weights are near these (Q4_K about 0.07 of the
    # weights' spread, each bit more halving it).
    assert rms["Q4_K"] < 0.08 and rms["Q5_K"] < 0.04 and rms["Q6_K"] < 0.02, rms
