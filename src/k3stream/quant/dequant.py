"""Vectorised torch decoders for GGML blocks, bit-exact with `gguf.quants.dequantize`.

Every decoder mirrors gguf's float operations in the same order (e.g. `d * (q - 8)`, and
`(d * sc) * q - (dmin * m)` for the K-quants): the integer parts are exact in any form, but the float
products and differences must round the same way. The device follows the input tensor.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from .fields import as_floats, fp16_field, fp16_to_fp32, unpack, with_high_bits
from .iquants import IQUANT_DECODERS
from .types import QType, as_qtype, type_size

T = GGMLQuantizationType
BlockDecoder = Callable[[torch.Tensor], torch.Tensor]
FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


def dequantize(data: np.ndarray | torch.Tensor, qtype: QType) -> torch.Tensor:
    """float32 rows (last dim elements) from rows of `qtype` blocks (last dim bytes).

    Like gguf, the input's bytes are what count: any dtype is reinterpreted as bytes, so F32/F16/BF16
    may come as uint8 or already typed. Output lives on the input's device.
    """
    qt = as_qtype(qtype)
    raw = _as_byte_tensor(data)
    block_elems, block_bytes = type_size(qt)
    if raw.ndim == 0 or raw.shape[-1] % block_bytes:
        raise ValueError(
            f"dequantize {qt.name}: last dim of {tuple(raw.shape)} bytes is not a multiple of "
            f"its block size {block_bytes}"
        )
    out_shape = (*raw.shape[:-1], raw.shape[-1] // block_bytes * block_elems)
    if raw.numel() == 0:
        return torch.empty(out_shape, dtype=torch.float32, device=raw.device)
    if qt == T.F32 and isinstance(data, np.ndarray) and not data.flags.writeable:
        # F32 decodes to a view; never hand out a writable tensor over read-only (mmap) memory
        return _decode_float(raw, qt).reshape(out_shape).clone()
    if qt in FLOAT_DTYPES:
        return _decode_float(raw, qt).reshape(out_shape)
    blocks = raw.reshape(-1, block_bytes)
    return _DECODERS[qt](blocks).reshape(out_shape)


def _as_byte_tensor(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(data, np.ndarray):
        with warnings.catch_warnings():
            # read-only mmap views are fine: nothing here writes to the input
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(np.ascontiguousarray(data))
    if data.dtype == torch.uint8:
        return data
    if data.ndim == 0:
        data = data.reshape(1)
    return data.contiguous().view(torch.uint8)


def _decode_float(raw: torch.Tensor, qt: GGMLQuantizationType) -> torch.Tensor:
    flat = raw.reshape(-1).contiguous()
    if qt == T.BF16:
        # via integer bits: keeps every NaN payload exactly as gguf's shift does
        return (flat.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    if qt == T.F16:
        return fp16_to_fp32(flat.view(torch.float16))
    return flat.view(torch.float32)


@functools.lru_cache(maxsize=16)
def _mxfp4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(MXFP4_VALUES, dtype=torch.float32).to(device)


# ---- legacy 32-element blocks ---------------------------------------------------------------
# gguf computes d * float(q - 8); float(q) - 8 is the same exact value, so q is shifted in float.


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = as_floats(unpack(blocks[:, 2:], bits=4, groups=1).reshape(-1, 32))
    return q.sub_(8).mul_(fp16_field(blocks, 0))


def _decode_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = as_floats(unpack(blocks[:, 4:], bits=4, groups=1).reshape(-1, 32))
    return q.mul_(fp16_field(blocks, 0)).add_(fp16_field(blocks, 2))


def _q5_codes(blocks: torch.Tensor, high_at: int) -> torch.Tensor:
    """The 5-bit codes of Q5_0/Q5_1, as floats: low nibbles after the 32-bit high mask at `high_at`."""
    high = unpack(blocks[:, high_at : high_at + 4], bits=1, groups=4).reshape(-1, 32)
    low = unpack(blocks[:, high_at + 4 :], bits=4, groups=1).reshape(-1, 32)
    return as_floats(with_high_bits(low, high, 4))


def _decode_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _q5_codes(blocks, high_at=2).sub_(16).mul_(fp16_field(blocks, 0))


def _decode_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _q5_codes(blocks, high_at=4).mul_(fp16_field(blocks, 0)).add_(fp16_field(blocks, 2))


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = as_floats(blocks[:, 2:].contiguous().view(torch.int8))
    return q.mul_(fp16_field(blocks, 0))


def _decode_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e = blocks[:, :1].to(torch.int32)
    scale_bits = torch.where(
        e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23
    )
    q = unpack(blocks[:, 1:], bits=4, groups=1).reshape(-1, 32)
    return _mxfp4_table(blocks.device)[q.to(torch.int32)].mul_(scale_bits.view(torch.float32))


@functools.lru_cache(maxsize=16)
def _ue4m3_table(device: torch.device) -> torch.Tensor:
    """NVFP4's 256 UE4M3 scales, halved (its E2M1 values are held doubled), from gguf's own decoder."""
    from gguf.quants import NVFP4

    codes = np.arange(256, dtype=np.uint8)
    return torch.from_numpy(NVFP4.ue4m3_to_fp32(codes).astype(np.float32)).to(device)


def _decode_nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    """Four runs of 16 values a block: a UE4M3 scale each (bytes 0..3), then 8 bytes of E2M1 codes (low
    nibbles the run's first 8 values, high nibbles its last 8)."""
    scales = _ue4m3_table(blocks.device)[blocks[:, :4].to(torch.int32)].unsqueeze(-1)
    q = unpack(blocks[:, 4:], bits=4, groups=4).reshape(-1, 4, 16)
    return _mxfp4_table(blocks.device)[q.to(torch.int32)].mul_(scales).reshape(-1, 64)


# ---- K-quants (256-element super-blocks) ----------------------------------------------------


def _decode_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, :16]
    d, dmin = fp16_field(blocks, 80), fp16_field(blocks, 82)
    step = as_floats(scales & 0x0F).mul_(d).unsqueeze(-1)
    offset = as_floats(scales >> 4).mul_(dmin).unsqueeze(-1)
    q = as_floats(unpack(blocks[:, 16:80], bits=2, groups=2).reshape(-1, 16, 16))
    return q.mul_(step).sub_(offset).reshape(-1, 256)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Sixteen signed 6-bit scales from Q3_K's 12 bytes, as floats."""
    low = unpack(packed[:, :8], bits=4, groups=1).reshape(-1, 16)
    high = unpack(packed[:, 8:], bits=2, groups=1).reshape(-1, 16)
    return as_floats(with_high_bits(low, high, 4)).sub_(32)


