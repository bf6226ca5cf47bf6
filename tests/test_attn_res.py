"""The attention-residual mix: the C kernel (`steps_cpu.c`) and the torch path against a float64 oracle
written here from the reference (../shared/reference/kimi-k3-architecture.md)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NO_C_KERNELS
from k3stream.model import attn_res
from k3stream.quant.kernels import cpu


def reference_mix(rows: list[torch.Tensor], score: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax over i of score . (x_i / rms(x_i)), then the weighted sum of the raw x_i, in float64."""
    stacked = torch.stack(rows).double()
    normed = stacked / torch.sqrt(stacked.pow(2).mean(-1, keepdim=True) + eps)
    weights = torch.softmax((normed * score.double()).sum(-1), dim=0)
    return (weights[..., None] * stacked).sum(0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@settings(max_examples=25, deadline=None)
@given(
    positions=st.integers(1, 40),
    width=st.integers(1, 300),
    banked=st.integers(1, 8),
    scale=st.sampled_from([0.01, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_both_paths_match_the_float64_mix(positions, width, banked, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randn(positions, width, generator=generator) for _ in range(banked + 1)]
    score = torch.randn(width, generator=generator) * scale
    expected = reference_mix(rows, score, 1e-5)
    mixed = attn_res.residual_mix(rows[:-1], rows[-1], score, 1e-5)
    assert relative(mixed, expected) < 1e-5
    with torch.enable_grad():  # a row autograd follows takes the torch path
        tracked = rows[-1].clone().requires_grad_()
        traced = attn_res.residual_mix(rows[:-1], tracked, score, 1e-5)
    assert traced.grad_fn is not None
    # torch's float32 softmax takes logits of up to |score| sqrt(width) (hundreds at scale 30), each
    # rounded to 2^-24 of its size: the weights carry a few 1e-5 of it where the C kernel does not
    assert relative(traced.detach(), expected) < 1e-5 * max(1.0, scale / 6)


def test_the_c_kernel_is_the_cpu_path():
    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    rows = [torch.randn(3, 64) for _ in range(3)]
    score = torch.randn(64)
    assert torch.equal(
        attn_res.residual_mix(rows[:-1], rows[-1], score, 1e-5), cpu.residual_mix(rows, score, 1e-5)
    )


def test_a_prefills_mix_on_the_threads_gives_each_position_its_own_result():
    """Enough positions (a prefill's) are split over the threads: the same bits as on one thread."""
    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    rows = [torch.randn(301, 1024) for _ in range(3)]
    score = torch.randn(1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu.residual_mix(rows, score, 1e-5)
        torch.set_num_threads(2)
        assert torch.equal(cpu.residual_mix(rows, score, 1e-5), alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[7:8], cpu.residual_mix([r[7:8] for r in rows], score, 1e-5))


def test_rows_of_different_shapes_are_refused_not_read_past():
    """Mismatched rows never reach the C kernel (it would read past the shorter one): torch refuses."""
    rows = [torch.randn(3, 64), torch.randn(2, 64)]
    with pytest.raises(RuntimeError):
        attn_res.residual_mix(rows[:1], rows[1], torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError):
        attn_res.residual_mix([torch.randn(2, 64)], torch.randn(2, 64), torch.randn(32), 1e-5)
