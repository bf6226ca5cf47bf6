"""k3stream.quant against the independent oracle gguf.quants (and GGML's block layouts)."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NO_CUDA
from k3stream.quant import (
    DECODE_ONLY_TYPES,
    IQUANT_TYPES,
    SUPPORTED_TYPES,
    default_slab_rows,
    dequantize,
    qlinear,
    quantize,
    row_bytes,
    slab_ranges,
    type_name,
    type_size,
)

T = GGMLQuantizationType
ALL_TYPES = sorted(SUPPORTED_TYPES)
QUANT_TYPES = [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)]
ENCODED_TYPES = [t for t in ALL_TYPES if t not in DECODE_ONLY_TYPES]  # the types k3stream can encode
ENCODED_QUANT_TYPES = [t for t in QUANT_TYPES if t not in DECODE_ONLY_TYPES]
# byte offsets of the fp16 scale fields in each block (ggml-common.h); random bytes there could be NaN/inf
FP16_SCALE_OFFSETS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}  # fmt: skip
# relative RMS error of the reference encoders on N(0, 1) data: loose upper bounds
ENCODER_ERROR_BOUND = {
    T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_0: 0.06, T.Q5_1: 0.06,
    T.Q5_K: 0.06, T.Q4_0: 0.12, T.Q4_1: 0.12, T.Q4_K: 0.12, T.MXFP4: 0.2, T.Q3_K: 0.25, T.Q2_K: 0.45,
}  # fmt: skip


def random_blocks(qt: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    """Random bytes for `n_blocks` blocks, fp16 scale fields forced finite (exponent != 31)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qt][1]), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS.get(qt, ()):
        high = blocks[:, offset + 1]
        blocks[:, offset + 1] = np.where((high & 0x7C) == 0x7C, high ^ 0x40, high)
    if qt == T.IQ1_M:  # the fp16 scale is the top nibbles of bytes 49, 51, 53, 55: exponent in 53 and 55
        all_ones = ((blocks[:, 53] & 0xC0) == 0xC0) & ((blocks[:, 55] & 0x70) == 0x70)
        blocks[:, 55] = np.where(all_ones, blocks[:, 55] ^ 0x40, blocks[:, 55])
    return blocks


def assert_same_bits(ours: torch.Tensor, reference: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == reference.shape
    reference_bits = np.ascontiguousarray(reference, dtype=np.float32).view(np.uint32)
    mismatch = ours.numpy().view(np.uint32) != reference_bits
    assert not mismatch.any(), f"{mismatch.sum()} of {mismatch.size} values differ"


def gaussian(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact**2)))


# ---- dequantize: bit-exact with gguf ----------------------------------------------------------


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    blocks_per_row=st.integers(1, 4),
    as_torch=st.booleans(),
)
def test_dequantize_matches_gguf_bit_for_bit(qt, seed, lead, blocks_per_row, as_torch):
    n_rows = int(np.prod(lead)) if lead else 1
    data = random_blocks(qt, n_rows * blocks_per_row, seed).reshape(*lead, -1)
    reference = gguf.quants.dequantize(data, qt)
    ours = dequantize(torch.from_numpy(data) if as_torch else data, qt)
    assert_same_bits(ours, reference)


@pytest.mark.parametrize(
    ("qt", "np_dtype", "torch_dtype"),
    [(T.F32, np.float32, torch.float32), (T.F16, np.float16, torch.float16), (T.BF16, None, torch.bfloat16)],
    ids=["F32", "F16", "BF16"],
)
def test_float_types_accept_typed_input(qt, np_dtype, torch_dtype):
    raw = random_blocks(qt, 3 * 8, seed=7).reshape(3, -1)
    reference = gguf.quants.dequantize(raw, qt)
    typed = torch.from_numpy(raw).view(torch_dtype)
    assert_same_bits(dequantize(typed, qt), reference)
    if np_dtype is not None:
        assert_same_bits(dequantize(raw.view(np_dtype), qt), gguf.quants.dequantize(raw.view(np_dtype), qt))


