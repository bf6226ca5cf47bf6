"""Where streamed decode loses the overlap of reads and compute: a per-token timeline on a slice.

    python benchmarks/bench_stream_timeline.py [--layers 3] [--experts 128] [--fractions 0.1,0.25]

For each fraction f of the real-dimension slice's routed experts (`bench_real.py`'s slice and memory
cgroup: the non-expert bytes + f x the expert bytes + --slack, page cache dropped, `--ram-mib` f x the
experts), one child prefills the 16-token prompt and decodes --decode-tokens tokens on the eager path
(as `bench_real --score-hints`: every hint kind scored), timing the store's calls and every pack read
range (issued, landed, the reads in flight then), each layer's attention, each MoE layer's routing,
shared experts and routed experts (fetched and computed). Per token, averaged over the tokens after the
first, it prints:

- each phase of the token (from its start to the first MoE layer's attention, each MoE layer's start ->
  its router -> its routed experts' end, the gaps between) with the time the disk read nothing in it;
- per MoE layer at its router: the step's experts resident, being read (a hint's), missing; the time
  from the router to the last read landing and the share of it the disk was busy; how long the step's
  first read waited to start;
- the fetch wait, the bytes read, the reads in flight on average, the CPU time (user / system);
- the time the disk was busy (at least one read running) and idle, and its read rate while busy.

The store's read rate (`bench_real.store_read_rate`) is measured first, and each fraction prints its
reads at that rate and the ratio of its decode to max(that, the decode's own compute: ms less fetch wait).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import bench_beyond_ram as beyond
import bench_real as real
from k3stream.memlimit import MIB, parse_size
from k3stream.testing.slices import like

CHILD = """
import argparse, json, os, sys, threading, time
job = json.loads(sys.argv[1])
from k3stream.cli import calm_openmp
calm_openmp()
import torch
from k3stream.commands.flags import add_model_arguments, runtime_from_args
from k3stream.engine.generate import prefill_last
from k3stream.model.moe import LatentMoE
from k3stream.store import expert_store, loading, pack_io
events, in_flight, counting = [], [0], threading.Lock()
start = time.perf_counter()
def now():
    return (time.perf_counter() - start) * 1e3
def timed(owner, name, kind, layer_of):
    inner = getattr(owner, name)
    def wrapper(self, *args, **kwargs):
        began = now()
        out = inner(self, *args, **kwargs)
        events.append((kind, layer_of(self, args), began, now(), None))
        return out
    setattr(owner, name, wrapper)
timed(LatentMoE, "_routed_sum", "routed", lambda self, args: self.layer)
timed(expert_store.ExpertStore, "fetch", "fetch", lambda self, args: args[0])
timed(loading.Loader, "start", "queue", lambda self, args: None)  # a step's read-ahead queueing its reads
ask = expert_store.ExpertStore.read_ahead
def read_ahead(self, layer, experts):
    experts = list(experts)
    with self._lock:
        held = sum((layer, e) in self._compute.buffers for e in experts)
        loading = sum((layer, e) in self._compute.loading for e in experts)
    events.append(("route", layer, now(), now(), (len(experts), held, loading)))
    ask(self, layer, experts)
expert_store.ExpertStore.read_ahead = read_ahead
read_range = pack_io.PackFile._read_range
def timed_range(self, request, begin, length):
    with counting:
        in_flight[0] += 1
        depth = in_flight[0]
    began = now()
    try:
        return read_range(self, request, begin, length)
    finally:
        with counting:
            in_flight[0] -= 1
        events.append(("range", request.label, began, now(), depth))
pack_io.PackFile._read_range = timed_range
parser = argparse.ArgumentParser()
add_model_arguments(parser)
args = parser.parse_args(job["argv"])
torch.set_num_threads(job["threads"])
runtime = runtime_from_args(args)
model, store = runtime.model, runtime.store
model.score_all_hints = True  # bench_real --score-hints' decode path: the eager forward
for layer in model.layers:
    if isinstance(layer.ffn, LatentMoE) and layer.ffn.w.shared is not None:
        shared = layer.ffn.w.shared
        class Shared:
            def __init__(self, inner, index):
                self.inner, self.index = inner, index
            def __call__(self, h):
                began = now()
                out = self.inner(h)
                events.append(("shared", self.index, began, now(), None))
                return out
        layer.ffn.w.shared = Shared(shared, layer.index)
    attend = layer.attn.decode
    def attention(h, states, attend=attend, index=layer.index):
        began = now()
        out = attend(h, states)
        events.append(("attn", index, began, now(), None))
        return out
    layer.attn.decode = attention
