"""Reference encoders (numpy) that write valid GGML blocks, for test fixtures and tiny models.

Types that `gguf.quants` can encode are delegated to its block encoders; the K-quants (which gguf
cannot encode) use a simple per-sub-block range fit, good enough for fixtures, not for production.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf.quants
import numpy as np
from gguf.constants import GGMLQuantizationType

from .types import DECODE_ONLY_TYPES, QType, as_qtype, type_size

T = GGMLQuantizationType
ELEMENTS_PER_CHUNK = 1 << 19  # 2 MB of float32: the temporaries stay in cache
BlockEncoder = Callable[[np.ndarray], np.ndarray]


def quantize(values: np.ndarray, qtype: QType) -> np.ndarray:
    """Encode float `values` (any leading dims, last dim whole blocks) as uint8 rows of `qtype` blocks."""
    qt = as_qtype(qtype)
    if qt in DECODE_ONLY_TYPES:
        raise ValueError(f"quantize to {qt.name}: k3stream decodes {qt.name} but has no encoder for it")
    block_elems, block_bytes = type_size(qt)
    values = np.asarray(values)
    if values.ndim == 0 or values.shape[-1] % block_elems:
        raise ValueError(
            f"quantize to {qt.name}: last dim of shape {values.shape} is not a multiple of {block_elems}"
        )
    if not np.isfinite(values).all():
        raise ValueError(f"quantize to {qt.name}: values must be finite")
    blocks = values.reshape(-1, block_elems).astype(np.float32, copy=False)
    out = np.empty((blocks.shape[0], block_bytes), dtype=np.uint8)
    encode_blocks = _block_encoder(qt)
    blocks_per_chunk = max(1, ELEMENTS_PER_CHUNK // block_elems)
    for start in range(0, blocks.shape[0], blocks_per_chunk):
        stop = start + blocks_per_chunk
        out[start:stop] = encode_blocks(blocks[start:stop])
    return out.reshape(*values.shape[:-1], values.shape[-1] // block_elems * block_bytes)


def _block_encoder(qt: GGMLQuantizationType) -> BlockEncoder:
    if qt in _OWN_ENCODERS:
        return _OWN_ENCODERS[qt]
    if qt == T.F32:
        return lambda blocks: blocks.view(np.uint8)
    if qt == T.F16:
        return lambda blocks: blocks.astype(np.float16).view(np.uint8)
    return getattr(gguf.quants, qt.name).quantize_blocks


# ---- sub-block fits -------------------------------------------------------------------------


def _fp16_rounded(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        rounded = x.astype(np.float16)
    if not np.isfinite(rounded).all():
        raise ValueError(f"values too large for an fp16 block scale (largest scale {float(x.max()):.3g})")
    return rounded.astype(np.float32)


def _min_max(sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and max over the last axis. Moving that axis to the front first is ~2x faster: numpy's
    reductions over a short contiguous axis are slow, over a long leading one they are element-wise."""
    lead = np.ascontiguousarray(np.moveaxis(sub, -1, 0))
    return np.minimum.reduce(lead, axis=0), np.maximum.reduce(lead, axis=0)


