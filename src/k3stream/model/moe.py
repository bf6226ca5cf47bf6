"""Feed-forward blocks: the dense MLP of the first layers and the latent MoE of the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3stream.model.experts import (
    ROLES,
    DenseExpertCache,
    ExpertMatrix,
    ExpertSource,
    ExpertWeights,
    stack_dense,
)
from k3stream.model.ggml_rounding import round_like_ggml
from k3stream.model.layers import FLOAT_TYPES, Linear, rms_norm, situ
from k3stream.quant.matmul import default_slab_rows

# llama.cpp clamps the sum of the chosen weights from below before renormalising
MIN_WEIGHT_SUM = 6.103515625e-5
# run all (row, choice) pairs batched when their gathered float32 expert weights fit in this
GATHER_LIMIT_BYTES = 48 << 20
# the per-expert path dequantizes experts in batches of at most this many float32 bytes (all roles)
DEQUANT_BATCH_BYTES = 8 << 20


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
        dense_cache: DenseExpertCache | None = None,
    ) -> None:
        self.layer = layer
        self.w = weights
        self.source = source
        self.routing = routing
        self.beta = beta
        self.linear_beta = linear_beta
        self.eps = eps
        self.match_ggml = match_ggml
        self.dense_cache = dense_cache

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
            run = self._pairs_gathered if gathered else self._pairs_per_expert
            if len(experts) == len(expert_ids):  # one fetch serves every pair, in order
                every = torch.arange(pair_experts.numel(), device=latent.device)
                return run(latent, chosen.shape[1], every, pair_experts, experts)
            pairs = torch.isin(pair_experts, torch.tensor(list(experts))).nonzero().flatten()
            pair_outputs[pairs] = run(latent, chosen.shape[1], pairs, pair_experts[pairs], experts)
        return pair_outputs

    def _pairs_per_expert(self, latent, top_k, pairs, pair_experts, experts: dict[int, ExpertWeights]):
        """Each expert once, on all the rows that chose it (prefill: many rows per expert).

        Experts are dequantized in batches of up to DEQUANT_BATCH_BYTES of float32 (one call per role
        and batch, not per expert) unless a matrix spans several qlinear slabs.
        """
        out = latent.new_empty(pairs.numel(), latent.shape[1])
        ids = list(experts)
        batch = self._dense_batch(experts[ids[0]])
        for start in range(0, len(ids), batch or len(ids)):
            chunk = ids[start : start + (batch or len(ids))]
            dense = (
                {role: self._stack(role, chunk, experts, latent.device) for role in ROLES} if batch else {}
            )
            for index, expert in enumerate(chunk):
                up, gate, down = (
                    (getattr(experts[expert], r), dense[r][index] if dense else None) for r in ROLES
                )
                mine = (pair_experts == expert).nonzero().flatten()
                x = latent[pairs[mine] // top_k]
                activated = situ(self._apply(*gate, x), self._apply(*up, x), self.beta, self.linear_beta)
                out[mine] = self._apply(*down, activated)
        return out

    def _pairs_gathered(self, latent, top_k, pairs, pair_experts, experts: dict[int, ExpertWeights]):
        """All pairs in three batched matmuls (decode: about one row per expert)."""
        ids = pair_experts.tolist()

        def project(role: str, x: torch.Tensor) -> torch.Tensor:
            if self.match_ggml:
                x = round_like_ggml(x, getattr(experts[ids[0]], role).ggml_type)
            return torch.bmm(x[:, None, :], self._stack(role, ids, experts, x.device).transpose(1, 2))[:, 0]

        x = latent[pairs // top_k]
        return project("down", situ(project("gate", x), project("up", x), self.beta, self.linear_beta))

    def _dense_batch(self, first: ExpertWeights) -> int:
        """Experts per batched dequantize on the per-expert path; 0: per-expert qlinear instead (float
        weights, which qlinear uses as they are, or a matrix spanning several qlinear slabs)."""
        matrices = [getattr(first, role) for role in ROLES]
        if any(m.ggml_type in FLOAT_TYPES or default_slab_rows(m.shape[1]) < m.shape[0] for m in matrices):
            return 0
        return max(1, DEQUANT_BATCH_BYTES // sum(4 * m.shape[0] * m.shape[1] for m in matrices))

    def _stack(self, role: str, ids: list[int], experts: dict[int, ExpertWeights], device) -> torch.Tensor:
        """Float32 [len(ids), out, in] of `role`: from the dense cache when there is one."""
        if self.dense_cache is not None:
            return self.dense_cache.stack(self.layer, role, ids, experts, device)
        return stack_dense([getattr(experts[e], role) for e in ids], device)

    def _apply(self, matrix: ExpertMatrix, dense: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T: over W's dequantized values `dense` (exactly qlinear's one slab) or via qlinear."""
        if self.match_ggml:
            x = round_like_ggml(x, matrix.ggml_type)
        return matrix(x) if dense is None else x @ dense.T
