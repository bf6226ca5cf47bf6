"""The routed-expert interface: the MoE asks a source for (layer, experts) and gets GGUF bytes back.

A source may read the GGUF (`GGUFExpertSource`, here) or an expert pack through a cache (the store).
The model never reads routed expert tensors from the checkpoint itself.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from k3stream.gguf.layout import routed_expert_name
from k3stream.model.layers import bytes_to_matrix

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
        from k3stream.quant import qlinear

        return qlinear(x, self.data, self.ggml_type, self.shape[0], self.shape[1])


def stack_dense(matrices: list[ExpertMatrix], device: torch.device | str = "cpu") -> torch.Tensor:
    """Float32 [n, out, in] on `device` of several matrices of one role (one dequantize call)."""
    first = matrices[0]
    if any(m.ggml_type != first.ggml_type or m.shape != first.shape for m in matrices):
        raise ValueError("stack_dense: matrices differ in GGML type or shape")
    data = torch.cat([m.data.reshape(-1) for m in matrices]).to(device)
    return bytes_to_matrix(data, first.ggml_type, (len(matrices), *first.shape))


class DenseExpertCache:
    """Dequantized float32 routed-expert matrices kept across steps, least recently used out first.

    Opt-in (`k3stream.load(..., expert_cache_mib=N)`): memory on top of, and not counted in, the
    expert source's byte budget. The source is still asked for every expert each step, so its
    traffic and counters do not change. Entries hold exactly what `stack_dense` computes (blocks
    dequantize independently), so a cached run equals an uncached one bit for bit.
    """

    def __init__(self, budget_mib: float) -> None:
        self.budget_bytes = int(budget_mib * 2**20)
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, str, int], torch.Tensor] = OrderedDict()

    def stack(
        self, layer: int, role: str, ids: list[int], experts: dict[int, ExpertWeights], device: torch.device
    ) -> torch.Tensor:
        """Float32 [len(ids), out, in] of `role` of each expert in `ids`, as `stack_dense` would give."""
        missing = [e for e in dict.fromkeys(ids) if (layer, role, e) not in self._entries]
        fresh = {}
        if missing:
            dense = stack_dense([getattr(experts[e], role) for e in missing], device)
            fresh = dict(zip(missing, dense, strict=True))
        self.misses += len(missing)
        self.hits += len(set(ids)) - len(missing)
        rows = [fresh[e] if e in fresh else self._entries[(layer, role, e)] for e in ids]
        for expert in dict.fromkeys(ids):
            if expert not in fresh:  # hits first: a fresh entry then evicts older ones, not these
                self._entries.move_to_end((layer, role, expert))
        for expert, matrix in fresh.items():
            self._store((layer, role, expert), matrix)
        return torch.stack(rows)

    def _store(self, key: tuple[int, str, int], fresh: torch.Tensor) -> None:
        """Keep a fresh matrix if it fits the budget, evicting the least recently used first."""
        size = fresh.numel() * fresh.element_size()
        if size > self.budget_bytes:
            return
        while self.used_bytes + size > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.numel() * evicted.element_size()
        self._entries[key] = fresh.clone()  # not a view: the evicted entry frees its own memory
        self.used_bytes += size


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
    """Serves expert slices straight from the checkpoint's memory map (no cache, no prefetch)."""

    def __init__(self, checkpoint: K3Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._roles: dict[tuple[int, str], tuple[torch.Tensor, int, tuple[int, int]]] = {}

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        roles = [self._role(layer, role) for role in ROLES]
        count = roles[0][0].shape[0]
        bad = [expert for expert in expert_ids if not 0 <= expert < count]
        if bad:
            raise IndexError(
                f"{self.checkpoint.shards[0]}: expert {bad[0]} outside 0..{count - 1} (layer {layer})"
            )
        return {
            expert: ExpertWeights(
                *(ExpertMatrix(data[expert], type_id, shape) for data, type_id, shape in roles)
            )
            for expert in expert_ids
        }

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        return None

    def _role(self, layer: int, role: str) -> tuple[torch.Tensor, int, tuple[int, int]]:
        """One routed tensor as [experts, bytes per expert] over the map, its type and (out, in)."""
        key = (layer, role)
        if key not in self._roles:
            name = routed_expert_name(layer, role)
            info = self.checkpoint.info(name)
            count, rows, cols = info.shape
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only map: the model never writes it
                data = torch.from_numpy(self.checkpoint.raw(name)).view(count, -1)
            self._roles[key] = (data, int(info.ggml_type), (int(rows), int(cols)))
        return self._roles[key]
