"""The tensors a Kimi-K3 GGUF holds for a given config: names and numpy shapes `(out, in)`.

One table for both sides: the tiny generator writes exactly these tensors, and the reader checks a
checkpoint against them (llama.cpp's `kimi-k3` loader expects the same set).
"""

from __future__ import annotations

import re
from collections.abc import Container
from typing import Any

from k3stream.gguf.config import K3Config
from k3stream.quant.types import FLOAT_TYPE_IDS  # noqa: F401 (re-exported: the float types' ids)

Shape = tuple[int, ...]
MAX_DIMS = 4  # GGML's

# routed expert tensors, one per role and layer (the pack's order of the roles: `pack.format.ROLES`)
ROUTED_EXPERT_RE = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<role>up|gate|down)_exps\.weight$")
# Tensors llama.cpp's kimi-k3 loader treats as optional (TENSOR_NOT_REQUIRED): the reader accepts them
# missing, and the graph then skips them: the routed experts' norm, the MLA output gate (no gating), the
# shared experts (a MoE layer of routed experts alone; all three or none)
OPTIONAL_SUFFIXES = ("ffn_routed_norm.weight", "attn_gate.weight")
SHARED_EXPERT_SUFFIXES = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
# what `TinySpec.without` may leave out of a test model: the name of each optional group, its suffixes
OMITTABLE = {"attn_gate": ("attn_gate.weight",), "shexp": SHARED_EXPERT_SUFFIXES}
# attention-residual scores (attn_res_score, ffn_res_score, output_res_score): fused norm*proj vectors
RESIDUAL_SCORE_SUFFIX = "_res_score.weight"


def routed_expert_name(layer: int, role: str) -> str:
    return f"blk.{layer}.ffn_{role}_exps.weight"


def is_routed_expert(name: str) -> bool:
    return ROUTED_EXPERT_RE.match(name) is not None


def is_residual_score(name: str) -> bool:
    return name.endswith(RESIDUAL_SCORE_SUFFIX)


def check_residual_score(shape: tuple[int, ...]) -> None:
    """A residual score is a vector; sglang's loader's message, its shape in numpy order."""
    if len(shape) != 1:
        raise ValueError(f"Kimi-K3 attention-residual score must be a vector, got {tuple(shape)}")


def check_ssm_a(values: Any) -> None:
    """KDA's `ssm_a` holds llama.cpp's -exp(A_log): finite floats, every one negative (a
    tensor of another form would make the decay grow); sglang's loader's messages."""
    if not values.is_floating_point() or not values.isfinite().all():
        raise ValueError("Kimi-K3 GGUF ssm_a must contain finite floating values")
    if not (values < 0).all():
        raise ValueError("Kimi-K3 GGUF ssm_a must contain only -exp(A_log) values")


def _top_level(cfg: K3Config) -> dict[str, Shape]:
    e, v = cfg.hidden, cfg.vocab_size
    return {
        "token_embd.weight": (v, e),
        "output_norm.weight": (e,),
        "output_res_score.weight": (e,),
        "output.weight": (v, e),
    }


def _kda(cfg: K3Config) -> dict[str, Shape]:
    e, heads, d, inner = cfg.hidden, cfg.n_heads, cfg.kda_head_dim, cfg.kda_inner
    conv = (1, inner, 1, cfg.conv_kernel)
    return {
        "attn_q.weight": (inner, e),
        "attn_k.weight": (inner, e),
        "attn_v.weight": (inner, e),
        "ssm_conv1d_q.weight": conv,
        "ssm_conv1d_k.weight": conv,
        "ssm_conv1d_v.weight": conv,
        "ssm_f_a.weight": (d, e),
        "ssm_f_b.weight": (inner, d),
        "ssm_beta.weight": (heads, e),
        "ssm_a": (heads,),
        "ssm_dt.bias": (inner,),
        "ssm_g.weight": (inner, e),
        "ssm_norm.weight": (d,),
        "attn_output.weight": (e, inner),
    }


