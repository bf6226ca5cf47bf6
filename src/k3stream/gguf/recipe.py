"""A checkpoint's quantization recipe per MoE layer and role, and what it implies for streaming.

A decode token reads, uncached, its top-k experts' objects in every MoE layer, its own row of
`token_embd` and every other non-expert weight whole: those bytes are the disk-bound decode rate, and
the bits per weight say how much of the model fits in the same RAM.
"""

from __future__ import annotations

import math
from typing import Any

from k3stream.gguf.layout import is_routed_expert, routed_expert_name

ROLES = ("gate", "up", "down")


def _elements(info: Any) -> int:
    return math.prod(int(n) for n in info.shape)


def _bits_per_weight(nbytes: int, elements: int) -> float:
    return round(8 * nbytes / elements, 4) if elements else 0.0


def expert_layers(checkpoint: Any) -> list[dict[str, Any]]:
    """Per MoE layer: each role's type, bytes per expert and bits per weight, and the layer's expert
    object (up + gate + down of one expert)."""
    experts = checkpoint.config.n_experts
    rows = []
    for layer in checkpoint.config.moe_layers:
        infos = {role: checkpoint.tensors[routed_expert_name(layer, role)] for role in ROLES}
        roles = {
            role: {
                "type": info.type_name,
                "expert_bytes": info.nbytes // experts,
                "bits_per_weight": _bits_per_weight(info.nbytes, _elements(info)),
            }
            for role, info in infos.items()
        }
        object_bytes = sum(role["expert_bytes"] for role in roles.values())
        rows.append({"layer": layer, "roles": roles, "object_bytes": object_bytes})
    return rows


def recipe_report(checkpoint: Any) -> dict[str, Any]:
    """The recipe per MoE layer and role, bits per weight (experts, the rest, all) and the bytes a
    decode token reads uncached: top-k expert objects of every MoE layer plus the non-expert weights,
    of which `token_embd` counts one row."""
    tensors = checkpoint.tensors.values()
    routed = [info for info in tensors if is_routed_expert(info.name)]
    others = [info for info in tensors if not is_routed_expert(info.name)]
    layers = expert_layers(checkpoint)
    non_expert_bytes = sum(info.nbytes for info in others)
    embd = checkpoint.tensors["token_embd.weight"]
    embd_row = embd.nbytes // embd.shape[0]  # a token looks up one row of [vocab, hidden]
    read_non_expert = non_expert_bytes - embd.nbytes + embd_row
    top_k = checkpoint.config.top_k
    expert_bytes_per_token = top_k * sum(row["object_bytes"] for row in layers)
    return {
        "moe_layers": layers,
        "bits_per_weight": {
            "routed_experts": _bits_per_weight(sum(i.nbytes for i in routed), sum(map(_elements, routed))),
            "non_expert": _bits_per_weight(non_expert_bytes, sum(map(_elements, others))),
            "all": _bits_per_weight(sum(i.nbytes for i in tensors), sum(map(_elements, tensors))),
        },
        "bytes_per_token_uncached": {
            "experts": expert_bytes_per_token,
            "non_expert": read_non_expert,
            "token_embd_row": embd_row,
            "total": expert_bytes_per_token + read_non_expert,
            "top_k": top_k,
        },
    }


def recipe_lines(report: dict[str, Any]) -> list[str]:
    """`inspect`'s text for `recipe_report`: runs of MoE layers with one recipe, then the totals."""
    lines = ["recipe (routed experts: gate / up / down, bits per weight, bytes per expert object):"]
    for first, last, row in _runs(report["moe_layers"]):
        span = f"layer {first}" if first == last else f"layers {first}-{last}"
        roles = " / ".join(f"{r['type']} {r['bits_per_weight']:.2f}" for r in row["roles"].values())
        lines.append(f"  {span}: {roles}  ({row['object_bytes']:,} B)")
    bits, per_token = report["bits_per_weight"], report["bytes_per_token_uncached"]
    lines.append(
        f"bits per weight: routed experts {bits['routed_experts']:.3f}, non-expert {bits['non_expert']:.3f}, "
        f"all {bits['all']:.3f}"
    )
    lines.append(
        f"bytes per token uncached: {per_token['total']:,} (top-{per_token['top_k']} experts "
        f"{per_token['experts']:,} + non-expert {per_token['non_expert']:,}; token_embd: one row of "
        f"{per_token['token_embd_row']:,} B)"
    )
    return lines


def _runs(layers: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """(first layer, last layer, row) for each run of consecutive MoE layers with the same recipe."""
    runs: list[tuple[int, int, dict[str, Any]]] = []
    for row in layers:
        if runs and runs[-1][2]["roles"] == row["roles"]:
            runs[-1] = (runs[-1][0], row["layer"], runs[-1][2])
        else:
            runs.append((row["layer"], row["layer"], row))
    return runs
