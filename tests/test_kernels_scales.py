"""The AVX-512 integer kernels of TQ1_0 and MXFP4 on the block contents random valid blocks rarely hold:
MXFP4's E8M0 exponents from 0 (a subnormal scale, 2^-128) to the largest whose products stay finite,
TQ1_0's every code byte (0..255, the invalid ones above 242 too) in every position of a block. Each
output bit for bit llama.cpp's AVX2 vec_dot, as the AVX2 kernel and the portable one give theirs."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from conftest import KERNEL_ISAS, take_kernel_isa
from k3stream.quant.kernels import cpu
from k3stream.testing import ggml_oracle
from test_kernels_iquants import ggml_product, inputs, matrix, product

pytestmark = [
    pytest.mark.skipif(not cpu.available(), reason="the C kernels were not built with this install"),
    pytest.mark.skipif(ggml_oracle.library() is None, reason="llama-cpp-python's libggml-cpu not found"),
]


def mxfp4_every_exponent(rows: int, cols: int) -> np.ndarray:
    """Random MXFP4 blocks whose exponent bytes run 0, 1, .., 229 over the matrix (2^101 times the
    largest products stays finite)."""
    w = matrix(T.MXFP4, rows, cols, seed=7)
    blocks = w.reshape(-1, 17)
    blocks[:, 0] = np.arange(len(blocks)) % 230
    return w


def tq1_0_every_byte(rows: int, cols: int) -> np.ndarray:
    """Random TQ1_0 blocks whose 52 code bytes take every value 0..255 in every position over the matrix."""
    w = matrix(T.TQ1_0, rows, cols, seed=8)
    blocks = w.reshape(-1, 54)
    blocks[:, :52] = (np.arange(len(blocks))[:, None] * 7 + np.arange(52)[None, :] * 37) % 256
    return w


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize(
    "qt,weights,rows,cols",
    [(T.MXFP4, mxfp4_every_exponent, 46, 320), (T.TQ1_0, tq1_0_every_byte, 37, 1792)],
    ids=["MXFP4", "TQ1_0"],
)
def test_every_scale_and_code_byte_gives_llama_cpps_bits(qt, weights, rows, cols, isa, monkeypatch):
    take_kernel_isa(isa, monkeypatch)
    w, x = weights(rows, cols), inputs(5, cols, seed=9)
    if qt == T.TQ1_0:
        assert len(np.unique(w.reshape(-1, 54)[:, 3])) == 256
    assert np.array_equal(product(qt, w, x), ggml_product(qt, w, x, generic=isa == "portable"))
