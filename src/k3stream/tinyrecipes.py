"""The mixed recipes of `make-tiny --recipe`: the i-quant, ternary and per-layer mixes users download.

A recipe gives each tensor a GGML type from its name and shape. Routed experts take the recipe's types
per role (gate, up, down), a "dynamic" recipe other types in each MoE layer (as unsloth's UD-Q2_K_XL
and UD-IQ2_XXS do). Vectors, the convolution kernels, the router and the token embedding stay F32. A
matrix takes a type only where its rows are whole blocks of it (256 values for the K- and i-quants, 32
for IQ4_NL and Q8_0), else the recipe's next type for narrower rows, else F32, as llama.cpp's quantizer
falls back for rows that do not fit.

The tensors of types k3stream cannot encode (the i-quants, the ternary types) are random valid blocks
(`random_blocks`): random codes (every grid index and sign pattern of the i-quants is valid, the
ternary codes are drawn from -1, 0, 1) under one fp16 scale that gives the decoded values the
standard deviation `k3stream.tiny` gives its float weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EXPERT_ROLES = ("gate", "up", "down")
KEEP_F32 = ("token_embd.weight", "ffn_gate_inp.weight", "ssm_conv1d")


@dataclass(frozen=True)
class MixedRecipe:
    """Type names per expert role for each MoE layer in turn (cycled), and for other matrices."""

    expert_layers: tuple[tuple[str, str, str], ...]  # (gate, up, down) of the 1st, 2nd... MoE layer
    matrices: tuple[str, ...] = ()  # other matrices: the first type whose block fits the row
    file_type: str = "MOSTLY_Q2_K"  # general.file_type (gguf.LlamaFileType name)


MIXED_RECIPES: dict[str, MixedRecipe] = {
    "iq2_xxs": MixedRecipe((("IQ2_XXS", "IQ2_XXS", "IQ2_XXS"),), file_type="MOSTLY_IQ2_XXS"),
    "iq1_s": MixedRecipe((("IQ1_S", "IQ1_S", "IQ1_M"),), file_type="MOSTLY_IQ1_S"),
    "ternary": MixedRecipe((("TQ1_0", "TQ1_0", "TQ2_0"),), file_type="MOSTLY_TQ1_0"),
    "iq4_xs": MixedRecipe((("IQ4_XS", "IQ4_XS", "IQ4_XS"),), ("IQ4_XS", "IQ4_NL"), "MOSTLY_IQ4_XS"),
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
    if len(shape) < 2 or any(part in name for part in KEEP_F32):
        return 0
    return next((_type_id(t) for t in recipe.matrices if _fits(t, shape[-1])), 0)


def file_type(recipe: MixedRecipe) -> int:
    from gguf.constants import LlamaFileType

    return int(LlamaFileType[recipe.file_type])


# ---- random valid blocks ----------------------------------------------------------------------

_TERNARY_POWERS = np.array([81, 27, 9, 3, 1], dtype=np.int64)


def _ternary_bytes(trits: np.ndarray) -> np.ndarray:
    """TQ1_0 bytes of (..., k) trits 0..2, most significant first, as ggml packs them."""
    value = (trits.astype(np.int64) * _TERNARY_POWERS[-trits.shape[-1] :] * 3 ** (5 - trits.shape[-1])).sum(
        -1
    )
    return ((value * 256 + 242) // 243).astype(np.uint8)


def _tq1_0_codes(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    trits = rng.integers(0, 3, (n_blocks, 256), dtype=np.uint8)
    head = trits[:, :160].reshape(n_blocks, 5, 32).transpose(0, 2, 1)
    middle = trits[:, 160:240].reshape(n_blocks, 5, 16).transpose(0, 2, 1)
    tail = trits[:, 240:].reshape(n_blocks, 4, 4).transpose(0, 2, 1)
    return np.concatenate([_ternary_bytes(head), _ternary_bytes(middle), _ternary_bytes(tail)], axis=-1)


def _tq2_0_codes(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    trits = rng.integers(0, 3, (n_blocks, 2, 4, 32), dtype=np.uint8)
    shifted = trits << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(shifted, axis=2).reshape(n_blocks, 64)


def _set_scale(blocks: np.ndarray, type_name: str, d: float) -> None:
    """Write fp16 `d` as every block's super-scale."""
    bits = int(np.float16(d).view(np.uint16))
    if type_name == "IQ1_M":  # the four nibbles top the last four 16-bit words
        words = blocks[:, 48:56].copy().view(np.uint16)
        nibbles = (bits >> np.array([0, 4, 8, 12])) & 0xF
        blocks[:, 48:56] = ((words & 0x0FFF) | (nibbles << 12).astype(np.uint16)).view(np.uint8)
        return
    offset = {"TQ1_0": 52, "TQ2_0": 64}.get(type_name, 0)
    blocks[:, offset : offset + 2] = np.frombuffer(np.uint16(bits).tobytes(), dtype=np.uint8)


def random_blocks(type_name: str, shape: tuple[int, ...], seed: list[int]) -> np.ndarray:
    """uint8 (*shape[:-1], row bytes): random valid `type_name` blocks whose decoded values have a
    standard deviation of about 1/sqrt(shape[-1])."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from k3stream.quant import dequantize

    qtype = GGMLQuantizationType[type_name]
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_values
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    if type_name == "TQ1_0":
        blocks[:, :52] = _tq1_0_codes(rng, n_blocks)
    elif type_name == "TQ2_0":
        blocks[:, :64] = _tq2_0_codes(rng, n_blocks)
    _set_scale(blocks, type_name, 1.0)
    spread = float(dequantize(blocks, qtype).square().mean().sqrt())
    _set_scale(blocks, type_name, 1.0 / np.sqrt(shape[-1]) / max(spread, 1e-3))
    return blocks.reshape(*shape[:-1], -1)
