"""Triton kernels (`k3stream.quant.kernels.gpu`) against the reference dequantizer.

Triton's interpreter runs the kernels on CPU tensors, but only when TRITON_INTERPRET=1 is set before the
kernels are defined, so `test_interpreter_subprocess` runs this module again in a fresh process with it
set; there the `interp` cases run. With CUDA the `cuda` cases run the compiled kernels in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from conftest import NO_CUDA
from k3stream.quant import DECODE_ONLY_TYPES, dequantize, quantize, type_size

triton = pytest.importorskip("triton", reason="triton is not installed (the project's `gpu` extra)")

from k3stream.quant.kernels import gpu  # noqa: E402  (after the skip above)
from k3stream.quant.kernels.gpu import (  # noqa: E402
    SUPPORTED_GPU_TYPES,
    triton_grouped_qmatmul,
    triton_qmatmul,
)

T = GGMLQuantizationType
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
interp = pytest.mark.interp  # collected only under TRITON_INTERPRET=1 (tests/conftest.py)
cuda = pytest.mark.skipif(not CUDA, reason=NO_CUDA)
TYPES = sorted(SUPPORTED_GPU_TYPES - DECODE_ONLY_TYPES)  # the others: test_kernels_gpu_iquants.py
# (rows of x, out features, in features); K = 288 is 256 plus one 32-block: a partial K tile
SHAPES = [(1, 64, 512), (3, 5, 512), (17, 64, 256), (8, 5, 256)]
LEGACY_SHAPES = [(2, 5, 288), (17, 3, 288)]
# byte offsets of the fp16 scales in each block, set to sane values in random blocks
SCALE_FIELDS = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
SCALE_FIELDS |= {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q5_K: (0, 2), T.MXFP4: ()}


def _weights(qt: T, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((out_features, in_features)).astype(np.float32)
    return torch.from_numpy(quantize(values, qt))


def _random_blocks(qt: T, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random block bytes (every bit pattern of the codes and scales), with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block_elems, block_bytes = type_size(qt)
    blocks = rng.integers(0, 256, (out_features * in_features // block_elems, block_bytes), dtype=np.uint8)
    for start in SCALE_FIELDS[qt]:
        scales = rng.uniform(0.01, 1.0, len(blocks)).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qt == T.MXFP4:  # E8M0 scales 2^-27..2^23 (and the subnormal halves of 0 and 1): finite products
        blocks[:, 0] = rng.choice([0, 1, *range(100, 151)], len(blocks))
    return torch.from_numpy(blocks.reshape(out_features, -1))


def _relative_error(got: torch.Tensor, x: torch.Tensor, data: torch.Tensor, qt: T) -> float:
    """max |got - x @ W.T| / max |x @ W.T|, the reference in float64 on CPU from `dequantize`."""
    ref = x.cpu().double() @ dequantize(data.cpu(), qt).double().T
    return ((got.cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _check(qt: T, n: int, m: int, k: int, device: str) -> None:
    data = _weights(qt, m, k).to(device)
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(device)
    got = triton_qmatmul(x, data, qt, m, k)
    assert got.shape == (n, m) and got.dtype == torch.float32
    assert _relative_error(got, x, data, qt) <= 1e-5


def _cases() -> list[tuple[T, int, int, int]]:
    legacy = {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4}
    return [(qt, *s) for qt in TYPES for s in SHAPES + (LEGACY_SHAPES if qt in legacy else [])]


def _ids(case: tuple[T, int, int, int]) -> str:
    return f"{case[0].name}-{case[1]}x{case[3]}-{case[2]}"


# ---- interpreter (CPU) ----------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_interp_matches_dequantize(case: tuple[T, int, int, int]) -> None:
    _check(*case, device="cpu")


@interp
@pytest.mark.parametrize("qt", sorted(SCALE_FIELDS), ids=lambda qt: qt.name)
@pytest.mark.parametrize("n", [3, 256], ids=["matvec", "dot"])
def test_interp_decodes_random_blocks_exactly(qt: T, n: int) -> None:
    """One-hot rows of x pick single weights: both paths must reproduce dequantize bit for bit."""
    data = _random_blocks(qt, 5, 256)
    picks = torch.arange(n) * 97 % 256
    x = torch.nn.functional.one_hot(picks, 256).float()
    got = triton_qmatmul(x, data, qt, 5, 256)
    assert torch.equal(got, dequantize(data, qt)[:, picks].T)


GROUPINGS = {"decode": [0, 1, 2, 3, 4], "prefill": [0, 3, 3, 12, 20], "implicit-end": [0, 3, 3, 12]}


@interp
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q4_0, T.BF16], ids=lambda qt: qt.name)
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_interp_grouped(qt: T, grouping: str) -> None:
    """Each expert's rows times its own matrix, in one launch (mat-vec for one row each, tiled else)."""
    m, k, starts = 7, 256, GROUPINGS[grouping]
    rows = 4 if grouping == "decode" else 20
    weights = [_weights(qt, m, k, seed) for seed in range(4)]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    got = triton_grouped_qmatmul(x, weights, qt, m, k, starts)
    bounds = [*starts, rows][:5]
    for w, lo, hi in zip(weights, bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            assert _relative_error(got[lo:hi], x[lo:hi], w, qt) <= 1e-5


@interp
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q8_0, T.F16], ids=lambda qt: qt.name)
@pytest.mark.parametrize("splits", [2, 5])
def test_interp_split_k(qt: T, splits: int) -> None:
    """K split into partial sums (what mat-vec launches short of programs do on a GPU), single and grouped;
    5 splits of 3 K tiles leave some splits empty."""
    m, k = 6, 768
    data = [_weights(qt, m, k, seed) for seed in range(2)]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    tiles = gpu.Tiles(4, 2, False, 4, splits)
    w, stride_w = gpu._weight_operand(data[0], qt, m, k, x.device)
    out = torch.empty(3, m)
    gpu._launch(x, w, stride_w, int(qt), out, tiles)
    assert _relative_error(out, x, data[0], qt) <= 1e-5
    groups = [
        (gpu._weight_operand(d, qt, m, k, x.device)[0], lo, hi)
        for d, lo, hi in zip(data, [0, 1], [1, 3], strict=True)
    ]
    gpu._launch_grouped(x, groups, stride_w, int(qt), out, tiles)
    assert _relative_error(out[:1], x[:1], data[0], qt) <= 1e-5
    assert _relative_error(out[1:], x[1:], data[1], qt) <= 1e-5


