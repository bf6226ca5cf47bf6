"""k3stream against llama.cpp on a model several times larger than a memory limit.

    python benchmarks/bench_beyond_ram.py [--limit 1.5GiB] [--ratio 2.5] [--recipe R] [--cache-dir DIR]

Writes (or reuses, in --cache-dir) a tiny model with the real model's sparsity (512 experts top-8:
top-k / experts = 1.6%) and enough MoE layers for its audited-recipe experts to be >= --ratio x the
limit, in --recipe (audited, or the i-quant `iq2_xxs` / `iq1_s` experts at the same parameter count),
packs it, then runs each contender alone in a child memory cgroup (created under this process's own
cgroup, limit --limit) after dropping the model files' page cache:

- llama.cpp (llama-cpp-python, mmap, CPU) as users run it;
- k3stream with experts streaming from the pack, sized by `--memory-limit` (the same limit).

Both warm up with the prompt, then prefill it and greedily decode --decode-tokens tokens; each prefill
computes the last prompt token's logits alone (llama.cpp's `eval`; k3stream's `prefill_last`, as its
`generate` does: past the last attention only that row runs on). Per contender:
prefill and decode tok/s, bytes read from disk (`/proc/PID/io` read_bytes of the child, load and run),
peak cgroup memory, times the limit was hit, OOM kills; for k3stream also the decode hit rate, fetch
time (the model waiting on `fetch`) and pack read time per decode token; then the ratios. Skips with one
line where no memory cgroup can be created.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from k3stream.memlimit import MIB, format_size, parse_size
from k3stream.testing.cgroups import ChildCgroup, drop_page_cache
from k3stream.testing.tiny import TinySpec

# the model: hidden 1024, 512 experts top-8, expert_ff = latent = 1024 (one object 1.14 MB)
SHAPE = dict(
    recipe="audited",
    hidden=1024,
    n_experts=512,
    top_k=8,
    expert_ff=1024,
    latent=1024,
    kv_lora=256,
    qk_nope=32,
)
OBJECT_BYTES = 1024 * 1024 // 256 * (84 + 84 + 110)  # up + gate (Q2_K), down (Q3_K)
RECIPES = ("audited", "iq2_xxs", "iq1_s")  # iq1_s: IQ1_S gate and up, IQ1_M down
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3stream-beyond-ram"

# ---- the model --------------------------------------------------------------------------------------


def model_spec(limit: int, ratio: float, layers: int | None = None, recipe: str = "audited") -> TinySpec:
    """The issue's shape in `recipe` with enough MoE layers (after one dense layer) for audited
    experts of >= ratio x limit: every recipe has the same parameter count."""
    if layers is None:
        moe_layers = max(1, math.ceil(ratio * limit / (SHAPE["n_experts"] * OBJECT_BYTES)))
        layers = moe_layers + 1
    return TinySpec(n_layers=max(layers, 2), **{**SHAPE, "recipe": recipe})


def model_directory(spec: TinySpec, cache_dir: Path) -> Path:
    """Where `spec` is cached: named by its recipe (but audited), layers, experts and a hash of it."""
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    recipe = "" if spec.recipe == "audited" else f"{spec.recipe}-"
    return cache_dir / f"{recipe}L{spec.n_layers}-E{spec.n_experts}-{key}"


def ensure_model(spec: TinySpec, cache_dir: Path) -> tuple[Path, Path]:
    """`(gguf, manifest)` for `spec` in `cache_dir`, written and packed unless already there."""
    from k3stream.gguf.writer import shard_paths
    from k3stream.pack.builder import BuildOptions, build_pack
    from k3stream.testing.tiny import make_tiny

    directory = model_directory(spec, cache_dir)
    gguf = shard_paths(directory, spec.shards)[0]
    manifest = gguf.with_name(gguf.stem + ".expert-major.pack.manifest.json")
    if not gguf.is_file():
        print(f"writing {directory} ...", file=sys.stderr, flush=True)
        make_tiny(directory, spec)
    if not manifest.is_file():
        print(f"packing {gguf} ...", file=sys.stderr, flush=True)
        manifest = build_pack(gguf, options=BuildOptions(progress=False)).manifest
    return gguf, manifest


def model_files(gguf: Path, manifest: Path) -> list[Path]:
    return [gguf, manifest.with_name(manifest.name.removesuffix(".manifest.json"))]


def bench_prompt(gguf: Path, count: int) -> list[int]:
    from k3stream.engine import bench
    from k3stream.engine.tokenizer import Tokenizer

    return bench.bench_prompt(Tokenizer.from_gguf(gguf), count)


# ---- the children ---------------------------------------------------------------------------------

IO_SNIPPET = """
def read_io():
    with open("/proc/self/io") as f:
        return dict((k.rstrip(":"), int(v)) for k, v in (line.split() for line in f))["read_bytes"]