@pytest.mark.parametrize("qt", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern_matches_gguf(qt):
    """All 65536 halves, NaN payloads and signalling NaNs included."""
    data = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, -1)
    assert_same_bits(dequantize(data, qt), gguf.quants.dequantize(data, qt))


def test_int_and_enum_qtype_are_equivalent():
    data = random_blocks(T.Q3_K, 2, seed=3)
    assert torch.equal(dequantize(data, 11), dequantize(data, T.Q3_K))


def test_read_only_mmap_like_input_is_not_copied_or_rejected():
    data = random_blocks(T.Q2_K, 4, seed=5)
    data.setflags(write=False)
    assert_same_bits(dequantize(data, T.Q2_K), gguf.quants.dequantize(data, T.Q2_K))


def test_f32_output_never_aliases_read_only_memory():
    values = gaussian((2, 8))
    data = values.copy().view(np.uint8)
    data.setflags(write=False)
    out = dequantize(data, T.F32)
    np.testing.assert_array_equal(out.numpy(), values)
    out.zero_()  # would crash on a read-only mmap if `out` were a view of it
    np.testing.assert_array_equal(data.view(np.float32), values)


def test_empty_rows_decode_to_empty():
    out = dequantize(np.zeros((0, 84), dtype=np.uint8), T.Q2_K)
    assert tuple(out.shape) == (0, 256)


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="Q1_0"):
        dequantize(np.zeros((1, 18), dtype=np.uint8), T.Q1_0)
    with pytest.raises(ValueError, match="999"):
        dequantize(np.zeros((1, 84), dtype=np.uint8), 999)


def test_partial_block_is_rejected_with_type_name():
    with pytest.raises(ValueError, match="Q3_K"):
        dequantize(np.zeros((2, 111), dtype=np.uint8), T.Q3_K)


# ---- type helpers -----------------------------------------------------------------------------


def test_type_helpers():
    assert type_size(T.Q2_K) == (256, 84) and type_size(11) == (256, 110)
    assert row_bytes(T.Q4_0, 7168) == 7168 // 32 * 18
    assert type_name(10) == "Q2_K" and type_name(T.MXFP4) == "MXFP4"
    with pytest.raises(ValueError, match="Q2_K"):
        row_bytes(T.Q2_K, 100)
    assert type_size(T.IQ2_XXS) == (256, 66) and row_bytes(T.IQ1_S, 512) == 100
    with pytest.raises(ValueError, match="Q8_K"):
        type_size(T.Q8_K)
    with pytest.raises(ValueError, match="'Q2_K'"):
        type_name("Q2_K")


# ---- reference encoders -----------------------------------------------------------------------


@pytest.mark.parametrize("qt", ENCODED_TYPES, ids=lambda t: t.name)
def test_encoder_round_trip_error_and_gguf_agreement(qt):
    values = gaussian((6, 512), seed=int(qt))
    data = quantize(values, qt)
    assert data.dtype == np.uint8 and data.shape == (6, row_bytes(qt, 512))
    decoded = gguf.quants.dequantize(data, qt)
    assert rel_rms(decoded, values) <= ENCODER_ERROR_BOUND[qt]
    assert_same_bits(dequantize(data, qt), decoded)


