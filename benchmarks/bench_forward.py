"""Prefill and decode speed of k3stream and llama.cpp on the same mid-size tiny Kimi-K3 GGUF.

    python benchmarks/bench_forward.py [--recipe f32|f16|audited|iq2_xxs|dynamic|...] [--shape mid|wide|big]
        [--threads 2] [--clock wall|cpu]
        [--prompt 128] [--decode 32] [--repeat 3] [--prefills 3]
        [--kernels auto|reference] [--float-activations] [--step-times]

`--clock cpu` times the process's CPU seconds instead of wall seconds (meaningful with `--threads 1`,
where both engines compute on the calling thread alone): on a shared machine the cores other
processes take are then not counted.

Writes the model with `k3stream.testing.tiny` (`mid`: hidden 1024, 8 layers, 64 experts top-8 of 256 x 256;
`wide`: hidden 768, 128 experts top-8 of 512 x 512; `big`: hidden 1024, 128 experts top-8 of 1024 x
1024, where the routed experts are most of a token's work, as in Kimi-K3), runs the two engines in turn
`--repeat` times on the same tokens with the same thread count (a shared machine's speed drifts by
a quarter within a minute: alternating keeps both sides in the same weather; each run times
`--prefills` prefills of the prompt from a fresh state and keeps its fastest, both engines alike, as a
run's single prefill of half a second fell in a slow phase of a few seconds as often as not), and
prints the median tokens/s of each and the ratio of the medians, k3stream/llama.cpp.
`--kernels reference` runs k3stream's reference path (weights dequantized to float32 at load);
k3stream computes with its default arithmetic, llama.cpp's (activations quantized to 8 bits a row,
ggml's integer kernels), or with `--float-activations` on float32 activations.
`--step-times` then prints where a k3stream decode token's time goes: ms per token of each C function
of its decode program (`k3stream.model.program`), each step timed alone over `--decode` tokens, and of
its Python steps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from k3stream.cli import calm_openmp

calm_openmp()  # OpenMP's workers wait as the `k3stream` command's do (read when torch loads the runtime)

import numpy as np  # noqa: E402

from k3stream.commands.flags import add_arithmetic_arguments  # noqa: E402
from k3stream.gguf.writer import RECIPES  # noqa: E402

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}

SHAPES = {}
SHAPES["mid"] = MID_SIZE = dict(
    n_layers=8,
    hidden=1024,
    dense_ff=2048,
    kda_heads=8,
    kda_head_dim=128,
    mla_heads=8,
    q_lora=256,
    kv_lora=256,
    qk_nope=64,
    qk_rope=32,
    v_head_dim=64,
    n_experts=64,
    top_k=8,
    expert_ff=256,
    latent=256,
    n_shared=1,
    block_size=3,
    context_length=1024,
)
# more, larger experts (128 of them, top-8, 512 x 512) beside a narrower trunk
SHAPES["wide"] = dict(MID_SIZE, hidden=768, dense_ff=1536, n_experts=128, expert_ff=512, latent=512)
# the routed experts most of the work (over half of a decode token's time), as in the real model
SHAPES["big"] = dict(MID_SIZE, n_experts=128, expert_ff=1024, latent=1024)


def bench_k3stream(
    path: Path,
    tokens: list[int],
    prompt: int,
    threads: int,
    kernels: str = "auto",
    match_ggml: bool = True,
    prefills: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    import torch

    import k3stream

    torch.set_num_threads(threads)
    model = k3stream.load(path, k3stream.LoadOptions(kernels=kernels, match_ggml=match_ggml))
    model.logits(tokens[:8])  # warm-up
    prefill_s = float("inf")
    for _ in range(prefills):
        state = model.new_state()
        start = clock()
        model.prefill_last(state, tokens[:prompt])  # the last logits alone, as llama.cpp by default
        prefill_s = min(prefill_s, clock() - start)
    start = clock()
    for token in tokens[prompt:]:
        model.decode(state, token)
    return prefill_s, clock() - start


def decode_step_times(
    path: Path, tokens: list[int], prompt: int, threads: int, match_ggml: bool
) -> dict[str, tuple[float, int]]:
    """ms per decode token and calls per token of each function of k3stream's decode program (Python
    steps as "python"), each step timed alone as the program runs it, over the tokens after the prompt."""
    import torch

    import k3stream

    torch.set_num_threads(threads)
    model = k3stream.load(path, k3stream.LoadOptions(match_ggml=match_ggml))
    state = model.new_state()
    model.prefill_last(state, tokens[:prompt])
    model.decode(state, tokens[prompt])  # builds the program
    program = model._program
    names = [function.__name__.replace("_dropping_result", "python") for function, _, _ in program.steps]
    seconds = dict.fromkeys(names, 0.0)
    decoded = tokens[prompt + 1 :]
    for token in decoded:
        program._token = token
        for name, (function, args, _) in zip(names, program.steps, strict=True):
            start = time.perf_counter()
            function(*args)
            seconds[name] += time.perf_counter() - start
    return {name: (1e3 * s / len(decoded), names.count(name)) for name, s in seconds.items()}


def bench_llama(
    path: Path,
    tokens: list[int],
    prompt: int,
    threads: int,
    prefills: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    from llama_cpp import Llama

    model = Llama(
        str(path), n_ctx=len(tokens) + 8, n_batch=prompt, n_ubatch=prompt, n_threads=threads,
        n_threads_batch=threads, type_k=0, type_v=0, verbose=False,
    )  # fmt: skip
    model.eval(tokens[:8])  # warm-up
    prefill_s = float("inf")
    for _ in range(prefills):
        model.reset()
        start = clock()
        model.eval(tokens[:prompt])
        prefill_s = min(prefill_s, clock() - start)
    start = clock()
    for token in tokens[prompt:]:
        model.eval([token])
    return prefill_s, clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="f32", choices=RECIPES, help="as make-tiny --recipe")
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="cpu: process CPU seconds")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each engine, alternating; medians")
    parser.add_argument(
        "--prefills",
        type=int,
        default=3,
        help="prefills a run times (a fresh state each), keeping its fastest",
    )
    parser.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    parser.add_argument(
        "--step-times", action="store_true", help="then each decode program step's ms per token"
    )
    add_arithmetic_arguments(parser)
    args = parser.parse_args()
    match_ggml = not args.float_activations

    from k3stream.testing.tiny import TinySpec, make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(tmp, TinySpec(**SHAPES[args.shape], recipe=args.recipe, seed=args.seed))
        size_mb = sum(p.stat().st_size for p in Path(tmp).glob("*.gguf")) / 2**20
        print(
            f"model: {size_mb:.0f} MiB {args.recipe} GGUF, {SHAPES[args.shape]}; threads {args.threads}; "
            f"medians of {args.repeat} alternating runs (each the fastest of {args.prefills} prefills); "
            f"k3stream kernels {args.kernels}, {'ggml arithmetic' if match_ggml else 'float32 activations'}"
        )
        clock = CLOCKS[args.clock]
        tokens = np.random.default_rng(args.seed).integers(0, 500, args.prompt + args.decode).tolist()
        runs: dict[str, list[tuple[float, float]]] = {"k3stream": [], "llama.cpp": []}
        for _ in range(args.repeat):
            runs["k3stream"].append(
                bench_k3stream(
                    path,
                    tokens,
                    args.prompt,
                    args.threads,
                    args.kernels,
                    match_ggml,
                    args.prefills,
                    clock,
                )
            )
            runs["llama.cpp"].append(
                bench_llama(path, tokens, args.prompt, args.threads, args.prefills, clock)
            )
        steps = (
            decode_step_times(path, tokens, args.prompt, args.threads, match_ggml) if args.step_times else {}
        )
    rates = {
        name: (
            float(np.median([args.prompt / prefill_s for prefill_s, _ in times])),
            float(np.median([args.decode / decode_s for _, decode_s in times])),
        )
        for name, times in runs.items()
    }
    for name, (prefill_rate, decode_rate) in rates.items():
        print(f"{name:10s} prefill {prefill_rate:8.1f} tok/s   decode {decode_rate:7.2f} tok/s")
    ours, theirs = rates["k3stream"], rates["llama.cpp"]
    print(f"ratio k3stream/llama.cpp: prefill {ours[0] / theirs[0]:.2f}x   decode {ours[1] / theirs[1]:.2f}x")
    if steps:
        print(f"k3stream decode steps, ms per token (calls): total {sum(ms for ms, _ in steps.values()):.3f}")
        for name, (ms, calls) in sorted(steps.items(), key=lambda item: -item[1][0]):
            print(f"  {name:16s} {ms:7.3f} ({calls})")


if __name__ == "__main__":
    main()
