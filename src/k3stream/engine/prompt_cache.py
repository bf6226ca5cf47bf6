"""The prompt cache: sequence-state snapshots by exact token prefix, in RAM and on disk.

A request's prompt ids are matched against a radix tree of the token ids whose states were snapshotted
(`model.snapshot`); the longest prefix with a snapshot is restored and only the rest is prefilled.
Snapshots come from passes that run anyway: the end of each prompt's prefill, every `every` tokens
inside it (the same pass: `snapshot.prefill_marked`), and the end of each response. A snapshot is
keyed to the token ids, to the model file's fingerprint and to how the model computes (`computation_key`:
k3stream's code and the load options that decide the bits), so another model, template, system prompt,
arithmetic flag or k3stream build never reuses a state the cold prefill would not reach.

Tiers: RAM (a byte budget; snapshots of one sequence share their MLA rows, counted once per buffer) and
disk (one file a snapshot: a header with the fingerprint and token ids, the tensors, an xxh3_64 of all
of it; written to a temporary name and renamed, so a restarted process finds whole files or none; a
file that fails its checksum is a miss with a warning). On disk too a conversation's snapshots share
their MLA rows: a file holds only the rows past its parent, the deepest snapshot file of a prefix of its
tokens, named in its header by length and checksum; a restore reads the chain. A parent is kept while a
file refers to it; a missing or changed parent makes its children misses. Both tiers evict by what a
snapshot saves (tokens of recompute) per byte, halved for every `HALF_LIFE` cache operations since its
last use. One budget covers every snapshot folder of the disk tier's directory, other keys' first
(`cache_folders`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import torch
import xxhash

from k3stream.engine.cache_folders import FolderLock, Foreign, Removed, trim_directory
from k3stream.engine.generate import prefill_last
from k3stream.gguf.layout import is_routed_expert, layer_shapes
from k3stream.memlimit import format_size
from k3stream.model.kda import KDAState
from k3stream.model.snapshot import (
    LatentRows,
    Snapshot,
    StateLayout,
    check_fits,
    prefill_marked_batch,
    restore,
    restores_exactly,
    state_layout,
    take_snapshot,
)
from k3stream.pack.fileio import write_bytes_atomic
from k3stream.quant.kernels import set_row_exact

if TYPE_CHECKING:
    from k3stream.gguf.config import K3Config
    from k3stream.model.k3 import K3Model, SequenceState

log = logging.getLogger(__name__)
MIB, GIB = 1 << 20, 1 << 30
HALF_LIFE = 64  # cache operations after which a snapshot's score halves
DEFAULT_EVERY = 1024  # tokens between snapshots inside a prefill (docs/prompt-cache.md: why)
# what a multiply-add of the MLA attention (a prompt's queries one at a time, as a decode step's) costs
# in the products' multiply-adds, for `attention_rows_per_token`: chunks of equal work by it took level
# CPU time along a 4,096-token prompt on bench_sessions' stall model (17-22 ms; deep chunks 1.25x the
# first with 1)
ATTENTION_COST = 2.0
MAGIC = b"K3SNAP02"
SUFFIX = ".k3snap"


@functools.cache
def code_fingerprint() -> str:
    """xxh3_64 (hex) of k3stream's own code: every Python file and compiled kernel library of the
    package (another build computes other bits, or may)."""
    package = Path(__file__).resolve().parents[1]
    digest = xxhash.xxh3_64()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".so") and p.is_file()):
        digest.update(f"{path.relative_to(package)}:".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def computation_key(model: K3Model) -> str:
    """How `model` computes, beside its file: k3stream's code, the load options' arithmetic and the
    integer kernels' instruction set (xxh3_64 hex)."""
    from k3stream.quant.kernels import cpu

    isa = cpu.isa() if cpu.available() else "none"
    return xxhash.xxh3_64(f"{code_fingerprint()}|{model.arithmetic}|{isa}".encode()).hexdigest()


def model_fingerprint(shards: list[Path]) -> str:
    """xxh3_64 (hex) of a model's GGUF shards: their sizes, modification times and sampled windows of
    their bytes. The windows leave most of a large shard unread, so a shard rewritten in place with
    bytes changed between them (its size kept) differs by its modification time; a renamed shard keeps
    its fingerprint, a copy made without its time is a miss."""
    from k3stream.pack.integrity import shard_fingerprint

    digest = xxhash.xxh3_64()
    for path in shards:
        stat = os.stat(path)
        windows = shard_fingerprint(Path(path), 0, stat.st_size)
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}:{windows};".encode())
    return digest.hexdigest()


@dataclass
class Entry:
    """One snapshot's place in the tree: its token ids, and where it lives (RAM, disk or both)."""

    tokens: tuple[int, ...]
    snapshot: Snapshot | None = None
    disk_path: Path | None = None
    disk_bytes: int = 0
    disk_checksum: int | None = None  # the file's identity its children name: its first xxh3_64
    disk_parent: Entry | None = None  # the file holding the latent rows before this file's own
    disk_children: int = 0  # files whose rows continue this one's: it stays while there are any
    disk_rows_bytes: int = 0  # of `disk_bytes`, the file's own latent rows
    rows_only: bool = False  # the file keeps only its latent rows, for its children (not restorable)
    last_used: int = 0
    disk_logits: bool = False  # the file holds the last token's logits (it ends a prompt)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def has_logits(self) -> bool:
        """Whether the snapshot a restore would take (RAM's, else the file's) holds its last token's
        logits: the RAM snapshot and the file of one entry can differ (a response's end written to disk,
        the same ids then a prompt whose end's logits stay in RAM)."""
        if self.snapshot is not None:
            return self.snapshot.logits is not None
        return self.disk_path is not None and self.disk_logits

    @property
    def restorable(self) -> bool:
        return self.snapshot is not None or (self.disk_path is not None and not self.rows_only)


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)
    entry: Entry | None = None


