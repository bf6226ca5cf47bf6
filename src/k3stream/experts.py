"""The routed-expert interface: the MoE asks a source for (layer, experts) and gets GGUF bytes back.

It sits beneath everything that serves or uses experts (gguf, pack, store, model): a source reads the
GGUF (`model.experts.GGUFExpertSource`) or an expert pack through a cache (the store). Callers use only
the members below; none probes a source for what it can do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from k3stream.quant.kernels import QWeight

if TYPE_CHECKING:
    import numpy as np
    import torch

ExpertMatrix = QWeight  # one role matrix of one expert: GGUF bytes, GGML type id, (out, in)

# a step of at most this many (row, expert) pairs is one group from any source (a decode token, a short
# chunk): one kernel call
MIN_GROUP_PAIRS = 1024
# a streamed step's group holds at most this share of its pairs: a warm 2,048-row pass of a 64-expert
# top-8 model took 2% longer in groups of a quarter of its pairs than in one group, 12% in eighths
GROUP_SHARE = 4


def group_pairs(rows: int, top_k: int) -> int:
    """The most (row, expert) pairs one group of a step of `rows` rows computes at once from a source
    with a fetch limit (`ExpertSource.max_experts_per_fetch`: the expert store, or the GGUF's experts
    when they are not kept in RAM): a quarter of the step's pairs (GROUP_SHARE), or `rows` (one
    expert's most: a row picks an expert once), or MIN_GROUP_PAIRS, whichever is largest, at most the
    step's. The expert kernel holds each pair's gate and up products for its group, so this bounds
    the largest buffers of a streamed step (`memlimit.ffn_floats` counts it)."""
    pairs = rows * top_k
    return min(pairs, max(-(-pairs // GROUP_SHARE), rows, MIN_GROUP_PAIRS))


@dataclass(frozen=True)
class ExpertWeights:
    up: ExpertMatrix
    gate: ExpertMatrix
    down: ExpertMatrix


ROLES = tuple(field.name for field in fields(ExpertWeights))


@dataclass(frozen=True)
class ResidentRole:
    """One role of a layer's experts, all in RAM: expert e's matrix is data[e * nbytes:(e + 1) * nbytes]
    (uint8 GGUF bytes of GGML type `ggml_type`, shape (out, in))."""

    data: torch.Tensor
    nbytes: int
    ggml_type: int
    shape: tuple[int, int]  # ("up", "gate", "down")


@dataclass(frozen=True)
class ObjectRole:
    """One role of a layer's experts, each expert in an object of its own (a store's slot): the role's
    matrix lies at `offset` in the object (uint8 GGUF bytes of GGML type `ggml_type`, shape (out, in))."""

    offset: int
    ggml_type: int
    shape: tuple[int, int]


@runtime_checkable
class ExpertSource(Protocol):
    """Routed experts by (layer, expert ids). The defaults describe a source that serves any fetch and
    ignores hints; a source subclasses this protocol to inherit them."""

    prefetches: bool = False  # whether `prefetch` does anything (else the model predicts nothing)
    reads_ahead: bool = False  # whether `read_ahead` does anything (and `ready` may leave some out)
    max_experts_per_fetch: int | None = None  # distinct experts one fetch may ask for; None: any

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        """The weights of each requested expert of `layer` (one call per layer and step)."""
        ...

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        """A hint that these experts of `layer` are likely needed soon."""
        return None

    def read_ahead(self, layer: int, expert_ids: list[int]) -> None:
        """These experts of `layer` are the caller's next fetches (the step it is computing): load
        them in the background, one after another, in this order."""
        return None

    def resident(self, layer: int) -> dict[str, ResidentRole] | None:
        """Every expert of `layer` by role when all of them sit in RAM for as long as the source lives
        (its fetches hand out views of these bytes), else None: the MoE then computes a decode step's
        experts straight from their addresses, without a fetch."""
        return None

    def object_roles(self, layer: int) -> dict[str, ObjectRole] | None:
        """Where each role's matrix lies in an expert's object of `layer`, for a source that can `hold`
        them, else None."""
        return None

    def hold(self, layer: int, expert_ids: list[int], objects: np.ndarray) -> bool:
        """The fetch of `expert_ids` (distinct) without views, where all of them sit in RAM now: pinned
        as a fetch pins them, until the calling thread's next fetch, and the address of each one's
        object written to `objects` [len(expert_ids)] (int64, in that order); else False, and nothing
        was pinned, counted or written (the caller fetches them)."""
        return False

    def ready(self, layer: int, expert_ids: list[int]) -> list[int]:
        """Those of `expert_ids` a fetch would serve now, without waiting for a read (in the given
        order); a source that reads nothing in the background has them all."""
        return list(expert_ids)
