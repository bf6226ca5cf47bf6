"""Cold prefills at several expert budgets, alternating in one process: where a larger budget's time goes.

    python benchmarks/bench_real_cold.py [--layers 3] [--experts 128] [--fractions 0.1,0.25] [--rounds 5]

On `bench_real.py`'s real-dimension slice (written and packed unless in --cache-dir), each round
loads the model once per budget (each of --fractions of the routed experts, `--ram-mib`, O_DIRECT, no
memory cgroup; the budgets' order alternates between rounds) and times its cold prefill of the
16-token prompt. Per budget it prints the medians over the rounds of the prefill's ms, MB read, fetch
wait, hint reads and of them used, how many experts of each MoE layer's first read-ahead (at its
router: what the tier holds of the step and its first window) were not in RAM, and the ms after the
last router; per round also the disk's busy time before and after each router; with --calls, each
round's hints and read-ahead calls (as `bench_warm_prefill.py` prints them).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

import bench_beyond_ram as beyond
import bench_real as real
from bench_stream_timeline import busy_ms
from bench_warm_prefill import Timeline, watched_slice
from k3stream.memlimit import MIB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--fractions", default="0.1,0.25", help="of the routed experts in RAM")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", action="store_true", help="print each round's hints and read-ahead calls")
    parser.add_argument("--cache-dir", type=Path, default=real.DEFAULT_CACHE)
    return parser.parse_args(argv)


def cold_prefill(flags: list[str], ram_mib: float, prompt: list[int], timeline: Timeline) -> dict:
    """Load the model with `ram_mib` of experts and time its cold prefill of `prompt`."""
    from k3stream.commands.flags import add_model_arguments, runtime_from_args
    from k3stream.engine.generate import prefill_last

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    runtime = runtime_from_args(parser.parse_args([*flags, "--ram-mib", f"{ram_mib:.1f}"]))
    try:
        store = runtime.store
        store.wait_for_buffers()
        before = store.stats()
        timeline.start()
        prefill_last(runtime.model, runtime.model.new_state(), prompt)
        elapsed = timeline.now_ms()
        timeline.stop()
        after = store.stats()
    finally:
        runtime.close()
    delta = {name: after[name] - before[name] for name in ("pack_read_bytes", "fetch_ns", "prefetch_loads")}
    # each MoE layer's router: its first read-ahead call, and how many of the step's experts it missed
    routers, missing = {}, {}
    for at, kind, layer, row in timeline.calls:
        if kind == "read-ahead" and layer not in routers:
            routers[layer], missing[layer] = at / 1e3, row[1]
    edges = [0.0, *sorted(routers.values()), elapsed / 1e3]
    return {
        "ms": elapsed,
        "MB": delta["pack_read_bytes"] / 1e6,
        "wait": delta["fetch_ns"] / 1e6,
        "hint reads": delta["prefetch_loads"],
        "hint used": after["prefetch_hits"] - before["prefetch_hits"],
        "missing": [missing[layer] for layer in sorted(missing)],
        "busy": [1e3 * busy_ms(sorted(timeline.reads), a, b) for a, b in zip(edges, edges[1:], strict=False)],
        "span": [1e3 * (b - a) for a, b in zip(edges, edges[1:], strict=False)],
        "calls": list(timeline.calls),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf, expert_bytes, flags, timeline = watched_slice(args)
    fractions = [float(part) for part in args.fractions.split(",")]
    prompt = beyond.bench_prompt(gguf, 16)
    results: dict[float, list[dict]] = {fraction: [] for fraction in fractions}
    for round_ in range(args.rounds):
        order = fractions if round_ % 2 == 0 else fractions[::-1]
        for fraction in order:
            run = cold_prefill(flags, fraction * expert_bytes / MIB, prompt, timeline)
            gc.collect()
            results[fraction].append(run)
            spans = " | ".join(
                f"{busy:.0f}/{span:.0f}" for busy, span in zip(run["busy"], run["span"], strict=True)
            )
            print(
                f"round {round_ + 1} {fraction:.0%}: {run['ms']:.0f} ms, {run['MB']:.0f} MB, wait"
                f" {run['wait']:.0f} ms, hint reads {run['hint reads']} ({run['hint used']} used),"
                f" missing at each router {run['missing']}; disk busy/ms to each router"
                f" and after the last: {spans}",
                flush=True,
            )
            if args.calls:
                for at, kind, layer, row in run["calls"]:
                    print(
                        f"   {at:7.1f} ms {kind:<10} layer {layer}: " + " / ".join(str(part) for part in row)
                    )
    print(f"\nmedians of {args.rounds} rounds:")
    for fraction, runs in results.items():
        cells = {
            name: statistics.median(run[name] for run in runs)
            for name in ("ms", "MB", "wait", "hint reads", "hint used")
        }
        missing = [
            statistics.median(column) for column in zip(*(run["missing"] for run in runs), strict=True)
        ]
        tail = statistics.median(run["span"][-1] for run in runs)
        print(
            f"  {fraction:.0%}: "
            + ", ".join(f"{name} {value:.0f}" for name, value in cells.items())
            + f", missing at each router {missing}, ms after the last router {tail:.0f}"
        )
    if len(fractions) == 2:
        ratios = [b["ms"] / a["ms"] for a, b in zip(*results.values(), strict=True)]
        print(
            f"  {fractions[1]:.0%} / {fractions[0]:.0%} ms per round: {', '.join(f'{r:.2f}' for r in ratios)}"
        )
    print("hint rows: experts named / not in the tier / kept for the step / layer active / allowance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
