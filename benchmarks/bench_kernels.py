"""GB/s of GGUF weight bytes the CPU kernels consume in a decode-style product, against a plain read.

    python benchmarks/bench_kernels.py [--threads 1,2] [--types Q2_K,Q3_K,...] [--experts 16] [--repeat 5]

One step of a real-size Kimi-K3 MoE layer: `--experts` matrices of one expert role (3072 x 3584, the
shape of up and gate), each multiplied by one input row (decode: top-16 experts, one token), through
`k3stream.quant.kernels.grouped_qmatmul` (F32: `qmatmul` per matrix, as a model's F32 projections
run). The same bytes are read by a plain sequential pass (`torch.sum` over them as int64, the same
thread count), the physical limit of reading them from RAM, alternating with the product run for run
(the best of each), so both meet the machine in the same phases.
The matrices together exceed the last-level cache, so both sides read from memory. Printed per type and
thread count: both rates and the ratio; types with integer kernels (`cpu.Q8_TYPES`) also with `match_ggml`
("q8": activations quantized to Q8_K or Q8_0 as llama.cpp does). Also prints the reference path (dequantize,
then matmul) once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from k3stream.quant import quantize
from k3stream.quant.kernels import F32, QWeight, cpu, grouped_qmatmul, qmatmul

ROWS, COLS = 3072, 3584  # one Kimi-K3 expert's up (or gate) projection: expert_ff x latent


def matrices(qtype: GGMLQuantizationType, count: int) -> list[QWeight]:
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(quantize(values, qtype)).reshape(-1))
    return [QWeight(data.clone(), int(qtype), (ROWS, COLS)) for _ in range(count)]


def best_seconds(run, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_both(first, second, repeat: int) -> tuple[float, float]:
    """The fastest of `repeat` runs of each, alternating (the machine's speed drifts within seconds:
    both see the same phases)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for run, spent in zip((first, second), times, strict=True):
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--types", default="Q2_K,Q3_K,Q4_0,Q8_0,Q4_K,Q5_K,Q6_K,Q4_1,Q5_0,Q5_1,MXFP4,F16,BF16,F32"
    )
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    x = torch.randn(args.experts, COLS)
    starts = torch.arange(args.experts + 1)
    rows = torch.arange(args.experts)
    each = f"best of {args.repeat}, kernel and read alternating"
    print(f"{args.experts} matrices of {ROWS} x {COLS}, one input row each; {each}")
    print(f"{'type':9s} {'threads':>7s} {'kernel GB/s':>11s} {'read GB/s':>9s} {'ratio':>6s} {'Gw/s':>6s}")
    for name in args.types.split(","):
        weights = matrices(GGMLQuantizationType[name], args.experts)
        total = sum(w.data.numel() for w in weights)
        words = [w.data.view(torch.int64) for w in weights]

        def plain_read(words=words):
            return [w.sum() for w in words]

        for match_ggml in (False, True) if GGMLQuantizationType[name] in cpu.Q8_TYPES else (False,):

            def product(weights=weights, match_ggml=match_ggml):
                if weights[0].ggml_type == F32:  # a model's F32 mat-vecs: one matrix at a time
                    return [qmatmul(x[i : i + 1], w) for i, w in enumerate(weights)]
                return grouped_qmatmul(x, weights, starts, rows, match_ggml=match_ggml)

            label = name + " q8" * match_ggml
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                kernel, read = best_of_both(product, plain_read, args.repeat)
                print(
                    f"{label:9s} {threads:7d} {total / kernel / 1e9:11.2f} {total / read / 1e9:9.2f} "
                    f"{read / kernel:6.2f} {ROWS * COLS * args.experts / kernel / 1e9:6.2f}"
                )
    torch.set_num_threads(1)
    weights = matrices(GGMLQuantizationType.Q2_K, args.experts)
    reference = best_seconds(lambda: grouped_qmatmul(x, weights, starts, rows, "reference"), 2)
    total = sum(w.data.numel() for w in weights)
    print(f"reference path (dequantize, then matmul), Q2_K, 1 thread: {total / reference / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
