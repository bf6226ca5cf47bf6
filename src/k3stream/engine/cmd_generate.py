"""`k3stream generate MODEL --prompt TEXT`: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from k3stream.engine.loading import (
    add_model_arguments,
    add_sampling_arguments,
    runtime_from_args,
    sampling_params,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the prompt ('-' reads it from stdin)")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the chat template"
    )
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--thinking", action="store_true", help="open the think channel (Kimi-K3 templates)")
    add_sampling_arguments(parser, max_tokens=128)


def chat_stop_token_ids(tokenizer: Any, thinking: bool) -> tuple[int, ...]:
    """Kimi-K3 closes the response channel with `<|close|>` before `<|end_of_msg|>`: stop there."""
    if thinking or "<|close|>" not in tokenizer.special_tokens:
        return ()
    return (tokenizer.token_id("<|close|>"),)


def prompt_ids(tokenizer: Any, args: argparse.Namespace, text: str) -> list[int]:
    if not args.chat:
        return tokenizer.encode(text)
    from k3stream.engine.chat import ChatTemplate

    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    rendered = ChatTemplate.for_tokenizer(tokenizer).render(messages, thinking=args.thinking)
    return tokenizer.encode(rendered, allow_special=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def report(result: Any, store: Any) -> None:
    """Statistics of one generation (and of the expert store) on stderr."""
    t = result.timings
    print(
        f"[k3stream] prompt {result.prompt_tokens} tokens, completion {result.completion_tokens} tokens, "
        f"finish {result.finish_reason}",
        file=sys.stderr,
    )
    print(
        f"[k3stream] prefill {t['prefill_s']:.3f} s ({t['prefill_tokens_per_s']:.1f} tok/s), "
        f"decode {t['decode_s']:.3f} s ({t['decode_tokens_per_s']:.2f} tok/s)",
        file=sys.stderr,
    )
    if store is None:
        return
    store.end_token(result.prompt_tokens + result.completion_tokens - 1)
    stats = store.stats()
    tiers = ", ".join(
        f"{name} hit rate {tier['hit_rate']:.1%} ({tier['resident_experts']} experts, "
        f"{tier['resident_bytes'] / 2**20:.1f} MiB)"
        for name, tier in stats["tiers"].items()
    )
    print(
        f"[k3stream] expert store: {tiers}; pack reads {stats['pack_reads']} "
        f"({stats['pack_read_bytes'] / 2**20:.1f} MiB, {stats['bytes_per_token'] / 2**10:.1f} KiB/token)",
        file=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from k3stream.engine.generate import generate

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params(args)  # bad flags fail before the model loads
    runtime = runtime_from_args(args)
    try:
        tokenizer = runtime.tokenizer
        stops = chat_stop_token_ids(tokenizer, args.thinking) if args.chat else ()
        result = generate(
            runtime.model,
            tokenizer,
            prompt_ids(tokenizer, args, text),
            replace(params, stop_token_ids=stops),
            on_text=_write,
        )
        _write("\n")
        report(result, runtime.store)
    finally:
        runtime.close()
    return 0
