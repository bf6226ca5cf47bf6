"""Expert-store benchmark: eviction policies against Belady, and what prefetch buys in decode.

    python benchmarks/bench_store.py [--synthetic-tokens 96] [--text-tokens 160] [--decode-tokens 24]

1. Policy table on a synthetic Kimi-K3-shaped trace (92 MoE layers, 896 experts, top-16, real object
   size): Zipf popularity per layer, reuse between consecutive tokens, topic drift. Synthetic: no real
   Kimi-K3 routing trace exists here.
2. Policy table on a trace recorded by the store while a tiny random-weight Kimi-K3 reads real text
   (this repository's docs/design.md) token by token. Random routers route almost uniformly, so this
   trace is much less skewed than a trained model's; it checks the machinery, not the policies.
4. Prefetch with perfect predictions: the text trace replayed with each step's true successor as the
   hint and a fixed off-CPU "compute" (a sleep, as a GPU kernel would leave the CPU free) per layer:
   how much read latency the store can hide when the hint is right.
3. Prefetch on/off: the same tiny model decodes with a RAM budget of a quarter of its experts and an
   artificial latency per read (the pack sits in the page cache here, so reads are otherwise ~free),
   16 reader threads (an NVMe queue serves many reads at once) and one torch thread (so that compute
   does not fight the readers for the 2 cores of the machine this was written on). The model asks
   for layer i's experts before layer i's attention, predicted from the layer's input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
POLICIES = ["lfu-lru", "lru", "arc", "cycle"]
# One Kimi-K3 expert object: up and gate (3072 x 3584) Q2_K, down (3584 x 3072) Q3_K.
KIMI_OBJECT_BYTES = 2 * (3072 * 3584 // 256 * 84) + 3584 * 3072 // 256 * 110
TEXT_TRACE = "text-trace.jsonl"
TINY_SPEC = dict(n_layers=8, n_experts=64, top_k=8, expert_ff=64, latent=64)


def policy_table(title: str, steps: list, object_bytes: int, sizes_mib: list[float]) -> list[dict]:
    from k3stream.store.simulate import format_table, hit_rate_table, largest_step

    started = time.perf_counter()
    rows = hit_rate_table(steps, object_bytes, sizes_mib, POLICIES)
    print(
        f"\n## {title}\n{len(steps)} steps, largest step {largest_step(steps)} experts, "
        f"object {object_bytes} bytes ({time.perf_counter() - started:.0f} s to simulate)"
    )
    print(format_table(rows, POLICIES))
    return rows


def synthetic_section(tokens: int) -> list[dict]:
    from k3stream.store.traces import SyntheticSpec, synthetic_trace

    spec = SyntheticSpec(moe_layers=92, num_experts=896, top_k=16, tokens=tokens)
    trace = synthetic_trace(spec)
    sizes = [gib * 1024 for gib in (5, 20, 80, 320)]
    return policy_table(
        f"synthetic Kimi-K3-shaped trace, {tokens} tokens (sizes in MiB)",
        trace.steps,
        KIMI_OBJECT_BYTES,
        sizes,
    )


def build_tiny(work: Path) -> tuple[Path, Path]:
    from k3stream.pack.builder import build_pack
    from k3stream.testing.tiny import TinySpec, make_tiny

    gguf_path = make_tiny(work / "model", TinySpec(**TINY_SPEC))
    result = build_pack(gguf_path, work / "tiny.pack", work / "tiny.manifest.json")
    return gguf_path, result.manifest


def text_tokens(gguf_path: Path, count: int) -> list[int]:
    from k3stream.engine.tokenizer import Tokenizer

    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return Tokenizer.from_gguf(gguf_path).encode(text)[:count]


def text_trace_section(gguf_path: Path, manifest: Path, work: Path, tokens: list[int]) -> list[dict]:
    import k3stream
    from k3stream.pack.reader import ExpertPack
    from k3stream.store import ExpertStore
    from k3stream.store.traces import read_trace

    pack = ExpertPack(manifest)
    trace_path = work / TEXT_TRACE
    everything = len(pack.moe_layers) * pack.num_experts * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=everything, prefetch=False, record_trace=trace_path) as store:
        model = k3stream.load(gguf_path, k3stream.LoadOptions(expert_source=store, prefetch=False))
        state = model.new_state()
        for token in tokens:
            model.decode(state, token)
            store.end_token(1)
    trace = read_trace(trace_path)
    total = len(pack.moe_layers) * pack.num_experts
    sizes = [round(fraction * total) * pack.object_bytes / MIB for fraction in (0.1, 0.25, 0.5)]
    title = f"tiny random-weight model reading docs/design.md, {trace.tokens} tokens ({total} experts)"
    return policy_table(title, trace.steps, pack.object_bytes, sizes)


def quarter_budget_store(manifest: Path, prefetch: bool, latency_us: float):
    """An LRU store holding a quarter of the pack's experts, reads slowed by `latency_us`."""
    from k3stream.pack.reader import ExpertPack
    from k3stream.store import ExpertStore

    pack = ExpertPack(manifest)
    budget = len(pack.moe_layers) * pack.num_experts // 4 * pack.object_bytes / MIB
    return ExpertStore(
        pack,
        ram_mib=budget,
        policy="lru",
        prefetch=prefetch,
        io_threads=16,
        simulated_read_latency_us=latency_us,
    )


