"""How good each kind of expert prediction is: its precision and recall against the experts each MoE
layer then used, counted over a run.

The forward predicts a MoE layer's experts three ways, from what exists at three moments:
- "token": what the layer picked the last time each of the step's token ids passed it
  (`token_routes`), sent TOKEN_HINT_LEAD MoE layers before the layer (at the step's start for the
  first ones);
- "layer-ahead": the next MoE layer's router on this layer's stream after attention (before this
  layer's MoE), a whole MoE block earlier;
- "pre-attention": the layer's own router on its input stream, before its attention runs.
The one named by `K3Model.prefetch_hint` is predicted, counted and sent to the expert source (with
`K3Model.score_all_hints` the others are predicted and counted too, on the same run), or with "auto"
(the default) layer-ahead and then pre-attention for steps of many rows (prefill: their union is
predicted almost exactly, reads start a MoE block earlier, and the layer's own router refines the
first hint; the expert store reads that second hint into free slots only) and token for the others
(decode: on the shipped trained model's held-out text it is right 92-96% of the time, the
pre-attention hint 12-30%).
"""

from __future__ import annotations

HINT_KINDS = ("pre-attention", "layer-ahead", "token")
HINT_CHOICES = ("auto", *HINT_KINDS)
# "auto" sends layer-ahead hints for steps of at least this many rows
AUTO_LAYER_AHEAD_ROWS = 8
# a token hint is sent this many MoE layers before its layer: a whole layer of lead, and the cache holds
# the predictions of at most this many layers beyond the current one
TOKEN_HINT_LEAD = 1


def sent_kinds(choice: str, rows: int) -> tuple[str, ...]:
    """The predictions sent to the expert source in a step of `rows` rows under `choice`, the earliest
    first: with "auto", a step of many rows sends its layer-ahead hint and then, the layer's own router
    on its input, the pre-attention hint, which reads what the first left out of the layer's likeliest
    experts (each hint held to the store's allowance and share)."""
    if choice != "auto":
        return (choice,)
    return ("layer-ahead", "pre-attention") if rows >= AUTO_LAYER_AHEAD_ROWS else ("token",)


def sent_kind(choice: str, rows: int) -> str:
    """The first prediction sent in a step of `rows` rows under `choice` (`sent_kinds`)."""
    return sent_kinds(choice, rows)[0]


class HintLog:
    """Predictions waiting for their layer's routing, and per kind: predicted, correct, used counts."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], set[int]] = {}
        self._counts: dict[tuple[str, int], list[int]] = {}  # (kind, layer) -> predicted, correct, used

    def predicted(self, kind: str, layer: int, experts: list[int]) -> None:
        self._pending[(kind, layer)] = set(experts)

    def used(self, layer: int, experts: list[int]) -> None:
        """The experts layer `layer` used this step: score the predictions made for it."""
        actual = set(experts)
        for kind in HINT_KINDS:
            guess = self._pending.pop((kind, layer), None)
            if guess is not None:
                counts = self._counts.setdefault((kind, layer), [0, 0, 0])
                counts[0] += len(guess)
                counts[1] += len(guess & actual)
                counts[2] += len(actual)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind, over all layers: precision (correct / predicted), recall (correct / used), counts."""
        totals = {kind: [0, 0, 0] for kind in HINT_KINDS}
        for (kind, _layer), counts in self._counts.items():
            totals[kind] = [total + count for total, count in zip(totals[kind], counts, strict=True)]
        return {kind: _scores(*counts) for kind, counts in totals.items()}

    def by_layer(self) -> dict[str, dict[int, dict[str, float]]]:
        """The same per kind and MoE layer."""
        layers = sorted({layer for _kind, layer in self._counts})
        return {
            kind: {layer: _scores(*self._counts.get((kind, layer), (0, 0, 0))) for layer in layers}
            for kind in HINT_KINDS
        }


def _scores(predicted: int, correct: int, used: int) -> dict[str, float]:
    return {
        "predicted": predicted,
        "correct": correct,
        "used": used,
        "precision": correct / predicted if predicted else 0.0,
        "recall": correct / used if used else 0.0,
    }
