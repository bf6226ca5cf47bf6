"""What the generate/chat commands share: model + tokenizer + expert store from a path, and the flags."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from k3stream.engine.generate import GenerationResult
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.model.k3 import K3Model
    from k3stream.store.expert_store import ExpertStore


def manifest_next_to(gguf_path: Path) -> Path | None:
    """The manifest `k3stream pack` writes beside a GGUF by default, if it is there."""
    from k3stream.gguf.shards import discover_shards
    from k3stream.pack.paths import default_outputs

    _pack, manifest = default_outputs(discover_shards(gguf_path))
    return manifest if manifest.is_file() else None


def manifest_gguf(manifest_path: Path) -> Path:
    """The first GGUF shard a manifest was built from."""
    from k3stream.pack.manifest import first_shard_path, read_json

    return first_shard_path(read_json(manifest_path), manifest_path)


@dataclass
class Runtime:
    """A loaded model with its tokenizer and, when experts stream from a pack, the expert store: what
    every command runs, and what the server extends (`server.runtime.ServedModel`). Tensor parallelism
    puts a stand-in with the K3Model methods in `model` (`parallel.runner.DriverModel`)."""

    model: K3Model
    tokenizer: Tokenizer
    store: ExpertStore | None = None
    manifest: Path | None = None

    def end_generation(self, result: GenerationResult) -> int:
        """Tell the store how many tokens the model forwarded for `result`; returns that count.

        Every token but the last sampled one went through the model."""
        tokens = result.prompt_tokens + result.completion_tokens - 1
        self.end_tokens(tokens)
        return tokens

    def end_tokens(self, n: int) -> None:
        """Tell the store the model forwarded `n` more tokens (its bytes per token)."""
        if self.store is not None:
            self.store.end_token(n)

    def store_stats(self) -> dict[str, Any]:
        """The store's `stats()`; `{}` without a store."""
        return self.store.stats() if self.store is not None else {}

    def batch_limit(self) -> int | None:
        """The most sequences one decode step may hold so that the union of their experts in a layer
        always fits the store's compute tier (each sequence picks top_k experts per layer)."""
        if self.store is None:
            return None
        return max(1, self.store.max_experts_per_fetch // self.store.top_k)

    def model_files(self) -> list[Path]:
        """The files behind the model: every GGUF shard and the pack when experts stream from one, else
        the GGUF the tokenizer came from."""
        if self.store is None:
            return [Path(self.tokenizer.source)]
        pack = self.store.pack
        return list(dict.fromkeys([*pack.gguf_paths, pack.path]))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


@dataclass(frozen=True)
class StoreOptions:
    """How the expert store caches and reads (the `ExpertStore` keywords of the same names)."""

    policy: str = "cycle"
    prefetch: bool = True
    io_threads: int = 4
    direct_io: bool | None = None  # None: O_DIRECT when the pack does not fit the RAM budget
    simulated_read_latency_us: float = 0.0  # sleeps before each pack read: tests and experiments

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StoreOptions:
        return cls(
            policy=args.policy,
            prefetch=not args.no_prefetch,
            io_threads=args.io_threads,
            direct_io=args.direct_io,
        )


def resolve_model(path: str | Path, stream_experts: bool) -> tuple[Path, Path | None]:
    """`(gguf, manifest or None)` for a GGUF or a manifest path; a GGUF uses the manifest beside it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.suffix == ".json":
        return manifest_gguf(path), path if stream_experts else None
    return path, manifest_next_to(path) if stream_experts else None


def open_model(path: str | Path, stream_experts: bool) -> tuple[K3Checkpoint, Path | None]:
    """`(checkpoint, manifest or None)`: `resolve_model`, then the checkpoint opened once
    (`pack.manifest.open_checkpoint`, the seed loader's checks for a manifest), for everything a load
    reads from the GGUF: the memory plan, the pack's config check, the model and the tokenizer."""
    from k3stream.pack.manifest import open_checkpoint

    gguf_path, manifest = resolve_model(path, stream_experts)
    return open_checkpoint(manifest or gguf_path), manifest


def load_runtime(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    ram_mib: float | None = 1024.0,
    gpu_mib: float | None = None,
    stream_experts: bool = True,
    store_options: StoreOptions = StoreOptions(),
) -> Runtime:
    """Load for generation; routed experts stream from the pack when there is a manifest."""
    checkpoint, manifest = open_model(path, stream_experts)
    return load_resolved(
        checkpoint,
        manifest,
        device=device,
        dtype=dtype,
        ram_mib=ram_mib,
        gpu_mib=gpu_mib,
        store_options=store_options,
    )


def load_resolved(
    checkpoint: K3Checkpoint,
    manifest: Path | None,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    ram_mib: float | None = 1024.0,
    gpu_mib: float | None = None,
    store_options: StoreOptions = StoreOptions(),
    match_ggml: bool = False,
    prefetch_hint: str = "auto",
) -> Runtime:
    """`load_runtime` for what `open_model` opened."""
    import torch

    import k3stream
    from k3stream.engine.tokenizer import Tokenizer

    store = None
    if manifest is not None:
        from k3stream.pack.reader import ExpertPack
        from k3stream.store.expert_store import ExpertStore

        pack = ExpertPack(manifest, config=checkpoint.config)
        store = ExpertStore(pack, ram_mib=ram_mib, gpu_mib=gpu_mib, device=device, **asdict(store_options))
    budget = {} if ram_mib is None else {"expert_ram_mib": ram_mib}  # None: `k3stream.load`'s default
    try:
        model = k3stream.load(
            checkpoint,
            **budget,
            device=device,
            dtype=dtype or torch.float32,
            expert_source=store,
            prefetch=store_options.prefetch,
            match_ggml=match_ggml,
            prefetch_hint=prefetch_hint,
        )
        tokenizer = Tokenizer.from_gguf(checkpoint)
    except BaseException:
        if store is not None:
            store.close()
        raise
    return Runtime(model=model, tokenizer=tokenizer, store=store, manifest=manifest)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Kimi-K3 GGUF (any shard) or an expert-pack manifest (.json)")
    parser.add_argument(
        "--ram-mib",
        type=float,
        default=None,
        help="RAM budget of the expert store (MiB); without a pack, the GGUF's routed experts stay in RAM "
        "when all of them fit it; default: what --memory-limit leaves for experts",
    )
    parser.add_argument(
        "--memory-limit",
        metavar="SIZE",
        default=None,
        help="memory k3stream may use (e.g. 1.5GiB, 1536M); sizes the expert RAM budget after non-expert "
        "weights, KV/state and working buffers (default: the memory cgroup's limit, else available RAM)",
    )
    parser.add_argument("--gpu-mib", type=float, default=None, help="GPU budget of the expert store (MiB)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--match-ggml",
        action="store_true",
        help="compute as llama.cpp's CPU backend does: activations quantized to 8 bits against quantized "
        "weights (integer kernels for Q2_K/Q3_K, about 2x faster); default: float32 activations",
    )
    parser.add_argument(
        "--no-stream-experts",
        action="store_true",
        help="serve routed experts from the GGUF mmap even when a pack is there",
    )
    add_store_arguments(parser)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The expert store's flags (they apply when experts stream from a pack)."""
    from k3stream.model.hints import HINT_CHOICES
    from k3stream.store.policies import POLICIES

    defaults = StoreOptions()
    parser.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=defaults.policy,
        help="expert eviction policy (default %(default)s)",
    )
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="no background reads of the experts the next layers may need",
    )
    parser.add_argument(
        "--prefetch-hint",
        choices=list(HINT_CHOICES),
        default="auto",
        help="which prediction is prefetched: a MoE layer's router on its input (pre-attention), on the "
        "previous layer's stream after attention (layer-ahead, a MoE block earlier), the experts the layer "
        "last picked for each token id (token, a MoE layer earlier), or auto: layer-ahead in steps of 8 or "
        "more rows (prefill), token otherwise (default)",
    )
    parser.add_argument(
        "--io-threads", type=int, default=defaults.io_threads, help="pack read threads (default %(default)s)"
    )
    parser.add_argument(
        "--direct-io",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read the pack with O_DIRECT, bypassing the page cache (default: when the pack does not fit "
        "the RAM budget)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help="default %(default)s")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=40, help="0 disables (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95, help="1 disables (default %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.05, help="0 disables (default %(default)s)")
    parser.add_argument("--repeat-penalty", type=float, default=1.0, help="1 disables (default %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> Any:
    """`SamplingParams` from the sampling flags."""
    from k3stream.engine.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )


def _expert_ram_mib(args: argparse.Namespace, checkpoint: K3Checkpoint, manifest: Path | None) -> float:
    """`--ram-mib`, else the budget `--memory-limit` leaves (printed on stderr when a limit was given or
    binds); refuses a limit too small."""
    import sys

    from k3stream.memlimit import (
        MIB,
        default_expert_ram_mib,
        pin_malloc_mmap_threshold,
        plan_for_model,
    )

    if manifest is None and args.memory_limit is None:  # the GGUF's experts, kept in RAM when all fit
        return args.ram_mib if args.ram_mib is not None else default_expert_ram_mib(checkpoint)
    pin_malloc_mmap_threshold()  # expert buffers churn: keep freed ones from bloating the heap
    if args.ram_mib is not None and args.memory_limit is None:
        return args.ram_mib
    cache_bytes = int(getattr(args, "cache_ram", 0) * MIB)  # the prompt cache of serve and chat
    plan = plan_for_model(checkpoint, args.memory_limit, args.io_threads, cache_bytes)
    if args.ram_mib is not None:
        print(f"{plan.summary()}; --ram-mib {args.ram_mib:g} MiB in use instead", file=sys.stderr)
        return args.ram_mib
    if args.memory_limit is not None or plan.expert_budget < plan.needs.expert_bytes:  # the limit binds
        print(plan.summary(), file=sys.stderr)
    return plan.expert_budget / MIB


def runtime_from_args(
    args: argparse.Namespace, opened: tuple[K3Checkpoint, Path | None] | None = None
) -> Runtime:
    """The runtime the model flags ask for; `opened`: what `open_model(args.model, ...)` returned, when
    the command read the GGUF already (its tokenizer first)."""
    checkpoint, manifest = opened or open_model(args.model, not args.no_stream_experts)  # before torch
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_resolved(
        checkpoint,
        manifest,
        device=device,
        dtype=getattr(torch, args.dtype),
        ram_mib=_expert_ram_mib(args, checkpoint, manifest),
        gpu_mib=args.gpu_mib,
        store_options=StoreOptions.from_args(args),
        match_ggml=args.match_ggml,
        prefetch_hint=args.prefetch_hint,
    )
