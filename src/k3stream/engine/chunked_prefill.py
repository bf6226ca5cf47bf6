"""A prompt's prefill in chunks: where the chunks are cut (`PrefillChunks`, by each token's work with
`attention_rows_per_token`), a prompt's prefill restored from a prompt cache and run a chunk at a time
(`ChunkedPrefill`), and the next chunk of several prompts in one pass (`step_together`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from k3stream.engine.generate import prefill_last
from k3stream.gguf.layout import is_routed_expert, layer_shapes
from k3stream.model.snapshot import Snapshot, prefill_marked_batch

if TYPE_CHECKING:
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.gguf.config import K3Config
    from k3stream.model.k3 import SequenceState

# what a multiply-add of the MLA attention (a prompt's queries one at a time, as a decode step's) costs
# in the products' multiply-adds, for `attention_rows_per_token`: chunks of equal work by it took level
# CPU time along a 4,096-token prompt on bench_sessions' stall model (17-22 ms; deep chunks 1.25x the
# first with 1)
ATTENTION_COST = 2.0


def attention_rows_per_token(config: K3Config) -> float:
    """How many latent rows one token's MLA attention must cover to cost as much as all of its other
    work (multiply-adds: every matrix of every layer, the routed experts' by top_k / experts, and the
    KDA recurrence's ~4 D^2 a head; an attention multiply-add counts ATTENTION_COST), by the config's
    shapes. A prompt token at position i attends over i + 1 rows in each MLA layer but the last, so
    deep in a long prompt the attention outweighs the rest; a prefill pass sends only its last row
    (each sequence's) through the last layer's attention, so that layer's rows cost no attention."""
    per_token, per_row = 0.0, 0.0
    for layer in range(config.n_layers):
        for name, shape in layer_shapes(config, layer).items():
            if len(shape) >= 2:
                share = config.top_k / config.n_experts if is_routed_expert(name) else 1.0
                per_token += math.prod(shape) * share
        if not config.is_mla(layer):
            per_token += 4 * config.n_heads * config.kda_head_dim**2
        elif layer < config.n_layers - 1:  # the scores over kv_lora + rope, the context over kv_lora
            per_row += ATTENTION_COST * config.n_heads * (2 * config.kv_lora + config.qk_rope)
    return per_token / per_row if per_row else math.inf


class PrefillChunks:
    """Where a chunked prefill cuts its prompts: from where its computation starts (after what the cache
    restored; never by what runs beside it), each chunk about the work of a prompt's first `tokens`
    tokens, so a stream running beside waits about one such chunk however deep the prompt is, and a
    turn of n new tokens takes the fewest chunks that hold them. With `rows_per_token`
    (`attention_rows_per_token`) a token's work grows with the rows it attends over, and chunks deep in
    a long prompt take fewer tokens; without, every chunk takes `tokens` (where experts stream from a
    pack: a pass then costs its expert reads, nearly whatever its tokens, and n new tokens take
    ceil(n / tokens) passes)."""

    def __init__(self, tokens: int, rows_per_token: float | None = None) -> None:
        if tokens < 1:
            raise ValueError(f"--prefill-chunk must be at least 1, got {tokens}")
        self.tokens = tokens
        finite = rows_per_token is not None and math.isfinite(rows_per_token)
        self.rows_per_token = rows_per_token if finite else None
        self.budget = self.cost(0, tokens)

    def cost(self, start: int, end: int) -> float:
        """The work of positions start..end - 1, in tokens without attention."""
        if self.rows_per_token is None:
            return float(end - start)
        rows = (end * (end + 1) - start * (start + 1)) / 2  # position i attends over i + 1 rows
        return end - start + rows / self.rows_per_token

    def next_end(self, position: int, length: int) -> int:
        """Where the chunk that starts at `position` ends, in a prompt of `length` tokens."""
        if self.rows_per_token is None:
            return min(length, position + self.tokens)
        return min(length, self._end_after(position))

    def _end_after(self, start: int) -> int:
        """The most positions from `start` whose cost fits the budget (at least one): the root of
        e^2 + (1 + 2r) e - (start (start + 1) + 2r (start + budget)) = 0, r = rows_per_token."""
        r = self.rows_per_token
        linear, constant = 1 + 2 * r, start * (start + 1) + 2 * r * (start + self.budget)
        end = int((math.sqrt(linear * linear + 4 * constant) - linear) / 2)
        while self.cost(start, end + 1) <= self.budget:  # the root's rounding, either way
            end += 1
        while end > start and self.cost(start, end) > self.budget:
            end -= 1
        return max(end, start + 1)


def check_cache_model(cache: PromptCache | None, model: Any) -> None:
    """One line for a cache of another loaded model: its snapshots are that model's states, and its
    restores build that model's. Told apart by their config object, which a wrapper of the cache's
    model (a tracer, a rank driver) shares and another load (another file, or the same one loaded again)
    does not."""
    if cache is not None and getattr(cache.model, "config", None) is not getattr(model, "config", None):
        raise ValueError("the prompt cache was made for another model: make one with PromptCache(model, ...)")


class ChunkedPrefill:
    """A prompt's prefill in steps: restored from `cache` (if any) as far as it holds the prompt, then
    `step(chunks)` runs the next of `chunks`' chunks (cut from where the computation starts, whatever
    runs beside it). The last step gives the logits; `keep_end()` snapshots the
    prompt's end, which a server calls once the first token is sent (before the state goes on)."""

    def __init__(
        self, model: Any, tokens: list[int], cache: PromptCache | None = None, reuse: bool = True
    ) -> None:
        check_cache_model(cache, model)
        self.model, self.tokens, self.cache = model, list(tokens), cache
        self.logits: torch.Tensor | None = None
        self._end_unsaved = False  # the prompt's end was computed and is not in the cache yet
        self.wanted: set[int] = set()  # positions other requests wait to restore (`want_snapshot`)
        if cache is not None and cache.enabled and reuse:  # `reuse` False: computed whole, still kept
            self.state, self.reused, self.logits = cache.restore_longest(self.tokens)
        else:
            self.state, self.reused = model.new_state(), 0
        self.position = len(self.tokens) if self.logits is not None else self.reused

    @property
    def done(self) -> bool:
        return self.logits is not None

    def next_end(self, chunks: PrefillChunks) -> int:
        """Where the next of `chunks` ends."""
        return chunks.next_end(self.position, len(self.tokens))

    def want_snapshot(self, position: int) -> None:
        """Snapshot the state at `position` (ahead of this prefill, short of its end: the end is kept
        anyway) in the pass that reaches it, as the cache's own marks are: another request that shares
        the prompt's first `position` tokens restores it instead of computing them again."""
        self.wanted.add(position)

    def marks(self, end: int) -> list[int]:
        """The positions inside the chunk that ends at `end` at which its pass snapshots."""
        wanted = [mark for mark in self.wanted if self.position < mark < end]
        return sorted({*self.cache.marks(self.position, end), *wanted})

    def step(self, chunks: PrefillChunks) -> bool:
        """Prefill the next chunk; whether the prompt is done."""
        if not self.done:
            step_together([self], chunks)
        return self.done

    def advance(self, end: int, logits: torch.Tensor, inside: list[Snapshot]) -> None:
        """Tokens up to `end` went through the model, `logits` the last one's."""
        start, self.position = self.position, end
        cache = self.cache if self.cache is not None and self.cache.enabled else None
        if cache is not None:
            cache.note_prefilled(self.tokens, start, end, inside, self.state, end in self.wanted)
        if end == len(self.tokens):
            self.logits, self._end_unsaved = logits, cache is not None

    @property
    def end_unsaved(self) -> bool:
        """Whether the prompt's end was computed and `keep_end` has not snapshotted it yet."""
        return self._end_unsaved

    def keep_end(self) -> None:
        """Snapshot the prompt's end with its last logits (once; nothing where the cache held it whole):
        call it before the state goes on, after the first token is out where a client waits for it."""
        if self._end_unsaved:
            self._end_unsaved = False
            self.cache.save(self.tokens, self.state, self.logits)

    def run(self, keep_end: bool = True) -> Prefilled:
        """The whole prefill in one pass (and the snapshot of its end, unless `keep_end` is False: the
        caller then calls `keep_end()`)."""
        self.step(PrefillChunks(max(len(self.tokens), 1)))
        if keep_end:
            self.keep_end()
        return Prefilled(self.logits, self.state, self.reused)


def step_together(prefills: list[ChunkedPrefill], chunks: PrefillChunks) -> None:
    """The next chunk of each of `prefills` (one model, one cache or none; none done) in one pass: in
    each MoE layer the experts any of them routes to are read once."""
    first = prefills[0]
    ends = [prefill.next_end(chunks) for prefill in prefills]
    parts = [prefill.tokens[prefill.position : end] for prefill, end in zip(prefills, ends, strict=True)]
    states = [prefill.state for prefill in prefills]
    cache = first.cache if first.cache is not None and first.cache.enabled else None
    if cache is not None:
        marks = [prefill.marks(end) for prefill, end in zip(prefills, ends, strict=True)]
        logits, snapshots = prefill_marked_batch(first.model, states, parts, marks)
    elif len(prefills) == 1:
        logits, snapshots = prefill_last(first.model, states[0], parts[0])[None], [[]]
    else:
        logits, snapshots = first.model.prefill_batch(states, parts), [[] for _ in prefills]
    for row, (prefill, end, inside) in enumerate(zip(prefills, ends, snapshots, strict=True)):
        prefill.advance(end, logits[row], inside)


@dataclass
class Prefilled:
    """What `PromptCache.prefill` returns: the last prompt token's logits, the sequence's live state and
    how many prompt tokens came from the cache."""

    logits: torch.Tensor
    state: SequenceState
    reused: int
