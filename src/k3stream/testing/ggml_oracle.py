"""llama.cpp's own CPU dot products, reached through the shared libraries llama-cpp-python installs
(`libggml-cpu.so`), for tests and benchmarks to compare the C kernels with: the 8-bit quantizer of a
type's activations (its `vec_dot_type`'s `from_float`) and `vec_dot` from `ggml_get_type_traits_cpu`,
which the library picks for this machine (AVX2 here), and ggml's portable `ggml_vec_dot_*_generic`;
`random_blocks` makes the weights to compare them on.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q8_0, Q8_1, Q8_K = 8, 9, 15
Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 3, 7, 10, 11, 12, 13, 14
IQ1_M, MXFP4, TQ1_0, TQ2_0 = 29, 39, 34, 35
# where a block's F16 scales are (d, and the K-quants' dmin or Q4_1/Q5_1's m; 0 for the others but IQ1_M's)
F16_AT = {Q4_1: (0, 2), Q5_1: (0, 2), Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
          TQ1_0: (52,), TQ2_0: (64,)}  # fmt: skip
# bytes of one Q8_0, Q8_1 and Q8_K block as ggml lays them out (F16 d + 32 codes; F16 d and s + 32 codes;
# F32 d + 256 codes + 16 sums)
ACTIVATION_BLOCK = {Q8_0: (32, 34), Q8_1: (32, 36), Q8_K: (256, 292)}
VecDot = ctypes.CFUNCTYPE(
    None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
    ctypes.c_size_t, ctypes.c_int,
)  # fmt: skip
FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]  # fmt: skip


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """libggml-cpu.so of the installed llama-cpp-python, or None without it."""
    try:
        import llama_cpp
    except ImportError:
        return None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"
    if not path.exists():
        return None
    ggml = ctypes.CDLL(str(path))
    ggml.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    ggml.ggml_cpu_init()
    return ggml


def _traits(ggml_type: int) -> _TraitsCpu:
    return library().ggml_get_type_traits_cpu(ggml_type).contents


def activation_type(ggml_type: int) -> int:
    """ggml's vec_dot_type of a weight type: the 8-bit type its activations are quantized to."""
    return _traits(ggml_type).vec_dot_type


