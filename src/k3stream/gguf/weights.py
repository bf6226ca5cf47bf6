"""The non-expert tensors of a checkpoint, by GGUF name (what the model is built from), and sglang's
loader's exporter over them: `(runtime_name, tensor)` in sglang's names.

Routed expert tensors are skipped (they come from the expert pack). The exporter keeps quantized
tensors' GGUF bytes: `...weight` becomes `...qweight`, preceded by a uint8 `...qweight_type` holding
the GGML type id. A residual score s (stored fused as norm*proj) becomes proj `s.unsqueeze(0)` and
norm `ones_like(s)`; `ssm_a` (stored as -exp(A_log)) becomes `A_log`. Tensors stream shard by shard.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from k3stream.gguf.layout import FLOAT_TYPE_IDS, check_residual_score, check_ssm_a, is_routed_expert
from k3stream.quant.finite import non_finite_problem
from k3stream.quant.types import T

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.gguf.tensors import TensorInfo

_LAYER_RE = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<suffix>.+)$")

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_RESIDUAL_SCORES = {
    "output_res_score.weight": ("model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"),
}
_LAYER_RESIDUAL_SCORES = {
    "attn_res_score.weight": ("self_attention_res_proj.weight", "self_attention_res_norm.weight"),
    "ffn_res_score.weight": ("mlp_res_proj.weight", "mlp_res_norm.weight"),
}
_LAYER_NAMES = {
    # every layer
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_routed_down.weight": "mlp.routed_expert_down_proj.weight",
    "ffn_routed_norm.weight": "mlp.routed_expert_norm.weight",
    "ffn_routed_up.weight": "mlp.routed_expert_up_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # KDA layers
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "ssm_g.weight": "self_attn.g_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    # MLA layers; K and V use different GGUF types and stay apart
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_gate.weight": "self_attn.g_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_qweight",
    "attn_v_b.weight": "self_attn.v_b_qweight",
}


def checkpoint_targets(source_name: str) -> tuple[str, ...]:
    """The runtime parameter name(s) of one GGUF tensor (two for a residual score)."""
    if source_name in _RESIDUAL_SCORES:
        return _RESIDUAL_SCORES[source_name]
    if source_name in _TOP_LEVEL_NAMES:
        return (_TOP_LEVEL_NAMES[source_name],)
    match = _LAYER_RE.fullmatch(source_name)
    if match is None:
        raise KeyError(f"unsupported Kimi-K3 GGUF tensor name: {source_name}")
    prefix = f"model.layers.{int(match.group('layer'))}."
    suffix = match.group("suffix")
    if suffix in _LAYER_RESIDUAL_SCORES:
        return tuple(prefix + target for target in _LAYER_RESIDUAL_SCORES[suffix])
    target = _LAYER_NAMES.get(suffix)
    if target is None:
        raise KeyError(f"unsupported Kimi-K3 GGUF tensor name: {source_name}")
    return (prefix + target,)


def runtime_name(target: str, quantized: bool) -> str:
    if not quantized or not target.endswith(".weight"):
        return target
    return target.removesuffix("weight") + "qweight"


def residual_target_value(raw: torch.Tensor, target_index: int) -> torch.Tensor:
    """Target 0 (proj) is the fused score as a row, target 1 (norm) is ones: proj * norm == s exactly."""
    check_residual_score(tuple(raw.shape))
    if target_index == 0:
        return raw.unsqueeze(0)
    if target_index == 1:
        return torch.ones_like(raw)
    raise ValueError(f"invalid Kimi-K3 attention-residual target {target_index}")


def a_log_value(raw: torch.Tensor) -> torch.Tensor:
    """Undo llama.cpp's conversion-time A_log -> -exp(A_log)."""
    check_ssm_a(raw)
    return torch.log(-raw)


def tensor_weights(
    source_name: str, raw: torch.Tensor, ggml_type: int, emitted: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The runtime pairs of one non-routed GGUF tensor; `emitted` collects names across calls."""
    targets = checkpoint_targets(source_name)
    quantized = ggml_type not in FLOAT_TYPE_IDS
    for target_index, target in enumerate(targets):
        if source_name.endswith(".ssm_a"):
            value = a_log_value(raw)
        elif len(targets) == 2:
            value = residual_target_value(raw, target_index)
        else:
            value = raw
        name = runtime_name(target, quantized)
        _claim(name, emitted)
        if quantized:
            type_name = name.removesuffix("qweight") + "qweight_type"
            _claim(type_name, emitted)
            yield type_name, torch.tensor(ggml_type, dtype=torch.uint8)
        yield name, value


def _claim(name: str, emitted: set[str]) -> None:
    if name in emitted:
        raise ValueError(f"duplicate Kimi-K3 target parameter: {name}")
    emitted.add(name)


def nonexpert_tensors(checkpoint: K3Checkpoint, copy: bool = True) -> Iterator[tuple[str, torch.Tensor, int]]:
    """`(GGUF name, value, GGML type)` of every non-routed tensor, shard by shard in file order (values
    as `tensor_value` gives them)."""
    for name, info in checkpoint.tensors.items():
        if not is_routed_expert(name):
            yield name, tensor_value(checkpoint, name, copy), info.ggml_type


def nonexpert_weights(checkpoint: K3Checkpoint, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """sglang's loader's output for an open checkpoint: every non-routed tensor as `(runtime_name,
    tensor)` (`k3stream.nonexpert_weights` opens a path or manifest first). `copy=False` yields
    read-only views of the memory map instead of copies where no transform applies."""
    emitted: set[str] = set()
    for name, raw, ggml_type in nonexpert_tensors(checkpoint, copy):
        yield from tensor_weights(name, raw, ggml_type, emitted)


def check_finite(info: TensorInfo, raw: np.ndarray) -> None:
    """Refuse (one line naming the file, the tensor and the place) a tensor whose GGUF bytes `raw` hold a
    NaN or infinite value or scale, where llama.cpp's `--check-tensors` finds one."""
    problem = non_finite_problem(raw, info.ggml_type)
    if problem is not None:
        where = f"{info.path}: tensor {info.name} ({info.type_name})"
        raise ValueError(f"{where}: {problem}; the file is damaged")


def tensor_value(checkpoint: K3Checkpoint, name: str, copy: bool = True) -> torch.Tensor:
    """One tensor: float values in numpy shape, or GGUF bytes as uint8 rows of blocks; a copy read
    from the file into anonymous memory, or with `copy=False` a read-only view of the map."""
    info = checkpoint.info(name)
    raw = checkpoint.read(name) if copy else checkpoint.raw(name)
    if not name.endswith(".ssm_a"):  # ssm_a has sglang's loader's check (`check_ssm_a`)
        check_finite(info, raw)
    if info.ggml_type in FLOAT_TYPE_IDS:
        array = raw.view(checkpoint.array(name).dtype).reshape(info.shape)
    else:
        array = raw.reshape(*info.shape[:-1], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that a read-only view is read-only
        values = torch.from_numpy(array)
    return values.view(torch.bfloat16) if info.ggml_type == T.BF16 else values
