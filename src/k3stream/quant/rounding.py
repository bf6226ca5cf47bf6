"""What ggml's CPU matmul does to activations before its dot products, for `match_ggml=True`.

ggml converts the activations to the weight's "vec_dot" type first: F16/BF16 weights round them to
F16/BF16; K-quant, i-quant and ternary weights quantize them to Q8_K (256-value blocks, float scale);
Q4_0/Q5_0/Q8_0/MXFP4/NVFP4/IQ4_NL weights to Q8_0 (32-value blocks, F16 scale). The dot products are then
exact up to float summation order, so rounding the inputs the same way reproduces llama.cpp's numbers.
Q4_1/Q5_1 weights take Q8_1 in ggml: Q8_0's codes and scale plus a per-block F16 sum of the codes times
the unrounded scale, which multiplies the weight's offset. The C integer kernels (`kernels.cpu`) compute
that; rounding the inputs cannot, so for these two types `round_like_ggml` gives Q8_0's values and a
product on them differs from llama.cpp's offset terms by that sum's F16 rounding (the reference path's
`match_ggml` only).
"""

from __future__ import annotations

import torch

from k3stream.quant.types import IQUANT_TYPES, T

Q8_K_WEIGHTS = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}) | (IQUANT_TYPES - {T.IQ4_NL})
Q8_0_WEIGHTS = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4, T.NVFP4, T.IQ4_NL})


def round_like_ggml(x: torch.Tensor, weight_type: int | None) -> torch.Tensor:
    """x as ggml's CPU matmul sees it against a weight of GGML type `weight_type` (None: as is)."""
    if weight_type == T.F16:
        return x.to(torch.float16).to(x.dtype)
    if weight_type == T.BF16:
        return x.to(torch.bfloat16).to(x.dtype)
    if weight_type in Q8_K_WEIGHTS:
        return _blocks(x, 256, _q8_k)
    if weight_type in Q8_0_WEIGHTS:
        return _blocks(x, 32, _q8_0)
    return x


def _blocks(x: torch.Tensor, size: int, quantize) -> torch.Tensor:
    blocks = x.float().reshape(*x.shape[:-1], -1, size)
    return quantize(blocks).reshape(x.shape).to(x.dtype)


def _q8_k(blocks: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K_ref: scale -127/max by the signed value of largest magnitude (first one)."""
    first_max = blocks.abs().argmax(-1, keepdim=True)
    signed_max = blocks.gather(-1, first_max)
    iscale = torch.where(signed_max != 0, _divided(-127.0, signed_max), torch.zeros_like(signed_max))
    q = torch.round(iscale * blocks).clamp(max=127)  # round half to even, as nearest_int
    return torch.where(signed_max != 0, q * _divided(1.0, iscale), torch.zeros_like(blocks))


def _divided(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator correctly rounded, as C's float division: torch computes `scalar /
    tensor` as reciprocal times scalar, one ulp off at times, which moves a code at a rounding tie."""
    return torch.full_like(denominator, numerator) / denominator


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0 (AVX2): d = amax/127 stored as F16, q = round_half_even(x * 127/amax)."""
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax != 0, _divided(127.0, amax), torch.zeros_like(amax))
    d = (amax / 127.0).to(torch.float16).float()
    return torch.round(blocks * inverse) * d
