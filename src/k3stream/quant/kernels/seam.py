"""The kernel seam: every product with GGUF weights goes through here, and only here a kernel is picked.

- `qmatmul(x, weight)`: `x @ W^T` for one matrix of any supported GGML type; `Products(weights)` the
  same for one or several matrices of one input, side by side, with what does not depend on x worked
  out once (the model's linear layers and a layer's projections of one input);
- `grouped_qmatmul(x, weights, starts, rows)`: several matrices of one type and shape, each with its
  own input rows (the heads of MLA's k_b/v_b, the experts of one MoE step);
- `expert_mlp(x, experts, starts, rows, activation)`: the routed-expert MLP (gate, up, `Situ`, down)
  over the experts of one step; on the CPU one C call when every role has a C kernel.

Backends: on CPU the C kernels (`cpu`: fused AVX2 kernels or blocks decoded into an L1 tile, never a
float32 matrix); on CUDA
the Triton kernels (`gpu`); F32 weights use torch's own matmul on a float32 view of their bytes. A type
or device without a kernel, or `backend="reference"`, takes the reference path: the torch dequantizer
a slab of rows at a time (`k3stream.quant.qlinear`), which the kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from k3stream.quant.matmul import qlinear
from k3stream.quant.rounding import round_like_ggml
from k3stream.quant.types import as_qtype, row_bytes, type_name

from . import cpu

log = logging.getLogger(__name__)
BACKENDS = ("auto", "reference")
F32 = 0
FLOAT_WIDTH_TYPES = frozenset({1, 30})  # F16, BF16: one value per "block"
# products the C kernels do not take go a row at a time (`row_at_a_time`): F32 rows off whole 32s
# (small models' narrow matrices) at any row count, the reference dequantize path up to this many
# rows; every product the C kernels take is row-exact at any row count
ROW_AT_A_TIME_MAX_ROWS = 16
ANY_ROWS = 1 << 62
# F32 matrices of at most this many bytes go to `Products`' C call as an input-major copy (small
# models' short rows, whose products are compute-bound); larger ones (a real model's 7168-wide rows,
# read at the memory's speed in a decode step) keep their GGUF bytes and the row-major kernel, and no
# second copy of them is made. 256 KiB: a decode step of the `mid` test shape (1024 x 256 F32
# matrices, 1 MiB) ran 1.2x faster with those on the row-major kernel (bench_forward, one thread)
INPUT_MAJOR_MAX_BYTES = 1 << 18


class _RowExact:
    """Process-wide: whether prefills compute as decode steps do (`set_row_exact`)."""

    on = False


def set_row_exact(on: bool) -> None:
    """Make a prefill's row get a decode step's bits (and a prefill resumed at any position the bits of
    one from the start: what a restored sequence snapshot needs): MLA attends each query as a decode
    step does, and products off the C kernels go a row at a time at any row count. The C kernels'
    products are row-exact either way. Off, prefills take the faster batched attention."""
    _RowExact.on = on


def row_exact() -> bool:
    return _RowExact.on


@dataclass(frozen=True)
class QWeight:
    """A matrix as GGUF stores it: bytes (uint8, `out` rows of whole blocks), GGML type id, (out, in)."""

    data: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qmatmul(x, self)

    @functools.cached_property
    def input_major(self) -> torch.Tensor:
        """An F32 matrix as a float32 [in, out] copy for the C products (`INPUT_MAJOR_F32`), made once:
        every `Products` over this weight shares it."""
        return _f32_matrix(self, self.data.device).T.contiguous()


def checked_weight(name: str, data: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> QWeight:
    """A QWeight after checking that `data` holds `shape` in whole blocks; errors name the tensor."""
    try:
        expected = shape[0] * row_bytes(ggml_type, shape[1])
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    flat = data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    if flat.numel() != expected:
        raise ValueError(f"{name}: {type_name(ggml_type)} {shape} needs {expected} bytes, has {flat.numel()}")
    return QWeight(flat, ggml_type, shape)


class ExpertMatrices(Protocol):
    """What `expert_mlp` needs of one expert: its `up`, `gate` and `down` matrices."""

    up: QWeight
    gate: QWeight
    down: QWeight


def kernel_for(
    ggml_type: int, device: torch.device | str = "cpu", in_features: int = 256, match_ggml: bool = False
) -> str:
    """Which path a product on `device` takes: "torch" (F32), "c", "triton" or "reference".

    The C kernels read F16/BF16 rows 32 values at a time: other widths take the reference path.
    `match_ggml` picks between a type's C kernels (float or 8-bit activations), not the path.
    """
    if ggml_type == F32:
        return "torch"
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cuda":
        from . import gpu

        return "triton" if gpu.available() and ggml_type in gpu.SUPPORTED_GPU_TYPES else "reference"
    whole_tiles = ggml_type not in FLOAT_WIDTH_TYPES or in_features % 32 == 0
    return "c" if cpu.available() and ggml_type in cpu.CPU_TYPES and whole_tiles else "reference"


def note_fallbacks(types: set[int], device: torch.device | str) -> list[str]:
    """One line per GGML type in `types` that has no kernel on `device` (they use the reference path)."""
    lines = [
        f"note: no {torch.device(device).type} kernel for GGML type {type_name(t)}: using the reference "
        "dequantize path"
        for t in sorted(types)
        if kernel_for(t, device) == "reference"
    ]
    for line in lines:
        log.warning(line)
    return lines


def warm_up(types: set[int], device: torch.device | str) -> None:
    """Compile the GPU kernels of these types now, at load (Triton compiles on first use): one
    decode-shaped and one prefill-shaped product each. Nothing to do on the CPU (built at install)."""
    for ggml_type in sorted(types):
        if kernel_for(ggml_type, device) == "triton":
            weight = QWeight(
                torch.zeros(row_bytes(ggml_type, 256), dtype=torch.uint8, device=device), ggml_type, (1, 256)
            )
            for rows in (1, 64):
                qmatmul(torch.zeros(rows, 256, device=device), weight)


def qmatmul(
    x: torch.Tensor, weight: QWeight, backend: str = "auto", match_ggml: bool = False
) -> torch.Tensor:
    """`x @ W^T` ([..., in] -> [..., out], float32) for W in any supported GGML type; `match_ggml`: the
    input as ggml's CPU matmul sees it (see `grouped_qmatmul`)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"qmatmul: input has {x.shape[-1]} features, the weight expects {weight.shape[1]}")
    flat = x.reshape(-1, x.shape[-1]).float()
    if weight.ggml_type != F32:
        out = grouped_qmatmul(flat, [weight], *_all_rows(flat.shape[0]), backend, match_ggml)
    elif _f32_by_kernel(flat.device, [weight]):
        out_features, in_features = weight.shape
        out = cpu.grouped_product(
            flat, [weight.data], F32, out_features, 4 * in_features, *_all_rows(len(flat))
        )
    elif weight.data.dtype == torch.uint8:  # GGUF rows the C kernel does not take (widths off its 32s)
        matrix = _f32_matrix(weight, x.device)
        out = row_at_a_time(flat, lambda rows: torch.nn.functional.linear(rows, matrix), ANY_ROWS)
    else:  # float parameters (the trainer's): one product autograd follows
        return torch.nn.functional.linear(x.float(), _f32_matrix(weight, x.device))
    return out.reshape(*x.shape[:-1], weight.shape[0])


