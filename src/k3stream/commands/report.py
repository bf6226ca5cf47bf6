"""The statistics a generation reports (generate, chat, demo): speed, cache hits, pack reads."""

from __future__ import annotations

import sys
from typing import Any

MIB = 1 << 20


def store_snapshot(store: Any) -> dict[str, Any] | None:
    """The store's counters before a generation (None without a store), for `statistics_lines`."""
    from k3stream.engine.bench import store_counters

    return store_counters(store) if store is not None else None


def statistics_lines(result: Any, store: Any, start: dict[str, Any] | None, tokens: int) -> list[str]:
    """Speed, cache hits per tier and pack reads of one generation of `tokens` forwarded tokens."""
    t = result.timings
    # the first token comes from the prefill: with one token there was no decode step to rate
    decode = (
        f"decode {result.completion_tokens} tokens at {t['decode_tokens_per_s']:.1f} tok/s"
        if result.completion_tokens > 1
        else f"{result.completion_tokens} token from the prefill, no decode step"
    )
    lines = [
        f"speed   prefill {result.prompt_tokens - result.cached_tokens} tokens at "
        f"{t['prefill_tokens_per_s']:.1f} tok/s, {decode} (finish: {result.finish_reason})"
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
        f"{delta['bytes_per_token'] / 1024:.1f} KiB per token, {delta['read_gb_per_s']:.3g} GB/s"
    )
    return lines


def format_mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def report(lines: list[str]) -> None:
    """Statistics on stderr, so that stdout holds only the generated text."""
    print("\n".join(lines), file=sys.stderr)