state = model.new_state()
token = int(prefill_last(model, state, job["prompt"]).argmax())
store.end_token(len(job["prompt"]))
events.clear()
before, cpu_before = store.stats(), os.times()
for _ in range(job["decode_tokens"]):
    began = now()
    token = int(model.decode(state, token).argmax())
    store.end_token(1)
    events.append(("token", None, began, now(), None))
after, cpu_after = store.stats(), os.times()
runtime.close()
print(json.dumps({"events": events, "read_bytes": after["pack_read_bytes"] - before["pack_read_bytes"],
                  "fetch_ms": (after["fetch_ns"] - before["fetch_ns"]) / 1e6,
                  "cpu": [cpu_after.user - cpu_before.user, cpu_after.system - cpu_before.system],
                  "counts": {name: after[name] - before[name] for name in (
                      "prefetch_loads", "prefetch_hits", "prefetch_unused_evictions")}}))
"""


def busy_ms(ranges: list[tuple[float, float]], begin: float, end: float) -> float:
    """How long at least one of the read `ranges` (sorted (start, end) ms) ran within [begin, end]."""
    total, run = 0.0, None
    for start, stop in ranges:
        start, stop = max(start, begin), min(stop, end)
        if stop <= start:
            continue
        if run is None or start > run[1]:
            total += 0.0 if run is None else run[1] - run[0]
            run = [start, stop]
        else:
            run[1] = max(run[1], stop)
    return total + (0.0 if run is None else run[1] - run[0])


def token_phases(events: list, begin: float, end: float, ranges: list) -> list[tuple[str, float, float]]:
    """(phase, ms, ms the disk read nothing) of one token: its start, each MoE layer's attention start,
    router and routed experts' end, its end."""
    inside = [event for event in events if begin <= event[3] <= end]
    moe = sorted({event[1] for event in inside if event[0] == "route"})
    marks = [("token start", begin)]
    for layer in moe:
        first = {
            kind: next(e for e in inside if e[0] == kind and e[1] == layer) for kind in ("attn", "route")
        }
        routed = next(e for e in inside if e[0] == "routed" and e[1] == layer)
        marks += [(f"L{layer} start", first["attn"][2]), (f"L{layer} router", first["route"][2])]
        marks.append((f"L{layer} end", routed[3]))
    marks.append(("token end", end))
    return [
        (f"{a} -> {b}", stop - start, stop - start - busy_ms(ranges, start, stop))
        for (a, start), (b, stop) in zip(marks, marks[1:], strict=False)
    ]


def step_rows(events: list, begin: float, end: float, ranges: list) -> list[tuple[int, bool, tuple]]:
    """Per read-ahead call of one token's MoE layers: (layer, whether the call is the layer's router's
    (else a slide of its step's window), ((resident, reading, missing) at it, ms from it to the last read
    landing, the disk's busy share of that, ms its first read waited, ms until it had queued its reads))."""
    inside = [event for event in events if begin <= event[3] <= end]
    rows, routed_layers = [], set()
    for route in (e for e in inside if e[0] == "route"):
        asked, held, loading = route[4]
        layer = route[1]
        router = layer not in routed_layers
        routed_layers.add(layer)
        routed = next(e for e in inside if e[0] == "routed" and e[1] == layer and e[3] >= route[2])
        reads = [(e[2], e[3]) for e in inside if e[0] == "range" and route[2] <= e[2] <= routed[3]]
        last = max((stop for _, stop in reads), default=route[2])
        window = last - route[2]
        share = busy_ms(ranges, route[2], last) / window if window > 0 else 1.0
        first = min((start for start, _ in reads), default=route[2]) - route[2]
        queued = min(
            (e[3] for e in inside if e[0] == "queue" and route[2] <= e[2] <= routed[3]), default=route[2]
        )
        rows.append(
            (layer, router, (held, loading, asked - held - loading, window, share, first, queued - route[2]))
        )
    return rows


Spans = list[tuple[float, float]]


def disk_per_token(ranges: Spans, spans: Spans) -> tuple[float, float]:
    """The mean ms a token the disk was busy (at least one read running) and idle, over the token
    `spans` ((start, end) ms)."""
    busy = statistics.mean(busy_ms(ranges, start, stop) for start, stop in spans)
    return busy, statistics.mean(stop - start for start, stop in spans) - busy


