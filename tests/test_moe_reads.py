"""The MoE's reads against a source that reads ahead: a step's first part is asked for before the
projections that do not need it (routed_down, the shared experts) run, then fetched; the rest follows
part by part; results equal a source that reads nothing ahead, bit for bit."""

from __future__ import annotations

import torch

import k3stream
from k3stream.model.experts import GGUFExpertSource
from source_helpers import RecordingSource


class ReadingAheadSource(RecordingSource):
    reads_ahead = True

    def read_ahead(self, layer: int, expert_ids: list[int]) -> None:
        self.calls.append(("read_ahead", layer, list(expert_ids)))


def test_the_first_part_is_read_ahead_before_the_projections_and_results_do_not_change(tiny_model):
    path = tiny_model(n_layers=4, n_experts=32, top_k=4, seed=8)
    plain = k3stream.load(path)
    source = ReadingAheadSource(GGUFExpertSource(plain.expert_source.checkpoint))
    model = k3stream.load(path, expert_source=source, prefetch=False)
    tokens = list(range(3, 40))
    assert torch.equal(model.logits(tokens), plain.logits(tokens))
    for layer in sorted({layer for _, layer, _ in source.calls}):
        calls = [(call, experts) for call, at, experts in source.calls if at == layer]
        (first_call, first_ids), (second_call, second_ids) = calls[:2]
        assert (first_call, second_call) == ("read_ahead", "fetch") and first_ids == second_ids
        fetched = [expert for call, experts in calls if call == "fetch" for expert in experts]
        assert len(calls) > 3 and fetched == sorted(set(fetched))  # in parts, each expert once, in order
