"""What a pack reader's work costs the mat-vecs computing beside it.

    python benchmarks/bench_read_steal.py PACK [--rounds 40] [--period-ms 0.5] [--threads 2]

A KDA-sized layer of Q8_0 mat-vecs (5 matrices of 12288 x 7168, 470 MB; one input row, 8-bit
activations) runs on `--threads` threads through k3stream's C kernels while a side thread, round by
round in turn, does nothing, spins 0.2 ms bursts, hashes out-of-cache ranges (xxh3_64, the digests),
reads ranges of PACK with O_DIRECT into a buffer made as the store makes its read buffers, or reads
and hashes them (a pack reader's work), each followed by `--period-ms` of sleep. Per kind of work it
prints the layer's median ms, the side thread's CPU ms during a layer and the layer's extra wall ms per
side CPU ms (each round's layer against that round's quiet one): 0.5 on two threads is one core's
share, 1 a thread of the region waiting for the other.
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time

import numpy as np
import torch
import xxhash
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from k3stream.quant.kernels import cpu
from k3stream.store.pack_io import prefaulted_buffer
from k3stream.testing import ggml_oracle

Q8_0 = int(GGMLQuantizationType.Q8_0)
RANGE_BYTES = 2920 << 10  # a 128-expert slice object's quarter: one of the store's 4 splits
KINDS = ("quiet", "spin", "digest", "read", "read+digest")


def q8_0_matrix(rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    """Random Q8_0 rows with finite scales (`ggml_oracle.random_blocks`), one row of blocks a row."""
    blocks = ggml_oracle.random_blocks(
        Q8_0, rows * cols // GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0], rng
    )
    return torch.from_numpy(blocks.reshape(rows, -1))


class SideThread:
    """One kind of work at a time (`kind`), its CPU time summed in `cpu_ns`."""

    def __init__(self, pack: str, period_s: float) -> None:
        self.kind = "quiet"
        self.cpu_ns = 0
        self.period_s = period_s
        try:
            self._fd = os.open(pack, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            raise SystemExit(f"{pack}: cannot be opened for O_DIRECT reads ({exc.strerror})") from None
        self._span = os.fstat(self._fd).st_size - RANGE_BYTES
        if self._span <= 0:
            os.close(self._fd)
            raise SystemExit(f"{pack}: smaller than one {RANGE_BYTES >> 10} KiB range")
        self._buffer = prefaulted_buffer(RANGE_BYTES)
        self._cold = np.random.default_rng(1).integers(0, 256, size=(64, RANGE_BYTES), dtype=np.uint8)
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _one(self, kind: str, i: int) -> None:
        if kind == "spin":
            until = time.perf_counter() + 0.0002
            while time.perf_counter() < until:
                pass
        elif kind == "digest":
            xxhash.xxh3_64_intdigest(self._cold[i % len(self._cold)])
        else:
            offset = (i * RANGE_BYTES * 7919) % self._span // 4096 * 4096
            os.preadv(self._fd, [memoryview(self._buffer)], offset)
            if kind == "read+digest":
                xxhash.xxh3_64_intdigest(self._buffer)

    def _run(self) -> None:
        for i in itertools.count():
            if self._stop:
                return
            kind = self.kind
            if kind == "quiet":
                time.sleep(0.001)
                continue
            started = time.thread_time_ns()
            self._one(kind, i)
            self.cpu_ns += time.thread_time_ns() - started
            time.sleep(self.period_s)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        os.close(self._fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", help="a file on the disk the pack is read from (read with O_DIRECT)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--period-ms", type=float, default=0.5, help="the side thread's sleep after each piece"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    side = SideThread(args.pack, args.period_ms / 1000)
    rows, cols, matrices = 12288, 7168, 5
    rng = np.random.default_rng(0)
    weights = [q8_0_matrix(rows, cols, rng) for _ in range(matrices)]
    x = torch.randn(1, cols)
    layout = (
        [w.data_ptr() for w in weights],
        [Q8_0] * matrices,
        [rows] * matrices,
        [weights[0].shape[1]] * matrices,
    )
    wall: dict[str, list[float]] = {kind: [] for kind in KINDS}
    stolen: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        for _ in range(3):
            cpu.products(x, *layout, [1] * matrices)
        for _ in range(args.rounds):
            for kind in KINDS:
                side.kind = kind
                time.sleep(0.003)
                cpu_before, started = side.cpu_ns, time.perf_counter()
                cpu.products(x, *layout, [1] * matrices)
                wall[kind].append((time.perf_counter() - started) * 1e3)
                stolen[kind].append((side.cpu_ns - cpu_before) / 1e6)
    finally:
        side.close()
    quiet = np.array(wall["quiet"])
    print(
        f"a layer of {matrices} Q8_0 mat-vecs {rows} x {cols} on {args.threads} threads, "
        f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}"
    )
    print("| side thread | layer ms, median | side CPU ms a layer | extra wall ms per side CPU ms |")
    print("|---|---|---|---|")
    for kind in KINDS:
        cost = np.median(stolen[kind])
        extra = f"{np.median(np.array(wall[kind]) - quiet) / cost:.2f}" if cost > 0 else "n/a"
        print(f"| {kind} | {np.median(wall[kind]):.2f} | {cost:.2f} | {extra} |")


if __name__ == "__main__":
    main()
