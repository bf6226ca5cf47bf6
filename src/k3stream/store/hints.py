"""Which prefetch hints the store loads: adaptive scoring of each MoE layer's hints.

The experts each hint reads (those the compute tier lacks; of a suppressed hint, those it would have
read) are scored against the experts its layer's fetches ask for until the layer's next hint or the
end of the step (a step is fetched in several parts), whether the hint was issued or not (a hint
behind a step that sweeps the tier is not scored: it reads nothing whatever its record,
`ExpertStore.prefetch`). A layer's precision is its right experts over its hinted experts, both sums
decayed per hint, so a prefill hint of hundreds of experts weighs more than a decode hint of a few;
with `adaptive`, a layer's hints are issued only while that precision is at least
PREFETCH_MIN_PRECISION. Scoring suppressed hints too is the probe: a layer whose predictions improve
gets prefetch back without spending reads on it. Hints are kept per layer, not per thread: a hint is
scored by whichever fetches of its layer come next. A layer starts trusted, as if one right hint of
`prior` experts had been scored.

With `adaptive`, a hint reads no more absent experts than its layer's evidence covers: its decayed
right experts over PREFETCH_MIN_PRECISION (`allowance`), the first ones in the hint's order (a
prediction lists the experts most rows chose first). A layer's first prefill hint is hundreds of
experts on the evidence of `prior`: read whole, at the precision a random-weight model's routing has
(~25-40%), it spent more reads on unused experts than it saved, and made a cold prefill read more
with a larger budget (where the hint fitted the tier) than with a smaller one; a layer
whose hints prove right earns a larger allowance with each one (steady decode hints never reach it).

Each layer's fetches are numbered too: a hint queued before a fetch of its layer is stale when it runs.
Every method runs under the store's lock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

# a layer's hints are read only while this precise: when reads bound the step, a hint of precision p
# spends (1 - p) of its reads on experts nobody uses
PREFETCH_MIN_PRECISION = 0.75
PREFETCH_DECAY = 0.75  # the weight of a layer's past hints


class HintScores:
    def __init__(self, layers: Iterable[int], adaptive: bool, prior: int) -> None:
        self.adaptive = adaptive
        self.precision = {layer: 1.0 for layer in layers}
        # per layer: the decayed sums of right and of hinted experts
        self._sums = {layer: [float(prior), float(prior)] for layer in self.precision}
        self._pending: dict[int, set[int]] = {}  # each layer's hinted experts, not yet scored
        self._asked: dict[int, set[int]] = {}  # what its fetches asked for since
        self._fetches: Counter[int] = Counter()
        self._sweeping: set[int] = set()  # layers hinted larger than the hints' share, not yet fetched
        self._evicting: set[int] = set()  # layers whose pending hint may evict (`evicts`)
        self.counts = Counter(prefetch_stale=0, prefetch_suppressed=0)

    def active(self, layer: int) -> bool:
        """Whether `layer`'s hints are loaded (always, unless adaptive and too imprecise)."""
        return not self.adaptive or self.precision[layer] >= PREFETCH_MIN_PRECISION

    def fetched(self, layer: int, experts: list[int]) -> None:
        """A fetch of `layer` asked for `experts`: kept for scoring the layer's pending hint; numbered.
        It ends every layer's claim to evict for its coming step (`evicts`): the fetched layer's hint is
        scored, and another layer's step may evict what the others' hints read (a cold prefill's step of
        one layer sweeps the tier after the next layer's layer-ahead hint), so the next hint for their
        steps is again the first that may evict (the last layer's pre-attention hint, at its start)."""
        self._fetches[layer] += 1
        self._sweeping.discard(layer)
        self._evicting.clear()
        if layer in self._pending:
            self._asked.setdefault(layer, set()).update(experts)

    def follows(self, layer: int) -> bool:
        """Whether a hint of `layer` would follow another one for the same step that may evict
        (`evicts`), with no fetch since. One that reads into free slots only took nothing a full tier
        holds: the hint after it is the first for the step that may."""
        return layer in self._evicting

    def evicts(self, layer: int) -> None:
        """A hint of `layer` that may evict (within the hints' share) went out for its coming step."""
        self._evicting.add(layer)

    def sweeps(self, layer: int) -> None:
        """`layer` was hinted more absent experts than the hints' share of the tier: its step sweeps
        the tier."""
        self._sweeping.add(layer)

    def behind_sweep(self, layer: int) -> bool:
        """Whether another layer hinted to sweep the tier (`sweeps`) has not been fetched since: its step
        comes before `layer`'s."""
        return bool(self._sweeping - {layer})

    def hinted(self, layer: int, requested: int, absent: list[int]) -> list[int]:
        """A hint of `requested` experts, `absent` of them not in the compute tier (in the hint's order):
        those of `absent` to load, remembered for scoring (all of them when the layer's hints are
        suppressed: the probe); what is not loaded is counted as suppressed."""
        self._score(layer)
        pending = self._pending.setdefault(layer, set())
        if not self.active(layer):
            pending.update(absent)
            self.counts["prefetch_suppressed"] += requested
            return []
        loaded = absent[: self.allowance(layer)] if self.adaptive else absent
        pending.update(loaded)
        self.counts["prefetch_suppressed"] += len(absent) - len(loaded)
        return loaded

    def allowance(self, layer: int) -> int:
        """The most absent experts one hint of `layer` reads when adaptive: what its right experts so far
        vouch for."""
        return math.ceil(self._sums[layer][0] / PREFETCH_MIN_PRECISION)

    def step_over(self) -> None:
        """A step ended: score every hint whose layer was fetched; no hinted step sweeps the tier now."""
        self._sweeping.clear()
        for layer in list(self._asked):
            self._score(layer)

    def _score(self, layer: int) -> None:
        """Score `layer`'s pending hint against what its fetches asked for, if any fetch has."""
        asked = self._asked.pop(layer, None)
        if asked is None:
            return
        hinted = self._pending.pop(layer)
        if hinted:
            sums = self._sums[layer]
            sums[0] = PREFETCH_DECAY * sums[0] + len(hinted & asked)
            sums[1] = PREFETCH_DECAY * sums[1] + len(hinted)
            self.precision[layer] = sums[0] / sums[1]

    def serial(self, layer: int) -> int:
        """The number of `layer`'s fetches so far: a queued load checks it with `stale`."""
        return self._fetches[layer]

    def stale(self, layer: int, serial: int, count: int) -> bool:
        """Whether `layer` was fetched since `serial` was taken (then `count` experts are dropped)."""
        if self._fetches[layer] == serial:
            return False
        self.counts["prefetch_stale"] += count
        return True

    def snapshot(self, enabled: bool) -> dict[str, Any]:
        return {
            str(layer): {"precision": precision, "active": enabled and self.active(layer)}
            for layer, precision in sorted(self.precision.items())
        }
