"""Tiny random Kimi-K3 GGUFs for tests, benchmarks and the demo (`gguf.writer` with the built-in vocabulary).

`make_tiny(out_dir, TinySpec(...))` writes random weights (`gguf.writer.initial_values`). Large
routed-expert tensors (at least `FAST_EXPERT_VALUES` values) and other large matrices (at least
`FAST_MATRIX_VALUES`: real-dimension slices) are random valid blocks instead (`testing.tinyblocks`,
`testing.iquant_blocks`) or random F32 or F16 rows, written slab by slab at close to disk speed and in
constant memory.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from k3stream.gguf.vocab import Vocab, padded
from k3stream.gguf.writer import F16, F32, TinySpec, checked_plan, write_model
from k3stream.quant import DECODE_ONLY_TYPES
from k3stream.testing.iquant_blocks import random_blocks
from k3stream.testing.tinyblocks import FAST_TYPES, random_block_slabs
from k3stream.testing.tinyvocab import tiny_vocab

# Tensors of at least this many values (routed experts; other matrices) are written as random valid
# blocks or random F32 rows in slabs (seconds per GB, constant memory) instead of quantized random
# floats (minutes per GB, the whole tensor in float64). Test models stay far below them, so their bytes,
# and the property that every recipe quantizes the same float values, do not change.
FAST_EXPERT_VALUES = 1 << 22
FAST_MATRIX_VALUES = 1 << 22
SLAB_VALUES = 1 << 22  # F32 and i-quant slabs: 16 MiB of F32 values


def make_tiny(
    out_dir: str | os.PathLike[str],
    spec: TinySpec,
    vocab: Vocab | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny Kimi-K3 GGUF into `out_dir`; return the file (or shard 1) path.

    Random weights and the built-in vocabulary unless given: `vocab` and `weights` (float32 values of
    every tensor by GGUF name, in its numpy shape: a trained model)."""
    if vocab is None and spec.vocab is not None:
        checked_plan(out_dir, spec, spec.vocab)  # sizes first: padding builds a token per row
        vocab = padded(tiny_vocab(), spec.vocab)
    if vocab is None:
        vocab = tiny_vocab()
    return write_model(out_dir, spec, vocab, weights, _random_blocks if weights is None else None)


def _random_blocks(tensor, spec: TinySpec, ggml_type: int) -> Iterator[np.ndarray] | None:
    """Random values in slabs for a large tensor, random valid blocks for a type k3stream cannot encode
    (the i-quants, the ternary types, NVFP4); None for any other (its values are encoded whole)."""
    seed = [spec.seed, zlib.crc32(tensor.name.encode()), 1]
    large = int(np.prod(tensor.shape)) >= (
        FAST_EXPERT_VALUES if "_exps." in tensor.name else FAST_MATRIX_VALUES
    )
    if ggml_type in DECODE_ONLY_TYPES:
        return _iquant_slabs(tensor.shape, ggml_type, seed, SLAB_VALUES if large else None)
    if not large or len(tensor.shape) < 2:
        return None
    if ggml_type in FAST_TYPES:
        return random_block_slabs(tensor.shape, ggml_type, seed)
    if ggml_type in (F32, F16):
        std = 1.0 if tensor.name == "token_embd.weight" else None
        return _float_slabs(tensor.shape, seed, std, np.float32 if ggml_type == F32 else np.float16)
    return None


def _rows_per_slab(shape: tuple[int, ...], slab_values: int) -> tuple[int, int]:
    """(rows, rows per slab) of a tensor seen as rows of shape[-1] values."""
    rows = int(np.prod(shape[:-1]))
    return rows, max(1, slab_values // shape[-1])


def _iquant_slabs(shape, ggml_type: int, seed: list[int], slab_values: int | None) -> Iterator[np.ndarray]:
    """Random valid i-quant blocks, the whole tensor at once or `slab_values` at a time."""
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(ggml_type).name
    if slab_values is None:
        yield random_blocks(name, shape, seed)
        return
    rows, step = _rows_per_slab(shape, slab_values)
    for index, start in enumerate(range(0, rows, step)):
        yield random_blocks(name, (min(step, rows - start), shape[-1]), [*seed, index])


def _float_slabs(shape, seed: list[int], std: float | None, dtype: type) -> Iterator[np.ndarray]:
    """`dtype` (float32, float16) rows of normal values (std 1/sqrt(row) unless given, as
    `initial_values` gives matrices)."""
    rng = np.random.default_rng(seed)
    scale = np.float32(std if std is not None else 1.0 / np.sqrt(shape[-1]))
    rows, step = _rows_per_slab(shape, SLAB_VALUES)
    for start in range(0, rows, step):
        slab = rng.standard_normal((min(step, rows - start), shape[-1]), dtype=np.float32)
        slab *= scale
        yield slab.astype(dtype, copy=False)
