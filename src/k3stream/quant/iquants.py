"""Torch decoders of the i-quants and the ternary types, bit-exact with `gguf.quants.dequantize`.

The lookup grids, the sign patterns and the IQ4 values are data taken from the `gguf` package (which
holds ggml's tables); they are made into tensors once per device. As in `dequant`, every float
product is taken in gguf's order (`d * (0.5 + s) * 0.25`, then `* grid`, then `* sign`): the
integer parts are exact, the float products must round the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf.quants
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from .fields import as_floats, fp16_field, fp16_to_fp32, unpack

T = GGMLQuantizationType
BlockDecoder = Callable[[torch.Tensor], torch.Tensor]
GRID_TYPES = (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S)


def grid_rows(qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [entries, values] lookup grid of an i-quant, as gguf decodes it from ggml's table."""
    quant = getattr(gguf.quants, qtype.name)
    quant.init_grid()
    return np.asarray(quant.grid, dtype=np.float32).reshape(quant.grid_shape)


def sign_patterns() -> np.ndarray:
    """uint8 [128, 8]: bit j of ggml's `ksigns_iq2xs[i]` (the 8th sign makes the count of minuses even)."""
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    return (ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1


def iq4_values() -> np.ndarray:
    """int8 [16]: the non-linear 4-bit codebook of IQ4_NL and IQ4_XS."""
    return np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)


