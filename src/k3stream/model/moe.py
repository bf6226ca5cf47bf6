"""Feed-forward blocks: the dense MLP of the first layers and the latent MoE of the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3stream.model.experts import ExpertMatrix, ExpertSource, ExpertWeights, stack_dense
from k3stream.model.ggml_rounding import round_like_ggml
from k3stream.model.layers import Linear, rms_norm, situ

# llama.cpp clamps the sum of the chosen weights from below before renormalising
MIN_WEIGHT_SUM = 6.103515625e-5
# run all (row, choice) pairs batched when their gathered float32 expert weights fit in this
GATHER_LIMIT_BYTES = 48 << 20


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
    ) -> None:
        self.layer = layer
        self.w = weights
        self.source = source
        self.routing = routing
        self.beta = beta
        self.linear_beta = linear_beta
        self.eps = eps
        self.match_ggml = match_ggml

    def predict(self, h: torch.Tensor) -> list[int]:
        """The experts this layer would pick for rows h (the prefetch hint)."""
        chosen, _ = self.routing.choose(self.w.router, self.w.correction_bias, h)
        return chosen.unique().tolist()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, E] -> [N, E]; the union of the experts all rows chose, fetched once each."""
        chosen, weights = self.routing.choose(self.w.router, self.w.correction_bias, h)
        latent = self.w.routed_down(h).float()
        pair_outputs = self._routed_pairs(latent, chosen)
        routed = (pair_outputs.view(*chosen.shape, -1) * weights[..., None]).sum(1)
        if self.w.routed_norm is not None:
            routed = rms_norm(routed, self.w.routed_norm, self.eps)
        out = self.w.routed_up(routed).float()
        if self.w.shared is not None:
            out = out + self.w.shared(h).float()
        return out

    def _routed_pairs(self, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The expert output of every (row, choice) pair, [N * k, latent].

        A cache smaller than one step's union serves it in groups of `max_experts_per_fetch`. Each
        pair's output does not depend on the grouping (the kernel is chosen once for the whole step),
        so a streamed run equals an all-resident run bit for bit at any cache size.
        """
        expert_ids = chosen.unique().tolist()
        group = getattr(self.source, "max_experts_per_fetch", None) or len(expert_ids)
        pair_experts = chosen.flatten()
        pair_outputs = latent.new_empty(pair_experts.numel(), latent.shape[1])
        gathered = None
        for start in range(0, len(expert_ids), group):
            experts = self.source.fetch(self.layer, expert_ids[start : start + group])
            if gathered is None:
                first = next(iter(experts.values()))
                expert_floats = sum(m.shape[0] * m.shape[1] for m in (first.up, first.gate, first.down))
                gathered = pair_experts.numel() * expert_floats * 4 <= GATHER_LIMIT_BYTES
            pairs = torch.isin(pair_experts, torch.tensor(list(experts))).nonzero().flatten()
            run = self._pairs_gathered if gathered else self._pairs_per_expert
            pair_outputs[pairs] = run(latent, chosen.shape[1], pairs, pair_experts[pairs], experts)
        return pair_outputs

    def _pairs_per_expert(self, latent, top_k, pairs, pair_experts, experts: dict[int, ExpertWeights]):
        """Each expert once, on all the rows that chose it (prefill: many rows per expert)."""
        out = latent.new_empty(pairs.numel(), latent.shape[1])
        for expert, matrices in experts.items():
            mine = (pair_experts == expert).nonzero().flatten()
            x = latent[pairs[mine] // top_k]
            gate, up = self._apply(matrices.gate, x), self._apply(matrices.up, x)
            out[mine] = self._apply(matrices.down, situ(gate, up, self.beta, self.linear_beta))
        return out

    def _pairs_gathered(self, latent, top_k, pairs, pair_experts, experts: dict[int, ExpertWeights]):
        """All pairs in three batched matmuls (decode: about one row per expert)."""
        ids = pair_experts.tolist()

        def project(role: str, x: torch.Tensor) -> torch.Tensor:
            matrices = [getattr(experts[e], role) for e in ids]
            if self.match_ggml:
                x = round_like_ggml(x, matrices[0].ggml_type)
            return torch.bmm(x[:, None, :], stack_dense(matrices, x.device).transpose(1, 2))[:, 0]

        x = latent[pairs // top_k]
        return project("down", situ(project("gate", x), project("up", x), self.beta, self.linear_beta))

    def _apply(self, matrix: ExpertMatrix, x: torch.Tensor) -> torch.Tensor:
        if self.match_ggml:
            x = round_like_ggml(x, matrix.ggml_type)
        return matrix(x)
