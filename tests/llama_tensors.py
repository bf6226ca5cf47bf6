"""llama.cpp's MLA attention inputs and output, token by token, read through its graph callback
(`cb_eval`) in a child process (llama.cpp may abort the whole process on a model it rejects)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = """
import ctypes, json, sys
import numpy as np
import llama_cpp.llama_cpp as L

class Tensor(ctypes.Structure):  # ggml.h's struct ggml_tensor, up to its name
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]

def floats(address):  # an F32 tensor's values (strides followed), in ggml's dimension order reversed
    t = Tensor.from_address(address)
    assert t.type == 0, t.name
    shape, strides = [t.ne[i] for i in range(4)][::-1], [t.nb[i] for i in range(4)][::-1]
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 4
    data = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=np.float32)
    return np.lib.stride_tricks.as_strided(data, shape=shape, strides=strides).copy()

path, tokens, layer, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
found = {}

@L.ggml_backend_sched_eval_callback
def record(address, ask, user_data):
    name = Tensor.from_address(address).name.decode()
    if not ask and name == f"kq-{layer}":
        t = Tensor.from_address(address)
        found["cache"], found["query"] = floats(t.src[0]), floats(t.src[1])
    elif not ask and name == f"kqv-{layer}":
        found["kqv"] = floats(address)
    return True

L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 256, 1, 1, 1, 1
params.type_k = params.type_v = 0
params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
params.cb_eval = record
context = L.llama_init_from_model(model, params)
arrays = {}
for i, token in enumerate(tokens):
    assert L.llama_decode(context, L.llama_batch_get_one((ctypes.c_int32 * 1)(token), 1)) == 0
    heads = found["query"].shape[-3]
    arrays[f"query{i}"] = found["query"].reshape(heads, -1)
    arrays[f"cache{i}"] = found["cache"].reshape(-1, found["query"].shape[-1])[: i + 1]
    arrays[f"kqv{i}"] = found["kqv"].reshape(heads, -1)
L.llama_free(context)
L.llama_model_free(model)
np.savez(out, **arrays)
"""


def llama_mla_attention(
    path: Path, tokens: list[int], layer: int, out_dir: Path
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each token of a token-by-token run (F32 cache, no flash attention): MLA layer `layer`'s
    absorbed query [heads, width], its cache rows up to the token [t + 1, width] and llama.cpp's
    attention output `kqv` [heads, kv]."""
    out = Path(out_dir) / "llama_mla_attention.npz"
    argument = json.dumps([int(t) for t in tokens])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), argument, str(layer), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"llama.cpp failed: {done.stderr[-2000:]}"
    with np.load(out) as arrays:
        return [(arrays[f"query{i}"], arrays[f"cache{i}"], arrays[f"kqv{i}"]) for i in range(len(tokens))]
