"""Measurements shared by `k3stream bench` and `k3stream demo`.

Expert-store numbers are differences of `ExpertStore.stats()` counters taken around a phase (prefill,
decode), so each phase reports its own hit rates, bytes read per token and read throughput. Next to
them: a plain sequential read of the pack (large preads, the disk's best case) and, optionally, the
same prompt run by llama.cpp on the GGUF with mmap, in a child process (llama.cpp may abort).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3stream.engine.generate import prefill_last

if TYPE_CHECKING:
    from k3stream.engine.loading import Runtime

MIB = 1 << 20
SEQUENTIAL_CHUNK = 16 * MIB
# Text the bench prompt is cut from: ordinary prose routes experts more like real use than random ids.
BENCH_TEXT = (
    "Mixture-of-experts models keep most of their weights in routed experts, and each token uses only "
    "a few of them. Streaming the experts from a pack on disk lets a machine run a model far larger "
    "than its memory: a cache keeps the experts that are used often, and the rest are read on demand. "
    "How fast that runs depends on the hit rate of the cache, the bytes read per token and the speed "
    "of the disk. "
)


def bench_prompt(tokenizer: Any, count: int) -> list[int]:
    """`count` token ids of ordinary text (the paragraph repeated as needed)."""
    ids = tokenizer.encode(BENCH_TEXT)
    return (ids * (count // len(ids) + 1))[:count]


# ---- store counters -----------------------------------------------------------------------------

# experts read ahead; then found by a fetch, waited for by one, or evicted before any fetch wanted them
PREFETCH_COUNTERS = ("loads", "hits", "waits", "unused_evictions")


def store_counters(store: Any) -> dict[str, Any]:
    """The counters a phase's numbers are differences of."""
    stats = store.stats()
    return {
        "pack_reads": stats["pack_reads"],
        "pack_read_bytes": stats["pack_read_bytes"],
        "pack_read_ns": stats["pack_read_ns"],
        "fetch_ns": stats["fetch_ns"],
        "integrity_check_ns": stats.get("integrity_check_ns", 0),
        "prefetch": {name: stats[f"prefetch_{name}"] for name in PREFETCH_COUNTERS},
        "tiers": {
            name: {"hits": tier["cache_hits"], "misses": tier["cache_misses"]}
            for name, tier in stats["tiers"].items()
        },
    }


def _tier_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0}


