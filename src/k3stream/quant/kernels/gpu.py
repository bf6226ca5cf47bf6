"""Triton kernels for `x @ W.T` with W as GGUF blocks, dequantised in registers (never a float32 W).

Every program owns a `[BLOCK_N, BLOCK_M]` tile of the output (input rows x weight rows) and walks K in
tiles of 256 elements: it loads the tile's bytes of `BLOCK_M` weight rows, decodes them to float32 in
registers (the same field layout as `k3stream.quant.dequant`), and accumulates in float32. Few input
rows (decode, N <= 8) multiply elementwise and reduce once at the end; more rows (prefill) use `tl.dot`
at IEEE float32 precision. The grouped product (routed experts) serves every expert in one launch.

Triton is imported when present; without it this module still imports and the public functions raise
ImportError. `TRITON_INTERPRET=1` (set before this module is imported) runs the same kernels on CPU
tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from gguf.constants import GGMLQuantizationType

from k3stream.quant.types import QType, as_qtype, row_bytes

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the kernels below stay plain functions; calls raise ImportError
    triton = tl = None
    _TRITON_MISSING: ImportError | None = exc
else:
    _TRITON_MISSING = None

T = GGMLQuantizationType
# the i-quants and ternary types (`_dq_iquant`, their grids from `lookup_table`)
IQUANT_GPU_TYPES = frozenset(
    {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0}
)
SUPPORTED_GPU_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.NVFP4}
    | {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
    | IQUANT_GPU_TYPES
)
# float types are read through a typed view of W's bytes (BF16 as int16: the kernel shifts its bits)
_FLOAT_VIEWS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.int16}
MATVEC_MAX_ROWS = 8  # inputs with at most this many rows take the broadcast (mat-vec) path
MIN_PROGRAMS_PER_SM = 16  # mat-vec launches with fewer programs split K (loads in flight hide latency)


def available() -> bool:
    """Whether triton imported, so the products can run (on CUDA tensors, or on CPU under the interpreter)."""
    return _TRITON_MISSING is None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


# ---- block decoders ------------------------------------------------------------------------------
# Each decodes one K tile of 256 elements of BLOCK_M weight rows to float32 [BLOCK_M, 256]: `w_rows` are
# the rows' [BLOCK_M, 1] pointers, `k0` the tile's first element. Packed fields are loaded once per byte
# and unpacked with `_fields` (the layout of `dequant._unpack`); per-sub-block scales are loaded once per
# sub-block and broadcast with `_scaled`.


@_jit
def _load(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@_jit
def _f16(ptr, mask):
    """float32 from the little-endian fp16 at `ptr` (uint8 pointers)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _fields(packed, GROUPS: tl.constexpr, BITS: tl.constexpr):
    """[rows, GROUPS * WIDTH] bytes -> [rows, GROUPS * (8 // BITS) * WIDTH] fields: `dequant._unpack`."""
    rows: tl.constexpr = packed.shape[0]
    width: tl.constexpr = packed.shape[1] // GROUPS
    count: tl.constexpr = 8 // BITS
    shifts = (tl.arange(0, count) * BITS)[None, None, :, None]
    fields = (tl.reshape(packed, [rows, GROUPS, 1, width]) >> shifts) & ((1 << BITS) - 1)
    return tl.reshape(fields, [rows, GROUPS * count * width])


@_jit
def _scaled(q, step, offset, SUB: tl.constexpr):
    """`q * step - offset` with one step and offset ([rows, n_sub]) per SUB consecutive elements."""
    rows: tl.constexpr = q.shape[0]
    n_sub: tl.constexpr = q.shape[1] // SUB
    w = tl.reshape(q, [rows, n_sub, SUB]) * step[:, :, None] - offset[:, :, None]
    return tl.reshape(w, [rows, n_sub * SUB])


@_jit
def _dq_q2_k(blk, ok):
    sc = _load(blk + tl.arange(0, 16)[None, :], ok)
    step = (sc & 0xF).to(tl.float32) * _f16(blk + 80, ok)
    offset = (sc >> 4).to(tl.float32) * _f16(blk + 82, ok)
    q = _fields(_load(blk + 16 + tl.arange(0, 64)[None, :], ok), 2, 2).to(tl.float32)
    return _scaled(q, step, offset, 16)


