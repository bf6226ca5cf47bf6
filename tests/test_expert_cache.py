"""The opt-in cache of dequantized routed experts: same logits as without it, within its budget."""

from __future__ import annotations

import pytest
import torch

import k3stream
from k3stream.model.experts import DenseExpertCache, stack_dense
from k3stream.model.moe import LatentMoE
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore

MIB = 1 << 20
QUANTIZED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
TOKENS = [5, 17, 3, 99, 42, 7, 7, 250, 5, 17]
PROMPT = [(7 * i) % 500 for i in range(24)]  # 96 (token, expert) pairs: the per-expert prefill path


def decode_all(model) -> torch.Tensor:
    state = model.new_state()
    return torch.stack([model.decode(state, token) for token in TOKENS])


def dense_cache(model):
    return next(layer.ffn.dense_cache for layer in model.layers if isinstance(layer.ffn, LatentMoE))


@pytest.fixture(scope="module")
def quantized_model(tiny_model):
    """(path, uncached decode logits) of a tiny model whose routed experts are Q2_K/Q3_K blocks."""
    path = tiny_model(**QUANTIZED, n_layers=4, n_experts=16, top_k=4)
    return path, decode_all(k3stream.load(path))


def test_cache_evicts_least_recently_used_and_returns_stack_dense_values(quantized_model):
    path, _ = quantized_model
    moe = next(layer.ffn for layer in k3stream.load(path).layers if isinstance(layer.ffn, LatentMoE))
    experts = moe.source.fetch(moe.layer, [0, 1, 2])
    rows, columns = experts[0].up.shape
    cache = DenseExpertCache(2 * rows * columns * 4 / MIB)  # room for two matrices
    for ids in ([0, 1], [2, 0], [1, 1, 0]):  # [2, 0]: the hit on 0 survives, 1 goes
        got = cache.stack(moe.layer, "up", ids, experts, torch.device("cpu"))
        assert torch.equal(got, stack_dense([experts[e].up for e in ids]))
    assert (cache.hits, cache.misses) == (2, 4)
    assert cache.used_bytes == cache.budget_bytes


@pytest.mark.parametrize("experts_that_fit", [0, 3, 1000])
def test_cached_decode_equals_uncached_bit_for_bit(quantized_model, experts_that_fit):
    """Budgets: under one matrix (stores nothing), a few matrices (evicts), every expert (hits)."""
    path, reference = quantized_model
    probe = k3stream.load(path)
    moe = next(layer.ffn for layer in probe.layers if isinstance(layer.ffn, LatentMoE))
    matrix = moe.source.fetch(moe.layer, [0])[0].up
    matrix_mib = matrix.shape[0] * matrix.shape[1] * 4 / MIB
    budget_mib = max(experts_that_fit, 0.5) * matrix_mib
    model = k3stream.load(path, expert_cache_mib=budget_mib)
    assert torch.equal(decode_all(model), reference)
    assert torch.equal(model.logits(PROMPT), probe.logits(PROMPT))
    cache = dense_cache(model)
    assert 0 <= cache.used_bytes <= cache.budget_bytes
    assert cache.misses > 0
    if experts_that_fit == 1000:
        assert cache.hits > 0


def test_cache_under_a_streamed_store_keeps_logits_and_store_traffic(quantized_model, tmp_path):
    """The store still serves every expert each step: same pack reads with or without the cache."""
    path, reference = quantized_model
    result = build_pack(path, tmp_path / "tiny.pack", tmp_path / "tiny.manifest.json")
    pack = ExpertPack(result.manifest)
    ram_mib = (pack.top_k + 1) * pack.object_bytes / MIB
    reads = []
    for cache_mib in (0, 64):
        with ExpertStore(pack, ram_mib=ram_mib, prefetch=False) as store:  # no racing reads
            model = k3stream.load(path, expert_source=store, prefetch=False, expert_cache_mib=cache_mib)
            assert torch.equal(decode_all(model), reference)
            reads.append(store.stats()["pack_reads"])
    assert reads[0] == reads[1] > 0