def read_status():
    with open("/proc/self/status") as f:
        rows = [line.split() for line in f]
    return {row[0].rstrip(":"): int(row[1]) * 1024 for row in rows if row[0] in ("VmHWM:", "RssAnon:")}
def read_disk(stat_path):  # the block device's bytes read and ms with a request in flight (None: unknown)
    if not stat_path:
        return None
    with open(stat_path) as f:
        fields = f.read().split()
    return {"bytes": int(fields[2]) * 512, "busy_ms": int(fields[9])}
"""

LLAMA_CHILD = (
    IO_SNIPPET
    + """
import json, sys, time
import numpy as np
import llama_cpp
job = json.loads(sys.argv[1])
io = {"start": read_io()}
started = time.perf_counter()
model = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=job["n_batch"],
                        n_threads=job["threads"], n_threads_batch=job["threads"], use_mmap=True,
                        n_gpu_layers=0, verbose=False)
load_s = time.perf_counter() - started
io["load"] = read_io()
n_vocab = model.n_vocab()
def last_argmax():
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model._ctx.ctx, -1), shape=(n_vocab,))
    return int(logits.argmax())
model.eval(job["prompt"])
token = last_argmax()
for _ in range(job["decode_tokens"] if job["warm_decode"] else 0):  # the measured run's own tokens
    model.eval([token])
    token = last_argmax()
model.reset()
io["warmup"] = read_io()
started = time.perf_counter()
model.eval(job["prompt"])
prefill_s = time.perf_counter() - started
io["prefill"] = read_io()
tokens = [last_argmax()]
token_s = []  # each decode step's seconds
started = time.perf_counter()
for _ in range(job["decode_tokens"]):
    step = time.perf_counter()
    model.eval([tokens[-1]])
    tokens.append(last_argmax())
    token_s.append(time.perf_counter() - step)
decode_s = time.perf_counter() - started
io["decode"] = read_io()
print(json.dumps({"load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "io": io,
                  "tokens": tokens[:-1], "token_s": token_s, "status": read_status()}))
"""
)

K3_CHILD = (
    IO_SNIPPET
    + """
import argparse, json, resource, sys, time
job = json.loads(sys.argv[1])
io = {"start": read_io()}
from k3stream.cli import calm_openmp
calm_openmp()  # as the k3stream command does, before torch loads the OpenMP runtime
import torch
from k3stream.engine import bench
from k3stream.engine.generate import prefill_last
from k3stream.commands.flags import add_model_arguments, runtime_from_args
parser = argparse.ArgumentParser()
add_model_arguments(parser)
args = parser.parse_args(job["argv"])
torch.set_num_threads(job["threads"])
started = time.perf_counter()
runtime = runtime_from_args(args)
load_s = time.perf_counter() - started
io["load"] = read_io()
model, store = runtime.model, runtime.store
# every kind of hint predicted and scored (the eager forward: `score_all_hints` keeps the decode program
# off), or the default decode, the program where it runs
model.score_all_hints = job.get("score_hints", True)
prompt = job["prompt"]
phases = {}
def cpu_seconds():  # and the minor page faults (pages first touched), all threads
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": usage.ru_utime, "system": usage.ru_stime, "minor_faults": usage.ru_minflt}
BUFFERS = ("buffers_made", "buffers_prefaulted")  # read buffers made by reads (faulted by them), ahead
# how the reads ran: ranges, depth, the readers' and the digest checks' CPU, read-ahead calls
READS = ("pack_ranges", "pack_unaligned_ranges", "pack_busy_ns", "pack_depth_ns", "pack_read_cpu_ns",
         "integrity_cpu_ns", "integrity_check_ns", "read_ahead_calls", "read_ahead", "pack_reads")
def buffers():
    stats = store.stats()
    return {key: stats[key] for key in BUFFERS + READS}
