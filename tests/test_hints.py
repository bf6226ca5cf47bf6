"""Expert predictions in the forward: every kind is scored against what each layer then used, and the
chosen kind reaches the expert source at its moment (pre-attention: just before the layer's own fetch;
layer-ahead and token: before the previous MoE layer's fetch)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import k3stream
from k3stream import LoadOptions
from k3stream.model.experts import GGUFExpertSource
from k3stream.model.hints import (
    AUTO_LAYER_AHEAD_ROWS,
    GAP_HINT_RANKS,
    GAP_PROBE_EVERY,
    HINT_KINDS,
    HINT_TRUST_DECAY,
    SECOND_HINT_MIN_PRECISION,
    HintLog,
)
from k3stream.model.moe import LatentMoE
from k3stream.model.token_routes import TokenRoutes
from source_helpers import RecordingSource


def load_recording(path, hint: str):
    plain = k3stream.load(path)
    source = RecordingSource(GGUFExpertSource(plain.expert_source.checkpoint))
    return k3stream.load(path, LoadOptions(expert_source=source, prefetch_hint=hint)), source


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(n_layers=6, seed=5)


def moe_layers(model) -> list[int]:
    return [layer.index for layer in model.layers if isinstance(layer.ffn, LatentMoE)]


def assert_sent_at_its_moment(calls: list, layers: list[int], kind: str) -> None:
    """pre-attention: after the previous MoE layer's fetch; layer-ahead: before it."""
    for position, (call, layer, _) in enumerate(calls):
        if call != "prefetch" or layer == layers[0]:
            continue
        last_fetch = [c[1] for c in calls[:position] if c[0] == "fetch"][-1:]
        previous = layers[layers.index(layer) - 1]
        assert (last_fetch == [previous]) == (kind == "pre-attention"), (kind, layer, calls[:position])


def exact_score(calls: list) -> tuple[int, int, int]:
    """(predicted, correct, used) of the hints sent, each against the next fetch of its layer."""
    predicted = correct = used = 0
    pending: dict[int, set[int]] = {}
    for call, layer, experts in calls:
        if call == "prefetch":
            pending[layer] = set(experts)
        elif layer in pending:
            guess = pending.pop(layer)
            predicted, correct, used = (
                predicted + len(guess),
                correct + len(guess & set(experts)),
                used + len(experts),
            )
    return predicted, correct, used


@pytest.mark.parametrize("hint", HINT_KINDS)
def test_the_chosen_hint_is_scored_exactly_and_sent_at_its_moment(model_path, hint):
    model, source = load_recording(model_path, hint)
    model.score_all_hints = True
    state = model.new_state()
    model.prefill(state, [1, 2, 3])
    for token in (4, 2, 6, 1, 4):  # some seen before: the token hint predicts only those
        model.decode(state, token)
    assert_sent_at_its_moment(source.calls, moe_layers(model), hint)
    summary = model.hints.summary()[hint]
    predicted, correct, used = exact_score(source.calls)
    assert (summary["predicted"], summary["correct"]) == (predicted, correct)
    # a token never seen predicts nothing and sends nothing, but what its step used still counts
    assert summary["used"] == used if hint != "token" else summary["used"] > used
    assert summary["predicted"] > 0 and 0.0 <= summary["precision"] <= 1.0
    other = next(kind for kind in HINT_KINDS if kind != hint)
    assert model.hints.summary()[other]["predicted"] > 0  # scored on the same run, never sent
    per_layer = model.hints.by_layer()[hint]
    assert sorted(per_layer) == moe_layers(model)
    assert sum(scores["correct"] for scores in per_layer.values()) == summary["correct"]


def test_the_hint_not_sent_costs_nothing_unless_asked_for(model_path):
    model, _ = load_recording(model_path, "pre-attention")
    model.logits([1, 2, 3, 4])
    assert model.hints.summary()["pre-attention"]["predicted"] > 0
    assert model.hints.summary()["layer-ahead"]["predicted"] == 0  # no router product spent on it
    assert model.hints.summary()["token"]["predicted"] == 0
    # no routing learned per token either
    assert all(model.token_routes.predict(layer, [1, 2, 3, 4]) == [] for layer in moe_layers(model))


