"""k3stream.quant against llama.cpp's own GGML C code: row validation and dequantisation, bit for bit."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from conftest import requires_llama
from k3stream.quant import IQUANT_TYPES, dequantize, quantize
from k3stream.testing.iquant_blocks import random_blocks as recipe_blocks
from test_quant import ALL_TYPES, ENCODED_TYPES, gaussian, random_blocks

pytestmark = [requires_llama, pytest.mark.llama]

T = GGMLQuantizationType
ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class TypeTraits(ctypes.Structure):  # struct ggml_type_traits in ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ToFloat),
        ("from_float_ref", ctypes.c_void_p),
    ]


@pytest.fixture(scope="module")
def ggml():
    lib_dir = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    lib.ggml_validate_row_data.restype = ctypes.c_bool
    lib.ggml_validate_row_data.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


def ggml_dequantize(lib, data: np.ndarray, qt: GGMLQuantizationType, n_elems: int) -> np.ndarray:
    traits = lib.ggml_get_type_traits(int(qt)).contents
    assert traits.blck_size and traits.to_float, qt.name
    out = np.empty(n_elems, dtype=np.float32)
    data = np.ascontiguousarray(data)
    traits.to_float(data.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n_elems)
    return out


@pytest.mark.parametrize("qt", ENCODED_TYPES, ids=lambda t: t.name)
def test_llama_cpp_accepts_and_decodes_encoder_output(ggml, qt):
    values = gaussian((4, 512), seed=11)
    data = quantize(values, qt)
    assert ggml.ggml_validate_row_data(int(qt), data.ctypes.data, data.nbytes)
    if qt == T.F32:  # GGML has no to_float for F32: nothing to decode
        return
    ours = dequantize(data, qt).reshape(-1).numpy()
    np.testing.assert_array_equal(ours, ggml_dequantize(ggml, data, qt, values.size))


@pytest.mark.parametrize(
    "qt", [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)], ids=lambda t: t.name
)
def test_random_blocks_decode_like_llama_cpp(ggml, qt):
    data = random_blocks(qt, 64, seed=int(qt))
    n_elems = 64 * dequantize(data[:1], qt).shape[-1]
    ours = dequantize(torch.from_numpy(data), qt).reshape(-1).numpy()
    np.testing.assert_array_equal(ours, ggml_dequantize(ggml, data, qt, n_elems))


@pytest.mark.parametrize("qt", sorted(IQUANT_TYPES), ids=lambda t: t.name)
def test_make_tiny_blocks_of_the_new_types_are_valid_for_llama_cpp(ggml, qt):
    """The random blocks `make-tiny --recipe` writes pass ggml's own row validation and decode as ggml
    decodes them."""
    data = recipe_blocks(qt.name, (4, 512), [int(qt)])
    assert ggml.ggml_validate_row_data(int(qt), data.ctypes.data, data.nbytes)
    ours = dequantize(data, qt).reshape(-1).numpy()
    np.testing.assert_array_equal(ours, ggml_dequantize(ggml, data, qt, 4 * 512))