def measured(name, tokens, work):
    disk_before = read_disk(job.get("disk_stat"))
    before = bench.store_counters(store)
    hints_before = model.hints.summary()
    cpu_before, buffers_before = cpu_seconds(), buffers()
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    delta = bench.store_delta(before, bench.store_counters(store), tokens)
    delta["hints"] = bench.hint_delta(hints_before, model.hints.summary())
    delta["cpu_s"] = {key: value - cpu_before[key] for key, value in cpu_seconds().items()}
    after = buffers()
    delta["buffers"] = {key: after[key] - buffers_before[key] for key in BUFFERS}
    delta["reads"] = {key: after[key] - buffers_before[key] for key in READS}
    delta["buffers_ahead"] = buffers_before["buffers_prefaulted"]
    disk_after = read_disk(job.get("disk_stat"))
    if disk_after is not None:
        delta["disk"] = {key: value - disk_before[key] for key, value in disk_after.items()}
    phases[name] = {"seconds": seconds, "tokens": tokens, **delta}
    io[name] = read_io()
warm, first = model.new_state(), []
def cold():  # the first prefill after the load: every expert it uses is read
    first.append(int(prefill_last(model, warm, prompt).argmax()))
    store.end_token(len(prompt))
measured("cold", len(prompt), cold)
for _ in range(job["decode_tokens"] if job["warm_decode"] else 1):  # the measured run's own tokens
    first.append(int(model.decode(warm, first[-1]).argmax()))
    store.end_token(1)
io["warmup"] = read_io()
state = model.new_state()
decoded = []
def prefill():
    decoded.append(int(prefill_last(model, state, prompt).argmax()))
    store.end_token(len(prompt))
token_s = []  # each decode step's seconds
def decode():
    for _ in range(job["decode_tokens"]):
        step = time.perf_counter()
        decoded.append(int(model.decode(state, decoded[-1]).argmax()))
        store.end_token(1)
        token_s.append(time.perf_counter() - step)
measured("prefill", len(prompt), prefill)
measured("decode", job["decode_tokens"], decode)
profile = {}
if job.get("profile_tokens"):  # per layer kind, on the decode's path (engine.layer_profile)
    from k3stream.engine.layer_profile import profile_decode, ram_read_rates
    profile_ids = prompt[: job["profile_tokens"]]
    if job["warm_decode"]:  # resident: the profiled steps' experts read before, as the measured decode's
        def at_prompt_end():  # a fresh sequence after the prompt: the same steps route alike from it
            fresh = model.new_state()
            prefill_last(model, fresh, prompt)
            store.end_token(len(prompt))
            return fresh
        warm = at_prompt_end()
        for token in profile_ids:
            model.decode(warm, token)
            store.end_token(1)
        state = at_prompt_end()
    # the RAM's read rate right before and after, in this process (where the memory allows a buffer)
    rates = ram_read_rates(job["threads"]) if job.get("ram_rates") else []
    measured("profile", len(profile_ids), lambda: profile.update(profile_decode(model, state, profile_ids)))
    profile["ram_rates"] = rates + (ram_read_rates(job["threads"]) if rates else [])
budget = store.stats()["tiers"]["ram"]["budget_bytes"]
status = read_status()
runtime.close()
print(json.dumps({"load_s": load_s, "phases": phases, "io": io, "tokens": decoded[:-1], "token_s": token_s,
                  "ram_budget_bytes": budget, "status": status, "profile": profile}))
"""
)


def run_child(name: str, script: str, job: dict[str, Any], limit: int, files: list[Path]) -> dict[str, Any]:
    """Run `script` in a fresh child cgroup of `limit` bytes, the files' page cache dropped first."""
    cgroup = ChildCgroup.create(f"bench-{name}-{os.getpid()}", limit)
    if isinstance(cgroup, str):
        raise SystemExit(f"bench_beyond_ram: skipped: {cgroup}")
    try:
        drop_page_cache(*files)
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps(job)],
            capture_output=True,
            text=True,
            preexec_fn=cgroup.join,
        )
        usage = cgroup.usage()
    finally:
        cgroup.remove()
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"exit status {done.returncode}: {tail}", "cgroup": usage}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cgroup"] = usage
    result["stderr"] = done.stderr.strip().splitlines()
    return result


def run_llama(gguf: Path, prompt: list[int], args: argparse.Namespace, files: list[Path]) -> dict[str, Any]:
    job = {
        "model": str(gguf),
        "n_ctx": len(prompt) + args.decode_tokens + 8,
        "n_batch": max(512, len(prompt)),
        "threads": args.threads,
        "prompt": prompt,
        "decode_tokens": args.decode_tokens,
        "warm_decode": getattr(args, "warm_decode", False),
    }
    return run_child("llama", LLAMA_CHILD, job, args.limit_bytes, files)


