"""Tensor-parallel slices of linear layers, in their GGUF types (whole blocks, never re-typed).

A column-parallel layer keeps a range of output rows (any rows: a row is whole blocks); a row-parallel
layer keeps a range of input columns, which must start and end on block boundaries of its type. A
split that cannot fall on block boundaries is refused with one line naming the tensor and world size.
Slices are copies, so the full matrix can be freed once every layer is sliced.
"""

from __future__ import annotations

import torch

from k3stream.model.layers import DenseLinear, Linear, QuantLinear
from k3stream.quant.kernels import QWeight
from k3stream.quant.types import row_bytes, type_name, type_size


def part(count: int, rank: int, world: int, name: str, unit: int = 1) -> slice:
    """Rank `rank`'s equal share of `count` items split over `world` ranks, in whole `unit`s; `name`
    says what is split, by its GGUF names ("blk.3: 4 MLA heads")."""
    if not 0 <= rank < world:
        raise ValueError(f"{name}: rank {rank} outside 0..{world - 1}")
    if count % (unit * world):
        raise ValueError(f"{name} cannot be split over {world} tensor-parallel ranks")
    share = count // world
    return slice(rank * share, (rank + 1) * share)


def output_rows(linear: Linear, rows: slice) -> Linear:
    """Column-parallel: the layer computing only output features `rows`."""
    if isinstance(linear, DenseLinear):
        return DenseLinear(linear.weight[rows].clone(), linear.rounding_type)
    w = linear.weight
    width = row_bytes(w.ggml_type, w.shape[1])
    data = w.data.view(w.shape[0], width)[rows].reshape(-1).clone()
    count = len(range(w.shape[0])[rows])
    return _quant_like(linear, QWeight(data, w.ggml_type, (count, w.shape[1])))


def input_columns(linear: Linear, columns: slice, name: str, world: int) -> Linear:
    """Row-parallel: the layer reading only input features `columns` (its output is a partial sum)."""
    if isinstance(linear, DenseLinear):
        return DenseLinear(linear.weight[:, columns].clone(), linear.rounding_type)
    w = linear.weight
    elems, nbytes = type_size(w.ggml_type)
    if columns.start % elems or columns.stop % elems:
        raise ValueError(
            f"{name}: {type_name(w.ggml_type)} {list(w.shape)} cannot be split over {world} "
            f"tensor-parallel ranks on its {elems}-value blocks"
        )
    rows = w.data.view(w.shape[0], row_bytes(w.ggml_type, w.shape[1]))
    data = rows[:, columns.start // elems * nbytes : columns.stop // elems * nbytes].reshape(-1).clone()
    return _quant_like(linear, QWeight(data, w.ggml_type, (w.shape[0], columns.stop - columns.start)))


def _quant_like(linear: QuantLinear, weight: QWeight) -> QuantLinear:
    return QuantLinear(weight, linear.rounding_type is not None, linear.backend)


def rows_of(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """A copy of a dense tensor's rows `rows` (vectors, convolution rows, per-head matrices)."""
    return tensor[rows].clone()
