"""Decode time per layer kind (KDA, MLA attention; dense FFN; MoE routed and shared), for benchmarks.

`profile_decode(model, state, tokens)` decodes the tokens on the eager path (the decode program runs
whole layers in C and has no per-kind seams) with each kind's call timed: KDA and MLA attention, the
dense FFN, the shared experts and the whole MoE block (its routed part is the block less the shared
experts: router, routed experts with their fetches, latent projections). "other" is the rest of the
step (embedding, norms, residual mixes, the output head).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from k3stream.model.kda import KDA
from k3stream.model.mla import MLA
from k3stream.model.moe import LatentMoE, SituMLP

KINDS = ("KDA attention", "MLA attention", "dense FFN", "MoE routed", "MoE shared", "other")


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.in_moe = False

    def timed(self, kind_of: Callable[[], str], call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[kind_of()] += time.perf_counter() - started

        return run

    def moe(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.in_moe = True
            try:
                return call(*args, **kwargs)
            finally:
                self.in_moe = False

        return self.timed(lambda: "MoE block", run)


@contextmanager
def _clocked() -> Iterator[_Clock]:
    clock = _Clock()
    patched = [
        (KDA, "decode", clock.timed(lambda: "KDA attention", KDA.decode)),
        (MLA, "decode", clock.timed(lambda: "MLA attention", MLA.decode)),
        (
            SituMLP,
            "__call__",
            clock.timed(lambda: "MoE shared" if clock.in_moe else "dense FFN", SituMLP.__call__),
        ),
        (LatentMoE, "__call__", clock.moe(LatentMoE.__call__)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, wrapped in patched:
            setattr(owner, name, wrapped)
        yield clock
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def profile_decode(model: Any, state: Any, tokens: list[int]) -> dict[str, Any]:
    """Decode `tokens` into `state` eagerly; ms per token of each kind in KINDS, and the total."""
    use_program = model.use_program
    model.use_program = False
    try:
        with _clocked() as clock:
            started = time.perf_counter()
            for token in tokens:
                model.decode(state, token)
            total = time.perf_counter() - started
    finally:
        model.use_program = use_program
    seconds = dict(clock.seconds)
    seconds["MoE routed"] = seconds.pop("MoE block", 0.0) - seconds.get("MoE shared", 0.0)
    seconds["other"] = total - sum(seconds.values())
    per_token = {kind: 1e3 * seconds.get(kind, 0.0) / len(tokens) for kind in KINDS}
    return {"ms_per_token": per_token, "total_ms_per_token": 1e3 * total / len(tokens)}