def run_k3stream(
    manifest: Path, prompt: list[int], args: argparse.Namespace, files: list[Path]
) -> dict[str, Any]:
    argv = [str(manifest), "--device", "cpu", "--threads", str(args.threads), *args.k3stream_args]
    if "--ram-mib" not in args.k3stream_args and "--memory-limit" not in args.k3stream_args:
        argv += ["--memory-limit", str(args.limit_bytes)]
    job = {
        "argv": argv,
        "threads": args.threads,
        "prompt": prompt,
        "decode_tokens": args.decode_tokens,
        "warm_decode": getattr(args, "warm_decode", False),
        "profile_tokens": getattr(args, "profile_tokens", 0),
        "score_hints": getattr(args, "score_hints", True),
        "ram_rates": getattr(args, "ram_rates", False),
        "disk_stat": device_stat(files[-1]) if files else None,
    }
    return run_child("k3stream", K3_CHILD, job, args.limit_bytes, files)


def device_stat(path: Path) -> str | None:
    """The `stat` file of the block device holding `path` (its reads and busy time), None where
    there is none (tmpfs, overlay filesystems)."""
    device = os.stat(path).st_dev
    stat = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat")
    return str(stat) if stat.is_file() else None


# ---- the report -----------------------------------------------------------------------------------


