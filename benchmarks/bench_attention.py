"""One query's MLA attention over a long latent cache at Kimi-K3's widths: the C kernel
(`cpu.mla_attend`) against torch's two matrix products (`mla.torch_attend_one`, `MLA._attend_one`'s
torch form, and the same with `torch.softmax`'s weights), side by side.

    python benchmarks/bench_attention.py [--heads 64,96] [--rows 2048,4096,8192,16384]
        [--spreads 1,8,30] [--threads 2] [--repeats 7]

A cache row is 576 floats (kv_lora 512 + rope 64), the context its first 512; the scale is 192^-0.5.
The scores' spread is the standard deviation of query . row * scale: 1 is random-like (every weight
counts), 30 is a trained model's peaked attention (scores spanning hundreds, so most softmax weights
are far below the largest: `torch.softmax`'s are then subnormal floats, whose products are slow; the
C kernel and `mla.softmax_weights` take weights below exp(-64) of the largest as 0). Each figure is
the least of --repeats calls; the ratios are torch's time over C's (above 1: C is faster).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from k3stream.model.mla import torch_attend_one
from k3stream.quant.kernels import cpu

WIDTH, KV, SCALE = 576, 512, 192**-0.5


def least(function, repeats: int) -> float:
    function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def inputs(heads: int, rows: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of normed rows and a query whose scores have standard deviation `spread`."""
    generator = torch.Generator().manual_seed(heads * rows)
    cache = torch.randn(rows, WIDTH, generator=generator)
    query = torch.randn(heads, WIDTH, generator=generator)
    query *= spread / (SCALE * WIDTH**0.5)
    return query, cache


def by_torch_softmax(query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(torch.mm(query, cache.T) * SCALE, dim=-1)
    return torch.mm(probs, cache[:, :KV])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", default="64,96")
    parser.add_argument("--rows", default="2048,4096,8192,16384")
    parser.add_argument("--spreads", default="1,8,30")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{os.cpu_count()} CPUs, {args.threads} threads, kernels {cpu.isa()}; least of {args.repeats}")
    print(
        f"{'heads':>5} {'rows':>6} {'spread':>6} | {'C ms':>8} {'torch ms':>8} {'torch/C':>7} | "
        f"{'softmax ms':>10} {'/C':>6} | max diff to C"
    )
    for heads in map(int, args.heads.split(",")):
        for rows in map(int, args.rows.split(",")):
            for spread in map(float, args.spreads.split(",")):
                query, cache = inputs(heads, rows, spread)
                by_c = least(lambda q=query, k=cache: cpu.mla_attend(q, k, KV, SCALE), args.repeats)
                engine = least(lambda q=query, k=cache: torch_attend_one(q, k, KV, SCALE), args.repeats)
                plain = least(lambda q=query, k=cache: by_torch_softmax(q, k), args.repeats)
                diff = cpu.mla_attend(query, cache, KV, SCALE) - torch_attend_one(query, cache, KV, SCALE)
                print(
                    f"{heads:>5} {rows:>6} {spread:>6g} | {1e3 * by_c:>8.2f} {1e3 * engine:>8.2f} "
                    f"{engine / by_c:>7.2f} | {1e3 * plain:>10.2f} {plain / by_c:>6.2f} | "
                    f"{float(diff.abs().max()):.1e}"
                )


if __name__ == "__main__":
    main()
