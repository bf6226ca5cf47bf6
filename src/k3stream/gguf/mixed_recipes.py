"""The mixed recipes `gguf.writer` can write (`make-tiny --recipe`): the i-quant, ternary and per-layer
mixes users download.

A recipe gives each tensor a GGML type from its name and shape. Routed experts take the recipe's types
per role (gate, up, down), a "dynamic" recipe other types in each MoE layer (as unsloth's UD-Q2_K_XL
and UD-IQ2_XXS do). Vectors, the convolution kernels, the router and the token embedding stay F32. A
matrix takes a type only where its rows are whole blocks of it (256 values for the K- and i-quants, 32
for IQ4_NL and Q8_0, 64 for NVFP4), else the recipe's next type for narrower rows, else F32, as
llama.cpp's quantizer falls back for rows that do not fit. k3stream encodes none of the i-quant,
ternary or NVFP4 types: their tensors come from the caller (`testing.iquant_blocks` writes random
valid ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

EXPERT_ROLES = ("gate", "up", "down")
KEEP_F32 = ("token_embd.weight", "ffn_gate_inp.weight", "ssm_conv1d")


@dataclass(frozen=True)
class MixedRecipe:
    """Type names per expert role for each MoE layer in turn (cycled), and for other matrices."""

    expert_layers: tuple[tuple[str, str, str], ...]  # (gate, up, down) of the 1st, 2nd... MoE layer
    matrices: tuple[str, ...] = ()  # other matrices: the first type whose block fits the row
    file_type: str = "MOSTLY_Q2_K"  # general.file_type (gguf.LlamaFileType name)
    keep_f32: tuple[str, ...] = KEEP_F32  # name parts of matrices that stay F32


MIXED_RECIPES: dict[str, MixedRecipe] = {
    "iq2_xxs": MixedRecipe((("IQ2_XXS", "IQ2_XXS", "IQ2_XXS"),), file_type="MOSTLY_IQ2_XXS"),
    "iq1_s": MixedRecipe((("IQ1_S", "IQ1_S", "IQ1_M"),), file_type="MOSTLY_IQ1_S"),
    "ternary": MixedRecipe((("TQ1_0", "TQ1_0", "TQ2_0"),), file_type="MOSTLY_TQ1_0"),
    "iq4_xs": MixedRecipe((("IQ4_XS", "IQ4_XS", "IQ4_XS"),), ("IQ4_XS", "IQ4_NL"), "MOSTLY_IQ4_XS"),
    "nvfp4": MixedRecipe((("NVFP4", "NVFP4", "NVFP4"),), ("NVFP4", "Q8_0"), "MOSTLY_NVFP4"),
    "dynamic": MixedRecipe(
        (
            ("IQ3_S", "IQ3_S", "Q4_K"),
            ("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"),
            ("Q2_K", "Q2_K", "Q3_K"),
            ("IQ1_S", "IQ1_M", "IQ2_S"),
            ("IQ2_XS", "TQ2_0", "IQ4_XS"),
        ),
        ("Q6_K", "Q8_0"),
    ),
}

# Release-like files: the audited routed experts, every other matrix (the token table too) in one type
# as published quantizations store them; rows too narrow for it take the next type.
AUDITED_EXPERTS = (("Q2_K", "Q2_K", "Q3_K"),)
RELEASE_KEEP_F32 = ("ffn_gate_inp.weight", "ssm_conv1d")
RELEASE_RECIPES: dict[str, MixedRecipe] = {
    "q8_0": MixedRecipe(AUDITED_EXPERTS, ("Q8_0",), "MOSTLY_Q8_0", RELEASE_KEEP_F32),
    "q6_k": MixedRecipe(AUDITED_EXPERTS, ("Q6_K", "Q8_0"), "MOSTLY_Q6_K", RELEASE_KEEP_F32),
    "q4_k": MixedRecipe(AUDITED_EXPERTS, ("Q4_K", "Q8_0"), "MOSTLY_Q4_K_M", RELEASE_KEEP_F32),
}
WRITABLE_RECIPES = {**MIXED_RECIPES, **RELEASE_RECIPES}


def release_like(recipe: MixedRecipe) -> MixedRecipe:
    """`recipe` as a published file of it stores the matrices outside the routed experts: in the
    recipe's types, Q8_0 where it names none (the i-quant and ternary mixes), the token table too."""
    return replace(recipe, matrices=recipe.matrices or ("Q8_0",), keep_f32=RELEASE_KEEP_F32)


def _type_id(name: str) -> int:
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[name])


def _fits(type_name: str, width: int) -> bool:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return width % GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0] == 0


def expert_types(recipe: MixedRecipe, moe_index: int) -> dict[str, str]:
    """Role -> type name of the `moe_index`-th MoE layer (0 = the first MoE layer)."""
    layer = recipe.expert_layers[moe_index % len(recipe.expert_layers)]
    return dict(zip(EXPERT_ROLES, layer, strict=True))


def mixed_type(recipe: MixedRecipe, name: str, shape: tuple[int, ...], first_moe_layer: int) -> int:
    """The GGML type id `recipe` gives tensor `name` of numpy `shape`."""
    if "_exps." in name:
        layer = int(name.split(".")[1])
        role = name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
        return _type_id(expert_types(recipe, layer - first_moe_layer)[role])
    if len(shape) < 2 or any(part in name for part in recipe.keep_f32):
        return 0
    return next((_type_id(t) for t in recipe.matrices if _fits(t, shape[-1])), 0)


def file_type(recipe: MixedRecipe) -> int:
    from gguf.constants import LlamaFileType

    return int(LlamaFileType[recipe.file_type])
