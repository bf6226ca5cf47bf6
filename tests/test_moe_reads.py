"""The MoE's reads against a source that reads ahead: a step's experts are asked for before the
projections that do not need them (routed_down, the shared experts) run; then whatever has arrived is
fetched and computed, and when nothing has, the next expert alone is waited for; results equal a
source that reads nothing ahead, bit for bit, in any arrival order and at any cache size."""

from __future__ import annotations

import pytest
import torch

import k3stream
from k3stream import LoadOptions
from k3stream.model.experts import GGUFExpertSource
from k3stream.model.moe import GROUPS_PER_STEP
from source_helpers import RecordingSource


class ArrivingSource(RecordingSource):
    """Reads ahead; of the experts read ahead, `ready` reports those whose id is congruent to the
    number of fetches so far (mod `spread`), so arrivals come in an order unlike pack order."""

    reads_ahead = True

    def __init__(self, inner: GGUFExpertSource, spread: int, slots: int | None) -> None:
        super().__init__(inner)
        self.spread = spread
        self.max_experts_per_fetch = slots
        self.read: set[tuple[int, int]] = set()

    def read_ahead(self, layer: int, expert_ids: list[int]) -> None:
        self.calls.append(("read_ahead", layer, list(expert_ids)))
        self.read.update((layer, expert) for expert in expert_ids)

    def ready(self, layer: int, expert_ids: list[int]) -> list[int]:
        fetches = sum(call == "fetch" for call, _, _ in self.calls)
        return [e for e in expert_ids if (layer, e) in self.read and e % self.spread == fetches % self.spread]