def _inverse(x: np.ndarray) -> np.ndarray:
    """1/x, and 0 where x is 0 (an all-zero sub-block then encodes as zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0, 1 / x).astype(np.float32)


def _fit_affine(blocks: np.ndarray, n_sub: int, q_max: int, scale_max: int):
    """x ~= d*sc[j]*q - dmin*m[j], q in 0..q_max, sc and m in 0..scale_max (Q2_K, Q4_K, Q5_K)."""
    sub = blocks.reshape(blocks.shape[0], n_sub, -1)
    lo, hi = _min_max(sub)
    lo = np.minimum(lo, 0)
    scale = (hi - lo) / q_max
    d = _fp16_rounded(scale.max(axis=-1, keepdims=True) / scale_max)
    dmin = _fp16_rounded(-lo.min(axis=-1, keepdims=True) / scale_max)
    sc = np.clip(np.rint(scale * _inverse(d)), 0, scale_max)
    m = np.clip(np.rint(-lo * _inverse(dmin)), 0, scale_max)
    inv_step, offset = _inverse(d * sc)[..., None], (dmin * m)[..., None]
    q = np.clip(np.rint((sub + offset) * inv_step), 0, q_max)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8).reshape(blocks.shape)


def _fit_symmetric(blocks: np.ndarray, n_sub: int, q_neg: int, scale_max: int):
    """x ~= d*sc[j]*q, q in -q_neg..q_neg-1, sc in -scale_max..scale_max (Q3_K, Q6_K).

    Each sub-block's largest magnitude maps to -q_neg exactly (the scale takes its sign), so the
    asymmetric code range is used where it matters.
    """
    sub = blocks.reshape(blocks.shape[0], n_sub, -1)
    lo, hi = _min_max(sub)
    peak = np.where(-lo > hi, lo, hi)
    scale = peak / -q_neg
    d = _fp16_rounded(np.abs(scale).max(axis=-1, keepdims=True) / scale_max)
    sc = np.clip(np.rint(scale * _inverse(d)), -scale_max, scale_max)
    q = np.clip(np.rint(sub * _inverse(d * sc)[..., None]), -q_neg, q_neg - 1)
    return d, sc.astype(np.int8), q.astype(np.int8).reshape(blocks.shape)


# ---- bit packing (layouts as in ggml-common.h) ----------------------------------------------


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_fields(q: np.ndarray, groups: int, bits: int) -> np.ndarray:
    """Pack `q` (n, groups*fields*width) into (n, groups*width) bytes, field f at bit f*bits."""
    n = q.shape[0]
    fields = 8 // bits
    q = q.reshape(n, groups, fields, -1).astype(np.uint8)
    shifts = (np.arange(fields, dtype=np.uint8) * bits).reshape(1, 1, fields, 1)
    return np.bitwise_or.reduce(q << shifts, axis=2).reshape(n, -1)


def _pack_high_bits(q: np.ndarray, bit: int) -> np.ndarray:
    """Bit `bit` of every element of (n, 256) `q`, as 32 bytes: element b*32+l at bit b of byte l."""
    return _pack_fields((q >> bit) & 1, groups=1, bits=1)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    return np.concatenate(
        [lo_sc | ((hi_sc >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4)],
        axis=1,
    )


def _pack_q3_scales(sc: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit (offset 32) scales into Q3_K's 12 bytes."""
    s = (sc.astype(np.int16) + 32).astype(np.uint8)
    low = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    return np.concatenate([low, _pack_fields(s >> 4, groups=1, bits=2)], axis=1)


# ---- K-quant block encoders -----------------------------------------------------------------


def _encode_q2_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _fit_affine(blocks, n_sub=16, q_max=3, scale_max=15)
    qs = _pack_fields(q, groups=2, bits=2)
    return np.concatenate([sc | (m << 4), qs, _fp16_bytes(d), _fp16_bytes(dmin)], axis=1)


def _encode_q3_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _fit_symmetric(blocks, n_sub=16, q_neg=4, scale_max=31)
    qu = (q + 4).astype(np.uint8)
    hmask = _pack_high_bits(qu, bit=2)
    qs = _pack_fields(qu & 3, groups=2, bits=2)
    return np.concatenate([hmask, qs, _pack_q3_scales(sc), _fp16_bytes(d)], axis=1)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _fit_affine(blocks, n_sub=8, q_max=15, scale_max=63)
    qs = _pack_fields(q, groups=4, bits=4)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_k_scales(sc, m), qs], axis=1)


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _fit_affine(blocks, n_sub=8, q_max=31, scale_max=63)
    qh = _pack_high_bits(q, bit=4)
    qs = _pack_fields(q & 0x0F, groups=4, bits=4)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_k_scales(sc, m), qh, qs], axis=1)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _fit_symmetric(blocks, n_sub=16, q_neg=32, scale_max=127)
    qu = (q + 32).astype(np.uint8)
    ql = _pack_fields(qu & 0x0F, groups=2, bits=4)
    qh = _pack_fields(qu >> 4, groups=2, bits=2)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)


MXFP4_MAGNITUDES = np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float32)  # e2m1, doubled


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """2**(e - 128) as float32 (ggml_e8m0_to_fp32_half), subnormal for e < 2."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _encode_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """gguf's MXFP4 encoder (shared exponent from the block's peak, nearest e2m1 value), without its
    16-way error table: the nearest magnitude comes from the midpoints between representable values."""
    lo, hi = _min_max(blocks)
    peak = np.maximum(-lo, hi)[:, None]
    with np.errstate(divide="ignore"):
        e = np.where(peak > 0, np.clip(np.floor(np.log2(peak)) - 2 + 127, 0, 254), 0).astype(np.uint8)
    midpoints = (MXFP4_MAGNITUDES[1:] + MXFP4_MAGNITUDES[:-1]) / 2
    index = np.searchsorted(midpoints, np.abs(blocks) / _e8m0_half(e)).astype(np.uint8)
    codes = index | np.where((blocks < 0) & (index > 0), np.uint8(8), np.uint8(0))
    return np.concatenate([e, _pack_fields(codes, groups=1, bits=4)], axis=1)


_OWN_ENCODERS: dict[GGMLQuantizationType, BlockEncoder] = {
    T.Q2_K: _encode_q2_k,
    T.Q3_K: _encode_q3_k,
    T.Q4_K: _encode_q4_k,
    T.Q5_K: _encode_q5_k,
    T.Q6_K: _encode_q6_k,
    T.MXFP4: _encode_mxfp4,
}
