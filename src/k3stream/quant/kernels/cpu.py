"""The C CPU kernels (`ggml_cpu.c`, `steps_cpu.c` and `iquants_cpu.c`, built at install as `_ggml_cpu`).

`grouped_product` runs `out[p] = x[rows[p]] @ W_b^T` for the rows `starts[b]..starts[b+1]` of each
matrix b in one call, `products` several matrices of different types on one input, `expert_mlp` a
step's routed-expert MLP (its three products and the activation) in one call (`chosen_experts` for a
row's experts all in RAM); `kda_recurrent`, `residual_mix`, `rms_norm`, `situ`, `route`, `add`, `combine`
`mla_attend` and `sigmoid_gate` one per-token step each, `copy` the copies between a decode token's
buffers, `decode_row` its embedding; `read_parts` a step's expert reads. All are the extension
module's own functions, threads from `torch.get_num_threads()` (one for a small product). `bind_*` give
a step as a `Call` on fixed buffers (the decode program, `k3stream.model.program`, runs a token as a
list of them). `available()` says whether it was built; without it callers use the torch reference
path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

# a C step bound to fixed buffers: function(*args) runs it (a nonzero result is its error status); the
# tensors its addresses point into are held in the third item for as long as the call is kept
Call = tuple[Callable[..., Any], tuple, tuple]

# the i-quants and ternary types (`iquants_cpu.c`): on float activations by the float tile path (a C
# decoder a type), with `q8_activations` by ggml's integer kernels
IQ_TYPES = frozenset({16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35})
# GGML type ids with a C kernel on float activations (a decoder: also `decode_row`)
# the type id of an F32 matrix stored input-major ([in, out], float32; no GGML type): `products` and
# `expert_mlp` sum each output in one chain over its inputs, the same bits at any row count
INPUT_MAJOR_F32 = 1000
CPU_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30, 39, 40}) | IQ_TYPES
# ... and with integer kernels on 8-bit activations, as ggml's: Q8_K for the K-quants, the i-quants but
# IQ4_NL and the ternary types, Q8_0 for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4 and NVFP4, Q8_1 for Q4_1 and Q5_1
Q8_TYPES = frozenset({10, 11, 12, 13, 14, 2, 3, 6, 7, 8, 39, 40}) | IQ_TYPES

log = logging.getLogger(__name__)
# what a user without the extension is told, once a process, and `kernels_report` says
NOT_BUILT = (
    "the C kernels are not in this install: every product on the CPU takes the torch reference path, "
    "several times slower. pip builds them where a C compiler is present (GCC or clang, with "
    "OpenMP for threads): install one and reinstall k3stream (docs/kernels.md)"
)
# ... and one whose C compiler had no OpenMP (Apple's clang)
NO_OPENMP = (
    "the C kernels were built without OpenMP (the C compiler had none, as Apple's clang): they run on "
    "one thread. A compiler with OpenMP (GCC, or clang with libomp) and a reinstall give them threads "
    "(docs/kernels.md)"
)


@functools.lru_cache(maxsize=1)
def _ggml_cpu() -> ModuleType | None:
    """The extension module (its functions are called directly: ctypes costs more than a small step),
    or None when it was not built (said once, as a warning)."""
    try:
        from k3stream.quant.kernels import _ggml_cpu as module
    except ImportError as exc:
        log.warning("warning: %s (%s)", NOT_BUILT, exc)
        return None
    module.set_iq_grids(*_iq_grids())
    if not module.openmp():
        log.warning("warning: %s", NO_OPENMP)
    return module


def _iq_grids() -> list[bytes]:
    """The i-quants' lookup grids and value tables from the `gguf` package, as `set_iq_grids` takes them:
    IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, then IQ4_NL's and MXFP4's values, a byte each."""
    from gguf import quants

    grids = []
    for kind in (quants.IQ2_XXS, quants.IQ2_XS, quants.IQ2_S, quants.IQ3_XXS, quants.IQ3_S, quants.IQ1_S):
        kind.init_grid()
        grids.append(np.asarray(kind.grid).astype(np.int8).tobytes())
    values = [np.asarray(kind.kvalues).astype(np.int8).tobytes() for kind in (quants.IQ4_NL, quants.MXFP4)]
    return grids + values


def available() -> bool:
    """Whether the C kernels were built with this install."""
    return _ggml_cpu() is not None


def isa() -> str:
    """The instruction set the integer kernels take now: "avx512" (AVX-512 with VNNI and VBMI, unless
    K3STREAM_NO_AVX512=1), "avx2" or "portable" (K3STREAM_GENERIC_KERNELS=1, or neither)."""
    return _ggml_cpu().isa()


def kernels_report() -> str:
    """The CPU kernels this install runs, for a user: the C kernels' instruction set (`isa`) and, built
    without OpenMP, their one thread; or none (the warning `_ggml_cpu` gives says why and what to do)."""
    if not available():
        return "none (the torch reference path)"
    return f"C ({isa()})" if _ggml_cpu().openmp() else f"C ({isa()}, one thread: built without OpenMP)"


def release_openmp_workers() -> bool:
    """End the calling thread's idle OpenMP workers (torch's and the C kernels' runtime), before another
    thread takes over the kernels: libgomp lets idle workers spin only while the threads of every team
    fit the CPUs, so one team left behind makes every region of the new one wake its workers from
    sleep (a 2-thread decode 15-25% slower). False where the runtime cannot (no C kernels; no OpenMP 5)."""
    module = _ggml_cpu()
    return module is not None and module.release_openmp_workers()


def takes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the C steps (`kda_recurrent`, `residual_mix`, `rms_norm`, `situ`, `route`) may take these
    tensors: the library is built and each is float32, contiguous, on the CPU, not followed by autograd."""
    for t in tensors:  # a loop, not all(...): called ~100 times a token
        if not (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and not t.requires_grad):
            return False
    return available()


