"""Expert predictions from token ids: each MoE layer's latest routing of every token id it has seen.

A trained model routes a token largely by what the token is: on the shipped model's held-out text, the
experts a token's row picked the last time the same token id passed a layer are 92-96% of what it
picks now (`benchmarks/bench_routing.py`). The table is learned from the model's own routing as it
runs (nothing to train or ship) and predicts every MoE layer's experts from the step's token ids before
any layer has run. Per layer it keeps the `MAX_TOKENS` token ids seen most recently.
"""

from __future__ import annotations

import numpy as np

MAX_TOKENS = 4096  # token ids remembered per MoE layer (the least recently seen is forgotten first)


class TokenRoutes:
    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        # layer -> token id -> its experts, as int16 bytes (compact: the real model has 92 MoE layers)
        self._latest: dict[int, dict[int, bytes]] = {}

    def learn(self, layer: int, token_ids: list[int], chosen: np.ndarray) -> None:
        """Rows with these token ids picked `chosen` [N, k] at `layer` (a host array: a decode step's
        one row converts without a torch operation, which costs tens of microseconds in a step whose
        weight reads evicted torch's code)."""
        table = self._latest.setdefault(layer, {})
        rows = chosen.astype(np.int16)
        data, width = rows.tobytes(), rows.shape[1] * rows.itemsize  # bytes slices: no row arrays
        for row, token in zip(range(len(rows)), token_ids, strict=True):
            table.pop(token, None)  # re-inserted last: the most recently seen
            table[token] = data[row * width : (row + 1) * width]
        while len(table) > self.max_tokens:
            del table[next(iter(table))]

    def predict(self, layer: int, token_ids: list[int]) -> list[int]:
        """The experts `layer` picked for these token ids last time, sorted (a token id never seen at
        `layer` predicts nothing)."""
        table = self._latest.get(layer, {})
        known = [table[token] for token in set(token_ids) if token in table]
        # a memoryview, not numpy: a decode step's one row is a few ids (and np.unique in numpy 2
        # imports numpy.ma on its first call: tens of ms inside a request's step)
        return sorted(set(memoryview(b"".join(known)).cast("h").tolist()))
