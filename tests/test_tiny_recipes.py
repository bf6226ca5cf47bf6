"""`make-tiny --recipe` mixes (i-quants, ternary, per-layer dynamic): the types each tensor takes, and
llama.cpp loading and running each one, k3stream within 1e-3 of it on the F32 rewrite."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

import k3stream
from conftest import requires_llama
from k3stream import LoadOptions, cli
from k3stream.gguf import mixed_recipes, writer
from k3stream.gguf.mixed_recipes import MIXED_RECIPES, MixedRecipe
from k3stream.gguf.writer import tensor_plan
from k3stream.quant import DECODE_ONLY_TYPES, dequantize
from llama_logits import llama_logits, relative_error
from test_model import f32_rewrite, tokens_for

DIMS = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)  # expert rows of whole 256-blocks
TOKENS = 40


def types_of(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("recipe", MIXED_RECIPES)
def test_recipes_give_valid_blocks_of_their_types(tiny_model, recipe):
    path = tiny_model(recipe=recipe, **DIMS)
    reader = GGUFReader(path)
    quantized = [t for t in reader.tensors if t.tensor_type.name not in ("F32", "F16")]
    assert any(t.tensor_type in DECODE_ONLY_TYPES for t in quantized)
    for tensor in quantized:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        rms = float(values.square().mean().sqrt())
        width = int(tensor.shape[0])  # GGML order: the row is the first dimension
        assert values.isfinite().all() and 0.3 < rms * np.sqrt(width) < 3, tensor.name


def test_the_dynamic_recipe_gives_each_moe_layer_other_expert_types(tiny_model):
    types = types_of(tiny_model(recipe="dynamic", **DIMS))
    per_layer = [
        tuple(types[f"blk.{layer}.ffn_{role}_exps.weight"] for role in ("gate", "up", "down"))
        for layer in range(1, 6)
    ]
    assert per_layer == list(MIXED_RECIPES["dynamic"].expert_layers)
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.1.ffn_down_shexp.weight"] == "Q6_K"


def test_the_iq4_xs_recipe_quantizes_the_non_expert_matrices(tiny_model):
    types = types_of(tiny_model(recipe="iq4_xs", **DIMS))
    assert types["blk.3.attn_v_b.weight"] == "IQ4_XS" and types["blk.3.attn_k_b.weight"] == "IQ4_NL"
    assert types["blk.0.attn_q.weight"] == "IQ4_NL" and types["blk.0.ssm_f_b.weight"] == "F32"  # rows of 16
    assert types["token_embd.weight"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"


def test_a_recipe_refuses_shapes_its_types_cannot_hold(tmp_path):
    from k3stream.testing.tiny import TinySpec, make_tiny

    with pytest.raises(
        ValueError, match="recipe iq1_s: blk.1.ffn_gate_exps.weight rows of 32 values"
    ) as error:
        make_tiny(tmp_path, TinySpec(recipe="iq1_s"))
    assert not any(tmp_path.iterdir())
    # the message names shapes that fit: the recipe writes with them
    hint = re.search(r"\(((?:\w+=\d+, )*\w+=\d+) fit every one\)$", str(error.value))
    assert hint, str(error.value)
    fitting = {name: int(value) for name, value in (pair.split("=") for pair in hint.group(1).split(", "))}
    assert make_tiny(tmp_path, TinySpec(recipe="iq1_s", n_layers=2, mla_layers=(1,), **fitting)).is_file()


@pytest.mark.parametrize("recipe", ["audited", "iq1_s", "nvfp4"])
def test_make_tiny_with_a_quantized_recipe_alone_takes_shapes_that_fit_it(tmp_path, capsys, recipe):
    """`make-tiny DIR --recipe R` writes R without shape flags; a shape flag given still decides."""
    assert cli.main(["make-tiny", str(tmp_path / "fit"), "--recipe", recipe]) == 0
    tensors = {t.name: t for t in GGUFReader(capsys.readouterr().out.strip()).tensors}
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type not in (
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
    )
    assert int(tensors["blk.1.ffn_gate_exps.weight"].shape[0]) == writer.FITTING_SHAPES["latent"]
    assert cli.main(["make-tiny", str(tmp_path / "wide"), "--recipe", recipe, "--latent", "512"]) == 0
    tensors = {t.name: t for t in GGUFReader(capsys.readouterr().out.strip()).tensors}
    assert int(tensors["blk.1.ffn_gate_exps.weight"].shape[0]) == 512


def test_recipes_keep_the_plan(tiny_model):
    """Every recipe writes the same tensors in the same shapes: only the types change."""
    from k3stream.gguf.writer import TinySpec

    plan = tensor_plan(TinySpec(**DIMS), 300)
    for recipe in MIXED_RECIPES:
        assert set(types_of(tiny_model(recipe=recipe, **DIMS))) == {t.name for t in plan}


@requires_llama
@pytest.mark.slow
@pytest.mark.parametrize("recipe", MIXED_RECIPES)
def test_llama_cpp_runs_each_recipe_and_k3stream_matches_it_on_the_f32_rewrite(tiny_model, tmp_path, recipe):
    """llama.cpp loads and runs the quantized file itself (finite logits); k3stream's logits on the
    quantized file with float32 activations equal llama.cpp's on its F32 rewrite within 1e-3, prefill
    and decode."""
    path = tiny_model(recipe=recipe, **DIMS, seed=3)
    model = k3stream.load(path, LoadOptions(match_ggml=False))
    tokens = tokens_for(3, model.config.vocab_size, TOKENS)
    rewrite = f32_rewrite(path, tmp_path)
    direct, reference = llama_logits([(path, tokens), (rewrite, tokens)], tmp_path)
    assert np.isfinite(direct).all() and direct.std() > 0
    assert relative_error(model.logits(tokens).numpy(), reference) <= 1e-3
    state = model.new_state()
    model.prefill(state, tokens[:32])
    decoded = np.stack([model.decode(state, token).numpy() for token in tokens[32:]])
    assert relative_error(decoded, reference[32:]) <= 1e-3


@requires_llama
@pytest.mark.slow
@pytest.mark.parametrize("recipe", MIXED_RECIPES)
def test_each_recipe_two_layers_directly_against_llama(tiny_model, tmp_path, recipe):
    """The quantized file itself against llama.cpp, as the audited K-quants are held
    (`test_model.test_audited_two_layers_directly_against_llama`): the default rounds the activations
    as ggml does (Q8_K for the i-quants and ternary types, Q8_0 for IQ4_NL). Measured: 0 to 4.7e-7 on
    every recipe; float32 activations 1.0e-2 to 7.2e-2."""
    path = tiny_model(recipe=recipe, **DIMS, n_layers=2, mla_layers=(1,), seed=1)
    model = k3stream.load(path)
    tokens = tokens_for(1, model.config.vocab_size, TOKENS)
    (reference,) = llama_logits([(path, tokens)], tmp_path)
    assert relative_error(model.logits(tokens).numpy(), reference) <= 5e-3


def test_inspect_shows_the_recipe_per_layer_and_role_and_what_it_implies(tiny_model, capsys):
    from k3stream.cli import main

    path = tiny_model(recipe="dynamic", **DIMS)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    routed = [t for name, t in tensors.items() if "_exps." in name]
    others = [t for name, t in tensors.items() if "_exps." not in name]
    experts, top_k = 16, 4
    objects = [
        sum(int(tensors[f"blk.{layer}.ffn_{role}_exps.weight"].n_bytes) for role in ("gate", "up", "down"))
        // experts
        for layer in range(1, 6)
    ]
    assert main(["inspect", str(path), "--json"]) == 0
    recipe = json.loads(capsys.readouterr().out)["recipe"]
    for row, layer_types in zip(recipe["moe_layers"], MIXED_RECIPES["dynamic"].expert_layers, strict=True):
        assert tuple(role["type"] for role in row["roles"].values()) == layer_types
    # a token reads one row of token_embd (its own), every other non-expert weight whole
    embd = tensors["token_embd.weight"]
    embd_row = int(embd.n_bytes) // int(embd.shape[1])
    non_expert = sum(int(t.n_bytes) for t in others) - int(embd.n_bytes) + embd_row
    assert recipe["bytes_per_token_uncached"] == {
        "experts": top_k * sum(objects),
        "non_expert": non_expert,
        "token_embd_row": embd_row,
        "total": top_k * sum(objects) + non_expert,
        "top_k": top_k,
    }
    expert_bits = 8 * sum(int(t.n_bytes) for t in routed) / sum(int(t.n_elements) for t in routed)
    assert recipe["bits_per_weight"]["routed_experts"] == pytest.approx(expert_bits, abs=1e-4)
    iq1 = recipe["moe_layers"][3]["roles"]["gate"]
    assert (iq1["type"], iq1["bits_per_weight"]) == ("IQ1_S", 1.5625)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "  layer 4: IQ1_S 1.56 / IQ1_M 1.75 / IQ2_S 2.56" in text
    assert f"expert objects {min(objects):,} to {max(objects):,} B by layer" in text
    assert f"bytes per token uncached: {top_k * sum(objects) + non_expert:,}" in text
    assert f"token_embd: one row of {embd_row:,} B" in text


@requires_llama
@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q3_K", "Q4_K", "Q5_K"])
def test_files_of_one_quantized_type_match_llama_directly(tiny_model, tmp_path, monkeypatch, type_name):
    """A file whose every matrix that fits the type's blocks (routed experts included) is of one type,
    against llama.cpp's token-by-token run (its vec_dot for every product; its batched prefill takes
    other kernels for some types): the default quantizes each product's activations to the 8-bit blocks
    ggml takes for the type (Q8_1 for Q4_1 and Q5_1, Q8_0 for Q4_0 and Q5_0, Q8_K for the K-quants) and
    its integer kernels give ggml's bits. Measured on 40 tokens: every row within 6e-7 (Q4_0, Q5_0 and
    Q5_1: every logit equal) but one or two late rows where another expert is chosen (Q4_1 5.2e-4 at row
    33, Q3_K 7e-3 and 9.2e-4 at rows 17 and 18, Q4_K and Q5_K 9.5e-3 at row 17). A Q2_K file has three
    such rows (17, 21, 35): it is held by the kernel tests alone."""
    name = f"every-{type_name.lower()}"
    recipe = MixedRecipe(((type_name,) * 3,), (type_name,), "MOSTLY_Q4_0")
    monkeypatch.setitem(mixed_recipes.WRITABLE_RECIPES, name, recipe)
    monkeypatch.setattr(writer, "RECIPES", (*writer.RECIPES, name))
    path = tiny_model(recipe=name, **DIMS, n_layers=2, mla_layers=(1,), seed=1)
    assert types_of(path)["blk.1.ffn_down_exps.weight"] == type_name
    model = k3stream.load(path)
    tokens = tokens_for(1, model.config.vocab_size, TOKENS)
    (reference,) = llama_logits([(path, tokens)], tmp_path, n_batch=1)
    rows = sorted(
        relative_error(ours, row) for ours, row in zip(model.logits(tokens).numpy(), reference, strict=True)
    )
    assert rows[-3] <= 1e-6 and rows[-1] <= 2e-2