@interp
def test_interp_leading_dims_and_dtype() -> None:
    data = _weights(T.Q2_K, 7, 256)
    x = torch.randn(4, 5, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = triton_qmatmul(x, data, T.Q2_K, 7, 256)
    assert got.shape == (4, 5, 7) and got.dtype == torch.bfloat16
    flat = got.reshape(20, 7).float()
    assert _relative_error(flat, x.reshape(20, 256).float(), data, T.Q2_K) < 1e-2  # bf16 rounding of out


def test_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="GGML type Q8_1 .9. is not supported by k3stream.quant"):
        triton_qmatmul(x, torch.zeros(4, 288, dtype=torch.uint8), T.Q8_1, 4, 256)
    with pytest.raises(ValueError, match="expected 4 rows x 84 bytes"):
        triton_qmatmul(x, torch.zeros(3, 84, dtype=torch.uint8), T.Q2_K, 4, 256)
    with pytest.raises(ValueError, match="input has 256 features"):
        triton_qmatmul(x, torch.zeros(4, 168, dtype=torch.uint8), T.Q2_K, 4, 512)
    with pytest.raises(ValueError, match="do not split"):
        triton_grouped_qmatmul(x, [torch.zeros(4, 84, dtype=torch.uint8)] * 2, T.Q2_K, 4, 256, [0, 1, 3])


# compile-only cases: every type's mat-vec kernel, the tiled (tl.dot) kernel and the grouped kernel for a few
COMPILE_CASES = [("single", qt, 1) for qt in sorted(SUPPORTED_GPU_TYPES)] + [
    ("single", T.IQ2_XXS, 17),
    ("grouped", T.IQ1_M, 17),
    ("single", T.Q2_K, 17),
    ("single", T.Q3_K, 8),
    ("grouped", T.Q2_K, 1),
    ("grouped", T.BF16, 1),
    ("grouped", T.Q4_0, 17),
]
INT_ARGS = {"single": ["N", "M", "K"], "grouped": ["M", "K"]}