@pytest.mark.parametrize("qt", ENCODED_QUANT_TYPES, ids=lambda t: t.name)
def test_encoder_tracks_per_row_scale_and_sign(qt):
    """Rows at very different scales, and one-signed rows, keep their relative error."""
    row_scale = np.array([1e-3, 1.0, 50.0], dtype=np.float32)[:, None]
    values = np.concatenate(
        [gaussian((3, 256)) * row_scale, np.abs(gaussian((1, 256))), -np.abs(gaussian((1, 256)))]
    )
    decoded = gguf.quants.dequantize(quantize(values, qt), qt)
    for row in range(values.shape[0]):
        assert rel_rms(decoded[row], values[row]) <= ENCODER_ERROR_BOUND[qt], f"row {row}"


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_rows=st.integers(1, 5),
    blocks_per_row=st.integers(1, 3),
    log_scale=st.floats(-3, 3),
)
def test_own_encoders_round_trip_at_any_scale(qt, seed, n_rows, blocks_per_row, log_scale):
    values = gaussian((n_rows, 256 * blocks_per_row), seed) * np.float32(10**log_scale)
    decoded = gguf.quants.dequantize(quantize(values, qt), qt)
    for row in range(n_rows):
        assert rel_rms(decoded[row], values[row]) <= ENCODER_ERROR_BOUND[qt], f"row {row}"


def test_mxfp4_encoder_writes_the_same_bytes_as_gguf():
    values = gaussian((16, 1024), seed=12) * np.logspace(-4, 4, 16, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(quantize(values, T.MXFP4), gguf.quants.quantize(values, T.MXFP4))


@pytest.mark.parametrize("qt", ENCODED_QUANT_TYPES, ids=lambda t: t.name)
def test_encoder_zero_blocks_decode_to_zero(qt):
    data = quantize(np.zeros((2, 256), dtype=np.float32), qt)
    assert not dequantize(data, qt).any()


def test_encoder_rejects_bad_input():
    with pytest.raises(ValueError, match="Q2_K"):
        quantize(np.zeros((2, 100), dtype=np.float32), T.Q2_K)
    with pytest.raises(ValueError, match="finite"):
        quantize(np.full((1, 256), np.nan, dtype=np.float32), T.Q3_K)
    with pytest.raises(ValueError, match="fp16 block scale"):
        quantize(np.full((1, 256), 1e7, dtype=np.float32), T.Q2_K)


# ---- qlinear ----------------------------------------------------------------------------------


def test_slab_ranges_cover_rows_in_bounded_pieces():
    assert slab_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert slab_ranges(3, 8) == [(0, 3)]
    assert slab_ranges(0, 8) == []
    with pytest.raises(ValueError):
        slab_ranges(4, 0)


def test_default_slab_rows_is_bounded_by_bytes():
    assert default_slab_rows(7168) * 7168 * 4 <= 16 << 20 < (default_slab_rows(7168) + 1) * 7168 * 4
    assert default_slab_rows(1 << 30) == 1


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_0, T.Q8_0, T.Q6_K, T.F16, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("slab_rows", [None, 1, 5])
def test_qlinear_equals_dense_matmul(qt, slab_rows):
    out_features, in_features = 13, 512
    data = quantize(gaussian((out_features, in_features), seed=1), qt)
    x = torch.from_numpy(gaussian((2, 3, in_features), seed=2))
    expected = x @ dequantize(data, qt).T
    got = qlinear(x, data, qt, out_features, in_features, slab_rows=slab_rows)
    assert got.shape == (2, 3, out_features)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)  # outputs are ~20: summation order


def test_qlinear_flat_bytes_and_dtype_follow_x():
    data = quantize(gaussian((8, 256), seed=4), T.Q2_K)
    x = torch.from_numpy(gaussian((4, 256), seed=5)).to(torch.bfloat16)
    got = qlinear(x, torch.from_numpy(data.reshape(-1)), T.Q2_K, 8, 256, slab_rows=3)
    assert got.dtype == torch.bfloat16
    expected = x @ dequantize(data, T.Q2_K).to(torch.bfloat16).T
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(qlinear(x[0], data, T.Q2_K, 8, 256, slab_rows=3), expected[0])


def test_qlinear_rejects_mismatched_shapes():
    data = quantize(gaussian((8, 256)), T.Q4_0)
    with pytest.raises(ValueError, match="Q4_0"):
        qlinear(torch.zeros(1, 256), data, T.Q4_0, 9, 256)
    with pytest.raises(ValueError, match="features"):
        qlinear(torch.zeros(1, 255), data, T.Q4_0, 8, 256)


