"""Expert parallelism: each rank owns a contiguous block of every MoE layer's routed experts.

**Partition.** Rank r of N owns experts [r X/N, (r+1) X/N) of every layer (X experts; N must divide X).
Expert ids carry no meaning a router could exploit (an expert's popularity is not tied to its index),
so contiguous blocks balance as well as any fixed split, and in a pack (layer-major, expert-ordered) a
rank's share of each layer is one contiguous byte range: its reads, its page cache and its disk
read-ahead never touch another rank's bytes.

**Exchange.** Every rank holds every row of a step (rank 0's tokens, the same on each rank; after the
tensor-parallel all-reduce too), so no input row travels: each rank runs the (row, expert) pairs of its
own experts, and only those pair outputs are exchanged (one all-gather of [pairs of the busiest rank,
latent] per MoE layer and step). Each rank then combines every pair exactly as one process does, so a
MoE output is bit-identical to the single-process one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from k3stream.engine.parallel.groups import collective
from k3stream.experts import ExpertSource, ExpertWeights
from k3stream.model.k3 import K3Model
from k3stream.model.moe import LatentMoE

PairRunner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_partition(n_experts: int, rank: int, world: int) -> range:
    """The experts rank `rank` of `world` owns in every MoE layer."""
    if n_experts % world:
        raise ValueError(f"{n_experts} routed experts cannot be split over {world} expert-parallel ranks")
    share = n_experts // world
    return range(rank * share, (rank + 1) * share)


class OwnedExperts:
    """An expert source limited to this rank's experts: prefetch and read-ahead hints are filtered to
    them, and a fetch of another rank's expert is an error (so no rank ever reads another's bytes)."""

    def __init__(self, source: ExpertSource, owned: range) -> None:
        self.source = source
        self.owned = owned
        self.prefetches, self.reads_ahead = source.prefetches, source.reads_ahead
        self.max_experts_per_fetch = source.max_experts_per_fetch

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        foreign = [e for e in expert_ids if e not in self.owned]
        if foreign:
            raise ValueError(
                f"expert {foreign[0]} of layer {layer} belongs to another rank "
                f"(this one owns {self.owned.start}..{self.owned.stop - 1})"
            )
        return self.source.fetch(layer, expert_ids)

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        self.source.prefetch(layer, [e for e in expert_ids if e in self.owned])

    def read_ahead(self, layer: int, expert_ids: list[int]) -> None:
        self.source.read_ahead(layer, [e for e in expert_ids if e in self.owned])

    def resident(self, layer: int) -> None:
        """None: a rank computes its own experts through its exchange, never all of a layer's."""
        return None

    def object_roles(self, layer: int) -> None:
        """None: a rank's step goes through its exchange, which fetches."""
        return None

    def __getattr__(self, name: str) -> Any:  # stats, pack, ...
        return getattr(self.source, name)


class ExpertExchange:
    """`LatentMoE.routed_pairs` over ranks: this rank's pairs computed here, the others' received."""

    def __init__(self, local: PairRunner, owner_width: int, rank: int, world: int) -> None:
        self.local = local
        self.owner_width = owner_width  # experts per rank
        self.rank = rank
        self.world = world
        self.sent_bytes = 0  # pair outputs this rank sent (padding included)

    def __call__(self, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        pair_experts = chosen.flatten()
        owners = pair_experts // self.owner_width
        counts = torch.bincount(owners, minlength=self.world).tolist()
        mine = (owners == self.rank).nonzero().flatten()
        padded = latent.new_zeros(max(counts), latent.shape[1])
        if len(mine):  # each own pair as a row of its own: the kernel's outputs depend on row and expert
            rows = mine // chosen.shape[1]
            padded[: len(mine)] = self.local(latent[rows], pair_experts[mine].view(-1, 1))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        collective("the expert exchange", dist.all_gather, parts, padded)
        self.sent_bytes += padded.numel() * padded.element_size()
        outputs = latent.new_empty(len(pair_experts), latent.shape[1])
        for owner, (received, count) in enumerate(zip(parts, counts, strict=True)):
            outputs[(owners == owner).nonzero().flatten()] = received[:count]
        return outputs


def apply_expert_parallel(model: K3Model, rank: int, world: int) -> list[ExpertExchange]:
    """Give every MoE layer of `model` this rank's experts and the exchange; returns the exchanges."""
    owned = expert_partition(model.config.n_experts, rank, world)
    model.expert_source = OwnedExperts(model.expert_source, owned)
    exchanges = []
    for layer in model.layers:
        if isinstance(layer.ffn, LatentMoE):
            layer.ffn.source = model.expert_source
            exchange = ExpertExchange(layer.ffn.routed_pairs, len(owned), rank, world)
            layer.ffn.routed_pairs = exchange
            exchanges.append(exchange)
    return exchanges
