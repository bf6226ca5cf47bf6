"""One request's per-token logic for the scheduler: the engine's `Sequence` (sampling, stops,
detokenisation) plus what the API adds: a grammar that limits the next token, the Kimi output parser
(reasoning, tool calls) and logprobs.

Logprobs are the model's own: log-softmax of the raw logits, before temperature, penalties and the
grammar (what vLLM returns by default); with `post_sampling` they are llama-server's post-sampling
probabilities instead: the distribution the token was drawn from, after the whole sampler chain. Each
piece carries the logprobs of the tokens accepted since the last piece that carried text, so the pieces
of a stream together hold every token once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from k3stream.engine.generate import FINISH_LENGTH, FINISH_STOP, Sequence
from k3stream.engine.sampling import SamplingParams
from k3stream.server.kimi_output import OutputParser, Piece


class TokenConstraint(Protocol):
    def allowed(self) -> torch.Tensor | None:
        """bool [V]: the tokens that may come next (None: any)."""

    def advance(self, token: int) -> None:
        """Record the token that came."""


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top: list[TokenLogprob] = field(default_factory=list)
    id: int = -1  # the token id
    prob: float | None = None  # set: a post-sampling probability, which llama-server sends instead

    def llama(self) -> dict[str, Any]:
        """llama-server's `completion_probabilities` entry (its `top_logprobs`, or `top_probs` after the
        sampler chain, without lists of their own)."""
        entry = self.llama_top()
        key = "top_logprobs" if self.prob is None else "top_probs"
        return {**entry, key: [t.llama_top() for t in self.top]}

    def llama_top(self) -> dict[str, Any]:
        value = {"logprob": self.logprob} if self.prob is None else {"prob": self.prob}
        return {"id": self.id, "token": self.token, "bytes": self.bytes, **value}

    def openai(self) -> dict[str, Any]:
        """The chat API's entry (`top_logprobs` entries have no list of their own)."""
        entry: dict[str, Any] = {"token": self.token, "logprob": self.logprob, "bytes": self.bytes}
        return {**entry, "top_logprobs": [t.openai_top() for t in self.top]}

    def openai_top(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": self.bytes}


class RequestLogic:
    """`SequenceLogic` for the scheduler; `accept` returns a `Piece` (empty when nothing is released)."""

    def __init__(
        self,
        sequence: Sequence,
        tokenizer: Any,
        *,
        parser: OutputParser | None = None,
        constraint: TokenConstraint | None = None,
        top_logprobs: int | None = None,
        post_sampling: bool = False,
        on_answer: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        self.sequence = sequence
        self.on_answer = on_answer  # hears a finished answer's prompt and token ids
        self.tokenizer = tokenizer
        self.parser = parser
        self.constraint = constraint
        self.top_logprobs = top_logprobs
        self.post_sampling = post_sampling and top_logprobs is not None
        sequence.sampler.keep_distribution = self.post_sampling
        self._logprobs: list[TokenLogprob] = []
        self._tokens: list[int] = []
        self.reasoning_tokens = 0  # the tokens accepted inside the think block, its delimiters included

    @property
    def finish_reason(self) -> str | None:
        """The sequence's finish reason; `tool_calls` where it stopped after calls that all ended with
        arguments their tools take (an unfinished call is sent, but not as one to run)."""
        reason = self.sequence.finish_reason
        if reason == FINISH_STOP and self.parser is not None and self.parser.calls_complete:
            return "tool_calls"
        return reason

    def unfinished(self, call_index: int) -> bool:
        """Whether the call at `call_index` is one not to run: cut by the answer's end, or with arguments
        its tool does not take."""
        return self.parser is not None and call_index in self.parser.unfinished

    @property
    def completion_tokens(self) -> int:
        return self.sequence.completion_tokens

    @property
    def params(self) -> SamplingParams:
        return self.sequence.params

    def choose(self, logits: torch.Tensor) -> int:
        allowed = self.constraint.allowed() if self.constraint is not None else None
        token = self.sequence.choose(logits, allowed)
        if self.post_sampling:
            self._logprobs.append(self._probability(self.sequence.sampler.distribution, token))
        elif self.top_logprobs is not None:
            self._logprobs.append(self._logprob(logits, token))
        return token

    def accept(self, token: int) -> Piece:
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.sequence.accept(token)
        self._tokens.append(token)
        if self.parser is None:
            piece = Piece(content=text)
        else:
            was_reasoning = self.parser.in_reasoning
            piece = self.parser.feed(text)
            self.reasoning_tokens += was_reasoning or self.parser.in_reasoning
        if self.parser is not None and self.sequence.done:
            piece.extend(self.parser.finish())
        if self.on_answer is not None and self.sequence.done:
            self.on_answer(self.sequence.prompt_ids, self.sequence.token_ids)
        if piece.content or piece.reasoning or piece.tool_calls or self.sequence.done:
            piece.logprobs, self._logprobs = self._logprobs, []
            piece.tokens, self._tokens = self._tokens, []
        return piece

    def end(self) -> None:
        self.sequence.finish_reason = FINISH_LENGTH

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits.reshape(-1).float(), dim=-1)
        top = torch.topk(logprobs, self.top_logprobs) if self.top_logprobs else None
        listed = [] if top is None else zip(top.indices.tolist(), top.values.tolist(), strict=True)
        entry = self._entry(token, float(logprobs[token]))
        top = [self._entry(i, v) for i, v in listed]
        return TokenLogprob(entry.token, entry.logprob, entry.bytes, top, token)

    def _probability(self, probs: torch.Tensor, token: int) -> TokenLogprob:
        """llama-server's post-sampling entry: the token's probability in the distribution it was drawn
        from and the `top_logprobs` likeliest tokens of it, those of probability 0 left out."""
        top = torch.topk(probs, min(self.top_logprobs, probs.numel()))
        listed = [(i, p) for i, p in zip(top.indices.tolist(), top.values.tolist(), strict=True) if p > 0]
        entry = self._entry(token, 0.0, float(probs[token]))
        return replace(entry, top=[self._entry(i, 0.0, p) for i, p in listed])

    def _entry(self, token: int, logprob: float, prob: float | None = None) -> TokenLogprob:
        """The token as the tokenizer decodes it (special tokens as their text)."""
        piece = self.tokenizer.piece(token)
        return TokenLogprob(
            piece.decode("utf-8", errors="replace"), logprob, list(piece), id=token, prob=prob
        )
