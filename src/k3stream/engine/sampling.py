"""Next-token sampling: repetition penalty, temperature, top-k, top-p, min-p, seeded draws.

Order (as in HF transformers and vLLM): repetition penalty on the raw logits, then temperature, then the
top-k, top-p and min-p masks on the tempered distribution, then one draw from a per-request generator.
Temperature 0 (or below GREEDY_BELOW, as in vLLM) is greedy: the argmax of the penalised logits.
Non-finite logits (NaN or infinity: damaged weights, an overflow) are never sampled from: `sample`
raises NonFiniteLogits.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# below this a temperature is greedy: dividing by it overflows float32 for ordinary logits
GREEDY_BELOW = 1e-5


class NonFiniteLogits(ValueError):
    """The model produced NaN or infinite logits; the request fails instead of sampling garbage."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: Iterable[int], penalty: float
) -> torch.Tensor:
    """CTRL-style penalty (HF, llama.cpp): for each token seen, a positive logit is divided by `penalty`
    and a negative one multiplied by it."""
    if penalty == 1.0:
        return logits
    ids = torch.tensor(sorted(set(previous_ids)), dtype=torch.long, device=logits.device)
    if ids.numel() == 0:
        return logits
    out = logits.clone()
    seen = out[ids]
    out[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return out


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True for tokens kept: logits at least the k-th largest (ties with it are kept)."""
    if k <= 0 or k >= logits.numel():
        return torch.ones_like(logits, dtype=torch.bool)
    kth = torch.topk(logits, k).values[-1]
    return logits >= kth


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """True for the smallest most-probable set whose mass reaches `p`: a token is kept when the mass of
    the tokens ranked before it is below `p` (so the most probable token is always kept)."""
    if p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
    keep = torch.empty_like(probs, dtype=torch.bool)
    keep[order] = mass_before < p
    keep[order[0]] = True  # a `p` below float32's smallest value would otherwise keep nothing
    return keep


def min_p_mask(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """True for tokens with probability at least `min_p` times the largest."""
    if min_p <= 0:
        return torch.ones_like(probs, dtype=torch.bool)
    return probs >= min_p * probs.max()


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [V] (float32) that a non-greedy draw uses, after temperature and the masks."""
    scaled = logits.float() / params.temperature
    scaled = scaled.masked_fill(~top_k_mask(scaled, params.top_k), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    keep = top_p_mask(probs, params.top_p) & min_p_mask(probs, params.min_p)
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum()


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits (one line, with counts) unless every logit is finite."""
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(logits).sum())
    raise NonFiniteLogits(
        f"the model produced non-finite logits ({nan} NaN, {int((~finite).sum()) - nan} infinite of "
        f"{logits.numel()}); refusing to sample (damaged weights or an overflow)"
    )


class Sampler:
    """Draws tokens for one request; its generator makes a seeded request reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def sample(
        self, logits: torch.Tensor, previous_ids: Iterable[int] = (), allowed: torch.Tensor | None = None
    ) -> int:
        """Next token from `logits` [V]; `previous_ids` (prompt and output) feed the repetition penalty;
        `allowed` (bool [V], constrained decoding) keeps only those tokens. Raises NonFiniteLogits when
        any logit is NaN or infinite."""
        check_finite(logits)
        logits = apply_repetition_penalty(logits.reshape(-1), previous_ids, self.params.repetition_penalty)
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = sampling_distribution(logits, self.params)
        return int(torch.multinomial(probs, 1, generator=self._generator_for(probs.device)))
