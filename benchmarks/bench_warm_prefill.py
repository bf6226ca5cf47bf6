"""Where a streamed prefill's disk idles: the store's calls and every pack read, timed, on a slice.

    python benchmarks/bench_warm_prefill.py [--layers 3] [--experts 128] [--fraction 0.25] [--repeats 2]

On `bench_real.py`'s real-dimension slice (written and packed unless in --cache-dir), with an expert
budget of --fraction of the routed experts (`--ram-mib`, O_DIRECT; no memory cgroup), it prefills the
16-token prompt and decodes --decode-tokens tokens (the tier then holds what a decode left), then
prefills the same prompt again in a fresh sequence --repeats times, one decode step between (as
`bench_real.py` measures its warm prefill). Per warm prefill it prints its ms, the bytes read and the
fetch wait; each hint the store got (ms from the prefill's start, layer, experts named, of them not
in the tier, of them the tier keeps for the step, whether the layer's hints are active, its
allowance) and each read-ahead (layer, experts, of them not in the tier); the first and the last
read, the time the disk was busy and its gaps over 5 ms.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import bench_beyond_ram as beyond
import bench_real as real
from k3stream.memlimit import MIB
from k3stream.testing.slices import like


class Timeline:
    """The store's hints and read-ahead calls and the pack's read ranges, from `start()` on."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.reads: list[tuple[float, float]] = []
        self.origin: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self.calls, self.reads, self.origin = [], [], time.perf_counter()

    def stop(self) -> None:
        self.origin = None

    def now_ms(self) -> float:
        return 1e3 * (time.perf_counter() - self.origin)

    def watch(self, store_class, pack_file_class) -> None:
        """Wrap the store's `prefetch` and `read_ahead` and the pack file's range reads."""
        timeline = self
        prefetch, read_ahead, read_range = (
            store_class.prefetch,
            store_class.read_ahead,
            pack_file_class._read_range,
        )

        def timed_prefetch(store, layer, expert_ids):
            experts = list(expert_ids)
            prefetch(store, layer, experts)
            if timeline.origin is not None:
                tier, keys = store._compute, [(layer, expert) for expert in experts]
                kept = sum(key in tier.fresh for key in keys)
                hints = store._hints
                row = (
                    len(experts),
                    len(tier.missing(keys)),
                    kept,
                    hints.active(layer),
                    hints.allowance(layer),
                )
                timeline.calls.append((timeline.now_ms(), "hint", layer, row))

        def timed_read_ahead(store, layer, expert_ids):
            experts = list(expert_ids)
            if timeline.origin is not None:
                missing = len(store._compute.missing([(layer, expert) for expert in experts]))
                timeline.calls.append((timeline.now_ms(), "read-ahead", layer, (len(experts), missing)))
            read_ahead(store, layer, experts)

        def timed_range(file, request, start, length):
            began = time.perf_counter()
            read_range(file, request, start, length)
            if timeline.origin is not None:
                with timeline._lock:
                    timeline.reads.append((began - timeline.origin, time.perf_counter() - timeline.origin))

        store_class.prefetch, store_class.read_ahead = timed_prefetch, timed_read_ahead
        pack_file_class._read_range = timed_range

    def disk_lines(self) -> list[str]:
        """The first and last read, the disk's busy time and its idle gaps over 5 ms."""
        if not self.reads:
            return ["   no reads"]
        busy, end, gaps = 0.0, None, []
        for began, ended in sorted(self.reads):
            if end is not None and began - end > 0.005:
                gaps.append(f"{1e3 * end:.0f}-{1e3 * began:.0f}")
            if end is None or ended > end:
                busy += ended - (began if end is None else max(began, end))
                end = ended
        first = min(began for began, _ in self.reads)
        return [
            f"   reads from {1e3 * first:.0f} to {1e3 * end:.0f} ms, disk busy {1e3 * busy:.0f} ms; "
            f"idle gaps over 5 ms: {', '.join(gaps) or 'none'}"
        ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.25, help="of the routed experts in RAM")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=real.DEFAULT_CACHE)
    return parser.parse_args(argv)


def watched_slice(args: argparse.Namespace) -> tuple[Path, int, list[str], Timeline]:
    """OpenMP calmed and --threads set; the slice (written and packed unless in --cache-dir), its
    routed experts' bytes, the flags of a runtime on it (O_DIRECT) and a Timeline watching its store."""
    from k3stream.cli import calm_openmp

    calm_openmp()
    import torch

    from k3stream.store.expert_store import ExpertStore
    from k3stream.store.pack_io import PackFile

    spec = like("kimi-k3", args.layers, n_experts=args.experts)
    gguf, manifest = beyond.ensure_model(spec, args.cache_dir)
    torch.set_num_threads(args.threads)
    timeline = Timeline()
    timeline.watch(ExpertStore, PackFile)
    flags = [str(manifest), "--device", "cpu", "--threads", str(args.threads), "--direct-io"]
    return gguf, real.bytes_per_token(gguf, spec)[2], flags, timeline


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf, expert_bytes, flags, timeline = watched_slice(args)
    from k3stream.commands.flags import add_model_arguments, runtime_from_args
    from k3stream.engine.generate import prefill_last

    ram_mib = args.fraction * expert_bytes / MIB
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    runtime = runtime_from_args(parser.parse_args([*flags, "--ram-mib", f"{ram_mib:.1f}"]))
    model, store = runtime.model, runtime.store
    prompt = beyond.bench_prompt(gguf, 16)
    try:
        state = model.new_state()
        token = int(prefill_last(model, state, prompt).argmax())
        store.end_token(len(prompt))
        for _ in range(args.decode_tokens):
            token = int(model.decode(state, token).argmax())
            store.end_token(1)
        print(f"{args.fraction:.0%} of the experts ({ram_mib:.0f} MiB), {args.threads} threads")
        for repeat in range(args.repeats):
            state, before = model.new_state(), store.stats()
            timeline.start()
            token = int(prefill_last(model, state, prompt).argmax())
            store.end_token(len(prompt))
            elapsed = timeline.now_ms()
            timeline.stop()
            after = store.stats()
            read = (after["pack_read_bytes"] - before["pack_read_bytes"]) / 1e6
            wait = (after["fetch_ns"] - before["fetch_ns"]) / 1e6
            print(
                f"warm prefill {repeat + 1}: {elapsed:.0f} ms, {read:.0f} MB read, fetch wait {wait:.0f} ms"
            )
            for at, kind, layer, row in timeline.calls:
                print(f"   {at:7.1f} ms {kind:<10} layer {layer}: " + " / ".join(str(part) for part in row))
            print("\n".join(timeline.disk_lines()))
            token = int(model.decode(state, token).argmax())
            store.end_token(1)
    finally:
        runtime.close()
    print("hint rows: experts named / not in the tier / kept for the step / layer active / allowance")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
