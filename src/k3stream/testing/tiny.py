"""Tiny random Kimi-K3 GGUFs for tests, benchmarks and the demo (`gguf.writer` with the built-in vocabulary).

`make_tiny(out_dir, TinySpec(...))` writes random weights (`gguf.writer.initial_values`). Large
routed-expert tensors (Q2_K/Q3_K, at least `FAST_EXPERT_VALUES` values) are random valid blocks instead
(`testing.tinyblocks`), so multi-GB benchmark models are written at close to disk speed.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from k3stream.gguf.vocab import Vocab, padded
from k3stream.gguf.writer import TinySpec, write_model
from k3stream.quant import IQUANT_TYPES
from k3stream.testing.iquant_blocks import random_blocks
from k3stream.testing.tinyblocks import FAST_TYPES, random_block_slabs
from k3stream.testing.tinyvocab import tiny_vocab

# Routed-expert tensors of at least this many values are written as random valid blocks (seconds per GB)
# instead of quantized random floats (minutes per GB). Test models stay far below it, so their bytes, and
# the property that every recipe quantizes the same float values, do not change.
FAST_EXPERT_VALUES = 1 << 27


def make_tiny(
    out_dir: str | os.PathLike[str],
    spec: TinySpec,
    vocab: Vocab | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a tiny Kimi-K3 GGUF into `out_dir`; return the file (or shard 1) path.

    Random weights and the built-in vocabulary unless given: `vocab` and `weights` (float32 values of
    every tensor by GGUF name, in its numpy shape: a trained model)."""
    if vocab is None:
        vocab = tiny_vocab() if spec.vocab is None else padded(tiny_vocab(), spec.vocab)
    return write_model(out_dir, spec, vocab, weights, _random_blocks if weights is None else None)


def _random_blocks(tensor, spec: TinySpec, ggml_type: int) -> Iterator[np.ndarray] | None:
    """Random valid blocks: in slabs for a large routed-expert tensor, whole for a type k3stream cannot
    encode (the i-quants, the ternary types); None for any other."""
    seed = [spec.seed, zlib.crc32(tensor.name.encode()), 1]
    if ggml_type in IQUANT_TYPES:
        from gguf import GGMLQuantizationType

        return iter([random_blocks(GGMLQuantizationType(ggml_type).name, tensor.shape, seed)])
    if "_exps." not in tensor.name or ggml_type not in FAST_TYPES:
        return None
    if int(np.prod(tensor.shape)) < FAST_EXPERT_VALUES:
        return None
    return random_block_slabs(tensor.shape, ggml_type, seed)
