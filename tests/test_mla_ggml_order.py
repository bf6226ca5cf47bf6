"""The default arithmetic's steps in the float order of ggml's CPU backend, each on llama.cpp's own inputs
(read from its graph) against llama.cpp's output bit for bit: the MLA attention (decode and prefill), the
RMS norm and the MoE's routing weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import k3stream
from conftest import NO_C_KERNELS, requires_llama
from k3stream import LoadOptions
from k3stream.model.layers import rms_norm
from k3stream.model.mla import MLA
from k3stream.model.moe import LatentMoE
from k3stream.quant.kernels import cpu
from llama_tensors import llama_mla_attention, llama_tensors
from test_model import tokens_for


@requires_llama
@pytest.mark.parametrize("seed", [5, 11])
def test_mla_attention_is_llama_cpps_bit_for_bit(tiny_model, tmp_path, seed):
    """40 tokens (past 32 cache rows: every one of ggml's 32 running sums and its groups of 8 taken), rows
    of 264 (not whole 32s: its scores' remaining values added one at a time), 4 heads."""
    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    path = tiny_model(n_layers=2, mla_layers=(1,), kv_lora=256, seed=seed)
    model = k3stream.load(path)
    attention = model.layers[1].attn
    assert isinstance(attention, MLA) and attention.ggml_order
    tokens = tokens_for(seed, model.config.vocab_size, 40)
    steps = llama_mla_attention(path, tokens, 1, tmp_path)
    for query, cache, expected in steps:
        context = attention._attend_one(torch.from_numpy(query), torch.from_numpy(cache))
        assert np.array_equal(context.numpy(), expected)
    queries, cache = (torch.from_numpy(np.stack([s[0] for s in steps])), torch.from_numpy(steps[-1][1]))
    assert np.array_equal(attention._attend(queries, cache, 0).numpy(), np.stack([s[2] for s in steps]))
    floats = k3stream.load(path, LoadOptions(match_ggml=False)).layers[1].attn
    assert not floats.ggml_order
    query, cache, expected = steps[-1]
    other = floats._attend_one(torch.from_numpy(query), torch.from_numpy(cache)).numpy()
    assert not np.array_equal(other, expected) and np.abs(other - expected).max() < 1e-5


@requires_llama
def test_rms_norm_is_llama_cpps_bit_for_bit(tiny_model, tmp_path):
    """Layer 0's input norm of each token's embedding row: ggml sums the squares in double one by one."""
    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    path = tiny_model(n_layers=2, mla_layers=(1,), seed=5)
    model = k3stream.load(path)
    tokens = tokens_for(5, model.config.vocab_size, 40)
    steps = llama_tensors(path, tokens, ["inp_embd", "attn_norm-0"], tmp_path)
    rows = torch.from_numpy(np.concatenate([step["inp_embd"].reshape(1, -1) for step in steps]))
    normed = rms_norm(rows, model.layers[0].input_norm, model.config.rms_eps)
    assert np.array_equal(
        normed.numpy(), np.concatenate([step["attn_norm-0"].reshape(1, -1) for step in steps])
    )


@requires_llama
def test_routing_weights_are_llama_cpps_bit_for_bit(tiny_model, tmp_path):
    """Each MoE layer's routing on llama.cpp's router logits: its experts and weights, the chosen
    sigmoids divided by their sum, which ggml's sum_rows adds in double (a float sum parts from it at some
    of these 200 rows)."""
    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    path = tiny_model(n_layers=6, seed=5)
    model = k3stream.load(path)
    moe_layers = [layer for layer in model.layers if isinstance(layer.ffn, LatentMoE)]
    names = [f"ffn_moe_{part}-{layer.index}" for layer in moe_layers for part in ("logits", "weights_norm")]
    steps = llama_tensors(path, tokens_for(5, model.config.vocab_size, 40), names, tmp_path)
    for layer in moe_layers:
        logits, expected = (
            np.concatenate([step[f"ffn_moe_{part}-{layer.index}"].reshape(1, -1) for step in steps])
            for part in ("logits", "weights_norm")
        )
        _, weights = layer.ffn.routing.choose(torch.from_numpy(logits), layer.ffn.w.correction_bias)
        assert np.array_equal(weights.numpy(), expected), layer.index
