"""Tensor parallelism applied to a loaded K3Model from outside (as gpt-fast does): every rank keeps its
share of the attention heads and MLP width, in GGUF types, and the row-parallel outputs are all-reduced.

- KDA: heads (`model.kda.shard_kda_weights`); MLA: heads (q_b, k_b, v_b, the gate's rows where it has
  one; o_proj columns); the latent cache and kv_a stay whole on every rank (MLA's one shared latent head).
- dense and shared-expert MLPs: gate/up column-parallel, down row-parallel.
- lm_head: vocabulary-parallel (a share of the rows), all-gathered into the full logits.
Embedding, norms, residual scores, router and the MoE's routed down/up projections stay replicated.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.distributed as dist

from k3stream.engine.parallel.groups import collective
from k3stream.model.k3 import K3Model
from k3stream.model.kda import KDA, shard_kda_weights
from k3stream.model.layers import Linear
from k3stream.model.mla import MLA, HeadProjection
from k3stream.model.moe import LatentMoE, SituMLP
from k3stream.model.shard import input_columns, output_rows, part
from k3stream.model.state import Layer
from k3stream.quant.kernels import GroupedProduct, row_exact


class AllReduced:
    """A row-parallel layer: this rank's partial product, summed over the ranks. With row-exact products
    (a prompt cache) and more than two ranks the partials are gathered and summed in rank order: such an
    all-reduce sums an element in an order that depends on the tensor's size (its rows), so a restored
    prefix continued would not give the cold prefill's bits (two ranks add once: a + b = b + a)."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.out_features, self.in_features = linear.out_features, linear.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        if not row_exact() or dist.get_world_size() <= 2:
            collective("an all-reduce", dist.all_reduce, y)
            return y
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        collective("an all-gather", dist.all_gather, parts, y)
        total = parts[0]
        for partial in parts[1:]:
            total += partial
        return total


class VocabParallel:
    """lm_head over a share of the vocabulary per rank, all-gathered into [N, vocab] on every rank."""

    def __init__(self, linear: Linear, rank: int, world: int) -> None:
        vocab = linear.out_features
        self.bounds = [r * vocab // world for r in range(world + 1)]
        self.width = max(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))
        self.linear = output_rows(linear, slice(self.bounds[rank], self.bounds[rank + 1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).float()
        padded = local.new_zeros(*local.shape[:-1], self.width)
        padded[..., : local.shape[-1]] = local
        parts = [torch.empty_like(padded) for _ in self.bounds[1:]]
        collective("the logits' all-gather", dist.all_gather, parts, padded)
        pieces = [p[..., : b - a] for p, a, b in zip(parts, self.bounds, self.bounds[1:], strict=False)]
        return torch.cat(pieces, dim=-1)


def apply_tensor_parallel(model: K3Model, rank: int, world: int) -> K3Model:
    """Slice `model` in place to rank `rank` of `world` and wrap its row-parallel layers; returns it.
    A split that cannot be made is refused naming the GGUF layer or tensor ("blk.3.attn_output.weight")."""
    for layer in model.layers:
        prefix = f"blk.{layer.index}"
        layer.attn = _attention(layer, prefix, rank, world)
        if isinstance(layer.ffn, LatentMoE):
            if layer.ffn.w.shared is not None:
                layer.ffn.w.shared = _mlp(layer.ffn.w.shared, f"{prefix}.ffn_{{}}_shexp.weight", rank, world)
        else:
            layer.ffn = _mlp(layer.ffn, f"{prefix}.ffn_{{}}.weight", rank, world)
    model.lm_head = VocabParallel(model.lm_head, rank, world)
    return model


def _attention(layer: Layer, prefix: str, rank: int, world: int) -> KDA | MLA:
    attn = layer.attn
    if isinstance(attn, KDA):
        w = shard_kda_weights(attn.w, attn.heads, rank, world, prefix)
        w = replace(w, o_proj=AllReduced(w.o_proj))
        return KDA(w, attn.heads // world, attn.head_dim, attn.lower_bound, attn.eps)
    heads = part(attn.heads, rank, world, f"{prefix}: {attn.heads} MLA heads")
    w = attn.w
    q_width, v_width = attn.nope + attn.rope, w.o_proj.in_features // attn.heads
    o_proj = input_columns(w.o_proj, _scaled(heads, v_width), f"{prefix}.attn_output.weight", world)
    sharded = replace(
        w,
        q_b_proj=output_rows(w.q_b_proj, _scaled(heads, q_width)),
        k_b=_heads(w.k_b, heads),
        v_b=_heads(w.v_b, heads),
        g_proj=None if w.g_proj is None else output_rows(w.g_proj, _scaled(heads, v_width)),
        o_proj=AllReduced(o_proj),
    )
    return MLA(
        sharded, heads.stop - heads.start, attn.nope, attn.rope, attn.kv_lora, attn.eps, attn.ggml_order
    )


def _mlp(mlp: SituMLP, tensor: str, rank: int, world: int) -> SituMLP:
    """`tensor` is the GGUF name with `{}` for the role: "blk.0.ffn_{}.weight"."""
    rows = mlp.gate_proj.out_features
    width = part(rows, rank, world, f"{tensor.format('gate')}, {tensor.format('up')}: {rows} rows")
    return replace(
        mlp,
        gate_proj=output_rows(mlp.gate_proj, width),
        up_proj=output_rows(mlp.up_proj, width),
        down_proj=AllReduced(input_columns(mlp.down_proj, width, tensor.format("down"), world)),
    )


def _scaled(heads: slice, width: int) -> slice:
    return slice(heads.start * width, heads.stop * width)


def _heads(projection: HeadProjection, heads: slice) -> HeadProjection:
    """A per-head projection (k_b, v_b) holding only `heads`."""
    sharded = copy.copy(projection)
    sharded.heads = heads.stop - heads.start
    if projection.weight is not None:
        sharded.weight = projection.weight[heads].clone()
    own = projection.per_head
    if own is not None:
        weights = [replace(w, data=w.data.clone()) for w in own.weights[heads]]
        sharded.per_head = GroupedProduct(weights, own.backend, own.match_ggml)
    return sharded
