"""`k3stream generate MODEL --prompt TEXT`: stream a completion to stdout, statistics to stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3stream.commands.flags import (
    STDIN,
    add_cache_arguments,
    add_context_argument,
    add_escape_argument,
    add_model_arguments,
    add_parallel_arguments,
    add_sampling_arguments,
    add_system_arguments,
    prompt_file_text,
    prompt_ids,
    reached_tokens,
    sampling_params,
    size_context,
    system_prompt,
    user_text,
    with_ends,
)
from k3stream.commands.report import report, statistics_lines, store_snapshot
from k3stream.engine.chat import chat_stop_token_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_context_argument(parser, "the prompt plus --max-tokens")  # `size_context`
    add_parallel_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", help="the prompt ('-' reads it from stdin)")
    source.add_argument(
        "--file", "-f", type=Path, help="a file holding the prompt (UTF-8), as llama-cli's ('-': stdin)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the chat template"
    )
    add_system_arguments(parser, " (implies --chat)")
    parser.add_argument(
        "--thinking", action="store_true", help="open the think channel (Kimi-K3 templates; implies --chat)"
    )
    add_escape_argument(parser, "the prompt and --stop strings")
    add_sampling_arguments(parser, max_tokens=128)
    add_cache_arguments(parser, ram_mib=None)  # off unless asked: a prompt reused across runs (--cache-dir)


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt: `--prompt`, stdin for `--prompt -`, or the text of `--file` (`prompt_file_text`; stdin's
    for `--file -`)."""
    if args.file is None:
        return sys.stdin.read() if args.prompt == STDIN else args.prompt
    return prompt_file_text(args.file, "--file")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class _Completion:
    """The completion's stream to stdout, and whether any text reached it."""

    def __init__(self) -> None:
        self.started = False

    def __call__(self, text: str) -> None:
        self.started = self.started or bool(text)
        _write(text)


def run(args: argparse.Namespace) -> int:
    from k3stream.commands.flags import cache_from_args
    from k3stream.commands.launch import parallel_runtime, report_ranks
    from k3stream.engine.generate import generate
    from k3stream.engine.loading import open_model
    from k3stream.engine.tokenizer import Tokenizer

    args.system = system_prompt(args)
    text = prompt_text(args)
    # llama-cli's escapes (its default), for the prompt however given and the stop strings
    text = user_text(text, "--prompt" if args.file is None else "--file", args.escape)
    args.stop = [user_text(stop, "--stop", args.escape) for stop in args.stop]
    args.chat = args.chat or args.system is not None or args.thinking  # they mean the chat template
    params = sampling_params(args)  # bad flags fail before the model loads
    opened = open_model(args.model, not args.no_stream_experts)
    prompt = prompt_ids(Tokenizer.from_gguf(opened[0]), args, text)
    size_context(args, opened[0].config, reached_tokens(args, len(prompt)))
    with parallel_runtime(args, opened=opened) as runtime:  # under torchrun: rank 0 generates
        if runtime is None:
            return 0
        tokenizer = runtime.tokenizer
        stops = chat_stop_token_ids(tokenizer, args.thinking) if args.chat else ()
        params = with_ends(params, tokenizer, stops)
        cache = cache_from_args(args, runtime.model)
        start = store_snapshot(runtime.store)
        completion = _Completion()
        try:
            result = generate(
                runtime.model,
                tokenizer,
                prompt,
                params,
                on_text=completion,
                cache=cache,
                context=args.ctx,
            )
        except KeyboardInterrupt:  # Ctrl-C: the text so far ends its line, as llama-cli ends it
            if completion.started:
                _write("\n")
            raise
        finally:
            if cache is not None:
                cache.close()  # its snapshot files, for the next run
        _write("\n")
        tokens = runtime.end_generation(result)
        reused = [f"cache   {result.cached_tokens} of {result.prompt_tokens} prompt tokens reused"]
        report(statistics_lines(result, runtime.store, start, tokens) + reused * bool(cache))
        report_ranks(runtime, tokens)
    return 0
