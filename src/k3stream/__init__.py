"""k3stream: run Kimi-K3 GGUF checkpoints with routed experts streamed from an expert pack."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load", "nonexpert_weights"]


def nonexpert_weights(path_or_manifest: Any, **kwargs: Any):
    """Yield `(runtime_name, tensor)` pairs as the seed system's loader does."""
    from k3stream.gguf.weights import nonexpert_weights as _impl

    return _impl(path_or_manifest, **kwargs)


def load(path_or_manifest: Any, **kwargs: Any):
    """Load a Kimi-K3 model from a GGUF (any shard or directory) or an expert-pack manifest."""
    from k3stream.model.k3 import load as _impl

    return _impl(path_or_manifest, **kwargs)