@functools.lru_cache(maxsize=32)
def _grid(qtype: GGMLQuantizationType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(grid_rows(qtype)).to(device)


@functools.lru_cache(maxsize=8)
def _sign_table(device: torch.device) -> torch.Tensor:
    """float32 [128, 8] of +1/-1: the signs of the 7-bit sign indices."""
    return torch.from_numpy(1.0 - 2.0 * sign_patterns().astype(np.float32)).to(device)


@functools.lru_cache(maxsize=8)
def _iq4_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(iq4_values().astype(np.float32)).to(device)


def _words(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes `start:stop` of every block as little-endian words, widened to int64."""
    packed = blocks[:, start:stop].clone(memory_format=torch.contiguous_format)  # word views need offset 0
    return packed.view(dtype).to(torch.int64)


def _looked_up(qtype: GGMLQuantizationType, index: torch.Tensor) -> torch.Tensor:
    return _grid(qtype, index.device)[index]


def _bit_signs(bits: torch.Tensor) -> torch.Tensor:
    """+1 for a clear bit, -1 for a set one (float32)."""
    return as_floats(bits).mul_(-2).add_(1)


def _nibble_scales(packed: torch.Tensor) -> torch.Tensor:
    """(n, 2 * bytes) 4-bit scales, low nibble first, as floats."""
    return as_floats(unpack(packed, bits=4, groups=packed.shape[1]).reshape(packed.shape[0], -1))


def _signed_grid(step: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """step * grid * signs in gguf's order, flattened to blocks of 256."""
    return (step * grid).mul_(signs).reshape(grid.shape[0], -1)


# ---- 2- and 3-bit grids with 7-bit sign indices ---------------------------------------------


def _decode_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    words = _words(blocks, 2, 66, torch.int32).reshape(-1, 8, 2)
    aux = words[..., 1] & 0xFFFFFFFF
    step = (fp16_field(blocks, 0) * as_floats(aux >> 28).add_(0.5)).mul_(0.25)
    grid = _looked_up(T.IQ2_XXS, blocks[:, 2:66].reshape(-1, 8, 8)[..., :4].to(torch.int64))
    sign_index = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F
    signs = _sign_table(blocks.device)[sign_index]
    return _signed_grid(step.reshape(-1, 8, 1, 1), grid, signs)


def _decode_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    codes = _words(blocks, 2, 66, torch.int16) & 0xFFFF
    scales = _nibble_scales(blocks[:, 66:74])
    step = (fp16_field(blocks, 0) * scales.add_(0.5)).mul_(0.25)
    grid = _looked_up(T.IQ2_XS, codes & 511).reshape(-1, 16, 2, 8)
    signs = _sign_table(blocks.device)[codes >> 9].reshape(-1, 16, 2, 8)
    return _signed_grid(step.reshape(-1, 16, 1, 1), grid, signs)


def _decode_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    high = unpack(blocks[:, 66:74], bits=2, groups=8).reshape(-1, 32).to(torch.int64)
    codes = blocks[:, 2:34].to(torch.int64) | (high << 8)
    scales = _nibble_scales(blocks[:, 74:82])
    step = (fp16_field(blocks, 0) * scales.add_(0.5)).mul_(0.25)
    grid = _looked_up(T.IQ2_S, codes).reshape(-1, 16, 2, 8)
    signs = _bit_signs(unpack(blocks[:, 34:66], bits=1, groups=32)).reshape(-1, 16, 2, 8)
    return _signed_grid(step.reshape(-1, 16, 1, 1), grid, signs)


def _decode_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    aux = _words(blocks, 66, 98, torch.int32) & 0xFFFFFFFF
    step = (fp16_field(blocks, 0) * as_floats(aux >> 28).add_(0.5)).mul_(0.5)
    grid = _looked_up(T.IQ3_XXS, blocks[:, 2:66].to(torch.int64)).reshape(-1, 8, 4, 8)
    sign_index = (aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 0x7F
    signs = _sign_table(blocks.device)[sign_index]
    return _signed_grid(step.reshape(-1, 8, 1, 1), grid, signs)


def _decode_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    high = unpack(blocks[:, 66:74], bits=1, groups=8).reshape(-1, 64).to(torch.int64)
    codes = blocks[:, 2:66].to(torch.int64) | (high << 8)
    scales = _nibble_scales(blocks[:, 106:110])
    step = fp16_field(blocks, 0) * scales.mul_(2).add_(1)
    grid = _looked_up(T.IQ3_S, codes).reshape(-1, 8, 4, 8)
    signs = _bit_signs(unpack(blocks[:, 74:106], bits=1, groups=32)).reshape(-1, 8, 4, 8)
    return _signed_grid(step.reshape(-1, 8, 1, 1), grid, signs)


# ---- 1-bit grids: values -1, 0, 1 shifted by +-1/8 ------------------------------------------

IQ1_DELTA = float(gguf.quants.IQ1_S.delta)


def _iq1_codes(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """11-bit grid indices: a byte each, 3 high bits each from `high` (int64, same shape)."""
    return low.to(torch.int64) | ((high & 7) << 8)


def _iq1_values(step: torch.Tensor, codes: torch.Tensor, negative_delta: torch.Tensor) -> torch.Tensor:
    """step * (grid + delta), delta -1/8 where `negative_delta` else +1/8."""
    delta = torch.where(negative_delta, -IQ1_DELTA, IQ1_DELTA).to(torch.float32)
    grid = _looked_up(T.IQ1_S, codes)
    return step * grid.add_(delta)


def _decode_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    high = _words(blocks, 34, 50, torch.int16) & 0xFFFF
    step = fp16_field(blocks, 0) * as_floats(((high >> 12) & 7) * 2 + 1)
    parts = high.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=blocks.device)
    codes = _iq1_codes(blocks[:, 2:34].reshape(-1, 8, 4), parts)
    negative = (high & 0x8000).ne(0).reshape(-1, 8, 1, 1)
    return _iq1_values(step.reshape(-1, 8, 1, 1), codes, negative).reshape(-1, 256)


def _decode_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    packed = _words(blocks, 48, 56, torch.int16) & 0xFFFF
    shifts = torch.tensor([12, 8, 4, 0], device=blocks.device)
    d_bits = ((packed & 0xF000) >> shifts).sum(-1, keepdim=True)  # four disjoint nibbles
    d = fp16_to_fp32(d_bits.to(torch.int16).view(torch.float16))
    scales = (packed.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9], device=blocks.device)) & 7
    step = d * as_floats(scales.reshape(-1, 16) * 2 + 1)
    high = unpack(blocks[:, 32:48], bits=4, groups=16).reshape(-1, 8, 2, 2).to(torch.int64)
    codes = _iq1_codes(blocks[:, :32].reshape(-1, 8, 2, 2), high)
    negative = (high & 8).ne(0).unsqueeze(-1)
    return _iq1_values(step.reshape(-1, 8, 2, 1, 1), codes, negative).reshape(-1, 256)


# ---- non-linear 4-bit codebook --------------------------------------------------------------


def _decode_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    codes = unpack(blocks[:, 2:], bits=4, groups=1).reshape(-1, 32).to(torch.int64)
    return fp16_field(blocks, 0) * _iq4_table(blocks.device)[codes]


def _decode_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    low = unpack(blocks[:, 4:8], bits=4, groups=4).reshape(-1, 8).to(torch.int64)
    high = _words(blocks, 2, 4, torch.int16) & 0xFFFF
    high = (high >> torch.arange(0, 16, 2, device=blocks.device)) & 3
    scales = as_floats((low | (high << 4)) - 32)
    step = (fp16_field(blocks, 0) * scales).unsqueeze(-1)
    codes = unpack(blocks[:, 8:], bits=4, groups=8).reshape(-1, 8, 32).to(torch.int64)
    return (step * _iq4_table(blocks.device)[codes]).reshape(-1, 256)


# ---- ternary ---------------------------------------------------------------------------------


def _ternary_digits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(n, count * bytes): digit k of each byte (base 3, most significant first) as ggml packs it:
    the byte times 3^k wraps to 8 bits, and the digit is (that * 3) >> 8."""
    powers = torch.tensor([3**k for k in range(count)], dtype=torch.int64, device=packed.device)
    shifted = (packed.to(torch.int64).unsqueeze(1) * powers.unsqueeze(-1)) & 0xFF
    return ((shifted * 3) >> 8).reshape(packed.shape[0], -1)


def _decode_tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    digits = torch.cat(
        [
            _ternary_digits(blocks[:, :32], 5),
            _ternary_digits(blocks[:, 32:48], 5),
            _ternary_digits(blocks[:, 48:52], 4),
        ],
        dim=-1,
    )
    return fp16_field(blocks, 52) * as_floats(digits - 1)


def _decode_tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    codes = unpack(blocks[:, :64], bits=2, groups=2).reshape(-1, 256)
    return fp16_field(blocks, 64) * as_floats(codes).sub_(1)


IQUANT_DECODERS: dict[GGMLQuantizationType, BlockDecoder] = {
    T.IQ1_S: _decode_iq1_s,
    T.IQ1_M: _decode_iq1_m,
    T.IQ2_XXS: _decode_iq2_xxs,
    T.IQ2_XS: _decode_iq2_xs,
    T.IQ2_S: _decode_iq2_s,
    T.IQ3_XXS: _decode_iq3_xxs,
    T.IQ3_S: _decode_iq3_s,
    T.IQ4_NL: _decode_iq4_nl,
    T.IQ4_XS: _decode_iq4_xs,
    T.TQ1_0: _decode_tq1_0,
    T.TQ2_0: _decode_tq2_0,
}