def assert_prefill_hints(calls: list, layers: list[int]) -> None:
    """Two hints a layer: layer-ahead, then the layer's own router's, around the previous layer's fetch."""
    at = {}  # each (call, layer)'s positions in the calls
    for position, (call, layer, _) in enumerate(calls):
        at.setdefault((call, layer), []).append(position)
    for previous, layer in zip([None, *layers], layers, strict=False):
        hints = at[("prefetch", layer)]
        assert len(hints) == 2, (layer, calls)
        if previous is not None:
            assert hints[0] < at[("fetch", previous)][0] < hints[1], (layer, calls)


def test_auto_sends_layer_ahead_then_pre_attention_hints_in_prefill_and_token_hints_in_decode(model_path):
    model, source = load_recording(model_path, "auto")
    state = model.new_state()
    model.prefill(state, list(range(1, 1 + AUTO_LAYER_AHEAD_ROWS)))
    layers = moe_layers(model)
    assert_prefill_hints(source.calls, layers)
    source.calls.clear()
    model.decode(state, 3)  # seen in the prefill: each layer's experts for it then are the whole hint
    prefetched = [(layer, experts) for call, layer, experts in source.calls if call == "prefetch"]
    assert sorted(layer for layer, _ in prefetched) == layers  # one a layer: it fills the layer's top-k
    assert all(len(experts) == model.layers[layer].ffn.routing.top_k for layer, experts in prefetched)
    assert_sent_at_its_moment(source.calls, layers, "token")


def test_a_prefill_whose_last_layer_keeps_one_row_sends_that_layer_a_prefills_hints(model_path):
    """`prefill_last` (and a batched prefill) run the last layer one row a sequence past its attention;
    the layer's hints are still chosen by the step's rows, so its reads start before its router."""
    model, source = load_recording(model_path, "auto")
    model.prefill_last(model.new_state(), list(range(1, 1 + AUTO_LAYER_AHEAD_ROWS)))
    assert_prefill_hints(source.calls, moe_layers(model))


def test_auto_decode_sends_the_pre_attention_hint_where_the_token_hint_has_nothing(model_path):
    """A token id never seen: the top of the layer's own router's picks on its input is the hint, at
    its moment, while the layer's recent pre-attention hints were right; a layer whose were not sends
    nothing (and predicts it only at its probes)."""
    model, source = load_recording(model_path, "auto")
    state = model.new_state()
    model.prefill(state, [1, 2, 3])
    layers = moe_layers(model)
    distrusted = layers[0]
    for _ in range(8):  # gap hints all right, of this layer all wrong
        for layer in layers:
            model.hints.gap(layer, [0])
            model.hints.used(layer, [1 if layer == distrusted else 0])
    assert not model.hints.trusted(distrusted) and all(model.hints.trusted(layer) for layer in layers[1:])
    source.calls.clear()
    before, before_layer = model.hints.summary(), model.hints.by_layer()["sent"][distrusted]
    model.decode(state, 99)
    prefetched = {layer: experts for call, layer, experts in source.calls if call == "prefetch"}
    assert sorted(prefetched) == layers[1:]
    assert_sent_at_its_moment(source.calls, layers, "pre-attention")
    top_k = model.layers[layers[1]].ffn.routing.top_k
    confident = math.ceil(GAP_HINT_RANKS * top_k)  # the top of the router's picks by score
    assert 0 < confident < top_k and all(len(experts) == confident for experts in prefetched.values())
    after = model.hints.summary()
    # the distrusted layer's probe ran in the prefill, a step ago: it predicts nothing this step
    for kind, count in (("pre-attention", top_k), ("sent", confident)):
        assert after[kind]["predicted"] - before[kind]["predicted"] == count * (len(layers) - 1), kind
    # the distrusted layer sent nothing: what it used counts against the recall of what was sent
    after_layer = model.hints.by_layer()["sent"][distrusted]
    assert after_layer["predicted"] == before_layer["predicted"]
    assert after_layer["used"] - before_layer["used"] == top_k


def test_token_routes_remember_each_layers_latest_experts_per_token():
    routes = TokenRoutes(max_tokens=2)
    routes.learn(1, [7, 8, 7], np.array([[0, 1], [2, 3], [4, 5]]))
    assert routes.predict(1, [7]) == [4, 5]  # the latest row of token 7
    assert routes.predict(1, [7, 7]) == routes.predict(1, [7])  # one token id: the many ids' answer
    assert routes.predict(1, [8, 7, 9]) == [2, 3, 4, 5] and routes.predict(2, [7]) == []
    routes.learn(1, [9], np.array([[6, 7]]))  # a third token id: the least recently seen goes
    assert routes.predict(1, [8]) == [] and routes.predict(1, [7, 9]) == [4, 5, 6, 7]


