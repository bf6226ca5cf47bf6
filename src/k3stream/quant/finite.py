"""Non-finite values in GGML tensor data, found where llama.cpp's `ggml_validate_row_data` (its
`--check-tensors`) finds them: every value of an F32, F16 or BF16 tensor; every fp16 scale of a
quantized block (`d`, and `m` or `dmin` where the type has one); IQ1_M's fp16 scale, spread over the top
nibbles of its four scale words; and MXFP4's E8M0 exponent 0xFF. Every byte of NVFP4's UE4M3 scales is
a finite scale, so it has nothing to find.

A non-finite scale makes its whole block NaN or infinite, and an integer product on 8-bit activations
can turn what follows into finite nonsense, so such a tensor is refused rather than run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3stream.quant.types import QType, T, as_qtype, type_size

# byte offsets of the fp16 scales in each block
F16_SCALE_OFFSETS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
    T.IQ1_S: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}
IQ1_M_SCALES = 48  # byte offset of IQ1_M's four uint16 scale words
CHUNK_BLOCKS = 1 << 20  # blocks (or values) checked at once: bounds the temporaries on a large tensor

# (bits of the exponent field, the integer view of one value) of the float types
_FLOAT_EXPONENTS = {T.F32: (0x7F800000, np.uint32), T.F16: (0x7C00, np.uint16), T.BF16: (0x7F80, np.uint16)}


def _f16_exponents_full(words: np.ndarray) -> np.ndarray:
    """Where fp16 bit patterns are NaN or infinity (exponent all ones)."""
    return (words & 0x7C00) == 0x7C00


def _words(blocks: np.ndarray) -> np.ndarray:
    """The little-endian uint16 words of each block (every block size and fp16 offset is even)."""
    return blocks.reshape(-1).view("<u2").reshape(len(blocks), -1)


def _iq1_m_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 scale of each block, as bits, from the top nibble of each scale word."""
    words = _words(blocks)[:, IQ1_M_SCALES // 2 : IQ1_M_SCALES // 2 + 4]
    parts = [(words[:, k] >> (12 - 4 * k)) & (0xF << (4 * k)) for k in range(4)]  # nibble k: bits 4k..4k+3
    return parts[0] | parts[1] | parts[2] | parts[3]


def _bad_blocks(blocks: np.ndarray, qtype: T) -> np.ndarray:
    """Bool per block (rows of `blocks`, uint8): whether a scale of it is not finite."""
    if qtype == T.MXFP4:
        return blocks[:, 0] == 0xFF
    if qtype == T.IQ1_M:
        return _f16_exponents_full(_iq1_m_scales(blocks))
    bad = np.zeros(len(blocks), dtype=bool)
    for offset in F16_SCALE_OFFSETS.get(qtype, ()):
        bad |= _f16_exponents_full(_words(blocks)[:, offset // 2])
    return bad


def first_non_finite(data: np.ndarray, qtype: QType) -> int | None:
    """The index of the first value (F32, F16, BF16) or block (quantized types) of `data`, a tensor's
    GGUF bytes (uint8, any shape), that is NaN or infinite or has such a scale; None when there is none."""
    member = as_qtype(qtype)
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if member in _FLOAT_EXPONENTS:
        exponent, word = _FLOAT_EXPONENTS[member]
        return _first(flat.view(word), lambda values: (values & exponent) == exponent)
    blocks = flat.reshape(-1, type_size(member)[1])
    return _first(blocks, lambda chunk: _bad_blocks(chunk, member))


def non_finite_problem(data: np.ndarray, qtype: QType) -> str | None:
    """What `first_non_finite` finds in `data`, said for an error line ("value 7 is NaN or infinite",
    "the scale of block 3 is NaN or infinite"); None when there is nothing."""
    index = first_non_finite(data, qtype)
    if index is None:
        return None
    where = f"value {index}" if as_qtype(qtype) in _FLOAT_EXPONENTS else f"the scale of block {index}"
    return f"{where} is NaN or infinite"


def _first(items: np.ndarray, is_bad: Callable[[np.ndarray], np.ndarray]) -> int | None:
    for start in range(0, len(items), CHUNK_BLOCKS):
        hits = np.flatnonzero(is_bad(items[start : start + CHUNK_BLOCKS]))
        if len(hits):
            return start + int(hits[0])
    return None
