"""Bit fields of GGML blocks as torch tensors: the pieces every block decoder is made of."""

from __future__ import annotations

import torch


def fp16_to_fp32(half: torch.Tensor) -> torch.Tensor:
    """Exact fp16 -> fp32 for every bit pattern: torch's CPU cast canonicalises NaNs, numpy keeps
    their sign and payload (shifted up 13 bits), so NaNs are rebuilt from the bits."""
    out = half.to(torch.float32)
    nan = out.isnan()
    if nan.any():
        bits = half.view(torch.int16)[nan].to(torch.int32)
        # written as integers: a float copy could quieten signalling NaNs
        out.view(torch.int32)[nan] = ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x03FF) << 13)
    return out


def fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n, 1) float32 from the little-endian fp16 at byte `start` of every block."""
    return fp16_to_fp32(blocks[:, start : start + 2].contiguous().view(torch.float16))


def unpack(fields: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    """(n, groups, 8//bits, width) bit fields of (n, groups*width) bytes; field f at bit f*bits.

    Returns a fresh tensor, so callers may update it in place (the decoders do, to save passes).
    Shifts whole words (up to 8 bytes at once) by scalars: a field never crosses a byte, so masking
    every byte of the shifted word leaves exactly the bytes' fields, and the little-endian byte view
    of the words is the unpacked bytes. Several times faster than a broadcast shift of the bytes."""
    count = 8 // bits
    width = fields.shape[1] // groups
    word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if width % d.itemsize == 0)
    packed = fields.clone(memory_format=torch.contiguous_format)  # word views need offset 0
    words = packed.view(word).reshape(fields.shape[0], groups, -1)
    mask = int.from_bytes(bytes([(1 << bits) - 1]) * word.itemsize, "little")
    shifted = torch.stack([words >> (field * bits) for field in range(count)], dim=2)
    return shifted.bitwise_and_(mask).view(torch.uint8)


def with_high_bits(low: torch.Tensor, high: torch.Tensor, low_bits: int) -> torch.Tensor:
    """`low | (high << low_bits)`, reusing both (fresh) tensors."""
    return low.bitwise_or_(high.bitwise_left_shift_(low_bits))


def as_floats(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32)
