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
    """Serves routed experts from the checkpoint's files (no prefetch, no read-ahead, no limit).

    Each read takes the experts' bytes with `preadv` into one fresh buffer rather than viewing the map,
    so a GGUF that shrinks while the model runs fails the step with a clear error instead of killing
    the process (a mapped read past the end is a SIGBUS). With `keep` every expert read is kept and
    served from RAM from then on (when all the routed experts fit the memory: `k3stream.load`'s
    `expert_ram_mib`); else each fetch reads its experts again.
    """

    def __init__(self, checkpoint: K3Checkpoint, keep: bool = False) -> None:
        self.checkpoint = checkpoint
        self._roles: dict[int, list[tuple[str, int, int, tuple[int, int]]]] = {}
        # layer -> expert -> its weights, read once (None: nothing is kept)
        self._kept: dict[int, dict[int, ExpertWeights]] | None = {} if keep else None

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        if self._kept is None:
            return self._read(layer, expert_ids)
        kept = self._kept.setdefault(layer, {})
        missing = [expert for expert in expert_ids if expert not in kept]
        if missing:
            kept.update(self._read(layer, missing))
        return {expert: kept[expert] for expert in expert_ids}

    def kept_bytes(self) -> int:
        """Bytes of the experts held in RAM (0 without `keep`)."""
        weights = [expert for experts in (self._kept or {}).values() for expert in experts.values()]
        return sum(getattr(expert, role).data.numel() for expert in weights for role in ROLES)

    def _read(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        roles = self._roles_of(layer)
        count = self.checkpoint.config.n_experts
        bad = [expert for expert in expert_ids if not 0 <= expert < count]
        if bad:
            raise IndexError(
                f"{self.checkpoint.shards[0]}: expert {bad[0]} outside 0..{count - 1} (layer {layer})"
            )
        parts = [(name, expert * size, size) for expert in expert_ids for name, size, *_ in roles]
        views = torch.from_numpy(self.checkpoint.read_parts(parts)).split([size for *_, size in parts])
        kinds = [(kind, shape) for *_, kind, shape in roles] * len(expert_ids)
        matrices = [ExpertMatrix(view, kind, shape) for view, (kind, shape) in zip(views, kinds, strict=True)]
        per = len(roles)
        return {
            expert: ExpertWeights(*matrices[per * i : per * (i + 1)]) for i, expert in enumerate(expert_ids)
        }

    def _roles_of(self, layer: int) -> list[tuple[str, int, int, tuple[int, int]]]:
        """Each routed tensor's name, bytes per expert, GGML type and (out, in), in ROLES order."""
        if layer not in self._roles:
            self._roles[layer] = [self._role(layer, role) for role in ROLES]
        return self._roles[layer]

    def _role(self, layer: int, role: str) -> tuple[str, int, int, tuple[int, int]]:
        name = routed_expert_name(layer, role)
        info = self.checkpoint.info(name)
        count, rows, cols = info.shape
        return name, info.nbytes // count, int(info.ggml_type), (int(rows), int(cols))
