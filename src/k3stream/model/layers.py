"""Small shared pieces of the Kimi-K3 forward: norms, the situ activation, linear layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3stream.model.ggml_rounding import round_like_ggml

# GGML type ids whose bytes are plain floats (everything else is a block quant)
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
FLOAT_TYPE_IDS = {dtype: type_id for type_id, dtype in FLOAT_TYPES.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (weight None: no scaling)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (llama.cpp's KDA q/k norm, eps = rms eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi-K3's activation: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)."""
    activated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta > 0:
        up = linear_beta * torch.tanh(up / linear_beta)
    return activated * up


def bytes_to_matrix(data: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 values of a GGUF tensor's bytes (any supported type), reshaped to `shape`."""
    float_dtype = FLOAT_TYPES.get(ggml_type)
    if float_dtype is not None:
        return data.contiguous().view(float_dtype).reshape(shape).float()
    from k3stream.quant import dequantize

    return dequantize(data, ggml_type).reshape(shape)


@dataclass(frozen=True)
class LoadOptions:
    """How weights become layers: dense dtype, GGUF blocks kept or not, ggml's input rounding."""

    dtype: torch.dtype = torch.float32
    keep_quantized: bool = False
    match_ggml: bool = False


class DenseLinear:
    """y = x @ W^T with W held as a dense tensor (float32 or bfloat16).

    `rounding_type`: inputs are first rounded as ggml does for a weight of that GGML type (None: not).
    """

    def __init__(self, weight: torch.Tensor, rounding_type: int | None = None) -> None:
        self.weight = weight
        self.rounding_type = rounding_type
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rounding_type is None and x.dtype == self.weight.dtype:
            return torch.nn.functional.linear(x, self.weight)  # the common case, without no-op casts
        x_rounded = round_like_ggml(x, self.rounding_type)
        return torch.nn.functional.linear(x_rounded.to(self.weight.dtype), self.weight).to(x.dtype)


class QuantLinear:
    """y = x @ W^T computed from W's GGUF blocks by `k3stream.quant.qlinear`."""

    def __init__(
        self, data: torch.Tensor, ggml_type: int, out_features: int, in_features: int, round_inputs: bool
    ) -> None:
        self.data = data
        self.ggml_type = ggml_type
        self.rounding_type = ggml_type if round_inputs else None
        self.out_features = out_features
        self.in_features = in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from k3stream.quant import qlinear

        x_rounded = round_like_ggml(x, self.rounding_type)
        y = qlinear(x_rounded, self.data, self.ggml_type, self.out_features, self.in_features)
        return y.to(x.dtype)


Linear = DenseLinear | QuantLinear


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor as the loader yields it: float values, or GGUF bytes plus their type id."""

    value: torch.Tensor
    ggml_type: int | None = None

    def matrix(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Dense values in `shape` and `dtype` (dequantizing GGUF blocks)."""
        if self.ggml_type is None:
            return self.value.reshape(shape).to(dtype)
        return bytes_to_matrix(self.value, self.ggml_type, shape).to(dtype)

    def linear(self, out_features: int, in_features: int, options: LoadOptions) -> Linear:
        """A linear layer over this weight; quantized bytes stay in blocks when asked to."""
        if options.keep_quantized and self.ggml_type is not None:
            return QuantLinear(
                self.value.reshape(-1), self.ggml_type, out_features, in_features, options.match_ggml
            )
        weight = self.matrix((out_features, in_features), options.dtype)
        return DenseLinear(weight, self.input_rounding(options))

    def input_rounding(self, options: LoadOptions) -> int | None:
        """This weight's GGML type when inputs are to be rounded as ggml does (see match_ggml)."""
        if not options.match_ggml:
            return None
        return self.ggml_type if self.ggml_type is not None else FLOAT_TYPE_IDS.get(self.value.dtype)
