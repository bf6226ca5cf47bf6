"""Decode time per layer kind (KDA, MLA attention; dense FFN; MoE routed and shared), for benchmarks.

`profile_decode(model, state, tokens)` decodes the tokens on the path `decode` takes: where the model
runs one sequence's step as its decode program (`program.DecodeProgram`), each step of it timed with
the kind of the part it belongs to (`DecodeProgram.owners`); else eagerly, each kind's call timed. The
kinds: KDA and MLA attention, the dense FFN, the shared experts and the routed part of each MoE layer
(router, routed experts with their fetches, latent projections, the layer's hint bookkeeping). "other"
is the rest of the step (embedding, norms, residual mixes, hints sent ahead, the output head).

Within each kind the mat-vec calls into the C kernels (`products`, `grouped_product`, `expert_mlp`,
`chosen_experts`, `experts_at`: activations quantized, OpenMP region, the dot products) are timed apart
as its kernel time; the rest of the kind's time is the Python, torch and other C steps around them.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from k3stream.model.kda import KDA
from k3stream.model.mla import MLA
from k3stream.model.moe import LatentMoE, SituMLP
from k3stream.quant.kernels import cpu

KINDS = ("KDA attention", "MLA attention", "dense FFN", "MoE routed", "MoE shared", "other")
# the C library's mat-vec entry points (`quant.kernels.cpu` looks them up at each call)
MAT_VECS = ("products", "grouped_product", "expert_mlp", "chosen_experts", "experts_at")
# the RAM read rate's buffer: larger than any layer kind's weight bytes per token at Kimi-K3's shapes
# (KDA attention's 472 MB), far larger than the last-level cache; passes a measurement
RAM_PASS_BYTES = 512 << 20
RAM_PASSES = 9


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.kernel_seconds: dict[str, float] = defaultdict(float)
        self.in_moe = False
        self.running: list[str] = ["other"]  # the kinds whose calls are on the stack

    def timed(self, kind_of: Callable[[], str], call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            kind = kind_of()
            self.running.append("MoE routed" if kind == "MoE block" else kind)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - started
                self.running.pop()

        return run

    def kernel(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.kernel_seconds[self.running[-1]] += time.perf_counter() - started

        return run

    def step(self, kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """A program step of `kind` timed; the whole step its kernel time where it is a bound mat-vec."""
        mat_vec = getattr(call, "__name__", "") in MAT_VECS

        @functools.wraps(call)
        def run(*args: Any) -> Any:
            self.running.append(kind)
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[kind] += elapsed
                if mat_vec:
                    self.kernel_seconds[kind] += elapsed
                self.running.pop()

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
def _clocked(eager: bool) -> Iterator[_Clock]:
    """A clock wrapping the C library's mat-vecs, and with `eager` each kind's eager call (a program's
    steps are wrapped apart: its Python steps that call the eager code are timed once, as steps)."""
    clock = _Clock()
    patched = []
    if eager:
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
    library = cpu._ggml_cpu()
    if library is not None:
        patched += [(library, name, clock.kernel(getattr(library, name))) for name in MAT_VECS]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, wrapped in patched:
            setattr(owner, name, wrapped)
        yield clock
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def ram_read_rates(threads: int, size: int = RAM_PASS_BYTES, passes: int = RAM_PASSES) -> list[float]:
    """Bytes per second of each of `passes` reads of one `size`-byte buffer (a float32 sum on `threads`
    threads, torch's, in the kernels' OpenMP runtime). The buffer is a NumPy array, on transparent huge
    pages as the model's weights are (NumPy advises its large arrays for them; on this VM a read of 4
    KiB pages ran at half the rate), allocated and touched once before the passes."""
    import numpy as np
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    buffer = torch.from_numpy(np.ones(size // 4, dtype=np.float32))
    rates = []
    try:
        buffer.sum()  # warm: the pages mapped, the threads up
        for _ in range(passes):
            started = time.perf_counter()
            buffer.sum()
            rates.append(size / (time.perf_counter() - started))
    finally:
        torch.set_num_threads(previous)
    return rates


def profile_decode(model: Any, state: Any, tokens: list[int]) -> dict[str, Any]:
    """Decode `tokens` into `state` as `model.decode` does: ms per token of each kind in KINDS
    (`ms_per_token`), of its C mat-vec calls (`kernel_ms_per_token`), the total, and the path timed
    (`path`: "program" or "eager")."""
    program = model.program_for([state])
    if program is None:
        seconds, kernel_seconds, total = _eager_seconds(model, state, tokens)
    else:
        seconds, kernel_seconds, total = _program_seconds(model, program, state, tokens)
    per_token = {kind: 1e3 * seconds.get(kind, 0.0) / len(tokens) for kind in KINDS}
    kernels = {kind: 1e3 * kernel_seconds.get(kind, 0.0) / len(tokens) for kind in KINDS}
    return {
        "ms_per_token": per_token,
        "kernel_ms_per_token": kernels,
        "total_ms_per_token": 1e3 * total / len(tokens),
        "path": "eager" if program is None else "program",
    }


def _program_seconds(
    model: Any, program: Any, state: Any, tokens: list[int]
) -> tuple[dict[str, float], dict[str, float], float]:
    """Seconds of each kind and of its mat-vecs, and in all, decoding `tokens` by `program` (each step
    timed as its owner's kind; the library's mat-vecs wrapped for the Python steps that call them)."""
    shared = {id(layer.ffn.w.shared) for layer in model.layers if isinstance(layer.ffn, LatentMoE)}
    steps = program.steps
    with _clocked(eager=False) as clock:
        program.steps = [
            (clock.step(_kind_of(owner, shared), function), args, kept)
            for (function, args, kept), owner in zip(steps, program.owners, strict=True)
        ]
        try:
            total = _decode_seconds(model, state, tokens)
        finally:
            program.steps = steps
    seconds = dict(clock.seconds)
    seconds["other"] = total - sum(value for kind, value in seconds.items() if kind != "other")
    return seconds, dict(clock.kernel_seconds), total


def _decode_seconds(model: Any, state: Any, tokens: list[int]) -> float:
    """The wall seconds `model` takes to decode `tokens` one at a time into `state`."""
    started = time.perf_counter()
    for token in tokens:
        model.decode(state, token)
    return time.perf_counter() - started


def _kind_of(owner: object | None, shared: set[int]) -> str:
    """The kind a program step's owner (`DecodeProgram.owners`) is timed as; `shared`: the ids of the
    MoE layers' shared experts."""
    if isinstance(owner, KDA):
        return "KDA attention"
    if isinstance(owner, MLA):
        return "MLA attention"
    if isinstance(owner, LatentMoE):
        return "MoE routed"
    if isinstance(owner, SituMLP):
        return "MoE shared" if id(owner) in shared else "dense FFN"
    return "other"


def _eager_seconds(
    model: Any, state: Any, tokens: list[int]
) -> tuple[dict[str, float], dict[str, float], float]:
    """`_program_seconds` of the eager forward: each kind's call timed."""
    use_program = model.use_program
    model.use_program = False
    # the layers whose one-row steps are C calls bound once
    bound = [
        part
        for layer in model.layers
        for part in (layer.attn, layer.ffn)
        if isinstance(part, MLA | LatentMoE)
    ]
    try:
        with _clocked(eager=True) as clock:
            for part in bound:  # to the wrapped mat-vecs
                part.unbind()
            total = _decode_seconds(model, state, tokens)
    finally:
        model.use_program = use_program
        for part in bound:
            part.unbind()
    seconds = dict(clock.seconds)
    seconds["MoE routed"] = seconds.pop("MoE block", 0.0) - seconds.get("MoE shared", 0.0)
    seconds["other"] = total - sum(seconds.values())
    return seconds, dict(clock.kernel_seconds), total
