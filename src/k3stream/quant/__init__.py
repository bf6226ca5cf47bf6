"""GGML block formats: bit-exact torch dequantisation, reference encoders, and a slab-wise qlinear."""

from .dequant import dequantize
from .encode import quantize
from .qlinear import default_slab_rows, qlinear, slab_ranges
from .types import SUPPORTED_TYPES, row_bytes, type_name, type_size

__all__ = [
    "SUPPORTED_TYPES",
    "default_slab_rows",
    "dequantize",
    "qlinear",
    "quantize",
    "row_bytes",
    "slab_ranges",
    "type_name",
    "type_size",
]
