"""Routed experts straight from the checkpoint: the `ExpertSource` used when there is no expert pack.

A source may also read an expert pack through a cache (the store); the model never reads routed expert
tensors from the checkpoint itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3stream.experts import ROLES, ExpertMatrix, ExpertSource, ExpertWeights, ResidentRole
from k3stream.gguf.layout import routed_expert_name

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint


class GGUFExpertSource(ExpertSource):
    """Serves routed experts from the checkpoint's files (no prefetch, no read-ahead).

    Reads take the experts' bytes with `preadv` into fresh buffers rather than viewing the map, so a
    GGUF that shrinks while the model runs fails the step with a clear error instead of killing the
    process (a mapped read past the end is a SIGBUS). With `keep` every routed tensor is read into RAM
    once, here (one read per MoE layer; for when all of them fit the memory: `k3stream.load`'s
    `expert_ram_mib`) with each expert's views of it, which fetches hand out (made here: made in the
    first pass that routes to an expert, they would lengthen the first chunk of a prompt prefilled
    beside a stream whose decode steps routed to few experts); else each fetch reads its experts, with
    `budget_bytes` at most that many bytes of them (`max_experts_per_fetch`, never under top-k): a
    prefill step's experts then come in groups within the expert budget, not a whole layer's at once.
    """

    def __init__(self, checkpoint: K3Checkpoint, keep: bool = False, budget_bytes: int | None = None) -> None:
        self.checkpoint = checkpoint
        self._roles: dict[int, list[tuple[str, int, int, tuple[int, int]]]] = {}
        # layer -> its routed tensors' bytes (ROLES order), with `keep`; and the views handed out of them
        self._resident = (
            {layer: self._read_layer(layer) for layer in checkpoint.config.moe_layers} if keep else {}
        )
        if not keep and budget_bytes is not None and checkpoint.config.moe_layers:
            largest = max(self._expert_bytes(layer) for layer in checkpoint.config.moe_layers)
            self.max_experts_per_fetch = max(checkpoint.config.top_k, budget_bytes // largest)
        experts = range(checkpoint.config.n_experts)
        self._views: dict[int, dict[int, ExpertWeights]] = {
            layer: {expert: self._view(layer, expert) for expert in experts} for layer in self._resident
        }

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        views = self._views.get(layer)
        if views is None:
            return self._read(layer, expert_ids)
        if any(expert not in views for expert in expert_ids):
            self._check_ids(layer, expert_ids)
        return {expert: views[expert] for expert in expert_ids}

    def resident(self, layer: int) -> dict[str, ResidentRole] | None:
        tensors = self._resident.get(layer)
        if tensors is None:
            return None
        roles = zip(ROLES, tensors, self._roles_of(layer), strict=True)
        return {role: ResidentRole(data, size, kind, shape) for role, data, (_, size, kind, shape) in roles}

    def kept_bytes(self) -> int:
        """Bytes of the routed experts held in RAM (0 without `keep`)."""
        return sum(tensor.numel() for tensors in self._resident.values() for tensor in tensors)

    def _expert_bytes(self, layer: int) -> int:
        """The GGUF bytes of one of `layer`'s routed experts, every role."""
        return sum(size for _, size, *_ in self._roles_of(layer))

    def _read_layer(self, layer: int) -> list[torch.Tensor]:
        """`layer`'s routed tensors, whole, in one read."""
        parts = [
            (name, 0, size * self.checkpoint.config.n_experts) for name, size, *_ in self._roles_of(layer)
        ]
        return list(torch.from_numpy(self.checkpoint.read_parts(parts)).split([size for *_, size in parts]))

    def _view(self, layer: int, expert: int) -> ExpertWeights:
        roles = zip(self._resident[layer], self._roles_of(layer), strict=True)
        return ExpertWeights(
            *(
                ExpertMatrix(data[expert * size : (expert + 1) * size], kind, shape)
                for data, (_, size, kind, shape) in roles
            )
        )

    def _check_ids(self, layer: int, expert_ids: list[int]) -> None:
        count = self.checkpoint.config.n_experts
        bad = [expert for expert in expert_ids if not 0 <= expert < count]
        if bad:
            raise IndexError(
                f"{self.checkpoint.shards[0]}: expert {bad[0]} outside 0..{count - 1} (layer {layer})"
            )

    def _read(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        self._check_ids(layer, expert_ids)
        roles = self._roles_of(layer)
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