def largest_allocation(fn) -> int:
    """Largest CPU allocation any single op made while `fn` ran, as torch's profiler records it."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max(event.self_cpu_memory_usage for event in prof.events())


def test_qlinear_dequantises_no_more_than_a_slab_at_once():
    out_features, in_features, slab_rows = 512, 1024, 16
    data = quantize(gaussian((out_features, in_features), seed=6), T.Q4_0)
    x = torch.from_numpy(gaussian((1, in_features), seed=7))
    slab_floats = slab_rows * in_features * 4
    bounded = largest_allocation(
        lambda: qlinear(x, data, T.Q4_0, out_features, in_features, slab_rows=slab_rows)
    )
    whole = largest_allocation(
        lambda: qlinear(x, data, T.Q4_0, out_features, in_features, slab_rows=out_features)
    )
    assert bounded <= slab_floats
    assert whole >= out_features * in_features * 4  # the measurement does see a whole-matrix dequant


# ---- CUDA (runs where a GPU is present) -------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@requires_cuda
@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_decode_matches_gguf_bit_for_bit(qt):
    data = random_blocks(qt, 3 * 257, seed=int(qt) + 100).reshape(3, -1)
    ours = dequantize(torch.from_numpy(data).cuda(), qt)
    assert ours.device.type == "cuda"
    assert_same_bits(ours.cpu(), gguf.quants.dequantize(data, qt))


@requires_cuda
def test_cuda_every_fp16_pattern_matches_gguf():
    data = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(256, -1)
    assert_same_bits(
        dequantize(torch.from_numpy(data).cuda(), T.F16).cpu(), gguf.quants.dequantize(data, T.F16)
    )


@requires_cuda
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_0, T.BF16], ids=lambda t: t.name)
def test_cuda_qlinear_moves_bytes_to_x_device(qt):
    data = quantize(gaussian((40, 512), seed=8), qt)
    x = torch.from_numpy(gaussian((3, 512), seed=9))
    got = qlinear(x.cuda(), data, qt, 40, 512, slab_rows=7)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), qlinear(x, data, qt, 40, 512), rtol=1e-4, atol=1e-3)


# ---- i-quants and ternary: the tables are gguf's, every scale pattern decodes as gguf does -------


def with_every_finite_scale(qt: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """`blocks` (one per finite fp16 pattern) with block i's fp16 scale set to the i-th finite pattern."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    halves = halves[(halves & 0x7C00) != 0x7C00]
    assert len(blocks) == len(halves)
    if qt == T.IQ1_M:  # the scale's four nibbles top the block's last four 16-bit words
        words = blocks[:, 48:56].copy().view(np.uint16)
        nibbles = (halves[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        blocks[:, 48:56] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)
    else:
        (offset,) = FP16_SCALE_OFFSETS[qt]
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("qt", sorted(IQUANT_TYPES), ids=lambda t: t.name)
def test_iquant_every_finite_scale_decodes_as_gguf(qt):
    """Every finite fp16 scale pattern (one a block), over random sub-scales, codes and signs."""
    data = with_every_finite_scale(qt, random_blocks(qt, 63488, seed=int(qt)))
    reference = gguf.quants.dequantize(data, qt)
    assert np.isfinite(reference).all()
    assert_same_bits(dequantize(data, qt), reference)


def test_quantize_refuses_types_it_only_decodes():
    with pytest.raises(ValueError, match="IQ2_XXS: k3stream decodes IQ2_XXS but has no encoder"):
        quantize(np.zeros((1, 256), dtype=np.float32), T.IQ2_XXS)
    with pytest.raises(ValueError, match="NVFP4: k3stream decodes NVFP4 but has no encoder"):
        quantize(np.zeros((1, 64), dtype=np.float32), T.NVFP4)