def store_delta(before: dict[str, Any], after: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Hit rate per tier, pack reads, bytes read per token, read GB/s, and per token the time fetches
    waited (the stall) next to the time reads took, between two snapshots."""
    read_bytes = after["pack_read_bytes"] - before["pack_read_bytes"]
    read_ns = after["pack_read_ns"] - before["pack_read_ns"]
    per_token_ms = 1e-6 / tokens if tokens else 0.0
    return {
        "tiers": {name: _tier_delta(before["tiers"][name], tier) for name, tier in after["tiers"].items()},
        "pack_reads": after["pack_reads"] - before["pack_reads"],
        "prefetch": {name: after["prefetch"][name] - before["prefetch"][name] for name in PREFETCH_COUNTERS},
        "pack_read_bytes": read_bytes,
        "bytes_per_token": read_bytes / tokens if tokens else 0.0,
        # bytes over the time the engine waited on its reads (reads in flight together count once)
        "read_gb_per_s": read_bytes / read_ns if read_ns else 0.0,
        "read_ms_per_token": read_ns * per_token_ms,
        "fetch_wait_ms_per_token": (after["fetch_ns"] - before["fetch_ns"]) * per_token_ms,
        # hashing every object read (xxh3_64 against the manifest), demand and prefetch reads together
        "integrity_check_s": (after["integrity_check_ns"] - before["integrity_check_ns"]) / 1e9,
    }


@dataclass
class ExpertBytesPeak:
    """Largest expert bytes seen at step boundaries: per tier, and host buffers alive anywhere."""

    tiers: dict[str, int] = field(default_factory=dict)
    live_host: int = 0

    def sample(self, store: Any) -> None:
        for name, nbytes in store.resident_bytes().items():
            self.tiers[name] = max(self.tiers.get(name, 0), nbytes)
        self.live_host = max(self.live_host, store.live_host_bytes())


def budgets(store: Any) -> dict[str, int]:
    return {name: tier["budget_bytes"] for name, tier in store.stats()["tiers"].items()}


# ---- k3stream run ---------------------------------------------------------------------------------


def hint_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per prediction kind (`K3Model.hints.summary()` snapshots): precision and recall in between."""
    delta = {}
    for kind, counts in after.items():
        predicted, correct, used = (
            counts[key] - before[kind][key] for key in ("predicted", "correct", "used")
        )
        delta[kind] = {
            "predicted": predicted,
            "precision": correct / predicted if predicted else None,
            "recall": correct / used if used else None,
        }
    return delta


def _measured(name: str, tokens: int, model: Any, store: Any, work: Callable[[], None]) -> dict[str, Any]:
    """Run `work` (one phase of `tokens` tokens); its time, the store counters it moved and how
    precise the expert predictions made in it were."""
    before = store_counters(store) if store is not None else None
    hints_before = model.hints.summary()
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    phase = {"phase": name, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if store is not None:
        phase.update(store_delta(before, store_counters(store), tokens))
        phase["integrity_check_share"] = phase["integrity_check_s"] / seconds if seconds else 0.0
        phase["hints"] = hint_delta(hints_before, model.hints.summary())
    return phase


def run_k3stream(runtime: Runtime, prompt_ids: list[int], decode_tokens: int) -> dict[str, Any]:
    """Warm up with the run itself (the prompt and its `decode_tokens` greedy steps, at least one:
    the tokens the timed run decodes, as llama.cpp's warm-up runs them, `run_llama`), then time a
    prefill and `decode_tokens` greedy steps. The timed phases read from the pack only what the
    budget could not keep of the warm-up's experts (their `pack_reads`).

    The model runs as loaded, as `generate` and `serve` run it: the decode step takes the decode
    program where they take it (the decode phase's `path`), and the hints scored are those that path
    predicts. The store is told about every token (`end_token`), and the expert bytes it holds are
    sampled after every step.
    """
    model, store = runtime.model, runtime.store
    peak = ExpertBytesPeak()

    def step_done(tokens: int) -> None:
        if store is not None:
            store.end_token(tokens)
            peak.sample(store)

    warm = model.new_state()  # first-call costs of both paths, and the cache the run leaves
    token = int(prefill_last(model, warm, prompt_ids).argmax())
    step_done(len(prompt_ids))
    for _ in range(max(decode_tokens, 1)):
        token = int(model.decode(warm, token).argmax())
        step_done(1)
    state = model.new_state()
    decoded: list[int] = []

    def prefill() -> None:
        decoded.append(int(prefill_last(model, state, prompt_ids).argmax()))
        step_done(len(prompt_ids))

    step_seconds: list[float] = []

    def decode() -> None:
        for _ in range(decode_tokens):
            started = time.perf_counter()
            decoded.append(int(model.decode(state, decoded[-1]).argmax()))
            step_seconds.append(time.perf_counter() - started)
            step_done(1)

    phases = [_measured("prefill", len(prompt_ids), model, store, prefill)]
    phases.append(_measured("decode", decode_tokens, model, store, decode))
    if step_seconds:  # a step's own time: the phase's less the store's sampling after each step
        phases[-1]["median_step_ms"] = 1e3 * statistics.median(step_seconds)
    phases[-1]["path"] = "eager" if model.program_for([state]) is None else "program"
    result: dict[str, Any] = {"phases": phases, "decoded_ids": decoded[:decode_tokens]}
    if store is not None:
        result["expert_bytes"] = {
            "budget": budgets(store),
            "peak_resident": peak.tiers,
            "peak_live_host": peak.live_host,
        }
        result["store"] = store.stats()
    return result


# ---- the disk's best case -------------------------------------------------------------------------


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to forget this file's cached pages (clean pages only; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential_read(path: str | os.PathLike[str], limit_bytes: int | None = None) -> dict[str, Any]:
    """Read the file from its start in 16 MiB preads (up to `limit_bytes`); bytes, seconds, GB/s."""
    buffer = bytearray(SEQUENTIAL_CHUNK)
    view = memoryview(buffer)
    size = os.path.getsize(path)
    total = size if limit_bytes is None else min(size, limit_bytes)
    fd = os.open(path, os.O_RDONLY)
    done = 0
    started = time.perf_counter()
    try:
        os.posix_fadvise(fd, 0, total, os.POSIX_FADV_SEQUENTIAL)
        while done < total:
            got = os.preadv(fd, [view[: min(SEQUENTIAL_CHUNK, total - done)]], done)
            if got <= 0:
                raise OSError(f"short read of {path} at byte {done} of {total}")
            done += got
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    return {"path": str(path), "bytes": done, "seconds": seconds, "gb_per_s": done / seconds / 1e9}


# ---- llama.cpp on the same prompt -----------------------------------------------------------------

LLAMA_BENCH_SCRIPT = """
import json, sys, time
import llama_cpp
job = json.loads(sys.argv[1])
started = time.perf_counter()
model = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=job["n_batch"],
                        n_threads=job["threads"], n_threads_batch=job["threads"], use_mmap=True,
                        n_gpu_layers=0, verbose=False)
load_s = time.perf_counter() - started
def timed(tokens):
    started = time.perf_counter()
    model.eval(tokens)
    return time.perf_counter() - started
timed(job["prompt"])
for token in job["decode"]:  # warm-up: the timed run's own tokens, as k3stream's
    timed([token])
model.reset()
prefill_s = timed(job["prompt"])
steps = [timed([token]) for token in job["decode"]]
print(json.dumps({"load_s": load_s, "prefill_s": prefill_s, "decode_s": sum(steps), "steps": steps}))
"""


def run_llama(
    gguf: str | os.PathLike[str], prompt_ids: list[int], decode_ids: list[int], threads: int
) -> dict[str, Any]:
    """llama.cpp (mmap, CPU) on the same prompt, then fed the same tokens k3stream decoded; warmed up
    as `run_k3stream` is, with the prompt and those tokens."""
    job = {
        "model": str(gguf),
        "n_ctx": len(prompt_ids) + len(decode_ids) + 8,
        "n_batch": max(512, len(prompt_ids)),
        "threads": threads,
        "prompt": prompt_ids,
        "decode": decode_ids,
    }
    done = subprocess.run(
        [sys.executable, "-c", LLAMA_BENCH_SCRIPT, json.dumps(job)], capture_output=True, text=True
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"llama.cpp could not run {gguf}: {tail[0]}")
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "load_s": times["load_s"],
        "prefill_tokens_per_s": len(prompt_ids) / times["prefill_s"],
        "decode_tokens_per_s": len(decode_ids) / times["decode_s"] if decode_ids else 0.0,
        "median_step_ms": 1e3 * statistics.median(times["steps"]) if decode_ids else 0.0,
        "threads": threads,
        "mmap": True,
    }
