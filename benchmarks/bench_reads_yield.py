"""Mat-vec regions on one thread fewer while pack reads are in flight, against all threads, token by token.

    python benchmarks/bench_reads_yield.py [--fraction 0.1] [--rounds 12] [--prefill-rounds 4]

One child in `bench_real.py`'s memory cgroup for the fraction (the non-expert bytes + the fraction of
the expert bytes + --slack, page cache dropped, `--ram-mib` the fraction of the experts) prefills the
16-token prompt, then decodes `2 x --rounds` tokens with the yield (`cpu.set_reads_yield`) on and off
in turn (on, off, off, on, ...: each pair under the same load on a shared machine), then runs the same
prompt on a fresh sequence (and one decode step) `2 x --prefill-rounds` times alike. The yield changes
no bits, so both take the same experts and reads. It prints per phase and setting the median ms and
the median of each pair's on / off ratio (the first round's decode pair left out: warming up).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import bench_beyond_ram as beyond
import bench_real as real
from k3stream.memlimit import MIB, parse_size
from k3stream.testing.slices import like

CHILD = """
import argparse, json, sys, time
job = json.loads(sys.argv[1])
from k3stream.cli import calm_openmp
calm_openmp()
import torch
from k3stream.commands.flags import add_model_arguments, runtime_from_args
from k3stream.engine.generate import prefill_last
from k3stream.quant.kernels import cpu
parser = argparse.ArgumentParser()
add_model_arguments(parser)
torch.set_num_threads(job["threads"])
runtime = runtime_from_args(parser.parse_args(job["argv"]))
model, store, prompt = runtime.model, runtime.store, job["prompt"]
times = {phase: {"on": [], "off": []} for phase in ("decode", "prefill")}
def in_turn(rounds):  # each round's settings, the order turned every other round
    for round_ in range(rounds):
        yield from ("on", "off") if round_ % 2 == 0 else ("off", "on")
state = model.new_state()
tokens = [int(prefill_last(model, state, prompt).argmax())]
store.end_token(len(prompt))
for setting in in_turn(job["rounds"]):
    cpu.set_reads_yield(setting == "on")
    started = time.perf_counter()
    tokens.append(int(model.decode(state, tokens[-1]).argmax()))
    store.end_token(1)
    times["decode"][setting].append(time.perf_counter() - started)
for setting in in_turn(job["prefill_rounds"]):
    cpu.set_reads_yield(setting == "on")
    fresh, started = model.new_state(), time.perf_counter()
    first = int(prefill_last(model, fresh, prompt).argmax())
    store.end_token(len(prompt))
    times["prefill"][setting].append(time.perf_counter() - started)
    model.decode(fresh, first)
    store.end_token(1)
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3, help="slice layers (%(default)s)")
    parser.add_argument("--experts", type=int, default=128, help="routed experts (%(default)s)")
    parser.add_argument("--fraction", type=float, default=0.1, help="of the experts in RAM (%(default)s)")
    parser.add_argument("--rounds", type=int, default=12, help="decode pairs (%(default)s)")
    parser.add_argument("--prefill-rounds", type=int, default=4, help="prefill pairs (%(default)s)")
    parser.add_argument("--slack", default="1.5GiB", help="cgroup room above weights + experts")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/slice-bench"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    spec = like("kimi-k3", args.layers, n_experts=args.experts)
    gguf, manifest = beyond.ensure_model(spec, args.cache_dir)
    files = beyond.model_files(gguf, manifest)
    expert_bytes = real.bytes_per_token(gguf, spec)[2]
    ram = int(args.fraction * expert_bytes)
    limit = gguf.stat().st_size - expert_bytes + ram + parse_size(args.slack)
    argv = [str(manifest), "--device", "cpu", "--threads", str(args.threads), "--ram-mib", str(ram // MIB)]
    job = {
        "argv": argv,
        "threads": args.threads,
        "prompt": beyond.bench_prompt(gguf, 16),
        "rounds": args.rounds,
        "prefill_rounds": args.prefill_rounds,
    }
    result = beyond.run_child("reads-yield", CHILD, job, limit, files)
    if "error" in result:
        raise SystemExit(f"bench_reads_yield: {result['error']}")
    print(
        f"{args.fraction:.0%} of the experts, {args.threads} threads, load average {os.getloadavg()[0]:.1f}"
    )
    for phase, skip in (("decode", 2), ("prefill", 0)):
        on, off = (result[phase][setting][skip // 2 :] for setting in ("on", "off"))
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        print(
            f"  {phase}: yield on {statistics.median(on) * 1e3:.0f} ms, "
            f"off {statistics.median(off) * 1e3:.0f} ms "
            f"(medians of {len(on)}); on / off of each pair: median {statistics.median(ratios):.3f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}]"
        )


if __name__ == "__main__":
    main()
