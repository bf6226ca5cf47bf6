"""llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs), in a child process.

The files users download are written by it: its per-tensor mixes (attn_v and ffn_down bumped per
layer, fallback types for rows its blocks do not divide, output/token_embd types), not the generator's.
llama.cpp may abort the whole process on a model it rejects, so it runs apart from pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gguf import LlamaFileType

SCRIPT = """
import ctypes, json, sys
import llama_cpp as L
from gguf import GGUFReader
src, dst, ftype, imatrix, overrides, keep_split = json.loads(sys.argv[1])
params = L.llama_model_quantize_default_params()
params.ftype, params.nthread, params.keep_split = ftype, 1, keep_split
kept = []
if imatrix:  # a uniform importance matrix: every column of every matrix weighs the same
    rows = [(t.name, int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1))
            for t in GGUFReader(src).tensors if len(t.shape) >= 2]
    entries = (L.llama_model_imatrix_data * (len(rows) + 1))()
    for entry, (name, size) in zip(entries, rows):
        kept.append((ctypes.c_float * size)(*([1.0] * size)))
        entry.name, entry.size = name.encode(), size
        entry.data = ctypes.cast(kept[-1], ctypes.POINTER(ctypes.c_float))
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(L.llama_model_imatrix_data))
if overrides:  # tensor-name regex -> GGML type id, as llama-quantize --tensor-type
    table = (L.llama_model_tensor_override * (len(overrides) + 1))()
    for entry, (pattern, ggml_type) in zip(table, overrides):
        kept.append(pattern.encode())
        entry.pattern, entry.type = kept[-1], ggml_type
    params.tt_overrides = ctypes.cast(table, ctypes.POINTER(L.llama_model_tensor_override))
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""


def llama_quantize(
    source: Path,
    out: Path,
    ftype: str,
    imatrix: bool = False,
    overrides: dict[str, int] | None = None,
    keep_split: bool = False,
) -> Path:
    """`out`, written by llama.cpp's quantizer from `source` in `ftype` (a `gguf.LlamaFileType` name
    less `MOSTLY_`, e.g. "Q4_K_M"); `imatrix` gives it a uniform importance matrix (the i-quants below
    4 bits require one); `overrides` maps tensor-name regexes to GGML type ids."""
    file_type = int(LlamaFileType[f"MOSTLY_{ftype}"])
    argument = json.dumps(
        [str(source), str(out), file_type, imatrix, list((overrides or {}).items()), keep_split]
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, argument], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"llama_model_quantize {ftype} failed: {done.stderr[-2000:]}"
    return out