@pytest.mark.skipif(INTERPRET, reason="the interpreter does not compile")
@pytest.mark.parametrize("kind,qt,n", COMPILE_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_gpu_kernel_compiles_for_sm90(kind: str, qt: T, n: int) -> None:
    """Triton compiles the kernels to an sm_90 (H100/H200) cubin without a GPU: catches what the
    interpreter lets through (layouts, shared memory over the 227 KiB limit, register spills, a
    multiply-add contracted into an FMA, which Triton does by default and the interpreter never)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    tiles = gpu._tiles(n)
    w_type = {T.F32: "*fp32", T.F16: "*fp16", T.BF16: "*i16"}.get(qt, "*u8")
    if kind == "single":
        signature = {"x_ptr": "*fp32", "w_ptr": w_type, "out_ptr": "*fp32"}
    else:
        signature = {"x_ptr": "*fp32", "w_like": w_type, "table_ptr": "*i64", "out_ptr": "*fp32"}
    ints = [*INT_ARGS[kind], "stride_x", "stride_w", "stride_out", "stride_split", "SPLITS", "K_CHUNK"]
    signature |= dict.fromkeys(ints, "i32") | {"lut": "*i8"}
    constants = {
        "QTYPE": int(qt),
        "BLOCK_N": tiles.block_n,
        "BLOCK_M": tiles.block_m,
        "USE_DOT": tiles.use_dot,
    }
    signature |= dict.fromkeys(constants, "constexpr")
    kernel_fn = gpu._qmm_kernel if kind == "single" else gpu._grouped_kernel
    try:
        source = ASTSource(fn=kernel_fn, signature=signature, constexprs=constants)
    except TypeError as exc:  # triton's ahead-of-time API differs between releases
        pytest.skip(f"triton {triton.__version__}: ASTSource takes other arguments ({exc})")
    options = {"num_warps": tiles.num_warps, **gpu.COMPILE_OPTIONS}
    kernel = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"] and kernel.metadata.shared <= 227 * 1024
    if not tiles.use_dot:  # no multiply-add contracted: each weight is the reference's, two roundings
        assert "fma.rn.f32" not in kernel.asm["ptx"]


def test_imports_without_triton() -> None:
    """Without triton the module imports (the type table works) and the products raise ImportError."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from k3stream.quant.kernels import gpu\n"
        "assert gpu.SUPPORTED_GPU_TYPES\n"
        "try:\n"
        "    gpu.triton_qmatmul(torch.zeros(1, 256), torch.zeros(1, 84, dtype=torch.uint8), 10, 1, 256)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "need triton" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(INTERPRET, reason="this is the interpreter subprocess")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    select = "interp and not subprocess"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", __file__, "-k", select]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, done.stdout[-3000:]


# ---- CUDA -------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("case", _cases(), ids=_ids)
def test_cuda_matches_dequantize(case: tuple[T, int, int, int]) -> None:
    _check(*case, device="cuda")


@cuda
@pytest.mark.parametrize("qt", TYPES, ids=lambda qt: qt.name)
@pytest.mark.parametrize("n", [1, 64])
def test_cuda_expert_shape(qt: T, n: int) -> None:
    _check(qt, n, 3072, 3584, device="cuda")


@cuda
def test_cuda_grouped() -> None:
    """One launch for the experts with rows; an expert's bytes left in host memory move to the GPU."""
    qt, m, k = T.Q3_K, 96, 512
    weights = [_weights(qt, m, k, seed).cuda() for seed in range(3)]
    weights[2] = weights[2].cpu()
    x = torch.randn(40, k, device="cuda")
    got = triton_grouped_qmatmul(x, weights, qt, m, k, [0, 1, 1])  # expert 1 has no rows
    for w, lo, hi in ((weights[0], 0, 1), (weights[2].cuda(), 1, 40)):
        assert _relative_error(got[lo:hi], x[lo:hi], w, qt) <= 1e-5


@cuda
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_0], ids=lambda qt: qt.name)
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_cuda_grouped_expert_shape(qt: T, grouping: str) -> None:
    m, k, starts = 3072, 3584, GROUPINGS[grouping]
    rows = 4 if grouping == "decode" else 20
    weights = [_weights(qt, m, k, seed).cuda() for seed in range(4)]
    x = torch.randn(rows, k, device="cuda")
    got = triton_grouped_qmatmul(x, weights, qt, m, k, starts)
    bounds = [*starts, rows][:5]
    for w, lo, hi in zip(weights, bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            assert _relative_error(got[lo:hi], x[lo:hi], w, qt) <= 1e-5
