"""Per-token cost of the candidate grammar libraries on the tiny Kimi vocabulary (issue 15's choice).

    python benchmarks/bench_grammar.py [--repeats 5] [--vocab N]

For each installed library (llguidance, xgrammar, outlines-core): compile a JSON schema against the
tiny model's vocabulary (byte strings, ranks = ids, Kimi special tokens), then walk the tokens of a
valid instance computing the allowed-token mask before every token and advancing by it. Prints the
set-up time (vocabulary and schema compile, imports excluded) and the median microseconds per token
(mask + advance) over `--repeats` walks. `--vocab` pads the vocabulary with unused ids, as Kimi's
converter pads (the real model has 163,840 ids).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable

import torch

from k3stream.engine.tokenizer import Tokenizer
from k3stream.gguf.vocab import padded
from k3stream.testing.tinyvocab import tiny_vocab
from k3stream.train.vocab import vocab_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "units", "tags"],
    "additionalProperties": False,
}
INSTANCE = '{"city":"The quick brown fox jumps over the lazy dog","days":7,"units":"metric",' + (
    '"tags":["expert","pack","cache","layer","stream"]}'
)


def tokenizer(vocab_size: int | None) -> Tokenizer:
    return vocab_tokenizer(tiny_vocab() if vocab_size is None else padded(tiny_vocab(), vocab_size))


def vocab_bytes(tok: Tokenizer) -> list[bytes]:
    return [tok.piece(i) for i in range(tok.vocab_size)]


def llguidance_walker(tok: Tokenizer) -> Callable[[list[int]], None]:
    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding

    lltok = lltokenizer_from_encoding(tok.encoding, n_vocab=tok.vocab_size, eos_token=tok.eos_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)

    def walk(tokens: list[int]) -> None:
        matcher = llguidance.LLMatcher(lltok, grammar)
        for token in tokens:
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
            assert matcher.consume_token(token), matcher.get_error()

    return walk


def xgrammar_walker(tok: Tokenizer) -> Callable[[list[int]], None]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab_bytes(tok), vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def walk(tokens: list[int]) -> None:
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokens:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(token)

    return walk


def outlines_walker(tok: Tokenizer) -> Callable[[list[int]], None]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    ids: dict[bytes, list[int]] = {}
    for token_id, piece in enumerate(vocab_bytes(tok)):
        if piece and token_id not in tok._special_pieces:
            ids.setdefault(piece, []).append(token_id)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), Vocabulary(tok.eos_id, ids))
    mask = torch.zeros((tok.vocab_size + 31) // 32, dtype=torch.int32)

    def walk(tokens: list[int]) -> None:
        guide = Guide(index)
        for token in tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(token)

    return walk


WALKERS = {"llguidance": llguidance_walker, "xgrammar": xgrammar_walker, "outlines-core": outlines_walker}
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=None, help="pad the vocabulary to this many ids")
    args = parser.parse_args()
    tok = tokenizer(args.vocab)
    tokens = tok.encode_plain(INSTANCE)
    print(f"vocabulary {tok.vocab_size} ids; instance {len(tokens)} tokens; torch {torch.__version__}")
    print(f"{'library':>14} {'set-up ms':>11} {'us/token':>9}")
    for name, make in WALKERS.items():
        try:
            importlib.import_module(MODULES[name])  # import time is not the library's per-request cost
        except ImportError as exc:
            print(f"{name:>14} not installed ({exc})")
            continue
        started = time.perf_counter()
        walk = make(tok)
        compile_ms = 1000 * (time.perf_counter() - started)
        walk(tokens)  # warm caches
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            walk(tokens)
            times.append((time.perf_counter() - started) / len(tokens))
        print(f"{name:>14} {compile_ms:>11.1f} {1e6 * statistics.median(times):>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