def grouped_product(
    x: torch.Tensor,
    matrices: Sequence[torch.Tensor],
    ggml_type: int,
    out_features: int,
    row_bytes: int,
    starts: torch.Tensor,
    rows: torch.Tensor,
    q8_activations: bool = False,
) -> torch.Tensor:
    """[P, out_features] float32: rows `starts[b]..starts[b+1]` of the result are `x[rows[p]]` times
    matrix b (contiguous uint8 GGUF bytes, `out_features` rows of `row_bytes`). x: float32 [R, K] on
    the CPU; starts/rows: int64. The matrices must stay alive for the call (they do: the caller holds
    them). `q8_activations` (types in Q8_TYPES): x is quantized to Q8_K, Q8_0 or Q8_1 as ggml does and
    the products are integer dot products per block, as ggml's."""
    out = torch.empty(rows.numel(), out_features, dtype=torch.float32)
    layout = (ggml_type, out_features, row_bytes)
    function, args, _ = bind_grouped_product(
        x.contiguous(), matrices, layout, starts, rows, out, torch.get_num_threads(), q8_activations
    )
    _check(function(*args), ggml_type, q8_activations)
    return out


def bind_grouped_product(
    x: torch.Tensor,
    matrices: Sequence[torch.Tensor],
    layout: tuple[int, int, int],
    starts: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    q8_activations: bool = False,
) -> Call:
    """`grouped_product` of x (contiguous) into `out` as a bound call; `layout`: the matrices' GGML type,
    output rows and bytes per row."""
    ggml_type, out_features, row_bytes = layout
    args = (
        x.data_ptr(), x.shape[1], [m.data_ptr() for m in matrices], out_features, row_bytes, ggml_type,
        starts.data_ptr(), rows.data_ptr(), out.data_ptr(), threads, int(q8_activations),
    )  # fmt: skip
    return _ggml_cpu().grouped_product, args, (x, *matrices, starts, rows, out)


