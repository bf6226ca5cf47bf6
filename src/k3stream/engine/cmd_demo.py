"""`k3stream demo`: make a tiny audited-recipe Kimi-K3 (once), pack its experts (once), and generate from a
chat prompt with the experts streamed from the pack through a RAM budget smaller than the pack."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from k3stream.engine.cmd_generate import format_mib
from k3stream.engine.loading import add_sampling_arguments, add_store_arguments

MIB = 1 << 20
DEFAULT_PROMPT = "What does a mixture-of-experts model keep on disk?"
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
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (default %(default)r)")
    parser.add_argument(
        "--ram-mib",
        type=float,
        default=None,
        help=f"expert RAM budget (default {BUDGET_FRACTION:.0%}% of the pack)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the tiny model's matrices are too small to share out)",
    )
    add_store_arguments(parser)
    add_sampling_arguments(parser, max_tokens=32)
    # the prompt goes through the chat template, like `generate --chat`
    parser.set_defaults(seed=0, chat=True, system=None, thinking=False)


# ---- the cached model and pack --------------------------------------------------------------------


@dataclass(frozen=True)
class DemoModel:
    gguf: Path
    pack: Path
    manifest: Path
    made_s: float | None  # None: found in the cache
    packed_s: float | None


def demo_spec() -> Any:
    from k3stream.tiny import TinySpec

    return TinySpec(**DEMO_SPEC_FIELDS)


def model_folder(cache_dir: Path) -> Path:
    """One folder per demo spec, so a changed spec never reuses an old model."""
    digest = hashlib.sha256(repr(demo_spec()).encode()).hexdigest()[:12]
    return cache_dir / f"tiny-audited-{digest}"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Two demos starting together make and pack the model once."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "demo.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare_demo_model(cache_dir: Path) -> DemoModel:
    """The demo GGUF and its pack in `cache_dir`, made and packed only when missing."""
    from k3stream.pack.builder import BuildOptions, build_pack, default_outputs
    from k3stream.tiny import make_tiny, shard_paths

    folder = model_folder(cache_dir)
    with _locked(folder):
        gguf = shard_paths(folder, 1)[0]
        made_s = packed_s = None
        if not gguf.is_file():
            started = time.perf_counter()
            make_tiny(folder, demo_spec())
            made_s = time.perf_counter() - started
        pack, manifest = default_outputs([gguf])
        if made_s is not None or not manifest.is_file():
            # the manifest is written last: without it, anything there is an unfinished build
            options = BuildOptions(force=True, progress=False, margin_bytes=64 * MIB)
            packed_s = build_pack(gguf, options=options, profile="audited").seconds
    return DemoModel(gguf, pack, manifest, made_s, packed_s)


# ---- run --------------------------------------------------------------------------------------------


def _took(seconds: float | None, verb: str) -> str:
    return "(cached)" if seconds is None else f"({verb} in {seconds:.1f} s)"


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    import torch

    from k3stream.engine.cmd_generate import chat_stop_token_ids, prompt_ids, statistics_lines, store_snapshot
    from k3stream.engine.generate import generate
    from k3stream.engine.loading import StoreOptions, load_runtime, sampling_params
    from k3stream.pack.reader import ExpertPack

    params = sampling_params(args)  # bad flags fail before anything is made
    torch.set_num_threads(args.threads)
    demo = prepare_demo_model(args.cache_dir or default_cache_dir())
    with ExpertPack(demo.manifest) as pack:
        expert_bytes = _expert_bytes(pack)
    ram_mib = args.ram_mib if args.ram_mib is not None else round(BUDGET_FRACTION * expert_bytes / MIB, 1)
    print(f"model   {demo.gguf} {_took(demo.made_s, 'made')}")
    print(f"pack    {demo.pack}: {format_mib(expert_bytes)} of experts {_took(demo.packed_s, 'packed')}")
    runtime = load_runtime(
        demo.manifest, device="cpu", ram_mib=ram_mib, store_options=StoreOptions.from_args(args)
    )
    try:
        print(f"budget  expert RAM {ram_mib:g} MiB, {ram_mib * MIB / expert_bytes:.0%} of the pack's experts")
        tokenizer = runtime.tokenizer
        ids = prompt_ids(tokenizer, args, args.prompt)
        print(f"prompt  {args.prompt!r} ({len(ids)} tokens with the chat template)\n")
        params = replace(params, stop_token_ids=chat_stop_token_ids(tokenizer, args.thinking))
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
