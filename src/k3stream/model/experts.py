"""The routed-expert interface: the MoE asks a source for (layer, experts) and gets GGUF bytes back.

A source may read the GGUF (`GGUFExpertSource`, here) or an expert pack through a cache (the store).
The model never reads routed expert tensors from the checkpoint itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from k3stream.gguf.layout import routed_expert_name
from k3stream.quant.kernels import QWeight

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint

ROLES = ("up", "gate", "down")
ExpertMatrix = QWeight  # one role matrix of one expert: GGUF bytes, GGML type id, (out, in)


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


class GGUFExpertSource:
    """Serves routed experts from the checkpoint's files (no cache, no prefetch).

    Each fetch reads the experts' bytes with `preadv` into fresh buffers rather than viewing the map,
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
        return {expert: ExpertWeights(*(self._read(role, expert) for role in roles)) for expert in expert_ids}

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        return None

    def _read(self, role: tuple[str, int, int, tuple[int, int]], expert: int) -> ExpertMatrix:
        name, per_expert, type_id, shape = role
        data = torch.from_numpy(self.checkpoint.read(name, expert * per_expert, per_expert))
        return ExpertMatrix(data, type_id, shape)

    def _role(self, layer: int, role: str) -> tuple[str, int, int, tuple[int, int]]:
        """One routed tensor's name, bytes per expert, GGML type and (out, in)."""
        key = (layer, role)
        if key not in self._roles:
            name = routed_expert_name(layer, role)
            info = self.checkpoint.info(name)
            count, rows, cols = info.shape
            self._roles[key] = (name, info.nbytes // count, int(info.ggml_type), (int(rows), int(cols)))
        return self._roles[key]
