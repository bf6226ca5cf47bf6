"""A tiny Kimi-K3 run with streamed experts: same logits as the all-resident run, expert bytes in budget."""

from __future__ import annotations

import pytest
import torch

import k3stream
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore

MIB = 1 << 20
TOKENS = [5, 17, 3, 99, 42, 7, 7, 250]


@pytest.fixture(scope="module")
def streamed_model(tiny_model, tmp_path_factory):
    """(GGUF path, ExpertPack, all-resident decode logits per position, all-resident prefill logits)."""
    gguf_path = tiny_model(n_layers=5, n_experts=16, top_k=4)
    out = tmp_path_factory.mktemp("pack")
    result = build_pack(gguf_path, out / "tiny.pack", out / "tiny.manifest.json")
    resident = k3stream.load(gguf_path)
    return gguf_path, ExpertPack(result.manifest), decode_all(resident), resident.logits(TOKENS)


def decode_all(model) -> torch.Tensor:
    state = model.new_state()
    return torch.stack([model.decode(state, token) for token in TOKENS])


@pytest.mark.parametrize(
    ("policy", "prefetch", "extra_slots"),
    [
        ("lfu-lru", False, 0),
        ("lfu-lru", False, 1),
        ("lfu-lru", False, None),
        ("cycle", True, 0),
        ("lru", True, 4),
    ],
)
def test_streamed_decode_equals_all_resident_bit_for_bit(streamed_model, policy, prefetch, extra_slots):
    """Slots: the smallest legal cache (top_k), one more, twice top_k, and every expert (None)."""
    gguf_path, pack, reference, _ = streamed_model
    objects = len(pack.moe_layers) * pack.num_experts if extra_slots is None else pack.top_k + extra_slots
    with ExpertStore(
        pack, ram_mib=objects * pack.object_bytes / MIB, policy=policy, prefetch=prefetch
    ) as store:
        model = k3stream.load(gguf_path, expert_source=store, prefetch=prefetch)
        assert torch.equal(decode_all(model), reference)
        assert store.stats()["pack_reads"] > 0


@pytest.mark.parametrize("extra_slots", [0, 5, None])
def test_streamed_prefill_equals_all_resident_bit_for_bit(streamed_model, extra_slots):
    """A prefill's union of experts may exceed the cache: the MoE then fetches it in groups."""
    gguf_path, pack, _, reference = streamed_model
    every_expert = len(pack.moe_layers) * pack.num_experts
    slots = every_expert if extra_slots is None else pack.top_k + extra_slots
    with ExpertStore(pack, ram_mib=slots * pack.object_bytes / MIB) as store:
        model = k3stream.load(gguf_path, expert_source=store)
        assert torch.equal(model.logits(TOKENS), reference)
        evictions = store.stats()["tiers"]["ram"]["cache_evictions"]
    assert (evictions > 0) == (slots < every_expert)  # the small caches really were too small


def test_expert_bytes_stay_within_the_ram_budget(streamed_model):
    gguf_path, pack, reference, _ = streamed_model
    limit = (pack.top_k + 3) * pack.object_bytes
    with ExpertStore(pack, ram_mib=limit / MIB, prefetch=True) as store:
        model = k3stream.load(gguf_path, expert_source=store)
        state = model.new_state()
        for position, token in enumerate(TOKENS):
            logits = model.decode(state, token)
            store.end_token(1)
            assert torch.equal(logits, reference[position])
            assert store.resident_bytes()["ram"] <= limit  # the store's accounting
            assert store.live_host_bytes() <= limit  # every expert buffer still alive anywhere
        stats = store.stats()
    assert stats["tokens"] == len(TOKENS)
    assert stats["tiers"]["ram"]["cache_evictions"] > 0  # the budget was binding


def test_quantized_experts_stream_bit_for_bit_at_the_smallest_budget(tiny_model, tmp_path):
    """Q2_K/Q3_K experts (objects with padding between roles) through the smallest legal cache."""
    gguf_path = tiny_model(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
    result = build_pack(gguf_path, tmp_path / "q.pack", tmp_path / "q.manifest.json")
    pack = ExpertPack(result.manifest)
    tokens = TOKENS[:4]
    resident = k3stream.load(gguf_path)
    state = resident.new_state()
    reference = torch.stack([resident.decode(state, token) for token in tokens])
    with ExpertStore(pack, ram_mib=pack.top_k * pack.object_bytes / MIB, policy="cycle") as store:
        model = k3stream.load(gguf_path, expert_source=store)
        state = model.new_state()
        assert torch.equal(torch.stack([model.decode(state, token) for token in tokens]), reference)
