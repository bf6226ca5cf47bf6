"""k3stream against llama.cpp on a real-dimension Kimi-K3 slice, resident and in memory cgroups.

    python benchmarks/bench_real.py [--layers 3] [--experts 128] [--fractions 0.1,0.25,0.5] [--cache-dir DIR]

Writes (or reuses) `make-tiny --like kimi-k3` for --layers layers with --experts routed experts (every
matrix at its real shape, non-expert matrices Q8_0, experts Q2_K/Q3_K), packs it, and measures in one run:

- the machine's bounds: the disk's best rate for the store's reads: the pack read as a streamed decode
  reads it (`store_read_rate`: a layer's top-k objects a request, the layers in turn, the next request
  queued while one lands, the store's reader threads and splits, O_DIRECT into buffers made ahead,
  page cache dropped) before and after the runs, and each streamed run's own reads while the disk was
  busy (`busy_rate`: the block device's bytes read over its busy time around the prefill and the
  decode), the best of them all (one stream's sequential rate beside it); the RAM read rate (the
  fastest of `ram_read_rates`' passes in the resident k3stream process right before and after its
  per-kind profile: the same process, threads and OpenMP runtime as the kernels it bounds);
- resident: both contenders with every file in the page cache and no memory limit (k3stream's expert
  budget holds every expert), each warmed up by the measured prompt and decode steps themselves (the
  same greedy tokens), so neither meets a weight first in the measured run;
- streamed: for each fraction f, both in a child memory cgroup of (non-expert bytes + f x expert bytes +
  --slack), page cache dropped, k3stream's expert budget f x expert bytes (`--ram-mib`).

Per run: prefill and decode tok/s of both, each decode step's ms (median, fastest, slowest: the ratio
of the medians beside the tok/s), and for k3stream the decode ms per token, pack bytes read
per token, RAM hit rate, fetch wait, and the bound max(resident decode ms, read bytes / the disk's best
rate), its bytes those the run read (hint reads no step used included: a wrong hint raises the bound
with the time it costs), and resident + the reads of experts no hint sent predicted.
k3stream decodes as `generate` does (its decode program, the hints it sends logged and scored); with
`--score-hints` the streamed runs predict and score every kind of expert hint, on the eager forward.
Per run and phase (cold prefill, prefill again, decode), how k3stream's pack reads ran (`read_lines`):
ranges read, their size, those off 4 KiB, the ranges in flight while the disk had one (beside the
best-rate reads' own), the reader threads' and the digest checks' CPU per token, read-ahead calls per
MoE step. Per layer kind (KDA, MLA, dense FFN, MoE routed and shared; each run's decode path): ms per
token, weight bytes read per token, and for the resident run that time (its C mat-vec calls apart, with
the rate they take the weight bytes at) against bytes / RAM rate, and against the larger of that and
the bytes at the kernels' rate on weights in the last-level cache (`kernel_rates`, measured at the
start: the compute the products take when no read waits). Last,
the real model's 93 layers as ARITHMETIC: measured per-layer costs times the real layer counts.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import bench_beyond_ram as beyond
from k3stream.engine.bench import sequential_read
from k3stream.engine.layer_profile import RAM_PASS_BYTES, RAM_PASSES, ram_read_rates
from k3stream.memlimit import MIB, format_size
from k3stream.testing.cgroups import ChildCgroup, drop_page_cache
from k3stream.testing.slices import like

KINDS = ("KDA attention", "MLA attention", "dense FFN", "MoE routed", "MoE shared")
HEAD_BYTES = 163840 * 7168 // 32 * 34  # the real output head in Q8_0
REAL_LAYERS = {"KDA attention": 69, "MLA attention": 24, "dense FFN": 1, "MoE routed": 92, "MoE shared": 92}
DEFAULT_CACHE = Path("/tmp/slice-bench")
KERNEL_PASSES = 40  # `kernel_rates`: passes over each type's cached rows, the fastest taken


# ---- what each layer kind reads --------------------------------------------------------------------


def _kind(name: str, mla: set[int], n_dense: int) -> str | None:
    """The layer kind a tensor's bytes belong to (None: not in a layer)."""
    found = re.match(r"blk\.(\d+)\.(.*)", name)
    if found is None:
        return None
    layer, rest = int(found.group(1)), found.group(2)
    if rest.startswith(("attn_norm.", "ffn_norm.", "attn_res_score.", "ffn_res_score.")):
        return None
    if rest.startswith(("attn_", "ssm_")):
        return "MLA attention" if layer in mla else "KDA attention"
    if rest.startswith(("ffn_", "exp_probs_b.")):
        if layer < n_dense:
            return "dense FFN"
        return "MoE shared" if "_shexp" in rest else "MoE routed"
    return None