def products(
    x: torch.Tensor,
    addresses: list[int],
    ggml_types: list[int],
    out_features: list[int],
    row_bytes: list[int],
    q8_activations: list[int],
) -> torch.Tensor:
    """[N, sum(out_features)]: x [N, K] (float32, contiguous, on the CPU) times each of several matrices
    (their bytes' addresses, GGML types, output rows, bytes per row and `q8_activations` flags, as
    `grouped_product` takes them), side by side in that order: one call for the projections a layer
    takes of one input, each computed as `grouped_product` computes it alone. The matrices must stay
    alive for the call."""
    out = torch.empty(x.shape[0], sum(out_features), dtype=torch.float32)
    arguments = (addresses, ggml_types, out_features, row_bytes, q8_activations)
    function, args, _ = bind_products(x, arguments, out, torch.get_num_threads())
    status = function(*args)
    if status != 0:
        _check(
            status, next((t for t in ggml_types if t not in CPU_TYPES), ggml_types[0]), any(q8_activations)
        )
    return out


def bind_products(x: torch.Tensor, arguments: tuple, out: torch.Tensor, threads: int) -> Call:
    """`products` of x into `out` as a bound call; `arguments`: its addresses, GGML types, output rows,
    bytes per row and `q8_activations` flags."""
    args = (x.data_ptr(), x.shape[1], x.shape[0], *arguments, out.data_ptr(), threads)
    return _ggml_cpu().products, args, (x, out)


def set_reads_busy(busy: bool) -> None:
    """Tell the kernels whether the expert store's pack reads are in flight (`region_threads`)."""
    module = _ggml_cpu()
    if module is not None:
        module.set_reads_busy(busy)


def set_reads_yield(on: bool) -> None:
    """Whether a mat-vec region (x one row: a decode's) takes one thread fewer while pack
    reads are in flight (on by default): the CPU it leaves takes the readers' wake-ups, digests and the
    disk's interrupts, which would otherwise preempt one of the region's threads while the others wait
    for it."""
    module = _ggml_cpu()
    if module is not None:
        module.set_reads_yield(on)


def region_threads(threads: int) -> int:
    """The threads a mat-vec region asked for `threads` takes now (one fewer while reads are in flight)."""
    return _ggml_cpu().region_threads(threads)


def run_calls(steps: list[Call]) -> None:
    """Runs bound calls in order; a C call's nonzero status (no memory) raises MemoryError."""
    for function, args, _ in steps:
        status = function(*args)
        if status:
            raise MemoryError(f"decode step {function.__name__}: status {status} (no memory)")


def python_step(function: Callable[[], object]) -> Call:
    """A Python step among bound calls (what it returns is dropped)."""
    return _dropping_result, (function,), ()


def _dropping_result(function: Callable[[], object]) -> None:
    function()


@dataclass(frozen=True)
class Role:
    """One role (gate, up or down) of a step's experts for `expert_mlp`: each expert's matrix (contiguous
    uint8 GGUF bytes), their GGML type, output rows and bytes per row."""

    matrices: Sequence[torch.Tensor]
    ggml_type: int
    out_features: int
    row_bytes: int


def expert_mlp(
    x: torch.Tensor,
    gate: Role,
    up: Role,
    down: Role,
    starts: torch.Tensor,
    rows: torch.Tensor,
    beta: float,
    linear_beta: float,
    q8_activations: bool = False,
) -> torch.Tensor:
    """[P, down.out_features]: down(situ(gate(x), up(x))) of expert b on `x[rows[p]]` for p in
    `starts[b]..starts[b+1]`; the same products and activation as `grouped_product` and `situ`, in one
    call without the GIL."""
    out = torch.empty(rows.numel(), down.out_features, dtype=torch.float32)
    roles = (gate, up, down)
    function, args, _ = bind_expert_mlp(
        x.contiguous(), roles, starts, rows, (beta, linear_beta), out, torch.get_num_threads(), q8_activations
    )
    _check(function(*args), gate.ggml_type, q8_activations)
    return out


