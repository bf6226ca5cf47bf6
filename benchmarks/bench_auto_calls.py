"""What tool_choice auto's lazy section grammar costs: per request, per token before a section, per token
inside one.

    python benchmarks/bench_auto_calls.py [--vocab 163840] [--repeats 5]

On the tiny Kimi vocabulary padded to `--vocab` ids (the real model has 163,840), with the server's
`GrammarCompiler` (its llguidance vocabulary built once, as a server builds it): for requests of 1 to 128
function tools, the milliseconds to compile the section grammar of a request (`tool_calls_grammar` over
every tool, the model's own JSON layout); the microseconds per token of `LazySections` before the model
opens a section, beside those of one grammar that holds the free text and the section together (what
llguidance would compute for the same answer without the trigger); and the microseconds per token
inside the section (mask + advance), JSON in the model's own layout beside compact JSON. The fastest
of `--repeats` runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from k3stream.gguf.vocab import padded
from k3stream.server.grammar import (
    JSON_DEFAULTS,
    OPENED_JSON,
    Constraint,
    GrammarCompiler,
    LazySections,
    tool_calls_grammar,
)
from k3stream.testing.tinyvocab import tiny_vocab
from k3stream.train.vocab import vocab_tokenizer

SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_COUNTS = (1, 8, 32, 128)
FREE_TEXT = "The quick brown fox jumps over the lazy dog; " * 8


def tool_schema(index: int) -> dict:
    """A schema of the kind agents send: strings, an enum, bounded numbers, an array, an optional key."""
    return {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": f"file {index}"},
            "mode": {"type": "string", "enum": ["read", "write", "append"]},
            "lines": {"type": "integer", "minimum": 1, "maximum": 10_000},
            "tags": {"type": "array", "items": {"type": "string"}},
            "force": {"type": "boolean"},
        },
        "required": ["path", "mode"],
        "additionalProperties": False,
    }


def tools(count: int) -> list[tuple[str, dict]]:
    return [(f"tool_{index}", tool_schema(index)) for index in range(count)]


def call_text(arguments: str) -> str:
    return (
        f"{SECTION_BEGIN}<|tool_call_begin|>functions.tool_0:0<|tool_call_argument_begin|>{arguments}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )


LAID_OUT = '{\n  "path": "src/main.py",\n  "mode": "read",\n  "lines": 120,\n  "tags": ["a", "b"]\n}'
COMPACT = '{"path":"src/main.py","mode":"read","lines":120,"tags":["a","b"]}'


def fastest_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def per_token_us(make: Callable[[], object], tokens: list[int], repeats: int) -> float:
    """The fastest run's microseconds per token of `allowed()` then `advance(token)` over `tokens`, a
    fresh constraint from `make` each run (its making not timed), after one run untimed (llguidance's
    first masks in a process build caches its later ones share)."""
    times = []
    for _ in range(repeats + 1):
        constraint = make()
        started = time.perf_counter()
        for token in tokens:
            constraint.allowed()
            constraint.advance(token)
        times.append((time.perf_counter() - started) / len(tokens))
    return 1e6 * min(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=163_840, help="pad the vocabulary to this many ids")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = vocab_tokenizer(padded(tiny_vocab(), args.vocab))
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_id])
    started = time.perf_counter()
    compiler.constraint(json.dumps({"grammars": [{"lark_grammar": "start: /a/"}]}), "warm")
    print(f"vocabulary {tokenizer.vocab_size} ids, built in {time.perf_counter() - started:.2f} s (once)")

    print("\ncompile per request (ms): tools, parallel calls, one call")
    for count in TOOL_COUNTS:
        listed = tools(count)

        def compiled(parallel: bool, listed: list = listed) -> Constraint:
            grammar = tool_calls_grammar(listed, parallel=parallel, json_options=OPENED_JSON)
            return compiler.constraint(grammar, "tools")

        parallel_ms = fastest_ms(lambda: compiled(True), args.repeats)
        single_ms = fastest_ms(lambda: compiled(False), args.repeats)
        print(f"{count:>5} {parallel_ms:>9.1f} {single_ms:>9.1f}", flush=True)

    encode = lambda text: tokenizer.encode(text, allow_special=True, add_bos=False)  # noqa: E731
    section = tool_calls_grammar(tools(8), parallel=True, json_options=OPENED_JSON)
    trigger = tokenizer.token_id(SECTION_BEGIN)
    free = encode(FREE_TEXT)
    lazy_us = per_token_us(lambda: LazySections(compiler.constraint(section, "tools"), trigger), free, 20)
    rules = json.loads(section)
    rules["grammars"][0]["lark_grammar"] = rules["grammars"][0]["lark_grammar"].replace(
        "start:", "start: TEXT section\nTEXT: /(?s:.*)/\nsection:", 1
    )
    whole = json.dumps(rules)
    whole_us = per_token_us(lambda: compiler.constraint(whole, "tools"), free, args.repeats)
    print(f"\nbefore a section, {len(free)} tokens of text (us/token): lazy {lazy_us:.2f}, ", end="")
    print(f"one grammar {whole_us:.1f}")

    print("\ninside a section of 8 tools (us/token): JSON options, arguments, tokens, us/token")
    compact_section = tool_calls_grammar(tools(8), parallel=True, json_options=JSON_DEFAULTS)
    cases = (
        ("own layout", section, LAID_OUT),
        ("own layout", section, COMPACT),
        ("compact", compact_section, COMPACT),
    )
    for options, grammar, arguments in cases:
        tokens = encode(call_text(arguments))
        cost = per_token_us(
            lambda grammar=grammar: compiler.constraint(grammar, "tools"), tokens, args.repeats
        )
        shape = "laid out" if arguments == LAID_OUT else "compact"
        print(f"{options:>10} {shape:>9} {len(tokens):>6} {cost:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