class RadixTree:
    """Token-id sequences with an entry each; `deepest(tokens)`: the longest stored prefix of tokens."""

    def __init__(self) -> None:
        self.root = _Node()

    def insert(self, entry: Entry) -> Entry:
        """Store `entry` at its tokens (an entry already there stays and is returned)."""
        node, tokens = self.root, entry.tokens
        while tokens:
            child = node.children.get(tokens[0])
            if child is None:
                child = node.children[tokens[0]] = _Node(tokens)
                node, tokens = child, ()
                break
            common = common_length(child.edge, tokens)
            if common < len(child.edge):  # split the edge where the two part
                middle = _Node(child.edge[:common], {child.edge[common]: child})
                child.edge = child.edge[common:]
                node.children[tokens[0]] = middle
                child = middle
            node, tokens = child, tokens[common:]
        if node.entry is None:
            node.entry = entry
        return node.entry

    def deepest(
        self, tokens: tuple[int, ...] | list[int], limit: int, accept: Callable[[Entry], bool] = bool
    ) -> Entry | None:
        """The entry of the longest prefix of `tokens` of at most `limit` tokens that `accept`s."""
        node, depth, best = self.root, 0, None
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None or depth + len(child.edge) > limit:
                break
            if tuple(tokens[depth : depth + len(child.edge)]) != child.edge:
                break
            node, depth = child, depth + len(child.edge)
            if node.entry is not None and accept(node.entry):
                best = node.entry
        return best

    def shared_length(self, tokens: tuple[int, ...] | list[int]) -> int:
        """How many of `tokens` lead some stored entry's tokens: where `tokens` branch off the tree."""
        node, depth = self.root, 0
        while depth < len(tokens) and (child := node.children.get(tokens[depth])) is not None:
            common = common_length(child.edge, tuple(tokens[depth : depth + len(child.edge)]))
            depth += common
            if common < len(child.edge):
                break
            node = child
        return depth

    def remove(self, tokens: tuple[int, ...]) -> None:
        """Take the entry at `tokens` out (nothing when there is none), and the nodes left empty."""
        path, node, rest = [self.root], self.root, tokens
        while rest:
            node = node.children.get(rest[0])
            if node is None or tuple(rest[: len(node.edge)]) != node.edge:
                return
            path.append(node)
            rest = rest[len(node.edge) :]
        node.entry = None
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if child.entry is not None or child.children:
                break
            del parent.children[child.edge[0]]

    def entries(self) -> Iterator[Entry]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                yield node.entry
            stack.extend(node.children.values())


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of two tuples or two lists (a tuple's slice never equals a
    list's): by slice comparisons (C loops), halving the range where they part, not a Python loop over
    a conversation's thousands of ids."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; they part before high (or are equal to it)
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0
    evictions_ram: int = 0
    evictions_disk: int = 0
    snapshots_created: int = 0
    disk_errors: int = 0
    create_s: float = 0.0
    restore_s: float = 0.0
    foreign: Foreign = field(default_factory=Foreign)  # the other folders under the disk tier's directory
    removed: Removed = field(default_factory=Removed)  # what trimming that directory removed


class _RowExactUsers:
    """The open caches: the products are row-exact while there is one (`kernels.set_row_exact`)."""

    count = 0
    lock = threading.Lock()

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            cls.count += 1
            set_row_exact(True)

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.count -= 1
            set_row_exact(cls.count > 0)


def keep_row_exact() -> None:
    """Row-exact products for the rest of the process, with a prompt cache or without: a server's or a
    chat's answers then never depend on its cache settings, on batching or on chunking."""
    _RowExactUsers.enter()


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


class Peers(Protocol):
    """The other ranks of a model split over processes (`parallel.runner.DriverModel`): each keeps its
    own cache of its shard of the states, told by rank 0 what to snapshot and restore."""

    def save_snapshot(self, state: SequenceState) -> None: ...

    def restored(self, state: SequenceState, tokens: list[int]) -> bool: ...


@dataclass
class Prefilled:
    """What `PromptCache.prefill` returns: the last prompt token's logits, the sequence's live state and
    how many prompt tokens came from the cache."""

    logits: torch.Tensor
    state: SequenceState
    reused: int


class PromptCache:
    """Snapshots of one model's sequences by exact token prefix (thread-safe: one lock around the tree
    and tiers; snapshots are immutable once stored, restores copy them)."""

    def __init__(
        self,
        model: K3Model,
        fingerprint: str,
        ram_bytes: int,
        disk_dir: Path | str | None = None,
        disk_bytes: int = 0,
        every: int = DEFAULT_EVERY,
        peers: Peers | None = None,
    ) -> None:
        if ram_bytes < 0 or disk_bytes < 0 or every < 1:
            raise ValueError("prompt cache: budgets must be >= 0 and --cache-every >= 1")
        self.model = model
        self.fingerprint = f"{computation_key(model)}-{fingerprint}"  # its disk folder's name too
        self.ram_budget = ram_bytes
        self.disk_budget = disk_bytes if disk_dir is not None else 0
        self.every = every
        self.peers = peers
        self.stats = CacheStats()
        self._tree = RadixTree()
        self._lock = threading.RLock()
        self._clock = 0
        self._storages: dict[int, list[int]] = {}  # latent storage -> [references, bytes]
        self._fixed_ram = 0
        self.disk_dir = Path(disk_dir) / self.fingerprint if disk_dir is not None else None
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="k3stream-cache-writer")
        self._closed = False
        self._folder_lock: FolderLock | None = None
        if self.disk_dir is not None and self.disk_budget:
            self._folder_lock = FolderLock(self.disk_dir)  # other processes leave its files alone
            self._scan_disk()
            self._evict_disk()  # the whole directory within the budget from the start
        if self.enabled:  # a restored state continues with the cold bits (`model.snapshot`)
            self._row_exact = weakref.finalize(self, _RowExactUsers.leave)
            _RowExactUsers.enter()

    @functools.cached_property
    def layout(self) -> StateLayout:
        """The shapes of this model's snapshots, which a file's header must give."""
        return state_layout(self.model)

    @property
    def enabled(self) -> bool:
        return self.ram_budget > 0

    def flush(self) -> None:
        """Wait for the snapshot files queued so far."""
        self._writes.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued snapshot files (a restarted process finds them) and stop writing."""
        with self._lock:
            self._closed = True  # later snapshots stay in RAM
        self._writes.shutdown(wait=True)
        if self._folder_lock is not None:
            self._folder_lock.release()
        if self.enabled:
            self._row_exact()  # runs once, here or when the cache is collected

    # ---- the driver --------------------------------------------------------------------------------

    def prefill(self, tokens: list[int]) -> Prefilled:
        """The prompt's last logits and live state: restored from the deepest snapshot of a prefix of
        `tokens`, the rest prefilled in one pass that snapshots every `every` tokens and at its end. A
        prompt seen whole before comes back with the logits its prefill kept."""
        return self.chunked(tokens).run()

    def chunked(self, tokens: list[int]) -> ChunkedPrefill:
        """The prompt's prefill, restored as far as the cache holds it, to run in steps."""
        return ChunkedPrefill(self.model, tokens, self)

    def note_prefilled(
        self,
        tokens: list[int],
        start: int,
        end: int,
        inside: list[Snapshot],
        state: SequenceState | None = None,
        wanted: bool = False,
    ) -> None:
        """Tokens start..end of `tokens` went through the model into `state`, with snapshots `inside`
        (`marks`); a chunk that ends at a snapshot position (a multiple of `every`, or `wanted`: another
        request waits for it) short of the prompt's end (whose snapshot `save` takes, with its logits)
        is snapshotted there from `state` (a follower rank's: when rank 0 tells it,
        `Peers.save_snapshot`)."""
        for snapshot in inside:
            self._store(tokens[: snapshot.length], snapshot, durable=False)
        at_mark = wanted or end % self.every == 0
        if state is not None and self.enabled and end < len(tokens) and at_mark:
            if self.peers is not None:
                self.peers.save_snapshot(state)
            self._store(tokens[:end], take_snapshot(state), durable=False)
        with self._lock:
            self.stats.tokens_computed += end - start

    def marks(self, start: int, end: int) -> list[int]:
        """The positions in start < p < end at which a prefill snapshots: every `every` tokens, only the
        deepest of them where the RAM budget holds fewer snapshots (a pass holds a copy of the KDA states
        at each of its marks until it ends: `--cache-every 1` would hold one a token of the pass, the
        shallower ones evicted as soon as stored)."""
        if not self.enabled:
            return []
        marks = range((start // self.every + 1) * self.every, end, self.every)
        return list(marks[max(len(marks) - self._snapshots_held, 0) :])

    @functools.cached_property
    def _snapshots_held(self) -> int:
        """How many snapshots' KDA states (their fixed part) the RAM budget holds."""
        return self.ram_budget // max(take_snapshot(self.model.new_state()).fixed_bytes, 1)

    def restore_longest(self, tokens: list[int]) -> tuple[SequenceState, int, torch.Tensor | None]:
        """A state restored from the deepest snapshot of a prefix of `tokens` (a new state and 0 where
        none is), that snapshot's length, and the last token's logits where it is the whole prompt (a
        snapshot of all of `tokens` without logits is passed over: the last logits must be computed)."""
        usable = self._usable_for(tokens)
        while self.enabled:
            found = self._use_deepest(tokens, usable)
            if found is None:
                break
            entry, snapshot = found
            if snapshot is None:  # a bad file: dropped, look again
                continue
            started = time.perf_counter()
            state = restore(self.model, snapshot, room=len(tokens) - entry.length)
            if self.peers is not None and not self.peers.restored(state, list(entry.tokens)):
                log.warning("prompt cache: a rank lacks the snapshot of %d tokens; a miss", entry.length)
                self._discard(entry)
                continue
            self._count_hit(entry, started)
            whole = entry.length == len(tokens) and snapshot.logits is not None
            return state, entry.length, snapshot.logits.clone() if whole else None
        with self._lock:
            self.stats.misses += self.enabled
        return self.model.new_state(), 0, None

    def cached_length(self, tokens: list[int]) -> int:
        """How many tokens of `tokens` `restore_longest` would restore (0: none, or the cache is off),
        without using the snapshot."""
        if not self.enabled:
            return 0
        with self._lock:
            usable = self._usable_for(tokens)
            entry = self._tree.deepest(tokens, len(tokens), lambda e: e.restorable and usable(e))
            return 0 if entry is None else entry.length

    def branch_length(self, tokens: list[int]) -> int:
        """How many of `tokens` lead the tokens of a snapshot the cache holds: where the prompt branches
        off what the cache has seen (0 with the cache off)."""
        if not self.enabled:
            return 0
        with self._lock:
            return self._tree.shared_length(tokens)

    @functools.cached_property
    def snapshots_anywhere(self) -> bool:
        """Whether a prefill's state restores exactly at every position (the per-token KDA recurrence;
        `snapshot.restores_exactly`), so another request may wait for a snapshot at any position."""
        return restores_exactly(self.model)

    def _usable_for(self, tokens: list[int]) -> Callable[[Entry], bool]:
        """Which entries may serve a prompt of `tokens`: all of it only with its last logits; and where
        a prefill resumed from a snapshot does not get the cold bits (`snapshots_anywhere` False: the
        chunked torch recurrence, torch's fallbacks for the C kernels), only all of it (nothing is
        computed after the restore, so its logits are those of the cold prefill that kept them)."""
        whole = len(tokens)
        if not self.snapshots_anywhere:
            return lambda entry: entry.length == whole and entry.has_logits
        return lambda entry: entry.length < whole or entry.has_logits

    def needs_read(self, tokens: list[int]) -> bool:
        """Whether `restore_longest(tokens)` would read its snapshot from disk (only a file holds it)."""
        if not self.enabled:
            return False
        with self._lock:
            usable = self._usable_for(tokens)
            entry = self._tree.deepest(tokens, len(tokens), lambda e: e.restorable and usable(e))
            return entry is not None and entry.snapshot is None

    def read_ahead(self, tokens: list[int]) -> None:
        """Read the snapshot `restore_longest(tokens)` would restore into the RAM tier where only its
        file holds it (a bad file is dropped, as there): a server calls it off its scheduler's thread,
        so the streams it runs go on while the disk reads; the restore then copies from RAM."""
        if self.enabled:
            self._use_deepest(tokens, self._usable_for(tokens))

    def restore_exact(self, tokens: list[int]) -> SequenceState | None:
        """A state restored from the snapshot of exactly `tokens`, or None (a rank told by rank 0)."""
        found = self._use_deepest(tokens, lambda entry: entry.length == len(tokens))
        if found is None or found[1] is None:
            return None
        entry, snapshot = found
        started = time.perf_counter()
        state = restore(self.model, snapshot)
        self._count_hit(entry, started)
        return state

    def _use_deepest(
        self, tokens: list[int], usable: Callable[[Entry], bool]
    ) -> tuple[Entry, Snapshot | None] | None:
        """The deepest usable entry of a prefix of `tokens`, marked used, and its snapshot (read from
        disk where only its file holds it; None for a bad file, which is dropped); None for no entry."""
        with self._lock:
            self._clock += 1
            entry = self._tree.deepest(tokens, len(tokens), lambda e: e.restorable and usable(e))
            if entry is None:
                return None
            entry.last_used = self._clock
            snapshot = entry.snapshot
        return entry, self._load(entry) if snapshot is None else snapshot

    def _count_hit(self, entry: Entry, started: float) -> None:
        with self._lock:
            self.stats.restore_s += time.perf_counter() - started
            self.stats.hits += 1
            self.stats.tokens_reused += entry.length

    def save(
        self,
        tokens: list[int],
        state: SequenceState,
        logits: torch.Tensor | None = None,
        final: bool = False,
    ) -> None:
        """Snapshot `state`, the state after exactly `tokens` (the end of a prompt, with its last
        `logits`, or of a response). `final`: the state goes no further (a finished response), so the
        snapshot takes its KDA tensors instead of copying them, and its latent rows get room for the
        next turn (`snapshot.take_snapshot`); the caller must not use the state again."""
        if not self.enabled:
            return
        if state.length != len(tokens):
            raise ValueError(f"prompt cache: a state of {state.length} tokens saved under {len(tokens)} ids")
        if self.peers is not None:
            self.peers.save_snapshot(state)
        started = time.perf_counter()
        snapshot = take_snapshot(state, final)
        if logits is not None:
            snapshot = snapshot.with_logits(logits)
        with self._lock:
            self.stats.create_s += time.perf_counter() - started
        self._store(tokens, snapshot, durable=True)

    def export(self, tokens: list[int], path: Path) -> tuple[int, int]:
        """Write the deepest snapshot of a prefix of `tokens` to `path` as a file of its own (every latent
        row in it, no parent; written to a temporary name, synced and renamed), for `import_file`:
        (its tokens, bytes written); (0, 0) where the cache holds no prefix of `tokens`."""
        found = self._use_deepest(tokens, lambda entry: True) if self.enabled else None
        if found is None or found[1] is None:
            return 0, 0
        entry, snapshot = found
        parts = encode(self.fingerprint, entry.tokens, snapshot)
        write_bytes_atomic(path, parts)
        return entry.length, _size(parts)

    def import_file(self, path: Path) -> tuple[list[int], int]:
        """A file `export` wrote, checked (checksum, this model file and computation, shapes) and stored
        in the cache, where the next prompt that starts with its tokens restores it: (its tokens, bytes
        read). Raises ValueError (OSError for a file that cannot be read) naming what is wrong."""
        if not self.enabled:
            raise ValueError("the prompt cache is off (--cache-ram 0)")
        tokens = tuple(read_header(path, self.fingerprint)["tokens"])
        data = read_file(path)
        snapshot, parent, _ = decode(data, self.fingerprint, tokens, self.layout)
        if parent != (0, 0) or any(layer is None for layer in snapshot.layers):
            raise ValueError("a prompt-cache file that depends on others, not a saved slot")
        check_fits(self.model.new_state(), snapshot)
        self._store(list(tokens), snapshot, durable=True)
        return list(tokens), len(data)

    # ---- the tiers ---------------------------------------------------------------------------------

    def _store(self, tokens: list[int], snapshot: Snapshot, durable: bool) -> None:
        if not self.enabled or (snapshot.logits is None and not self.snapshots_anywhere):
            return  # without logits a snapshot serves only a resumed prefill (`_usable_for`)
        key = tuple(tokens)
        with self._lock:
            self._clock += 1
            entry = self._tree.insert(Entry(key, last_used=self._clock))
            entry.last_used = self._clock
            if entry.snapshot is None or (snapshot.logits is not None and not entry.has_logits):
                if entry.snapshot is not None:
                    self._account(entry.snapshot, -1)
                entry.snapshot = snapshot
                self._account(snapshot, +1)
                self.stats.snapshots_created += 1
            write = durable and self.disk_budget > 0 and entry.disk_path is None and not self._closed
            self._evict_ram()  # may take this one out of RAM: its file is still written
        if write:  # off the request's path: the first token does not wait for the disk
            self._writes.submit(self._write, entry, snapshot)

    def _account(self, snapshot: Snapshot, sign: int) -> None:
        self._fixed_ram += sign * snapshot.fixed_bytes
        for latent in snapshot.latents():
            held = self._storages.setdefault(latent.storage_key(), [0, latent.storage_bytes])
            held[0] += sign
            if held[0] == 0:
                del self._storages[latent.storage_key()]

    @property
    def ram_bytes(self) -> int:
        with self._lock:
            return self._fixed_ram + sum(nbytes for _, nbytes in self._storages.values())

    @property
    def disk_used(self) -> int:
        with self._lock:
            return sum(entry.disk_bytes for entry in self._tree.entries())

    def counts(self) -> dict[str, int]:
        with self._lock:
            entries = list(self._tree.entries())
            return {
                "ram_snapshots": sum(entry.snapshot is not None for entry in entries),
                "disk_snapshots": sum(
                    entry.disk_path is not None and not entry.rows_only for entry in entries
                ),
            }

    @property
    def has_disk(self) -> bool:
        return self._folder_lock is not None

    def disk_line(self) -> str | None:
        """The disk tier's directory in one line (None without one): the bytes of this folder's snapshots
        and of the other folders', and what was removed so far."""
        if not self.has_disk:
            return None
        with self._lock:
            removed, foreign, size = self.stats.removed, self.stats.foreign, format_size
            return (
                f"prompt cache: {self.disk_dir.parent} holds {size(self.disk_used + foreign.nbytes)} of "
                f"its {size(self.disk_budget)}: {size(self.disk_used)} in {self.counts()['disk_snapshots']} "
                f"snapshots of this key ({self.disk_dir.name}), {size(foreign.nbytes)} in {foreign.folders} "
                f"other folders; removed {removed.snapshots} snapshots of other folders "
                f"({size(removed.snapshot_bytes)}), {removed.folders} emptied folders, {removed.temporaries} "
                f"stale temporary files ({size(removed.temporary_bytes)}); evicted "
                f"{self.stats.evictions_disk} of its own"
            )

    def _score(self, entry: Entry, nbytes: int) -> float:
        """Tokens of recompute saved per byte, halved every HALF_LIFE operations since the last use."""
        return entry.length / max(nbytes, 1) * 0.5 ** ((self._clock - entry.last_used) / HALF_LIFE)

    def _evict_ram(self) -> None:
        while self.ram_bytes > self.ram_budget:
            held = [entry for entry in self._tree.entries() if entry.snapshot is not None]
            if not held:
                return
            victim = min(held, key=lambda e: self._score(e, self._ram_freed(e.snapshot)))
            self._account(victim.snapshot, -1)
            victim.snapshot = None
            self.stats.evictions_ram += 1
            self._forget_if_gone(victim)

    def _ram_freed(self, snapshot: Snapshot) -> int:
        """What dropping `snapshot` from RAM frees: its KDA copies and logits, and the latent buffers no
        other snapshot holds (a conversation's snapshots share one)."""
        shared = (self._storages[latent.storage_key()] for latent in snapshot.latents())
        return snapshot.fixed_bytes + sum(nbytes for references, nbytes in shared if references == 1)

    def _evict_disk(self) -> None:
        """While the files outgrow the budget, evict the one of the fewest tokens of recompute saved per
        byte its eviction frees (and recency): a file its children need keeps its latent rows and frees
        the rest (`_trim`); a file without children goes, with the rows-only parents only it needed.
        The budget covers the whole directory: the foreign folders' files no process holds go first
        (`cache_folders.trim_directory`), this folder's files then fit what the others leave. The choice
        is made under the lock, the files are removed and rewritten outside it (on the writer's thread):
        the scheduler's snapshots and restores never wait on the disk."""
        self._trim_directory()
        while True:
            doomed: list[Path] = []
            with self._lock:
                victim = self._disk_victim()
                if victim is None:
                    return
                path, trim = victim.disk_path, bool(victim.disk_children)
                victim.rows_only = trim
                if not trim:
                    self._drop_file(victim, doomed)
                    self._forget_if_gone(victim)
                self.stats.evictions_disk += 1
            _remove(doomed)
            if trim and not self._trim(victim, path):
                return

    def _trim_directory(self) -> None:
        """The other folders of the directory trimmed to the budget this folder's files leave (outside
        the lock: on the writer's thread, or at the start)."""
        directory, own = self.disk_dir, self.disk_used
        foreign = trim_directory(directory.parent, directory.name, own, self.disk_budget, self.stats.removed)
        with self._lock:
            self.stats.foreign = foreign

    def _disk_victim(self) -> Entry | None:
        """The file to evict next (under the lock), None while the files fit the budget."""
        if self.disk_used + self.stats.foreign.nbytes <= self.disk_budget:
            return None
        held = [e for e in self._tree.entries() if e.disk_path is not None and not e.rows_only]
        return min(held, key=lambda e: self._disk_score(e), default=None)

    def _disk_score(self, entry: Entry) -> float:
        """`_score` per byte evicting `entry`'s file frees: the file less the rows its children need,
        or with no children the whole file and those of the rows-only parents only it needs."""
        if entry.disk_children:
            return self._score(entry, entry.disk_bytes - entry.disk_rows_bytes)
        freed, parent = entry.disk_bytes, entry.disk_parent
        while parent is not None and parent.rows_only and parent.disk_children == 1:
            freed, parent = freed + parent.disk_bytes, parent.disk_parent
        return self._score(entry, freed)

    def _trim(self, entry: Entry, path: Path) -> bool:
        """Rewrite `entry`'s file (marked rows-only: no restore reads it) with its latent rows only, its
        identity and parent kept (its children still chain through it), outside the lock; False where it
        cannot be read or written (a warning; the file stays whole and restorable)."""
        try:
            own, parent, identity = decode(read_file(path), self.fingerprint, entry.tokens, self.layout)
            rows = Snapshot(own.length, tuple(layer if _is_rows(layer) else None for layer in own.layers))
            reference = parent if parent[0] else None
            parts = encode(self.fingerprint, entry.tokens, rows, reference, 0, identity)
            write_bytes_atomic(path, parts)
        except (OSError, ValueError) as error:
            log.warning("prompt cache: cannot trim %s: %s", path, error)
            with self._lock:
                self.stats.disk_errors += 1
                if entry.disk_path == path:  # whole and restorable again
                    entry.rows_only = False
            return False
        with self._lock:
            if entry.disk_path == path:
                entry.disk_bytes = _size(parts)
                return True
        path.unlink(missing_ok=True)  # dropped while it was rewritten: the rewrite goes too
        return True

    def _discard(self, entry: Entry) -> None:
        """Take `entry` out of both tiers."""
        doomed: list[Path] = []
        with self._lock:
            if entry.snapshot is not None:
                self._account(entry.snapshot, -1)
                entry.snapshot = None
            self._drop_file(entry, doomed)
            self._forget_if_gone(entry)
        _remove(doomed)

    def _forget_if_gone(self, entry: Entry) -> None:
        if entry.snapshot is None and entry.disk_path is None:
            self._tree.remove(entry.tokens)

    def _drop_file(self, entry: Entry, doomed: list[Path]) -> None:
        """Take `entry`'s file out of the tier, and its parent's where that one kept only rows for its
        children (under the lock): their paths go into `doomed`, deleted once the lock is released."""
        if entry.disk_path is not None:
            doomed.append(entry.disk_path)
        parent = entry.disk_parent
        entry.disk_path, entry.disk_bytes, entry.disk_checksum, entry.disk_parent = None, 0, None, None
        entry.disk_rows_bytes, entry.rows_only, entry.disk_logits = 0, False, False
        if parent is not None:
            parent.disk_children -= 1
            if parent.rows_only and parent.disk_children == 0:
                self._drop_file(parent, doomed)
                self._forget_if_gone(parent)

    # ---- disk --------------------------------------------------------------------------------------

    def _write(self, entry: Entry, snapshot: Snapshot) -> None:
        """The snapshot's file (its latent rows past its parent's), written to a temporary name, synced
        and renamed into place."""
        with self._lock:
            parent = self._tree.deepest(entry.tokens, entry.length - 1, _on_disk)
            if parent is not None:
                parent.disk_children += 1  # kept while this file is written and refers to it
        reference = None if parent is None else (parent.length, parent.disk_checksum)
        parts = encode(self.fingerprint, entry.tokens, snapshot, reference)
        path = self.disk_dir / file_name(entry.tokens)
        try:
            write_bytes_atomic(path, parts)
        except OSError as error:
            log.warning("prompt cache: cannot write %s: %s", path, error)
            with self._lock:
                self.stats.disk_errors += 1
                if parent is not None:
                    parent.disk_children -= 1
            return
        with self._lock:
            kept = self._tree.insert(entry)  # back in the tree if RAM evicted it meanwhile
            if kept.disk_parent is not None:  # a file of these tokens written before, replaced
                kept.disk_parent.disk_children -= 1
            kept.disk_path, kept.disk_bytes = path, _size(parts)
            kept.disk_checksum, kept.disk_parent = _checksum(parts[-1]), parent
            kept.disk_rows_bytes, kept.rows_only = _rows_bytes(snapshot, reference), False
            kept.disk_logits = snapshot.logits is not None
        self._evict_disk()

    def _scan_disk(self) -> None:
        """Enter every whole snapshot file of this fingerprint into the tree (disk tier only), each
        linked to its parent's entry (a file whose parent is gone stays: a miss when it is read)."""
        parents: list[tuple[Entry, int]] = []
        for path in sorted(self.disk_dir.glob(f"*{SUFFIX}")):
            try:
                header = read_header(path, self.fingerprint)
                tokens, layers = tuple(header["tokens"]), list(header.get("layers", []))
                check_layers(layers, self.layout, bool(header.get("rows_only")))
                if path.name != file_name(tokens):  # renamed, or swapped with another
                    raise ValueError("not the file its token ids name")
                has_logits = any(layer[:1] == ["logits"] for layer in layers)
                parent_length = _parent_of(header, len(tokens))[0]
                checksum = header.get("identity") or read_checksum(path)
                rows_bytes = sum(4 * math.prod(layer[1]) for layer in layers if layer[0] == "mla")
            except (OSError, ValueError, TypeError) as error:
                log.warning("prompt cache: %s: %s; skipped", path, error)
                self.stats.disk_errors += 1
                continue
            entry = self._tree.insert(Entry(tokens))
            entry.disk_path, entry.disk_bytes, entry.disk_logits = path, path.stat().st_size, has_logits
            entry.disk_checksum, entry.disk_rows_bytes = checksum, rows_bytes
            entry.rows_only = bool(header.get("rows_only"))
            if parent_length:
                parents.append((entry, parent_length))
        for entry, length in parents:
            parent = self._tree.deepest(entry.tokens, length, lambda e, n=length: e.length == n)
            if parent is not None and parent.disk_path is not None:
                entry.disk_parent = parent
                parent.disk_children += 1
        doomed: list[Path] = []
        for entry in [e for e in self._tree.entries() if e.rows_only and not e.disk_children]:
            self._drop_file(entry, doomed)  # rows no file needs any more (a process stopped between)
            self._forget_if_gone(entry)
        _remove(doomed)

    def _load(self, entry: Entry) -> Snapshot | None:
        """The entry's snapshot read from disk (its file and its parents') into the RAM tier, or None (a
        warning; the entry is dropped) for a file that is gone, truncated, corrupt or of another model,
        or whose parent is."""
        started = time.perf_counter()
        with self._lock:
            path = entry.disk_path
        if path is None:  # evicted since it was matched
            return None
        try:
            snapshot = self._read_chain(entry.tokens, path)
        except (OSError, ValueError) as error:
            doomed: list[Path] = []
            with self._lock:
                if entry.rows_only or entry.disk_path != path:  # trimmed or dropped since it was matched
                    return None
                log.warning("prompt cache: %s: %s; treated as a miss", path, error)
                self.stats.disk_errors += 1
                self._drop_file(entry, doomed)
                self._forget_if_gone(entry)
            _remove(doomed)
            return None
        with self._lock:
            self.stats.restore_s += time.perf_counter() - started
            if entry.snapshot is None:
                entry.snapshot = snapshot
                self._account(snapshot, +1)
                self._evict_ram()
        return snapshot

    def _read_chain(self, tokens: tuple[int, ...], path: Path) -> Snapshot:
        """The whole snapshot of `tokens` from its file and its parents' (or a parent held in RAM)."""
        own, (length, checksum), _ = decode(read_file(path), self.fingerprint, tokens, self.layout)
        if any(layer is None for layer in own.layers):
            raise ValueError("it keeps only latent rows")
        pieces = [own]
        while length:
            with self._lock:
                held = self._tree.deepest(tokens, length, lambda e, n=length: e.length == n)
                in_ram = held.snapshot if held is not None else None
            if in_ram is not None:
                pieces.append(in_ram)
                break
            piece, (length, checksum) = self._read_parent(tokens[:length], checksum)
            pieces.append(piece)
        snapshot = joined(pieces)
        check_fits(self.model.new_state(), snapshot)
        return snapshot

    def _read_parent(self, tokens: tuple[int, ...], checksum: int) -> tuple[Snapshot, tuple[int, int]]:
        """A parent's file read and checked: the one its child names (by tokens and checksum)."""
        name = file_name(tokens)
        try:
            data = read_file(self.disk_dir / name)
            piece, parent, identity = decode(data, self.fingerprint, tokens, self.layout)
            if identity != checksum:
                raise ValueError("changed since its child was written")
            return piece, parent
        except (OSError, ValueError) as error:
            reason = "gone" if isinstance(error, OSError) else str(error)
            raise ValueError(f"its parent snapshot of {len(tokens)} tokens ({name}): {reason}") from None


def _remove(paths: list[Path]) -> None:
    """Delete the files of evicted or bad snapshots (outside the cache's lock)."""
    for path in paths:
        path.unlink(missing_ok=True)


def _size(parts: list[bytes | memoryview]) -> int:
    return sum(len(part) for part in parts)


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, or ValueError where it is no regular file: a FIFO's open waits for a
    writer without end (here it does not wait), a device reads without end (the start's scan of a
    folder, and a file given to import, take it)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise ValueError("not a regular file")
        os.set_blocking(descriptor, True)
        return open(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_file(path: Path) -> bytearray:
    """A snapshot file's bytes, read into one buffer (the GIL released while the disk reads it; the
    tensors decoded from it share it, nothing is copied again)."""
    with open(path, "rb", buffering=0) as stream:  # a file the start's scan found regular, or wrote
        data = bytearray(os.fstat(stream.fileno()).st_size)
        view, done = memoryview(data), 0
        while done < len(data):
            got = stream.readinto(view[done:])
            if not got:
                raise ValueError("truncated while it was read")
            done += got
    return data


def _on_disk(entry: Entry) -> bool:
    return entry.disk_path is not None and entry.disk_checksum is not None


def _is_rows(layer: KDAState | LatentRows | None) -> bool:
    return isinstance(layer, LatentRows)


def _rows_bytes(snapshot: Snapshot, parent: tuple[int, int] | None) -> int:
    """Bytes of the latent rows a file of `snapshot` holds (past its parent's length)."""
    start = 0 if parent is None else parent[0]
    return sum(4 * (rows.length - start) * rows.buffer.shape[1] for rows in snapshot.latents())


def file_name(tokens: tuple[int, ...]) -> str:
    """A snapshot file's name: a hash of its token ids."""
    return xxhash.xxh3_128_hexdigest(struct.pack(f"<{len(tokens)}q", *tokens)) + SUFFIX


def _checksum(data: bytes | memoryview) -> int:
    return struct.unpack("<Q", data[-8:])[0]


def read_checksum(path: Path) -> int:
    """A snapshot file's trailing checksum (its children name their parent by it)."""
    with open_regular(path) as stream:
        stream.seek(0, os.SEEK_END)
        if stream.tell() < len(MAGIC) + 16:
            raise ValueError("not a k3stream snapshot")
        stream.seek(-8, os.SEEK_END)
        return _checksum(stream.read(8))


def joined(pieces: list[Snapshot]) -> Snapshot:
    """One snapshot from a file's own (KDA states, logits, its latent rows) and its parents' latent
    rows, nearest parent first."""
    if len(pieces) == 1:
        return pieces[0]
    own, layers = pieces[0], []
    for index, layer in enumerate(own.layers):
        if isinstance(layer, KDAState):
            layers.append(layer)
            continue
        rows = torch.cat([piece.layers[index].rows() for piece in reversed(pieces)])
        layers.append(LatentRows(rows, rows.shape[0]))
    return Snapshot(own.length, tuple(layers), own.logits)


# ---- the file format -------------------------------------------------------------------------------
# MAGIC, u64 header length, JSON header {fingerprint, tokens, layers: [[kind, shape...]], parent: [length,
# identity] (absent: none), identity and rows_only (a file trimmed to its rows: its KDA layers ["kda"]
# without shapes, no logits)}, the tensors' float32 bytes in layer order (an MLA layer's rows from the
# parent's length on), then the xxh3_64 of everything before it (u64). A file's identity, which its
# children name, is that checksum of its first writing (`identity` in the header once trimmed).


def encode(
    fingerprint: str,
    tokens: tuple[int, ...],
    snapshot: Snapshot,
    parent: tuple[int, int] | None = None,
    start: int | None = None,
    identity: int | None = None,
) -> list[bytes | memoryview]:
    """A snapshot file's bytes, in parts: the header's, a view of each tensor's own memory (nothing
    copied while the GIL is held: a writer thread then never stops the scheduler) and the checksum's;
    with a `parent` (the length and identity of a file of a prefix of `tokens`), only the latent rows
    past it (from `start` of the snapshot's rows: default the parent's length). A snapshot whose KDA
    layers are None is a rows-only file of `identity`."""
    start = (0 if parent is None else parent[0]) if start is None else start
    tensors = list(_tensors(snapshot, start))
    layers = [
        ["kda", list(layer.conv.shape), list(layer.recurrent.shape)]
        if isinstance(layer, KDAState)
        else ["kda"]
        if layer is None
        else ["mla", [layer.length - start, layer.buffer.shape[1]]]
        for layer in snapshot.layers
    ]
    if snapshot.logits is not None:
        layers.append(["logits", list(snapshot.logits.shape)])
    fields = {"fingerprint": fingerprint, "tokens": list(tokens), "layers": layers}
    if parent is not None:
        fields["parent"] = list(parent)
    if any(layer is None for layer in snapshot.layers):
        fields["rows_only"], fields["identity"] = True, identity
    header = json.dumps(fields).encode()
    parts = [
        MAGIC,
        struct.pack("<Q", len(header)),
        header,
        *(memoryview(t.contiguous().numpy()).cast("B") for t in tensors),
    ]
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)  # the GIL released over a large part
    return [*parts, struct.pack("<Q", digest.intdigest())]


def _tensors(snapshot: Snapshot, start: int) -> Iterator[torch.Tensor]:
    for layer in snapshot.layers:
        if isinstance(layer, KDAState):
            yield from (layer.conv, layer.recurrent)
        elif layer is not None:
            yield layer.rows()[start:]
    if snapshot.logits is not None:
        yield snapshot.logits


def read_header(path: Path, fingerprint: str) -> dict[str, Any]:
    with open_regular(path) as stream:
        head = stream.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise ValueError("not a k3stream snapshot")
        (length,) = struct.unpack("<Q", head[len(MAGIC) :])
        header = _parse_header(stream.read(min(length, 1 << 34)), length)
    if header.get("fingerprint") != fingerprint:
        raise ValueError("a snapshot of another model file")
    return header


def _parse_header(raw: bytes, length: int) -> dict[str, Any]:
    if len(raw) != length:
        raise ValueError("truncated header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable header ({error})") from None
    if not isinstance(header, dict) or not isinstance(tokens := header.get("tokens"), list):
        raise ValueError("header without token ids")
    if not all(type(token) is int and 0 <= token < 1 << 63 for token in tokens):  # a file name packs them
        raise ValueError("header with token ids that are not integers in 0..2^63-1")
    layers = header.get("layers", [])
    if not isinstance(layers, list) or not all(map(_is_layer, layers)):
        raise ValueError("malformed layer list in the header")
    return header


LAYER_SHAPES = {"kda": (0, 2), "mla": (1,), "logits": (1,)}  # a header layer's kind -> its shape counts


def check_layers(layers: list[list[Any]], layout: StateLayout, rows_only: bool) -> None:
    """A header's layer list (`_is_layer`'s) against the model's `layout`: one line naming the field
    that does not fit (another model's dimensions or layer count, or a hand-edited header, whose file
    passes its checksum). Only a rows-only file has KDA layers without shapes."""
    logits = [index for index, layer in enumerate(layers) if layer[0] == "logits"]
    if logits not in ([], [len(layers) - 1]) or len(layers) - len(logits) != len(layout.layers):
        raise ValueError(
            f"header field layers: {len(layers) - len(logits)} layer states and {len(logits)} logits "
            f"where this model has {len(layout.layers)} layers and logits last"
        )
    for index, (saved, expected) in enumerate(zip(layers[: len(layout.layers)], layout.layers, strict=True)):
        field = f"header field layers[{index}]"
        if saved[0] != expected[0]:
            raise ValueError(f"{field}: {saved[0]} where this model's layer {index} is {expected[0]}")
        if saved[0] == "mla" and (len(saved[1]) != 2 or saved[1][1] != expected[1]):
            raise ValueError(
                f"{field}: mla rows of shape {saved[1]} where this model's are {expected[1]} wide"
            )
        if saved[0] == "kda" and saved[1:] != list(expected[1:]) and not (rows_only and len(saved) == 1):
            shapes = " and ".join(map(str, expected[1:]))
            raise ValueError(f"{field}: kda states of shapes {saved[1:]} where this model's are {shapes}")
    if logits and layers[-1][1] != [layout.vocab]:
        raise ValueError(
            f"header field layers[{logits[0]}]: logits of shape {layers[-1][1]} where this model's are "
            f"[{layout.vocab}]"
        )


def _is_layer(layer: Any) -> bool:
    """A header's layer: its kind, then as many shapes (lists of counts) as the kind has."""
    if not isinstance(layer, list) or not layer or not isinstance(layer[0], str):
        return False
    if len(layer) - 1 not in LAYER_SHAPES.get(layer[0], ()):
        return False
    return all(_is_shape(shape) for shape in layer[1:])


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(type(count) is int and count >= 0 for count in shape)


def _parent_of(header: dict[str, Any], length: int) -> tuple[int, int]:
    """The parent a header names: its length and checksum ((0, 0): none)."""
    parent = header.get("parent")
    if parent is None:
        return 0, 0
    if not (isinstance(parent, list) and len(parent) == 2 and all(isinstance(v, int) for v in parent)):
        raise ValueError("malformed parent reference")
    if not 0 < parent[0] < length:
        raise ValueError(f"a parent of {parent[0]} tokens for a snapshot of {length}")
    return parent[0], parent[1]


def decode(
    data: bytes | bytearray, fingerprint: str, tokens: tuple[int, ...], layout: StateLayout
) -> tuple[Snapshot, tuple[int, int], int]:
    """A snapshot from a file's bytes, checked (checksum, fingerprint, token ids, layer shapes against
    the model's `layout`), its parent's length and identity ((0, 0): none) and its own identity; with a
    parent, its MLA layers hold the rows past the parent's length only; a rows-only file's KDA layers
    are None."""
    try:
        return _decode(data, fingerprint, tokens, layout)
    except (TypeError, KeyError, RuntimeError) as error:  # a header that passed its checksum, but odd
        raise ValueError(f"malformed snapshot header ({error})") from None


def _decode(
    data: bytes | bytearray, fingerprint: str, tokens: tuple[int, ...], layout: StateLayout
) -> tuple[Snapshot, tuple[int, int], int]:
    if len(data) < len(MAGIC) + 16 or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a k3stream snapshot")
    data = data if isinstance(data, bytearray) else bytearray(data)  # the tensors share its memory
    body, (checksum,) = memoryview(data)[:-8], struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    (length,) = struct.unpack("<Q", body[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = _parse_header(bytes(body[start : start + length]), length)
    if header.get("fingerprint") != fingerprint or tuple(header["tokens"]) != tokens:
        raise ValueError("a snapshot of another model or prompt")
    parent = _parent_of(header, len(tokens))
    check_layers(header.get("layers", []), layout, bool(header.get("rows_only")))
    offset, layers, logits = start + length, [], None
    for kind, *shapes in header.get("layers", []):
        tensors = []
        for shape in shapes:
            count = math.prod(shape)
            chunk = body[offset : offset + 4 * count]
            if len(chunk) != 4 * count:
                raise ValueError("tensor data shorter than its header says")
            tensors.append(torch.frombuffer(chunk, dtype=torch.float32).view(shape))
            offset += 4 * count
        if kind == "logits":
            logits = tensors[0]
        elif kind == "kda":
            layers.append(KDAState(*tensors) if tensors else None)
        else:
            layers.append(LatentRows(tensors[0], shapes[0][0]))
    if offset != len(body):
        raise ValueError("tensor data longer than its header says")
    latents = {layer.length for layer in layers if isinstance(layer, LatentRows)}
    if latents - {len(tokens) - parent[0]}:
        raise ValueError("latent rows do not fit the snapshot's tokens and parent")
    identity = header.get("identity", checksum) if header.get("rows_only") else checksum
    if not isinstance(identity, int):
        raise ValueError("malformed identity")
    return Snapshot(len(tokens), tuple(layers), logits), parent, identity


# ---- flags -------------------------------------------------------------------------------------------
