"""The expert store: GPU, RAM and disk tiers over an expert pack, eviction policies, trace simulator.

`ExpertStore` is imported lazily so that `python -m k3stream.store.simulate` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ExpertStore"]


def __getattr__(name: str) -> Any:
    if name == "ExpertStore":
        from k3stream.store.expert_store import ExpertStore

        return ExpertStore
    raise AttributeError(f"module 'k3stream.store' has no attribute {name!r}")
