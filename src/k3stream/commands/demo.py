"""`k3stream demo`: pack the shipped trained Kimi-K3 (`k3stream/data`, audited recipe, trained on the
Python standard library by `k3stream train-tiny`) once and continue a Python prompt with its experts
streamed from the pack through a RAM budget smaller than the pack. `--random` makes, packs and runs a
random tiny audited model from a chat prompt instead."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3stream.commands.flags import (
    add_sampling_arguments,
    add_store_arguments,
    non_negative,
    threads,
    with_ends,
)
from k3stream.commands.report import format_mib

MIB = 1 << 20
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
RANDOM_PROMPT = "What does a mixture-of-experts model keep on disk?"
TRAINED_GGUF = Path(__file__).resolve().parent.parent / "data" / "k3-stdlib-audited.gguf"
BUDGET_FRACTION = 0.4  # of the pack's expert bytes: most experts stream from disk

# K-quant rows are 256 values (latent, expert_ff, kv_lora) and Q4_0 rows 32 (qk_nope). 32 experts in
# each of 5 MoE layers: a 12 MiB pack; small enough to make in seconds, big enough to need streaming.
DEMO_SPEC_FIELDS: dict[str, Any] = dict(
    recipe="audited",
    n_layers=6,
    n_experts=32,
    top_k=4,
    expert_ff=256,
    latent=256,
    kv_lora=256,
    qk_nope=32,
    seed=2026,
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k3stream" / "demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="where the model and pack live (~/.cache/k3stream/demo)"
    )
    parser.add_argument(
        "--prompt",
        "-p",
        default=None,
        help=f"text to continue (default {DEFAULT_PROMPT!r}; with --random a chat message)",
    )
    parser.add_argument(
        "--random",
        action="store_true",
        help="a random tiny model from a chat prompt instead of the trained one",
    )
    parser.add_argument(
        "--ram-mib",
        type=non_negative,
        default=None,
        help=f"expert RAM budget (default {BUDGET_FRACTION:.0%}% of the pack)",
    )
    parser.add_argument(
        "--threads",
        "-t",
        type=threads,
        default=1,
        help="torch CPU threads (default 1: the tiny model's matrices are too small to share out; "
        "0 or less: every core)",
    )
    add_store_arguments(parser)
    add_sampling_arguments(parser, max_tokens=48)
    parser.set_defaults(seed=0, temperature=0.6, system=None, thinking=False)


# ---- the cached model and pack --------------------------------------------------------------------


@dataclass(frozen=True)
class DemoModel:
    gguf: Path
    pack: Path
    manifest: Path
    made_s: float | None  # None: found in the cache
    packed_s: float | None
    trained: bool


def demo_spec() -> Any:
    from k3stream.gguf.writer import TinySpec

    return TinySpec(**DEMO_SPEC_FIELDS)


def model_folder(cache_dir: Path, trained: bool = True) -> Path:
    """One folder per demo model (the shipped file's bytes, or the random spec and the chat template its
    file is written with), so a changed model never reuses an old pack or file."""
    from k3stream.gguf.vocab import CHAT_TEMPLATE

    if trained:
        return cache_dir / f"trained-{_file_digest(TRAINED_GGUF)}"
    digest = hashlib.sha256(repr((demo_spec(), CHAT_TEMPLATE)).encode()).hexdigest()[:12]
    return cache_dir / f"tiny-audited-{digest}"


def _file_digest(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the shipped trained model is missing (reinstall k3stream)")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Two demos starting together make and pack the model once."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "demo.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare_demo_model(cache_dir: Path, trained: bool = True) -> DemoModel:
    """The demo GGUF (the shipped one copied, or a random one made) and its pack in `cache_dir`, made and
    packed only when missing."""
    from k3stream.gguf.writer import shard_paths
    from k3stream.pack.builder import BuildOptions, build_pack, default_outputs
    from k3stream.testing.tiny import make_tiny

    folder = model_folder(cache_dir, trained)
    with _locked(folder):
        gguf = folder / TRAINED_GGUF.name if trained else shard_paths(folder, 1)[0]
        made_s = packed_s = None
        if not gguf.is_file():
            started = time.perf_counter()
            if trained:
                _copy(TRAINED_GGUF, gguf)
            else:
                make_tiny(folder, demo_spec())
            made_s = time.perf_counter() - started
        pack, manifest = default_outputs([gguf])
        if made_s is not None or not manifest.is_file():
            # the manifest is written last: without it, anything there is an unfinished build
            options = BuildOptions(force=True, progress=False, margin_bytes=64 * MIB)
            packed_s = build_pack(gguf, options=options, profile="audited").seconds
    return DemoModel(gguf, pack, manifest, made_s, packed_s, trained)


def demo_gguf() -> Path:
    """The shipped demo model's GGUF in the default cache, its pack beside it, made on first use: what
    the source name `demo` stands for in every command."""
    demo = prepare_demo_model(default_cache_dir())
    if demo.packed_s is not None:
        print(f"k3stream: the demo model is packed in {default_cache_dir()}", file=sys.stderr)
    return demo.gguf


def _copy(source: Path, target: Path) -> None:
    """Copy through a temp file, so an interrupted copy never looks like the model."""
    import shutil

    temp = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, temp)
    os.replace(temp, target)


# ---- run --------------------------------------------------------------------------------------------


def _took(seconds: float | None, verb: str) -> str:
    return "(cached)" if seconds is None else f"({verb} in {seconds:.1f} s)"


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import torch

    from k3stream.commands.flags import (
        load_options,
        prompt_ids,
        sampling_params,
        store_options,
        thread_count,
    )
    from k3stream.commands.report import statistics_lines, store_snapshot
    from k3stream.engine.chat import chat_stop_token_ids
    from k3stream.engine.generate import generate
    from k3stream.engine.loading import load_runtime
    from k3stream.pack.reader import ExpertPack

    params = sampling_params(args)  # bad flags fail before anything is made
    threads = thread_count(args.threads)
    if threads:
        torch.set_num_threads(threads)
    demo = prepare_demo_model(args.cache_dir or default_cache_dir(), trained=not args.random)
    args.chat = not demo.trained  # the trained model continues code; the random one gets a chat prompt
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT if demo.trained else RANDOM_PROMPT
    with ExpertPack(demo.manifest) as pack:
        expert_bytes = _expert_bytes(pack)
    ram_mib = args.ram_mib if args.ram_mib is not None else round(BUDGET_FRACTION * expert_bytes / MIB, 1)
    kind = "trained on the Python standard library" if demo.trained else "random weights"
    print(f"model   {demo.gguf} ({kind}) {_took(demo.made_s, 'copied' if demo.trained else 'made')}")
    print(f"pack    {demo.pack}: {format_mib(expert_bytes)} of experts {_took(demo.packed_s, 'packed')}")
    runtime = load_runtime(demo.manifest, load_options(args, ram_mib), store_options=store_options(args))
    try:
        print(f"budget  expert RAM {ram_mib:g} MiB, {ram_mib * MIB / expert_bytes:.0%} of the pack's experts")
        tokenizer = runtime.tokenizer
        ids = prompt_ids(tokenizer, args, prompt)
        template = " with the chat template" if args.chat else ""
        print(f"prompt  {prompt!r} ({len(ids)} tokens{template})\n")
        params = with_ends(
            params, tokenizer, chat_stop_token_ids(tokenizer, args.thinking) if args.chat else ()
        )
        if not args.chat:
            _write(prompt)
        start = store_snapshot(runtime.store)
        result = generate(runtime.model, tokenizer, ids, params, on_text=_write)
        print("\n")
        tokens = runtime.end_generation(result)
        print("\n".join(statistics_lines(result, runtime.store, start, tokens)))
    finally:
        runtime.close()
    return 0


def _expert_bytes(pack: Any) -> int:
    return len(pack.moe_layers) * pack.num_experts * pack.object_bytes
