"""Dequantisation throughput: k3stream.quant.dequantize vs gguf.quants.dequantize on the same bytes.

    python benchmarks/bench_dequant.py [--elements 2097152] [--repeat 5] [--threads 1] [--device cpu]
                                       [--clock cpu|wall]

Prints one row per type: MB of float32 output per second for each, and k3stream's speed-up (best of
`--repeat`). The default clock is this process's CPU time, which a busy shared machine disturbs far
less than wall time; with one torch thread both sides are single-threaded. CUDA always uses wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gguf.quants
import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from k3stream.quant import SUPPORTED_TYPES, dequantize, quantize


def best_seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], None], clock) -> float:
    fn()  # warm-up: caches, allocator, lazy init
    sync()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        sync()
        times.append(clock() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 21, help="elements per tensor (multiple of 256)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (gguf/numpy uses one)")
    parser.add_argument("--device", default="cpu", help="device for k3stream (gguf always runs numpy on CPU)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    values = np.random.default_rng(0).standard_normal((args.elements // 4096, 4096)).astype(np.float32)
    out_mb = values.nbytes / 1e6
    print(
        f"{values.size} elements ({out_mb:.1f} MB float32 out), threads={args.threads}, "
        f"device={device}, clock={clock.__name__}"
    )
    print(f"{'type':<6} {'in MB':>7} {'k3stream MB/s':>14} {'gguf MB/s':>10} {'ratio':>7}")
    for qt in sorted(SUPPORTED_TYPES - {GGMLQuantizationType.F32}):  # F32 is a zero-copy view in both
        data = quantize(values, qt)
        on_device = torch.from_numpy(data).to(device)
        ours = best_seconds(lambda: dequantize(on_device, qt), args.repeat, sync, clock)  # noqa: B023
        theirs = best_seconds(lambda: gguf.quants.dequantize(data, qt), args.repeat, sync, clock)  # noqa: B023
        print(
            f"{qt.name:<6} {data.nbytes / 1e6:>7.2f} {out_mb / ours:>14.0f} {out_mb / theirs:>10.0f} "
            f"{theirs / ours:>6.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
