"""`x @ W^T` on GGUF bytes, dequantising a bounded slab of W's rows at a time."""

from __future__ import annotations

import numpy as np
import torch

from .dequant import FLOAT_DTYPES, _as_byte_tensor, dequantize
from .types import QType, as_qtype, row_bytes

SLAB_BYTES = 16 << 20  # float32 bytes of dequantised weight alive at once


def default_slab_rows(in_features: int, slab_bytes: int = SLAB_BYTES) -> int:
    """Rows of float32 weight that fit in `slab_bytes` (at least one)."""
    return max(1, slab_bytes // (4 * in_features))


def slab_ranges(n_rows: int, slab_rows: int) -> list[tuple[int, int]]:
    """`[start, stop)` row ranges of at most `slab_rows` rows covering `0..n_rows`."""
    if slab_rows < 1:
        raise ValueError(f"slab_rows must be >= 1, got {slab_rows}")
    return [(start, min(start + slab_rows, n_rows)) for start in range(0, n_rows, slab_rows)]


def qlinear(
    x: torch.Tensor,
    data: np.ndarray | torch.Tensor,
    qtype: QType,
    out_features: int,
    in_features: int,
    slab_rows: int | None = None,
) -> torch.Tensor:
    """`x @ W.T` for W given as GGUF bytes (`[out, row_bytes]` or flat); dtype and device follow `x`.

    Quantised W is dequantised `slab_rows` rows at a time (default: 16 MiB of float32), after its
    bytes move to x's device; F32/F16/BF16 W is used whole.
    """
    qt = as_qtype(qtype)
    weights = _weight_rows(data, qt, out_features, in_features)
    if x.shape[-1] != in_features:
        raise ValueError(f"qlinear: input has {x.shape[-1]} features, weight {qt.name} expects {in_features}")
    if qt in FLOAT_DTYPES:
        w = weights.contiguous().view(FLOAT_DTYPES[qt]).to(device=x.device, dtype=x.dtype)
        return x @ w.T
    out = x.new_empty(*x.shape[:-1], out_features)
    for start, stop in slab_ranges(out_features, slab_rows or default_slab_rows(in_features)):
        w = dequantize(weights[start:stop].to(x.device), qt).to(x.dtype)
        out[..., start:stop] = x @ w.T
    return out


def _weight_rows(data: np.ndarray | torch.Tensor, qt, out_features: int, in_features: int) -> torch.Tensor:
    raw = _as_byte_tensor(data)
    per_row = row_bytes(qt, in_features)
    if raw.numel() != out_features * per_row:
        raise ValueError(
            f"qlinear: {raw.numel()} weight bytes, expected {out_features} rows x {per_row} bytes "
            f"of {qt.name}"
        )
    return raw.reshape(out_features, per_row)
