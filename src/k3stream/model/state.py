"""The model's layer and state types: what `k3.K3Model` is built from and what a sequence carries
between calls, and `DecodedModel`, what a decode program (`program.DecodeProgram`) reads of a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from k3stream.gguf.config import K3Config
from k3stream.model.kda import KDA, KDAState
from k3stream.model.layers import GGUFTensor, Linear, bytes_to_matrix
from k3stream.model.mla import MLA, MLAState
from k3stream.model.moe import LatentMoE, SituMLP
from k3stream.model.options import LoadOptions
from k3stream.quant.kernels import F32, cpu

AttentionState = KDAState | MLAState


@dataclass
class Layer:
    index: int
    attn: KDA | MLA
    ffn: SituMLP | LatentMoE
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attn_score: torch.Tensor  # fused residual score: proj * norm
    ffn_score: torch.Tensor


@dataclass
class SequenceState:
    """Everything one sequence carries between calls: one attention state per layer."""

    layers: list[AttentionState]
    length: int = 0


class Embedding:
    """Rows of the token table: kept as the GGUF stores it (float values in their own dtype, or blocks)
    and decoded row by row, so an F16 table stays F16 in memory; a dense table on the reference path."""

    def __init__(self, table: GGUFTensor, hidden: int, options: LoadOptions) -> None:
        self.table = table if options.in_gguf_types else None
        self.dense = None if self.table else table.matrix((-1, hidden), options.torch_dtype)
        self.hidden = hidden

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense[tokens].float()
        rows = self.table.value.reshape(-1, self.table.value.shape[-1])[tokens]
        if self.table.ggml_type is None:  # float values (autograd follows them: the trainer's)
            return rows.reshape(len(tokens), self.hidden).float()
        return bytes_to_matrix(rows, self.table.ggml_type, (len(tokens), self.hidden))

    def row_writer(self, out: torch.Tensor) -> Callable[[int], object]:
        """A decode token's embedding: token -> its row into out [1, hidden]; a C decode of the row's
        blocks (the same values) where the table is on the CPU in a type with a decoder, else this
        call's."""
        if self.dense is not None:  # float32 rows are F32 blocks
            table, ggml_type = self.dense, F32 if self.dense.dtype == torch.float32 else None
        else:
            table, ggml_type = self.table.value, self.table.type_id
        in_c = (
            table.is_cpu
            and table.is_contiguous()
            and cpu.takes((out,))
            and cpu.decodes_row(ggml_type, self.hidden)
        )
        if not in_c:
            return lambda token: out.copy_(self(torch.tensor([token], device=out.device)))
        base, row_bytes, hidden = (
            table.data_ptr(),
            table.numel() * table.element_size() // table.shape[0],
            self.hidden,
        )
        return lambda token: cpu.decode_row(ggml_type, base + token * row_bytes, hidden, out)


class DecodedModel(Protocol):
    """The parts of a model a decode program binds (`k3.K3Model` has them)."""

    config: K3Config
    embedding: Embedding
    layers: list[Layer]
    norm: torch.Tensor
    output_score: torch.Tensor
    lm_head: Linear
    device: torch.device
    prefetch: bool
    prefetch_hint: str
    score_all_hints: bool
    eps: float
