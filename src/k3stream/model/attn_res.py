"""Attention residuals: a bank of earlier layer inputs, mixed back in by a softmax over scores."""

from __future__ import annotations

import torch

from k3stream.model.layers import rms_norm
from k3stream.quant.kernels import cpu


def residual_mix(
    bank: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-weighted sum of the banked rows and `current` ([N, E] each), scored by rms(row) . score.

    The scores use normalised rows, the sum the raw ones. An empty bank returns `current` as is.
    Float32 CPU rows that autograd does not follow take the C kernel (`steps_cpu.c`).
    """
    if not bank:
        return current
    if _mix_in_c(bank, current, score):
        return cpu.residual_mix([*bank, current], score, eps)
    rows = torch.stack([*bank, current])
    scores = (rms_norm(rows, None, eps) * score).sum(-1)
    weights = torch.softmax(scores, dim=0)
    return (weights[..., None] * rows).sum(0)


def bind_residual_mix(
    bank: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor, eps: float, out: torch.Tensor
) -> cpu.Call:
    """`residual_mix` of a non-empty bank into `out` as a bound C call where it runs in C, else a
    Python step."""
    if _mix_in_c(bank, current, score):
        return cpu.bind_residual_mix([*bank, current], score, eps, out)
    return cpu.python_step(lambda: out.copy_(residual_mix(bank, current, score, eps)))


def _mix_in_c(bank: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor) -> bool:
    same_shapes = current.ndim == 2 and all(row.shape == current.shape for row in bank)
    return same_shapes and score.shape == current.shape[1:] and cpu.takes([*bank, current, score])
