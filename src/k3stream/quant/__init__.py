"""GGML block formats: bit-exact torch dequantisation, reference encoders, and a slab-wise qlinear.

The torch-backed functions are imported on first use, so tools that only need the type table (the GGUF
reader, the packer) start without importing torch.
"""

from importlib import import_module
from typing import Any

from .types import DECODE_ONLY_TYPES, IQUANT_TYPES, SUPPORTED_TYPES, row_bytes, type_name, type_size

_LAZY = {
    "dequantize": ".dequant",
    "quantize": ".encode",
    "default_slab_rows": ".matmul",
    "qlinear": ".matmul",
    "slab_ranges": ".matmul",
}

__all__ = [
    "DECODE_ONLY_TYPES",
    "IQUANT_TYPES",
    "SUPPORTED_TYPES",
    "row_bytes",
    "type_name",
    "type_size",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)
