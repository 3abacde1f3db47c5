"""GGUF's quantized blocks as the arrays of MLX's quantized layers (groups of 32 weights).

llama.cpp stores a quantized tensor as blocks of 32 or 256 weights; MLX computes
with groups of 32 (64, 128) packed ``bits`` wide, each with a scale and, in
``affine`` mode, a bias (``w = scale * q + bias``). This module turns a run of
blocks of one type into those arrays, and says for each type what that costs and
whether it is exact:

- exact, packed as they are: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (a float16 scale and
  offset per 32 weights), Q4_K and Q5_K (a 6-bit scale and minimum per 32 weights
  times the 256-block's float16 ``d`` and ``dmin``: their products are exact in
  float32, so those scales are kept in float32), MXFP4 (MLX's own ``mxfp4``);
- exact, widened to 8 bits: Q3_K (every weight is ``d`` times an integer in
  [-124, 128]), IQ4_NL and IQ4_XS (``d`` or the 32-group's scale times an entry of
  a 16-value table in [-127, 113]);
- not exact: Q6_K and Q2_K hold a scale per 16 weights, which MLX's groups cannot
  hold; they are dequantized by gguf-py (llama.cpp's reference) and requantized to
  8 bits in groups of 32, with the error ``tools/gguf-forms`` measures.

"Exact" means ``mx.dequantize`` of the arrays in float32 equals gguf-py's
``gguf.quants.dequantize`` of the same bytes (``tests/models/test_gguf_blocks.py``).
What it ignores: files, tensors' names and shapes (a caller hands rows of blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# MLX's group: every form here holds one scale (and bias) per 32 weights.
GROUP_SIZE = 32


@dataclass(frozen=True)
class Form:
    """What one GGUF block type is in MLX."""

    bits: int
    block: int  # weights per GGUF block
    block_bytes: int  # bytes per GGUF block
    scale_dtype: type  # numpy dtype of scales and biases (uint8: mxfp4's e8m0 exponents)
    mode: str = "affine"
    exact: bool = True

    def mlx_bytes(self, weights: int) -> int:
        """Bytes of the MLX arrays for ``weights`` weights: the packed weights, scales and biases."""
        groups = weights // GROUP_SIZE
        per_group = np.dtype(self.scale_dtype).itemsize * (2 if self.mode == "affine" else 1)
        return weights * self.bits // 8 + groups * per_group


F16, F32 = np.float16, np.float32
# GGUF tensor type (gguf-py's GGMLQuantizationType name) -> its MLX form.
FORMS: dict[str, Form] = {
    "Q4_0": Form(4, 32, 18, F16),  # float16 d, 32 x 4 bits; w = d * (q - 8)
    "Q4_1": Form(4, 32, 20, F16),  # float16 d and m, 32 x 4 bits; w = d * q + m
    "Q5_0": Form(5, 32, 22, F16),  # float16 d, 32 high bits, 32 x 4 bits; w = d * (q - 16)
    "Q5_1": Form(5, 32, 24, F16),  # float16 d and m, 32 high bits, 32 x 4 bits; w = d * q + m
    "Q8_0": Form(8, 32, 34, F16),  # float16 d, 32 x int8; w = d * q
    "Q4_K": Form(4, 256, 144, F32),  # d, dmin, 8 x (6-bit sc, 6-bit m), 256 x 4 bits; w = d*sc * q - dmin*m
    "Q5_K": Form(5, 256, 176, F32),  # as Q4_K, with a fifth bit per weight
    "Q3_K": Form(8, 256, 110, F16),  # 16 x 6-bit sc, 256 x 3 bits, d; w = d * (sc - 32) * q, q in [-4, 3]
    "IQ4_NL": Form(8, 32, 18, F16),  # float16 d, 32 x 4-bit index; w = d * table[i]
    "IQ4_XS": Form(8, 256, 136, F32),  # d, 8 x 6-bit sc, 256 x 4-bit index; w = d * (sc - 32) * table[i]
    "MXFP4": Form(4, 32, 17, np.uint8, mode="mxfp4"),  # e8m0 exponent, 32 x e2m1 (OCP MX), as MLX's mxfp4
    "Q6_K": Form(8, 256, 210, F32, exact=False),  # 16 x int8 sc per 16 weights, 256 x 6 bits, d
    "Q2_K": Form(8, 256, 84, F32, exact=False),  # 16 x (4-bit sc, 4-bit m) per 16 weights, 256 x 2 bits, d, dmin
}

# IQ4_NL's and IQ4_XS's table (kvalues_iq4nl in ggml-common.h): a 4-bit index picks one.
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)

# Weights that are ``unit`` times an integer in [-128, 127] (or [-124, 128]) are exact in
# MLX's 8 bits as q = integer + 128 with the bias -128 * unit (or q = 128 - integer with the
# scale -unit): a power of two, so the bias is exact in float16 too.
_OFFSET = 128


def to_mlx(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks of ``qtype`` (uint8, one row per block) as MLX's (packed weights as uint8, scales, biases).

    The packed weights hold ``block * bits / 8`` bytes per block (view them as uint32 rows);
    scales and biases one per 32 weights, biases None for mxfp4.
    """
    form = FORMS[qtype]
    if blocks.ndim != 2 or blocks.shape[1] != form.block_bytes:
        raise ValueError(f"{qtype} blocks are {form.block_bytes} bytes; got an array of shape {blocks.shape}")
    q, scales, biases = _DECODERS[qtype](blocks)
    n = len(blocks)
    return _pack(q.reshape(n, form.block), form.bits), scales.reshape(n, -1).astype(form.scale_dtype), (
        None if biases is None else biases.reshape(n, -1).astype(form.scale_dtype)
    )


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Values below 2**bits, packed as MLX packs them: a little-endian bit stream, the first
    value in the lowest bits (eight values make ``bits`` whole bytes)."""
    if bits == 8:
        return q.astype(np.uint8)
    if bits == 4:
        return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    eights = q.reshape(*q.shape[:-1], -1, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * bits)
    stream = np.bitwise_or.reduce(eights, axis=-1)
    return np.ascontiguousarray(stream.view(np.uint8).reshape(*stream.shape, 8)[..., :bits]).reshape(*q.shape[:-1], -1)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 (exact)."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit runs: byte j holds value j in its low nibble and value j + len in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's fifth bits: bit j of a little-endian uint32 belongs to value j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4), d, -16 * d


def _q5_1(b):
    return _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    d = _f16(b, 0)
    return (b[:, 2:].view(np.int8).astype(np.int16) + _OFFSET).astype(np.uint8), d, -_OFFSET * d


def _k_scales(b):
    """Q4_K's and Q5_K's per-32 scale and bias in float32: d * sc and -dmin * m (exact)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b, 0)[:, None] * sc.astype(np.float32), -(_f16(b, 2)[:, None] * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 4 low bits: four runs of 32 bytes, each two groups (low nibbles, then high)."""
    n = len(qs)
    runs = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(n, 8, 32)


def _q4_k(b):
    scales, biases = _k_scales(b)
    return _k_nibbles(b[:, 16:]), scales, biases


def _q5_k(b):
    scales, biases = _k_scales(b)
    # The fifth bit of value j of group g is bit g of byte j of the 32 high-bit bytes.
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_nibbles(b[:, 48:]) | (qh << 4), scales, biases


def _q3_k(b):
    from gguf.quants import Q3_K

    # gguf-py's own dequantize, divided by d, is the integer (sc - 32) * q of each weight,
    # exactly: d = 1 in float16 makes every product an integer below 2**8.
    ones = b.copy()
    ones[:, 108:110] = np.array([1.0], dtype=np.float16).view(np.uint8)
    v = Q3_K.dequantize_blocks(ones).astype(np.int16)  # in [-124, 128]
    d = _f16(b, 108)
    return (_OFFSET - v).astype(np.uint8), -d[:, None] * np.ones(8, np.float32), _OFFSET * d[:, None] * np.ones(8, np.float32)


def _iq4_nl(b):
    d = _f16(b, 0)
    return (IQ4_TABLE[_nibbles(b[:, 2:])] + _OFFSET).astype(np.uint8), d, -_OFFSET * d


def _iq4_xs(b):
    from gguf.quants import IQ4_XS

    n = len(b)
    # The 32-groups' scales, as gguf-py unpacks them: dequantize a block whose indices all
    # pick the table's 1 (index 8) gives d * (sc - 32) for each group, exactly.
    ones = b.copy()
    ones[:, 8:] = 0x88
    scales = IQ4_XS.dequantize_blocks(ones).reshape(n, 8, 32)[..., 0]
    qs = b[:, 8:].reshape(n, 8, 16)
    return (IQ4_TABLE[_nibbles(qs)] + _OFFSET).astype(np.uint8), scales, -_OFFSET * scales


def _mxfp4(b):
    # ggml's e2m1 codes are MLX's (sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6), and its exponent
    # byte scales by 2**(e - 127) as MLX's does: only the order of the nibbles differs.
    return _nibbles(b[:, 1:]), b[:, 0], None


def _requantized(qtype: str):
    """Dequantized by gguf-py, then 8 bits from each 32-group's minimum to its maximum.

    Not ``mx.quantize``: it keeps the group's larger edge exact and so rounds the rest up to
    twice as far (0.9% of the group's largest weight against 0.39% here, ``tools/gguf-forms``).
    """

    def decode(b):
        import gguf

        w = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype]).reshape(len(b), -1, GROUP_SIZE)
        lo, hi = w.min(axis=-1), w.max(axis=-1)
        # float32: a small tensor's steps are float16 subnormals, which would round them by a
        # step's width (a tensor of weights near 1e-3 has steps near 1e-5).
        scales = (hi - lo) / 255
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scales[..., None] > 0, np.round((w - lo[..., None]) / scales[..., None]), 0)
        return np.clip(q, 0, 255).astype(np.uint8), scales, lo

    return decode


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q3_K": _q3_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
    "Q6_K": _requantized("Q6_K"),
    "Q2_K": _requantized("Q2_K"),
}
