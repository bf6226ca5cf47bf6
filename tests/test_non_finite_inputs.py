"""A NaN or infinite input stays non-finite through ggml's arithmetic (`match_ggml`): the 8-bit
activation blocks ggml quantizes skip a NaN and turn it, or an infinity, into a code, so a damaged
routed expert (served unchecked from the GGUF) gave finite nonsense where float arithmetic gives NaN
logits that the sampler refuses."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, take_kernel_isa
from k3stream.cli import main
from k3stream.quant import DECODE_ONLY_TYPES, quantize
from k3stream.quant.kernels import QWeight, cpu, qmatmul
from k3stream.testing.iquant_blocks import random_blocks

WIDTH = 512


def random_weight(qt: T, rows: int, seed: int) -> QWeight:
    if qt in DECODE_ONLY_TYPES:
        data = random_blocks(qt.name, (rows, WIDTH), [int(qt), seed])
    else:
        values = np.random.default_rng(seed).standard_normal((rows, WIDTH)).astype(np.float32)
        data = quantize(values, qt)
    return QWeight(torch.from_numpy(np.ascontiguousarray(data)).reshape(-1), int(qt), (rows, WIDTH))


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("qt", sorted(T(t) for t in cpu.Q8_TYPES), ids=lambda t: t.name)
def test_a_non_finite_input_makes_its_row_nan_and_leaves_the_others(qt, bad, isa, monkeypatch):
    take_kernel_isa(isa, monkeypatch)
    w = random_weight(qt, 24, seed=int(qt))
    x = torch.from_numpy(np.random.default_rng(int(qt)).standard_normal((3, WIDTH)).astype(np.float32))
    damaged = x.clone()
    damaged[1, 300] = bad  # the second 256-block (Q8_K), a later 32-block (Q8_0, Q8_1)
    got = qmatmul(damaged, w, match_ggml=True)
    assert got[1].isnan().all()
    assert torch.equal(got[[0, 2]], qmatmul(x, w, match_ggml=True)[[0, 2]])


def damaged_experts(source, out_dir, tensor_name: str, scale_at: int) -> object:
    """A copy of `source` whose every expert of `tensor_name` has a NaN scale in its first block."""
    path = out_dir / "damaged.gguf"
    shutil.copyfile(source, path)
    tensor = next(t for t in GGUFReader(source).tensors if t.name == tensor_name)
    experts = int(tensor.shape[-1])
    with path.open("r+b") as stream:
        for expert in range(experts):
            stream.seek(tensor.data_offset + expert * (tensor.n_bytes // experts) + scale_at)
            stream.write(np.float16(np.nan).tobytes())
    return path


@pytest.mark.parametrize(
    ("recipe", "tensor", "scale_at"),
    [("audited", "blk.2.ffn_down_exps.weight", 108), ("iq2_xxs", "blk.1.ffn_up_exps.weight", 0)],
)
@pytest.mark.parametrize("seed", [3, 11])
def test_generate_refuses_a_damaged_routed_expert_served_from_the_gguf(
    tiny_model, tmp_path, capsys, recipe, tensor, scale_at, seed
):
    """Every expert of one MoE layer damaged, served from the GGUF (no pack checks them): `generate`
    with ggml's arithmetic (the default) refuses the NaN logits in one line, as with float32
    activations, instead of printing text."""
    dims = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
    path = damaged_experts(
        tiny_model(recipe=recipe, seed=seed, n_layers=4, **dims), tmp_path, tensor, scale_at
    )
    for arithmetic in ("--match-ggml", "--float-activations"):
        argv = ["generate", str(path), "--prompt", "The cat sat on the mat", "--max-tokens", "3", arithmetic]
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "the model produced non-finite logits" in lines[0], (arithmetic, lines)
