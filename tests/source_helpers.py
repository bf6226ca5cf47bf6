"""An expert source for the model tests: the GGUF's, with every call the model makes written down."""

from __future__ import annotations

from k3stream.experts import ExpertSource, ExpertWeights
from k3stream.model.experts import GGUFExpertSource


class RecordingSource(ExpertSource):
    """The GGUF source, taking hints (so the model sends them), with every fetch and prefetch it is
    asked for written down in order."""

    prefetches = True

    def __init__(self, inner: GGUFExpertSource) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, list[int]]] = []

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        self.calls.append(("fetch", layer, list(expert_ids)))
        return self.inner.fetch(layer, expert_ids)

    def prefetch(self, layer: int, expert_ids: list[int]) -> None:
        self.calls.append(("prefetch", layer, list(expert_ids)))
