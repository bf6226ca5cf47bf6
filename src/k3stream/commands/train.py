"""`k3stream train-tiny OUT_DIR`: learn a vocabulary and train a small Kimi-K3 on the standard library.

Writes into OUT_DIR: `k3-stdlib-RECIPE.gguf` per recipe, `held-out.txt` (the start of the held-out
files, for `k3stream perplexity`) and `train.json` (the command, seed, shapes, figures).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from k3stream.cli import UsageError
from k3stream.commands.flags import threads

if TYPE_CHECKING:
    import numpy as np

    from k3stream.gguf.vocab import Vocab
    from k3stream.gguf.writer import TinySpec

MIB = 1 << 20
STEM = "k3-stdlib"
HELD_OUT_TEXT_BYTES = 256 * 1024
EVAL_WINDOWS = 16

# The shipped model's shape: every K-quant row 256 values (latent, expert_ff, kv_lora), qk_nope a
# multiple of 32, so the audited recipe applies; 16 experts, top-2, in 3 MoE layers after a dense one;
# KDA layers 0-2, MLA layer 3.
TRAIN_SPEC_FIELDS: dict[str, object] = dict(
    n_layers=4,
    hidden=64,
    dense_ff=192,
    kda_heads=4,
    kda_head_dim=16,
    mla_heads=4,
    q_lora=32,
    kv_lora=256,
    qk_nope=32,
    qk_rope=8,
    v_head_dim=16,
    n_experts=16,
    top_k=2,
    expert_ff=256,
    latent=256,
    context_length=1024,
)
# TinySpec fields that are not shape flags here
NOT_SHAPE = ("recipe", "shards", "seed", "vocab", "release_matrices")  # --recipes has no mixed recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3stream.commands.make_tiny import field_parser, flag_of, spec_flag_text
    from k3stream.gguf.writer import TinySpec
    from k3stream.train.trainer import TrainOptions

    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path, help="where the GGUFs and train.json go")
    defaults = TrainOptions()
    flags = [
        ("--minutes", float, defaults.minutes, "wall-clock cap on training"),
        ("--steps", int, defaults.steps, "optimizer steps (the lr schedule)"),
        ("--seed", int, defaults.seed, "initial weights and batches"),
        ("--seq-len", int, defaults.seq_len, "tokens per training sequence"),
        ("--batch", int, defaults.batch, "sequences per step"),
        ("--lr", float, defaults.lr, "peak learning rate (AdamW)"),
        ("--warmup", int, defaults.warmup, "steps of linear lr warm-up"),
        ("--bias-rate", float, defaults.bias_rate, "router bias step"),
        ("--vocab-size", int, 2048, "tokens: 256 bytes, merges, specials"),
        ("--threads", threads, 1, "torch CPU threads (on shared cores one is the fastest)"),
        ("--recipes", str, "f32,audited", "GGUFs to write (f32, f16, audited)"),
    ]
    for flag, parse, default, words in flags:
        parser.add_argument(flag, type=parse, default=default, help=f"{words} (default {default})")
    parser.add_argument("--text-mib", type=float, default=None, help="read at most this much training text")
    for spec_field in dataclasses.fields(TinySpec):
        if spec_field.name in NOT_SHAPE:
            continue
        default = TRAIN_SPEC_FIELDS.get(spec_field.name, spec_field.default)
        parser.add_argument(
            flag_of(spec_field.name),
            dest=spec_field.name,
            type=field_parser(spec_field),
            default=default,
            **spec_flag_text(spec_field, default),
        )


def check_training_flags(args: argparse.Namespace) -> None:
    """One line naming the flag, before the corpus is read (torch's and numpy's words name none: a
    batch of 0 was a ZeroDivisionError traceback, a sequence of 0 'expected a non-empty list')."""
    from k3stream.engine.sampling import SEEDS

    counts = {
        "--steps": args.steps,
        "--seq-len": args.seq_len,
        "--batch": args.batch,
        "--threads": args.threads,
    }
    for flag, value in counts.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if not 0 <= args.seed < SEEDS.stop:  # torch's generator takes it; the GGUF writer's takes no negative
        raise UsageError(f"--seed must be in [0, 2^64), got {args.seed}")
    if args.warmup < 0 or not args.lr > 0 or not args.minutes > 0:
        raise UsageError(
            "--warmup must be >= 0, --lr and --minutes above 0, "
            f"got {args.warmup}, {args.lr} and {args.minutes}"
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from k3stream.commands.make_tiny import in_flag_words
    from k3stream.gguf.writer import RECIPES, check_free_space, check_out_dir, tensor_data_nbytes

    check_training_flags(args)
    recipes = [r for r in args.recipes.split(",") if r]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise UsageError(f"--recipes: {args.recipes!r}: choose from {', '.join(RECIPES)}")
    # before an hour of training, not after it: every recipe's shapes, and room for all the files
    try:
        spec = spec_from_args(args)
        sizes = [tensor_data_nbytes(dataclasses.replace(spec, recipe=r), args.vocab_size) for r in recipes]
    except ValueError as error:
        raise UsageError(str(in_flag_words(error))) from None
    check_out_dir(args.out_dir)
    check_free_space(args.out_dir, sum(sizes))
    torch.set_num_threads(args.threads)
    record = train_tiny(args, spec, recipes)
    print(f"held-out perplexity {record['held_out_ppl']:.2f} ({record['held_out_tokens']} tokens)")
    return 0


def spec_from_args(args: argparse.Namespace) -> TinySpec:
    """The `TinySpec` the shape flags and `--seed` describe."""
    from k3stream.gguf.writer import TinySpec

    shape = {f.name: getattr(args, f.name) for f in dataclasses.fields(TinySpec) if f.name not in NOT_SHAPE}
    return TinySpec(**shape, seed=args.seed)


def train_tiny(args: argparse.Namespace, spec: TinySpec, recipes: list[str]) -> dict[str, object]:
    """Corpus, vocabulary, training, evaluation, GGUFs and train.json; returns the record."""
    import numpy as np
    import torch

    from k3stream.train.corpus import read_texts, split_corpus
    from k3stream.train.trainer import Parameters, TrainOptions, evaluate, train
    from k3stream.train.vocab import learn_vocab, vocab_tokenizer

    started = time.perf_counter()
    corpus = split_corpus()
    max_bytes = None if args.text_mib is None else int(args.text_mib * MIB)
    texts = read_texts(corpus.root, corpus.train, max_bytes)
    held_out = read_texts(corpus.root, corpus.held_out, HELD_OUT_TEXT_BYTES)
    vocab = learn_vocab(texts, args.vocab_size)
    tokenizer = vocab_tokenizer(vocab)
    train_tokens = _tokens(tokenizer, texts, vocab.eos_id)
    held_tokens = _tokens(tokenizer, held_out, vocab.eos_id)
    print(
        f"corpus  {len(texts)} train files ({sum(map(len, texts)) / MIB:.1f} MiB, "
        f"{len(train_tokens)} tokens), "
        f"{len(corpus.held_out)} held out; vocabulary {len(vocab.tokens)} tokens "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    options = TrainOptions(
        steps=args.steps,
        minutes=args.minutes,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        bias_rate=args.bias_rate,
        seed=args.seed,
    )
    params = Parameters(spec, len(vocab.tokens))
    log = train(params, train_tokens, options, _reporter(max(1, options.steps // 40)))
    held_nll = evaluate(params, held_tokens, options.seq_len, EVAL_WINDOWS)
    record = {
        "command": "k3stream " + shlex.join(sys.argv[1:]),
        "seed": args.seed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "train_files": len(texts),
            "held_out_files": len(corpus.held_out),
            "train_bytes": sum(len(t.encode()) for t in texts),
            "train_tokens": int(len(train_tokens)),
        },
        "vocab_size": len(vocab.tokens),
        "spec": dataclasses.asdict(spec),
        "options": dataclasses.asdict(options),
        "steps": log.steps,
        "train_seconds": round(log.seconds, 1),
        "tokens_seen": log.steps * options.batch * options.seq_len,
        "first_loss": round(log.losses[0], 4),
        "final_loss": round(float(np.mean(log.losses[-20:])), 4),
        "held_out_nll": round(held_nll, 4),
        "held_out_ppl": round(float(np.exp(held_nll)), 3),
        "held_out_tokens": EVAL_WINDOWS * options.seq_len,
        "max_load_ratio": round(log.max_load_ratio, 3),
        "files": {r: gguf_name(r) for r in recipes},
    }
    with staged_outputs(args.out_dir) as staging:
        for recipe in recipes:
            write_gguf(staging, spec, recipe, vocab, params.gguf_arrays())
        (staging / "held-out.txt").write_text(_held_out_text(held_out), encoding="utf-8")
        (staging / "train.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


@contextlib.contextmanager
def staged_outputs(out_dir: Path) -> Iterator[Path]:
    """A folder inside `out_dir` to write every output into; its files move into `out_dir` once all are
    written. A failure (a full disk) leaves the disk as it was: no partial file, and no folder this call
    made."""
    made = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]  # innermost first
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=".train-"))
    try:
        yield staging
        for path in sorted(staging.iterdir()):
            os.replace(path, out_dir / path.name)
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.filename and Path(exc.filename).is_relative_to(staging):
            exc.filename = str(out_dir / Path(exc.filename).relative_to(staging).parts[0])
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            if not any(folder.iterdir()):
                folder.rmdir()


def gguf_name(recipe: str) -> str:
    return f"{STEM}-{recipe}.gguf"


def _tokens(tokenizer, texts: list[str], eos_id: int):
    """The texts' tokens, each file followed by EOS, as one int32 array."""
    import numpy as np

    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode_plain(text)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int32)


def _held_out_text(texts: list[str]) -> str:
    return "".join(texts)[:HELD_OUT_TEXT_BYTES]


def _reporter(every: int):
    def report(log) -> None:
        if log.steps % every == 0 or log.steps == 1:
            recent = log.losses[-every:]
            print(
                f"step {log.steps:5d}  {log.seconds:7.1f} s  loss {sum(recent) / len(recent):.3f}  "
                f"max load {log.max_load_ratio:.2f}x mean",
                flush=True,
            )

    return report


def write_gguf(
    out_dir: Path, spec: TinySpec, recipe: str, vocab: Vocab, weights: dict[str, np.ndarray]
) -> Path:
    """`out_dir/k3-stdlib-RECIPE.gguf` through the GGUF writer."""
    from k3stream.gguf.writer import write_model

    target = out_dir / gguf_name(recipe)
    with tempfile.TemporaryDirectory(dir=out_dir) as temp:
        try:
            written = write_model(temp, dataclasses.replace(spec, recipe=recipe), vocab, weights)
        except OSError as exc:
            exc.filename = str(target)  # the file the user asked for, not the temp folder's
            raise
        os.replace(written, target)
    return target
