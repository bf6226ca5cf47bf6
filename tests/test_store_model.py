"""A tiny Kimi-K3 run with streamed experts: same logits as the all-resident run, expert bytes in budget."""

from __future__ import annotations

import pytest
import torch

import k3stream
from k3stream import LoadOptions
from k3stream.model.moe import LatentMoE
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
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store, prefetch=prefetch))
        assert torch.equal(decode_all(model), reference)
        assert store.stats()["pack_reads"] > 0


@pytest.mark.parametrize("extra_slots", [0, 5, None])
def test_streamed_prefill_equals_all_resident_bit_for_bit(streamed_model, extra_slots):
    """A prefill's union of experts may exceed the cache: the MoE then fetches it in groups."""
    gguf_path, pack, _, reference = streamed_model
    every_expert = len(pack.moe_layers) * pack.num_experts
    slots = every_expert if extra_slots is None else pack.top_k + extra_slots
    with ExpertStore(pack, ram_mib=slots * pack.object_bytes / MIB) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store))
        assert torch.equal(model.logits(TOKENS), reference)
        evictions = store.stats()["tiers"]["ram"]["cache_evictions"]
    assert (evictions > 0) == (slots < every_expert)  # the small caches really were too small


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize(
    ("extra_slots", "policy"), [(0, "cycle"), (3, "lru"), (9, "lfu-lru"), (None, "cycle")]
)
def test_a_prefill_reads_each_expert_once_per_layer_in_pack_order(streamed_model, extra_slots, policy, hints):
    """With read-ahead on, at caches smaller than a step's union too: every expert a layer's step needs
    is read from the pack once, each read queued in pack order. With prefetch hints on, an expert is
    read again only after a hint's read of it was evicted unused (a small cache gives the step's own
    reads priority over predictions)."""
    gguf_path, pack, _, reference = streamed_model
    every_expert = len(pack.moe_layers) * pack.num_experts
    slots = every_expert if extra_slots is None else pack.top_k + extra_slots
    with ExpertStore(pack, ram_mib=slots * pack.object_bytes / MIB, policy=policy) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store, prefetch=hints))
        reads: list[list[tuple[int, int]]] = []
        start = store._reader.start

        def recorded(keys, priority, read_here=False):
            reads.append(list(keys))
            return start(keys, priority, read_here)

        store._reader.start = recorded
        logits = model.logits(TOKENS)
        stats = store.stats()
    assert torch.equal(logits, reference)
    assert all(keys == sorted(keys) for keys in reads)  # each read queued in pack order
    read_keys = [key for keys in reads for key in keys]
    moe = [layer.ffn for layer in model.layers if layer.index in pack.moe_layers]
    used = {(ffn.layer, int(expert)) for ffn in moe for expert in ffn.chosen.unique()}
    assert used <= set(read_keys)
    assert len(read_keys) - len(set(read_keys)) <= stats["prefetch_unused_evictions"]
    assert len(set(read_keys) - used) <= stats["prefetch_loads"]  # anything else was a hint's read
    if not hints:
        assert len(read_keys) == len(used)


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_step_larger_than_the_cache_reads_only_what_was_not_resident(streamed_model, read_ahead):
    """Many sequences at once need more experts than the cache holds: the experts resident when the
    step starts are computed first, before the step's reads can evict them, so a repeated step reads
    only the others (before, each step evicted and read again the experts it would use)."""
    gguf_path, pack, _, _ = streamed_model
    slots = pack.top_k + 5
    with ExpertStore(pack, ram_mib=slots * pack.object_bytes / MIB, prefetch=read_ahead) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store, prefetch=False))
        moe = next(layer.ffn for layer in model.layers if isinstance(layer.ffn, LatentMoE))
        rows = torch.randn(16, model.config.hidden, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            first = moe(rows)
            step = moe.chosen.unique().tolist()
            resident = store.ready(moe.layer, step)
            reads = store.stats()["pack_reads"]
            assert torch.equal(moe(rows), first)
        assert len(step) > slots and len(resident) >= slots // 2
        assert store.stats()["pack_reads"] - reads == len(step) - len(resident)


def test_a_store_over_another_models_pack_is_refused_naming_both(streamed_model, tiny_model):
    """Same shapes, other weights: the pack's experts would run beside the other model's trunk."""
    gguf_path, pack, _, _ = streamed_model
    other = tiny_model(n_layers=5, n_experts=16, top_k=4, seed=11)
    with ExpertStore(pack, ram_mib=pack.top_k * pack.object_bytes / MIB) as store:
        with pytest.raises(ValueError, match=f"built from {gguf_path.resolve()}, not {other.resolve()}"):
            k3stream.load(other, LoadOptions(expert_source=store))
        assert k3stream.load(gguf_path, LoadOptions(expert_source=store)).logits(TOKENS[:2]).shape[0] == 2


@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_steps_the_store_holds_equal_its_fetched_steps_bit_for_bit(streamed_model, prefetch):
    """With every expert in the budget, each decode step's routed experts are held by the store
    (`hold`: pinned, no views) and computed by one C call on their addresses, on the decode program
    (prefetch off) and the eager path (on): the logits equal the all-resident GGUF run's and the same
    store's fetched steps' (`_routed_sum`, where the store does not hold them), bit for bit."""
    gguf_path, pack, reference, _ = streamed_model
    every_expert = len(pack.moe_layers) * pack.num_experts
    with ExpertStore(pack, ram_mib=every_expert * pack.object_bytes / MIB, prefetch=prefetch) as store:
        model = k3stream.load(gguf_path, LoadOptions(expert_source=store, prefetch=prefetch))
        fetched = decode_all(model)  # reads the experts the steps use: most of its steps fetch
        held, hold = [], store.hold
        store.hold = lambda *args: held.append(hold(*args)) or held[-1]
        assert torch.equal(decode_all(model), reference)
        assert torch.equal(fetched, reference)
        assert len(held) == len(TOKENS) * len(pack.moe_layers) and all(held)
        store.hold = lambda *args: False
        assert torch.equal(decode_all(model), reference)
