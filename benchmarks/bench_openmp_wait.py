"""What a prefill pass pays for how its OpenMP workers wait between parallel regions: asleep at once
(`OMP_WAIT_POLICY=PASSIVE`), after a spin of `GOMP_SPINCOUNT` rounds (the `k3stream` commands spin
10,000: `cli.calm_openmp`) or after libgomp's default spin: one small two-thread region, and the stall
benchmark's chunks.

    python benchmarks/bench_openmp_wait.py [--spins 1000,10000,100000] [--threads 2] [--repeats 8]

Each setting runs in a child process (the policy is read when torch loads its OpenMP runtime), in
turn: the mean wall time of a two-thread `add_` over 65,536 floats (one parallel region, a few
microseconds of work; 2,000 calls, each after 100 us of this thread's own work as a pass's Python
between kernels), and the wall time of the first five chunks (256 tokens' work each, cut by equal work
as `serve` cuts them beside a running stream) of a 4,096-token prompt on the stall benchmark's tiny
model, a decode step of another sequence between two chunks: the median and least of `--repeats`
prompts. Run it under `chrt -f 5` to see an idle machine on a shared one (nothing else preempts it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def settings(spins: list[int]) -> list[tuple[str, dict[str, str]]]:
    """Each setting's label and the environment its child starts with."""
    base = {
        key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    rows = [("asleep (PASSIVE)", {**base, "OMP_WAIT_POLICY": "PASSIVE"})]
    rows += [(f"spin {count} rounds", {**base, "GOMP_SPINCOUNT": str(count)}) for count in spins]
    return rows + [("libgomp's default spin", base)]


def child(threads: int, repeats: int) -> None:
    """One setting's figures, printed on one line."""
    import torch

    from k3stream.engine.chunked_prefill import ChunkedPrefill, PrefillChunks, attention_rows_per_token
    from k3stream.engine.loading import load_runtime
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.testing.tiny import TinySpec, make_tiny

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as directory:
        spec = TinySpec(
            n_layers=6, hidden=128, n_experts=64, top_k=4, expert_ff=64, context_length=8192, seed=11
        )
        model = load_runtime(make_tiny(Path(directory), spec), stream_experts=False).model
        cache = PromptCache(model, "wait", 256 << 20)  # open: the products as a served cache has them
        chunks = PrefillChunks(256, attention_rows_per_token(model.config))
        generator = torch.Generator().manual_seed(7)
        stream = model.new_state()
        model.prefill_last(stream, [5, 6, 7])
        times: list[list[float]] = [[] for _ in range(5)]
        for _ in range(repeats + 1):  # the first prompt warms up
            prefill = ChunkedPrefill(
                model, torch.randint(10, 500, (4096,), generator=generator).tolist(), cache
            )
            for took in times:
                start = time.perf_counter()
                prefill.step(chunks)
                took.append(time.perf_counter() - start)
                model.decode_batch([stream], [65])
        cache.close()
    region = _region_us()
    chunk_ms = ", ".join(f"{1e3 * statistics.median(t[1:]):.1f}/{1e3 * min(t[1:]):.1f}" for t in times)
    print(f"a region {region:.1f} us; chunks 1-5, ms median/least: {chunk_ms}", flush=True)


def _region_us(calls: int = 2000) -> float:
    """The mean wall time of a two-thread `add_` over 65,536 floats, each after 100 us of own work."""
    import torch

    values, took = torch.zeros(1 << 16), 0.0
    for _ in range(calls):
        busy = time.perf_counter()
        while time.perf_counter() - busy < 100e-6:
            pass
        start = time.perf_counter()
        values.add_(1.0)
        took += time.perf_counter() - start
    return 1e6 * took / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spins", default="1000,10000,100000", help="GOMP_SPINCOUNT values to time")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.threads, args.repeats)
        return
    spins = [int(count) for count in args.spins.split(",") if count]
    command = [
        sys.executable,
        __file__,
        "--child",
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
    ]
    print(f"OpenMP workers asleep or spinning between regions ({args.threads} threads):")
    for label, environment in settings(spins):
        result = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        print(f"  {label:>26}: {result.stdout.strip()}")


if __name__ == "__main__":
    main()