def bytes_per_token(gguf: Path, spec) -> tuple[dict[str, dict[int, float]], dict[str, int], int]:
    """Weight bytes one decode token reads per layer of each kind (routed experts: top-k of them), by
    GGML type, the slice's layer count per kind, and the routed experts' total bytes."""
    from gguf import GGUFReader

    mla = set(spec.mla_layer_ids())
    totals: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    experts = 0
    for tensor in GGUFReader(gguf).tensors:
        kind = _kind(tensor.name, mla, spec.n_dense)
        if kind is None:
            continue
        size = int(tensor.n_bytes)
        if "_exps." in tensor.name:
            experts += size
            size = size * spec.top_k / spec.n_experts
        ggml_type = int(tensor.tensor_type)
        totals[kind][ggml_type] = totals[kind].get(ggml_type, 0.0) + size
    moe = spec.n_layers - spec.n_dense
    counts = {
        "KDA attention": spec.n_layers - len(mla),
        "MLA attention": len(mla),
        "dense FFN": spec.n_dense,
        "MoE routed": moe,
        "MoE shared": moe,
    }
    per_layer = {
        kind: {ggml_type: size / counts[kind] for ggml_type, size in totals[kind].items()} for kind in KINDS
    }
    return per_layer, counts, experts


def kernel_rates(gguf: Path, threads: int, q8_activations: bool, nbytes: int = 2 << 20) -> dict[int, float]:
    """The decode mat-vec's rate on weights in cache, weight bytes per second, for each quantized GGML
    type of the layers' matrices (the first rows, about `nbytes`, of its largest tensor, one input row):
    one thread's fastest of KERNEL_PASSES times `threads` (the cores scaling perfectly: on a shared
    machine a second thread's pass waits for a core, and the bound is the best the cores allow). What
    the kernels compute at when no read waits: the products' compute bound beside the RAM's (F32 has
    none here)."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    from k3stream.quant.kernels import cpu

    largest: dict[int, Any] = {}
    for tensor in GGUFReader(gguf).tensors:
        ggml_type = int(tensor.tensor_type)
        matrix = tensor.name.startswith("blk.") and ggml_type != 0 and len(tensor.shape) >= 2
        if matrix and tensor.n_bytes > getattr(largest.get(ggml_type), "n_bytes", 0):
            largest[ggml_type] = tensor
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    try:
        for ggml_type, tensor in sorted(largest.items()):
            in_features = int(tensor.shape[0])
            row_bytes = int(tensor.n_bytes) // (int(tensor.n_elements) // in_features)
            rows = max(1, min(int(tensor.n_elements) // in_features, nbytes // row_bytes))
            matrix = torch.from_numpy(np.array(np.asarray(tensor.data).reshape(-1)[: rows * row_bytes]))
            x, one = torch.randn(1, in_features), torch.zeros(1, dtype=torch.int64)
            starts = torch.tensor([0, 1])
            seconds = []
            for _ in range(KERNEL_PASSES):
                started = time.perf_counter()
                cpu.grouped_product(x, [matrix], ggml_type, rows, row_bytes, starts, one, q8_activations)
                seconds.append(time.perf_counter() - started)
            rates[ggml_type] = threads * matrix.numel() / min(seconds)
    finally:
        torch.set_num_threads(previous)
    return rates


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def compute_bound_ms(type_bytes: dict[int, float], rates: dict[int, float]) -> float:
    """ms for one layer's bytes (by GGML type) at the kernels' in-cache rates (types with no rate: 0)."""
    return 1e3 * sum(size / rates[ggml_type] for ggml_type, size in type_bytes.items() if ggml_type in rates)


def disk_read_rate(path: Path, limit: int) -> float:
    """One stream's sequential read rate, page cache dropped (bytes per second)."""
    drop_page_cache(path)
    return sequential_read(path, limit)["gb_per_s"] * 1e9


def decode_reads(layers: list[int], experts: int, batch: int, steps: int, seed: int) -> list[list[tuple]]:
    """`steps` requests as a streamed decode makes them: the MoE layers in turn, each request `batch`
    distinct experts of one layer (a token's top-k there), drawn at random (a token's misses lie
    anywhere in its layer)."""
    import random

    draw = random.Random(seed)
    return [
        [(layers[step % len(layers)], expert) for expert in draw.sample(range(experts), batch)]
        for step in range(steps)
    ]


