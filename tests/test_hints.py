"""Expert predictions in the forward: both kinds are scored against what each layer then used, and the
chosen kind reaches the expert source at its moment (pre-attention: just before the layer's own fetch;
layer-ahead: before the previous MoE layer's fetch)."""

from __future__ import annotations

import pytest

import k3stream
from k3stream.model.experts import GGUFExpertSource
from k3stream.model.hints import HINT_KINDS
from k3stream.model.moe import LatentMoE


class RecordingSource:
    """The GGUF source, with every fetch and prefetch it is asked for written down in order."""

    def __init__(self, inner: GGUFExpertSource) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, list[int]]] = []

    def fetch(self, layer: int, expert_ids: list[int]):
        self.calls.append(("fetch", layer, list(expert_ids)))
        return self.inner.fetch(layer, expert_ids)

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        self.calls.append(("prefetch", layer, list(expert_ids)))


def load_recording(path, hint: str):
    plain = k3stream.load(path)
    source = RecordingSource(GGUFExpertSource(plain.expert_source.checkpoint))
    return k3stream.load(path, expert_source=source, prefetch_hint=hint), source


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(n_layers=6, seed=5)


def moe_layers(model) -> list[int]:
    return [layer.index for layer in model.layers if isinstance(layer.ffn, LatentMoE)]


@pytest.mark.parametrize("hint", HINT_KINDS)
def test_the_chosen_hint_is_scored_exactly_and_sent_at_its_moment(model_path, hint):
    model, source = load_recording(model_path, hint)
    state = model.new_state()
    model.prefill(state, [1, 2, 3])
    for token in (4, 5, 6, 7):
        model.decode(state, token)
    layers = moe_layers(model)
    predicted = correct = used = 0
    pending: dict[int, set[int]] = {}
    for position, (kind, layer, experts) in enumerate(source.calls):
        if kind == "prefetch":
            pending[layer] = set(experts)
            fetched_before_it = [c[1] for c in source.calls[:position] if c[0] == "fetch"]
            if hint == "layer-ahead":  # issued before the previous MoE layer's fetch of this step
                previous = layers[layers.index(layer) - 1] if layer != layers[0] else None
                assert previous is None or fetched_before_it[-1:] != [previous]
            else:  # issued after the previous MoE layer's fetch, before this layer's
                assert layer == layers[0] or fetched_before_it[-1] == layers[layers.index(layer) - 1]
        elif layer in pending:
            guess = pending.pop(layer)
            predicted, correct, used = (
                predicted + len(guess),
                correct + len(guess & set(experts)),
                used + len(experts),
            )
    summary = model.hints.summary()[hint]
    assert (summary["predicted"], summary["correct"], summary["used"]) == (predicted, correct, used)
    assert predicted > 0 and 0.0 <= summary["precision"] <= 1.0
    other = next(kind for kind in HINT_KINDS if kind != hint)
    assert model.hints.summary()[other]["predicted"] > 0  # scored on the same run, never sent


def test_an_unknown_hint_is_refused(model_path):
    with pytest.raises(ValueError, match="prefetch hint must be one of pre-attention, layer-ahead"):
        k3stream.load(model_path, prefetch_hint="psychic")