def test_an_unknown_hint_is_refused():
    with pytest.raises(ValueError, match="prefetch_hint must be one of auto, pre-attention, layer-ahead"):
        LoadOptions(prefetch_hint="psychic")


def test_token_hints_go_out_their_lead_of_moe_layers_early(model_path):
    """Lead N: the first N MoE layers' token hints at the step's start (before any fetch), then each
    layer's as the MoE layer N before it starts (before that layer's fetch)."""
    model, source = load_recording(model_path, "token")
    layers = moe_layers(model)
    state = model.new_state()
    model.prefill(state, [3, 5])
    for lead in range(1, len(layers) + 1):
        model.set_token_hint_lead(lead)
        source.calls.clear()
        model.decode(state, 3)
        fetches_before = {}
        for position, (call, layer, _) in enumerate(source.calls):
            if call == "prefetch":
                fetches_before[layer] = [c[1] for c in source.calls[:position] if c[0] == "fetch"]
        assert sorted(fetches_before) == layers
        for i, layer in enumerate(layers):
            assert fetches_before[layer] == layers[: max(0, i - lead)], (lead, layer)
    for bad in (0, len(layers) + 1):
        with pytest.raises(ValueError, match="token hint lead must be 1.."):
            model.set_token_hint_lead(bad)


def test_a_layers_gap_hints_are_trusted_while_recently_right_often_enough():
    """Not before any gap hint was scored; the first one's precision, then each next one weighed in at
    1 - HINT_TRUST_DECAY; a hint not sent is scored too (the probe); other layers keep their own; the
    kinds' counts are not the gap's."""
    log = HintLog()
    assert not log.trusted(1)
    log.gap(1, [0, 1])
    log.used(1, [0, 1, 9])
    assert log.trusted(1) and not log.trusted(2)
    recent = 1.0
    for right in (0, 1, 2, 2, 2):  # of 2: a wrong hint stops them, right ones bring them back
        log.gap(1, [5, 6])
        log.used(1, [5, 6][:right] + [9])
        recent = HINT_TRUST_DECAY * recent + (1 - HINT_TRUST_DECAY) * right / 2
        assert log.trusted(1) == (recent >= SECOND_HINT_MIN_PRECISION), (right, recent)
    assert log.trusted(1) and recent < 1.0
    assert log.summary()["pre-attention"]["predicted"] == 0


def test_an_untrusted_layers_gap_hint_is_predicted_one_step_in_gap_probe_every(model_path):
    """The router of a layer whose gap hints are not trusted runs one decode step in GAP_PROBE_EVERY
    (the first at once), a trusted layer's every step; logits are those of a model without hints."""
    model, _ = load_recording(model_path, "auto")
    plain = k3stream.load(model_path, LoadOptions(prefetch=False))
    state, plain_state = model.new_state(), plain.new_state()
    layers = moe_layers(model)
    distrusted = layers[0]
    steps = 2 * GAP_PROBE_EVERY
    for token in range(100, 100 + steps):  # ids never seen: each step's token hint has nothing
        for _ in range(8):  # gap hints all right, of one layer all wrong
            for layer in layers:
                model.hints.gap(layer, [0])
                model.hints.used(layer, [1 if layer == distrusted else 0])
        assert torch.equal(model.decode(state, token), plain.decode(plain_state, token))
    predicted = {
        layer: scores["predicted"] for layer, scores in model.hints.by_layer()["pre-attention"].items()
    }
    top_k = model.layers[distrusted].ffn.routing.top_k
    assert predicted[distrusted] == steps // GAP_PROBE_EVERY * top_k
    assert all(predicted[layer] == steps * top_k for layer in layers[1:]), predicted


def test_gap_hints_are_due_every_step_while_trusted_else_one_step_in_gap_probe_every():
    log = HintLog()
    assert [log.gap_due(1) for _ in range(2 * GAP_PROBE_EVERY)] == (
        [True] + [False] * (GAP_PROBE_EVERY - 1)
    ) * 2
    log.gap(1, [0])
    log.used(1, [0])
    assert log.trusted(1) and all(log.gap_due(1) for _ in range(GAP_PROBE_EVERY + 1))
    assert log.gap_due(2)  # another layer's own count
