"""The kernel seam against the reference dequantizer: every CPU type, grouped products, exact tiles,
results independent of grouping and threads, no float32 copy of a weight, fallbacks and bad shapes."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, NO_C_KERNELS, take_kernel_isa
from k3stream.model.layers import rms_norm
from k3stream.quant import DECODE_ONLY_TYPES, dequantize, quantize
from k3stream.quant.kernels import (
    MLP,
    GroupedProduct,
    Products,
    QWeight,
    Situ,
    checked_weight,
    cpu,
    expert_mlp,
    grouped_qmatmul,
    kernel_for,
    note_fallbacks,
    qmatmul,
    situ,
)
from k3stream.quant.rounding import round_like_ggml

pytestmark = pytest.mark.skipif(not cpu.available(), reason=NO_C_KERNELS)

CPU_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
FLOATS = [T.F16, T.BF16, T.F32]
# the types with integer kernels that k3stream.quant.quantize writes (the others: test_kernels_iquants.py)
Q8_QUANTIZED = sorted(t for t in cpu.Q8_TYPES if t not in DECODE_ONLY_TYPES)
# their activations are Q8_1 blocks: each block's offset takes Q8_1's sum s = F16(d sum(q)), within 2^-11
# of the rounded inputs' sum (test_kernels_tiles holds their products to llama.cpp's bits)
Q8_1_TYPES = (T.Q4_1, T.Q5_1)


def weight(qt: T, rows: int, cols: int, seed: int = 0) -> QWeight:
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = np.ascontiguousarray(quantize(values, qt)).reshape(-1)
    return QWeight(torch.from_numpy(data), int(qt), (rows, cols))


def reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    dense = dequantize(w.data.view(w.shape[0], -1), w.ggml_type).double()
    return (x.double() @ dense.T).float()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("qt", CPU_TYPES + FLOATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,inputs", [(37, 256, 1), (5, 512, 3), (64, 768, 40), (37, 2048, 2)])
def test_product_matches_the_reference(qt, rows, cols, inputs):
    w = weight(qt, rows, cols, seed=rows)
    x = torch.from_numpy(np.random.default_rng(cols).standard_normal((inputs, cols)).astype(np.float32))
    assert kernel_for(int(qt), "cpu", cols) in ("c", "torch")
    assert relative_error(qmatmul(x, w), reference(x, w)) <= 1e-5


@pytest.mark.parametrize("qt", CPU_TYPES + [T.F16, T.BF16], ids=lambda t: t.name)
def test_tiles_hold_exactly_the_reference_values(qt):
    """A one-hot input row reads one weight column back: the kernel's decoded values, bit for bit."""
    w = weight(qt, 9, 512, seed=3)
    columns = qmatmul(torch.eye(512), w)
    assert torch.equal(columns.T, dequantize(w.data.view(9, -1), int(qt)))


@pytest.mark.parametrize("qt", FLOATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, cols", [(45, 1024), (45, 2048), (131, 768), (70, 96)])
def test_float_rows_run_as_streams_and_each_output_row_keeps_its_own_result(qt, rows, cols):
    """Float rows are computed four weight rows at a time from four streams through a thread's rows
    (row counts that are not a multiple of four, and products split over threads, included): each
    output is the same alone, in company and on any thread count."""
    w = weight(qt, rows, cols, seed=cols)
    x = torch.randn(3, cols)
    alone = torch.stack(
        [qmatmul(x, QWeight(w.data.view(rows, -1)[m], w.ggml_type, (1, cols)))[:, 0] for m in range(rows)]
    )
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(qmatmul(x, w), alone.T)
    finally:
        torch.set_num_threads(threads)
    assert relative_error(qmatmul(x, w), reference(x, w)) <= 1e-6


BLOCK32_TYPES = (T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4)
MANY_ROW_CASES = [(qt, cols) for qt in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K) for cols in (768, 2304)] + [
    (qt, cols) for qt in BLOCK32_TYPES for cols in (768, 2304, 800)
]


@pytest.mark.parametrize("qt, cols", MANY_ROW_CASES, ids=lambda case: str(getattr(case, "name", case)))
def test_many_rows_of_one_matrix_equal_single_row_products_bit_for_bit(qt, cols):
    """Prefill-sized groups (from a few rows to more than one group of the tiled path, which expands
    each block once for many rows; weight rows that do not fill the last tile; rows longer than one
    expanded chunk; float rows that are not whole 256s, which stay off the tiles) give each row exactly
    its single-row result."""
    weights = [weight(qt, 42, cols, seed=s) for s in range(3)]
    x = torch.randn(150, cols)
    counts = [7, 0, 143]
    starts = torch.tensor([0, *np.cumsum(counts).tolist()])
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 150, sum(counts)))
    together = grouped_qmatmul(x, weights, starts, rows)
    for b, w in enumerate(weights):
        for p in range(int(starts[b]), int(starts[b + 1])):
            assert torch.equal(together[p], qmatmul(x[rows[p]][None], w)[0])
    assert relative_error(together[starts[2] :], reference(x[rows[starts[2] :]], weights[2])) <= 1e-5


@pytest.mark.parametrize("cols", [16, 5, 40, 12000])
def test_f32_products_are_row_exact_in_one_call_at_any_width(cols):
    """F32 matrices (of any width: a KDA decay's 16-wide second projection) take the C products from
    an input-major copy, one chain an output (beyond INPUT_MAJOR_MAX_BYTES from their own bytes, the
    row-major kernel), under row-exact products at any row count: each row its one-row result (a decode
    step's), the products x @ W^T."""
    from k3stream.quant.kernels import set_row_exact

    matrices = [torch.randn(24, cols), torch.randn(3, cols)]
    products = Products([QWeight(m.view(torch.uint8).reshape(-1), T.F32, tuple(m.shape)) for m in matrices])
    x = torch.randn(70, cols)
    set_row_exact(True)
    try:
        one_by_one = torch.cat([products(x[i : i + 1]) for i in range(len(x))])
        for count in (2, 3, 17, 49, 70):
            assert torch.equal(products(x[:count]), one_by_one[:count])
            assert torch.equal(torch.cat(products.parts(x[:count]), dim=1), one_by_one[:count])
    finally:
        set_row_exact(False)
    assert relative_error(one_by_one, torch.cat([x @ m.T for m in matrices], dim=1)) <= 1e-6