def store_read_rate(
    manifest: Path, batch: int, limit: int, seed: int = 0, depths: list | None = None
) -> float:
    """The pack's read rate the way the expert store reads it under a memory limit (bytes per second):
    whole objects, each request a layer's `batch` experts, the layers in turn (`decode_reads`), with
    the store's reader threads and splits (`StoreOptions`, `ExpertStore` defaults), O_DIRECT into
    recycled buffers, page cache dropped, at most `limit` bytes; each request queued while the one
    before it is read (as a decode's read-ahead and hints queue the next layer's), so the readers
    never wait for a request: the best the store's reads get from the disk."""
    import inspect

    from k3stream.engine.loading import StoreOptions
    from k3stream.pack.reader import ExpertPack
    from k3stream.store.expert_store import ExpertStore
    from k3stream.store.pack_io import PackFile, ReadRequest
    from k3stream.store.reader import RecycledBuffers

    splits = inspect.signature(ExpertStore).parameters["read_splits"].default
    with ExpertPack(manifest) as pack:
        steps = max(1, limit // (batch * pack.object_bytes))
        reads = decode_reads(sorted(pack.moe_layers), pack.num_experts, batch, steps, seed)
        file = PackFile(pack.path, io_threads=StoreOptions().io_threads, read_splits=splits, direct_io=True)
        buffers = RecycledBuffers(pack.object_bytes, 2 * batch)
        while buffers.prefault_one(2 * batch):  # made ahead, as the store makes its tier's
            pass
        try:
            drop_page_cache(pack.path)
            nbytes, started, landing = 0, time.perf_counter(), None
            for keys in reads:
                ranges = [pack.object_range(*key) for key in keys]
                taken = [buffers.take(size) for _, size in ranges]  # back once its view is dropped
                requests = [
                    ReadRequest(f"{key}", offset, size, buffer)
                    for key, (offset, size), (buffer, _) in zip(keys, ranges, taken, strict=True)
                ]
                nbytes += sum(size for _, size in ranges)
                queued = (file.start(requests, priority=1), taken)
                if landing is not None:
                    _finish(*landing)
                landing = queued
            _finish(*landing)
            seconds = time.perf_counter() - started
        finally:
            file.close()
    if depths is not None:  # the mean number of ranges in flight while some was
        counts = file.snapshot()
        depths.append(counts["pack_depth_ns"] / max(counts["pack_busy_ns"], 1))
    return nbytes / seconds


def _finish(reads, taken: list) -> None:
    """Wait for `reads` to land; then the buffers and views they were `taken` with may go."""
    for _ in reads:
        pass


def busy_rate(phase: dict) -> float | None:
    """The disk's read rate while busy in a run's phase (bytes the device read / the time it had a
    request in flight, from its `stat` file around the phase): the store's own reads, at their own
    queue depth and pattern. None below 64 MiB read (a few ms of busy time, too coarse to rate)."""
    disk = phase.get("disk")
    if not disk or not disk["busy_ms"] or disk["bytes"] < 64 * MIB:
        return None
    return disk["bytes"] / disk["busy_ms"] * 1e3


def busy_read_rates(results: list[dict]) -> list[float]:
    """`busy_rate` of each run's prefill and decode where it has one."""
    phases = (result["k3"].get("phases", {}) for result in results)
    rates = (busy_rate(phase.get(name, {})) for phase in phases for name in ("prefill", "decode"))
    return [rate for rate in rates if rate is not None]


# ---- the runs ---------------------------------------------------------------------------------------


def run_pair(
    name: str, gguf: Path, manifest: Path, prompt: list[int], args, limit: int, ram: int, files
) -> dict:
    """Both contenders under `limit` (files' page cache dropped first unless `files` is empty)."""
    run_args = copy.copy(args)
    run_args.limit_bytes = limit
    # resident: the warm-up decodes the measured run's tokens too, so both read every weight from RAM
    run_args.warm_decode = name == "resident"
    run_args.ram_rates = name == "resident"  # the RAM rate around the profile (room for its buffer)
    # the decode `generate` runs; with --score-hints a streamed run predicts and scores every kind of hint
    # (`hint_lines`), on the eager forward (every expert in RAM, the resident run has none to score)
    run_args.score_hints = args.score_hints and name != "resident"
    run_args.k3stream_args = ["--ram-mib", str(max(1, ram // MIB)), *args.k3stream_args]
    results: dict[str, Any] = {"name": name, "limit": limit, "ram": ram}
    print(f"{name}: limit {format_size(limit)}, expert budget {format_size(ram)} ...", flush=True)
    skipped = {"error": "skipped (--k3stream-only)"}
    results["llama"] = skipped if args.k3stream_only else beyond.run_llama(gguf, prompt, run_args, files)
    results["k3"] = beyond.run_k3stream(manifest, prompt, run_args, files)
    for who in ("llama", "k3"):
        if "error" in results[who] and results[who] is not skipped:
            print(f"  {who} failed: {results[who]['error']}", flush=True)
    return results


def summary(result: dict, prompt: int, decode: int) -> dict[str, Any]:
    row: dict[str, Any] = {"name": result["name"], "prompt": prompt}
    if "error" not in result["llama"]:
        llama = beyond.summarize_llama(result["llama"], prompt, decode)
        row.update(llama_prefill=llama["prefill_tok_s"], llama_decode=llama["decode_tok_s"])
        row["llama_token_s"] = result["llama"].get("token_s")
        row["llama_read"] = llama["decode_read_per_token"]
    if "error" not in result["k3"]:
        k3 = beyond.summarize_k3stream(result["k3"])
        row.update(
            k3_prefill=k3["prefill_tok_s"], k3_decode=k3["decode_tok_s"], k3_read=k3["decode_read_per_token"]
        )
        row.update(hit=k3["decode_hit_rate"], fetch_ms=k3["decode_fetch_ms_per_token"])
        row["k3_token_s"] = result["k3"].get("token_s")
        row["decode_busy_rate"] = busy_rate(result["k3"]["phases"]["decode"])
        row["budget"] = k3["ram_budget_bytes"]
        row["hints"] = result["k3"]["phases"]["decode"]["hints"]
        row["recall"] = row["hints"]["sent"]["recall"]  # of all the kinds sent
        io, phases = result["k3"]["io"], result["k3"]["phases"]
        row["prefill_read"] = io["prefill"] - io["warmup"]
        row["cold_ms"] = 1e3 * phases["cold"]["seconds"]
        row["cold_cpu"] = phases["cold"]["cpu_s"]
        row["cold_buffers"] = phases["cold"].get("buffers"), phases["cold"].get("buffers_ahead")
        row["cold_wait_ms"] = phases["cold"]["fetch_wait_ms_per_token"] * phases["cold"]["tokens"]
        row["cold_read"] = io["cold"] - io["load"]
        row["reads"] = {name: phases[name].get("reads") for name in ("cold", "prefill", "decode")}
        row["read_bytes"] = {name: phases[name]["pack_read_bytes"] for name in ("cold", "prefill", "decode")}
        row["decode_tokens"] = phases["decode"]["tokens"]
        row["profile"] = result["k3"].get("profile", {}).get("ms_per_token")
        row["profile_path"] = result["k3"].get("profile", {}).get("path")
        row["kernels"] = result["k3"].get("profile", {}).get("kernel_ms_per_token")
        row["ram_rates"] = result["k3"].get("profile", {}).get("ram_rates")
    return row


# ---- the report -------------------------------------------------------------------------------------


def _f(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _mb(value: float | None) -> str:
    return _f(None if value is None else value / 1e6, ".0f")


def run_table(rows: list[dict], resident_ms: float | None, disk_rate: float) -> list[str]:
    """One line per run; `disk_rate`: the disk's best rate for the store's reads (`store_read_rate`
    and the runs' own reads while the disk was busy, `busy_read_rates`)."""
    head = (
        "| run | llama.cpp prefill tok/s | k3stream prefill tok/s | llama.cpp decode tok/s | k3stream decode "
        "tok/s | k3/llama decode | k3stream decode ms/token | disk read/token MB (llama / k3) | RAM hit "
        "rate | fetch wait ms/token | disk GB/s while busy in the decode | read ms/token (bytes / the "
        "disk's best rate) | bound ms/token | bound / measured | resident + unpredicted reads ms/token | "
        "that / measured |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        k3_ms = 1e3 / row["k3_decode"] if row.get("k3_decode") else None
        read_ms = 1e3 * row["k3_read"] / disk_rate if row.get("k3_read") is not None else None
        bound = max(resident_ms or 0.0, read_ms or 0.0) if resident_ms else None
        ratio = bound / k3_ms if bound and k3_ms else None
        # the reads no decode prediction asked for cannot overlap compute: resident + their share
        recall = row.get("recall")
        serial = None
        if resident_ms and read_ms and recall is not None:
            serial = resident_ms + (1 - recall) * read_ms
        speedup = (
            row["k3_decode"] / row["llama_decode"]
            if row.get("k3_decode") and row.get("llama_decode")
            else None
        )
        reads = f"{_mb(row.get('llama_read'))} / {_mb(row.get('k3_read'))}"
        cells = [
            row["name"],
            _f(row.get("llama_prefill"), ".2f"),
            _f(row.get("k3_prefill"), ".2f"),
            _f(row.get("llama_decode"), ".2f"),
            _f(row.get("k3_decode"), ".2f"),
            _times(speedup),
            _f(k3_ms, ".0f"),
            reads,
            _f(row.get("hit"), ".1%"),
            _f(row.get("fetch_ms"), ".1f"),
            _f(row.get("decode_busy_rate") and row["decode_busy_rate"] / 1e9, ".2f"),
            _f(read_ms, ".1f"),
            _f(bound, ".0f"),
            _f(ratio, ".2f"),
            _f(serial, ".0f"),
            _f(serial and k3_ms and serial / k3_ms, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def spread(seconds: list[float] | None) -> tuple[float, float, float] | None:
    """The median, fastest and slowest of decode steps' seconds, in ms (None: no steps)."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    return 1e3 * statistics.median(ordered), 1e3 * ordered[0], 1e3 * ordered[-1]


def decode_step_lines(rows: list[dict]) -> list[str]:
    """Per run, both contenders' decode ms per step as median [fastest-slowest] (one slow step, another
    job's burst on a shared machine, moves the median little), and k3stream / llama.cpp by the medians."""
    lines = []
    for row in rows:
        llama, k3 = spread(row.get("llama_token_s")), spread(row.get("k3_token_s"))
        if llama is None and k3 is None:
            continue
        cells = [
            f"{who} {'n/a' if steps is None else '{:.1f} [{:.1f}-{:.1f}]'.format(*steps)}"
            for who, steps in (("llama.cpp", llama), ("k3stream", k3))
        ]
        ratio = _times(llama[0] / k3[0] if llama and k3 else None)
        steps = len(row.get("k3_token_s") or row.get("llama_token_s"))
        lines.append(f"  {row['name']}: {', '.join(cells)} ms a step of {steps}; k3stream/llama.cpp {ratio}")
    return lines


def prefill_table(rows: list[dict], disk_rate: float) -> list[str]:
    """k3stream's prefill of the prompt, cold (the first after the load) and again (a fresh sequence
    after one decode step), against max(the resident prefill's ms, its reads / the disk's best rate);
    the cold one's CPU seconds, minor page faults, read buffers (made ahead when it started, and made
    during it: by its reads, or ahead by the store's prefault thread) and the time its fetches waited."""
    resident = next((row for row in rows if row["name"] == "resident" and row.get("k3_prefill")), None)
    compute_ms = 1e3 * resident["prompt"] / resident["k3_prefill"] if resident else None
    lines = [
        "| run | cold prefill ms | cold CPU s, user / system | cold minor faults | read buffers made ahead "
        "at its start / during it, ahead / by its reads | cold fetch wait ms | cold read MB | cold bound "
        "ms | cold bound / measured | prefill ms | prefill read MB | prefill bound ms | prefill bound / "
        "measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.get("k3_prefill"):
            continue
        again_ms = 1e3 * row["prompt"] / row["k3_prefill"]
        cpu = row["cold_cpu"]
        cells = [row["name"]]
        for ms, read in ((row["cold_ms"], row["cold_read"]), (again_ms, row["prefill_read"])):
            bound = max(compute_ms, 1e3 * read / disk_rate) if compute_ms else None
            cells += [_f(ms, ".0f"), _mb(read), _f(bound, ".0f"), _f(bound and bound / ms, ".2f")]
        # beside the cold prefill's ms: its CPU, the pages it touched first, the read buffers made
        cells[2:2] = [f"{cpu['user']:.2f} / {cpu['system']:.2f}", _f(cpu.get("minor_faults"), "d")]
        made, ahead = row["cold_buffers"]
        cells.insert(4, f"{ahead} / {made['buffers_prefaulted']}, {made['buffers_made']}" if made else "n/a")
        cells.insert(5, _f(row["cold_wait_ms"], ".0f"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def read_lines(rows: list[dict], moe_layers: int) -> list[str]:
    """Per streamed run and phase, how its pack reads ran: ranges, their size, those off 4 KiB, the
    mean ranges in flight while the disk had one, the readers' and the digest checks' CPU per token,
    and the read-ahead calls per MoE layer step."""
    lines = []
    for row in rows:
        for phase, reads in (row.get("reads") or {}).items():
            if not reads or not reads["pack_ranges"]:
                continue
            tokens = row["prompt"] if phase != "decode" else row["decode_tokens"]
            steps = moe_layers * (1 if phase != "decode" else tokens)
            depth = reads["pack_depth_ns"] / max(reads["pack_busy_ns"], 1)
            per_token = {key: reads[key] / 1e6 / tokens for key in reads if key.endswith("_ns")}
            lines.append(
                f"  {row['name']} {phase}: {reads['pack_ranges']} ranges of "
                f"{row['read_bytes'][phase] / reads['pack_ranges'] / 1024:.0f} KiB on average "
                f"({reads['pack_unaligned_ranges']} off 4 KiB), depth {depth:.2f} while busy "
                f"({reads['pack_busy_ns'] / 1e6:.0f} ms busy), CPU per token: readers "
                f"{per_token['pack_read_cpu_ns']:.1f} ms, digests {per_token['integrity_cpu_ns']:.1f} ms "
                f"({per_token['integrity_check_ns']:.1f} ms wall); read-ahead calls per MoE step "
                f"{reads['read_ahead_calls'] / steps:.1f} ({reads['read_ahead'] / steps:.1f} experts)"
            )
    return lines


def hint_lines(rows: list[dict]) -> list[str]:
    """Per run, how right each kind of decode prediction was (the sent kind and the others, scored)."""
    lines = []
    for row in rows:
        if row.get("hints"):
            kinds = ", ".join(
                f"{kind} {_f(counts['precision'], '.0%')} / {_f(counts['recall'], '.0%')}"
                for kind, counts in row["hints"].items()
            )
            lines.append(f"  {row['name']}: {kinds}")
    return lines


def kind_ram_rate(rows: list[dict], start_rates: list[float], threads: int) -> float:
    """The RAM read rate the per-kind bound takes, printed with its spread: the fastest pass of those
    the resident k3stream process measured right before and after its profile (`ram_read_rates`: the
    same process, thread count and OpenMP runtime as the profiled kernels, a buffer larger than any
    kind's bytes per token), else of those at the start. The fastest, not the median: the bound is what
    the RAM delivered at best; a shared VM's slow passes are others' load, not the bound."""
    resident = (row.get("ram_rates") for row in rows if row["name"] == "resident")
    rates = next((rates for rates in resident if rates), None)
    where = "the resident k3stream process, before and after its profile"
    if not rates:
        rates, where = start_rates, "this process at the start"
    ordered = sorted(rates)
    fastest, median, slowest = (ordered[at] / 1e9 for at in (-1, len(ordered) // 2, 0))
    print(
        f"RAM read rate: {len(rates)} passes of {RAM_PASS_BYTES >> 20} MiB on {threads} threads in {where} "
        f"({RAM_PASSES} a time): fastest {fastest:.1f}, median {median:.1f}, slowest {slowest:.1f} GB/s; "
        "the bound takes the fastest"
    )
    return ordered[-1]


def kind_table(
    rows: list[dict],
    per_token: dict[str, float],
    counts: dict[str, int],
    bounds: tuple[float, dict[str, float]],
) -> list[str]:
    """Per layer of each kind: ms per token in each profiled run; for the resident run its C mat-vec
    calls' share (kernel), the rest (other) and the weight bytes' rate through the calls, against the
    weight bytes at the RAM rate and against the larger of that and `bounds`' compute ms a layer (its
    bytes at the kernels' in-cache rates, `kernel_rates`); `bounds`: (RAM rate, compute ms by kind)."""
    ram_rate, compute_ms = bounds
    profiled = [row for row in rows if row.get("profile")]
    lines = [
        "| layer kind (per layer) | weight bytes/token MB | RAM bound ms | compute bound ms (kernels in "
        "cache) | "
        + " | ".join(f"{row['name']} ms" for row in profiled)
        + " | resident kernel ms | resident other ms | kernel GB/s | kernel / RAM bound | resident / RAM "
        "bound | resident / max(RAM, compute) bound |",
        "|---|---|---|---|" + "---|" * len(profiled) + "---|---|---|---|---|---|",
    ]
    resident = next((row for row in profiled if row["name"] == "resident"), None)
    for kind in KINDS:
        bound_ms = 1e3 * per_token[kind] / ram_rate
        cells = [_f(row["profile"][kind] / counts[kind], ".1f") for row in profiled]
        whole = kernel = None
        if resident is not None:
            whole = resident["profile"][kind] / counts[kind]
            kernel = resident["kernels"][kind] / counts[kind]
        other = None if whole is None else whole - kernel
        ratios = [_times(None if ms is None else ms / bound_ms) for ms in (kernel, whole)]
        ratios.append(_times(None if whole is None else whole / max(bound_ms, compute_ms[kind])))
        rate = None if not kernel else per_token[kind] / kernel / 1e6  # weight bytes / kernel time
        lines.append(
            f"| {kind} | {per_token[kind] / 1e6:.1f} | {bound_ms:.1f} | {compute_ms[kind]:.1f} | "
            + " | ".join([*cells, _f(kernel, ".1f"), _f(other, ".1f"), _f(rate, ".1f"), *ratios])
            + " |"
        )
    return lines


def real_model_arithmetic(
    rows: list[dict], counts: dict[str, int], per_token: dict[str, float], rates: tuple[float, float]
) -> list[str]:
    """The 93-layer model as measured per-layer ms times real layer counts (arithmetic, not a run)."""
    disk_rate, ram_rate = rates
    resident = next((row for row in rows if row["name"] == "resident" and row.get("profile")), None)
    if resident is None:
        return ["(no resident profile: no arithmetic)"]
    layer_ms = {kind: resident["profile"][kind] / counts[kind] for kind in KINDS}
    compute = sum(layer_ms[kind] * REAL_LAYERS[kind] for kind in KINDS)
    lines = [
        "ARITHMETIC, not a measurement: the real model's 93 layers = measured per-layer ms x layer counts "
        "(69 KDA, 24 MLA, 1 dense FFN, 92 MoE); the output head and the embedding are left out",
        f"  resident compute per token: {compute:.0f} ms ({1e3 / compute:.2f} tok/s)",
        f"  + the output head at the real vocabulary (163840 x 7168 Q8_0, 1.25 GB) at the RAM rate: "
        f">= {1e3 * HEAD_BYTES / ram_rate:.0f} ms",
    ]
    expert_bytes = per_token["routed experts"]  # the top-k expert objects of one MoE layer, no cache
    for row in rows:
        if row["name"] == "resident" or row.get("hit") is None:
            continue
        read = 92 * (1 - row["hit"]) * expert_bytes
        read_ms = 1e3 * read / disk_rate
        fetch = 92 * row["fetch_ms"] / counts["MoE routed"]
        lines.append(
            f"  {row['name']}: hit rate {row['hit']:.1%} -> {read / 1e9:.2f} GB read per token, "
            f"{read_ms:.0f} ms at {disk_rate / 1e9:.2f} GB/s; bound max(compute, reads) "
            f"{max(compute, read_ms):.0f} ms; compute + the slice's fetch wait per MoE layer x 92: "
            f"{compute + fetch:.0f} ms"
        )
    return lines


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3, help="slice layers (default %(default)s)")
    parser.add_argument(
        "--experts", type=int, default=128, help="routed experts per layer (default %(default)s)"
    )
    parser.add_argument("--fractions", default="0.1,0.25,0.5", help="expert fractions that fit (%(default)s)")
    parser.add_argument("--slack", default="1.5GiB", help="cgroup room above weights + experts (%(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="models (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="default %(default)s")
    parser.add_argument("--decode-tokens", type=int, default=8, help="default %(default)s")
    parser.add_argument(
        "--profile-tokens", type=int, default=4, help="profiled per-kind decode steps (%(default)s)"
    )
    parser.add_argument("--threads", type=int, default=2, help="default %(default)s")
    parser.add_argument("--no-resident", action="store_true", help="skip the resident run")
    parser.add_argument("--k3stream-only", action="store_true", help="skip llama.cpp (to iterate)")
    parser.add_argument(
        "--score-hints",
        action="store_true",
        help="streamed runs score every kind of expert hint (the eager forward), not only those sent",
    )
    parser.add_argument("--k3stream-args", default="", help="extra k3stream flags")
    args = parser.parse_args(argv)
    args.k3stream_args = args.k3stream_args.split()
    args.fraction_list = [float(part) for part in args.fractions.split(",") if part.strip()]
    from k3stream.memlimit import parse_size

    args.slack_bytes = parse_size(args.slack)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    probe = ChildCgroup.create(f"bench-probe-{os.getpid()}", 1 << 30)
    if isinstance(probe, str):
        print(f"bench_real: skipped: {probe}")
        return 0
    probe.remove()
    spec = like("kimi-k3", args.layers, n_experts=args.experts)
    gguf, manifest = beyond.ensure_model(spec, args.cache_dir)
    files = beyond.model_files(gguf, manifest)
    type_bytes, counts, expert_bytes = bytes_per_token(gguf, spec)
    per_token = {kind: sum(type_bytes[kind].values()) for kind in KINDS}
    per_token["routed experts"] = expert_bytes / counts["MoE routed"] / spec.n_experts * spec.top_k
    non_expert = gguf.stat().st_size - expert_bytes
    sequential_rate = disk_read_rate(files[1], min(files[1].stat().st_size, 4 << 30))
    depths: list[float] = []
    store_rate = [store_read_rate(manifest, spec.top_k, min(files[1].stat().st_size, 2 << 30), depths=depths)]
    start_rates = ram_read_rates(args.threads)
    rates = kernel_rates(gguf, args.threads, "--float-activations" not in args.k3stream_args)
    compute_ms = {kind: compute_bound_ms(type_bytes[kind], rates) for kind in KINDS}
    prompt = beyond.bench_prompt(gguf, args.prompt_tokens)
    print(
        f"slice {gguf}: {format_size(gguf.stat().st_size)} ({format_size(expert_bytes)} routed experts), "
        f"{spec.n_layers} layers (MLA {spec.mla_layer_ids()}), {spec.n_experts} experts top-{spec.top_k}; "
        f"{args.prompt_tokens}-token prompt, {args.decode_tokens} decode steps, {args.threads} threads\n"
        f"machine bounds: disk {store_rate[0] / 1e9:.2f} GB/s as the store reads (a layer's {spec.top_k} "
        "random objects a request, the layers in turn, the next queued while one lands, its reader "
        "threads, O_DIRECT into buffers made ahead, page cache dropped; one sequential stream "
        f"{sequential_rate / 1e9:.2f} GB/s), RAM {max(start_rates) / 1e9:.1f} GB/s ({args.threads} threads, "
        "at the start; the per-kind bound takes the resident run's own)",
        flush=True,
    )
    results = []
    if not args.no_resident:
        for path in files:  # into the page cache, where the children find them
            sequential_read(path)
        everything = non_expert + 2 * expert_bytes + 4 * args.slack_bytes
        results.append(run_pair("resident", gguf, manifest, prompt, args, everything, 2 * expert_bytes, []))
    for fraction in args.fraction_list:
        ram = int(fraction * expert_bytes)
        limit = non_expert + ram + args.slack_bytes
        results.append(
            run_pair(f"{fraction:.0%} of experts", gguf, manifest, prompt, args, limit, ram, files)
        )
    # the disk's best: the store's reads timed apart before and after the runs (a shared disk varies),
    # and the runs' own reads while the disk was busy (the decode's queue depth and pattern)
    store_rate.append(
        store_read_rate(manifest, spec.top_k, min(files[1].stat().st_size, 2 << 30), seed=1, depths=depths)
    )
    busy = busy_read_rates(results)
    disk_rate = max(store_rate + busy)
    print(
        f"the store's read rate after the runs {store_rate[1] / 1e9:.2f} GB/s; the runs' reads while the "
        f"disk was busy: {', '.join(f'{rate / 1e9:.2f}' for rate in busy) or 'n/a'} GB/s (prefill, decode "
        f"of each streamed run); the bounds take the best, {disk_rate / 1e9:.2f} GB/s"
    )
    rows = [summary(result, len(prompt), args.decode_tokens) for result in results]
    resident_ms = next(
        (1e3 / row["k3_decode"] for row in rows if row["name"] == "resident" and row.get("k3_decode")), None
    )
    print("\n".join(run_table(rows, resident_ms, disk_rate)))
    print("decode ms a step, median [fastest-slowest]:")
    print("\n".join(decode_step_lines(rows)))
    print("\nprefill, k3stream (bound: max(resident prefill, reads / the disk's best rate)):")
    print("\n".join(prefill_table(rows, disk_rate)))
    print(
        "pack reads (the store's read rate ran at depth "
        + ", ".join(f"{depth:.2f}" for depth in depths)
        + " ranges in flight while busy, before and after the runs):"
    )
    print("\n".join(read_lines(rows, counts["MoE routed"])))
    print("decode expert predictions, precision / recall:")
    print("\n".join(hint_lines(rows)))
    paths = ", ".join(f"{row['name']} {row['profile_path']}" for row in rows if row.get("profile"))
    print(f"\nper layer kind, k3stream's decode path ({paths}; ms per token per layer):")
    ram_rate = kind_ram_rate(rows, start_rates, args.threads)
    print(
        f"the kernels' rate on weights in cache (one thread's x {args.threads}, one input row): "
        + ", ".join(f"{type_name(ggml_type)} {rate / 1e9:.1f} GB/s" for ggml_type, rate in rates.items())
    )
    print("\n".join(kind_table(rows, per_token, counts, (ram_rate, compute_ms))))
    print()
    print("\n".join(real_model_arithmetic(rows, counts, per_token, (disk_rate, ram_rate))))
    for result in results:
        pairs = zip(result["llama"].get("tokens", []), result["k3"].get("tokens", []), strict=False)
        same = sum(a == b for a, b in pairs)
        print(f"{result['name']}: greedy tokens equal at {same} of {args.decode_tokens} decode steps")
    print(
        "  (random weights at these widths: both engines' 8-bit activations part from the float32 result by"
        " ~0.2 of the logits' scale, so the tokens part at once; docs/accuracy.md#logits-against-llamacpp)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
