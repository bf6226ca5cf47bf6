"""Mat-vec bandwidth of the Triton GGUF kernels against the GPU's copy bandwidth.

    python benchmarks/bench_kernels_gpu.py [--repeat 50] [--no-sweep] [--shapes 3072x3584,7168x3584]

For every type in `SUPPORTED_GPU_TYPES` and each `[out, in]` weight shape (default: the real Kimi-K3
expert roles 3072 x 3584 and 7168 x 3584), times `triton_qmatmul` with one input row (decode) and prints
the GB/s of weight bytes it consumes and its ratio to the bytes a plain `dst.copy_(src)` of 1 GiB reads
per second. The weights rotate through enough copies to exceed the L2 cache, so every call reads DRAM.
Also printed: k3stream's CUDA fallback (`qlinear`: dequantise to float32, then matmul) and, for the
audited recipe's expert types (Q2_K, Q3_K) unless `--no-sweep`, the best of a few mat-vec tilings
(BLOCK_M, num_warps) to tune `gpu._tiles` with (each tiling compiles: sweeping all twenty-five types would
take the one-GPU check past its ten minutes).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from k3stream.quant import qlinear, row_bytes, type_size
from k3stream.quant.kernels import gpu
from k3stream.testing import ggml_oracle

T = GGMLQuantizationType
GIB = 1 << 30
DEVICE = "cuda"
ROTATE_BYTES = 512 << 20  # weight copies per case: well beyond an H100/H200's 50-60 MB of L2
SWEEP = [(4, 2), (8, 2), (16, 2), (8, 4), (16, 4), (32, 4)]  # mat-vec (BLOCK_M, num_warps) tried
SWEPT_TYPES = (T.Q2_K, T.Q3_K)
# byte offsets of the fp16 scales in each block: given sane values so the arithmetic is ordinary
SCALE_FIELDS = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q6_K: (208,)}
SCALE_FIELDS |= {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q5_K: (0, 2), T.MXFP4: ()}
FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def cuda_seconds(fn: Callable[[int], object], repeat: int) -> float:
    """Mean seconds per call of `fn(i)` over `repeat` calls, after a warm-up (compiles, caches)."""
    fn(0)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(repeat):
        fn(i)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / repeat


def copy_read_gbs(repeat: int) -> float:
    """GB/s of bytes read by `dst.copy_(src)` of 1 GiB (it also writes as many)."""
    src = torch.empty(GIB, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return GIB / cuda_seconds(lambda _: dst.copy_(src), max(5, repeat // 5)) / 1e9


def random_weights(qt: T, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Valid-looking GGUF bytes `[out, row_bytes]` on the GPU (timing only: random codes)."""
    gen = torch.Generator().manual_seed(seed)
    if qt in FLOAT_DTYPES:
        values = torch.randn(out_features, in_features, generator=gen).to(FLOAT_DTYPES[qt])
        return values.view(torch.uint8).to(DEVICE)
    block_bytes = type_size(qt)[1]
    n_blocks = out_features * row_bytes(qt, in_features) // block_bytes
    if qt in gpu.IQUANT_GPU_TYPES:  # random codes, finite scales where each type keeps them
        valid = ggml_oracle.random_blocks(int(qt), n_blocks, np.random.default_rng(seed))
        return torch.from_numpy(valid).reshape(out_features, -1).to(DEVICE)
    blocks = torch.randint(0, 256, (n_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.from_numpy(np.full(len(blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2))
    for at in SCALE_FIELDS[qt]:
        blocks[:, at : at + 2] = scales
    if qt == T.MXFP4:
        blocks[:, 0] = 120  # its E8M0 scale: 2^-8
    return blocks.reshape(out_features, -1).to(DEVICE)


def sweep_tilings(x: torch.Tensor, copies: list[torch.Tensor], qt: T, shape: tuple[int, int], repeat: int):
    """(seconds, tiles) of the fastest mat-vec tiling in SWEEP, K split as planned or not at all."""
    views = [gpu._weight_operand(c, qt, *shape, c.device) for c in copies]
    out = torch.empty(1, shape[0], device=DEVICE)

    def timed(tiles: gpu.Tiles) -> float:
        return cuda_seconds(lambda i: gpu._launch(x, *views[i % len(views)], int(qt), out, tiles), repeat)

    candidates = []
    for block_m, warps in SWEEP:
        unsplit = gpu.Tiles(1, block_m, False, warps)
        planned = gpu._splits(unsplit, 1, *shape, 1, x.device)
        candidates += [unsplit] if planned == unsplit else [unsplit, planned]
    return min((timed(tiles), tiles) for tiles in candidates)


def bench_case(qt: T, shape: tuple[int, int], args: argparse.Namespace, copy_gbs: float) -> str:
    out_features, in_features = shape
    one = random_weights(qt, out_features, in_features, seed=0)
    copies = [one] + [one.clone() for _ in range(max(1, ROTATE_BYTES // one.numel()) - 1)]
    x = torch.randn(1, in_features, device=DEVICE)

    def triton_call(i: int) -> torch.Tensor:
        return gpu.triton_qmatmul(x, copies[i % len(copies)], qt, out_features, in_features)

    def fallback_call(i: int) -> torch.Tensor:
        return qlinear(x, copies[i % len(copies)], qt, out_features, in_features)

    seconds = cuda_seconds(triton_call, args.repeat)
    fallback = cuda_seconds(fallback_call, 5)
    gbs = one.numel() / seconds / 1e9
    line = (
        f"{qt.name:5} {out_features:5}x{in_features:<5} {one.numel() / 2**20:7.2f} MiB "
        f"{seconds * 1e6:8.1f} us {gbs:7.1f} GB/s {gbs / copy_gbs:6.1%} of copy "
        f"| qlinear {fallback * 1e6:8.1f} us"
    )
    if args.sweep and qt in SWEPT_TYPES:
        best, tiles = sweep_tilings(x, copies, qt, shape, args.repeat)
        line += (
            f" | best BLOCK_M={tiles.block_m:2} warps={tiles.num_warps} splits={tiles.splits:2}: "
            f"{one.numel() / best / 1e9:7.1f} GB/s"
        )
    return line


def bench_grouped(qt: T, shape: tuple[int, int], experts: int, repeat: int) -> str:
    """A decode step's routed experts: `experts` matrices with one input row each, in one launch
    (`triton_grouped_qmatmul`) against one `triton_qmatmul` launch per expert."""
    out_features, in_features = shape
    one = random_weights(qt, out_features, in_features, seed=1)
    copies = [one] + [one.clone() for _ in range(max(experts, ROTATE_BYTES // one.numel()) - 1)]
    x = torch.randn(experts, in_features, device=DEVICE)
    starts = list(range(experts))

    def chosen(i: int) -> list[torch.Tensor]:
        return [copies[(i * experts + e) % len(copies)] for e in range(experts)]

    def grouped(i: int) -> torch.Tensor:
        return gpu.triton_grouped_qmatmul(x, chosen(i), qt, out_features, in_features, starts)

    def separate(i: int) -> list[torch.Tensor]:
        return [gpu.triton_qmatmul(x[e : e + 1], w, qt, *shape) for e, w in enumerate(chosen(i))]

    one_launch, launches = cuda_seconds(grouped, repeat), cuda_seconds(separate, repeat)
    nbytes = experts * one.numel()
    return (
        f"{qt.name:5} {experts} experts of {out_features}x{in_features}, one row each: grouped "
        f"{one_launch * 1e6:8.1f} us ({nbytes / one_launch / 1e9:7.1f} GB/s), {experts} launches "
        f"{launches * 1e6:8.1f} us ({nbytes / launches / 1e9:7.1f} GB/s)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--shapes", default="3072x3584,7168x3584", help="OUTxIN weight shapes")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tiling sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels_gpu: needs a CUDA device")
    copy_gbs = copy_read_gbs(args.repeat)
    print(f"{torch.cuda.get_device_name()}: copy_ of 1 GiB reads {copy_gbs:.1f} GB/s (and writes as much)")
    print(f"mat-vec (one input row) of triton_qmatmul; default tiling {gpu._tiles(1)}, K split as planned")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for qt in sorted(gpu.SUPPORTED_GPU_TYPES):
        for out_features, in_features in shapes:
            print(bench_case(qt, (out_features, in_features), args, copy_gbs), flush=True)
    print("routed experts of one decode step (top-8):")
    for qt in (T.Q2_K, T.Q3_K):
        print(bench_grouped(qt, shapes[0], 8, args.repeat), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
