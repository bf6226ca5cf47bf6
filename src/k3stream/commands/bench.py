"""`k3stream bench MODEL`: prefill/decode speed, expert-store hit rates and reads, the disk's sequential
read of the pack and (with `--llama`) llama.cpp on the same model, all in one run."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from k3stream.cli import UsageError
from k3stream.commands.flags import (
    add_context_argument,
    add_model_arguments,
    finite,
    runtime_from_args,
    size_context,
)
from k3stream.commands.report import format_mib
from k3stream.engine.loading import open_model

MIB = 1 << 20
LLAMA_MISSING = (
    "llama.cpp not run: llama-cpp-python is not installed (`pip install llama-cpp-python==0.3.36` builds "
    "it from source with a C++ compiler and cmake)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_context_argument(parser, "--prompt-tokens plus --decode-tokens")  # `size_context`
    parser.add_argument(  # llama-bench's spellings too
        "--prompt-tokens",
        "--n-prompt",
        "-p",
        type=int,
        default=64,
        help="prompt tokens (default %(default)s)",
    )
    parser.add_argument(
        "--decode-tokens", "--n-gen", "-n", type=int, default=32, help="tokens decoded (default %(default)s)"
    )
    parser.add_argument("--llama", action="store_true", help="also run the GGUF with llama.cpp (mmap)")
    parser.add_argument(
        "--seq-read-mib", type=finite, default=4096, help="read at most this much of the pack sequentially"
    )
    parser.add_argument(
        "--drop-cache",
        action="store_true",
        help="evict the pack and GGUF from the page cache before each measurement (cold reads)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _check_counts(args: argparse.Namespace) -> None:
    if args.prompt_tokens < 1 or args.decode_tokens < 0:
        raise UsageError(
            f"--prompt-tokens must be >= 1 and --decode-tokens >= 0, got {args.prompt_tokens} and "
            f"{args.decode_tokens}"
        )
    if not args.seq_read_mib > 0:
        raise UsageError(f"--seq-read-mib must be above 0, got {args.seq_read_mib}")


def _check_context(args: argparse.Namespace, config: Any) -> None:
    """The measured sequence stays within the context the memory plan holds (--ctx, else its default)."""
    from k3stream.memlimit import served_tokens

    context = served_tokens(config, args.ctx)
    if args.prompt_tokens + args.decode_tokens > context:
        raise ValueError(
            f"--prompt-tokens {args.prompt_tokens} and --decode-tokens {args.decode_tokens} pass the "
            f"context of {context} tokens (--ctx)"
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from k3stream.engine import bench

    _check_counts(args)
    opened = open_model(args.model, not args.no_stream_experts)
    shards = opened[0].shards  # llama.cpp opens a split set by its first shard
    size_context(args, opened[0].config, args.prompt_tokens + args.decode_tokens)
    runtime = runtime_from_args(args, opened)
    try:
        _check_context(args, runtime.model.config)
        prompt = bench.bench_prompt(runtime.tokenizer, args.prompt_tokens)
        results: dict[str, Any] = {
            "model": str(Path(args.model).resolve()),
            "device": str(runtime.model.device),
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
        }
        if runtime.store is not None:
            results["pack"] = _pack_facts(runtime.store)
            if args.drop_cache:
                bench.drop_page_cache(runtime.store.pack.path)
            results["sequential_read"] = bench.sequential_read(
                runtime.store.pack.path, int(args.seq_read_mib * MIB)
            )
            if args.drop_cache:
                bench.drop_page_cache(runtime.store.pack.path)
        results["k3stream"] = bench.run_k3stream(runtime, prompt, args.decode_tokens)
    finally:
        runtime.close()
    if args.llama and importlib.util.find_spec("llama_cpp") is None:
        results["llama_cpp_missing"] = LLAMA_MISSING
    elif args.llama:
        if args.drop_cache:
            for shard in shards:
                bench.drop_page_cache(shard)
        decoded = results["k3stream"]["decoded_ids"]
        results["llama_cpp"] = bench.run_llama(shards[0], prompt, decoded, results["threads"])
    results["k3stream"].pop("decoded_ids")
    print(json.dumps(results, indent=2) if args.json else "\n".join(report_lines(results)))
    return 0


def _pack_facts(store: Any) -> dict[str, Any]:
    pack = store.pack
    objects = len(pack.moe_layers) * pack.num_experts
    return {
        "path": str(pack.path),
        "size_bytes": pack.path.stat().st_size,
        "experts": objects,
        "object_bytes": store.slot_bytes,
        "expert_bytes": objects * store.slot_bytes,
    }


# ---- text report ------------------------------------------------------------------------------------


def report_lines(results: dict[str, Any]) -> list[str]:
    k3 = results["k3stream"]
    lines = [
        f"k3stream bench: {results['model']} on {results['device']}, {results['threads']} threads, "
        f"{results['dtype']}"
    ]
    if "pack" in results:
        lines += _budget_lines(results["pack"], k3["expert_bytes"])
    lines += ["", *_phase_table(k3["phases"]), _path_line(k3["phases"][-1])]
    if "pack" in results:
        lines.append(_warmup_line(k3["phases"], "llama_cpp" in results))
    if "sequential_read" in results:
        lines.append(_sequential_line(results["sequential_read"], k3["phases"][-1]))
    if "llama_cpp" in results:
        lines.append(_llama_line(results["llama_cpp"], k3["phases"]))
    if "llama_cpp_missing" in results:
        lines.append(results["llama_cpp_missing"])
    if "expert_bytes" in k3:
        lines.append(_peak_line(k3["expert_bytes"]))
    if "store" in k3:
        lines.append(_integrity_line(k3["store"], k3["phases"]))
    lines += [_hints_line(phase) for phase in k3["phases"] if "hints" in phase]
    return lines


def _path_line(decode: dict[str, Any]) -> str:
    """Which decode step the timed decode ran: the one `generate` and `serve` run for the model."""
    step = "the decode program" if decode["path"] == "program" else "the eager forward"
    return f"the timed decode ran {step}, as generate and serve do"


def _warmup_line(phases: list[dict[str, Any]], llama: bool) -> str:
    """What the timed phases ran after, and what they read from the pack."""
    engines = "k3stream and llama.cpp each" if llama else "k3stream"
    reads = ", ".join(
        f"{phase['phase']} {phase['pack_reads']} ({phase['bytes_per_token'] / 1024:.1f} KiB a token)"
        for phase in phases
    )
    return (
        f"warm-up: {engines} ran the prompt and the decoded tokens once before the timed run; "
        f"experts the timed phases read from the pack: {reads}"
    )


def _hints_line(phase: dict[str, Any]) -> str:
    """Precision / recall of the expert predictions the timed phase made (`k3stream.model.hints`):
    the kinds its path predicts (a kind it does not predict is left out), and what went out."""

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    kinds = ", ".join(
        f"{kind} {share(hint['precision'])} / {share(hint['recall'])}"
        for kind, hint in phase["hints"].items()
        if hint["precision"] is not None or hint["recall"] is not None
    )
    return f"expert predictions made in {phase['phase']} (precision / recall): {kinds or 'none'}"


def _integrity_line(store: dict[str, Any], phases: list[dict[str, Any]]) -> str:
    """What checking each object's xxh3_64 as it is read cost, as a share of each phase's time."""
    if not store.get("integrity_checks"):
        return "integrity: the manifest records no checksums; objects are not checked"
    shares = ", ".join(
        f"{phase['phase']} {phase['integrity_check_s'] * 1e3:.1f} ms ({phase['integrity_check_share']:.2%})"
        for phase in phases
    )
    return f"integrity: every object read is checked (xxh3_64); checking took {shares}"


def _budget_lines(pack: dict[str, Any], expert_bytes: dict[str, Any]) -> list[str]:
    lines = [
        f"expert pack {format_mib(pack['size_bytes'])}: {pack['experts']} experts of "
        f"{pack['object_bytes'] / 1024:.1f} KiB"
    ]
    for tier, budget in expert_bytes["budget"].items():
        lines.append(
            f"{tier} budget {format_mib(budget)}: {budget // pack['object_bytes']} experts, "
            f"{budget / pack['expert_bytes']:.0%} of the pack"
        )
    return lines


def _phase_table(phases: list[dict[str, Any]]) -> list[str]:
    tiers = list(phases[0].get("tiers", {}))
    header = f"{'phase':<8} {'tokens':>6} {'tok/s':>8}" + "".join(f" {t + ' hit':>8}" for t in tiers)
    if tiers:
        header += (
            f" {'reads':>7} {'prefetched':>10} {'KiB/token':>10} {'read GB/s':>9}"
            f" {'read ms/tok':>11} {'wait ms/tok':>11}"
        )
    rows = [header]
    for phase in phases:
        row = f"{phase['phase']:<8} {phase['tokens']:>6} {phase['tokens_per_s']:>8.2f}"
        row += "".join(f" {phase['tiers'][t]['hit_rate']:>8.1%}" for t in tiers)
        if tiers:
            row += (
                f" {phase['pack_reads']:>7} {_prefetched(phase['prefetch']):>10} "
                f"{phase['bytes_per_token'] / 1024:>10.1f} "
                f"{phase['read_gb_per_s']:>9.3f} {phase['read_ms_per_token']:>11.2f} "
                f"{phase['fetch_wait_ms_per_token']:>11.2f}"
            )
        rows.append(row)
    return rows


def _prefetched(prefetch: dict[str, int]) -> str:
    """Experts read ahead, as `used/loaded` (used: a fetch found it, or waited for its read)."""
    return f"{prefetch['hits'] + prefetch['waits']}/{prefetch['loads']}"


def _sequential_line(sequential: dict[str, Any], decode: dict[str, Any]) -> str:
    line = (
        f"sequential read of the pack: {format_mib(sequential['bytes'])} in {sequential['seconds']:.3f} s, "
        f"{sequential['gb_per_s']:.2f} GB/s"
    )
    if decode.get("pack_read_bytes"):
        line += f"; decode reads achieved {decode['read_gb_per_s'] / sequential['gb_per_s']:.0%} of it"
    return line


def _llama_line(llama: dict[str, Any], phases: list[dict[str, Any]]) -> str:
    prefill, decode = phases
    ratio = (
        f"{decode['tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x"
        if llama["decode_tokens_per_s"]
        else "n/a"
    )
    line = (
        f"llama.cpp (mmap, {llama['threads']} threads): prefill {llama['prefill_tokens_per_s']:.2f} tok/s, "
        f"decode {llama['decode_tokens_per_s']:.2f} tok/s; k3stream decode speed is {ratio} llama.cpp's, "
        f"prefill {prefill['tokens_per_s'] / llama['prefill_tokens_per_s']:.2f}x"
    )
    # the median step: steadier than a short phase's total on a busy machine, where one delayed step moves it
    if llama["median_step_ms"] and decode.get("median_step_ms"):
        ours, theirs = decode["median_step_ms"], llama["median_step_ms"]
        line += f"; median decode step {ours:.3f} ms, llama.cpp's {theirs:.3f} ms ({theirs / ours:.2f}x)"
    return line


def _peak_line(expert_bytes: dict[str, Any]) -> str:
    parts = [
        f"{tier} {format_mib(expert_bytes['peak_resident'].get(tier, 0))} (budget {format_mib(budget)})"
        for tier, budget in expert_bytes["budget"].items()
    ]
    return (
        f"expert bytes at most: {', '.join(parts)}; host expert buffers alive at most "
        f"{format_mib(expert_bytes['peak_live_host'])}"
    )