@pytest.mark.parametrize("qt", CPU_TYPES, ids=lambda t: t.name)
def test_grouped_rows_equal_separate_products_bit_for_bit(qt):
    """Uneven and empty groups; a row's result does not depend on what shared the call or on threads."""
    weights = [weight(qt, 48, 512, seed=s) for s in range(4)]
    x = torch.randn(7, 512)
    starts = torch.tensor([0, 3, 3, 8, 9])
    rows = torch.tensor([0, 6, 2, 1, 1, 3, 4, 5, 0])
    together = grouped_qmatmul(x, weights, starts, rows)
    for b, w in enumerate(weights):
        for p in range(int(starts[b]), int(starts[b + 1])):
            alone = qmatmul(x[rows[p]][None], w)[0]
            assert torch.equal(together[p], alone)
            assert relative_error(alone, reference(x[rows[p]][None], w)[0]) <= 1e-5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(grouped_qmatmul(x, weights, starts, rows), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("outs,cols", [(200, 64), (70, 40), (13, 512), (5, 33)])
def test_input_major_f32_products_have_one_rows_bits_on_every_isa(outs, cols, monkeypatch):
    """The input-major F32 kernels (AVX-512: six rows by 64 outputs a block, the rows left over one at a
    time; AVX2: four rows by 16; portable: one output at a time) give every row, at any row count and
    any output width (masked ends), the bits of the AVX2 kernel's one-row product (a decode step's);
    row-exact products take them at any row count."""
    from k3stream.quant.kernels import seam

    monkeypatch.setattr(seam._RowExact, "on", True)
    generator = torch.Generator().manual_seed(outs + cols)
    matrix = torch.randn(outs, cols, generator=generator)
    products = Products([QWeight(matrix.view(torch.uint8).reshape(-1), T.F32, (outs, cols))])
    x = torch.randn(47, cols, generator=generator)
    take_kernel_isa("avx2", monkeypatch)
    alone = torch.cat([products(row[None]) for row in x])
    for isa in KERNEL_ISAS:
        try:
            take_kernel_isa(isa, monkeypatch)
        except pytest.skip.Exception:  # this CPU does not run it
            continue
        for count in (1, 5, 6, 7, 13, 47):
            assert torch.equal(products(x[:count]), alone[:count]), (isa, count)
    assert relative_error(alone, x @ matrix.T) <= 1e-6


@pytest.mark.parametrize("qt", Q8_QUANTIZED, ids=lambda t: T(t).name)
@pytest.mark.parametrize("rows,cols,inputs", [(37, 256, 1), (5, 512, 3), (64, 768, 40), (37, 2048, 2)])
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_integer_kernels_equal_the_product_with_inputs_rounded_as_ggml(
    qt, rows, cols, inputs, isa, monkeypatch
):
    """match_ggml: integer kernels on ggml's Q8_K, Q8_0 or Q8_1 codes. Their sums are exact, so they agree
    with the rounded input times the dequantized weight; an all-zero block and a negative largest value
    included."""
    take_kernel_isa(isa, monkeypatch)
    w = weight(T(qt), rows, cols, seed=rows)
    x = torch.from_numpy(np.random.default_rng(cols).standard_normal((inputs, cols)).astype(np.float32))
    x[-1, 256 % cols] = -x[-1].abs().max() * 2  # the block's signed max is negative: codes reach -127
    if inputs > 1:
        x[0, :256] = 0.0
    got = qmatmul(x, w, match_ggml=True)
    bound = 2e-3 if qt in Q8_1_TYPES else 1e-6
    assert relative_error(got, reference(round_like_ggml(x, qt), w)) <= bound
    assert relative_error(got, reference(x, w)) > 1e-6  # the activations were quantized


@pytest.mark.parametrize("qt", Q8_QUANTIZED, ids=lambda t: T(t).name)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_integer_kernel_rows_do_not_depend_on_grouping_or_threads(qt, isa, monkeypatch):
    """A matrix's input rows in groups of four sharing each weight row's decoded codes (Q2_K-Q5_K; on
    AVX2 Q5_0, Q4_1, Q5_1 too), the rest three, two or one at a time: each row is its single-row result."""
    take_kernel_isa(isa, monkeypatch)
    counts = [2, 0, 3, 9, 7]  # 9: 4 + 4 + 1, 7: 4 + 3
    weights = [weight(T(qt), 24, 512, seed=s) for s in range(len(counts))]
    x = torch.randn(12, 512)
    starts = torch.tensor([0, *np.cumsum(counts).tolist()])
    rows = torch.from_numpy(np.random.default_rng(qt).integers(0, 12, sum(counts)))
    together = grouped_qmatmul(x, weights, starts, rows, match_ggml=True)
    for b, w in enumerate(weights):
        for p in range(int(starts[b]), int(starts[b + 1])):
            assert torch.equal(together[p], qmatmul(x[rows[p]][None], w, match_ggml=True)[0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(grouped_qmatmul(x, weights, starts, rows, match_ggml=True), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("match_ggml", [True, False])
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_a_large_products_rows_keep_their_bits_on_any_thread_count(qt, match_ggml):
    """Enough 32-row tasks (129, the last one short) that the threads' runs shrink to the split's
    floor: every thread count cuts them elsewhere, and every output row keeps its bits."""
    w = weight(qt, 4128, 256, seed=int(qt))
    x = torch.randn(3, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [qmatmul(x[:n], w, match_ggml=match_ggml) for n in (1, 3)]
        for count in (2, 3, 4):
            torch.set_num_threads(count)
            for n, expected in zip((1, 3), alone, strict=True):
                assert torch.equal(qmatmul(x[:n], w, match_ggml=match_ggml), expected), f"{count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qt", [T.F16, T.BF16], ids=lambda t: t.name)
def test_match_ggml_rounds_the_inputs_of_types_without_integer_kernels(qt):
    w = weight(qt, 16, 512)
    x = torch.randn(3, 512)
    assert torch.equal(qmatmul(x, w, match_ggml=True), qmatmul(round_like_ggml(x, int(qt)), w))


class Expert:
    """One routed expert's three matrices (gate and up 512 -> 256, down 256 -> 512)."""

    def __init__(self, seed: int, gate: T = T.Q2_K, up: T = T.Q2_K, down: T = T.Q3_K) -> None:
        self.gate, self.up = weight(gate, 256, 512, seed + 10), weight(up, 256, 512, seed)
        self.down = weight(down, 512, 256, seed + 20)


STEP_STARTS, STEP_ROWS = torch.tensor([0, 2, 5, 6]), torch.tensor([0, 4, 1, 2, 3, 0])


def test_expert_mlp_matches_the_reference_path():
    experts = [Expert(s) for s in range(3)]
    x = torch.randn(5, 512)
    activation = Situ(2.0, 3.0)
    fast = expert_mlp(x, experts, STEP_STARTS, STEP_ROWS, activation)
    slow = expert_mlp(x, experts, STEP_STARTS, STEP_ROWS, activation, backend="reference")
    assert relative_error(fast, slow) <= 1e-5


@pytest.mark.parametrize("match_ggml", [False, True])
@pytest.mark.parametrize(
    "types",
    [(T.Q2_K, T.Q2_K, T.Q3_K), (T.Q4_K, T.Q6_K, T.Q8_0), (T.Q5_0, T.Q4_0, T.F16), (T.F32, T.F32, T.F32)],
)
def test_the_one_call_expert_mlp_is_its_three_products_and_activation_bit_for_bit(
    types, match_ggml, monkeypatch
):
    """`expert_mlp` on the CPU is one C call: the same products and activation as the per-product
    path, in the same order (mixed types, 8-bit activations, F32 experts whatever match_ggml says, or,
    for a type without integer kernels under match_ggml, the per-product path itself)."""
    one_call = []
    fused = cpu.expert_mlp
    monkeypatch.setattr(cpu, "expert_mlp", lambda x, *args: one_call.append(len(x)) or fused(x, *args))
    experts = [Expert(s, *types) for s in range(3)]
    x = torch.randn(5, 512)
    betas = Situ(1.5, 0.0 if types[0] == T.Q5_0 else 4.0)

    def product(role: str, inputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return grouped_qmatmul(
            inputs, [getattr(e, role) for e in experts], STEP_STARTS, rows, "auto", match_ggml
        )

    hidden = situ(product("gate", x, STEP_ROWS), product("up", x, STEP_ROWS), betas.beta, betas.linear_beta)
    expected = product("down", hidden, torch.arange(len(STEP_ROWS)))
    assert torch.equal(expert_mlp(x, experts, STEP_STARTS, STEP_ROWS, betas, match_ggml), expected)
    assert one_call == ([] if match_ggml and T.Q5_0 in types else [len(x)])


def test_f32_experts_of_a_prefill_take_one_c_call(monkeypatch):
    """F32 experts of a step of any length are one C call whose every row is bit for bit that row's
    decode step and its result in any grouping of the experts (a streamed step's fetch groups)."""
    experts = [Expert(s, T.F32, T.F32, T.F32) for s in range(3)]
    activation = Situ(2.0, 3.0)
    one_call = []
    fused = cpu.expert_mlp
    monkeypatch.setattr(cpu, "expert_mlp", lambda x, *args: one_call.append(len(args[4])) or fused(x, *args))
    x = torch.randn(5, 512)
    prefill = expert_mlp(x, experts, STEP_STARTS, STEP_ROWS, activation)
    first_two = expert_mlp(x, experts[:2], STEP_STARTS[:3], STEP_ROWS[:5], activation)
    last = expert_mlp(x, experts[2:], torch.tensor([0, 1]), STEP_ROWS[5:], activation)
    assert torch.equal(torch.cat([first_two, last]), prefill)
    for b in range(3):
        for p in range(int(STEP_STARTS[b]), int(STEP_STARTS[b + 1])):
            one = torch.tensor([0, 1])
            alone = expert_mlp(x[STEP_ROWS[p]][None], [experts[b]], one, torch.tensor([0]), activation)
            assert torch.equal(prefill[p], alone[0])
    slow = expert_mlp(x, experts, STEP_STARTS, STEP_ROWS, activation, backend="reference")
    assert relative_error(prefill, slow) <= 1e-6
    assert one_call == [6, 5, 1, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("shape", [(1, 1024), (3, 7, 100), (2, 16)])
def test_the_c_rms_norm_and_situ_match_their_torch_formulas(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x, weights = 30 * torch.randn(*shape, generator=generator), torch.randn(shape[-1], generator=generator)
    for scale in (weights, None):
        expected = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        expected = expected if scale is None else expected * scale.double()
        assert relative_error(rms_norm(x, scale, 1e-6).double(), expected) <= 1e-6
    gate, up = x, torch.randn(*shape, generator=generator) * 50
    for beta, linear_beta in ((2.0, 3.0), (0.5, 0.0)):
        g, u = gate.double(), up.double()
        u = linear_beta * torch.tanh(u / linear_beta) if linear_beta > 0 else u
        expected = beta * torch.tanh(g / beta) * torch.sigmoid(g) * u
        assert relative_error(situ(gate, up, beta, linear_beta).double(), expected) <= 1e-6
    needs_grad = x.clone().requires_grad_()  # autograd takes the torch formula
    assert rms_norm(needs_grad, weights, 1e-6).requires_grad


def test_a_prefills_activation_on_the_threads_gives_the_same_values():
    """Enough values (a prefill's) are cut in chunks over the threads: the same bits as one thread."""
    generator = torch.Generator().manual_seed(7)
    gate, up = (
        30 * torch.randn(300, 512, generator=generator),
        50 * torch.randn(300, 512, generator=generator),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = situ(gate, up, 2.0, 3.0)
        torch.set_num_threads(2)
        assert torch.equal(situ(gate, up, 2.0, 3.0), alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(situ(gate[5:6], up[5:6], 2.0, 3.0), alone[5:6])


def test_the_c_kda_step_gives_the_same_bits_on_one_and_two_threads():
    """Kimi-K3's 64 heads of 128 take the threads, each head on one: the same output and states."""
    from k3stream.quant.kernels import cpu

    heads, dim, taps = 64, 128, 4
    generator = torch.Generator().manual_seed(64)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator)

    inner = heads * dim
    inputs = (draw(1, 3 * inner), draw(1, inner), draw(1, heads), draw(1, inner))
    weights = (draw(taps, 3 * inner), draw(inner), -torch.rand(heads, generator=generator), torch.rand(dim))
    history, state = draw(taps - 1, 3 * inner), draw(heads, dim, dim, scale=0.01)
    results = []
    for threads in (1, 2):
        histories, states = [history.clone()], [state.clone()]
        out = torch.empty(1, inner)
        function, args, _ = cpu.bind_kda_recurrent(
            inputs, histories, states, weights, (-5.0, 1e-6, 0.1), out, threads
        )
        assert function(*args) == 0
        results.append((out, histories[0], states[0]))
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    assert not torch.equal(results[0][2], state)  # the state moved


@pytest.mark.parametrize(
    "heads, dim, taps, length", [(8, 128, 4, 37), (3, 24, 2, 37), (2, 16, 1, 37), (4, 16, 4, 301)]
)
def test_the_c_kda_recurrence_over_a_sequence_is_its_steps_one_by_one(heads, dim, taps, length):
    """A prefill's call (one sequence of T rows, heads on two threads) gives the same bits as T decode
    calls of one row: outputs, the state and the conv history (head sizes with and without the eight-row
    blocks of the delta rule; small heads over enough rows take the threads too)."""
    from k3stream.quant.kernels import cpu

    generator = torch.Generator().manual_seed(heads * dim)
    inner = heads * dim
    inputs = [torch.randn(length, width, generator=generator) for width in (3 * inner, inner, heads, inner)]
    weights = (
        0.5 * torch.randn(taps, 3 * inner, generator=generator),
        torch.randn(inner, generator=generator),
        -torch.rand(heads, generator=generator),
        torch.rand(dim, generator=generator),
    )
    history, state = torch.randn(taps - 1, 3 * inner, generator=generator), torch.zeros(heads, dim, dim)
    numbers, runs = (-5.0, 1e-6, dim**-0.5), []
    for steps in ((slice(0, length),), [slice(t, t + 1) for t in range(length)]):
        histories, states, outs = [history.clone()], [state.clone()], []
        for rows in steps:
            out = torch.empty(rows.stop - rows.start, inner)
            function, args, _ = cpu.bind_kda_recurrent(
                [t[rows].contiguous() for t in inputs], histories, states, weights, numbers, out, 2
            )
            assert function(*args) == 0
            outs.append(out)
        runs.append((torch.cat(outs), histories[0], states[0]))
    for together, one_by_one in zip(*runs, strict=True):
        assert torch.equal(together, one_by_one)
    assert runs[0][2].abs().sum() > 0
    out = torch.empty(length, inner)
    with pytest.raises(
        ValueError, match=f"{length} rows, 2 histories and 2 states do not make whole sequences"
    ):
        cpu.bind_kda_recurrent(inputs, [history] * 2, [state] * 2, weights, numbers, out, 1)


@pytest.mark.parametrize("rows, top_k, width", [(1, 8, 256), (5, 16, 96), (3, 1, 7)])
def test_the_c_combine_is_the_torch_weighted_sum(rows, top_k, width):
    """The MoE's weighted sum of each row's expert outputs: the torch formula's products, summed in
    choice order (the same bits as `(pairs.view(N, k, W) * weights[..., None]).sum(1)` here)."""
    from k3stream.quant.kernels import cpu

    generator = torch.Generator().manual_seed(rows * top_k)
    pairs, weights = (
        torch.randn(rows * top_k, width, generator=generator),
        torch.rand(rows, top_k, generator=generator),
    )
    expected = (pairs.double().view(rows, top_k, width) * weights.double()[..., None]).sum(1)
    assert relative_error(cpu.combine(pairs, weights).double(), expected) <= 1e-6
    out = torch.empty(rows, width)
    assert cpu.combine(pairs, weights, out) is out and torch.equal(out, cpu.combine(pairs, weights))


@pytest.mark.parametrize("offset", [0, 1, 37, 4099])
def test_a_prefills_mla_queries_attend_in_one_call_with_each_decode_steps_bits(offset):
    """The row-exact prefill attention: queries at positions offset.., each over the latent cache up to
    its own, in one call of any count on one thread or two, give each query what a decode step's
    attention at its position gives, bit for bit (one query over a long cache: its parts on the
    threads)."""
    generator = torch.Generator().manual_seed(offset)
    queries = torch.randn(50, 4, 40, generator=generator)
    cache = 3 * torch.randn(offset + 50, 40, generator=generator)
    alone = torch.stack([cpu.mla_attend(queries[i], cache[: offset + i + 1], 32, 0.1) for i in range(50)])
    for count in (1, 2, 7, 50):
        for threads in (1, 2):
            together = cpu.mla_attend_rows(queries[:count], cache, offset, 32, 0.1, threads)
            assert torch.equal(together, alone[:count])


@pytest.mark.parametrize(
    "heads, length, width, kv",
    [(1, 1, 288, 256), (4, 37, 288, 256), (16, 200, 288, 256), (16, 300, 288, 256), (5, 4099, 264, 200)],
)
def test_the_c_mla_attention_matches_its_torch_formula(heads, length, width, kv):
    """MLA's decode attention (one query a head over the latent cache, in blocks of rows, heads in pairs
    and rows in fours with their odd ends; heads on two threads when the work is large, the same bits as
    on one) against softmax(q K^T s) K[:, :kv] in double."""
    from k3stream.quant.kernels import cpu

    generator = torch.Generator().manual_seed(heads * length)
    query = torch.randn(heads, width, generator=generator)
    cache = 3 * torch.randn(length, width, generator=generator)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu.mla_attend(query, cache, kv, 0.06))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)
    probs = torch.softmax(query.double() @ cache.double().T * 0.06, dim=-1)
    # float32 sums in row order: their rounding grows with the rows
    exact = probs @ cache.double()[:, :kv]
    assert relative_error(results[0].double(), exact) <= 1e-6 * max(1.0, length / 1000)


def test_the_c_mla_attention_of_scores_spanning_hundreds_matches_its_torch_formula():
    """A trained model's scores span hundreds (the shipped model's last token: 220-470 over 7,194 rows):
    the weights far below the largest are 0 (not subnormal floats), each part's softmax merged with the
    others': against softmax(q K^T s) K[:, :kv] in double, within twice the error of that formula in
    torch's float32 (float32 scores of hundreds are 3e-5 apart), on one thread or two. Over 64 queries:
    with a few, one query's rounding decides both errors, and torch's GEMM rounds otherwise on other
    CPUs."""
    from k3stream.quant.kernels import cpu

    generator = torch.Generator().manual_seed(3)
    query = 40 * torch.randn(64, 264, generator=generator)
    cache = torch.randn(1000, 264, generator=generator)
    scores = query.double() @ cache.double().T * 0.06
    assert (scores.max(-1).values - scores.min(-1).values).min() > 200
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu.mla_attend(query, cache, 256, 0.06))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)
    exact = torch.softmax(scores, dim=-1) @ cache.double()[:, :256]
    in_float = torch.softmax(query @ cache.T * 0.06, dim=-1) @ cache[:, :256]
    assert relative_error(results[0].double(), exact) <= 2 * relative_error(in_float.double(), exact)


@pytest.mark.parametrize("count", [1, 7, 4096 + 3])
def test_the_c_sigmoid_gate_matches_torch(count):
    """MLA's output gate values * sigmoid(logits) in C (the polynomial exp) against torch's, extreme
    logits included (no overflow, no NaN)."""
    from k3stream.quant.kernels import cpu

    generator = torch.Generator().manual_seed(count)
    values = torch.randn(1, count, generator=generator)
    logits = 8 * torch.randn(1, count, generator=generator)
    logits[0, 0] = -1e4 if count > 1 else 1e4
    got = cpu.sigmoid_gate(values, logits)
    expected = values.double() * torch.sigmoid(logits.double())
    assert torch.isfinite(got).all() and relative_error(got.double(), expected) <= 1e-6


def test_c_copies_move_strided_rows_exactly_and_fall_back_to_torch_where_they_cannot():
    """`bind_copy` between matrices whose rows belong to wider ones (a decode token's query assembled
    from its parts), `copy_row` into a cache's next row; a view with strided columns copies by torch."""
    from k3stream.quant.kernels import cpu

    wide, target = torch.randn(5, 12), torch.zeros(5, 20)
    function, args, _ = cpu.bind_copy(wide[:, 3:10], target[:, 8:15])
    assert function is cpu._ggml_cpu().copy
    function(*args)
    assert torch.equal(target[:, 8:15], wide[:, 3:10])
    assert not target[:, :8].any() and not target[:, 15:].any()
    function, args, _ = cpu.bind_copy(wide[:, ::2], target[:, :6])
    assert function is not cpu._ggml_cpu().copy
    function(*args)
    assert torch.equal(target[:, :6], wide[:, ::2])
    cache, row = torch.zeros(4, 12), torch.randn(1, 12)
    cpu.copy_row(row, cache, 2)
    assert torch.equal(cache[2], row[0]) and not cache[[0, 1, 3]].any()


@pytest.mark.parametrize(
    "types",
    [[T.F32], [T.F16], [T.Q2_K], [T.Q5_0, T.Q4_1, T.Q5_K], [T.Q2_K, T.F32, T.Q4_0], [T.Q3_K, T.F16, T.Q8_0]],
    ids=lambda types: "+".join(t.name for t in types),
)
@pytest.mark.parametrize("match_ggml", [False, True])
def test_prepared_products_are_qmatmul_bit_for_bit(types, match_ggml, monkeypatch):
    """`Products` (a linear layer's call, or a layer's projections of one input side by side) takes
    decode-sized inputs straight to the C kernels in one call and everything else through qmatmul per
    weight: the same values either way (bit for bit; F32 matrices within rounding: the C call sums
    each of their outputs in one chain, from an input-major copy), and qmatmul's errors."""
    from k3stream.quant.kernels import seam

    weights = [weight(qt, 40 + 8 * i, 512, seed=1 + i) for i, qt in enumerate(types)]
    products = Products(weights, match_ggml=match_ggml)
    through_qmatmul = []
    monkeypatch.setattr(seam, "qmatmul", lambda x, *args: through_qmatmul.append(len(x)) or qmatmul(x, *args))
    inputs = [torch.randn(1, 512), torch.randn(20, 512), torch.randn(2, 3, 512), torch.randn(4, 1024)[:, ::2]]
    for x in inputs:
        got = products(x).split([w.shape[0] for w in weights], dim=-1)
        for part, w in zip(got, weights, strict=True):
            expected = qmatmul(x, w, match_ggml=match_ggml)
            close = w.ggml_type == T.F32 and relative_error(part, expected) < 1e-6
            assert torch.equal(part, expected) or close
    # under match_ggml a type without integer kernels (F16) has its inputs rounded in torch first
    rounded_in_torch = match_ggml and T.F16 in types
    expected_calls = [len(x) for x in inputs[:2] if rounded_in_torch] + [2, 4]
    assert through_qmatmul == [rows for rows in expected_calls for _ in weights]
    with pytest.raises(ValueError, match="input has 256 features, the weight expects 512"):
        products(torch.randn(1, 256))
    with pytest.raises(ValueError, match="different input widths"):
        Products([weights[0], weight(T.F32, 8, 256)])


@pytest.mark.parametrize("match_ggml", [False, True])
@pytest.mark.parametrize("types", [(T.F32, T.F32, T.F32), (T.Q2_K, T.Q2_K, T.Q3_K), (T.F16, T.Q4_0, T.F32)])
def test_an_mlp_in_one_call_is_its_three_products_bit_for_bit(types, match_ggml, monkeypatch):
    """`MLP` (the dense and shared-expert MLPs) is one C call for inputs its products take straight to
    the C kernels (any row count; under match_ggml, types whose kernels quantize their own
    activations, or F32 alone) and the three products otherwise: the same values either way."""
    gate, up, down = (
        weight(qt, rows, 256, seed=i) for i, (qt, rows) in enumerate(zip(types, (256, 256, 64), strict=True))
    )
    activation = Situ(2.0, 3.0)
    mlp = MLP(*(Products([w], match_ggml=match_ggml) for w in (gate, up, down)), activation)
    generator = torch.Generator().manual_seed(3)
    one_call = []
    fused = cpu.expert_mlp
    monkeypatch.setattr(cpu, "expert_mlp", lambda x, *args: one_call.append(len(x)) or fused(x, *args))
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=generator)
        expected = mlp.down(activation(mlp.gate(x), mlp.up(x)))
        assert torch.equal(mlp(x), expected)
    rounded_in_torch = match_ggml and T.F16 in types
    assert one_call == ([] if rounded_in_torch else [1, 5, 40])


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q2_K, T.F16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("match_ggml", [False, True])
def test_a_prepared_grouped_product_is_grouped_qmatmul_bit_for_bit(qt, match_ggml):
    """`GroupedProduct` (MLA's per-head k_b and v_b) sends what grouped_qmatmul sends to the C kernel
    straight there: the same values for any grouping, and grouped_qmatmul's path for anything else."""
    weights = [weight(qt, 24, 256, seed=10 + h) for h in range(4)]
    product = GroupedProduct(weights, match_ggml=match_ggml)
    generator = torch.Generator().manual_seed(5)
    for count in (4, 9, 40):
        x = torch.randn(count, 256, generator=generator)
        rows = torch.randperm(count, generator=generator)
        cuts = sorted(torch.randint(0, count + 1, (3,), generator=generator).tolist())
        starts = torch.tensor([0, *cuts, count])
        expected = grouped_qmatmul(x, weights, starts, rows, match_ggml=match_ggml)
        assert torch.equal(product(x, starts, rows), expected)
        assert torch.equal(product(x[:, :256].T.contiguous().T, starts, rows), expected)  # not contiguous
    with pytest.raises(ValueError, match="differ in GGML type or shape"):
        GroupedProduct(weights + [weight(qt, 8, 256)])(x, torch.tensor([0, 1, 2, 3, 4, count]), rows)


# MLA's per-head shapes off the vector widths: head counts, ranks (output rows) and row lengths (Kimi-K3's
# k_b: 96 heads of 512 x 128, v_b: 128 x 512; short rows of at most 256 bytes take adjacent row pairs)
PER_HEAD_SHAPES = [(7, 37, 128), (3, 5, 96), (5, 1, 32), (2, 9, 224), (3, 11, 544), (2, 70, 512)]


@pytest.mark.parametrize("heads, out_rows, cols", PER_HEAD_SHAPES, ids=str)
@pytest.mark.parametrize("match_ggml", [True, False])
def test_per_head_q8_0_products_of_one_row_each_keep_every_rows_bits(
    heads, out_rows, cols, match_ggml, monkeypatch
):
    """One input row a head (a decode step's k_b and v_b): four or two weight rows at a time share the
    input's blocks, each row its own chains; every output is that row's bits in a two-row product (the
    kernels' one-row-at-a-time path), on one and two threads and without AVX-512, and near the
    reference."""
    weights = [weight(T.Q8_0, out_rows, cols, seed=h) for h in range(heads)]
    x = torch.randn(heads, cols, generator=torch.Generator().manual_seed(out_rows))
    one_each = torch.arange(heads + 1), torch.arange(heads)
    twice = (
        torch.arange(0, 2 * heads + 1, 2),
        torch.arange(heads).repeat_interleave(2),
    )  # each head's row twice
    results = []
    threads = torch.get_num_threads()
    try:
        for no_avx512, count in ((None, 1), (None, 2), ("1", 2)):  # the CPU's own kernels, then AVX2's
            monkeypatch.delenv("K3STREAM_NO_AVX512", raising=False)
            if no_avx512:
                monkeypatch.setenv("K3STREAM_NO_AVX512", no_avx512)
            torch.set_num_threads(count)
            results.append(grouped_qmatmul(x, weights, *one_each, match_ggml=match_ggml))
            assert torch.equal(results[-1], grouped_qmatmul(x, weights, *twice, match_ggml=match_ggml)[::2])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(result, results[0]) for result in results)
    inputs = round_like_ggml(x, T.Q8_0) if match_ggml else x
    expected = torch.cat([reference(inputs[h : h + 1], w) for h, w in enumerate(weights)])
    assert relative_error(results[0], expected) <= 1e-6


@pytest.mark.parametrize(
    "experts,top_k,normalize", [(64, 8, True), (896, 16, True), (7, 7, False), (5, 1, True)]
)
def test_the_c_router_picks_and_weighs_as_the_torch_formula(experts, top_k, normalize):
    """`Routing.choose` on float32 CPU logits is one C call: the same experts in the same order (sigmoid
    plus bias, descending) and the same weights within float rounding; a top-k beyond the experts is
    refused in one line."""
    from k3stream.model.moe import MIN_WEIGHT_SUM, Routing

    generator = torch.Generator().manual_seed(experts + top_k)
    h, router = torch.randn(3, 32, generator=generator), Products([weight(T.F32, experts, 32, seed=experts)])
    bias = torch.randn(experts, generator=generator) * 0.5
    routing = Routing(top_k, normalize, 2.5)
    chosen, weights = routing.choose(router(h), bias)
    probs = torch.sigmoid(router(h).double())
    expected = torch.topk(probs + bias.double(), top_k, dim=-1).indices
    picked = probs.gather(-1, expected)
    if normalize:
        picked = picked / picked.sum(-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    assert torch.equal(chosen, expected) and chosen.dtype == torch.int64
    assert relative_error(weights.double(), picked * 2.5) <= 1e-6
    with pytest.raises(ValueError, match=f"route: top-k {experts + 1} outside 1..{experts} experts"):
        Routing(experts + 1, normalize, 1.0).choose(router(h), bias)


def test_a_product_runs_without_the_gil_so_other_threads_go_on():
    """The store's readers and the server's threads run beside a product: the extension's call must
    release the GIL as ctypes did (else every thread stalls for the product's whole length)."""
    w = weight(T.Q2_K, 4096, 4096)
    x = torch.randn(16, 4096)
    start = time.perf_counter()
    qmatmul(x, w)
    one_product = time.perf_counter() - start
    started, finished, ticks = threading.Event(), threading.Event(), []

    def products() -> None:
        started.set()
        for _ in range(20):
            qmatmul(x, w)
        finished.set()

    worker = threading.Thread(target=products)
    worker.start()
    started.wait()
    while not finished.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    gaps = np.diff(ticks)
    # a held GIL leaves gaps of a whole product between the ticks; released, they are ~1 ms
    assert len(gaps) >= 10 and float(np.median(gaps)) < one_product / 3


def test_the_extension_call_refuses_bad_arguments_in_one_line():
    module = cpu._ggml_cpu()
    with pytest.raises(TypeError, match="a list of addresses"):
        module.grouped_product(0, 256, (0,), 1, 84, 10, 0, 0, 0, 1, 0)
    with pytest.raises(TypeError, match="takes 11 arguments"):
        module.grouped_product(0, 256)
    with pytest.raises(TypeError):  # a pointer that is not an int: Python's own one-line error
        module.grouped_product(0, "256", [0], 1, 84, 10, 0, 0, 0, 1, 0)
    with pytest.raises(TypeError):
        module.grouped_product(0, 256, ["0"], 1, 84, 10, 0, 0, 0, 1, 0)
    with pytest.raises(TypeError, match="expert_mlp takes 20 arguments, got 2"):
        module.expert_mlp(0, 256)
    with pytest.raises(TypeError, match="address lists differ in length"):
        module.expert_mlp(
            0, 256, [0], 10, 84, [0, 0], 10, 84, [0], 11, 110, 256, 256, 0, 0, 2.0, 3.0, 0, 1, 0
        )
    with pytest.raises(TypeError, match="products: its address lists differ in length"):
        module.products(0, 256, 1, [0], [10, 10], [1], [84], [0], 0, 1)
    with pytest.raises(TypeError, match="kda_recurrent: its address lists differ in length"):
        module.kda_recurrent(0, [0], 0, 4, 0, 0, 0, 0, 0.0, 0, [0, 0], 0, 0, 1, 8, 128, 1e-6, 0.1, 0, 1)
    with pytest.raises(ValueError, match="chosen_experts: expert 9 outside 0..7"):
        chosen = torch.tensor([[1, 9]])
        module.chosen_experts(
            0, 256, chosen.data_ptr(), 2, 8, *[0, 84, 10, 84] * 3, 256, 256, 1.0, 0.0, 0, 1, 0
        )
    with pytest.raises(ValueError, match="experts_at: 0 experts, not 1..256"):
        module.experts_at(0, 256, 0, 0, *[0, 10, 84] * 3, 256, 256, 1.0, 0.0, 0, 0, 0, 1, 0)
    with pytest.raises(TypeError, match="experts_at takes 22 arguments, got 2"):
        module.experts_at(0, 256)
    with pytest.raises(TypeError, match="argument 3 must be a list"):
        module.expert_mlp(0, 256, 0, 10, 84, [0], 10, 84, [0], 11, 110, 256, 256, 0, 0, 2.0, 3.0, 0, 1, 0)
    with pytest.raises(TypeError):  # a float where a pointer goes
        module.rms_norm(0.5, 1, 16, 0, 1e-6, 0)
    with pytest.raises(TypeError, match="situ takes 7 arguments"):
        module.situ(0, 0, 1)


def test_a_product_allocates_no_float32_copy_of_the_weight():
    w = weight(T.Q2_K, 2048, 2048)
    x = torch.randn(1, 2048)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        qmatmul(x, w)
    allocated = sum(max(event.cpu_memory_usage, 0) for event in prof.events())
    assert allocated < 2048 * 2048 * 4 / 64  # the dense weight would be 16 MiB; the output is 8 KiB


def test_types_and_widths_without_a_kernel_take_the_reference_path(monkeypatch):
    odd = weight(T.F16, 4, 48)  # F16 rows the C kernel cannot tile
    assert kernel_for(int(T.F16), "cpu", 48) == "reference"
    x = torch.randn(2, 48)
    assert relative_error(qmatmul(x, odd), reference(x, odd)) <= 1e-5
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert note_fallbacks({int(T.Q2_K), int(T.F32)}, "cpu") == [
        "note: no cpu kernel for GGML type Q2_K: using the reference dequantize path"
    ]


def test_shapes_that_do_not_fit_the_blocks_name_the_tensor():
    with pytest.raises(ValueError, match=r"blk\.3\.attn_q\.weight: row of 100 elements is not a multiple"):
        checked_weight("blk.3.attn_q.weight", torch.zeros(100, dtype=torch.uint8), int(T.Q4_0), (1, 100))
    with pytest.raises(ValueError, match=r"blk\.3\.attn_q\.weight: Q8_0 \(2, 32\) needs 68 bytes, has 34"):
        checked_weight("blk.3.attn_q.weight", torch.zeros(34, dtype=torch.uint8), int(T.Q8_0), (2, 32))


GENERIC_CHECK = """
import numpy as np, torch
from test_kernels import (CPU_TYPES, FLOATS, Q8_1_TYPES, cpu, qmatmul, reference, relative_error,
                          round_like_ggml, weight)
worst = 0.0
for qt in CPU_TYPES + FLOATS:
    w = weight(qt, 19, 512, seed=4)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32))
    worst = max(worst, relative_error(qmatmul(x, w), reference(x, w)))
    if int(qt) in cpu.Q8_TYPES and qt not in Q8_1_TYPES:  # Q8_1's: test_integer_kernels_equal_...
        rounded = reference(round_like_ggml(x, int(qt)), w)
        worst = max(worst, relative_error(qmatmul(x, w, match_ggml=True), rounded))
print(worst)
"""


def test_the_portable_kernels_match_the_reference_too():
    """K3STREAM_GENERIC_KERNELS=1: the kernels a machine without AVX2 runs (tile and integer paths)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, K3STREAM_GENERIC_KERNELS="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", GENERIC_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= 1e-5


def test_f32_products_take_the_c_kernel_and_rows_do_not_depend_on_their_company(monkeypatch):
    """F32 GGUF bytes go through the C kernel at any row count, on every thread; each row's result is
    the same alone, in a batch and on one thread."""
    w = weight(T.F32, 300, 1024, seed=6)
    x = torch.randn(40, 1024)
    calls = []
    product = cpu.grouped_product
    monkeypatch.setattr(cpu, "grouped_product", lambda *args: calls.append(len(args[0])) or product(*args))
    alone = torch.stack([qmatmul(row[None], w)[0] for row in x])
    assert calls == [1] * len(x)
    assert torch.equal(qmatmul(x, w), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(qmatmul(x[:5], w), alone[:5])
    finally:
        torch.set_num_threads(threads)
    assert relative_error(alone, reference(x, w)) <= 1e-6


def test_grouped_f32_products_give_each_row_its_bits_alone():
    """F32 matrices in one grouped product (MLA's heads in an F32 file): each row its C mat-vec result,
    the bits qmatmul gives it alone, in any company and at any row count."""
    weights = [weight(T.F32, 40, 512, seed=s) for s in range(3)]
    x = torch.randn(30, 512)
    for counts in ([1, 3, 2], [16, 0, 5], [20, 2, 7]):
        starts = torch.tensor([0, *np.cumsum(counts)])
        rows = torch.from_numpy(np.random.default_rng(sum(counts)).integers(0, len(x), sum(counts)))
        got = grouped_qmatmul(x, weights, starts, rows)
        for b, w in enumerate(weights):
            mine = slice(int(starts[b]), int(starts[b + 1]))
            assert torch.equal(got[mine], qmatmul(x[rows[mine]], w))
            if counts[b]:
                alone = [qmatmul(x[rows[p]][None], w)[0] for p in range(mine.start, mine.stop)]
                assert torch.equal(got[mine], torch.stack(alone))
            assert counts[b] == 0 or relative_error(got[mine], reference(x[rows[mine]], w)) <= 1e-6


def test_a_thread_that_releases_its_openmp_workers_ends_them():
    """A thread that ran a 2-thread region keeps its OpenMP worker as long as it lives (libgomp then
    counts it beside another thread's team and stops their workers spinning); released, the worker
    ends. `serve` releases the loading thread's before its scheduler thread takes the kernels."""
    import os

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP worker to release")
    counts: list[int] = []

    def run() -> None:
        torch.randn(4_000_000).mul_(2)  # one parallel region: this thread's team starts its worker
        counts.append(len(os.listdir("/proc/self/task")))
        counts.append(cpu.release_openmp_workers())
        counts.append(len(os.listdir("/proc/self/task")))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    with_worker, released, after = counts
    assert released is True and after <= with_worker - 1
