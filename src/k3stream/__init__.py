"""k3stream: run Kimi-K3 GGUF checkpoints with routed experts streamed from an expert pack."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from k3stream.model.options import LoadOptions

if TYPE_CHECKING:
    from k3stream.model.k3 import K3Model

__version__ = "0.1.0"

__all__ = ["LoadOptions", "__version__", "load", "nonexpert_weights"]


def _checkpoint(source: Any) -> Any:
    """An open `K3Checkpoint` as is; a GGUF or manifest path opened (`pack.source.open_checkpoint`)."""
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.source import open_checkpoint

    return source if isinstance(source, K3Checkpoint) else open_checkpoint(source)


def nonexpert_weights(path_or_manifest: Any, copy: bool = True) -> Iterator[tuple[str, Any]]:
    """Yield `(runtime_name, tensor)` pairs as sglang's loader does, from a GGUF (any shard or
    directory), an expert-pack manifest, or an open `K3Checkpoint`. A generator, as sglang's: the
    file is opened and checked when the first pair is asked for."""
    from k3stream.gguf.weights import nonexpert_weights as _impl

    yield from _impl(_checkpoint(path_or_manifest), copy)


def load(source: Any, options: LoadOptions | None = None) -> K3Model:
    """Load a Kimi-K3 model from a GGUF (any shard or directory), an expert-pack manifest, or an open
    `K3Checkpoint`, as `options` say (`LoadOptions`; default: `LoadOptions()`). With neither an
    `expert_source` nor an `expert_ram_mib`, the routed experts are read from the GGUF into RAM at load
    when all of them fit the expert budget the memory plan leaves (`k3stream.memlimit`: the cgroup's
    limit or the available RAM). An `ExpertStore` over the pack of another GGUF is refused
    (`pack.source.check_built_from`)."""
    from k3stream.model.k3 import load as _impl

    if not isinstance(options, LoadOptions | None):
        raise TypeError(f"k3stream.load: options must be a LoadOptions, got {type(options).__name__}")
    checkpoint = _checkpoint(source)
    options = options or LoadOptions()
    pack = getattr(options.expert_source, "pack", None)  # an ExpertStore's
    if pack is not None:
        from k3stream.pack.source import check_built_from

        check_built_from(pack.manifest_path, pack.gguf_paths, checkpoint.shards)
    if options.expert_source is None and options.expert_ram_mib is None:
        from k3stream.memlimit import default_expert_ram_mib

        options = replace(options, expert_ram_mib=default_expert_ram_mib(checkpoint))
    return _impl(checkpoint, options)
