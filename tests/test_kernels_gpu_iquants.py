"""The Triton kernels of the i-quants, the ternary types (`gpu._dq_iquant`) and NVFP4 (`gpu._dq_nvfp4`)
against `gguf.quants.dequantize`, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 in a fresh
process, as test_kernels_gpu.py does) on tiny shapes of random valid blocks: the decode path (few rows)
and the `tl.dot` path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

triton = pytest.importorskip("triton", reason="triton is not installed (the project's `gpu` extra)")

from k3stream.quant.kernels import gpu  # noqa: E402  (after the skip above)
from k3stream.testing import ggml_oracle  # noqa: E402

interp = pytest.mark.interp  # collected only under TRITON_INTERPRET=1 (test_the_interpreter_runs_them)
TYPES = sorted(gpu.IQUANT_GPU_TYPES | {T.NVFP4})


def product(qt: T, rows: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's x @ W^T on random valid blocks, and gguf's dequantized W times x in float64."""
    elems, nbytes = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(int(qt))
    blocks = ggml_oracle.random_blocks(int(qt), out_features * in_features // elems, rng)
    w = torch.from_numpy(blocks.reshape(out_features, -1))
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32))
    out = torch.empty(rows, out_features)
    gpu._launch(x, w, w.shape[1], int(qt), out)
    dense = gguf_dequantize(blocks, qt).astype(np.float64).reshape(out_features, in_features)
    return out, torch.from_numpy(x.double().numpy() @ dense.T)


@interp
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [2, 9], ids=["decode", "dot"])
def test_the_kernels_match_gguf_dequantize(qt, rows):
    got, expected = product(qt, rows, 4, 512)
    assert float((got.double() - expected).norm() / expected.norm()) <= 1e-5


@interp
@pytest.mark.parametrize("rows", [2, 9], ids=["decode", "dot"])
def test_nvfp4_rows_of_whole_blocks_that_end_inside_a_tile(rows):
    """NVFP4's 64-value blocks: rows of 320 values end one block into the second 256-value K tile."""
    got, expected = product(T.NVFP4, rows, 4, 320)
    assert float((got.double() - expected).norm() / expected.norm()) <= 1e-5


def test_the_interpreter_runs_them():
    """This module again with TRITON_INTERPRET=1 (set before triton defines the kernels)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        str(Path(__file__)),
        "-k",
        "match",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{2 * len(TYPES)} passed" in done.stdout
