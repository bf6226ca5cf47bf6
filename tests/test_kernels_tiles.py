"""The multi-row integer kernels (`tiles_cpu.c`): a matrix's product with several 8-bit input rows,
each weight block decoded once for all of them, is bit for bit the one-row kernel's product of each
row alone and llama.cpp's own vec_dot (its libggml-cpu), on random valid blocks, for every row count
and width the blocking treats apart, and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, take_kernel_isa
from k3stream.quant.kernels import cpu
from k3stream.testing import ggml_oracle
from test_kernels_iquants import AVX2_BITS_AVX512_TYPES, inputs
from test_kernels_iquants import AVX512_TYPES as GRID_AVX512_TYPES

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C kernels were not built with this install")
needs_llama = pytest.mark.skipif(
    ggml_oracle.library() is None, reason="llama-cpp-python's libggml-cpu not found"
)

TILED = [T.Q2_K, T.Q3_K, T.Q6_K, T.Q4_K, T.Q8_0, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S,
         T.IQ4_XS, T.NVFP4]  # fmt: skip
# the types whose row kernels take every input row on AVX2, sharing each decoded block between four
ONE_ROW = [T.Q5_K, T.Q5_0, T.Q4_1, T.Q5_1]
LLAMA_EXACT = TILED + ONE_ROW
ISAS = pytest.mark.parametrize("isa", KERNEL_ISAS)
# the kernels that are llama.cpp's AVX2 vec_dot bit for bit: every AVX2 one, and the AVX-512 ones but the
# grid i-quants' (their own lanes: held within a few ulp in test_kernels_iquants)
LLAMA_EXACT_ISAS = [(t, isa) for t in LLAMA_EXACT for isa in ("avx512", "avx2")
                    if not (isa == "avx512" and t in GRID_AVX512_TYPES)]  # fmt: skip
# the types whose AVX-512 one-row kernels keep the AVX2 ones' bits (`kquants_avx512.c`, `iquants_cpu.c`)
SAME_BITS_AVX512_TYPES = [T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q6_K, *ONE_ROW, *AVX2_BITS_AVX512_TYPES]
# input rows: one (the one-row kernel), the tile's groups and tails, past the 64 parked rows
COUNTS = [1, 2, 3, 5, 8, 17, 24, 64, 70]
# (weight rows, width): weight-row groups of 4 with tails of 1-3 (Q8_0's AVX-512 kernel: 8, tails of
# 1-7), tasks of 32 rows; chunks of 4 blocks (Q8_0: 16 or 32) with a tail, one block, many
MATRICES = [(1, 256), (6, 512), (7, 1280), (37, 2304), (33, 1024), (12, 768)]


def matrix(qt: T, rows: int, cols: int, seed: int) -> np.ndarray:
    elems = GGML_QUANT_SIZES[qt][0]
    blocks = ggml_oracle.random_blocks(int(qt), rows * cols // elems, np.random.default_rng(seed))
    return blocks.reshape(rows, -1)


def grouped(
    qt: T, weights: list[np.ndarray], x: np.ndarray, counts: list[int], rows: np.ndarray
) -> np.ndarray:
    """`cpu.grouped_product` on 8-bit activations: matrix b takes the x rows `rows[starts[b]:starts[b+1]]`."""
    starts = torch.tensor([0, *np.cumsum(counts).tolist()])
    datas = [torch.from_numpy(np.ascontiguousarray(w).reshape(-1)) for w in weights]
    out = cpu.grouped_product(
        torch.from_numpy(x), datas, int(qt), weights[0].shape[0], weights[0].shape[1], starts,
        torch.from_numpy(rows), True,
    )  # fmt: skip
    return out.numpy()


def wide_matrix(qt: T, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """random_blocks whose F16 scales (d, dmin, m; not IQ1_M's and MXFP4's, of their own layouts) span
    2^-12..2^3 of either sign, apart in every block: products whose terms cancel, so any other order of
    their float operations shows in the last bits."""
    data = ggml_oracle.random_blocks(int(qt), rows * blocks, rng)
    for at in () if qt in (T.IQ1_M, T.MXFP4) else ggml_oracle.F16_AT.get(int(qt), (0,)):
        scales = rng.standard_normal(len(data)) * np.exp2(rng.uniform(-12, 3, len(data)))
        data[:, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def wide_inputs(count: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Normal inputs, each 32 of them times 10^-3..10^3."""
    spread = np.repeat(10.0 ** rng.uniform(-3, 3, (count, cols // 32)), 32, axis=1)
    return (rng.standard_normal((count, cols)) * spread).astype(np.float32)


def one_row_at_a_time(qt: T, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    alone = [grouped(qt, [w], row[None], [1], np.zeros(1, dtype=np.int64))[0] for row in x]
    return np.stack(alone) if alone else np.zeros((0, w.shape[0]), dtype=np.float32)


@pytest.mark.parametrize("qt", TILED + ONE_ROW, ids=lambda t: t.name)
@pytest.mark.parametrize("out_rows,cols", MATRICES)
@ISAS
def test_many_rows_give_the_one_row_kernels_bits(qt, out_rows, cols, isa, monkeypatch):
    take_kernel_isa(isa, monkeypatch)
    w = matrix(qt, out_rows, cols, seed=out_rows)
    x = inputs(max(COUNTS), cols, seed=cols)
    alone = one_row_at_a_time(qt, w, x)
    for count in COUNTS:
        together = grouped(qt, [w], x[:count], [count], np.arange(count))
        assert np.array_equal(together.view(np.uint32), alone[:count].view(np.uint32)), count


@pytest.mark.parametrize("cols", [32, 96, 1056])
@pytest.mark.parametrize("out_rows", [2, 3, 4, 9, 15])
@ISAS
def test_q8_0_rows_of_any_whole_blocks(cols, out_rows, isa, monkeypatch):
    """Q8_0 rows of 1, 3 and 33 blocks (its tiles take 16 or 32 blocks at a time), 2 to 15 of them (the
    AVX-512 tiles pair weight rows, 8 a group): the one-row kernel's bits."""
    take_kernel_isa(isa, monkeypatch)
    w, x = matrix(T.Q8_0, out_rows, cols, seed=cols), inputs(11, cols, seed=cols + 1)
    together = grouped(T.Q8_0, [w], x, [len(x)], np.arange(len(x)))
    assert np.array_equal(together.view(np.uint32), one_row_at_a_time(T.Q8_0, w, x).view(np.uint32))


@needs_llama
@pytest.mark.parametrize("qt", [T.Q8_0, T.Q5_0, T.Q4_1, T.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [32, 96, 1056])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_32_value_rows_of_any_whole_blocks_give_llama_cpps_bits(qt, cols, isa, monkeypatch):
    """Rows of 1, 3 and 33 blocks (the AVX-512 kernels take 16 at a time), 1 to 3 weight rows a call's
    range (they pair rows m and m + half), two input rows: llama.cpp's vec_dot bit for bit."""
    take_kernel_isa(isa, monkeypatch)
    x = inputs(2, cols, seed=cols)
    activations = [ggml_oracle.quantize_activations(row, int(qt)) for row in x]
    for out_rows in (1, 2, 3):
        w = matrix(qt, out_rows, cols, seed=out_rows)
        expected = np.array(
            [[ggml_oracle.vec_dot(int(qt), cols, r, a) for r in w] for a in activations], dtype=np.float32
        )
        got = grouped(qt, [w], x, [len(x)], np.arange(len(x)))
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), out_rows


@needs_llama
@pytest.mark.parametrize("qt,isa", LLAMA_EXACT_ISAS, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("count", [1, 2, 5, 17])
def test_many_rows_give_llama_cpps_vec_dot_bit_for_bit(qt, isa, count, monkeypatch):
    """Against the vec_dot llama.cpp runs on this machine (the portable K-quant kernels sum a block's
    lanes in another order than ggml's generic C: they are held to the one-row kernel above); the
    AVX-512 kernels form ggml's AVX2 lanes, so they are held to it too."""
    take_kernel_isa(isa, monkeypatch)
    avx2 = bool(ggml_oracle.library().ggml_cpu_has_avx2())
    cols = 1280
    w, x = matrix(qt, 7, cols, seed=count), inputs(count, cols, seed=count + 1)
    activations = [ggml_oracle.quantize_activations(row, int(qt)) for row in x]
    expected = np.array(
        [[ggml_oracle.vec_dot(int(qt), cols, r, a, not avx2) for r in w] for a in activations],
        dtype=np.float32,
    )
    got = grouped(qt, [w], x, [count], np.arange(count))
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


# every type with integer kernels on 8-bit activations, on the ISAs whose kernels are llama.cpp's AVX2
# vec_dot bit for bit
WIDE_ISAS = [(T(t), isa) for t in sorted(cpu.Q8_TYPES) for isa in ("avx512", "avx2")
             if not (isa == "avx512" and t in GRID_AVX512_TYPES)]  # fmt: skip


@needs_llama
@pytest.mark.parametrize("qt,isa", WIDE_ISAS, ids=lambda v: getattr(v, "name", v))
def test_wide_ranges_give_llama_cpps_vec_dot_bit_for_bit(qt, isa, monkeypatch):
    """Scales and inputs over many orders of magnitude (terms that cancel), rows of 1 to 40 blocks, one
    input row (the one-row kernels) and 5 and 18 (the multi-row ones), 6 weight rows (a group of four
    and a tail): every output llama.cpp's vec_dot bit for bit. (Tame scales hid a block's offset sum
    taken in another order than ggml's: a few ulp, 1e-2 on a model's logits.)"""
    take_kernel_isa(isa, monkeypatch)
    rng = np.random.default_rng(int(qt))
    elems = GGML_QUANT_SIZES[qt][0]
    for blocks in (1, 3, 17, 40):
        cols = blocks * elems
        w = wide_matrix(qt, 6, blocks, rng)
        for count in (1, 5, 18):
            x = wide_inputs(count, cols, rng)
            activations = [ggml_oracle.quantize_activations(row, int(qt)) for row in x]
            expected = np.array([[ggml_oracle.vec_dot(int(qt), cols, r, a) for r in w] for a in activations])
            got = grouped(qt, [w], x, [count], np.arange(count))
            differ = got.view(np.uint32) != expected.astype(np.float32).view(np.uint32)
            assert not differ.any(), f"{blocks} blocks, {count} rows: {differ.sum()} of {differ.size} differ"


@needs_llama
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_q8_0_many_rows_give_llama_cpps_mul_mat_bit_for_bit(isa, monkeypatch):
    """Against llama.cpp's own mul_mat as its CPU backend runs a model's Q8_0 matrix (one graph, 2
    threads: llamafile's sgemm at prefill shapes), at 1 to 16 input rows. (Its Q6_K product at 16 rows
    is a few ulp from its own vec_dot, which the Q6_K kernels keep.)"""
    take_kernel_isa(isa, monkeypatch)
    cols = 1024
    w, x = matrix(T.Q8_0, 37, cols, seed=3), inputs(16, cols, seed=4)
    for count in (1, 2, 5, 16):
        graph = ggml_oracle.MulMat(int(T.Q8_0), [w], cols, count, 2)
        try:
            expected = graph(x[:count])[0]
        finally:
            graph.close()
        got = grouped(T.Q8_0, [w], x[:count], [count], np.arange(count))
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), count


@pytest.mark.parametrize("qt", TILED + ONE_ROW, ids=lambda t: t.name)
@ISAS
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(qt, isa, monkeypatch):
    """Several matrices in one call, input rows repeated and in any order, on 1 and 2 threads: each
    output is that row's product alone."""
    take_kernel_isa(isa, monkeypatch)
    counts = [2, 0, 3, 9, 1, 66]
    weights = [matrix(qt, 10, 768, seed=s) for s in range(len(counts))]
    x = inputs(12, 768, seed=5)
    rows = np.random.default_rng(6).integers(0, len(x), sum(counts))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = grouped(qt, weights, x, counts, rows)
        torch.set_num_threads(2)
        two_threads = grouped(qt, weights, x, counts, rows)
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(one_thread.view(np.uint32), two_threads.view(np.uint32))
    starts = np.cumsum([0, *counts])
    for b, w in enumerate(weights):
        alone = one_row_at_a_time(qt, w, x[rows[starts[b] : starts[b + 1]]])
        assert np.array_equal(one_thread[starts[b] : starts[b + 1]].view(np.uint32), alone.view(np.uint32))


@ISAS
def test_products_on_one_input_equal_each_product_alone(isa, monkeypatch):
    """`cpu.products` quantizes x once for its matrices of one activation type (Q8_K, Q8_0, Q8_1) and
    each matrix's outputs are its `grouped_product` alone, float-activation matrices among them."""
    take_kernel_isa(isa, monkeypatch)
    kinds = [(T.Q6_K, 1), (T.Q8_0, 1), (T.Q4_1, 1), (T.IQ2_XXS, 1), (T.Q4_K, 0), (T.Q5_1, 1), (T.Q6_K, 1),
             (T.Q5_0, 1), (T.Q8_0, 1)]  # fmt: skip
    weights = [matrix(qt, 5 + i, 512, seed=i) for i, (qt, _) in enumerate(kinds)]
    x = inputs(9, 512, seed=2)
    got = cpu.products(
        torch.from_numpy(x), [w.ctypes.data for w in weights], [int(qt) for qt, _ in kinds],
        [w.shape[0] for w in weights], [w.shape[1] for w in weights], [q8 for _, q8 in kinds],
    ).numpy()  # fmt: skip
    column = 0
    for (qt, q8), w in zip(kinds, weights, strict=True):
        data = torch.from_numpy(w.reshape(-1))
        alone = cpu.grouped_product(
            torch.from_numpy(x), [data], int(qt), w.shape[0], w.shape[1], torch.tensor([0, len(x)]),
            torch.arange(len(x)), bool(q8),
        ).numpy()  # fmt: skip
        assert np.array_equal(got[:, column : column + w.shape[0]].view(np.uint32), alone.view(np.uint32))
        column += w.shape[0]


@needs_llama
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_activations_round_as_ggml_quantizes_them(isa, monkeypatch):
    """Inputs whose 8-bit codes are exact halves (ties to even) and blocks whose largest magnitude comes
    twice with both signs: the products (Q6_K and Q5_K, Q8_K activations; Q8_0; Q4_1, Q8_1 with its sums of
    the codes) are llama.cpp's bit for bit."""
    take_kernel_isa(isa, monkeypatch)
    avx2 = bool(ggml_oracle.library().ggml_cpu_has_avx2())
    rng = np.random.default_rng(9)
    x = (rng.integers(-127, 128, (6, 512)) / 2).astype(np.float32)
    x[:, 0], x[:, 100], x[:, 300], x[:, 400] = -127.0, 127.0, 127.0, -127.0  # the first one sets the sign
    x[1, 256:] = 0.0
    x[2, 5] = 127.0
    for qt in (T.Q6_K, T.Q5_K, T.Q8_0, T.Q4_1):
        w = matrix(qt, 5, 512, seed=int(qt))
        activations = [ggml_oracle.quantize_activations(row, int(qt)) for row in x]
        expected = np.array(
            [[ggml_oracle.vec_dot(int(qt), 512, r, a, not avx2) for r in w] for a in activations],
            dtype=np.float32,
        )
        got = grouped(qt, [w], x, [len(x)], np.arange(len(x)))
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), qt.name


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [3584, 7168])  # the routed experts' and the trunk's row widths
def test_avx512_kernels_on_two_threads_keep_the_one_thread_avx2_bits(qt, cols, monkeypatch):
    """The AVX-512 one-row kernels (their lines asked for ahead), the matrices cut between two threads'
    runs: each output the AVX2 kernel's on one thread."""
    take_kernel_isa("avx512", monkeypatch)
    weights = [matrix(qt, 301, cols, seed=seed) for seed in (1, 2)]  # > PARALLEL_MIN_MACS together
    x = inputs(2, cols, seed=cols)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        avx512 = grouped(qt, weights, x, [1, 1], np.arange(2))
        monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
        torch.set_num_threads(1)
        avx2 = grouped(qt, weights, x, [1, 1], np.arange(2))
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(avx512.view(np.uint32), avx2.view(np.uint32))


@pytest.mark.parametrize("qt", SAME_BITS_AVX512_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "out_rows,cols", [(5, 256), (7, 1280), (3, 7168), (4, 25600), (19, 1280), (9, 25600)]
)
def test_the_avx512_kernels_give_the_avx2_kernels_bits(qt, out_rows, cols, monkeypatch):
    """The AVX-512 one-row kernels (one to five input rows a matrix: below the tiles) form the AVX2
    kernels' integer lanes and float operations: the same bits, on weights whose codes reach both ends
    (Q8_0's eight-row groups: whole groups and a rest, a last chunk of fewer than 16 blocks, rows
    longer than the input row's held starts)."""
    take_kernel_isa("avx512", monkeypatch)
    w, x = matrix(qt, out_rows, cols, seed=cols), inputs(5, cols, seed=out_rows)
    for count in range(1, 6):
        avx512 = grouped(qt, [w], x[:count], [count], np.arange(count))
        monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
        avx2 = grouped(qt, [w], x[:count], [count], np.arange(count))
        monkeypatch.delenv("K3STREAM_NO_AVX512")
        assert np.array_equal(avx512.view(np.uint32), avx2.view(np.uint32)), count


@pytest.mark.parametrize("wide", ["0", "1"])
@pytest.mark.parametrize(
    "out_rows,cols", [(5, 256), (3, 7168), (19, 1280), (9, 25600), (37, 512), (70, 3584)]
)
def test_q8_0s_one_row_kernels_by_either_vector_width_give_the_avx2_kernels_bits(
    out_rows, cols, wide, monkeypatch
):
    """Q8_0's one-row kernel on a CPU that runs 512-bit operations at full width (a one-time measurement;
    K3STREAM_WIDE_VECTORS=1) takes rows of more than 256 bytes two to a 512-bit vector, four streams; on
    one that splits them (=0) eight rows of 256-bit vectors: either way the AVX2 kernel's bits, on one
    and two threads, weight-row counts that leave 1-3 streams short."""
    take_kernel_isa("avx512", monkeypatch)
    w, x = matrix(T.Q8_0, out_rows, cols, seed=cols), inputs(1, cols, seed=out_rows)
    threads = torch.get_num_threads()
    try:
        results = []
        for isa, count in (("avx512", 1), ("avx512", 2), ("avx2", 1)):
            monkeypatch.setenv("K3STREAM_WIDE_VECTORS", wide)
            if isa == "avx2":
                monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
            torch.set_num_threads(count)
            results.append(grouped(T.Q8_0, [w], x, [1], np.arange(1)))
    finally:
        torch.set_num_threads(threads)
    for got in results[:2]:
        assert np.array_equal(got.view(np.uint32), results[2].view(np.uint32))


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [256, 7168, 32768, 33024])  # 1, 28, 128 (the most held) and 129 blocks
@pytest.mark.parametrize("wide", ["1", "0"])
def test_decode_kernels_holding_an_input_rows_blocks_keep_the_avx2_bits(qt, cols, wide, monkeypatch):
    """Q2_K's and Q3_K's AVX-512 decode kernels take one input row's Q8_K scales (Q3_K also its offset
    lanes) once a call for rows of up to 128 blocks, and make them block by block for longer rows: every
    weight row (the pairs, in alternate lanes of 512-bit vectors with K3STREAM_WIDE_VECTORS=1 or in two
    256-bit chains with =0, and an odd last one), each matrix on its own input row (not the first), on one
    and two threads, is the AVX2 kernel's on one thread."""
    take_kernel_isa("avx512", monkeypatch)
    monkeypatch.setenv("K3STREAM_WIDE_VECTORS", wide)
    weights = [matrix(qt, rows, cols, seed=rows) for rows in (67, 67, 67)]
    x = inputs(3, cols, seed=cols)
    order = np.array([2, 0, 1])
    threads = torch.get_num_threads()
    try:
        results = []
        for isa, count in (("avx512", 1), ("avx512", 2), ("avx2", 1)):
            if isa == "avx2":
                monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
            torch.set_num_threads(count)
            results.append(grouped(qt, weights, x, [1, 1, 1], order))
    finally:
        torch.set_num_threads(threads)
    for got in results[:2]:
        assert np.array_equal(got.view(np.uint32), results[2].view(np.uint32))