def _decode_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    step = _q3_k_scales(blocks[:, 96:108]).mul_(fp16_field(blocks, 108)).unsqueeze(-1)
    low = unpack(blocks[:, 32:96], bits=2, groups=2).reshape(-1, 16, 16)
    high = unpack(blocks[:, :32], bits=1, groups=1).reshape(-1, 16, 16)
    # a clear high bit means "minus 4" (ggml's hmask is inverted)
    q = low.view(torch.int8).sub_(high.bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8))
    return as_floats(q).mul_(step).reshape(-1, 256)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit scales and mins from Q4_K/Q5_K's 12 bytes, as floats."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return as_floats(scales), as_floats(mins)


def _affine_k(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    step = scales.mul_(fp16_field(blocks, 0)).unsqueeze(-1)
    offset = mins.mul_(fp16_field(blocks, 2)).unsqueeze(-1)
    return as_floats(q.reshape(-1, 8, 32)).mul_(step).sub_(offset).reshape(-1, 256)


def _decode_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _affine_k(blocks, unpack(blocks[:, 16:], bits=4, groups=4))


def _decode_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = unpack(blocks[:, 16:48], bits=1, groups=1).reshape(-1, 8, 32)
    low = unpack(blocks[:, 48:], bits=4, groups=4).reshape(-1, 8, 32)
    return _affine_k(blocks, with_high_bits(low, high, 4))


def _decode_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = as_floats(blocks[:, 192:208].contiguous().view(torch.int8))
    step = scales.mul_(fp16_field(blocks, 208)).unsqueeze(-1)
    low = unpack(blocks[:, :128], bits=4, groups=2).reshape(-1, 8, 32)
    high = unpack(blocks[:, 128:192], bits=2, groups=2).reshape(-1, 8, 32)
    q = as_floats(with_high_bits(low, high, 4).reshape(-1, 16, 16)).sub_(32)
    return q.mul_(step).reshape(-1, 256)


_DECODERS: dict[GGMLQuantizationType, BlockDecoder] = {
    T.Q4_0: _decode_q4_0,
    T.Q4_1: _decode_q4_1,
    T.Q5_0: _decode_q5_0,
    T.Q5_1: _decode_q5_1,
    T.Q8_0: _decode_q8_0,
    T.MXFP4: _decode_mxfp4,
    T.NVFP4: _decode_nvfp4,
    T.Q2_K: _decode_q2_k,
    T.Q3_K: _decode_q3_k,
    T.Q4_K: _decode_q4_k,
    T.Q5_K: _decode_q5_k,
    T.Q6_K: _decode_q6_k,
}
_DECODERS.update(IQUANT_DECODERS)