def bind_expert_mlp(
    x: torch.Tensor,
    roles: tuple[Role, Role, Role],
    starts: torch.Tensor,
    rows: torch.Tensor,
    betas: tuple[float, float],
    out: torch.Tensor,
    threads: int,
    q8_activations: bool = False,
) -> Call:
    """`expert_mlp` of x (contiguous) with its (gate, up, down) roles into `out` as a bound call."""
    gate, up, down = roles
    args = (
        x.data_ptr(), x.shape[1], [m.data_ptr() for m in gate.matrices], gate.ggml_type, gate.row_bytes,
        [m.data_ptr() for m in up.matrices], up.ggml_type, up.row_bytes,
        [m.data_ptr() for m in down.matrices], down.ggml_type, down.row_bytes, gate.out_features,
        down.out_features, starts.data_ptr(), rows.data_ptr(), *betas, out.data_ptr(), threads,
        int(q8_activations),
    )  # fmt: skip
    return _ggml_cpu().expert_mlp, args, (x, starts, rows, out, roles)


def bind_chosen_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    roles: Sequence[tuple[torch.Tensor, int, Role]],
    experts: int,
    betas: tuple[float, float],
    out: torch.Tensor,
    threads: int,
    q8_activations: bool = False,
) -> Call:
    """`expert_mlp` of one row x (contiguous) through the experts `chosen` [1, k] (int64) picks, one pair
    each in the order of choice, into out [k, down rows], as a bound call: `roles` (gate, up, down) each
    (the bytes of all `experts` experts, bytes per expert, its Role without matrices), expert e's matrix
    at e times the bytes per expert; the addresses are worked out in C at each call."""
    gate, down = roles[0][2], roles[2][2]
    per_role = [
        number
        for data, nbytes, role in roles
        for number in (data.data_ptr(), nbytes, role.ggml_type, role.row_bytes)
    ]
    args = (
        x.data_ptr(), x.shape[1], chosen.data_ptr(), chosen.shape[1], experts, *per_role, gate.out_features,
        down.out_features, *betas, out.data_ptr(), threads, int(q8_activations),
    )  # fmt: skip
    return _ggml_cpu().chosen_experts, args, (x, chosen, out, *(data for data, _, _ in roles))


def bind_experts_at(
    x: torch.Tensor,
    objects: torch.Tensor,
    roles: Sequence[tuple[int, Role]],
    betas: tuple[float, float],
    pairs: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    q8_activations: bool = False,
) -> Call:
    """`expert_mlp` of one row x (contiguous) through the experts whose objects lie at the addresses
    `objects` [k] (int64) holds at each call, one pair each in that order, into pairs [k, down rows],
    then their `combine` by weights [1, k] into out [1, down rows], as a bound call: `roles` (gate, up,
    down) each (its matrix's offset in an object, its Role without matrices). `objects[0] == 0` at a
    call: it does nothing. Whoever fills `objects` keeps those objects in place until the call returns."""
    gate, down = roles[0][1], roles[2][1]
    per_role = [number for offset, role in roles for number in (offset, role.ggml_type, role.row_bytes)]
    args = (
        x.data_ptr(), x.shape[1], objects.data_ptr(), objects.numel(), *per_role, gate.out_features,
        down.out_features, *betas, pairs.data_ptr(), weights.data_ptr(), out.data_ptr(), threads,
        int(q8_activations),
    )  # fmt: skip
    return _ggml_cpu().experts_at, args, (x, objects, pairs, weights, out)