def report(name: str, result: dict[str, Any], tokens: int, rate: float) -> list[str]:
    events = [tuple(event) for event in result["events"]]
    ranges = sorted((e[2], e[3]) for e in events if e[0] == "range")
    spans = [(e[2], e[3]) for e in events if e[0] == "token"][1:]  # the first: warm-up of the path
    ms = statistics.mean(stop - start for start, stop in spans)
    read_ms = 1e3 * result["read_bytes"] / tokens / rate
    compute = ms - result["fetch_ms"] / tokens
    busy, idle = disk_per_token(ranges, spans)
    read_mb = result["read_bytes"] / tokens / 1e6
    lines = [
        f"{name}: {ms:.0f} ms/token, fetch wait {result['fetch_ms'] / tokens:.1f}, read "
        f"{read_mb:.0f} MB/token = {read_ms:.0f} ms at {rate / 1e9:.2f} GB/s; "
        f"max(compute, reads) / measured {max(compute, read_ms) / ms:.2f}; reads in flight "
        f"{statistics.mean(e[4] for e in events if e[0] == 'range'):.1f}; CPU user / system "
        f"{1e3 * result['cpu'][0] / tokens:.0f} / {1e3 * result['cpu'][1] / tokens:.0f} ms/token",
        f"  disk busy {busy:.0f} ms a token, idle {idle:.0f} ms; {read_mb / busy:.2f} GB/s while busy",
        "  a token: " + ", ".join(f"{name} {count / tokens:.1f}" for name, count in result["counts"].items()),
        "  | phase | ms | disk idle ms |",
        "  |---|---|---|",
    ]
    phases: dict[str, list[tuple[float, float]]] = {}
    steps: dict[tuple[int, bool], list[tuple]] = {}
    for start, stop in spans:
        for phase, length, idle in token_phases(events, start, stop, ranges):
            phases.setdefault(phase, []).append((length, idle))
        for layer, router, row in step_rows(events, start, stop, ranges):
            steps.setdefault((layer, router), []).append(row)
    for phase, rows in phases.items():
        lines.append(f"  | {phase} | {_mean(rows, 0):.1f} | {_mean(rows, 1):.1f} |")
    for (layer, router), rows in sorted(steps.items(), key=lambda item: (item[0][0], not item[0][1])):
        where = "at its router" if router else "at its window's slides (mean of each)"
        lines.append(
            f"  L{layer} {where}: {_mean(rows, 0):.1f} resident, {_mean(rows, 1):.1f} being read, "
            f"{_mean(rows, 2):.1f} missing; last read lands {_mean(rows, 3):.1f} ms after it, the disk "
            f"busy {_mean(rows, 4):.0%} of that; the first read starts {_mean(rows, 5):.1f} ms after it "
            f"(its reads queued {_mean(rows, 6):.1f} ms after it)"
        )
    return lines


def _mean(rows: list[tuple], at: int) -> float:
    return statistics.mean(row[at] for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3, help="slice layers (default %(default)s)")
    parser.add_argument("--experts", type=int, default=128, help="routed experts (default %(default)s)")
    parser.add_argument("--fractions", default="0.1,0.25", help="expert fractions that fit (%(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="default %(default)s")
    parser.add_argument("--slack", default="1.5GiB", help="cgroup room above weights + experts (%(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=real.DEFAULT_CACHE, help="default %(default)s")
    parser.add_argument("--threads", type=int, default=2, help="default %(default)s")
    parser.add_argument("--k3stream-args", default="", help="extra k3stream flags")
    args = parser.parse_args(argv)
    spec = like("kimi-k3", args.layers, n_experts=args.experts)
    gguf, manifest = beyond.ensure_model(spec, args.cache_dir)
    files = beyond.model_files(gguf, manifest)
    _, _, expert_bytes = real.bytes_per_token(gguf, spec)
    rate = real.store_read_rate(manifest, spec.top_k, min(files[1].stat().st_size, 2 << 30))
    prompt = beyond.bench_prompt(gguf, 16)
    for fraction in (float(part) for part in args.fractions.split(",") if part.strip()):
        ram = int(fraction * expert_bytes)
        limit = gguf.stat().st_size - expert_bytes + ram + parse_size(args.slack)
        argv = [
            str(manifest),
            "--device",
            "cpu",
            "--threads",
            str(args.threads),
            "--ram-mib",
            str(ram // MIB),
        ]
        job = {
            "argv": argv + args.k3stream_args.split(),
            "threads": args.threads,
            "prompt": prompt,
            "decode_tokens": args.decode_tokens,
        }
        result = beyond.run_child("timeline", CHILD, job, limit, files)
        name = f"{fraction:.0%} of experts"
        if "error" in result:
            print(f"{name}: {result['error']}")
            continue
        print("\n".join(report(name, result, args.decode_tokens, rate)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
