"""`match_ggml` input rounding, checked against the `gguf` package's Q8_0 codec and IEEE casts."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from k3stream.quant.rounding import round_like_ggml


def test_q8_0_matches_the_gguf_codec():
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32) * [[1.0], [1e-3], [40.0]]
    x[0, :32] = 0.0  # an all-zero block
    expected = quants.dequantize(quants.quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    got = round_like_ggml(torch.from_numpy(x), int(GGMLQuantizationType.Q4_0))
    assert np.array_equal(got.numpy(), expected)


def test_q8_k_uses_the_signed_largest_value_and_127_levels():
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    x[0, 7] = -9.0  # the largest magnitude in block 0 is negative: it maps to +127
    x[1, 256:] = 0.0
    got = round_like_ggml(x, int(GGMLQuantizationType.Q2_K))
    scale = -9.0 / -127.0
    assert torch.isclose(got[0, 7], torch.tensor(-9.0), rtol=1e-6, atol=0)
    assert torch.allclose(got[0, :256], torch.round(x[0, :256] / scale) * scale, rtol=0, atol=1e-6)
    assert torch.equal(got[1, 256:], torch.zeros(256))
    assert (got[0, :256] - x[0, :256]).abs().max() <= scale / 2 + 1e-6


def test_float_weights():
    x = torch.tensor([1.0 + 2**-12, 1.0 + 2**-9])
    assert torch.equal(round_like_ggml(x, 1), x.half().float())
    assert torch.equal(round_like_ggml(x, 30), x.bfloat16().float())
    assert round_like_ggml(x, 0) is x and round_like_ggml(x, None) is x