class Products:
    """`qmatmul(x, w, backend, match_ggml)` for each of `weights` (one input width), side by side:
    [N, sum of their output rows]. A linear layer holds one weight, a layer's projections of one input
    several; the model calls them many times (a decode token ~100 calls of a few microseconds of work).
    A 2-D float32 CPU input that every weight's C kernel takes is one C call with everything that does
    not depend on x worked out here; anything else goes through qmatmul per weight (which also says
    what is wrong) and a cat. The C call takes F32 matrices of at most INPUT_MAJOR_MAX_BYTES from an
    input-major copy made here (`INPUT_MAJOR_F32`: each output's sum one chain over its inputs, so a
    decode row and a prefill's rows get the same bits, whatever the width, without a row-major
    kernel's horizontal sums); the same results as qmatmul's but for those, within 1e-6."""

    def __init__(self, weights: Sequence[QWeight], backend: str = "auto", match_ggml: bool = False) -> None:
        self.weights = list(weights)
        widths = {weight.shape[1] for weight in self.weights}
        if len(widths) != 1:
            raise ValueError(f"Products: the weights take different input widths {sorted(widths)}")
        self.in_features = widths.pop()
        self.out_features = sum(weight.shape[0] for weight in self.weights)
        self.backend, self.match_ggml = backend, match_ggml
        self._c_takes = all(self._c_takes_weight(weight) for weight in self.weights)
        self.widths = [weight.shape[0] for weight in self.weights]
        # the matrices as the C call reads them (kept alive here) and their kernels' type ids
        self._matrices = [_as_c_reads(w) if self._c_takes else (w.data, w.ggml_type) for w in self.weights]
        self._arguments = (
            [matrix.data_ptr() for matrix, _ in self._matrices],
            [kind for _, kind in self._matrices],
            self.widths,
            [row_bytes(weight.ggml_type, self.in_features) for weight in self.weights],
            [int(match_ggml and weight.ggml_type in cpu.Q8_TYPES) for weight in self.weights],
        )

    def _c_takes_weight(self, weight: QWeight) -> bool:
        """Whether products with `weight` go straight to the C kernel (at any row count)."""
        ggml_type = weight.ggml_type
        if self.backend != "auto":
            return False
        if ggml_type == F32 and weight.data.numel() <= INPUT_MAJOR_MAX_BYTES:
            return _input_major_takes(weight)
        if not _bytes_for_c(weight):
            return False
        return ggml_type == F32 or _c_kernel_takes(ggml_type, self.in_features, self.match_ggml)

    def role(self) -> cpu.Role:
        """The first matrix as `cpu.expert_mlp` takes it (an F32 one input-major)."""
        matrix, kind = self._matrices[0]
        return cpu.Role([matrix], kind, self.widths[0], self._arguments[3][0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct(x):
            return cpu.products(x, *self._arguments)
        outputs = self._each(x)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's product [N, its out]: views of one C call's output where x goes straight to
        C, else each product as it comes (a prefill's: no joint copy to split again)."""
        if self._direct(x):
            return list(cpu.products(x, *self._arguments).split(self.widths, dim=-1))
        return self._each(x)

    def _each(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [qmatmul(x, weight, self.backend, self.match_ggml) for weight in self.weights]

    def bind(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> cpu.Call | None:
        """The product of x into `out` ([N, out_features] float32) as a bound C call, or None where x
        would not go straight to C."""
        return cpu.bind_products(x, self._arguments, out, threads) if self._direct(x) else None

    def _direct(self, x: torch.Tensor) -> bool:
        return self._c_takes and list(x.shape[1:]) == [self.in_features] and cpu.takes((x,))


def _input_major_takes(weight: QWeight) -> bool:
    """Whether an F32 weight's products may take the C kernel from an input-major copy: GGUF bytes on
    the CPU and the library built (any width: the copy is the C call's own)."""
    return _gguf_bytes_on_cpu(weight) and cpu.available()


def _as_c_reads(weight: QWeight) -> tuple[torch.Tensor, int]:
    """A weight's matrix as the C products read it, and its type id there: an F32 one of at most
    INPUT_MAJOR_MAX_BYTES as an input-major float32 copy ([in, out]), any other as its GGUF bytes."""
    if weight.ggml_type != F32 or weight.data.numel() > INPUT_MAJOR_MAX_BYTES:
        return weight.data, weight.ggml_type
    return weight.input_major, cpu.INPUT_MAJOR_F32


class GroupedProduct:
    """`grouped_qmatmul(x, weights, starts, rows, backend, match_ggml)` for fixed weights (one GGML type
    and shape) with what does not depend on x worked out once (MLA's per-head k_b and v_b, twice a
    layer and token): a float32 CPU input goes straight to the C kernel where grouped_qmatmul would
    send it, anything else through grouped_qmatmul. Same results either way."""

    def __init__(self, weights: Sequence[QWeight], backend: str = "auto", match_ggml: bool = False) -> None:
        self.weights, self.backend, self.match_ggml = list(weights), backend, match_ggml
        first = self.weights[0]
        ggml_type, (out_features, in_features) = first.ggml_type, first.shape
        self._direct = (
            backend == "auto"
            and (ggml_type == F32 or _c_kernel_takes(ggml_type, in_features, match_ggml))
            and all(
                _bytes_for_c(w) and (w.ggml_type, w.shape) == (ggml_type, first.shape) for w in self.weights
            )
        )
        self._datas = [w.data for w in self.weights]
        self._layout = (ggml_type, out_features, row_bytes(ggml_type, in_features))
        self._q8 = match_ggml and ggml_type in cpu.Q8_TYPES
        self.in_features = in_features

    def __call__(self, x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self._takes(x, starts):
            return cpu.grouped_product(x, self._datas, *self._layout, starts, rows, self._q8)
        return grouped_qmatmul(x, self.weights, starts, rows, self.backend, self.match_ggml)

    def bind(
        self, x: torch.Tensor, starts: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, threads: int
    ) -> cpu.Call | None:
        """The product into `out` as a bound C call, or None where x would not go straight to C."""
        if not self._takes(x, starts):
            return None
        return cpu.bind_grouped_product(x, self._datas, self._layout, starts, rows, out, threads, self._q8)

    def _takes(self, x: torch.Tensor, starts: torch.Tensor) -> bool:
        return self._direct and x.ndim == 2 and x.shape[1] == self.in_features and cpu.takes((x,))


class MLP:
    """down(activation(gate(x), up(x))) over three prepared products of one weight each (a dense or
    shared-expert MLP): one C call (`cpu.expert_mlp`: the same products and activation) for an input
    each would take straight to its C kernel, else the three calls with the activation between."""

    def __init__(self, gate: Products, up: Products, down: Products, activation: Situ) -> None:
        self.gate, self.up, self.down, self.activation = gate, up, down, activation
        parts = (gate, up, down)
        single = all(len(part.weights) == 1 for part in parts)
        match_ggml = {part.match_ggml for part in parts}
        types = [weight.ggml_type for part in parts for weight in part.weights]
        q8 = _q8_flag(types, match_ggml.pop()) if len(match_ggml) == 1 else None
        self._q8 = bool(q8)
        self._c_takes = single and q8 is not None and all(part._c_takes for part in parts)
        self._roles = tuple(part.role() for part in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._direct(x):
            starts, rows = _all_rows(x.shape[0])
            return cpu.expert_mlp(
                x, *self._roles, starts, rows, self.activation.beta, self.activation.linear_beta, self._q8
            )
        return self.down(self.activation(self.gate(x), self.up(x)))

    def bind(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> cpu.Call | None:
        """The MLP of x into `out` as a bound C call, or None where x would not take the one call."""
        if not self._direct(x):
            return None
        betas = (self.activation.beta, self.activation.linear_beta)
        return cpu.bind_expert_mlp(x, self._roles, *_all_rows(x.shape[0]), betas, out, threads, self._q8)

    def _direct(self, x: torch.Tensor) -> bool:
        return self._c_takes and list(x.shape[1:]) == [self.gate.in_features] and cpu.takes((x,))


def _f32_by_kernel(device: torch.device, weights: Sequence[QWeight]) -> bool:
    """Whether an F32 product takes the C kernel: GGUF bytes on the CPU, at any row count (each row's
    sum in one order, so a row's bits do not depend on its company; torch's GEMM rounds as its row
    count has it)."""
    return device.type == "cpu" and all(map(_bytes_for_c, weights))


def _bytes_for_c(weight: QWeight) -> bool:
    """Whether the C library may read this weight: it is built, and the weight is contiguous GGUF bytes
    on the CPU (F32 rows in whole runs of 32 values)."""
    return (
        _gguf_bytes_on_cpu(weight)
        and weight.data.is_contiguous()
        and (weight.ggml_type != F32 or weight.shape[1] % 32 == 0)
        and cpu.available()
    )


def _gguf_bytes_on_cpu(weight: QWeight) -> bool:
    return weight.data.dtype == torch.uint8 and weight.data.device.type == "cpu"


def _f32_matrix(weight: QWeight, device: torch.device) -> torch.Tensor:
    """An F32 weight's bytes viewed as the floats they are (torch's own matmul takes it from there).
    Data already float32 (the trainer's expert parameters) is used as is: autograd sees through it."""
    data = weight.data.to(device)
    return (data if data.dtype == torch.float32 else data.view(torch.float32)).view(weight.shape)


@functools.lru_cache(maxsize=64)
def _all_rows(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`starts` and `rows` of one matrix taking every one of `count` rows in order."""
    return torch.tensor([0, count], dtype=torch.int64), torch.arange(count, dtype=torch.int64)


def grouped_qmatmul(
    x: torch.Tensor,
    weights: Sequence[QWeight],
    starts: torch.Tensor,
    rows: torch.Tensor,
    backend: str = "auto",
    match_ggml: bool = False,
) -> torch.Tensor:
    """[P, out]: result row p (for p in `starts[b]..starts[b+1]`) is `x[rows[p]] @ weights[b]^T`.

    Every weight has one GGML type and shape. x: float32 [R, in]; starts: [B + 1], rows: [P] (int64).
    `match_ggml`: x rounded as ggml's CPU matmul rounds it for this type (`round_like_ggml`); the types
    in `cpu.Q8_TYPES` on the CPU then take integer kernels on the 8-bit codes, as ggml does.
    """
    first = weights[0]
    if any(w.ggml_type != first.ggml_type or w.shape != first.shape for w in weights):
        raise ValueError("grouped_qmatmul: the matrices differ in GGML type or shape")
    kernel = (
        "reference"
        if backend == "reference"
        else kernel_for(first.ggml_type, x.device, first.shape[1], match_ggml)
    )
    if kernel == "torch" and _f32_by_kernel(x.device, weights):
        kernel = "c"  # as qmatmul
    q8_activations = match_ggml and kernel == "c" and first.ggml_type in cpu.Q8_TYPES
    if match_ggml and not q8_activations:
        x = round_like_ggml(x, first.ggml_type)
    if kernel == "c":
        bytes_per_row = row_bytes(first.ggml_type, first.shape[1])
        datas = [w.data for w in weights]
        return cpu.grouped_product(
            x, datas, first.ggml_type, first.shape[0], bytes_per_row, starts, rows, q8_activations
        )
    if kernel == "triton":
        from . import gpu

        gathered = x[rows.to(x.device)]
        sizes = starts.tolist()
        return gpu.triton_grouped_qmatmul(
            gathered, [w.data for w in weights], first.ggml_type, first.shape[0], first.shape[1], sizes
        )
    return _per_matrix(x, weights, starts, rows, kernel)


def row_at_a_time(x: torch.Tensor, product, most_rows: int = ROW_AT_A_TIME_MAX_ROWS) -> torch.Tensor:
    """product(x), a row at a time for at most `most_rows` rows on the CPU (any under `set_row_exact`):
    for products the C kernels do not take, so that a row's bits do not depend on its company (torch's
    products round as their row count has them)."""
    if (len(x) <= most_rows or _RowExact.on) and x.device.type == "cpu" and x.dim() > 1:
        return torch.cat([product(row) for row in x.split(1)])
    return product(x)


def _per_matrix(x, weights, starts, rows, kernel: str) -> torch.Tensor:
    """One matmul per matrix: qmatmul's on F32 bytes, else the reference dequantize path (through
    `row_at_a_time`)."""
    out = x.new_empty(int(rows.numel()), weights[0].shape[0])
    bounds = starts.tolist()
    for b, weight in enumerate(weights):
        if bounds[b + 1] == bounds[b]:
            continue
        inputs = x[rows[bounds[b] : bounds[b + 1]].to(x.device)]
        if kernel == "torch":  # qmatmul's F32 choice per matrix
            out[bounds[b] : bounds[b + 1]] = qmatmul(inputs, weight)
        else:
            out[bounds[b] : bounds[b + 1]] = row_at_a_time(
                inputs, lambda part, w=weight: qlinear(part, w.data, w.ggml_type, *w.shape)
            )
    return out


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi-K3's activation: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta) (no tanh
    on u when linear_beta is 0); in C for CPU float32 tensors outside autograd."""
    if gate.shape == up.shape and cpu.takes((gate, up)):
        return cpu.situ(gate, up, beta, linear_beta)
    activated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta > 0:
        up = linear_beta * torch.tanh(up / linear_beta)
    return activated * up


@dataclass(frozen=True)
class Situ:
    """The routed experts' activation, `situ` with these betas (`expert_mlp` fuses it on the CPU)."""

    beta: float
    linear_beta: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ(gate, up, self.beta, self.linear_beta)


def expert_mlp(
    x: torch.Tensor,
    experts: Sequence[ExpertMatrices],
    starts: torch.Tensor,
    rows: torch.Tensor,
    activation: Situ,
    match_ggml: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """down(activation(gate(x), up(x))) of each expert on its rows: [P, out of down].

    Rows `starts[b]..starts[b+1]` of the result are expert b's outputs for `x[rows[p]]`. `match_ggml`
    rounds each product's input as ggml's CPU matmul does for the weight's type.
    """
    roles = _fused_roles(x, experts, match_ggml) if backend == "auto" else None
    if roles is not None:
        q8 = _q8_flag([role.ggml_type for role in roles], match_ggml)
        return cpu.expert_mlp(x, *roles, starts, rows, activation.beta, activation.linear_beta, q8)
    as_qtype(experts[0].up.ggml_type)  # one clear error for an unsupported type

    def product(role: str, inputs: torch.Tensor, input_rows: torch.Tensor) -> torch.Tensor:
        return grouped_qmatmul(
            inputs, [getattr(e, role) for e in experts], starts, input_rows, backend, match_ggml
        )

    hidden = activation(product("gate", x, rows), product("up", x, rows))
    return product("down", hidden, torch.arange(hidden.shape[0], dtype=torch.int64))


def bind_chosen_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    roles: Sequence[tuple[torch.Tensor, int, int, tuple[int, int]]],
    activation: Situ,
    out: torch.Tensor,
    threads: int,
    match_ggml: bool = False,
    backend: str = "auto",
) -> cpu.Call | None:
    """`expert_mlp` of one row x [1, in] through the experts `chosen` [1, k] picks, each one pair in the
    order of choice, into out [k, down rows], as a bound C call (the call `expert_mlp` makes for those
    experts' matrices), or None where `expert_mlp` would not take them straight to C. `roles` (gate,
    up, down): each role's matrices of all the layer's experts in RAM, as (bytes, bytes per expert,
    GGML type, shape (out, in)), expert e's at e times the bytes per expert."""
    described = _one_row_roles(x, [role[2:] for role in roles], match_ggml, backend)
    if described is None:
        return None
    q8, c_roles = described
    experts = roles[0][0].numel() // roles[0][1]
    placed = [(data, nbytes, role) for (data, nbytes, _, _), role in zip(roles, c_roles, strict=True)]
    betas = (activation.beta, activation.linear_beta)
    return cpu.bind_chosen_experts(x, chosen, placed, experts, betas, out, threads, q8)


def bind_experts_at(
    x: torch.Tensor,
    objects: torch.Tensor,
    roles: Sequence[tuple[int, int, tuple[int, int]]],
    activation: Situ,
    pairs: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    threads: int,
    match_ggml: bool = False,
    backend: str = "auto",
) -> cpu.Call | None:
    """`bind_chosen_experts` for experts each in an object of its own, and their weighted sum: one row
    x [1, in] through the experts whose objects lie at the addresses `objects` [k] (int64) holds at each
    call, into pairs [k, down rows], summed by weights [1, k] into out [1, down rows] (`cpu.combine`),
    as one bound C call, or None where `expert_mlp` would not take them straight to C. `roles` (gate,
    up, down): (offset in an object, GGML type, shape (out, in)) each. A call finding `objects[0] == 0`
    does nothing; whoever fills `objects` keeps those objects in place until the call returns
    (`ExpertSource.hold`)."""
    described = _one_row_roles(x, [role[1:] for role in roles], match_ggml, backend)
    if described is None:
        return None
    q8, c_roles = described
    placed = [(offset, role) for (offset, _, _), role in zip(roles, c_roles, strict=True)]
    betas = (activation.beta, activation.linear_beta)
    return cpu.bind_experts_at(x, objects, placed, betas, pairs, weights, out, threads, q8)


def _one_row_roles(
    x: torch.Tensor, kinds: Sequence[tuple[int, tuple[int, int]]], match_ggml: bool, backend: str
) -> tuple[bool, list[cpu.Role]] | None:
    """For one row x through experts of these (GGML type, shape) roles (gate, up, down): whether the C
    call quantizes its activations, and each role's `cpu.Role` without matrices; None where
    `expert_mlp` would not take them straight to C."""
    layouts = [_fused_layout(ggml_type, shape, match_ggml) for ggml_type, shape in kinds]
    q8 = _q8_flag([ggml_type for ggml_type, _ in kinds], match_ggml)
    if backend != "auto" or x.shape[0] != 1 or None in (*layouts, q8) or not cpu.takes((x,)):
        return None
    roles = [cpu.Role([], ggml_type, *layout) for (ggml_type, _), layout in zip(kinds, layouts, strict=True)]
    return bool(q8), roles


def _fused_roles(
    x: torch.Tensor, experts: Sequence[ExpertMatrices], match_ggml: bool
) -> tuple[cpu.Role, cpu.Role, cpu.Role] | None:
    """The gate, up and down roles for `cpu.expert_mlp`, or None where the step takes the per-product
    path: off the CPU, under autograd, a role without a C kernel, or with `match_ggml` a role whose
    kernel does not quantize activations itself (its inputs are rounded in torch first) or F32 roles
    beside quantized ones."""
    if not cpu.takes((x,)):
        return None
    first = experts[0]
    kinds = [(matrix.ggml_type, matrix.shape) for matrix in (first.gate, first.up, first.down)]
    layouts = [_fused_layout(ggml_type, shape, match_ggml) for ggml_type, shape in kinds]
    if None in (*layouts, _q8_flag([ggml_type for ggml_type, _ in kinds], match_ggml)):
        return None
    signature = [kind for kind in kinds for kind in kind]
    datas: tuple[list[torch.Tensor], ...] = ([], [], [])
    for expert in experts:  # one pass (a decode step calls this once per MoE layer)
        gate, up, down = expert.gate, expert.up, expert.down
        if [gate.ggml_type, gate.shape, up.ggml_type, up.shape, down.ggml_type, down.shape] != signature:
            raise ValueError("expert_mlp: the experts' matrices of one role differ in GGML type or shape")
        datas[0].append(gate.data), datas[1].append(up.data), datas[2].append(down.data)
    gate, up, down = (
        cpu.Role(data, ggml_type, *layout)
        for data, (ggml_type, _), layout in zip(datas, kinds, layouts, strict=True)
    )
    return gate, up, down


@functools.lru_cache(maxsize=64)
def _fused_layout(ggml_type: int, shape: tuple[int, int], match_ggml: bool) -> tuple[int, int] | None:
    """A role's output rows and bytes per row for `cpu.expert_mlp`, or None where it does not take it
    (see `_fused_roles`); F32 matrices of whole 32s take it at any row count, as `qmatmul` does."""
    out_features, in_features = shape
    f32_rows = ggml_type == F32 and in_features % 32 == 0 and cpu.available()
    if not (f32_rows or _c_kernel_takes(ggml_type, in_features, match_ggml)):
        return None
    return out_features, row_bytes(ggml_type, in_features)


def _q8_flag(ggml_types: Sequence[int], match_ggml: bool) -> bool | None:
    """Whether one C call over roles of these types quantizes their activations: under `match_ggml`
    all of them or none (F32, which ggml never rounds), None where they differ."""
    flags = {match_ggml and ggml_type in cpu.Q8_TYPES for ggml_type in ggml_types}
    return flags.pop() if len(flags) == 1 else None


@functools.lru_cache(maxsize=64)
def _c_kernel_takes(ggml_type: int, in_features: int, match_ggml: bool) -> bool:
    """Whether a product of this type goes to a C kernel on the CPU as it is: one exists, and under
    `match_ggml` it quantizes its activations itself (other types have their inputs rounded in torch)."""
    return kernel_for(ggml_type, "cpu", in_features, match_ggml) == "c" and (
        not match_ggml or ggml_type in cpu.Q8_TYPES
    )
