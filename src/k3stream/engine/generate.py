"""The generation loop: prefill, then one decode step per token, with stop handling and streaming.

`Sequence` holds everything about one request except the model state: sampling, stop tokens, stop
strings and incremental detokenisation. `generate` drives one sequence with `decode`; a batching
scheduler drives many with `decode_batch`, calling `choose(logits)` then `accept(token)` for each.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from k3stream.engine.sampling import Sampler, SamplingParams
from k3stream.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from k3stream.engine.prompt_cache import PromptCache

FINISH_STOP, FINISH_LENGTH = "stop", "length"


class ContextFull(ValueError):
    """A prompt that leaves no room in the context for a token: refused before any work."""


class StopGeneration(Exception):
    """Raised by an `on_text` callback (the `chat` command's Ctrl-C) to end the answer after that text:
    `generate` returns what it has (`finish_reason` stop) and keeps the state at its end in the prompt
    cache, as for an answer that ended by itself."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens restored from a prompt cache instead of computed


def prefill_last(model: Any, state: Any, tokens: list[int]) -> torch.Tensor:
    """The last prompt token's logits [vocab]: the model class's own `prefill_last` (the output matrix
    on that row alone) where its `prefill` is the class's too, else the last row of `prefill`'s (so a
    wrapper or a replaced `prefill` keeps its say)."""
    own = getattr(type(model), "prefill_last", None)
    if own is not None and getattr(model.prefill, "__func__", None) is type(model).prefill:
        return own(model, state, tokens)
    return model.prefill(state, tokens)[-1]


def _prefix_function(pattern: str) -> list[int]:
    """KMP failure function: for each prefix, the length of its longest proper border."""
    borders = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = borders[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        borders[i] = k
    return borders


class StopMatcher:
    """Finds stop strings in text that arrives in pieces, in time linear in the text (one KMP automaton
    per stop string), and knows how much of the text's end could still begin one."""

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = list(stops)
        self._borders = [_prefix_function(stop) for stop in self.stops]
        self._states = [0] * len(self.stops)  # per stop: its longest prefix that ends the text
        self._consumed = 0

    def feed(self, text: str) -> int | None:
        """Consume `text`; the start (in all text fed) of the earliest stop string found, or None."""
        earliest = None
        for index, stop in enumerate(self.stops):
            found = self._advance(index, stop, text)
            if found is not None and (earliest is None or found < earliest):
                earliest = found
        self._consumed += len(text)
        return earliest

    def _advance(self, index: int, stop: str, text: str) -> int | None:
        borders, k = self._borders[index], self._states[index]
        for offset, char in enumerate(text):
            while k and stop[k] != char:
                k = borders[k - 1]
            if stop[k] == char:
                k += 1
            if k == len(stop):
                self._states[index] = borders[k - 1]
                return self._consumed + offset + 1 - len(stop)
        self._states[index] = k
        return None

    def held_back(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        return max(self._states, default=0)


class MarkedText:
    """An answer's text holding marks (one character each, standing for a special token a parser must
    see) and the same text with each mark spelled as its token's text: what stop strings match, as they
    match the text a client sees."""

    def __init__(self, spellings: Mapping[str, str]) -> None:
        self.marked = ""
        self._spelled = ""  # kept apart only where there are marks to spell
        self._spellings = spellings  # mark -> its token's text
        self._places: list[int] = []  # each mark's place in `marked`
        self._starts: list[int] = []  # where its spelling starts in `spelled`
        self._ends: list[int] = []  # and ends

    @property
    def spelled(self) -> str:
        return self._spelled if self._spellings else self.marked

    def add(self, text: str) -> None:
        self.marked += text
        if self._spellings:
            self._spelled += text

    def add_mark(self, mark: str) -> None:
        self._places.append(len(self.marked))
        self._starts.append(len(self._spelled))
        self.marked += mark
        self._spelled += self._spellings[mark]
        self._ends.append(len(self._spelled))

    def marked_place(self, spelled_place: int, *, inside_after: bool) -> int:
        """The place in `marked` of a place in `spelled`: one inside a mark's spelling is the place
        before that mark, or after it where `inside_after`."""
        last = bisect_left(self._starts, spelled_place) - 1  # the last mark starting before it
        if last < 0:
            return spelled_place
        if spelled_place < self._ends[last]:
            return self._places[last] + inside_after
        return spelled_place - (self._ends[last] - self._places[last] - 1)


class Sequence:
    """One request's decoding logic, driven by logits from outside.

    `choose(logits)` samples the next token; `accept(token)` records it and returns the text it
    releases. Text that could be the start of a stop string is held back until it is clear either
    way; what follows a matched stop string is dropped, and the stop string too unless
    `params.include_stop_str`. `marks` maps token ids (special tokens a parser must see) to the text
    they decode to, a one-character mark; stop strings match the text with those tokens spelled, and a
    cut inside one's spelling goes before it (after it where the stop string is kept).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Seq[int],
        params: SamplingParams,
        on_text: Callable[[str], Any] | None = None,
        marks: Mapping[int, str] | None = None,
    ):
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.tokenizer = tokenizer
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_word = ""  # the stop string that ended the output ("" for none)
        self._on_text = on_text
        self._sampler = Sampler(params)
        self._decoder = tokenizer.stream_decoder(skip_special=params.skip_special_tokens)
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= tokenizer.end_ids
        self._marks = dict(marks or {})  # token id -> the text it stands for (special tokens kept as marks)
        self._answer = MarkedText({mark: tokenizer.decode([token]) for token, mark in self._marks.items()})
        self._released = 0  # characters of the marked answer handed out so far
        self._stops = StopMatcher(params.stop)
        self._matched = 0  # characters of the spelled answer the stop matcher has seen

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output so far, excluding held-back text."""
        return self._answer.marked[: self._released]

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    def choose(self, logits: Any, allowed: Any = None) -> int:
        """Sample the next token from a `[V]` logits row (among the `allowed` tokens, bool [V], if given)."""
        return self._sampler.sample(logits, self._context_ids(), allowed, self._counted_ids())

    def _context_ids(self) -> list[int]:
        """The tokens the repetition penalty sees."""
        return self._last(self.params.repetition_last_n) if self.params.repetition_penalty != 1.0 else []

    def _counted_ids(self) -> list[int]:
        """The tokens the frequency and presence penalties count: the output, or `penalty_last_n`'s."""
        last_n = self.params.penalty_last_n
        return self.token_ids if last_n is None else self._last(last_n)

    def _last(self, n: int) -> list[int]:
        """The last `n` tokens of prompt and output (-1: all of them)."""
        if n == 0:
            return []
        context = self.prompt_ids + self.token_ids
        return context if n < 0 else context[-n:]

    def accept(self, token: int) -> str:
        """Record `token`; return the newly released text (also given to `on_text`)."""
        if self.done:
            raise RuntimeError("the sequence has already finished")
        self.token_ids.append(token)
        if token in self._stop_ids:
            self.finish_reason = FINISH_STOP
            self._answer.add(self._decoder.flush())
            self._match_stop_strings()  # the flush's U+FFFD may complete one
        else:
            self._decode(token)
            self._match_stop_strings()
            if not self.done and len(self.token_ids) >= self.params.max_tokens:
                self.finish_reason = FINISH_LENGTH
                self._answer.add(self._decoder.flush())
                self._match_stop_strings()
        return self._release()

    def _decode(self, token: int) -> None:
        mark = self._marks.get(token)
        if mark is None:
            self._answer.add(self._decoder.feed(token))
        else:
            self._answer.add(self._decoder.flush())
            self._answer.add_mark(mark)

    def feed(self, logits: Any) -> tuple[int, bool]:
        """`choose` then `accept`: the token and whether the sequence is finished."""
        token = self.choose(logits)
        self.accept(token)
        return token, self.done

    def _match_stop_strings(self) -> None:
        """Look for stop strings in the text added since the last look (linear in the output)."""
        answer = self._answer
        start = self._stops.feed(answer.spelled[self._matched :])
        self._matched = len(answer.spelled)
        if start is not None:
            self.stop_word = next(s for s in self.params.stop if answer.spelled.startswith(s, start))
            kept = self.params.include_stop_str
            end = answer.marked_place(start + len(self.stop_word) * kept, inside_after=kept)
            answer.marked = answer.marked[:end]
            self.finish_reason = FINISH_STOP

    def _release(self) -> str:
        answer = self._answer
        held = self._stops.held_back()
        end = (
            len(answer.marked)
            if self.done
            else answer.marked_place(len(answer.spelled) - held, inside_after=False)
        )
        piece = answer.marked[self._released : end]
        self._released = max(self._released, end)
        if piece and self._on_text is not None:
            self._on_text(piece)
        return piece


def generate(
    model: Any,
    tokenizer: Tokenizer,
    prompt_ids: Seq[int],
    params: SamplingParams,
    on_text: Callable[[str], Any] | None = None,
    cache: PromptCache | None = None,
    context: int | None = None,
) -> GenerationResult:
    """Run `prompt_ids` through `model` and sample until a stop condition; stream text to `on_text`.

    Generation also ends ("length") when the context is full: `context` tokens (the one the memory plan
    holds, `--ctx`), else the model's; a prompt that fills it raises ContextFull. With a prompt `cache`
    (`prompt_cache.PromptCache` of this model) the longest cached prefix of the prompt is restored
    instead of computed (`cached_tokens` in the result) and the states at the prompt's and the
    response's ends are kept for the next turn.
    """
    params = _within_context(model, len(prompt_ids), params, context)
    if cache is not None:
        from k3stream.engine.chunked_prefill import check_cache_model

        check_cache_model(cache, model)
    sequence = Sequence(tokenizer, prompt_ids, params, on_text)
    start = time.perf_counter()
    if cache is not None:
        prefill = cache.chunked(sequence.prompt_ids)
        prefilled = prefill.run(keep_end=False)
        state, logits, cached = prefilled.state, prefilled.logits, prefilled.reused
    else:
        state, cached = model.new_state(), 0
        logits = prefill_last(model, state, sequence.prompt_ids)
    done = _feed(sequence, logits)
    first_token_at = time.perf_counter()
    if cache is not None:  # the prompt's end, once the first token's text is out
        prefill.keep_end()
    while not done:
        done = _feed(sequence, model.decode(state, sequence.token_ids[-1]))
    end = time.perf_counter()
    if cache is not None and len(sequence.token_ids) > 1:  # every token but the last one sampled went
        # through the model (one token: the prompt's end, kept above); the state goes no further
        cache.save(sequence.prompt_ids + sequence.token_ids[:-1], state, final=True)
    return GenerationResult(
        text=sequence.text,
        token_ids=list(sequence.token_ids),
        finish_reason=sequence.finish_reason or FINISH_LENGTH,
        prompt_tokens=len(sequence.prompt_ids),
        completion_tokens=sequence.completion_tokens,
        timings=_timings(
            len(sequence.prompt_ids) - cached, sequence.completion_tokens, start, first_token_at, end
        ),
        cached_tokens=cached,
    )


def _feed(sequence: Sequence, logits: Any) -> bool:
    """`sequence.feed(logits)`: whether the answer is finished, by itself or by its `on_text` raising
    StopGeneration (after the token was accepted, so the state is the tokens before it, as at any end)."""
    try:
        return sequence.feed(logits)[1]
    except StopGeneration:
        sequence.finish_reason = sequence.finish_reason or FINISH_STOP
        return True


def _within_context(
    model: Any, prompt_tokens: int, params: SamplingParams, context: int | None
) -> SamplingParams:
    if context is None:
        context = getattr(getattr(model, "config", None), "context_length", None)
    if context is None:
        return params
    if prompt_tokens >= context:
        raise ContextFull(f"the prompt has {prompt_tokens} tokens; the context is {context}")
    return replace(params, max_tokens=min(params.max_tokens, context - prompt_tokens))


def _timings(
    computed_tokens: int, completion_tokens: int, start: float, first: float, end: float
) -> dict[str, float]:
    """Seconds and rates of one generation: the prefill's rate counts the prompt tokens computed, not
    those restored from a prompt cache."""
    decode_steps = completion_tokens - 1
    prefill_s, decode_s = first - start, end - first
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "time_to_first_token_s": prefill_s,
        "prefill_tokens_per_s": computed_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_tokens_per_s": decode_steps / decode_s if decode_steps and decode_s > 0 else 0.0,
    }
