"""Checkpoint profiles: which GGML types a checkpoint may hold.

`generic` accepts any type k3stream's quant kernels decode. `audited` enforces the published Kimi-K3
recipe (routed up/gate Q2_K, down Q3_K, MLA k_b Q4_0, v_b Q2_K) that sglang's expert-pack
path accepts; its k_b/v_b errors name the file and tensor, then give sglang's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from k3stream.quant.types import SUPPORTED_TYPES

if TYPE_CHECKING:
    from k3stream.gguf.tensors import TensorInventory

T = GGMLQuantizationType


@dataclass(frozen=True)
class ModelNumbers:
    """The dimensions an expert pack's runtime checks: layers, MoE layers, experts, top-k, widths."""

    n_layers: int
    moe_layers: tuple[int, ...]
    n_experts: int
    top_k: int
    hidden: int
    latent: int
    expert_ff: int


# the published Kimi-K3: what the audited profile enforces (sglang's expert-pack path hard-codes it)
AUDITED_MODEL = ModelNumbers(
    n_layers=93,
    moe_layers=tuple(range(1, 93)),
    n_experts=896,
    top_k=16,
    hidden=7168,
    latent=3584,
    expert_ff=3072,
)
# tensor suffix -> the type the audited recipe stores it in
AUDITED_RECIPE: dict[str, GGMLQuantizationType] = {
    "ffn_up_exps.weight": T.Q2_K,
    "ffn_gate_exps.weight": T.Q2_K,
    "ffn_down_exps.weight": T.Q3_K,
    "attn_k_b.weight": T.Q4_0,
    "attn_v_b.weight": T.Q2_K,
}
# sglang's message for split MLA layers whose k_b / v_b left the recipe
MLA_PROJECTION_ERRORS = {
    "attn_k_b.weight": "Kimi-K3 MLA K projection must remain GGUF Q4_0",
    "attn_v_b.weight": "Kimi-K3 MLA V projection must remain GGUF Q2_K",
}


def recipe_type(name: str) -> GGMLQuantizationType | None:
    """The audited recipe's type for tensor `name` (None: the recipe does not name it)."""
    return next((t for suffix, t in AUDITED_RECIPE.items() if name.endswith(suffix)), None)


def check_recipe(checkpoint: TensorInventory) -> list[str]:
    """Every deviation from the audited recipe, one line each (empty: the checkpoint follows it)."""
    deviations = []
    for name, info in checkpoint.tensors.items():
        expected = recipe_type(name)
        if expected is not None and info.ggml_type != expected:
            deviations.append(f"{name} is {info.type_name}, the audited recipe has {expected.name}")
    return deviations


class GenericProfile:
    name = "generic"

    def check(self, checkpoint: TensorInventory) -> None:
        for name, info in checkpoint.tensors.items():
            if info.ggml_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{info.path}: tensor {name} has GGML type {info.type_name} ({info.ggml_type}), "
                    "which k3stream cannot decode"
                )


class AuditedProfile(GenericProfile):
    name = "audited"

    def check(self, checkpoint: TensorInventory) -> None:
        super().check(checkpoint)
        self._check_mla_projections(checkpoint)
        deviations = check_recipe(checkpoint)
        if deviations:
            raise ValueError(
                f"{checkpoint.shards[0]}: not the audited Kimi-K3 recipe: {deviations[0]}"
                + (f" (and {len(deviations) - 1} more)" if len(deviations) > 1 else "")
            )

    @staticmethod
    def _check_mla_projections(checkpoint: TensorInventory) -> None:
        for layer in checkpoint.config.mla_layers:
            for suffix, message in MLA_PROJECTION_ERRORS.items():
                name = f"blk.{layer}.{suffix}"
                info = checkpoint.tensors.get(name)
                if info is not None and info.ggml_type != AUDITED_RECIPE[suffix]:
                    raise ValueError(f"{info.path}: tensor {name} is {info.type_name}: {message}")


PROFILES = {profile.name: profile for profile in (GenericProfile(), AuditedProfile())}


def get_profile(name: str) -> GenericProfile:
    profile = PROFILES.get(name)
    if profile is None:
        raise ValueError(f"unknown checkpoint profile {name!r} (choose {', '.join(PROFILES)})")
    return profile