@_jit
def _dq_q3_k(blk, ok):
    s = tl.arange(0, 16)
    sc_low = (_load(blk + (96 + s % 8)[None, :], ok) >> (s // 8 * 4)[None, :]) & 0xF
    sc_high = (_load(blk + (104 + s % 4)[None, :], ok) >> (s // 4 * 2)[None, :]) & 3
    step = ((sc_low | (sc_high << 4)) - 32).to(tl.float32) * _f16(blk + 108, ok)
    low = _fields(_load(blk + 32 + tl.arange(0, 64)[None, :], ok), 2, 2)
    high = _fields(_load(blk + tl.arange(0, 32)[None, :], ok), 1, 1)
    q = (low - ((high ^ 1) << 2)).to(tl.float32)  # a clear high bit means "minus 4"
    return _scaled(q, step, tl.zeros_like(step), 16)


@_jit
def _dq_q45_k(blk, ok, FIFTH_BIT: tl.constexpr):
    """Q4_K, or Q5_K (FIFTH_BIT: nibbles from byte 48; bit s of byte 16 + i the fifth of element 32s + i)."""
    s = tl.arange(0, 8)
    first = (s < 4)[None, :]
    d_part = _load(blk + (4 + s % 4)[None, :], ok)
    m_part = _load(blk + (8 + s % 4)[None, :], ok)
    md_part = _load(blk + (12 + s % 4)[None, :], ok)
    sc = tl.where(first, d_part & 63, (md_part & 0xF) | ((d_part >> 2) & 0x30)).to(tl.float32)
    mn = tl.where(first, m_part & 63, (md_part >> 4) | ((m_part >> 2) & 0x30)).to(tl.float32)
    q = _fields(_load(blk + (48 if FIFTH_BIT else 16) + tl.arange(0, 128)[None, :], ok), 4, 4)
    if FIFTH_BIT:
        q = q | (_fields(_load(blk + 16 + tl.arange(0, 32)[None, :], ok), 1, 1) << 4)
    return _scaled(q.to(tl.float32), sc * _f16(blk, ok), mn * _f16(blk + 2, ok), 32)


@_jit
def _dq_q6_k(blk, ok):
    sc = tl.load(blk + (192 + tl.arange(0, 16))[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
    step = sc.to(tl.float32) * _f16(blk + 208, ok)
    low = _fields(_load(blk + tl.arange(0, 128)[None, :], ok), 2, 4)
    high = _fields(_load(blk + 128 + tl.arange(0, 64)[None, :], ok), 2, 2)
    q = ((low | (high << 4)) - 32).to(tl.float32)
    return _scaled(q, step, tl.zeros_like(step), 16)


@_jit
def _nibbles(w_rows, k0, K, row_ok, bb: tl.constexpr, at: tl.constexpr):
    """[rows, 256] 4-bit codes of the tile's eight blocks (codes from byte `at` of each): element i of a
    block the low nibble of its byte i, element 16 + i its high nibble."""
    i = tl.arange(0, 128)
    ptr = w_rows + ((k0 // 32 + i // 16) * bb + at + i % 16)[None, :]
    return _fields(_load(ptr, row_ok & (k0 + i // 16 * 32 < K)[None, :]), 8, 4)


@_jit
def _fifth_bits(w_rows, k0, K, row_ok, bb: tl.constexpr, at: tl.constexpr):
    """[rows, 256] Q5_0/Q5_1 fifth bits as 16 or 0: bit j of each block's 32-bit qh (from byte `at`)."""
    j = tl.arange(0, 256)
    qh = _load(
        w_rows + ((k0 // 32 + j // 32) * bb + at + j % 32 // 8)[None, :],
        row_ok & (k0 + j // 32 * 32 < K)[None, :],
    )
    return ((qh >> (j % 8)[None, :]) & 1) << 4


@_jit
def _e2m1_doubled(code):
    """MXFP4's E2M1 value of a 4-bit code, doubled (0 1 2 3 4 6 8 12, negative from code 8 on)."""
    magnitude = code & 7
    big = (2 + (magnitude & 1)) << ((magnitude >> 1) - 1)  # 4 6 8 12 for 4..7
    value = tl.where(magnitude < 4, magnitude, big)
    return tl.where(code >= 8, -value, value)


@_jit
def _dq_legacy(w_rows, k0, K, row_ok, QTYPE: tl.constexpr, bb: tl.constexpr):
    """32-element blocks of `bb` bytes (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4): the tile's eight (those past K
    read as 0), each code times its block's step (plus Q4_1/Q5_1's offset m), as `dequant` computes."""
    b = tl.arange(0, 8)
    blocks = w_rows + ((k0 // 32 + b) * bb)[None, :]  # [rows, 8]
    ok = row_ok & (k0 + b * 32 < K)[None, :]
    if QTYPE == 39:  # E8M0 scale, halved as dec_mxfp4: 2^(e - 128)
        e = _load(blocks, ok)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:
        d = _f16(blocks, ok)
    offset = tl.zeros_like(d)
    if QTYPE == 8:
        i = tl.arange(0, 256)
        ptr = w_rows + ((k0 // 32 + i // 32) * bb + 2 + i % 32)[None, :]
        q = tl.load(ptr, mask=row_ok & (k0 + i < K)[None, :], other=0).to(tl.int8, bitcast=True)
        q = q.to(tl.float32)
    elif QTYPE == 2:
        q = _nibbles(w_rows, k0, K, row_ok, bb, 2).to(tl.float32) - 8.0
    elif QTYPE == 3:
        q = _nibbles(w_rows, k0, K, row_ok, bb, 4).to(tl.float32)
        offset = -_f16(blocks + 2, ok)  # q d - (-m): the reference's q d + m
    elif QTYPE == 6:
        q = (_nibbles(w_rows, k0, K, row_ok, bb, 6) | _fifth_bits(w_rows, k0, K, row_ok, bb, 2)).to(
            tl.float32
        ) - 16.0
    elif QTYPE == 7:
        q = (_nibbles(w_rows, k0, K, row_ok, bb, 8) | _fifth_bits(w_rows, k0, K, row_ok, bb, 4)).to(
            tl.float32
        )
        offset = -_f16(blocks + 2, ok)
    else:
        q = _e2m1_doubled(_nibbles(w_rows, k0, K, row_ok, bb, 1)).to(tl.float32)
    return _scaled(q, d, offset, 32)


@_jit
def _dq_nvfp4(w_rows, k0, K, row_ok):
    """NVFP4: the tile's four 64-value blocks of 36 bytes (values past K read as 0). Element e is value
    e % 16 of run e % 64 // 16 of its block: the run's UE4M3 scale, halved as `dequant`'s table holds it
    (0 and 0x7F are 0; bit 7 ignored), times its code's doubled E2M1 value (low nibbles of the run's 8
    bytes its first 8 values, high nibbles its last 8)."""
    e = tl.arange(0, 256)[None, :]
    blk = w_rows + (k0 // 64 + e // 64) * 36
    ok = row_ok & (k0 + e < K)
    run, j = e % 64 // 16, e % 16
    code = (_load(blk + 4 + 8 * run + j % 8, ok) >> (j // 8 * 4)) & 15
    s = _load(blk + run, ok)
    exponent, mantissa = (s >> 3) & 15, (s & 7).to(tl.float32)
    power = ((exponent + 120) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 7)
    raw = tl.where(exponent == 0, mantissa * 0.001953125, (1.0 + mantissa / 8.0) * power)
    scale = tl.where((s == 0) | (s == 0x7F), 0.0, raw * 0.5)
    return scale * _e2m1_doubled(code).to(tl.float32)


@_jit
def _dq_float(w_rows, k0, K, row_ok, QTYPE: tl.constexpr):
    k = k0 + tl.arange(0, 256)
    w = tl.load(w_rows + k[None, :], mask=row_ok & (k < K)[None, :], other=0)
    if QTYPE == 30:  # BF16 read as int16: its bits are the high half of a float32
        w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return w.to(tl.float32)


# The i-quants' grids and value tables in one int8 tensor (`lookup_table`), each at its offset here:
# IQ2_XXS, IQ2_XS, IQ2_S (8 values an entry), IQ3_XXS, IQ3_S (4), IQ1_S (8), IQ4_NL's 16 values, MXFP4's
# 16 and ggml's 128 ksigns (7 sign bits and their parity, as int8)
# (constexpr: the only globals a compiled kernel may read)
_constexpr = tl.constexpr if tl is not None else int
LUT_IQ2_XXS, LUT_IQ2_XS, LUT_IQ2_S = _constexpr(0), _constexpr(2048), _constexpr(6144)
LUT_IQ3_XXS, LUT_IQ3_S, LUT_IQ1_S = _constexpr(14336), _constexpr(15360), _constexpr(17408)
LUT_IQ4_NL, LUT_KSIGNS = _constexpr(33792), _constexpr(33824)


@functools.lru_cache(maxsize=8)
def lookup_table(device: torch.device) -> torch.Tensor:
    """The grids (`cpu._iq_grids`, from the gguf package) and ksigns as one int8 tensor on `device`."""
    from . import cpu

    ksigns = bytes((i | (bin(i).count("1") & 1) << 7) for i in range(128))
    table = b"".join(cpu._iq_grids()) + ksigns
    return torch.frombuffer(bytearray(table), dtype=torch.int8).to(device)


@_jit
def _lut(lut, index):
    return tl.load(lut + index).to(tl.int32)


@_jit
def _signed(sign_byte, j):
    """+1.0 or -1.0: bit j of `sign_byte` clear or set."""
    return (1 - 2 * ((sign_byte >> j) & 1)).to(tl.float32)


@_jit
def _dq_iquant(w_rows, k0, K, row_ok, lut, QTYPE: tl.constexpr):
    """The tile of an i-quant or ternary type: element e of the 256 is value j of group l (8 values) of
    run ib (32 values), decoded from its own bytes with gathered loads, as gguf's dequantize does."""
    e = tl.arange(0, 256)[None, :]
    ib, group, j = e // 32, e % 32 // 8, e % 8
    if QTYPE == 20:  # IQ4_NL: eight 32-value blocks of 18 bytes
        blk = w_rows + (k0 // 32 + ib) * 18
        ok = row_ok & (k0 + ib * 32 < K)
        code = (_load(blk + 2 + e % 16, ok) >> (e % 32 // 16 * 4)) & 15
        w = _f16(blk, ok) * _lut(lut, LUT_IQ4_NL + code).to(tl.float32)
    elif QTYPE == 16:
        blk = w_rows + k0 // 256 * 66
        packed = _u32(blk + 6 + 8 * ib, row_ok)
        sign = _lut(lut, LUT_KSIGNS + ((packed >> 7 * group) & 127))
        step = _f16(blk, row_ok) * (0.5 + (packed >> 28).to(tl.float32)) * 0.25
        grid = _lut(lut, LUT_IQ2_XXS + _load(blk + 2 + 8 * ib + group, row_ok) * 8 + j)
        w = step * grid.to(tl.float32) * _signed(sign, j)
    elif QTYPE == 17:
        blk = w_rows + k0 // 256 * 74
        q = _load(blk + 2 + 8 * ib + 2 * group, row_ok) | (_load(blk + 3 + 8 * ib + 2 * group, row_ok) << 8)
        sign = _lut(lut, LUT_KSIGNS + (q >> 9))
        step = _f16(blk, row_ok) * (
            0.5 + ((_load(blk + 66 + ib, row_ok) >> group // 2 * 4) & 15).to(tl.float32)
        )
        grid = _lut(lut, LUT_IQ2_XS + (q & 511) * 8 + j)
        w = step * 0.25 * grid.to(tl.float32) * _signed(sign, j)
    elif QTYPE == 22:
        blk = w_rows + k0 // 256 * 82
        index = _load(blk + 2 + 4 * ib + group, row_ok) | (
            (_load(blk + 66 + ib, row_ok) << (8 - 2 * group)) & 0x300
        )
        step = _f16(blk, row_ok) * (
            0.5 + ((_load(blk + 74 + ib, row_ok) >> group // 2 * 4) & 15).to(tl.float32)
        )
        grid = _lut(lut, LUT_IQ2_S + index * 8 + j)
        sign = _load(blk + 34 + 4 * ib + group, row_ok)
        w = step * 0.25 * grid.to(tl.float32) * _signed(sign, j)
    elif QTYPE == 18:
        blk = w_rows + k0 // 256 * 98
        packed = _u32(blk + 66 + 4 * ib, row_ok)
        sign = _lut(lut, LUT_KSIGNS + ((packed >> 7 * group) & 127))
        step = _f16(blk, row_ok) * (0.5 + (packed >> 28).to(tl.float32)) * 0.5
        grid = _lut(lut, LUT_IQ3_XXS + _load(blk + 2 + 8 * ib + e % 32 // 4, row_ok) * 4 + e % 4)
        w = step * grid.to(tl.float32) * _signed(sign, j)
    elif QTYPE == 21:
        blk = w_rows + k0 // 256 * 110
        entry = e % 32 // 4
        index = _load(blk + 2 + 8 * ib + entry, row_ok) | (
            (_load(blk + 66 + ib, row_ok) << (8 - entry)) & 256
        )
        scale = (_load(blk + 106 + ib // 2, row_ok) >> (ib % 2 * 4)) & 15
        step = _f16(blk, row_ok) * (1 + 2 * scale).to(tl.float32)
        grid = _lut(lut, LUT_IQ3_S + index * 4 + e % 4)
        sign = _load(blk + 74 + 4 * ib + group, row_ok)
        w = step * grid.to(tl.float32) * _signed(sign, j)
    elif QTYPE == 19:
        blk = w_rows + k0 // 256 * 50
        qh = _load(blk + 34 + 2 * ib, row_ok) | (_load(blk + 35 + 2 * ib, row_ok) << 8)
        index = _load(blk + 2 + 4 * ib + group, row_ok) | (((qh >> 3 * group) & 7) << 8)
        step = _f16(blk, row_ok) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        w = step * (_lut(lut, LUT_IQ1_S + index * 8 + j).to(tl.float32) + delta)
    elif QTYPE == 29:
        blk = w_rows + k0 // 256 * 56
        qh = _load(blk + 32 + 2 * ib + group // 2, row_ok)
        index = _load(blk + 4 * ib + group, row_ok) | ((qh << (8 - 4 * (group % 2))) & 0x700)
        delta = tl.where(((qh >> (3 + 4 * (group % 2))) & 1) != 0, -0.125, 0.125)
        words = blk + 48 + 2 * tl.arange(0, 4)[None, :]
        top = ((_load(words + 1, row_ok) >> 4) << (4 * tl.arange(0, 4)[None, :])).to(tl.int32)
        d = tl.sum(top, axis=1).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        word = _load(blk + 48 + 2 * (ib // 2), row_ok) | (_load(blk + 49 + 2 * (ib // 2), row_ok) << 8)
        scale = (word >> (6 * (ib % 2) + 3 * (group // 2))) & 7
        w = d * (2 * scale + 1).to(tl.float32) * (_lut(lut, LUT_IQ1_S + index * 8 + j).to(tl.float32) + delta)
    elif QTYPE == 23:
        blk = w_rows + k0 // 256 * 136
        high = (_load(blk + 2 + ib // 4, row_ok) >> (2 * (ib % 4))) & 3
        scale = ((_load(blk + 4 + ib // 2, row_ok) >> (ib % 2 * 4)) & 15) | (high << 4)
        code = (_load(blk + 8 + 16 * ib + e % 16, row_ok) >> (e % 32 // 16 * 4)) & 15
        w = _f16(blk, row_ok) * (scale - 32).to(tl.float32) * _lut(lut, LUT_IQ4_NL + code).to(tl.float32)
    elif QTYPE == 34:
        blk = w_rows + k0 // 256 * 54
        at = tl.where(e < 160, e % 32, tl.where(e < 240, 32 + (e - 160) % 16, 48 + (e - 240) % 4))
        trit = tl.where(e < 160, e // 32, tl.where(e < 240, (e - 160) // 16, (e - 240) // 4))
        power = tl.where(
            trit == 0, 1, tl.where(trit == 1, 3, tl.where(trit == 2, 9, tl.where(trit == 3, 27, 81)))
        )
        q = (_load(blk + at, row_ok) * power) & 255
        w = _f16(blk + 52, row_ok) * (((q * 3) >> 8) - 1).to(tl.float32)
    else:  # TQ2_0: bits 2l of byte 32(e // 128) + e % 32
        blk = w_rows + k0 // 256 * 66
        code = (_load(blk + e // 128 * 32 + e % 32, row_ok) >> (e % 128 // 32 * 2)) & 3
        w = _f16(blk + 64, row_ok) * (code - 1).to(tl.float32)
    return w


@_jit
def _u32(ptr, mask):
    """The little-endian uint32 at `ptr`."""
    low = _load(ptr, mask) | (_load(ptr + 1, mask) << 8) | (_load(ptr + 2, mask) << 16)
    return (low | (_load(ptr + 3, mask) << 24)).to(tl.uint32, bitcast=True)


@_jit
def _dequant(w_rows, k0, K, row_ok, lut, QTYPE: tl.constexpr):
    """float32 [BLOCK_M, 256] of the K tile starting at element `k0` (a multiple of 256); `lut`: the
    i-quants' grids (`lookup_table`)."""
    if QTYPE == 10:
        w = _dq_q2_k(w_rows + k0 // 256 * 84, row_ok)
    elif QTYPE == 11:
        w = _dq_q3_k(w_rows + k0 // 256 * 110, row_ok)
    elif QTYPE == 12:
        w = _dq_q45_k(w_rows + k0 // 256 * 144, row_ok, False)
    elif QTYPE == 13:
        w = _dq_q45_k(w_rows + k0 // 256 * 176, row_ok, True)
    elif QTYPE == 14:
        w = _dq_q6_k(w_rows + k0 // 256 * 210, row_ok)
    elif QTYPE == 2:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 18)
    elif QTYPE == 3:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 20)
    elif QTYPE == 6:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 22)
    elif QTYPE == 7:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 24)
    elif QTYPE == 8:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 34)
    elif QTYPE == 39:
        w = _dq_legacy(w_rows, k0, K, row_ok, QTYPE, 17)
    elif QTYPE == 40:
        w = _dq_nvfp4(w_rows, k0, K, row_ok)
    elif QTYPE == 0 or QTYPE == 1 or QTYPE == 30:
        w = _dq_float(w_rows, k0, K, row_ok, QTYPE)
    else:
        w = _dq_iquant(w_rows, k0, K, row_ok, lut, QTYPE)
    return w


# ---- the product ------------------------------------------------------------------------------------


@_jit
def _product_tile(
    x_ptr, w_ptr, out_ptr, m_tile, n_start, n_end, k_start, k_end, M, K, stride_x, stride_w, stride_out, lut,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    """out[n, m] = sum over k in [k_start, k_end) of x[n, k] W[m, k], for n in [n_start, n_start + BLOCK_N)
    below n_end and the BLOCK_M rows m of `m_tile`."""
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = n_start + tl.arange(0, BLOCK_N)
    row_ok = (rows < M)[:, None]
    n_ok = (ns < n_end)[:, None]
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + ns.to(tl.int64)[:, None] * stride_x
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # mat-vec: elementwise partial sums, reduced across lanes once at the end
        acc = tl.zeros([BLOCK_N, BLOCK_M, 256], dtype=tl.float32)
    for k0 in range(k_start, k_end, 256):
        k = k0 + tl.arange(0, 256)
        w = _dequant(w_rows, k0, K, row_ok, lut, QTYPE)
        xk = tl.load(x_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0).to(tl.float32)
        if USE_DOT:
            acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
        else:
            acc += xk[:, None, :] * w[None, :, :]
    result = acc if USE_DOT else tl.sum(acc, axis=2)
    out = out_ptr + ns.to(tl.int64)[:, None] * stride_out + rows[None, :]
    tl.store(out, result, mask=n_ok & (rows < M)[None, :])


@_jit
def _qmm_kernel(
    x_ptr, w_ptr, out_ptr, N, M, K, stride_x, stride_w, stride_out, stride_split, SPLITS, K_CHUNK, lut,
    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    """Grid (M tiles x SPLITS, N tiles): one weight matrix; split s sums K in [s K_CHUNK, (s+1) K_CHUNK)
    into the partial output at `out_ptr + s * stride_split`."""
    split = tl.program_id(0) % SPLITS
    k_start = split * K_CHUNK
    out_split = out_ptr + split.to(tl.int64) * stride_split
    _product_tile(x_ptr, w_ptr, out_split, tl.program_id(0) // SPLITS, tl.program_id(1) * BLOCK_N, N,
                  k_start, tl.minimum(K, k_start + K_CHUNK), M, K, stride_x, stride_w, stride_out, lut,
                  QTYPE, BLOCK_N, BLOCK_M, USE_DOT)  # fmt: skip


@_jit
def _grouped_kernel(
    x_ptr, w_like, table_ptr, out_ptr, M, K, stride_x, stride_w, stride_out, stride_split, SPLITS, K_CHUNK,
    lut, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    """Grid (M tiles x SPLITS, N tiles of the largest group, groups): group g's rows [lo, hi) of x times
    the matrix at address `addr`, from `table[g] = (addr, lo, hi)`; `w_like` only gives the pointer
    type. Splits of K as in `_qmm_kernel`."""
    group = table_ptr + tl.program_id(2) * 3
    n_start = tl.load(group + 1) + tl.program_id(1) * BLOCK_N
    n_end = tl.load(group + 2)
    if n_start < n_end:
        w_ptr = tl.load(group).to(w_like.dtype, bitcast=True)
        split = tl.program_id(0) % SPLITS
        k_start = split * K_CHUNK
        out_split = out_ptr + split.to(tl.int64) * stride_split
        _product_tile(x_ptr, w_ptr, out_split, tl.program_id(0) // SPLITS, n_start, n_end,
                      k_start, tl.minimum(K, k_start + K_CHUNK), M, K, stride_x, stride_w, stride_out,
                      lut, QTYPE, BLOCK_N, BLOCK_M, USE_DOT)  # fmt: skip


class Tiles(NamedTuple):
    """A launch's shape: output tile, kernel path, warps, and how many parts K is split into."""

    block_n: int
    block_m: int
    use_dot: bool
    num_warps: int
    splits: int = 1


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tiles(n_rows: int) -> Tiles:
    """The tiles for an input of `n_rows` rows (K unsplit)."""
    if n_rows > MATVEC_MAX_ROWS:
        return Tiles(16 if n_rows <= 16 else 32, 32, True, 8)
    block_n = triton.next_power_of_2(n_rows)
    return Tiles(block_n, max(2, 8 // block_n), False, 2)


def _splits(
    tiles: Tiles, n_rows: int, out_features: int, in_features: int, groups: int, device: torch.device
) -> Tiles:
    """`tiles` with K split so that a mat-vec launch has about MIN_PROGRAMS_PER_SM programs per SM."""
    if tiles.use_dot or device.type != "cuda" or tiles.splits != 1:
        return tiles
    programs = triton.cdiv(out_features, tiles.block_m) * triton.cdiv(n_rows, tiles.block_n) * groups
    k_tiles = triton.cdiv(in_features, 256)
    wanted = min(k_tiles, triton.cdiv(MIN_PROGRAMS_PER_SM * _sm_count(device), programs))
    return tiles._replace(splits=triton.cdiv(k_tiles, triton.cdiv(k_tiles, wanted)))


def _weight_operand(
    data: torch.Tensor, qt: GGMLQuantizationType, out_features: int, in_features: int, device: torch.device
):
    """W's bytes on `device` as the kernel reads them, and the row stride in its elements."""
    per_row = row_bytes(qt, in_features)
    if data.numel() * data.element_size() != out_features * per_row:
        raise ValueError(
            f"triton_qmatmul: {data.numel() * data.element_size()} weight bytes, expected {out_features} "
            f"rows x {per_row} bytes of {qt.name}"
        )
    raw = data.to(device).contiguous().view(torch.uint8).reshape(out_features, per_row)
    if qt in _FLOAT_VIEWS:
        return raw.view(_FLOAT_VIEWS[qt]), in_features
    return raw, per_row


def _launch(
    x: torch.Tensor, w: torch.Tensor, stride_w: int, qt: int, out: torch.Tensor, tiles: Tiles | None = None
) -> None:
    """One matrix's launch into `out`; `tiles` overrides the planned ones (tests and benchmark)."""
    n_rows, in_features = x.shape
    tiles = tiles or _splits(_tiles(n_rows), n_rows, out.shape[1], in_features, 1, x.device)
    target, k_chunk = _split_target(out, tiles, in_features)
    grid = (triton.cdiv(out.shape[1], tiles.block_m) * tiles.splits, triton.cdiv(n_rows, tiles.block_n))
    args = (x, w, target, n_rows, out.shape[1], in_features, x.stride(0), stride_w, target.stride(-2))
    split_stride = target.stride(0) if tiles.splits > 1 else 0
    _qmm_kernel[grid](*args, split_stride, tiles.splits, k_chunk, lookup_table(x.device), **_meta(qt, tiles))
    _reduce_splits(target, out)


def _launch_grouped(
    x: torch.Tensor,
    groups: list[tuple[torch.Tensor, int, int]],
    stride_w: int,
    qt: int,
    out: torch.Tensor,
    tiles: Tiles | None = None,
) -> None:
    """One launch for every `(weight operand, lo, hi)` group: its matrix's address rides in a table."""
    rows = [(w.data_ptr(), lo, hi) for w, lo, hi in groups]
    # pinned, so the copy is asynchronous (a pageable one would wait for the GPU's queued work)
    table = torch.tensor(rows, dtype=torch.int64, pin_memory=x.is_cuda).to(x.device, non_blocking=True)
    max_rows = max(hi - lo for _, lo, hi in groups)
    tiles = tiles or _splits(_tiles(max_rows), max_rows, out.shape[1], x.shape[1], len(groups), x.device)
    target, k_chunk = _split_target(out, tiles, x.shape[1])
    m_programs = triton.cdiv(out.shape[1], tiles.block_m) * tiles.splits
    grid = (m_programs, triton.cdiv(max_rows, tiles.block_n), len(groups))
    args = (
        x,
        groups[0][0],
        table,
        target,
        out.shape[1],
        x.shape[1],
        x.stride(0),
        stride_w,
        target.stride(-2),
    )
    split_stride = target.stride(0) if tiles.splits > 1 else 0
    lut = lookup_table(x.device)
    _grouped_kernel[grid](*args, split_stride, tiles.splits, k_chunk, lut, **_meta(qt, tiles))
    _reduce_splits(target, out)


# No multiply-add contracted into an FMA (Triton's default, as C's -ffp-contract=on): each weight is
# the reference's `q * step - offset`, two roundings, as the C kernels built with -ffp-contract=off
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def _meta(qt: int, tiles: Tiles) -> dict[str, int | bool]:
    return {
        "QTYPE": qt,
        "BLOCK_N": tiles.block_n,
        "BLOCK_M": tiles.block_m,
        "USE_DOT": tiles.use_dot,
        "num_warps": tiles.num_warps,
        **COMPILE_OPTIONS,
    }


def _split_target(out: torch.Tensor, tiles: Tiles, in_features: int) -> tuple[torch.Tensor, int]:
    """Where the kernel writes (`out`, or one partial per split of K) and the elements of K a split sums."""
    k_chunk = triton.cdiv(triton.cdiv(in_features, 256), tiles.splits) * 256
    if tiles.splits == 1:
        return out, k_chunk
    return torch.empty(tiles.splits, *out.shape, dtype=torch.float32, device=out.device), k_chunk


def _reduce_splits(target: torch.Tensor, out: torch.Tensor) -> None:
    if target is not out:
        torch.sum(target, dim=0, out=out)


def _checked(x: torch.Tensor, qtype: QType, in_features: int) -> tuple[torch.Tensor, GGMLQuantizationType]:
    if _TRITON_MISSING is not None:
        raise ImportError(
            "k3stream's GPU kernels need triton (the project's `gpu` extra: pip install -e '.[gpu]')"
        ) from _TRITON_MISSING
    qt = as_qtype(qtype)  # every type k3stream.quant supports has a Triton kernel
    if x.shape[-1] != in_features:
        raise ValueError(f"triton_qmatmul: input has {x.shape[-1]} features, weight expects {in_features}")
    x2 = x.reshape(-1, in_features)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), qt


def triton_qmatmul(
    x: torch.Tensor, data: torch.Tensor, qtype: QType, out_features: int, in_features: int
) -> torch.Tensor:
    """`x @ W.T` for W given as GGUF bytes (`[out, row_bytes]` uint8, or flat; moved to x's device first
    when elsewhere, as `qlinear` does).

    `x` is `[..., in_features]` of any float dtype; the product accumulates in float32 and is returned in
    x's dtype. ValueError for a type k3stream.quant does not support or mismatched sizes.
    """
    x2, qt = _checked(x, qtype, in_features)
    w, stride_w = _weight_operand(data, qt, out_features, in_features, x.device)
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32, device=x.device)
    if x2.shape[0] and out_features:
        _launch(x2, w, stride_w, int(qt), out)
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def triton_grouped_qmatmul(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    qtype: QType,
    out_features: int,
    in_features: int,
    starts: list[int],
) -> torch.Tensor:
    """Rows `x[starts[b]:starts[b + 1]]` times expert b's `weights[b]`.T, as one `[P, out_features]`.

    `x` is `[P, in_features]` with each expert's rows contiguous; `starts` holds the first row of every
    expert (non-decreasing, starting at 0), optionally followed by P. One kernel launch serves every
    expert with rows (the matrices' addresses go to the GPU in a small table); the rest are skipped.
    """
    x2, qt = _checked(x, qtype, in_features)
    bounds = [*starts, x2.shape[0]] if len(starts) == len(weights) else list(starts)
    if len(bounds) != len(weights) + 1 or bounds[0] != 0 or bounds[-1] != x2.shape[0]:
        raise ValueError(
            f"triton_grouped_qmatmul: starts {starts} do not split {x2.shape[0]} rows into "
            f"{len(weights)} experts"
        )
    if any(a > b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"triton_grouped_qmatmul: starts {starts} must be non-decreasing")
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32, device=x.device)
    groups = []
    for data, lo, hi in zip(weights, bounds, bounds[1:], strict=False):
        if hi > lo:
            w, stride_w = _weight_operand(data, qt, out_features, in_features, x.device)
            groups.append((w, lo, hi))
    if groups and out_features:
        _launch_grouped(x2, groups, stride_w, int(qt), out)
    return out.to(x.dtype)
