"""Real-dimension slices: `TinySpec`s with a released model's shapes, for N of its layers.

`like("kimi-k3", n_layers=2, n_experts=8)` is Kimi-K3 as released (docs/real-model.md) cut to its first
layers: layer 0 dense, the later ones MoE, MLA every 4th layer counted from 1 and on the last layer (a
slice ends with an MLA layer, as the model does), every matrix at its real shape. Overrides make
smaller test slices at the same matrix shapes (fewer experts, a real-size vocabulary). The default
recipe is release-like: non-expert matrices Q8_0, routed experts in the audited Q2_K/Q3_K; with a mixed
recipe (i-quants, ternary, dynamic) its experts' types, the other matrices quantized as its releases
store them (`mixed_recipes.release_like`).
"""

from __future__ import annotations

from typing import Any

from k3stream.gguf.writer import TinySpec

KIMI_K3: dict[str, Any] = dict(
    hidden=7168,
    n_dense=1,
    dense_ff=18432,
    kda_heads=96,
    kda_head_dim=128,
    conv_kernel=4,
    gate_lower_bound=-5.0,
    mla_heads=96,
    q_lora=1536,
    kv_lora=512,
    qk_nope=128,
    qk_rope=64,
    v_head_dim=128,
    n_experts=896,
    top_k=16,
    expert_ff=3072,
    latent=3584,
    n_shared=2,
    block_size=12,
    situ_beta=4.0,
    situ_linear_beta=25.0,
    rms_eps=1e-5,
    context_length=4096,
    recipe="q8_0",
    release_matrices=True,
)
REAL_LAYERS = {"kimi-k3": 93}
LIKE = {"kimi-k3": KIMI_K3}
REAL_VOCAB = {"kimi-k3": 163840}


def like(model: str, n_layers: int, **overrides: Any) -> TinySpec:
    """The first `n_layers` layers of `model` at its real shapes, `overrides` (TinySpec fields) applied.

    With fewer experts than the model routes to, top-k shrinks to the expert count unless given."""
    if model not in LIKE:
        raise ValueError(f"like: unknown model {model!r}; one of {', '.join(LIKE)}")
    if not 2 <= n_layers <= REAL_LAYERS[model]:
        raise ValueError(f"--like {model}: --layers {n_layers} must be in 2..{REAL_LAYERS[model]}")
    fields = {**LIKE[model], "n_layers": n_layers, **overrides}
    if not 1 <= fields["n_experts"] <= LIKE[model]["n_experts"]:
        raise ValueError(
            f"--like {model}: --experts {fields['n_experts']} must be in 1..{LIKE[model]['n_experts']}, "
            "the model's routed experts"
        )
    if "top_k" not in overrides:
        fields["top_k"] = min(fields["top_k"], fields["n_experts"])
    return TinySpec(**fields)
