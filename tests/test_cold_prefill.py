"""A cold prefill's hints read no more than its layers' hints have earned: a layer's first hint (the
whole prompt's prediction, hundreds of experts on the real model) is read only as far as the prior
trust covers, its likeliest experts first, so a larger expert budget never makes a cold prefill read
more. Real packs, real stores, the real model's routing on a tiny model with many experts."""

from __future__ import annotations

import math

import pytest
import torch

from k3stream import LoadOptions
from k3stream.engine.loading import load_runtime
from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore
from k3stream.store.hints import PREFETCH_MIN_PRECISION
from test_store_prefetch import drain

MIB = 1 << 20
MANY = dict(n_layers=4, n_experts=128, top_k=8)  # 16 prompt rows choose ~70 of 128 experts a layer
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(16)]


@pytest.fixture(scope="module")
def many(tiny_model, tmp_path_factory) -> ExpertPack:
    out = tmp_path_factory.mktemp("many")
    return build_pack(tiny_model(**MANY), out / "many.pack", out / "many.manifest.json").manifest


def test_a_layers_first_hint_reads_what_the_prior_covers_its_first_experts_first(many):
    with ExpertPack(many) as pack, ExpertStore(pack, ram_mib=64) as store:
        layer = pack.moe_layers[0]
        hint = list(range(pack.num_experts - 1, 19, -1))  # 108 experts, the likeliest first
        store.prefetch(layer, hint)
        drain(store)
        allowance = math.ceil(pack.top_k / PREFETCH_MIN_PRECISION)
        assert store.ready(layer, hint) == hint[:allowance]
        stats = store.stats()
    assert stats["prefetch_loads"] == allowance
    assert stats["prefetch_suppressed"] == len(hint) - allowance


def test_a_layer_whose_hints_are_right_earns_a_larger_allowance(many):
    with ExpertPack(many) as pack, ExpertStore(pack, ram_mib=64) as store:
        layer = pack.moe_layers[0]
        loaded = []
        for first in (0, 40, 80):  # each hint right: the layer then fetches exactly what was read
            store.prefetch(layer, range(first, first + 40))
            drain(store)
            ready = store.ready(layer, range(first, first + 40))
            loaded.append(len(ready))
            for start in range(0, len(ready), pack.top_k):
                store.fetch(layer, ready[start : start + pack.top_k])
            store.end_token()
    assert loaded[0] < loaded[1] < loaded[2], loaded


def test_hints_list_the_experts_most_rows_chose_first(many):
    runtime = load_runtime(many, LoadOptions(expert_ram_mib=64))
    try:
        moe = next(layer.ffn for layer in runtime.model.layers if hasattr(layer.ffn, "predict"))
        rows = torch.randn(32, runtime.model.config.hidden, generator=torch.Generator().manual_seed(1))
        predicted = moe.predict(rows)
        chosen, _ = moe.routing.choose(moe.w.router(rows).float(), moe.w.correction_bias)
    finally:
        runtime.close()
    votes = torch.bincount(chosen.flatten())
    assert sorted(predicted) == chosen.unique().tolist()
    assert [int(votes[e]) for e in predicted] == sorted((int(votes[e]) for e in predicted), reverse=True)
    assert votes[predicted[0]] > 1  # 32 rows of 8 over 128 experts: some are chosen more than once


def cold_prefill_reads(manifest, share: float, prefetch: bool) -> int:
    with ExpertPack(manifest) as pack:
        pack_mib = len(pack.moe_layers) * pack.num_experts * pack.object_bytes / MIB
    runtime = load_runtime(manifest, LoadOptions(expert_ram_mib=share * pack_mib, prefetch=prefetch))
    try:
        runtime.model.prefill_last(runtime.model.new_state(), PROMPT)
        return runtime.store.stats()["pack_reads"]
    finally:
        runtime.close()


def test_a_cold_prefill_reads_about_what_it_uses_at_any_budget(many):
    """Without hints a cold prefill reads each expert it uses once (all fit); with them, at most each
    MoE layer's first allowance more, at a quarter of the pack and at all of it."""
    used = cold_prefill_reads(many, 1.0, prefetch=False)
    with ExpertPack(many) as pack:
        spare = len(pack.moe_layers) * math.ceil(pack.top_k / PREFETCH_MIN_PRECISION)
    for share in (0.25, 1.0):
        assert used <= cold_prefill_reads(many, share, prefetch=True) <= used + spare


def prefill_reads(manifest, share: float, prefetch: bool) -> tuple[int, int, int]:
    """Pack reads of a cold prefill and one decode step, then of the same prompt prefilled again (as
    `bench_real.py` measures), at `share` of the pack; and the hinted experts nobody then used."""
    with ExpertPack(manifest) as pack:
        pack_mib = len(pack.moe_layers) * pack.num_experts * pack.object_bytes / MIB
    runtime = load_runtime(manifest, LoadOptions(expert_ram_mib=share * pack_mib, prefetch=prefetch))
    try:
        model, store = runtime.model, runtime.store
        state = model.new_state()
        model.decode(state, int(model.prefill(state, PROMPT)[-1].argmax()))
        store.end_token(len(PROMPT) + 1)
        cold = store.stats()["pack_reads"]
        model.prefill(model.new_state(), PROMPT)
        stats = store.stats()
        return cold, stats["pack_reads"] - cold, stats["prefetch_loads"] - stats["prefetch_hits"]
    finally:
        runtime.close()


def test_a_larger_budget_never_makes_a_prefill_read_more(many):
    """From two working sets to the whole pack, neither the cold prefill nor the same prompt again reads
    more experts with a larger budget (reads, not times: the times swing on a shared machine). With
    hints, what a larger budget may add is only hinted experts nobody used: a small budget drops a
    hint that does not fit beside the step, a larger one reads it, the wrong experts included."""
    with ExpertPack(many) as pack:
        working_sets = len(pack.moe_layers) * pack.num_experts / pack.top_k
    shares = [2 / working_sets, 0.1, 0.25, 0.5, 1.0]
    demand = [prefill_reads(many, share, prefetch=False) for share in shares]
    for phase in (0, 1):
        counts = [reads[phase] for reads in demand]
        assert counts == sorted(counts, reverse=True), (shares, demand)
    assert demand[-1][1] < demand[0][1]  # a budget that holds the prompt's experts reads less again
    # with prefetch at two working sets a hint can take the slot of an expert the step needs next (one
    # read more, by timing); from 10% on there is room for both
    for cold, again, unused in (prefill_reads(many, share, prefetch=True) for share in shares[1:]):
        assert cold + again - unused <= demand[0][0] + demand[0][1], (cold, again, unused, demand)
