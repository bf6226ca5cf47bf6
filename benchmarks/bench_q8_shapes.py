"""The Q8_0 mat-vec on the same bytes at Kimi-K3's shapes, and a plain read of them, side by side.

    python benchmarks/bench_q8_shapes.py [--threads 2] [--repeat 15] [--clock wall|cpu]

140 MB of random Q8_0 blocks (one 18432 x 7168 matrix: the dense FFN's gate) multiplied by one input
row with llama.cpp's arithmetic (the input quantized to Q8_0, integer dot products) as: one matrix of
7168-wide rows (the trunk: every matrix reading the hidden state), one of 3584-wide rows (a latent
expert's width), 12 expert-sized matrices of 3072 x 3584 (`bench_kernels.py`'s shape) and 6 of 3072 x
7168, each on 2 MiB pages (NumPy's arrays, as the model's weights) and on 4 KiB pages; and an int64 sum
over the same bytes. Runs alternate; GB/s of the best and the median run. `--clock cpu` (with
`--threads 1`) times the calling thread's CPU seconds, which other processes on a shared machine do
not take.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from k3stream.quant.kernels import cpu

Q8_0 = 8
ROWS, WIDTH = 18432, 7168
BLOCK_BYTES = 34  # an f16 scale and 32 int8 codes


def random_q8_0(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """Random Q8_0 blocks with scale 1.0, in NumPy's memory (huge pages) or torch's (small pages)."""
    data = (
        torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
        if huge_pages
        else torch.empty(nbytes, dtype=torch.uint8)
    )
    data.copy_(torch.randint(-127, 128, (nbytes,), dtype=torch.int8).view(torch.uint8))
    data.view(-1, BLOCK_BYTES)[:, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # f16 1.0
    return data


def shapes(data: torch.Tensor) -> dict[str, tuple]:
    """name -> (call, bytes it reads) over `data`."""
    wide, narrow = torch.randn(1, WIDTH), torch.randn(1, WIDTH // 2)

    def grouped(x: torch.Tensor, count: int, rows: int) -> tuple:
        row_bytes = x.shape[1] // 32 * BLOCK_BYTES
        matrices = [data[i * rows * row_bytes : (i + 1) * rows * row_bytes] for i in range(count)]
        starts, inputs = torch.arange(count + 1), torch.zeros(count, dtype=torch.int64)
        call = lambda: cpu.grouped_product(x, matrices, Q8_0, rows, row_bytes, starts, inputs, True)  # noqa: E731
        return call, count * rows * row_bytes

    def one(x: torch.Tensor, rows: int) -> tuple:
        row_bytes = x.shape[1] // 32 * BLOCK_BYTES
        return lambda: cpu.products(x, [data.data_ptr()], [Q8_0], [rows], [row_bytes], [1]), rows * row_bytes

    return {
        "one 18432 x 7168": one(wide, ROWS),
        "one 36864 x 3584": one(narrow, 2 * ROWS),
        "6 x (3072 x 7168)": grouped(wide, 6, 3072),
        "12 x (3072 x 3584)": grouped(narrow, 12, 3072),
        "int64 sum": (lambda: data.view(torch.int64).sum(), data.numel()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    runs = {}
    for pages, huge in (("2 MiB pages", True), ("4 KiB pages", False)):
        for name, run in shapes(random_q8_0(ROWS * WIDTH // 32 * BLOCK_BYTES, huge)).items():
            runs[f"{name}, {pages}"] = run
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, (call, _) in runs.items():
            started = clock()
            call()
            seconds[name].append(clock() - started)
    print(f"{args.threads} threads, {args.clock} clock; GB/s best / median")
    for name, (_, nbytes) in runs.items():
        best, median = min(seconds[name]), statistics.median(seconds[name])
        print(f"  {name:32s} {nbytes / best / 1e9:6.1f} / {nbytes / median / 1e9:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
