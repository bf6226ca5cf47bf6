"""What the model commands share: model + tokenizer + expert store from a GGUF or a manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3stream.engine.generate import GenerationResult
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.model.k3 import K3Model
    from k3stream.model.options import LoadOptions
    from k3stream.store.expert_store import ExpertStore

DEFAULT_RAM_MIB = 1024.0  # `load_runtime`'s expert RAM budget when it is given no options


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
    """How the expert store caches and reads (the `ExpertStore` keywords of the same names; whether it
    prefetches is `LoadOptions.prefetch`)."""

    policy: str = "cycle"
    io_threads: int = 4
    # None: O_DIRECT under a memory limit (the checkpoint's `uncached_reads`) or when the experts the
    # store serves do not fit the RAM budget
    direct_io: bool | None = None
    expert_ranks: int = 1  # expert-parallel ranks (`--ep`): the store serves its rank's share
    simulated_read_latency_us: float = 0.0  # sleeps before each pack read: tests and experiments


def resolve_model(path: str | Path, stream_experts: bool) -> tuple[Path, Path | None]:
    """`(gguf, manifest or None)` for a GGUF or a manifest path; a GGUF uses the manifest beside it."""
    from k3stream.pack.source import is_manifest, manifest_gguf, manifest_next_to

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if is_manifest(path):
        return manifest_gguf(path), path if stream_experts else None
    return path, manifest_next_to(path) if stream_experts else None


def open_model(path: str | Path, stream_experts: bool) -> tuple[K3Checkpoint, Path | None]:
    """`(checkpoint, manifest or None)`: `resolve_model`, then the checkpoint opened once
    (`pack.source.open_checkpoint`, sglang's loader's checks for a manifest), for everything a load
    reads from the GGUF: the memory plan, the pack's config check, the model and the tokenizer."""
    from k3stream.pack.source import open_checkpoint

    gguf_path, manifest = resolve_model(path, stream_experts)
    return open_checkpoint(manifest or gguf_path), manifest


def load_runtime(
    path: str | Path,
    options: LoadOptions | None = None,
    *,
    gpu_mib: float | None = None,
    stream_experts: bool = True,
    store_options: StoreOptions = StoreOptions(),
) -> Runtime:
    """Load for generation; routed experts stream from the pack when there is a manifest. Default
    `options`: `LoadOptions(expert_ram_mib=1024)`."""
    from k3stream.model.options import LoadOptions

    checkpoint, manifest = open_model(path, stream_experts)
    options = options or LoadOptions(expert_ram_mib=DEFAULT_RAM_MIB)
    return load_resolved(checkpoint, manifest, options, gpu_mib=gpu_mib, store_options=store_options)


def load_resolved(
    checkpoint: K3Checkpoint,
    manifest: Path | None,
    options: LoadOptions,
    *,
    gpu_mib: float | None = None,
    store_options: StoreOptions = StoreOptions(),
) -> Runtime:
    """`load_runtime` for what `open_model` opened. With a manifest the expert store is the expert
    source, its RAM budget `options.expert_ram_mib` (None: what the memory plan leaves) and its device
    `options.device`."""
    import k3stream
    from k3stream.engine.tokenizer import Tokenizer

    store = None
    if manifest is not None:
        from k3stream.memlimit import ServedShape, default_expert_ram_mib
        from k3stream.pack.reader import ExpertPack
        from k3stream.store.expert_store import ExpertStore

        pack = ExpertPack(manifest, config=checkpoint.config)
        ram_mib = options.expert_ram_mib
        if ram_mib is None:
            ranks = store_options.expert_ranks
            shape = ServedShape(slot_bytes=pack.object_bytes, expert_ranks=ranks)
            ram_mib = default_expert_ram_mib(checkpoint, shape)
        if store_options.direct_io is None and checkpoint.uncached_reads:
            # the pack's page cache would be charged to the limit beside the expert budget
            store_options = replace(store_options, direct_io=True)
        store = ExpertStore(
            pack,
            ram_mib=ram_mib,
            gpu_mib=gpu_mib,
            device=options.device,
            prefetch=options.prefetch,
            **asdict(store_options),
        )
        options = replace(options, expert_source=store, expert_ram_mib=ram_mib)
    try:
        model = k3stream.load(checkpoint, options)
        tokenizer = Tokenizer.from_gguf(checkpoint)
        if store is not None:  # its read buffers, made while the weights loaded, all made before a read
            store.wait_for_buffers()
    except BaseException:
        if store is not None:
            store.close()
        raise
    return Runtime(model=model, tokenizer=tokenizer, store=store, manifest=manifest)