def decode_run(gguf_path: Path, manifest: Path, tokens: list[int], prefetch: bool, latency_us: float) -> dict:
    import k3stream

    with quarter_budget_store(manifest, prefetch, latency_us) as store:
        model = k3stream.load(gguf_path, k3stream.LoadOptions(expert_source=store, prefetch=prefetch))
        state = model.new_state()
        started = time.perf_counter()
        for token in tokens:
            model.decode(state, token)
            store.end_token(1)
        seconds = time.perf_counter() - started
        stats = store.stats()
    return {
        "prefetch": prefetch,
        "latency_us": latency_us,
        "tokens_per_s": len(tokens) / seconds,
        "fetch_stall_ms_per_token": stats["fetch_ns"] / 1e6 / len(tokens),
        "hit_rate": stats["tiers"]["ram"]["hit_rate"],
        "prefetch_hits": stats["prefetch_hits"],
        "prefetch_loads": stats["prefetch_loads"],
        "prefetch_waits": stats["prefetch_waits"],
        "bytes_per_token": stats["bytes_per_token"],
    }


def median_run(
    gguf_path: Path, manifest: Path, tokens: list[int], prefetch: bool, latency: float, repeats: int
) -> dict:
    """The run with the median decode speed of `repeats` (the machine is shared, timings are noisy)."""
    runs = sorted(
        (decode_run(gguf_path, manifest, tokens, prefetch, latency) for _ in range(repeats)),
        key=lambda row: row["tokens_per_s"],
    )
    return runs[len(runs) // 2]


def prefetch_section(
    gguf_path: Path, manifest: Path, tokens: list[int], latencies: list[float], repeats: int
) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows = [
        median_run(gguf_path, manifest, tokens, prefetch, latency, repeats)
        for latency in latencies
        for prefetch in (False, True)
    ]
    print(
        f"\n## prefetch on/off: tiny model decode, {len(tokens)} tokens, RAM budget 1/4 of experts, lru,"
        f" median of {repeats} runs"
    )
    print(
        f"{'latency_us':>10} {'prefetch':>8} {'tok/s':>7} {'stall ms/tok':>12} {'hit rate':>8} "
        f"{'pf hit+wait/loaded':>18} {'KiB/tok':>8}"
    )
    for row in rows:
        used = f"{row['prefetch_hits']}+{row['prefetch_waits']}/{row['prefetch_loads']}"
        print(
            f"{row['latency_us']:>10g} {str(row['prefetch']):>8} {row['tokens_per_s']:>7.2f} "
            f"{row['fetch_stall_ms_per_token']:>12.1f} {100 * row['hit_rate']:>7.1f}% {used:>18} "
            f"{row['bytes_per_token'] / 1024:>8.0f}"
        )
    return rows


def replay_run(manifest: Path, steps: list, prefetch: bool, latency_us: float, compute_ms: float) -> dict:
    """Replay `steps`: fetch a layer, hint the next step's true experts, then 'compute' off the CPU."""
    with quarter_budget_store(manifest, prefetch, latency_us) as store:
        started = time.perf_counter()
        for index, (layer, experts) in enumerate(steps):
            store.fetch(layer, experts)
            if index + 1 < len(steps):
                store.prefetch(*steps[index + 1])
            time.sleep(compute_ms / 1e3)  # a GPU kernel: the CPU and the GIL stay free
        seconds = time.perf_counter() - started
        stats = store.stats()
    return {
        "prefetch": prefetch,
        "latency_us": latency_us,
        "compute_ms": compute_ms,
        "seconds": seconds,
        "fetch_stall_ms": stats["fetch_ns"] / 1e6,
        "hit_rate": stats["tiers"]["ram"]["hit_rate"],
    }


def replay_section(manifest: Path, trace_path: Path, latencies: list[float], compute_ms: float) -> list[dict]:
    from k3stream.store.traces import read_trace

    steps = read_trace(trace_path).steps
    rows = [
        replay_run(manifest, steps, prefetch, latency, compute_ms)
        for latency in latencies
        for prefetch in (False, True)
    ]
    print(
        f"\n## prefetch with perfect predictions: replay of the text trace ({len(steps)} steps), "
        f"{compute_ms:g} ms of off-CPU compute per layer, RAM budget 1/4 of experts, lru"
    )
    print(f"{'latency_us':>10} {'prefetch':>8} {'total s':>8} {'stall ms':>9} {'hit rate':>8}")
    for row in rows:
        print(
            f"{row['latency_us']:>10g} {str(row['prefetch']):>8} {row['seconds']:>8.2f} "
            f"{row['fetch_stall_ms']:>9.0f} {100 * row['hit_rate']:>7.1f}%"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-tokens", type=int, default=96)
    parser.add_argument("--text-tokens", type=int, default=160)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument(
        "--latencies-us", default="0,500,2000", help="simulated read latencies, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="decode runs per prefetch setting")
    parser.add_argument(
        "--compute-ms", type=float, default=1.0, help="off-CPU compute per layer in the replay"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = {"synthetic": synthetic_section(args.synthetic_tokens)}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        work = Path(tmp)
        gguf_path, manifest = build_tiny(work)
        tokens = text_tokens(gguf_path, max(args.text_tokens, args.decode_tokens))
        results["text"] = text_trace_section(gguf_path, manifest, work, tokens[: args.text_tokens])
        latencies = [float(value) for value in args.latencies_us.split(",")]
        results["prefetch"] = prefetch_section(
            gguf_path, manifest, tokens[: args.decode_tokens], latencies, args.repeats
        )
        results["replay"] = replay_section(manifest, work / TEXT_TRACE, latencies, args.compute_ms)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
