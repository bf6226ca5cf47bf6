"""The integer kernels of the i-quants, the ternary types, MXFP4 and NVFP4 (`iquants_cpu.c`) on random valid
blocks: bit for bit llama.cpp's own dot products (its libggml-cpu: the AVX2 kernel it runs here, and
ggml's generic C for the portable build), and within float rounding of `gguf.quants.dequantize` times
the 8-bit activations in float64. The grid types' AVX-512 kernels (`iquants_avx512.c`, on a CPU with
AVX-512 F/BW/VL/VNNI/VBMI) order their float operations apart from ggml's: within 1e-6 of each output's
magnitude of llama.cpp's AVX2 vec_dot (a few ulp), and K3STREAM_NO_AVX512=1 gives its bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from conftest import KERNEL_ISAS, take_kernel_isa
from k3stream.quant.kernels import QWeight, cpu, kernel_for, qmatmul
from k3stream.testing import ggml_oracle

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C kernels were not built with this install")
needs_llama = pytest.mark.skipif(
    ggml_oracle.library() is None, reason="llama-cpp-python's libggml-cpu not found"
)

# most used first
TYPES = [T.IQ2_XXS, T.IQ1_S, T.IQ4_XS, T.IQ2_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_S, T.IQ1_M, T.IQ4_NL, T.TQ1_0,
         T.TQ2_0, T.MXFP4, T.NVFP4]  # fmt: skip
SHAPES = [(5, 256, 1), (37, 512, 3), (19, 2048, 5)]  # 5 rows: four sharing decoded runs, one alone
# the types with AVX-512 grid kernels
AVX512_TYPES = [T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
# the types whose AVX-512 kernels read their grid by gathers or by byte permutes (K3STREAM_GRID_LOOKUP)
TWO_LOOKUP_TYPES = [T.IQ2_S]
# the types whose AVX-512 kernels give their AVX2 kernels' (llama.cpp's) bits
AVX2_BITS_AVX512_TYPES = [T.IQ4_NL, T.MXFP4, T.IQ4_XS, T.TQ2_0, T.TQ1_0, T.NVFP4]


def matrix(qt: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random valid blocks."""
    elems = GGML_QUANT_SIZES[qt][0]
    return ggml_oracle.random_blocks(int(qt), rows * cols // elems, np.random.default_rng(seed)).reshape(
        rows, -1
    )


