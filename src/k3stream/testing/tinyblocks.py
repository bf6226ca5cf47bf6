"""Random *valid* GGML blocks (K-quants, Q8_0), generated in slabs at memory speed, for large tiny models.

Quantizing random floats costs minutes per GB; a routed-expert tensor of a benchmark model only needs
blocks that decode to finite, moderate values. Each block here has random code bytes and a fixed fp16
super-scale chosen so the decoded values have a standard deviation of about 1/sqrt(row length), like
the float initialisation in `k3stream.gguf.writer`. One generator per tensor (seeded by the caller) and
a fixed slab size make the bytes a function of the seed and shape alone.

Block layouts (as in ggml and `gguf.quants`):
- Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min), qs[64] (2-bit codes), d, dmin (fp16);
  value = d * scale * q - dmin * min. Each scales byte holds the same random nibble twice (min = scale)
  and dmin = 1.5 d, so each sub-block is centred: value = d * scale * (q - 1.5).
- Q3_K, 110 bytes: hmask[32], qs[64], scales[12] (16 signed 6-bit scales), d (fp16); value =
  d * (scale - 32) * (q - 4 * !hbit). Every byte pattern of hmask, qs and scales is valid.
- Q4_K, 144 bytes: d, dmin (fp16), scales[12] (8 packed 6-bit scale/min pairs), qs[128] (4-bit codes);
  value = d * scale * q - dmin * min. Bytes 8-11 repeat bytes 0-3 and bytes 12-15 hold each nibble
  twice, so min = scale in every sub-block, and dmin = 7.5 d centres it: value = d * scale * (q - 7.5).
- Q6_K, 210 bytes: ql[128], qh[64], scales[16] (int8), d (fp16); value = d * scale * (q - 32).
- Q8_0, 34 bytes: d (fp16), qs[32] (int8); value = d * q.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Q8_0, Q2_K, Q3_K, Q4_K, Q6_K = 8, 10, 11, 12, 14
FAST_TYPES = frozenset({Q8_0, Q2_K, Q3_K, Q4_K, Q6_K})
BLOCK_VALUES = {Q8_0: 32, Q2_K: 256, Q3_K: 256, Q4_K: 256, Q6_K: 256}
BLOCK_BYTES = {Q8_0: 34, Q2_K: 84, Q3_K: 110, Q4_K: 144, Q6_K: 210}
SLAB_BYTES = 1 << 24  # 16 MiB of blocks per slab


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values, dtype=np.float64))))


# standard deviation of a decoded value per unit of d (see the module docstring)
_SPREAD = {
    Q2_K: float(np.sqrt(np.mean(np.arange(16) ** 2) * 1.25)),  # E[scale^2] * Var(q), q in 0..3
    Q3_K: _rms(np.arange(64) - 32.0) * _rms(np.arange(8) - 4.0),
    Q4_K: _rms(np.arange(64)) * _rms(np.arange(16) - 7.5),
    Q6_K: _rms(np.arange(-128, 128)) * _rms(np.arange(64) - 32.0),
    Q8_0: _rms(np.arange(-128, 128)),
}


def _fp16_bits(value: float) -> int:
    return int(np.float16(value).view(np.uint16))


def _fix_q2_k(blocks: np.ndarray, d: float) -> None:
    words = blocks.view(np.uint32)  # 21 little-endian words per block: scales are words 0-3, d|dmin word 20
    scales = words[:, :4]
    np.bitwise_and(scales, 0x0F0F0F0F, out=scales)
    np.multiply(scales, 0x11, out=scales)  # each byte: min nibble = scale nibble (no carries, <= 0xFF)
    words[:, 20] = _fp16_bits(d) | _fp16_bits(1.5 * d) << 16


def _fix_q3_k(blocks: np.ndarray, d: float) -> None:
    blocks.view(np.uint16)[:, 54] = _fp16_bits(d)  # bytes 108-109


def _fix_q4_k(blocks: np.ndarray, d: float) -> None:
    words = blocks.view(np.uint32)  # 36 words per block: d|dmin, then the three words of scales
    words[:, 0] = _fp16_bits(d) | _fp16_bits(7.5 * d) << 16
    words[:, 2] = words[:, 1]  # scales[4:8] = scales[0:4]: min = scale for sub-blocks 0-3
    np.bitwise_and(words[:, 3], 0x0F0F0F0F, out=words[:, 3])
    np.multiply(words[:, 3], 0x11, out=words[:, 3])  # and for 4-7 (their top bits come from 0-7)


def _fix_q6_k(blocks: np.ndarray, d: float) -> None:
    blocks.view(np.uint16)[:, 104] = _fp16_bits(d)  # bytes 208-209


def _fix_q8_0(blocks: np.ndarray, d: float) -> None:
    blocks.view(np.uint16)[:, 0] = _fp16_bits(d)


_FIX = {Q8_0: _fix_q8_0, Q2_K: _fix_q2_k, Q3_K: _fix_q3_k, Q4_K: _fix_q4_k, Q6_K: _fix_q6_k}


def block_scale(ggml_type: int, row_values: int) -> float:
    """The fp16 super-scale `d` that gives decoded values a std of about 1/sqrt(row_values)."""
    return float(np.float16(1.0 / np.sqrt(row_values) / _SPREAD[ggml_type]))


def random_block_slabs(
    shape: tuple[int, ...], ggml_type: int, seed: list[int], slab_bytes: int = SLAB_BYTES
) -> Iterator[np.ndarray]:
    """uint8 slabs of whole blocks that together are a `shape` tensor of `ggml_type` (one of FAST_TYPES)."""
    if ggml_type not in FAST_TYPES:
        raise ValueError(f"random_block_slabs: GGML type {ggml_type} is not one of {sorted(FAST_TYPES)}")
    block_values, block_bytes = BLOCK_VALUES[ggml_type], BLOCK_BYTES[ggml_type]
    if shape[-1] % block_values:
        raise ValueError(
            f"random_block_slabs: rows of {shape[-1]} values are not a multiple of {block_values}"
        )
    d = block_scale(ggml_type, shape[-1])
    fix = _FIX[ggml_type]
    slab_blocks = max(1, slab_bytes // block_bytes)
    generator = np.random.SFC64(seed)  # the fastest of numpy's bit generators
    left = int(np.prod(shape)) // block_values
    while left:
        count = min(slab_blocks, left)
        words = generator.random_raw(-(-count * block_bytes // 8))
        blocks = words.view(np.uint8)[: count * block_bytes].reshape(count, block_bytes)
        fix(blocks, d)
        yield blocks
        left -= count
