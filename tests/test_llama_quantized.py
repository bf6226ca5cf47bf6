"""GGUFs written by llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs): its
per-tensor mixes and fallback types, importance-matrix i-quants, per-layer `--tensor-type` overrides
and `--keep-split` shards, run by k3stream as llama.cpp runs them."""

from __future__ import annotations

import re
import statistics

import pytest
import torch

import k3stream
from conftest import requires_llama
from k3stream import LoadOptions
from k3stream.cli import main
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.pack.verify import verify_pack
from k3stream.store import ExpertStore
from llama_logits import llama_logits, relative_error
from llama_quantize import llama_quantize
from test_model import f32_rewrite, tokens_for
from test_pack_mixed import greedy
from test_tiny_recipes import types_of

pytestmark = [requires_llama, pytest.mark.llama]

# two layers (a dense KDA one, an MLA/MoE one): rows of 64 (hidden) and 256 (experts, latent, kv_lora),
# so llama.cpp's K-quant and i-quant ftypes fall back to other types on the 64-wide rows
SOURCE = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32, n_layers=2, mla_layers=(1,), n_experts=8)
TOKENS = 16
MIB = 1 << 20
FLOAT_TYPES = {"F32", "F16", "BF16"}
# (ftype, whether llama.cpp requires an importance matrix for it)
FTYPES = [
    ("Q4_K_M", False),
    ("IQ2_XXS", True),
    ("TQ1_0", False),
    pytest.param("Q3_K_S", False, marks=pytest.mark.slow),
    pytest.param("Q4_1", False, marks=pytest.mark.slow),
    pytest.param("IQ4_XS", False, marks=pytest.mark.slow),
    pytest.param("IQ3_M", False, marks=pytest.mark.slow),
    pytest.param("MXFP4_MOE", False, marks=pytest.mark.slow),
    pytest.param("IQ1_S", True, marks=pytest.mark.slow),
    pytest.param("IQ2_M", True, marks=pytest.mark.slow),
    pytest.param("IQ3_XXS", True, marks=pytest.mark.slow),
    pytest.param("Q2_K_S", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("ftype", "imatrix"), FTYPES)
def test_a_llama_quantize_file_runs_as_llama_cpp_runs_it(tiny_model, tmp_path, ftype, imatrix):
    """Float32 activations against llama.cpp on the file's F32 rewrite (the model computed), and the
    default (ggml's activation rounding and integer products) against llama.cpp on the file itself,
    token by token: the first row and most rows give ggml's bits, a routing choice flipped by one
    rounding may part a later row."""
    path = llama_quantize(tiny_model(**SOURCE, seed=1), tmp_path / f"{ftype}.gguf", ftype, imatrix)
    quantized = set(types_of(path).values()) - FLOAT_TYPES
    assert len(quantized) >= 2, quantized  # llama.cpp's own mix, its fallback types among them
    model, floats = k3stream.load(path), k3stream.load(path, LoadOptions(match_ggml=False))
    tokens = tokens_for(1, model.config.vocab_size, TOKENS)
    direct, reference = llama_logits([(path, tokens), (f32_rewrite(path, tmp_path), tokens)], tmp_path, 1)
    assert relative_error(floats.logits(tokens).numpy(), reference) <= 1e-4
    rows = [relative_error(ours, row) for ours, row in zip(model.logits(tokens).numpy(), direct, strict=True)]
    assert rows[0] <= 1e-6 and statistics.median(rows) <= 1e-6, rows


# llama-quantize --tensor-type: each MoE layer's experts in other types, as "dynamic" releases are made
OVERRIDES = {
    r"blk\.1\.ffn_(gate|up)_exps": 16,  # IQ2_XXS
    r"blk\.1\.ffn_down_exps": 18,  # IQ3_XXS
    r"blk\.2\.ffn_(gate|up)_exps": 34,  # TQ1_0
    r"blk\.2\.ffn_down_exps": 39,  # MXFP4
    r"token_embd": 23,  # IQ4_XS
}


@pytest.fixture(scope="module")
def override_mix(tiny_model, tmp_path_factory):
    """(GGUF, manifest): a Q2_K file whose two MoE layers take other expert types, packed."""
    out = tmp_path_factory.mktemp("override-mix")
    source = tiny_model(**{**SOURCE, "n_layers": 3, "mla_layers": (2,)}, seed=2)
    path = llama_quantize(source, out / "mix.gguf", "Q2_K", imatrix=True, overrides=OVERRIDES)
    return path, build_pack(path, out / "mix.pack", out / "mix.manifest.json").manifest


def test_tensor_type_overrides_pack_per_layer_and_stream(override_mix, capsys):
    path, manifest = override_mix
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"layer 1: IQ2_XXS \S+ / IQ2_XXS \S+ / IQ3_XXS", text)
    assert re.search(r"layer 2: TQ1_0 \S+ / TQ1_0 \S+ / MXFP4", text)
    assert verify_pack(manifest, full=True)["ok"]
    prompt = [5, 17, 3, 99, 42]
    expected_tokens, expected_logits = greedy(k3stream.load(path), prompt, 6)
    with (
        ExpertPack(manifest) as pack,
        ExpertStore(pack, ram_mib=(pack.top_k + 2) * pack.object_bytes / MIB) as store,
    ):
        tokens, logits = greedy(k3stream.load(path, LoadOptions(expert_source=store)), prompt, 6)
        assert store.stats()["pack_reads"] > 0
    assert tokens == expected_tokens and torch.equal(logits, expected_logits)


def test_keep_split_shards_load_as_the_single_file(tiny_model, tmp_path):
    """llama-quantize --keep-split names its shards `OUT-0000N-of-0000M.gguf` after OUT itself."""
    source = tiny_model(**SOURCE, shards=3, seed=3)
    whole = llama_quantize(source, tmp_path / "whole.gguf", "Q4_K_M")
    (tmp_path / "split").mkdir()
    llama_quantize(source, tmp_path / "split" / "q.gguf", "Q4_K_M", keep_split=True)
    shards = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert shards == [f"q.gguf-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    model = k3stream.load(whole)
    tokens = tokens_for(3, model.config.vocab_size, TOKENS)
    expected = model.logits(tokens)
    for shard in shards:
        assert torch.equal(k3stream.load(tmp_path / "split" / shard).logits(tokens), expected)
