"""Random *valid* GGML K-quant blocks, generated in slabs at memory speed, for large tiny models.

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
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

Q2_K, Q3_K = 10, 11
FAST_TYPES = frozenset({Q2_K, Q3_K})
BLOCK_VALUES = 256
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110}
SLAB_BLOCKS = 1 << 18  # 21-28 MiB of blocks per slab

# standard deviation of a decoded value per unit of d (see the module docstring)
_Q2_SPREAD = float(np.sqrt(np.mean(np.arange(16) ** 2) * 1.25))  # E[scale^2] * Var(q), q in 0..3
_Q3_SPREAD = float(np.sqrt(np.mean((np.arange(64) - 32.0) ** 2) * np.mean((np.arange(8) - 4.0) ** 2)))


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


def block_scale(ggml_type: int, row_values: int) -> float:
    """The fp16 super-scale `d` that gives decoded values a std of about 1/sqrt(row_values)."""
    spread = _Q2_SPREAD if ggml_type == Q2_K else _Q3_SPREAD
    return float(np.float16(1.0 / np.sqrt(row_values) / spread))


def random_block_slabs(
    shape: tuple[int, ...], ggml_type: int, seed: list[int], slab_blocks: int = SLAB_BLOCKS
) -> Iterator[np.ndarray]:
    """uint8 slabs of whole blocks that together are a `shape` tensor of `ggml_type` (Q2_K or Q3_K)."""
    if ggml_type not in FAST_TYPES:
        raise ValueError(f"random_block_slabs: GGML type {ggml_type} is not Q2_K ({Q2_K}) or Q3_K ({Q3_K})")
    if shape[-1] % BLOCK_VALUES:
        raise ValueError(f"random_block_slabs: rows of {shape[-1]} values are not a multiple of 256")
    block_bytes = BLOCK_BYTES[ggml_type]
    d = block_scale(ggml_type, shape[-1])
    fix = _fix_q2_k if ggml_type == Q2_K else _fix_q3_k
    generator = np.random.SFC64(seed)  # the fastest of numpy's bit generators
    left = int(np.prod(shape)) // BLOCK_VALUES
    while left:
        count = min(slab_blocks, left)
        words = generator.random_raw(-(-count * block_bytes // 8))
        blocks = words.view(np.uint8)[: count * block_bytes].reshape(count, block_bytes)
        fix(blocks, d)
        yield blocks
        left -= count