def bind_combine(pairs: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> Call:
    """`combine` into `out` as a bound call."""
    rows, top_k = weights.shape
    args = (pairs.data_ptr(), weights.data_ptr(), rows, top_k, pairs.shape[1], out.data_ptr())
    return _ggml_cpu().combine, args, (pairs, weights, out)


def mla_attend(
    query: torch.Tensor,
    cache: torch.Tensor,
    kv: int,
    scale: float,
    out: torch.Tensor | None = None,
    length: int | None = None,
    threads: int | None = None,
    ggml_order: bool = False,
) -> torch.Tensor:
    """MLA's decode attention (`steps_cpu.c`): one query [H, width] per head over the first `length`
    rows (all by default) of the latent cache [T, width], softmax((query @ cache^T) * scale) @
    cache[:, :kv] -> [H, kv] (into `out` when given; tensors as `takes` wants them; heads on `threads`,
    by default `torch.get_num_threads()`, when the work is large). `ggml_order`: in the float order of
    ggml's CPU backend (`k3_mla_attend_ggml`), the default arithmetic's."""
    heads, width = query.shape
    out = torch.empty(heads, kv, dtype=torch.float32) if out is None else out
    status = _ggml_cpu().mla_attend(
        query.data_ptr(), cache.data_ptr(), cache.shape[0] if length is None else length, heads, width, kv,
        scale, out.data_ptr(), torch.get_num_threads() if threads is None else threads, int(ggml_order),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("no memory for an MLA attention step")
    return out


def mla_attend_rows(
    queries: torch.Tensor,
    cache: torch.Tensor,
    offset: int,
    kv: int,
    scale: float,
    threads: int | None = None,
    ggml_order: bool = False,
) -> torch.Tensor:
    """A prefill's MLA attention: queries [T, H, width] at positions offset.., each over the latent cache
    [>= offset + T, width] up to its own position -> [T, H, kv], each query's result `mla_attend`'s for
    it (with the same `ggml_order`), bit for bit (`steps_cpu.c`; queries on `threads`, by default
    `torch.get_num_threads()`)."""
    count, heads, width = queries.shape
    out = torch.empty(count, heads, kv, dtype=torch.float32)
    status = _ggml_cpu().mla_attend_rows(
        queries.data_ptr(), cache.data_ptr(), offset, count, heads, width, kv, scale, out.data_ptr(),
        torch.get_num_threads() if threads is None else threads, int(ggml_order),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("no memory for an MLA prefill attention")
    return out


def sigmoid_gate(values: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """values * sigmoid(logits) (MLA's output gate; same shapes, tensors as `takes` wants them)."""
    out = torch.empty_like(values)
    function, args, _ = bind_sigmoid_gate(values, logits, out)
    function(*args)
    return out


def bind_sigmoid_gate(values: torch.Tensor, logits: torch.Tensor, out: torch.Tensor) -> Call:
    """`sigmoid_gate` into `out` as a bound call."""
    args = (values.data_ptr(), logits.data_ptr(), values.numel(), out.data_ptr())
    return _ggml_cpu().sigmoid_gate, args, (values, logits, out)


def bind_copy(src: torch.Tensor, dst: torch.Tensor) -> Call:
    """dst[:] = src for two float32 CPU matrices of one shape, each row contiguous (the rows of either
    may be a wider matrix's), as a bound call; a Python step where they are not that."""
    if not all(t.ndim == 2 and t.stride(1) == 1 for t in (src, dst)) or src.shape != dst.shape:
        return python_step(lambda: dst.copy_(src))
    if not all(t.is_cpu and t.dtype == torch.float32 and not t.requires_grad for t in (src, dst)):
        return python_step(lambda: dst.copy_(src))
    rows, cols = src.shape
    args = (src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), rows, cols)
    return _ggml_cpu().copy, args, (src, dst)


def decodes_row(ggml_type: int, values: int) -> bool:
    """Whether `decode_row` takes a row of `values` values of `ggml_type`: a type of CPU_TYPES, in runs
    of 32 values (its float types' blocks; a quantized row is whole blocks of 32 or 256)."""
    return ggml_type in CPU_TYPES and values % 32 == 0


def decode_row(ggml_type: int, address: int, values: int, out: torch.Tensor) -> None:
    """The first `values` values (whole blocks; `ggml_type` one of CPU_TYPES) of the GGUF bytes at
    `address` into float32 `out` (contiguous, CPU): the reference dequantizer's values, with no torch
    operation (a decode token's embedding)."""
    if _ggml_cpu().decode_row(ggml_type, address, values, out.data_ptr()) != 0:
        raise ValueError(f"no decoder for GGML type {ggml_type} over {values} values")


def copy_row(row: torch.Tensor, to: torch.Tensor, index: int) -> None:
    """to[index] = row for a float32 CPU matrix `to` and a contiguous row of its width (no torch
    operation: a decode step appending to a cache)."""
    width = to.shape[1]
    _ggml_cpu().copy(row.data_ptr(), width, to.data_ptr() + 4 * width * index, width, 1, width)


def _check(status: int, ggml_type: int, q8_activations: bool) -> None:
    if status == -2:
        raise MemoryError("no memory for a CPU product's buffers")
    if status != 0:
        raise ValueError(
            f"no CPU kernel for GGML type {ggml_type}" + " on 8-bit activations" * q8_activations
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (tensors as `takes` wants them)."""
    out = torch.empty_like(x)
    function, args, _ = bind_rms_norm(x, weight, eps, out)
    function(*args)
    return out


def bind_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor) -> Call:
    """`rms_norm` of x into `out` as a bound call."""
    width = x.shape[-1]
    address = 0 if weight is None else weight.data_ptr()
    return (
        _ggml_cpu().rms_norm,
        (x.data_ptr(), x.numel() // width, width, address, eps, out.data_ptr()),
        (x, out),
    )


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi-K3's activation of same-shaped `gate` and `up` (tensors as `takes` wants them); a
    prefill's values on the threads."""
    out, threads = torch.empty_like(gate), torch.get_num_threads()
    _ggml_cpu().situ(gate.data_ptr(), up.data_ptr(), gate.numel(), beta, linear_beta, out.data_ptr(), threads)
    return out


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, normalize: bool, min_sum: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router of `logits` [N, X] (tensors as `takes` wants them; bias [X]): the top_k experts
    by sigmoid + bias, descending, [N, k] int64, and their sigmoid weights, divided by their sum
    (clamped below at min_sum) when `normalize`, times scale, [N, k] float32."""
    rows = logits.shape[0]
    chosen = torch.empty(rows, top_k, dtype=torch.int64)
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    function, args, _ = bind_route(logits, bias, (top_k, normalize, min_sum, scale), chosen, weights)
    function(*args)
    return chosen, weights


def bind_route(
    logits: torch.Tensor, bias: torch.Tensor, how: tuple[int, bool, float, float], chosen: torch.Tensor,
    weights: torch.Tensor,
) -> Call:  # fmt: skip
    """`route` of logits into `chosen` and `weights` as a bound call; `how`: (top_k, normalize, min_sum,
    scale)."""
    rows, experts = logits.shape
    top_k, normalize, min_sum, scale = how
    args = (
        logits.data_ptr(), bias.data_ptr(), rows, experts, top_k, int(normalize), min_sum, scale,
        chosen.data_ptr(), weights.data_ptr(),
    )  # fmt: skip
    return _ggml_cpu().route, args, (logits, bias, chosen, weights)


def read_parts(descriptors: list[int], offsets: list[int], lengths: list[int], out: np.ndarray) -> int:
    """Read `lengths[i]` bytes at `offsets[i]` of `descriptors[i]` for each part i into `out` (uint8,
    contiguous, their total size), one after another, in one call without the GIL (a megabyte or more
    on `torch.get_num_threads()` threads at once): how many were read whole (fewer: the file ended
    early); a failed read raises OSError."""
    return _ggml_cpu().read_parts(descriptors, offsets, lengths, out.ctypes.data, torch.get_num_threads())


def kda_recurrent(
    projected: torch.Tensor,
    histories: Sequence[torch.Tensor],
    conv: torch.Tensor,
    f: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_a: torch.Tensor,
    lower_bound: float | None,
    b_logits: torch.Tensor,
    states: Sequence[torch.Tensor],
    g_logits: torch.Tensor,
    o_norm: torch.Tensor,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The KDA recurrence after the projections, token by token (`steps_cpu.c`), of B sequences with the
    same number of rows each (decode: one row each; prefill: one sequence of T rows): [rows, H * D], the
    gated and normed output for o_proj. `conv` [taps, 3 H D] by tap (the GGUF's [3 H D, taps] transposed).
    Updates each conv history [taps - 1, 3 H D] and state [H, D, D] in place; every tensor float32,
    contiguous, on the CPU."""
    out = torch.empty(f.shape, dtype=torch.float32)
    function, args, _ = bind_kda_recurrent(
        (projected, f, b_logits, g_logits), histories, states, (conv, dt_bias, ssm_a, o_norm),
        (lower_bound, eps, scale), out, torch.get_num_threads(),
    )  # fmt: skip
    if function(*args) != 0:
        raise MemoryError("no memory for the KDA recurrence")
    return out


def bind_kda_recurrent(
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    histories: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor],
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    numbers: tuple[float | None, float, float],
    out: torch.Tensor,
    threads: int,
) -> Call:
    """`kda_recurrent` into `out` as a bound call: inputs (projected, f, b_logits, g_logits), weights
    (conv by tap, dt_bias, ssm_a, o_norm), numbers (lower_bound, eps, scale); heads on up to `threads` threads
    when the call's steps are large (each head on one: the same bits)."""
    projected, f, b_logits, g_logits = inputs
    conv, dt_bias, ssm_a, o_norm = weights
    lower_bound, eps, scale = numbers
    tokens, rest = divmod(projected.shape[0], len(histories))
    if rest or len(states) != len(histories):
        raise ValueError(
            f"kda_recurrent: {projected.shape[0]} rows, {len(histories)} histories and {len(states)} states "
            "do not make whole sequences"
        )
    args = (
        projected.data_ptr(), [t.data_ptr() for t in histories], conv.data_ptr(), conv.shape[0],
        f.data_ptr(), dt_bias.data_ptr(), ssm_a.data_ptr(), int(lower_bound is not None),
        float(lower_bound or 0.0), b_logits.data_ptr(), [t.data_ptr() for t in states], g_logits.data_ptr(),
        o_norm.data_ptr(), tokens, ssm_a.numel(), o_norm.numel(), eps, scale, out.data_ptr(), threads,
    )  # fmt: skip
    return _ggml_cpu().kda_recurrent, args, (*inputs, *histories, *states, *weights, out)


def residual_mix(rows: Sequence[torch.Tensor], score: torch.Tensor, eps: float) -> torch.Tensor:
    """The attention-residual mix (`steps_cpu.c`) of `rows` ([N, E] each, bank then current; float32,
    contiguous, on the CPU) scored by `score` [E]: [N, E]; a prefill's positions on the threads."""
    out = torch.empty(rows[0].shape, dtype=torch.float32)
    function, args, _ = bind_residual_mix(rows, score, eps, out, torch.get_num_threads())
    if function(*args) != 0:
        raise MemoryError("no memory for a residual mix")
    return out


def bind_residual_mix(
    rows: Sequence[torch.Tensor], score: torch.Tensor, eps: float, out: torch.Tensor, threads: int = 1
) -> Call:
    """`residual_mix` of rows into `out` as a bound call (positions split over `threads` when there
    are enough of them: each one's result is the same)."""
    n, width = rows[0].shape
    args = ([t.data_ptr() for t in rows], n, width, score.data_ptr(), eps, out.data_ptr(), threads)
    return _ggml_cpu().residual_mix, args, (*rows, score, out)


def bind_add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Call:
    """`add` into `out` as a bound call."""
    return _ggml_cpu().add, (a.data_ptr(), b.data_ptr(), a.numel(), out.data_ptr()), (a, b, out)


def combine(pairs: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE's weighted sum of each row's expert outputs: pairs [N * k, W], weights [N, k] -> [N, W]
    (into `out` when given), each product rounded, then summed from zero in choice order (as torch's
    `(pairs.view(N, k, W) * weights[..., None]).sum(1)`); tensors as `takes` wants them."""
    out = torch.empty(weights.shape[0], pairs.shape[1], dtype=torch.float32) if out is None else out
    function, args, _ = bind_combine(pairs, weights, out)
    function(*args)
    return out
