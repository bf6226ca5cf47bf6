"""Attention residuals: a bank of earlier layer inputs, mixed back in by a softmax over scores."""

from __future__ import annotations

import torch

from k3stream.model.layers import rms_norm


def residual_mix(
    bank: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-weighted sum of the banked rows and `current` ([N, E] each), scored by rms(row) . score.

    The scores use normalised rows, the sum the raw ones. An empty bank returns `current` as is.
    """
    if not bank:
        return current
    rows = torch.stack([*bank, current])
    scores = (rms_norm(rows, None, eps) * score).sum(-1)
    weights = torch.softmax(scores, dim=0)
    return (weights[..., None] * rows).sum(0)
