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
(the default) two of them, the earliest first:
- steps of many rows (prefill): layer-ahead and then pre-attention (their union is predicted almost
  exactly, reads start a MoE block earlier, and the layer's own router refines the first hint; the
  expert store reads that second hint into free slots only);
- the others (decode): token, and then the pre-attention hint for what the token hint left out, no
  more than the layer's picks for the step's rows (top-k a row) less the token hint's experts: on the
  shipped trained model's held-out text the token hint is right 92-96% of the time and fills a
  decode row's top-k, the pre-attention hint 12-30%; on the random-weight real-dimension slice a
  token id is seldom seen twice (the token hint predicts 12% of the experts used) and the
  pre-attention hint is right 74% of the time, its top half by router score ~89%
  (GAP_HINT_RANKS: only that half goes out). That half goes out only once such hints at the layer
  were recently right at least SECOND_HINT_MIN_PRECISION of the time (`HintLog.trusted`); where it
  is not, it is still predicted and scored one step in GAP_PROBE_EVERY (the probe that can trust the
  layer again), not every step: its cost is the layer's router on its input (at Kimi-K3's size a
  7168 x 896 F32 product, ~26 MB a MoE layer), and nothing reads what it predicts.
"sent" counts what went out of all kinds, per layer and step.
"""

from __future__ import annotations

HINT_KINDS = ("pre-attention", "layer-ahead", "token")
HINT_CHOICES = ("auto", *HINT_KINDS)
SENT = "sent"  # the summaries' entry for what went out, all kinds together
GAP = "gap"  # the pending predictions' key for what would fill a token hint's gap
# "auto" sends layer-ahead hints for steps of at least this many rows
AUTO_LAYER_AHEAD_ROWS = 8
# a token hint is sent this many MoE layers before its layer: a whole layer of lead, and the cache holds
# the predictions of at most this many layers beyond the current one
TOKEN_HINT_LEAD = 1
# a hint that fills the token hint's gap goes out while its recent hints at the layer were right this
# often (the expert store's PREFETCH_MIN_PRECISION: when reads bound the step, a hint of precision p
# spends 1 - p of its reads on experts nobody uses); on the shipped trained model (top-2) the top
# pre-attention pick is right less often, and at 0.5 its gap hints read 1-2% more a token
SECOND_HINT_MIN_PRECISION = 0.75
# of each row's top-k by router score, the share a hint filling the token hint's gap sends: on the
# real-dimension slice's decode the pre-attention router's ranks 1-8 of 16 were used 83-96% of the
# time, ranks 9-16 40-75% (a wrong read lengthens a read-bound token)
GAP_HINT_RANKS = 0.5
HINT_TRUST_DECAY = 0.5  # the weight of a layer's past gap hints in their recent precision
# a layer whose gap hints are not trusted predicts and scores them one step in this many (the probe): on
# the shipped trained model none is trusted, and a router product every decode step is ~3% of its compute
GAP_PROBE_EVERY = 8


def sent_kinds(choice: str, rows: int) -> tuple[str, ...]:
    """The predictions sent to the expert source in a step of `rows` rows under `choice`, the earliest
    first: with "auto", a step of many rows sends its layer-ahead hint, any other step its token hint,
    and then, the layer's own router on its input, the pre-attention hint, which reads what the first
    left out of the layer's likeliest experts (each hint held to the store's allowance and share)."""
    if choice != "auto":
        return (choice,)
    return ("layer-ahead" if rows >= AUTO_LAYER_AHEAD_ROWS else "token", "pre-attention")


class HintLog:
    """Predictions waiting for their layer's routing, and per kind (and SENT): predicted, correct, used
    counts; per layer, the recent precision of the hints that fill the token hints' gaps (`trusted`)."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, set[int]]] = {}  # layer -> kind, SENT or GAP -> experts
        self._counts: dict[tuple[str, int], list[int]] = {}  # (kind, layer) -> predicted, correct, used
        self._gap_precision: dict[int, float] = {}  # layer -> decayed precision per gap hint
        self._since_gap: dict[int, int] = {}  # layer -> steps since its gap hint was last predicted

    def predicted(self, kind: str, layer: int, experts: list[int]) -> None:
        self._pending.setdefault(layer, {})[kind] = set(experts)

    def sent(self, layer: int, experts: list[int]) -> None:
        """`experts` of `layer` went out to the expert source (added to what its other hints sent this
        step; none: a step whose used experts count in the recall of what was sent)."""
        self._pending.setdefault(layer, {}).setdefault(SENT, set()).update(experts)

    def gap(self, layer: int, experts: list[int]) -> None:
        """`experts` of `layer` fill the step's token hint's gap, sent or not: scored for `trusted`."""
        self._pending.setdefault(layer, {})[GAP] = set(experts)

    def trusted(self, layer: int) -> bool:
        """Whether the hints filling the token hints' gaps at `layer` were recently right at least
        SECOND_HINT_MIN_PRECISION of the time: the first scored one's precision, then each next one's
        weighed in at 1 - HINT_TRUST_DECAY (not before any was scored: a wrong one wastes reads)."""
        return self._gap_precision.get(layer, 0.0) >= SECOND_HINT_MIN_PRECISION

    def gap_due(self, layer: int) -> bool:
        """Whether the hint filling the token hint's gap at `layer` is predicted this step (a step
        asks once): every step while `trusted` (it goes out), else one step in GAP_PROBE_EVERY, the
        first one at once."""
        since = self._since_gap.get(layer, GAP_PROBE_EVERY)
        due = self.trusted(layer) or since >= GAP_PROBE_EVERY
        self._since_gap[layer] = 1 if due else since + 1
        return due

    def used(self, layer: int, experts: list[int]) -> None:
        """The experts layer `layer` used this step: score the predictions made for it."""
        actual = set(experts)
        pending = self._pending.pop(layer, {})  # one pop a layer, not one a kind: a decode step's cost
        for kind, guess in pending.items():
            if kind != GAP:
                counts = self._counts.setdefault((kind, layer), [0, 0, 0])
                counts[0] += len(guess)
                counts[1] += len(guess & actual)
                counts[2] += len(actual)
        guess = pending.get(GAP)
        if guess:
            precision = len(guess & actual) / len(guess)
            recent = self._gap_precision.get(layer, precision)
            self._gap_precision[layer] = HINT_TRUST_DECAY * recent + (1 - HINT_TRUST_DECAY) * precision

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind and SENT, over all layers: precision (correct / predicted), recall (correct / used),
        counts."""
        totals = {kind: [0, 0, 0] for kind in (*HINT_KINDS, SENT)}
        for (kind, _layer), counts in self._counts.items():
            totals[kind] = [total + count for total, count in zip(totals[kind], counts, strict=True)]
        return {kind: _scores(*counts) for kind, counts in totals.items()}

    def by_layer(self) -> dict[str, dict[int, dict[str, float]]]:
        """The same per kind and MoE layer."""
        layers = sorted({layer for _kind, layer in self._counts})
        return {
            kind: {layer: _scores(*self._counts.get((kind, layer), (0, 0, 0))) for layer in layers}
            for kind in (*HINT_KINDS, SENT)
        }


def _scores(predicted: int, correct: int, used: int) -> dict[str, float]:
    return {
        "predicted": predicted,
        "correct": correct,
        "used": used,
        "precision": correct / predicted if predicted else 0.0,
        "recall": correct / used if used else 0.0,
    }
