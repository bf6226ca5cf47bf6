"""Next-token sampling: logit bias, repetition, frequency and presence penalties, temperature, top-k,
top-p, min-p, seeded draws.

Order (as in vLLM): logit bias on the raw logits, then the repetition penalty, then the frequency and
presence penalties (OpenAI's: on the tokens generated so far), then temperature, then the top-k, top-p
and min-p masks on the tempered distribution, then one draw from a per-request generator.
Temperature 0 (or below GREEDY_BELOW, as in vLLM) is greedy: the argmax of the penalised logits.
Non-finite logits (NaN or infinity: damaged weights, an overflow) are never sampled from: `sample`
raises NonFiniteLogits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# below this a temperature is greedy: dividing by it overflows float32 for ordinary logits
GREEDY_BELOW = 1e-5


# the seeds a torch generator takes (`manual_seed` refuses others with "Overflow when unpacking long long")
SEEDS = range(-(1 << 63), 1 << 64)


class NonFiniteLogits(ValueError):
    """The model produced NaN or infinite logits; the request fails instead of sampling garbage."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_last_n: int = -1  # the penalty counts the last n tokens of prompt and output (-1: all)
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    # what those two count: None the output (OpenAI's); n the last n tokens of prompt and output
    # (llama.cpp's penalties sampler, fed the prompt too; -1 all of them)
    penalty_last_n: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str: bool = False  # the stop string that ended the output stays at its end (vLLM's)

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 <= self.top_p <= 1, f"top_p must be in [0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.repetition_last_n >= -1, f"repeat_last_n must be >= -1, got {self.repetition_last_n}"),
            (
                math.isfinite(self.frequency_penalty),
                f"frequency_penalty must be finite, got {self.frequency_penalty}",
            ),
            (
                math.isfinite(self.presence_penalty),
                f"presence_penalty must be finite, got {self.presence_penalty}",
            ),
            (
                all(-100 <= bias <= 100 or bias == -math.inf for _, bias in self.logit_bias),
                "logit_bias values must be in [-100, 100] or minus infinity (the token is never chosen)",
            ),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.seed is None or self.seed in SEEDS, f"seed must be in [-2^63, 2^64), got {self.seed}"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

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


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """`logits` with each `(token, value)` of `bias` added to that token's logit (OpenAI's logit_bias)."""
    if not bias:
        return logits
    ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([value for _, value in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, values)


def apply_output_penalties(
    logits: torch.Tensor, counted_ids: Iterable[int], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's penalties: each token's logit less `frequency` times its count in `counted_ids` (the
    output so far, or llama.cpp's window: `SamplingParams.penalty_last_n`), less `presence` once if it
    occurs there at all."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    ids = torch.tensor(list(counted_ids), dtype=torch.long, device=logits.device)
    if ids.numel() == 0:
        return logits
    counts = torch.bincount(ids, minlength=logits.numel())[: logits.numel()].to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


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
        # set: each draw keeps the probabilities [V] it drew from in `distribution` (llama-server's
        # post-sampling probabilities; a greedy draw's are 1 for the chosen token, 0 elsewhere)
        self.keep_distribution = False
        self.distribution: torch.Tensor | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def sample(
        self,
        logits: torch.Tensor,
        previous_ids: Iterable[int] = (),
        allowed: torch.Tensor | None = None,
        counted_ids: Iterable[int] = (),
    ) -> int:
        """Next token from `logits` [V]; `previous_ids` (prompt and output) feed the repetition penalty,
        `counted_ids` (`penalty_last_n`'s tokens) the frequency and presence penalties; `allowed` (bool [V],
        constrained decoding) keeps only those tokens. Raises NonFiniteLogits when any logit is NaN or
        infinite."""
        check_finite(logits)
        params = self.params
        logits = apply_logit_bias(logits.reshape(-1), params.logit_bias)
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
        logits = apply_output_penalties(
            logits, counted_ids, params.frequency_penalty, params.presence_penalty
        )
        if allowed is not None:
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        if self.params.greedy:
            token = int(torch.argmax(logits))
            if self.keep_distribution:
                self.distribution = torch.zeros(logits.numel()).index_fill_(0, torch.tensor([token]), 1.0)
            return token
        probs = sampling_distribution(logits, self.params)
        if self.keep_distribution:
            self.distribution = probs
        return int(torch.multinomial(probs, 1, generator=self._generator_for(probs.device)))