def product(qt: T, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The C kernel's x @ W^T through `cpu.grouped_product` (one matrix, every row of x)."""
    rows = torch.arange(len(x))
    starts = torch.tensor([0, len(x)])
    data = torch.from_numpy(np.ascontiguousarray(w).reshape(-1))
    out = cpu.grouped_product(
        torch.from_numpy(x), [data], int(qt), w.shape[0], w.shape[1], starts, rows, True
    )
    return out.numpy()


def ggml_product(qt: T, w: np.ndarray, x: np.ndarray, generic: bool) -> np.ndarray:
    """llama.cpp's: each x row quantized by ggml, then its vec_dot with each weight row."""
    cols = x.shape[1]
    activations = [ggml_oracle.quantize_activations(row, int(qt)) for row in x]
    return np.array(
        [
            [ggml_oracle.vec_dot(int(qt), cols, np.ascontiguousarray(r), a, generic) for r in w]
            for a in activations
        ],
        dtype=np.float32,
    )


def inputs(count: int, cols: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((count, cols)).astype(np.float32)
    x[-1, cols // 2] = -4 * np.abs(x[-1]).max()  # a block whose signed max is negative: codes reach -127
    if count > 1:
        x[0, :256] = 0.0  # an all-zero block
    return x


@needs_llama
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,count", SHAPES)
def test_the_kernels_are_llama_cpps_dot_products_bit_for_bit(qt, rows, cols, count, monkeypatch):
    """Without AVX-512 the kernel is the one llama.cpp runs on this machine (its AVX2 one, else ggml's
    generic C); K3STREAM_GENERIC_KERNELS=1 gives ggml's generic C."""
    monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
    w, x = matrix(qt, rows, cols, seed=rows), inputs(count, cols, seed=cols)
    avx2 = bool(ggml_oracle.library().ggml_cpu_has_avx2())
    assert np.array_equal(product(qt, w, x), ggml_product(qt, w, x, generic=not avx2))
    monkeypatch.setenv("K3STREAM_GENERIC_KERNELS", "1")
    assert np.array_equal(product(qt, w, x), ggml_product(qt, w, x, generic=True))


@needs_llama
@pytest.mark.parametrize(
    "qt,rows,cols,count",
    [(t, *shape) for t in AVX2_BITS_AVX512_TYPES for shape in SHAPES]
    + [(t, 3, 288, 2) for t in AVX2_BITS_AVX512_TYPES if GGML_QUANT_SIZES[t][0] == 32],  # odd block counts
    ids=str,
)
def test_the_avx512_kernels_of_the_nibble_types_are_llama_cpps_bits(qt, rows, cols, count, monkeypatch):
    """IQ4_NL's, MXFP4's, NVFP4's, IQ4_XS's and the ternary types' AVX-512 kernels keep the AVX2 kernels'
    integer lanes and float operations: llama.cpp's AVX2 vec_dot bit for bit."""
    take_kernel_isa("avx512", monkeypatch)
    w, x = matrix(qt, rows, cols, seed=rows), inputs(count, cols, seed=cols)
    assert np.array_equal(product(qt, w, x), ggml_product(qt, w, x, generic=False))


@needs_llama
@pytest.mark.parametrize("qt", AVX512_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,count", [*SHAPES, (9, 1280, 9)])
def test_the_avx512_kernels_are_within_a_few_ulp_of_llama_cpps(qt, rows, cols, count, monkeypatch):
    """The AVX-512 kernels (llama.cpp's wheel has none for these types): each output within 1e-6 of
    its magnitude (the sum of |weight x activation| over the row) of llama.cpp's AVX2 vec_dot, and
    not its bits (their own float order: the AVX-512 kernel ran)."""
    take_kernel_isa("avx512", monkeypatch)
    w, x = matrix(qt, rows, cols, seed=rows), inputs(count, cols, seed=cols)
    got, expected = product(qt, w, x), ggml_product(qt, w, x, generic=False)
    dense = np.abs(gguf_dequantize(w, qt).astype(np.float64).reshape(rows, cols))
    magnitude = np.stack([dense @ np.abs(activations_f64(row, qt)) for row in x])
    assert np.all(np.abs(got.astype(np.float64) - expected) <= 1e-6 * magnitude)
    if rows * count > 20:
        assert not np.array_equal(got, expected)


@pytest.mark.parametrize("qt", TWO_LOOKUP_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,count", [(7, 1280, 1), (9, 1792, 3), (5, 256, 5), (3, 512, 4)])
def test_the_grid_lookups_by_gathers_and_by_byte_permutes_give_the_same_bits(
    qt, rows, cols, count, monkeypatch
):
    """Either way of reading the grid (a one-time measurement picks the faster: gathers on Intel Xeon,
    byte permutes on AMD Zen 4) gives each output the same bits, odd weight-row and block counts and one
    to five input rows included; both stay within a few ulp of llama.cpp (the test above holds the way
    this CPU takes)."""
    take_kernel_isa("avx512", monkeypatch)
    w, x = matrix(qt, rows, cols, seed=rows + cols), inputs(count, cols, seed=count)
    by_way = {}
    for way in ("gather", "permute"):
        monkeypatch.setenv("K3STREAM_GRID_LOOKUP", way)
        by_way[way] = product(qt, w, x)
    assert np.array_equal(by_way["gather"].view(np.uint32), by_way["permute"].view(np.uint32))
    dense = gguf_dequantize(w, qt).astype(np.float64).reshape(rows, cols)
    expected = np.stack([dense @ activations_f64(row, qt) for row in x])
    assert np.linalg.norm(by_way["permute"] - expected) <= 2e-6 * np.linalg.norm(expected)


def activations_f64(x_row: np.ndarray, qt: T) -> np.ndarray:
    """ggml's 8-bit activations of one row as float64 values: Q8_K (F32 d, 256 codes, 16 sums) or
    Q8_0 (F16 d, 32 codes) blocks decoded by hand."""
    data = ggml_oracle.quantize_activations(x_row, int(qt))
    if ggml_oracle.activation_type(int(qt)) == ggml_oracle.Q8_K:
        blocks = data.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32).astype(np.float64)
        return (blocks[:, 4:260].view(np.int8) * d).reshape(-1)
    blocks = data.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    return (blocks[:, 2:].view(np.int8) * d).reshape(-1)


@needs_llama
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_the_kernels_agree_with_gguf_dequantize_on_the_8_bit_activations(qt, isa, monkeypatch):
    """An oracle apart from ggml's kernels: `gguf.quants.dequantize` of the weights times the dequantized
    8-bit activations in float64; the kernel's float32 operations stay within 2e-6 of it."""
    take_kernel_isa(isa, monkeypatch)
    rows, cols = 23, 1024
    w, x = matrix(qt, rows, cols, seed=7), inputs(3, cols, seed=8)
    dense = gguf_dequantize(w, qt).astype(np.float64).reshape(rows, cols)
    expected = np.stack([dense @ activations_f64(row, qt) for row in x])
    got = product(qt, w, x)
    assert np.linalg.norm(got - expected) <= 2e-6 * np.linalg.norm(expected)
    exact_inputs = np.stack([dense @ row.astype(np.float64) for row in x])
    assert np.linalg.norm(got - exact_inputs) > 1e-5 * np.linalg.norm(exact_inputs)  # x was quantized


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", KERNEL_ISAS[:2])
def test_rows_do_not_depend_on_grouping_or_threads(qt, isa, monkeypatch):
    """Several matrices with their own input rows in one call: each output is its single-row product."""
    take_kernel_isa(isa, monkeypatch)
    counts = [2, 0, 3, 5]
    weights = [matrix(qt, 16, 512, seed=s) for s in range(len(counts))]
    x = inputs(6, 512, seed=1)
    starts = torch.tensor([0, *np.cumsum(counts).tolist()])
    rows = torch.from_numpy(np.random.default_rng(3).integers(0, 6, sum(counts)))
    datas = [torch.from_numpy(w.reshape(-1)) for w in weights]
    together = cpu.grouped_product(
        torch.from_numpy(x), datas, int(qt), 16, weights[0].shape[1], starts, rows, True
    )
    for b, w in enumerate(weights):
        for p in range(int(starts[b]), int(starts[b + 1])):
            assert torch.equal(together[p], torch.from_numpy(product(qt, w, x[int(rows[p])][None])[0]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu.grouped_product(
            torch.from_numpy(x), datas, int(qt), 16, weights[0].shape[1], starts, rows, True
        )
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("cols", [512, 256, 768])
def test_a_weight_row_does_not_depend_on_the_rows_beside_it(qt, isa, cols, monkeypatch):
    """Each output is the same bits whether its weight row comes alone, in a slice at any offset or in the
    whole matrix (the AVX-512 IQ1 and IQ2 kernels take two weight rows at once, row m and row m + half of
    the slice, against one to three input rows; the grid kernels, with an odd block count (1 or 3 here),
    the last blocks of two rows as one pair of blocks; the last row of an odd count alone), for 1 to 5
    input rows (5: a batch of four, then one)."""
    take_kernel_isa(isa, monkeypatch)
    w = matrix(qt, 7, cols, seed=11)
    for count in (1, 2, 3, 4, 5):
        x = inputs(count, cols, seed=count)
        whole = product(qt, w, x)
        for first, last in [(r, r + 1) for r in range(7)] + [(1, 6), (2, 5), (0, 4)]:
            assert np.array_equal(product(qt, w[first:last], x), whole[:, first:last]), (count, first, last)


@pytest.mark.parametrize("qt", [int(t) for t in TYPES if t != T.MXFP4], ids=lambda t: T(t).name)
def test_the_seam_takes_the_integer_kernels_under_match_ggml_and_the_float_tile_path_else(qt):
    """`match_ggml`: the C integer kernels on ggml's 8-bit activations; float activations: the C float
    tile path (a C decoder for every type), the float product of the decoded matrix."""
    assert kernel_for(qt, "cpu", 512, match_ggml=True) == "c"
    assert kernel_for(qt, "cpu", 512) == "c"
    try:
        from k3stream.quant.types import row_bytes

        row_bytes(qt, 512)
    except ValueError:
        pytest.skip(f"{T(qt).name} is not in this branch's type registry")
    w, x = matrix(T(qt), 9, 512, seed=2), inputs(2, 512, seed=4)
    weight = QWeight(torch.from_numpy(w.reshape(-1)), qt, (9, 512))
    assert np.array_equal(qmatmul(torch.from_numpy(x), weight, match_ggml=True).numpy(), product(T(qt), w, x))
    dense = gguf_dequantize(w, T(qt)).astype(np.float64).reshape(9, 512)
    float_product = qmatmul(torch.from_numpy(x), weight).double().numpy()
    expected = x.astype(np.float64) @ dense.T
    assert np.linalg.norm(float_product - expected) <= 1e-5 * np.linalg.norm(expected)


def test_mxfp4_takes_its_integer_kernel_only_under_match_ggml():
    """MXFP4 keeps its float kernel by default; `match_ggml` gives ggml's integer one on Q8_0 codes."""
    w, x = matrix(T.MXFP4, 8, 256, seed=5), inputs(2, 256, seed=6)
    weight = QWeight(torch.from_numpy(w.reshape(-1)), int(T.MXFP4), (8, 256))
    assert np.array_equal(
        qmatmul(torch.from_numpy(x), weight, match_ggml=True).numpy(), product(T.MXFP4, w, x)
    )
    assert not np.array_equal(qmatmul(torch.from_numpy(x), weight).numpy(), product(T.MXFP4, w, x))


@pytest.mark.parametrize("qt", [int(t) for t in TYPES], ids=lambda t: T(t).name)
def test_the_float_decoders_give_gguf_dequantize_bit_for_bit(qt):
    """`decode_row` (the float tile path's decoder) of random valid blocks: gguf's values exactly."""
    elems = GGML_QUANT_SIZES[T(qt)][0]
    blocks = ggml_oracle.random_blocks(qt, 64, np.random.default_rng(qt))
    out = torch.empty(64 * elems)
    cpu.decode_row(qt, torch.from_numpy(blocks.reshape(-1)).data_ptr(), 64 * elems, out)
    assert np.array_equal(
        out.numpy().view(np.uint32), gguf_dequantize(blocks, T(qt)).reshape(-1).view(np.uint32)
    )


def test_grids_of_the_wrong_size_are_refused_in_one_line():
    grids = cpu._iq_grids()
    with pytest.raises(ValueError, match=r"set_iq_grids: grid 2 has 8 bytes, expected 8192"):
        cpu._ggml_cpu().set_iq_grids(*grids[:2], b"12345678", *grids[3:])