def summarize_llama(result: dict[str, Any], prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    io = result["io"]
    return {
        "prefill_tok_s": prompt_tokens / result["prefill_s"],
        "decode_tok_s": decode_tokens / result["decode_s"],
        "read_bytes": io["decode"] - io["start"],
        "decode_read_per_token": (io["decode"] - io["prefill"]) / decode_tokens,
        **result["cgroup"],
        "peak_rss_bytes": result["status"].get("VmHWM"),
        "anon_bytes": result["status"].get("RssAnon"),
    }


def summarize_k3stream(result: dict[str, Any]) -> dict[str, Any]:
    io, prefill, decode = result["io"], result["phases"]["prefill"], result["phases"]["decode"]
    tokens = decode["tokens"]
    return {
        "prefill_tok_s": prefill["tokens"] / prefill["seconds"],
        "decode_tok_s": tokens / decode["seconds"],
        "read_bytes": io["decode"] - io["start"],
        "decode_read_per_token": (io["decode"] - io["prefill"]) / tokens,
        **result["cgroup"],
        "peak_rss_bytes": result["status"].get("VmHWM"),
        "anon_bytes": result["status"].get("RssAnon"),
        "ram_budget_bytes": result["ram_budget_bytes"],
        "decode_hit_rate": decode["tiers"]["ram"]["hit_rate"],
        "decode_pack_bytes_per_token": decode["bytes_per_token"],
        "decode_fetch_ms_per_token": decode["fetch_wait_ms_per_token"],
        "decode_pack_read_ms_per_token": decode["read_ms_per_token"],
        "decode_pre_attention_precision": decode["hints"]["pre-attention"]["precision"],
        "decode_layer_ahead_precision": decode["hints"]["layer-ahead"]["precision"],
        "decode_token_precision": decode["hints"]["token"]["precision"],
    }


def _cell(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


ROWS = [
    ("prefill tok/s", "prefill_tok_s", ".2f", 1),
    ("decode tok/s", "decode_tok_s", ".2f", 1),
    ("disk read, MB (load + run)", "read_bytes", ".0f", 1e6),
    ("disk read per decode token, MB", "decode_read_per_token", ".1f", 1e6),
    ("peak cgroup memory, MiB", "peak_bytes", ".0f", MIB),
    ("peak resident set (VmHWM), MiB", "peak_rss_bytes", ".0f", MIB),
    ("anonymous memory at the end, MiB", "anon_bytes", ".0f", MIB),
    ("times the limit was hit", "limit_hits", "d", None),
    ("OOM kills", "oom_kills", "d", None),
    ("expert RAM budget, MiB", "ram_budget_bytes", ".0f", MIB),
    ("decode hit rate", "decode_hit_rate", ".1%", None),
    ("decode pack read per token, MB", "decode_pack_bytes_per_token", ".1f", 1e6),
    ("decode fetch wait per token, ms", "decode_fetch_ms_per_token", ".1f", None),
    ("decode pack read time per token, ms", "decode_pack_read_ms_per_token", ".1f", None),
    ("decode hint precision, pre-attention", "decode_pre_attention_precision", ".1%", None),
    ("decode hint precision, layer-ahead", "decode_layer_ahead_precision", ".1%", None),
    ("decode hint precision, token", "decode_token_precision", ".1%", None),
]


def table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    names = list(summaries)
    lines = [f"| {'':<36} | " + " | ".join(f"{n:>12}" for n in names) + " |"]
    lines.append("|" + "-" * 38 + "|" + "|".join("-" * 14 for _ in names) + "|")
    for label, key, fmt, scale in ROWS:
        cells = []
        for name in names:
            value = summaries[name].get(key)
            if value is not None and scale:
                value = value / scale
            cells.append(_cell(value, fmt))
        if any(cell != "n/a" for cell in cells):
            lines.append(f"| {label:<36} | " + " | ".join(f"{c:>12}" for c in cells) + " |")
    return lines


def ratios(k3: dict[str, Any], llama: dict[str, Any]) -> str:
    def ratio(key: str) -> str:
        return f"{k3[key] / llama[key]:.2f}x" if llama.get(key) and k3.get(key) is not None else "n/a"

    return (
        f"k3stream / llama.cpp: prefill {ratio('prefill_tok_s')}, decode {ratio('decode_tok_s')}, "
        f"disk read {ratio('read_bytes')}, decode read per token {ratio('decode_read_per_token')}"
    )


# ---- main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", default="1.5GiB", help="memory cgroup limit per contender (%(default)s)")
    parser.add_argument(
        "--ratio", type=float, default=2.5, help="model bytes / limit, at least (%(default)s)"
    )
    parser.add_argument(
        "--recipe", choices=RECIPES, default="audited", help="the model's quantization (%(default)s)"
    )
    parser.add_argument("--layers", type=int, default=None, help="model layers (default: from --ratio)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="models (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="default %(default)s")
    parser.add_argument("--decode-tokens", type=int, default=16, help="default %(default)s")
    parser.add_argument("--threads", type=int, default=2, help="default %(default)s")
    parser.add_argument("--only", choices=["llama", "k3stream"], default=None, help="run one contender")
    parser.add_argument(
        "--k3stream-args", default="", help="extra k3stream flags, e.g. '--ram-mib 384 --no-prefetch'"
    )
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = parser.parse_args(argv)
    args.limit_bytes = parse_size(args.limit)
    args.k3stream_args = args.k3stream_args.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    probe = ChildCgroup.create(f"bench-probe-{os.getpid()}", args.limit_bytes)
    if isinstance(probe, str):
        print(f"bench_beyond_ram: skipped: {probe}")
        return 0
    probe.remove()
    spec = model_spec(args.limit_bytes, args.ratio, args.layers, args.recipe)
    gguf, manifest = ensure_model(spec, args.cache_dir)
    files = model_files(gguf, manifest)
    model_bytes = sum(path.stat().st_size for path in files[:1])
    print(
        f"model {gguf} ({spec.recipe}): {format_size(model_bytes)}, {spec.n_layers} layers, "
        f"{spec.n_experts} experts top-{spec.top_k}; limit {format_size(args.limit_bytes)} "
        f"({model_bytes / args.limit_bytes:.1f}x); "
        f"{args.prompt_tokens}-token prompt, {args.decode_tokens} greedy decode steps, "
        f"{args.threads} threads",
        flush=True,
    )
    prompt = bench_prompt(gguf, args.prompt_tokens)
    raw: dict[str, Any] = {}
    summaries: dict[str, dict[str, Any]] = {}
    if args.only in (None, "llama"):
        raw["llama.cpp"] = run_llama(gguf, prompt, args, files)
        if "error" not in raw["llama.cpp"]:
            summaries["llama.cpp"] = summarize_llama(raw["llama.cpp"], len(prompt), args.decode_tokens)
    if args.only in (None, "k3stream"):
        raw["k3stream"] = run_k3stream(manifest, prompt, args, files)
        if "error" not in raw["k3stream"]:
            summaries["k3stream"] = summarize_k3stream(raw["k3stream"])
            print(*[line for line in raw["k3stream"]["stderr"] if "memory limit" in line], sep="\n")
    for name, result in raw.items():
        if "error" in result:
            print(f"{name} failed: {result['error']} (cgroup: {result['cgroup']})")
    if summaries:
        print("\n".join(table(summaries)))
    if len(summaries) == 2:
        print(ratios(summaries["k3stream"], summaries["llama.cpp"]))
        pairs = zip(raw["llama.cpp"]["tokens"], raw["k3stream"]["tokens"], strict=False)
        same = sum(a == b for a, b in pairs)
        print(f"greedy tokens equal at {same} of {args.decode_tokens} decode steps")
    if args.json:
        print(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
