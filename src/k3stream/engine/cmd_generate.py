"""`k3stream generate MODEL --prompt TEXT`: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from k3stream.engine.chat import ChatTemplate, chat_stop_token_ids
from k3stream.engine.loading import (
    add_context_argument,
    add_model_arguments,
    add_sampling_arguments,
    sampling_params,
)
from k3stream.parallel.options import add_parallel_arguments

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_context_argument(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the prompt ('-' reads it from stdin)")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the chat template"
    )
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--thinking", action="store_true", help="open the think channel (Kimi-K3 templates)")
    add_sampling_arguments(parser, max_tokens=128)


def prompt_ids(tokenizer: Any, args: argparse.Namespace, text: str) -> list[int]:
    if not args.chat:
        return tokenizer.encode(text)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    rendered = ChatTemplate.for_tokenizer(tokenizer).render(messages, thinking=args.thinking)
    return tokenizer.encode(rendered, allow_special=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def store_snapshot(store: Any) -> dict[str, Any] | None:
    """The store's counters before a generation (None without a store), for `statistics_lines`."""
    from k3stream.engine.bench import store_counters

    return store_counters(store) if store is not None else None


def statistics_lines(result: Any, store: Any, start: dict[str, Any] | None, tokens: int) -> list[str]:
    """Speed, cache hits per tier and pack reads of one generation of `tokens` forwarded tokens."""
    t = result.timings
    lines = [
        f"speed   prefill {result.prompt_tokens} tokens at {t['prefill_tokens_per_s']:.1f} tok/s, "
        f"decode {result.completion_tokens} tokens at {t['decode_tokens_per_s']:.1f} tok/s "
        f"(finish: {result.finish_reason})"
    ]
    if store is None or start is None:
        return lines
    from k3stream.engine.bench import store_counters, store_delta

    delta = store_delta(start, store_counters(store), tokens)
    resident = store.resident_bytes()
    budgets = {name: tier["budget_bytes"] for name, tier in store.stats()["tiers"].items()}
    for name, tier in delta["tiers"].items():
        lines.append(
            f"cache   {name}: {tier['hits']} hits, {tier['misses']} misses, hit rate {tier['hit_rate']:.1%}; "
            f"holds {format_mib(resident[name])} of its {format_mib(budgets[name])} budget"
        )
    prefetch = delta["prefetch"]
    lines.append(
        f"reads   {delta['pack_reads']} experts read from the pack ({prefetch['loads']} read ahead, "
        f"{prefetch['hits'] + prefetch['waits']} of them used), {format_mib(delta['pack_read_bytes'])}: "
        f"{delta['bytes_per_token'] / 1024:.1f} KiB per token, {delta['read_gb_per_s']:.2f} GB/s"
    )
    return lines


def format_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def report(lines: list[str]) -> None:
    """Statistics on stderr, so that stdout holds only the generated text."""
    print("\n".join(lines), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from k3stream.engine.generate import generate
    from k3stream.parallel.runtime import parallel_runtime, report_ranks

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params(args)  # bad flags fail before the model loads
    with parallel_runtime(args) as runtime:  # under torchrun: rank 0 generates, the others follow it
        if runtime is None:
            return 0
        tokenizer = runtime.tokenizer
        stops = chat_stop_token_ids(tokenizer, args.thinking) if args.chat else ()
        start = store_snapshot(runtime.store)
        result = generate(
            runtime.model,
            tokenizer,
            prompt_ids(tokenizer, args, text),
            replace(params, stop_token_ids=stops),
            on_text=_write,
        )
        _write("\n")
        tokens = runtime.end_generation(result)
        report(statistics_lines(result, runtime.store, start, tokens))
        report_ranks(runtime, tokens)
    return 0
