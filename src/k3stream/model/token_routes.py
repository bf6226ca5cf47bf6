"""Expert predictions from token ids: each MoE layer's latest routing of every token id it has seen.

A trained model routes a token largely by what the token is: on the shipped model's held-out text, the
experts a token's row picked the last time the same token id passed a layer are 92-96% of what it
picks now (`benchmarks/bench_routing.py`). The table is learned from the model's own routing as it
runs (nothing to train or ship) and predicts every MoE layer's experts from the step's token ids before
any layer has run. Per layer it keeps the `MAX_TOKENS` token ids seen most recently.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_TOKENS = 4096  # token ids remembered per MoE layer (the least recently seen is forgotten first)


class TokenRoutes:
    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        # layer -> token id -> its experts, as int16 bytes (compact: the real model has 92 MoE layers)
        self._latest: dict[int, dict[int, bytes]] = {}

    def learn(self, layer: int, token_ids: list[int], chosen: torch.Tensor) -> None:
        """Rows with these token ids picked `chosen` [N, k] at `layer`."""
        table = self._latest.setdefault(layer, {})
        # numpy's conversion: in a decode step whose weight reads evicted torch's code, 2-3x cheaper
        for token, experts in zip(token_ids, chosen.cpu().numpy().astype(np.int16), strict=True):
            table.pop(token, None)  # re-inserted last: the most recently seen
            table[token] = experts.tobytes()
        while len(table) > self.max_tokens:
            del table[next(iter(table))]

    def predict(self, layer: int, token_ids: list[int]) -> list[int]:
        """The experts `layer` picked for these token ids last time, sorted (a token id never seen at
        `layer` predicts nothing)."""
        table = self._latest.get(layer, {})
        known = [table[token] for token in set(token_ids) if token in table]
        if not known:
            return []
        # not np.unique: numpy 2's imports numpy.ma on its first call (tens of ms inside a request's step)
        return sorted(set(np.frombuffer(b"".join(known), dtype=np.int16).tolist()))