def _mla(cfg: K3Config, split_kv_b: bool) -> dict[str, Shape]:
    e, heads, qk = cfg.hidden, cfg.n_heads, cfg.qk_nope + cfg.qk_rope
    if cfg.q_lora is None:
        query = {"attn_q.weight": (heads * qk, e)}
    else:
        query = {
            "attn_q_a.weight": (cfg.q_lora, e),
            "attn_q_a_norm.weight": (cfg.q_lora,),
            "attn_q_b.weight": (heads * qk, cfg.q_lora),
        }
    if split_kv_b:
        kv_b = {
            "attn_k_b.weight": (heads, cfg.kv_lora, cfg.qk_nope),
            "attn_v_b.weight": (heads, cfg.v_head_dim, cfg.kv_lora),
        }
    else:
        kv_b = {"attn_kv_b.weight": (heads * (cfg.qk_nope + cfg.v_head_dim), cfg.kv_lora)}
    return {
        **query,
        "attn_kv_a_mqa.weight": (cfg.kv_lora + cfg.qk_rope, e),
        "attn_kv_a_norm.weight": (cfg.kv_lora,),
        **kv_b,
        "attn_gate.weight": (heads * cfg.v_head_dim, e),
        "attn_output.weight": (e, heads * cfg.v_head_dim),
    }


def _dense(cfg: K3Config) -> dict[str, Shape]:
    e, ff = cfg.hidden, cfg.dense_ff
    return {"ffn_gate.weight": (ff, e), "ffn_up.weight": (ff, e), "ffn_down.weight": (e, ff)}


def _moe(cfg: K3Config) -> dict[str, Shape]:
    e, x, f, lt = cfg.hidden, cfg.n_experts, cfg.expert_ff, cfg.latent
    shapes = {
        "ffn_gate_inp.weight": (x, e),
        "exp_probs_b.bias": (x,),
        "ffn_gate_exps.weight": (x, f, lt),
        "ffn_up_exps.weight": (x, f, lt),
        "ffn_down_exps.weight": (x, lt, f),
        "ffn_routed_down.weight": (lt, e),
        "ffn_routed_up.weight": (e, lt),
        "ffn_routed_norm.weight": (lt,),
    }
    if cfg.n_shared:
        shared = f * cfg.n_shared
        shapes |= {
            "ffn_gate_shexp.weight": (shared, e),
            "ffn_up_shexp.weight": (shared, e),
            "ffn_down_shexp.weight": (e, shared),
        }
    return shapes


def layer_shapes(cfg: K3Config, layer: int, split_kv_b: bool = True) -> dict[str, Shape]:
    e = cfg.hidden
    shapes = {
        "attn_norm.weight": (e,),
        "ffn_norm.weight": (e,),
        "attn_res_score.weight": (e,),
        "ffn_res_score.weight": (e,),
    }
    shapes |= _mla(cfg, split_kv_b) if cfg.is_mla(layer) else _kda(cfg)
    shapes |= _moe(cfg) if cfg.is_moe(layer) else _dense(cfg)
    return {f"blk.{layer}.{suffix}": shape for suffix, shape in shapes.items()}


def expected_shapes(cfg: K3Config, present: Container[str] = ()) -> dict[str, Shape]:
    """Every tensor the config implies, in the order the tiny generator writes them.

    MLA layers hold split `attn_k_b`/`attn_v_b` unless `present` names their unsplit `attn_kv_b`.
    """
    shapes = _top_level(cfg)
    for layer in range(cfg.n_layers):
        shapes |= layer_shapes(cfg, layer, split_kv_b=f"blk.{layer}.attn_kv_b.weight" not in present)
    return shapes


def accepted_shapes(name: str, shape: Shape) -> tuple[Shape, ...]:
    """The shapes llama.cpp accepts for a tensor whose canonical shape is `shape`: GGML ignores trailing
    dimensions of 1 (numpy's leading ones), up to its 4 dimensions, on vectors and matrices alike."""
    ones = tuple((1,) * extra + shape for extra in range(MAX_DIMS - len(shape) + 1))
    if "ssm_conv1d_" in name:
        return (*ones, shape[1:])  # quantizers drop the trailing ggml dimension of 1
    return ones


def canonical_shape(stored: Shape, shape: Shape) -> Shape:
    """`shape` for a tensor stored with GGML's trailing dimensions of 1 beyond it, else `stored`."""
    extra = len(stored) - len(shape)
    return shape if extra > 0 and stored == (1,) * extra + shape else stored


def is_optional(name: str) -> bool:
    return name.endswith(OPTIONAL_SUFFIXES + SHARED_EXPERT_SUFFIXES)


def check_shared_experts(layer: int, present: Container[str], source: str) -> None:
    """A MoE layer holds its shared experts' gate, up and down, or none of them (llama.cpp's graph
    takes the gate's presence for all three)."""
    names = [f"blk.{layer}.{suffix}" for suffix in SHARED_EXPERT_SUFFIXES]
    missing = [name for name in names if name not in present]
    if missing and len(missing) < len(names):
        raise ValueError(f"{source}: missing tensor {missing[0]} (a layer's shared experts need all three)")
