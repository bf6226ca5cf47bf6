"""Routed experts straight from the checkpoint: the `ExpertSource` used when there is no expert pack.

A source may also read an expert pack through a cache (the store); the model never reads routed expert
tensors from the checkpoint itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3stream.experts import ROLES, ExpertMatrix, ExpertSource, ExpertWeights
from k3stream.gguf.layout import routed_expert_name

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint


class GGUFExpertSource(ExpertSource):
    """Serves routed experts from the checkpoint's files (no cache: no prefetch, no read-ahead, no limit).

    Each fetch reads the experts' bytes with `preadv` into one fresh buffer rather than viewing the map,
    so a GGUF that shrinks while the model runs fails the step with a clear error instead of killing
    the process (a mapped read past the end is a SIGBUS).
    """

    def __init__(self, checkpoint: K3Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._roles: dict[tuple[int, str], tuple[str, int, int, tuple[int, int]]] = {}

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        roles = [self._role(layer, role) for role in ROLES]
        count = self.checkpoint.config.n_experts
        bad = [expert for expert in expert_ids if not 0 <= expert < count]
        if bad:
            raise IndexError(
                f"{self.checkpoint.shards[0]}: expert {bad[0]} outside 0..{count - 1} (layer {layer})"
            )
        parts = [(name, expert * size, size) for expert in expert_ids for name, size, *_ in roles]
        data = torch.from_numpy(self.checkpoint.read_parts(parts))
        views = iter(data.split([size for *_, size in parts]))
        return {
            expert: ExpertWeights(*(ExpertMatrix(next(views), kind, shape) for _, _, kind, shape in roles))
            for expert in expert_ids
        }

    def _role(self, layer: int, role: str) -> tuple[str, int, int, tuple[int, int]]:
        """One routed tensor's name, bytes per expert, GGML type and (out, in)."""
        key = (layer, role)
        if key not in self._roles:
            name = routed_expert_name(layer, role)
            info = self.checkpoint.info(name)
            count, rows, cols = info.shape
            self._roles[key] = (name, info.nbytes // count, int(info.ggml_type), (int(rows), int(cols)))
        return self._roles[key]