def quantize_activations(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """One row of float32 activations as ggml quantizes them for products with `ggml_type` (uint8 bytes)."""
    kind = activation_type(ggml_type)
    elems, nbytes = ACTIVATION_BLOCK[kind]
    row = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(row.size // elems * nbytes, dtype=np.uint8)
    FromFloat(_traits(kind).from_float)(row.ctypes.data, out.ctypes.data, row.size)
    return out


def vec_dot(
    ggml_type: int, n: int, weights: np.ndarray, activations: np.ndarray, generic: bool = False
) -> float:
    """ggml's dot product of one weight row (its GGUF bytes, n values) with quantized activations: the
    function llama.cpp runs on this machine, or with `generic` ggml's portable C one."""
    if generic:
        name = f"ggml_vec_dot_{_type_name(ggml_type)}_{_type_name(activation_type(ggml_type))}_generic"
        function = VecDot(ctypes.cast(getattr(library(), name), ctypes.c_void_p).value)
    else:
        function = VecDot(_traits(ggml_type).vec_dot)
    result = ctypes.c_float()
    function(n, ctypes.addressof(result), 0, weights.ctypes.data, 0, activations.ctypes.data, 0, 1)
    return result.value


def _type_name(ggml_type: int) -> str:
    name = {Q8_0: "q8_0", Q8_K: "q8_K"}.get(ggml_type) or GGMLQuantizationType(ggml_type).name.lower()
    return name[:-2] + "_K" if name.endswith("_k") else name  # ggml's K-quants: q6_K


def random_blocks(ggml_type: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` blocks [count, bytes] of random codes and finite scales: the F16 d (and dmin; IQ1_M's d
    spread over its scales' top nibbles), MXFP4's E8M0 exponent where its products stay within float
    range."""
    data = rng.integers(0, 256, (count, GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]), dtype=np.uint8)
    scales = (rng.standard_normal(count) * 0.02).astype(np.float16).view(np.uint16)
    if ggml_type == MXFP4:
        data[:, 0] = rng.integers(100, 150, count)
    elif ggml_type == IQ1_M:
        words = data[:, 48:56].copy().view(np.uint16) & 0x0FFF
        for k in range(4):
            words[:, k] |= ((scales >> (4 * k)) & 15) << 12
        data[:, 48:56] = words.view(np.uint8)
    else:
        for k, at in enumerate(F16_AT.get(ggml_type, (0,))):
            data[:, at : at + 2] = np.roll(scales, k).view(np.uint8).reshape(count, 2)
    return data


# ---- llama.cpp's own mul_mat, as its CPU backend runs a model's products --------------------------


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@functools.lru_cache(maxsize=1)
def _ggml_base() -> ctypes.CDLL:
    """libggml-base.so beside libggml-cpu.so, its graph functions typed."""
    base = ctypes.CDLL(str(Path(library()._name).with_name("libggml-base.so")))
    pointer = ctypes.c_void_p
    signatures = {
        "ggml_init": (pointer, [_InitParams]),
        "ggml_new_tensor_2d": (pointer, [pointer, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        "ggml_mul_mat": (pointer, [pointer, pointer, pointer]),
        "ggml_new_graph": (pointer, [pointer]),
        "ggml_build_forward_expand": (None, [pointer, pointer]),
        "ggml_backend_cpu_buffer_type": (pointer, []),
        "ggml_backend_alloc_ctx_tensors_from_buft": (pointer, [pointer, pointer]),
        "ggml_backend_tensor_set": (None, [pointer, pointer, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_backend_tensor_get": (None, [pointer, pointer, ctypes.c_size_t, ctypes.c_size_t]),
        "ggml_backend_graph_compute": (ctypes.c_int, [pointer, pointer]),
        "ggml_backend_buffer_free": (None, [pointer]),
        "ggml_backend_free": (None, [pointer]),
        "ggml_free": (None, [pointer]),
    }
    for name, (restype, argtypes) in signatures.items():
        getattr(base, name).restype, getattr(base, name).argtypes = restype, argtypes
    cpu = library()
    cpu.ggml_backend_cpu_init.restype = pointer
    cpu.ggml_backend_cpu_set_n_threads.argtypes = [pointer, ctypes.c_int]
    return base


class MulMat:
    """llama.cpp's `ggml_mul_mat` of each of several weight matrices (GGUF bytes [rows, row bytes] of
    `ggml_type`, `cols` values a row) with the same `inputs` float32 rows, one graph on its CPU backend
    with `threads` threads: what llama.cpp runs for a model's matrices that it does not repack (its
    llamafile sgemm where that takes the shape, else vec_dot). The weights are copied into ggml's
    buffer; `close` frees it."""

    def __init__(self, ggml_type: int, matrices: list[np.ndarray], cols: int, inputs: int, threads: int):
        base, cpu = _ggml_base(), library()
        self.backend = cpu.ggml_backend_cpu_init()
        cpu.ggml_backend_cpu_set_n_threads(self.backend, threads)
        self.context = base.ggml_init(_InitParams(1 << 20, None, True))
        rows = matrices[0].shape[0]
        weights = [base.ggml_new_tensor_2d(self.context, ggml_type, cols, rows) for _ in matrices]
        self.x = base.ggml_new_tensor_2d(self.context, 0, cols, inputs)  # GGML_TYPE_F32
        self.outs = [base.ggml_mul_mat(self.context, w, self.x) for w in weights]
        self.graph = base.ggml_new_graph(self.context)
        for out in self.outs:
            base.ggml_build_forward_expand(self.graph, out)
        cpu_buffer = base.ggml_backend_cpu_buffer_type()
        self.buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(self.context, cpu_buffer)
        for tensor, data in zip(weights, matrices, strict=True):
            block = np.ascontiguousarray(data)
            base.ggml_backend_tensor_set(tensor, block.ctypes.data, 0, block.nbytes)
        self.shape = (len(matrices), inputs, rows)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[matrices, inputs, rows] float32: x [inputs, cols] times each matrix."""
        base = _ggml_base()
        x = np.ascontiguousarray(x, dtype=np.float32)
        base.ggml_backend_tensor_set(self.x, x.ctypes.data, 0, x.nbytes)
        if base.ggml_backend_graph_compute(self.backend, self.graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")
        out = np.empty(self.shape, dtype=np.float32)
        for i, tensor in enumerate(self.outs):
            base.ggml_backend_tensor_get(tensor, out[i].ctypes.data, 0, out[i].nbytes)
        return out

    def close(self) -> None:
        base = _ggml_base()
        base.ggml_backend_buffer_free(self.buffer)
        base.ggml_free(self.context)
        base.ggml_backend_free(self.backend)
