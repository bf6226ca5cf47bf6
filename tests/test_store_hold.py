"""The expert store's `hold` on the decode path: a one-row step whose experts are all in RAM is one store
call (held at the routing's step, nothing read ahead), counted as a fetch of the same experts counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import k3stream
from k3stream import LoadOptions
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore

MIB = 1 << 20
TOKENS = [5, 17, 3, 99, 42, 7, 7, 250]
STORE_CALLS = ("fetch", "hold", "ready", "read_ahead")


@pytest.fixture(scope="module")
def packed(tiny_model, tmp_path_factory):
    """(GGUF path, ExpertPack) of a model whose decode steps route diverse experts."""
    gguf_path = tiny_model(n_layers=5, n_experts=16, top_k=4, seed=21)
    out = tmp_path_factory.mktemp("pack")
    result = build_pack(gguf_path, out / "tiny.pack", out / "tiny.manifest.json")
    return gguf_path, ExpertPack(result.manifest)


def decode_all(model) -> torch.Tensor:
    state = model.new_state()
    return torch.stack([model.decode(state, token) for token in TOKENS])


def counted_calls(store: ExpertStore) -> dict[str, list]:
    """Each of `STORE_CALLS` the store gets from here on, with its result."""
    calls: dict[str, list] = {name: [] for name in STORE_CALLS}
    for name in STORE_CALLS:
        method = getattr(store, name)

        def counted(*args, method=method, name=name):
            calls[name].append(method(*args))
            return calls[name][-1]

        setattr(store, name, counted)
    return calls


def test_a_decode_step_whose_experts_are_all_in_ram_is_one_store_call(packed):
    """Prefetch on (the store reads ahead), every expert in the budget and read once: each MoE layer's
    decode step holds its experts at its routing's step and asks the store nothing else; the logits
    equal the all-resident GGUF run's bit for bit."""
    gguf_path, pack = packed
    reference = decode_all(k3stream.load(gguf_path))
    every_expert = len(pack.moe_layers) * pack.num_experts
    with ExpertStore(pack, ram_mib=every_expert * pack.object_bytes / MIB) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store))
        for layer in pack.moe_layers:
            store.fetch(layer, range(pack.num_experts))
        calls = counted_calls(store)
        assert torch.equal(decode_all(model), reference)
        assert model._program is not None and model._program.steps is not None
    assert len(calls["hold"]) == len(TOKENS) * len(pack.moe_layers) and all(calls["hold"])
    assert calls["read_ahead"] == calls["ready"] == calls["fetch"] == []


def test_a_decode_step_with_an_expert_not_in_ram_still_reads_ahead(packed):
    """A budget of a third of the experts: steps whose experts are not all in RAM read them ahead and
    fetch them, and the logits do not change."""
    gguf_path, pack = packed
    reference = decode_all(k3stream.load(gguf_path))
    third = len(pack.moe_layers) * pack.num_experts // 3
    with ExpertStore(pack, ram_mib=third * pack.object_bytes / MIB) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store))
        calls = counted_calls(store)
        assert torch.equal(decode_all(model), reference)
    assert calls["read_ahead"] and calls["fetch"]
    assert len(calls["hold"]) >= len(TOKENS) * len(pack.moe_layers)  # tried at each step's start


def test_hold_counts_as_a_fetch_of_the_same_experts(packed):
    """Hits, misses (what was read ahead for the step), prefetch uses, per-layer counts, and the eviction
    order that follows: the same whether a step's resident experts are held or fetched."""
    _, pack = packed
    first, second = pack.moe_layers[:2]
    top_k = pack.top_k
    hinted, ahead, fetched = (list(range(i * top_k, (i + 1) * top_k)) for i in range(3))
    step = hinted + ahead + fetched
    ram_mib = (len(step) + 2 * top_k) * pack.object_bytes / MIB
    stats, resident = [], []
    for by_hold in (True, False):
        with ExpertStore(pack, ram_mib=ram_mib, adaptive_prefetch=False) as store:
            store.fetch(first, fetched)
            store.fetch(second, fetched)
            store.prefetch(first, hinted)
            store.read_ahead(first, ahead)
            for thread in (store._prefetcher, store._reader_ahead):
                thread.submit(lambda: None).result()
            objects = np.empty(len(step), dtype=np.int64)
            if by_hold:
                assert store.hold(first, step, objects) and np.all(objects != 0)
            else:
                store.fetch(first, step)
            for layer in pack.moe_layers[1:]:  # evictions follow
                for start in range(0, pack.num_experts - top_k + 1, top_k):
                    store.fetch(layer, range(start, start + top_k))
            counts = store.stats()
            stats.append(
                {
                    "tier": {k: v for k, v in counts["tiers"]["ram"].items() if k.startswith("cache_")},
                    "layers": counts["layers"],
                    **{k: counts[k] for k in ("fetches", "prefetch_hits", "prefetch_loads", "pack_reads")},
                }
            )
            resident.append(sorted(store._compute.buffers))
    assert stats[0] == stats[1]
    assert stats[0]["tier"]["cache_evictions"] > 0 and stats[0]["prefetch_hits"] == top_k
    assert resident[0] == resident[1]