@pytest.mark.parametrize(("spread", "slots"), [(1, None), (3, None), (2, 6)])
def test_experts_are_computed_as_they_arrive_and_results_do_not_change(tiny_model, spread, slots):
    path = tiny_model(n_layers=4, n_experts=32, top_k=4, seed=8)
    plain = k3stream.load(path)
    source = ArrivingSource(GGUFExpertSource(plain.expert_source.checkpoint), spread, slots)
    model = k3stream.load(path, LoadOptions(expert_source=source, prefetch=False))
    tokens = list(range(3, 40))
    assert torch.equal(model.logits(tokens), plain.logits(tokens))
    for layer in sorted({layer for _, layer, _ in source.calls}):
        calls = [(call, experts) for call, at, experts in source.calls if at == layer]
        first_call, first_ids = calls[0]
        assert first_call == "read_ahead" and first_ids == sorted(first_ids)
        read = [expert for call, experts in calls if call == "read_ahead" for expert in experts]
        step = len(read)
        if slots and step > slots // 2:  # a step larger than half the cache reads a group ahead
            assert len(first_ids) == min(slots // 2, -(-step // GROUPS_PER_STEP))
        else:
            assert len(first_ids) == step
        assert calls[1][0] == "fetch"
        fetched = [expert for call, experts in calls if call == "fetch" for expert in experts]
        assert sorted(fetched) == sorted(read) == sorted(set(read))  # each read ahead once, fetched once
        assert all(len(experts) <= (slots or len(read)) for call, experts in calls if call == "fetch")
        if spread > 1:
            assert fetched != sorted(fetched)  # computed in the order they arrived, not pack order


@pytest.mark.parametrize("spread", [1, 3])
def test_a_decode_token_whose_experts_all_arrived_is_one_fetch_and_results_do_not_change(tiny_model, spread):
    path = tiny_model(n_layers=4, n_experts=32, top_k=4, seed=8)
    plain = k3stream.load(path)
    source = ArrivingSource(GGUFExpertSource(plain.expert_source.checkpoint), spread, None)
    model = k3stream.load(path, LoadOptions(expert_source=source, prefetch=False))
    states = [plain.new_state(), model.new_state()]
    for each, state in zip((plain, model), states, strict=True):
        each.prefill(state, [3, 4, 5])
    source.calls.clear()
    logits = [each.decode(state, 6) for each, state in zip((plain, model), states, strict=True)]
    assert torch.equal(*logits)
    fetches = [(layer, experts) for call, layer, experts in source.calls if call == "fetch"]
    layers = {layer for _, layer, _ in source.calls}
    if spread == 1:  # every expert read ahead is ready: one fetch a layer, in pack order
        assert len(fetches) == len(layers) and all(experts == sorted(experts) for _, experts in fetches)
    else:  # they arrive a few at a time: fetched as they do
        assert len(fetches) > len(layers)


class HoldingSource(ArrivingSource):
    """Reads ahead, everything read is ready at once, and the experts `holds` are in RAM from the start."""

    def __init__(self, inner: GGUFExpertSource, slots: int, holds: set[int]) -> None:
        super().__init__(inner, 1, slots)
        self.holds = holds

    def ready(self, layer: int, expert_ids: list[int]) -> list[int]:
        return [e for e in expert_ids if e in self.holds or (layer, e) in self.read]


def test_a_step_starting_on_experts_in_ram_computes_them_in_small_groups_while_its_reads_go_on(tiny_model):
    """A step larger than half the cache whose first experts are in RAM: while some of it is not yet
    asked for, each fetch is a small group (one large group of everything in RAM would leave the reads
    idle behind it), the reads slide on after each, what is asked for and not yet computed always
    fits the cache beside the group computing, and once a group is computed at most half the slots are
    asked ahead. Results do not change."""
    path = tiny_model(n_layers=4, n_experts=32, top_k=4, seed=8)
    plain = k3stream.load(path)
    slots = 16
    source = HoldingSource(GGUFExpertSource(plain.expert_source.checkpoint), slots, set(range(12)))
    model = k3stream.load(path, LoadOptions(expert_source=source, prefetch=False))
    tokens = list(range(3, 40))
    assert torch.equal(model.logits(tokens), plain.logits(tokens))
    for layer in sorted({layer for _, layer, _ in source.calls}):
        calls = [(call, experts) for call, at, experts in source.calls if at == layer]
        step = {expert for _, experts in calls for expert in experts}
        least = -(-len(step) // GROUPS_PER_STEP)
        asked: list[int] = []
        done = 0
        groups_while_reading = 0
        for call, experts in calls:
            if call == "read_ahead":
                asked += experts
                # once a group is computed, at most half the slots are asked ahead of what is computed
                # (the rest keep other layers' experts), though 12 led the step
                assert not done or len(asked) - done <= slots // 2, (layer, calls)
                continue
            assert len(asked) - done <= slots, (layer, calls)  # asked, not yet computed: in the cache
            if len(asked) < len(step):
                assert len(experts) <= least, (layer, calls)
                groups_while_reading += 1
            done += len(experts)
        assert groups_while_reading >= 2, (layer, calls)  # read on after the first group


def test_a_step_computed_in_groups_holds_its_pair_outputs_once(tiny_model):
    """A prefill step whose experts arrive in many groups copies each group's outputs into one buffer
    of the step's pairs and drops them: its peak stays under twice that buffer, where holding the
    groups, their join and its reorder at once takes three times it (8 of 64 experts a row, 1,024-wide
    outputs: the pairs' outputs are the step's largest buffer)."""
    from k3stream.memlimit import pin_malloc_mmap_threshold
    from memory_peak import peak_above

    pin_malloc_mmap_threshold()  # as every command does: freed buffers go back to the system
    path = tiny_model(recipe="audited", n_layers=4, n_experts=64, top_k=8, expert_ff=256, latent=1024,
                      kv_lora=256, qk_nope=32, seed=8)  # fmt: skip
    plain = k3stream.load(path)
    source = ArrivingSource(GGUFExpertSource(plain.expert_source.checkpoint), 3, None)
    model = k3stream.load(path, LoadOptions(expert_source=source, prefetch=False))
    tokens = torch.randint(0, model.config.vocab_size, (2048,), generator=torch.Generator().manual_seed(0))
    model.prefill_last(model.new_state(), tokens.tolist())  # the process's first large pass
    peak = peak_above(lambda: model.prefill_last(model.new_state(), tokens.tolist()))
    pair_outputs = len(tokens) * model.config.top_k * model.config.latent * 4
    assert pair_outputs < peak < 2 * pair_outputs
