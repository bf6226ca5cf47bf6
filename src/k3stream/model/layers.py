"""Small shared pieces of the Kimi-K3 forward: norms, the situ activation, linear layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3stream.model.options import LoadOptions
from k3stream.quant.dequant import FLOAT_DTYPES
from k3stream.quant.kernels import Products, QWeight, checked_weight, cpu, row_at_a_time
from k3stream.quant.rounding import round_like_ggml

FLOAT_TYPE_IDS = {dtype: type_id for type_id, dtype in FLOAT_DTYPES.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (weight None: no scaling); in C for CPU
    float32 tensors outside autograd."""
    if _rms_norm_in_c(x, weight):
        return cpu.rms_norm(x, weight, eps)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def bind_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor) -> cpu.Call:
    """`rms_norm(x, weight, eps)` into `out` as a bound C call where it runs in C, else a Python step."""
    if _rms_norm_in_c(x, weight):
        return cpu.bind_rms_norm(x, weight, eps, out)
    return cpu.python_step(lambda: out.copy_(rms_norm(x, weight, eps)))


def _rms_norm_in_c(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    tensors = (x,) if weight is None else (x, weight)
    return cpu.takes(tensors) and (weight is None or weight.shape == x.shape[-1:])


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp's KDA q/k norm, eps = rms eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def bytes_to_matrix(data: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a GGUF tensor's bytes (any supported type), reshaped to `shape`."""
    float_dtype = FLOAT_DTYPES.get(ggml_type)
    if float_dtype is not None:
        return data.contiguous().view(float_dtype).reshape(shape).float()
    from k3stream.quant import dequantize

    return dequantize(data, ggml_type).reshape(shape)


class DenseLinear:
    """y = x @ W^T with W held as a dense tensor (float32 or bfloat16): the reference path.

    `rounding_type`: inputs are first rounded as ggml does for a weight of that GGML type (None: not).
    Under `kernels.set_row_exact` a row at a time on the CPU: torch's products round as their row count
    has them, and a prompt cache's restore, a chunked prefill or a batched decode step must give each
    row the bits it gets alone.
    """

    def __init__(self, weight: torch.Tensor, rounding_type: int | None = None) -> None:
        self.weight = weight
        self.rounding_type = rounding_type
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return row_at_a_time(x, self._product, most_rows=1)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding_type is None and x.dtype == self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight)  # the common case, without no-op casts
        x_rounded = round_like_ggml(x, self.rounding_type)
        return torch.nn.functional.linear(x_rounded.to(self.weight.dtype), self.weight).to(x.dtype)


class QuantLinear:
    """y = x @ W^T from W's GGUF bytes through the kernel seam (`backend="reference"`: dequantize)."""

    def __init__(self, weight: QWeight, round_inputs: bool, backend: str = "auto") -> None:
        self.weight = weight
        self.rounding_type = weight.ggml_type if round_inputs else None
        self.out_features, self.in_features = weight.shape
        self.backend = backend
        self.products = Products([weight], backend, round_inputs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.products(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)


Linear = DenseLinear | QuantLinear


class JointLinear:
    """Several linear layers of one input as one: their outputs side by side ([N, sum of `widths`]).
    GGUF-typed layers on the kernels' path share one kernel call per input
    (`kernels.Products`); any others (the reference path, a wrapped layer) run one by one."""

    def __init__(self, linears: list[Linear]) -> None:
        self.linears = linears
        self.widths = [linear.out_features for linear in linears]
        joint = (
            all(isinstance(linear, QuantLinear) for linear in linears)
            and len({(linear.backend, linear.rounding_type is not None) for linear in linears}) == 1
        )
        first = linears[0]
        self.products = (
            Products([linear.weight for linear in linears], first.backend, first.rounding_type is not None)
            if joint
            else None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.products is not None:
            out = self.products(x)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        return torch.cat([linear(x) for linear in self.linears], dim=-1)

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output [N, width] (as float32 or x's dtype), without joining them."""
        if self.products is not None:
            return self.products.parts(x)
        return [linear(x) for linear in self.linears]


def bind_linear(
    linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor, threads: int
) -> cpu.Call:
    """A linear layer's product of x into `out` as a bound C call (`kernels.Products.bind`), or as a
    Python step calling the layer where it is not one C call (dense, wrapped, or sent elsewhere)."""
    products = linear.products if isinstance(linear, QuantLinear | JointLinear) else None
    call = products.bind(x, out, threads) if products is not None else None
    return call or cpu.python_step(lambda: out.copy_(linear(x)))


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor as the loader yields it: float values, or GGUF bytes plus their type id."""

    value: torch.Tensor
    ggml_type: int | None = None
    name: str = "tensor"

    @property
    def type_id(self) -> int:
        """The GGML type id of the stored values (float tensors: F32, F16 or BF16)."""
        return self.ggml_type if self.ggml_type is not None else FLOAT_TYPE_IDS[self.value.dtype]

    def matrix(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Dense values in `shape` and `dtype` (dequantizing GGUF blocks)."""
        if self.ggml_type is None:
            return self.value.reshape(shape).to(dtype)
        return bytes_to_matrix(self.value, self.ggml_type, shape).to(dtype)

    def qweight(self, out_features: int, in_features: int) -> QWeight:
        """The stored bytes as a matrix for the kernels (checked against the shape, errors name it)."""
        return checked_weight(self.name, self.value, self.type_id, (out_features, in_features))

    def linear(self, out_features: int, in_features: int, options: LoadOptions) -> Linear:
        """A linear layer over this weight; GGUF types kept unless the reference path densifies them."""
        if options.kernels == "auto" or (options.keep_quantized and self.ggml_type is not None):
            stored = self.qweight(out_features, in_features)
            return QuantLinear(stored, options.ggml_arithmetic, options.kernels)
        weight = self.matrix((out_features, in_features), options.torch_dtype)
        return DenseLinear(weight, self.input_rounding(options))

    def input_rounding(self, options: LoadOptions) -> int | None:
        """This weight's GGML type when inputs are to be rounded as ggml does (`ggml_arithmetic`)."""
        return self.type_id if options.ggml_arithmetic else None
