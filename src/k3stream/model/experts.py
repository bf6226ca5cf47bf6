"""The routed-expert interface: the MoE asks a source for (layer, experts) and gets GGUF bytes back.

A source may read the GGUF (`GGUFExpertSource`, here) or an expert pack through a cache (the store).
The model never reads routed expert tensors from the checkpoint itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint

ROLES = ("up", "gate", "down")


@dataclass(frozen=True)
class ExpertMatrix:
    """One role matrix of one expert: GGUF bytes (uint8), their GGML type id and (out, in) shape."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T, dequantizing the blocks."""
        from k3stream.quant.matmul import qlinear

        return qlinear(x, self.data, self.ggml_type, self.shape[0], self.shape[1])


@dataclass(frozen=True)
class ExpertWeights:
    up: ExpertMatrix
    gate: ExpertMatrix
    down: ExpertMatrix


@runtime_checkable
class ExpertSource(Protocol):
    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        """The weights of each requested expert of `layer` (one call per layer and step)."""
        ...

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        """A hint that these experts of `layer` are likely needed soon; may do nothing."""
        ...


def routed_tensor_name(layer: int, role: str) -> str:
    return f"blk.{layer}.ffn_{role}_exps.weight"


class GGUFExpertSource:
    """Serves expert slices straight from the checkpoint's memory map (no cache, no prefetch)."""

    def __init__(self, checkpoint: K3Checkpoint) -> None:
        self.checkpoint = checkpoint

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        return {expert: self._expert(layer, expert) for expert in expert_ids}

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        return None

    def _expert(self, layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights(*(self._matrix(layer, role, expert) for role in ROLES))

    def _matrix(self, layer: int, role: str, expert: int) -> ExpertMatrix:
        name = routed_tensor_name(layer, role)
        info = self.checkpoint.tensors[name]
        _count, rows, cols = info.shape
        # a copy: the map is read-only, and the copy is the read a streaming store would do anyway
        data = torch.from_numpy(np.array(self.checkpoint.expert_slice(name, expert)))
        return ExpertMatrix(data, int(info.ggml_type), (int(rows), int(cols)))
