"""Sampling: each mask against a direct numpy computation, the draw distribution, penalty and seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3stream.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_output_penalties,
    apply_repetition_penalty,
    min_p_mask,
    sampling_distribution,
    top_k_mask,
    top_p_mask,
)


def _logits(seed: int, size: int = 1000) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 3, size).astype(np.float32))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    logits = _logits(seed)
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == int(np.argmax(logits.numpy()))


@pytest.mark.parametrize("k", [1, 2, 7, 100, 999])
def test_top_k_keeps_the_k_largest(k):
    values = _logits(k).numpy()
    expected = np.array([(values > v).sum() < k for v in values])
    assert np.array_equal(top_k_mask(torch.from_numpy(values), k).numpy(), expected)
    assert expected.sum() == k


def test_top_k_zero_keeps_everything():
    assert top_k_mask(_logits(0), 0).all()


@pytest.mark.parametrize("p", [0.01, 0.3, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    probs = _softmax(_logits(int(p * 1000)).numpy().astype(np.float64))
    mass_above = np.array([probs[probs > q].sum() for q in probs])
    expected = mass_above < p
    got = top_p_mask(torch.from_numpy(probs), p).numpy()
    assert np.array_equal(got, expected)
    kept = np.sort(probs[got])
    assert kept.sum() >= p and kept.sum() - kept[0] < p  # reaches p; smaller sets do not


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.5, 1.0])
def test_min_p_keeps_tokens_near_the_top(min_p):
    probs = _softmax(_logits(7).numpy().astype(np.float64))
    expected = probs >= min_p * probs.max()
    assert np.array_equal(min_p_mask(torch.from_numpy(probs), min_p).numpy(), expected)


def _expected_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    z = logits.astype(np.float64) / temperature
    z = np.where(np.array([(z > v).sum() < top_k for v in z]), z, -np.inf)
    probs = _softmax(z)
    keep = np.array([probs[probs > q].sum() < top_p for q in probs]) & (probs >= min_p * probs.max())
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def test_draws_follow_the_masked_tempered_distribution():
    logits = np.array([2.0, 1.6, 1.5, 0.9, 0.5, 0.0, -0.5, -3.0, 1.0, 1.2], dtype=np.float32)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1, seed=1234)
    expected = _expected_distribution(logits, 0.8, 8, 0.9, 0.1)
    torch.testing.assert_close(
        sampling_distribution(torch.from_numpy(logits), params).double(),
        torch.from_numpy(expected),
        rtol=1e-5,
        atol=1e-6,
    )
    sampler, n = Sampler(params), 10000
    counts = np.bincount([sampler.sample(torch.from_numpy(logits)) for _ in range(n)], minlength=len(logits))
    assert (counts[expected == 0] == 0).all()
    assert 0 < (expected == 0).sum() < len(logits) - 2  # the masks did cut something, but not everything
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9
    assert (np.abs(counts / n - expected) <= tolerance).all()


def test_repetition_penalty_as_hf_and_llama_cpp_define_it():
    logits = _logits(3, 50)
    seen = [1, 4, 4, 9, 17, 30]
    out = apply_repetition_penalty(logits, seen, 1.3).numpy()
    ref = logits.numpy().copy()
    for token in set(seen):
        ref[token] = ref[token] / 1.3 if ref[token] > 0 else ref[token] * 1.3
    np.testing.assert_array_equal(out, ref)
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_greedy_applies_the_penalty():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=2.0)).sample(logits, [1]) == 2


def test_seed_makes_draws_reproducible():
    params = SamplingParams(temperature=1.0, seed=42)
    rows = [_logits(s, 300) for s in range(60)]

    def draws(p: SamplingParams) -> list[int]:
        sampler = Sampler(p)
        return [sampler.sample(row) for row in rows]

    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))
    unseeded = Sampler(SamplingParams())
    assert unseeded.seed != Sampler(SamplingParams()).seed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_last_n": -2}, "repeat_last_n must be >= -1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"stop": ("",)}, "stop strings must not be empty"),
    ],
)
def test_bad_parameters_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_output_penalties_are_openais():
    """logit - frequency * count - presence * (count > 0), from a direct numpy computation."""
    logits = _logits(3, 50)
    output = [4, 4, 4, 9, 17, 4, 9]
    counts = np.bincount(output, minlength=50)
    expected = logits.numpy() - 0.7 * counts - (-0.4) * (counts > 0)
    got = apply_output_penalties(logits, output, 0.7, -0.4)
    assert np.allclose(got.numpy(), expected, atol=1e-6)
    assert apply_output_penalties(logits, output, 0.0, 0.0) is logits
    assert apply_output_penalties(logits, [], 1.0, 1.0) is logits


def test_logit_bias_adds_to_the_named_tokens():
    logits = _logits(4, 20)
    got = apply_logit_bias(logits, ((3, 5.0), (19, -100.0)))
    expected = logits.numpy().copy()
    expected[3] += 5.0
    expected[19] -= 100.0
    assert np.array_equal(got.numpy(), expected)
    assert Sampler(SamplingParams(temperature=0, logit_bias=((7, 100.0),))).sample(logits) == 7


def test_penalties_see_the_output_only():
    """Tokens in the prompt alone are not penalised (OpenAI's and vLLM's frequency/presence)."""
    logits = torch.zeros(10)
    logits[2] = 1.0
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=2.0))
    assert sampler.sample(logits, previous_ids=[2, 2, 2]) == 2
    assert sampler.sample(logits, previous_ids=[2], counted_ids=[2]) != 2
