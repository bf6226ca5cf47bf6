"""llama.cpp's graph tensors, token by token, read through its graph callback (`cb_eval`) in a child
process (llama.cpp may abort the whole process on a model it rejects)."""

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

path, tokens, names, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
found = {}

@L.ggml_backend_sched_eval_callback
def record(address, ask, user_data):
    name = Tensor.from_address(address).name.decode()
    for wanted in names:  # "name" or "name:srcN", the tensor's N-th source
        tensor, _, source = wanted.partition(":src")
        if not ask and name == tensor:
            found[wanted] = floats(Tensor.from_address(address).src[int(source)] if source else address)
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
    arrays.update({f"{name}#{i}": found.pop(name) for name in names})
L.llama_free(context)
L.llama_model_free(model)
np.savez(out, **arrays)
"""


def llama_tensors(
    path: Path, tokens: list[int], names: list[str], out_dir: Path
) -> list[dict[str, np.ndarray]]:
    """For each token of a token-by-token run (F32 cache, no flash attention, one thread): the graph
    tensors named (a name with ":srcN": that tensor's N-th source), as arrays in ggml's dimension
    order reversed."""
    out = Path(out_dir) / "llama_tensors.npz"
    arguments = [str(path), json.dumps([int(t) for t in tokens]), json.dumps(names), str(out)]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *arguments], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"llama.cpp failed: {done.stderr[-2000:]}"
    with np.load(out) as arrays:
        return [{name: arrays[f"{name}#{i}"] for name in names} for i in range(len(tokens))]


def llama_mla_attention(
    path: Path, tokens: list[int], layer: int, out_dir: Path
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each token: MLA layer `layer`'s absorbed query [heads, width], its cache rows up to the token
    [t + 1, width] and llama.cpp's attention output `kqv` [heads, kv]."""
    names = [f"kq-{layer}:src1", f"kq-{layer}:src0", f"kqv-{layer}"]
    steps = []
    for t, found in enumerate(llama_tensors(path, tokens, names, out_dir)):
        query, cache, kqv = (found[name] for name in names)
        heads, width = query.shape[-3], query.shape[-1]
        steps.append((query.reshape(heads, width), cache.reshape(-1, width)[: t + 1], kqv.reshape(heads, -1)))
    return steps
