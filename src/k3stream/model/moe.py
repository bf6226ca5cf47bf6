"""Feed-forward blocks: the dense MLP of the first layers and the latent MoE of the rest."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3stream.experts import ExpertSource
from k3stream.model.layers import Linear, rms_norm, situ
from k3stream.quant.kernels import expert_mlp

# a step of at least twice this many experts is fetched in parts, the next part read while one computes
READ_AHEAD_MIN_EXPERTS = 4
# llama.cpp clamps the sum of the chosen weights from below before renormalising
MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass
class SituMLP:
    """down(situ(gate(x), up(x))): the dense layers and the shared experts."""

    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    beta: float
    linear_beta: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        activated = situ(self.gate_proj(h).float(), self.up_proj(h).float(), self.beta, self.linear_beta)
        return self.down_proj(activated)


@dataclass
class MoEWeights:
    router: Linear  # E -> X
    correction_bias: torch.Tensor  # [X]
    routed_down: Linear  # E -> latent
    routed_up: Linear  # latent -> E
    routed_norm: torch.Tensor | None
    shared: SituMLP | None


@dataclass(frozen=True)
class Routing:
    top_k: int
    normalize: bool
    scale: float

    def choose(
        self, router: Linear, bias: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [N, k] and their weights [N, k]: sigmoid scores, the bias only picks."""
        probs = torch.sigmoid(router(h).float())
        chosen = torch.topk(probs + bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
        return chosen, weights * self.scale


class LatentMoE:
    """Route in full width, run the routed experts in the latent space, add the shared experts."""

    def __init__(
        self,
        layer: int,
        weights: MoEWeights,
        source: ExpertSource,
        routing: Routing,
        beta: float,
        linear_beta: float,
        eps: float,
        match_ggml: bool = False,
        backend: str = "auto",
    ) -> None:
        self.layer = layer
        self.w = weights
        self.source = source
        self.routing = routing
        self.beta = beta
        self.linear_beta = linear_beta
        self.eps = eps
        self.match_ggml = match_ggml
        self.backend = backend
        # (latent [N, L], chosen [N, k]) -> the [N * k, L] pair outputs; expert parallelism
        # (`k3stream.parallel.experts`) wraps it to run only its rank's experts and exchange the rest
        self.routed_pairs = self._routed_pairs
        self.chosen = torch.empty(0, routing.top_k, dtype=torch.long)

    def predict(self, h: torch.Tensor) -> list[int]:
        """The experts this layer would pick for rows h (the prefetch hint)."""
        chosen, _ = self.routing.choose(self.w.router, self.w.correction_bias, h)
        return chosen.unique().tolist()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, E] -> [N, E]; the union of the experts all rows chose, fetched once each."""
        chosen, weights = self.routing.choose(self.w.router, self.w.correction_bias, h)
        self.chosen = chosen  # the step's choices [N, k], for whoever scores predictions of them
        if self.source.reads_ahead:  # the first part is read while the projections below compute
            ids = np.unique(chosen.flatten().cpu().numpy())
            self.source.read_ahead(self.layer, ids[: self._fetch_group(len(ids), True)].tolist())
        latent = self.w.routed_down(h).float()
        shared = self.w.shared(h).float() if self.w.shared is not None else None
        pair_outputs = self.routed_pairs(latent, chosen)
        routed = (pair_outputs.view(*chosen.shape, -1) * weights[..., None]).sum(1)
        if self.w.routed_norm is not None:
            routed = rms_norm(routed, self.w.routed_norm, self.eps)
        out = self.w.routed_up(routed).float()
        return out if shared is None else out + shared

    def _routed_pairs(self, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The expert output of every (row, choice) pair, [N * k, latent].

        Pairs are sorted by expert; a cache smaller than one step's union serves it in groups of
        `max_experts_per_fetch`. A pair's output depends only on its row and its expert (the kernel
        computes each output on its own), so a streamed run equals an all-resident run bit for bit
        at any cache size.
        """
        pair_experts = chosen.flatten().cpu().numpy()  # tiny index arrays: numpy is cheaper here
        order = np.argsort(pair_experts, kind="stable")
        ids, counts = np.unique(pair_experts, return_counts=True)  # sorted, as `order` is
        bounds = np.concatenate([[0], np.cumsum(counts)])
        rows = torch.from_numpy(order // chosen.shape[1])
        reads_ahead = self.source.reads_ahead
        group = self._fetch_group(len(ids), reads_ahead)
        sorted_outputs = latent.new_empty(len(pair_experts), latent.shape[1])
        for start in range(0, len(ids), group):
            chunk = ids[start : start + group].tolist()
            experts = self.source.fetch(self.layer, chunk)
            if reads_ahead and start + group < len(ids):  # read the next part meanwhile
                self.source.read_ahead(self.layer, ids[start + group : start + 2 * group].tolist())
            first, last = int(bounds[start]), int(bounds[start + len(chunk)])
            sorted_outputs[first:last] = expert_mlp(
                latent,
                [experts[e] for e in chunk],
                torch.from_numpy(bounds[start : start + len(chunk) + 1] - first),
                rows[first:last],
                self._activation,
                self.match_ggml,
                self.backend,
            )
        pair_outputs = torch.empty_like(sorted_outputs)
        pair_outputs[torch.from_numpy(order).to(latent.device)] = sorted_outputs
        return pair_outputs

    def _fetch_group(self, count: int, reads_ahead: bool) -> int:
        """Experts per fetch: what the cache can hold; a source that reads ahead (the store) gets the
        step in parts of at most half that, so the next part is read while this one is computed."""
        slots = self.source.max_experts_per_fetch or count
        if not reads_ahead or count < 2 * READ_AHEAD_MIN_EXPERTS:
            return slots
        return max(READ_AHEAD_MIN_EXPERTS, min(slots // 2, -(-count // 4)))

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ(gate, up, self.beta, self.linear_beta)
