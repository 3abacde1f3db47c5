"""llama.cpp's reference K-quant quantizers (``ggml-quants.c``), ported to numpy for test files.

gguf-py dequantizes every type but quantizes none of the K-quants, and there is no
llama.cpp here. ringd must be tested on K-quant blocks as llama-quantize writes them
(the scales its search picks, not just any valid bytes), so this follows
``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref`` and ``quantize_row_q6_K_ref``
with their helpers ``make_qkx2_quants`` and ``make_qx_quants``, step by step, on
many sub-blocks at once. Those are what llama-quantize runs without an importance
matrix.

Where it departs: sums run in numpy's order, not C's left to right, so where two of
the search's candidates tie to the last bit a block may pick the other (either is a
block llama.cpp could write). ``tests/models/test_kquants.py`` checks the blocks
against gguf-py's dequantize. What it ignores: importance matrices, the other types.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: a group this small is all zeros


def _nearest_int(x: np.ndarray) -> np.ndarray:
    """nearest_int: float32 rounded half to even (its 12582912.f trick)."""
    return np.rint(x.astype(np.float32)).astype(np.int32)


def _f16(x: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 then back: the value a float16 field holds."""
    return x.astype(np.float16).astype(np.float32)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """make_qkx2_quants (use_mad false) on rows of ``x``: (scale, -min, L) per row."""
    x = x.astype(np.float32)
    lo = np.minimum(x.min(axis=-1), 0)
    hi = x.max(axis=-1)
    sum_w = weights.sum(axis=-1)
    sum_x = (weights * x).sum(axis=-1)
    flat = hi == lo
    span = np.where(flat, 1, hi - lo)
    iscale = nmax / span
    scale = 1 / iscale
    L = np.clip(_nearest_int(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    best = (weights * (scale[:, None] * L + lo[:, None] - x) ** 2).sum(axis=-1)
    the_min = lo.copy()
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        Laux = np.clip(_nearest_int(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(np.float32)
        sum_l = (weights * Laux).sum(axis=-1)
        sum_l2 = (weights * Laux * Laux).sum(axis=-1)
        sum_xl = (weights * Laux * x).sum(axis=-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, 0, this_min)
        error = (weights * (this_scale[:, None] * Laux + this_min[:, None] - x) ** 2).sum(axis=-1)
        better = (D > 0) & (error < best) & ~flat
        L = np.where(better[:, None], Laux.astype(np.int32), L)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        the_min = np.where(better, this_min, the_min)
    L = np.where(flat[:, None], 0, L)
    scale = np.where(flat, 0, scale)
    return scale.astype(np.float32), (-the_min).astype(np.float32), L


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple:
    """make_qx_quants with rmse_type 1 (weights x**2) on rows of ``x``: (scale, L in [0, 2*nmax))."""
    x = x.astype(np.float32)
    at = np.abs(x).argmax(axis=-1)
    amax = np.abs(x).max(axis=-1)
    zero = amax < GROUP_MAX_EPS
    top = np.where(zero, 1, np.take_along_axis(x, at[:, None], axis=-1)[:, 0])
    w = x * x

    def attempt(iscale):
        l = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        return l, (w * x * l).sum(axis=-1), (w * l * l).sum(axis=-1)

    iscale = -nmax / top
    l, sumlx, suml2 = attempt(iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, 0).astype(np.float32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l2, sumlx, suml2 = attempt(-(nmax + np.float32(0.1) * step) / top)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        l = np.where(better[:, None], l2, l)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, scale).astype(np.float32), np.where(zero[:, None], 0, l + nmax)


def _k_scales(scales: np.ndarray, mins: np.ndarray) -> tuple:
    """quantize_row_q4_K_ref's packing of 8 (scale, min) pairs into 12 bytes, and d, dmin."""
    max_scale, max_min = scales.max(axis=-1), mins.max(axis=-1)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, 63 / max_scale, 0).astype(np.float32)
        inv_min = np.where(max_min > 0, 63 / max_min, 0).astype(np.float32)
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales)).astype(np.uint8)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins)).astype(np.uint8)
    packed = np.zeros((len(scales), 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4]
    packed[:, 4:8] = lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d, dmin = _f16(max_scale / 63), _f16(max_min / 63)
    return packed, d, dmin, ls.astype(np.float32), lm.astype(np.float32)


def _qkx(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple:
    """The part Q4_K and Q5_K share: per-32 (scale, min) searched, packed, and the weights
    requantized against the packed values. (d, dmin, 12 scale bytes, L per weight)."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    groups = blocks.reshape(-1, 32)
    av_x = np.sqrt((groups * groups).sum(axis=-1) / 32)
    weights = av_x[:, None] + np.abs(groups)
    scales, mins, _ = make_qkx2_quants(groups, weights, nmax, rmin, 0.1, nstep)
    packed, d, dmin, ls, lm = _k_scales(scales.reshape(-1, 8), mins.reshape(-1, 8))
    dl = d[:, None] * ls
    dm = dmin[:, None] * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.clip(_nearest_int((blocks + dm[..., None]) / dl[..., None]), 0, nmax)
    L = np.where(dl[..., None] == 0, 0, L).astype(np.uint8)  # "if (!d) continue": L stays the search's
    return d, dmin, packed, L


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref: rows of ``x`` (a multiple of 256 long) as Q4_K blocks (144 bytes)."""
    d, dmin, scales, L = _qkx(x, 15, -1.0, 20)
    L = L.reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=-1).reshape(*x.shape[:-1], -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref: rows of ``x`` as Q5_K blocks (176 bytes)."""
    d, dmin, scales, L = _qkx(x, 31, -0.5, 15)
    L = L.reshape(-1, 8, 32)
    qh = np.bitwise_or.reduce((L >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1).astype(np.uint8)
    low = (L & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=-1).reshape(*x.shape[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: rows of ``x`` as Q6_K blocks (210 bytes)."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    n = len(blocks)
    scales, L = make_qx_quants(blocks.reshape(-1, 16), 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    at = np.abs(scales).argmax(axis=-1)
    max_scale = np.take_along_axis(scales, at[:, None], axis=-1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # the block is written as zeros
    iscale = (-128 / np.where(zero, 1, max_scale)).astype(np.float32)
    d = _f16(1 / iscale)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales))
    dl = d[:, None] * sc.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(_nearest_int(blocks / dl[..., None]), -32, 31) + 32
    L = np.where(dl[..., None] == 0, L, requantized)  # "if (!d) continue": the search's L stays
    L = np.where(zero[:, None, None], 0, L).astype(np.uint8).reshape(n, 2, 4, 32)  # two halves of 128
    low = L & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1).reshape(n, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)).reshape(n, 64)
    sc_bytes = np.where(zero[:, None], 0, sc).astype(np.int8).view(np.uint8)
    d = np.where(zero, 0, d)
    return np.concatenate([ql, qh, sc_bytes, _f16_bytes(d)], axis=-1).reshape(*x.shape[:-1], -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
