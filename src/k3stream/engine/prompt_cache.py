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
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from k3stream.engine.cache_folders import FolderLock, Foreign, Removed, trim_directory
from k3stream.engine.chunked_prefill import ChunkedPrefill, Prefilled
from k3stream.engine.fingerprints import computation_key
from k3stream.engine.radix import RadixTree
from k3stream.engine.snapshot_files import (
    SUFFIX,
    check_layers,
    decode,
    encode,
    file_name,
    joined,
    parent_of,
    read_checksum,
    read_file,
    read_header,
    trailing_checksum,
)
from k3stream.memlimit import format_size
from k3stream.model.kda import KDAState
from k3stream.model.snapshot import (
    LatentRows,
    Snapshot,
    StateLayout,
    check_fits,
    restore,
    restores_exactly,
    state_layout,
    take_snapshot,
)
from k3stream.pack.fileio import write_bytes_atomic
from k3stream.quant.kernels import set_row_exact

if TYPE_CHECKING:
    from k3stream.model.k3 import K3Model, SequenceState

log = logging.getLogger(__name__)
HALF_LIFE = 64  # cache operations after which a snapshot's score halves
DEFAULT_EVERY = 1024  # tokens between snapshots inside a prefill (docs/prompt-cache.md: why)
# how long after a folder's last change a listing of it is repeated: file systems keep times in clock
# ticks (a few milliseconds), so a file renamed into the folder in the same tick as the listing leaves
# the folder's time where the listing saw it
MTIME_GRANULARITY_NS = 1_000_000_000


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
    # the file is another live process's (of this key, written after this one started): read, never
    # evicted, trimmed, deleted or chained through here
    adopted: bool = False

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


class Peers(Protocol):
    """The other ranks of a model split over processes (`parallel.runner.DriverModel`): each keeps its
    own cache of its shard of the states, told by rank 0 what to snapshot and restore."""

    def save_snapshot(self, state: SequenceState) -> None: ...

    def restored(self, state: SequenceState, tokens: list[int]) -> bool: ...


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
        self._tree: RadixTree[Entry] = RadixTree()
        self._lock = threading.RLock()
        self._clock = 0
        self._storages: dict[int, list[int]] = {}  # latent storage -> [references, bytes]
        self._fixed_ram = 0
        self.disk_dir = Path(disk_dir) / self.fingerprint if disk_dir is not None else None
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="k3stream-cache-writer")
        self._closed = False
        self._folder_lock: FolderLock | None = None
        # the folder's modification time when its files were last listed (None: list them again)
        self._listed_mtime: int | None = None
        self._seen_names: set[str] = set()  # file names listed so far, whatever they held
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
        """Whether `restore_longest(tokens)` would read its snapshot from disk (only a file holds it), or
        the folder changed since its files were last listed (another process of this key may have
        written the prompt's snapshot: `read_ahead` looks). One `stat` of the folder, no listing."""
        if not self.enabled:
            return False
        if self._folder_changed():
            return True
        with self._lock:
            usable = self._usable_for(tokens)
            entry = self._tree.deepest(tokens, len(tokens), lambda e: e.restorable and usable(e))
            return entry is not None and entry.snapshot is None

    def read_ahead(self, tokens: list[int]) -> None:
        """Read the snapshot `restore_longest(tokens)` would restore into the RAM tier where only its
        file holds it (a bad file is dropped, as there): a server calls it off its scheduler's thread,
        so the streams it runs go on while the disk reads; the restore then copies from RAM. The files
        another process wrote into the folder since it was last listed are entered first."""
        if self.enabled:
            self.adopt_new_files()
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
        (its tokens, bytes written); (0, 0) where the cache holds no prefix of `tokens`. No `tokens`: the
        state of none, as llama-server saves a slot that ran nothing."""
        if not tokens and self.enabled:
            prefix, snapshot = (), take_snapshot(self.model.new_state())
        else:
            found = self._use_deepest(tokens, lambda entry: True) if self.enabled else None
            if found is None or found[1] is None:
                return 0, 0
            prefix, snapshot = found[0].tokens, found[1]
        parts = encode(self.fingerprint, prefix, snapshot)
        write_bytes_atomic(path, parts)
        return len(prefix), _size(parts)

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
        if tokens:  # the state of none is where every prompt starts: nothing to keep
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

    def held_tokens(self) -> list[tuple[int, ...]]:
        """The token ids of every restorable snapshot held, in RAM or on disk (at the start: the ones a
        restarted process found in its folder)."""
        with self._lock:
            return [entry.tokens for entry in self._tree.entries() if entry.restorable]

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

    def _evict_disk(self, budget: int | None = None) -> None:
        """While the files outgrow the budget (`budget`, else `--cache-disk`'s), evict the one of the
        fewest tokens of recompute saved per byte its eviction frees (and recency): a file its children
        need keeps its latent rows and frees the rest (`_trim`; where that rewrite fails, the file stays
        whole and the next one is taken); a file without children goes, with the rows-only parents only
        it needed.
        The budget covers the whole directory: the foreign folders' files no process holds go first
        (`cache_folders.trim_directory`), this folder's files then fit what the others leave. The choice
        is made under the lock, the files are removed and rewritten outside it (on the writer's thread):
        the scheduler's snapshots and restores never wait on the disk."""
        budget = self.disk_budget if budget is None else budget
        self._trim_directory(budget)
        kept: set[tuple[int, ...]] = set()  # files whose rewrite failed: left whole this time
        while True:
            doomed: list[Path] = []
            with self._lock:
                victim = self._disk_victim(budget, kept)
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
                kept.add(victim.tokens)

    def _trim_directory(self, budget: int) -> None:
        """The other folders of the directory trimmed to the budget this folder's files leave (outside
        the lock: on the writer's thread, or at the start)."""
        directory, own = self.disk_dir, self.disk_used
        foreign = trim_directory(directory.parent, directory.name, own, budget, self.stats.removed)
        with self._lock:
            self.stats.foreign = foreign

    def _disk_victim(self, budget: int, kept: set[tuple[int, ...]]) -> Entry | None:
        """The file to evict next (under the lock) but those of `kept`, None while the files fit
        `budget`."""
        if self.disk_used + self.stats.foreign.nbytes + self.stats.foreign.beside <= budget:
            return None
        held = [
            e
            for e in self._tree.entries()
            if e.disk_path is not None and not e.rows_only and not e.adopted and e.tokens not in kept
        ]
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
        if entry.disk_path is not None and not entry.adopted:
            doomed.append(entry.disk_path)
        parent = entry.disk_parent
        entry.disk_path, entry.disk_bytes, entry.disk_checksum, entry.disk_parent = None, 0, None, None
        entry.disk_rows_bytes, entry.rows_only, entry.disk_logits, entry.adopted = 0, False, False, False
        if parent is not None:
            parent.disk_children -= 1
            if parent.rows_only and parent.disk_children == 0:
                self._drop_file(parent, doomed)
                self._forget_if_gone(parent)

    # ---- disk --------------------------------------------------------------------------------------

    def _write(self, entry: Entry, snapshot: Snapshot) -> None:
        """The snapshot's file (its latent rows past its parent's), written to a temporary name, synced
        and renamed into place, where the file system has room for it (`_make_room`)."""
        self._keep_folder()
        with self._lock:
            parent = self._tree.deepest(entry.tokens, entry.length - 1, _on_disk)
            if parent is not None:
                parent.disk_children += 1  # kept while this file is written and refers to it
        reference = None if parent is None else (parent.length, parent.disk_checksum)
        parts = encode(self.fingerprint, entry.tokens, snapshot, reference)
        path = self.disk_dir / file_name(entry.tokens)
        try:
            self._make_room(_size(parts), _rows_bytes(snapshot, reference))
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
            kept.disk_checksum, kept.disk_parent = trailing_checksum(parts[-1]), parent
            kept.disk_rows_bytes, kept.rows_only = _rows_bytes(snapshot, reference), False
            kept.disk_logits, kept.adopted = snapshot.logits is not None, False
            self._seen_names.add(path.name)  # listed, it is known: no header read
        self._evict_disk()

    def _keep_folder(self) -> None:
        """Where this process's folder was removed while it ran (a cleanup of the directory), make it again
        and forget the files it held, so that the snapshots from here on are kept on disk again."""
        if self._folder_lock.still_held():
            return
        log.warning(
            "prompt cache: %s was removed while in use; made again, its snapshots lost", self.disk_dir
        )
        try:
            held = FolderLock(self.disk_dir)
        except OSError as error:  # the write that follows fails too, with its own warning
            log.warning("prompt cache: cannot make %s again: %s", self.disk_dir, error)
            return
        self._folder_lock.release()
        self._folder_lock = held
        with self._lock:
            for entry in [e for e in self._tree.entries() if e.disk_path is not None]:
                self._drop_file(entry, [])  # gone with the folder: nothing to delete
                self._forget_if_gone(entry)

    def _make_room(self, nbytes: int, rows_bytes: int) -> None:
        """Where the file system has less free space than a file of `nbytes` (`rows_bytes` of them latent
        rows) takes, evict this folder's files (and foreign ones no process holds) as the budget does,
        until it has: a full file system bounds the tier as `--cache-disk` does, so new snapshots replace
        the least valuable old ones instead of failing to be written."""
        usage = os.statvfs(self.disk_dir)
        block = usage.f_frsize or 1
        with self._lock:
            held = self.disk_used + self.stats.foreign.nbytes + self.stats.foreign.beside
            # room for the file, one block for its directory entry, and for the largest rewrite a
            # later eviction may make (`_trim` writes a file's rows anew before the old file goes)
            rewrite = max(
                (e.disk_rows_bytes for e in self._tree.entries() if e.disk_path), default=rows_bytes
            )
            rewrite = max(rewrite, rows_bytes)
        needed = (-(-nbytes // block) - (-rewrite // block) + 1) * block
        short = needed - usage.f_bavail * block
        if short > 0:
            self._evict_disk(min(self.disk_budget, held - short))

    def _scan_disk(self) -> None:
        """Enter every whole snapshot file of this fingerprint into the tree (disk tier only), each
        linked to its parent's entry (a file whose parent is gone stays: a miss when it is read)."""
        parents: list[tuple[Entry, int]] = []
        self._listed_mtime = self._folder_mtime()
        paths = sorted(self.disk_dir.glob(f"*{SUFFIX}"))
        self._seen_names = {path.name for path in paths}
        for path in paths:
            read = self._file_entry(path)
            if read is None:
                continue
            found, parent_length = read
            entry = self._tree.insert(found)
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

    def _file_entry(self, path: Path) -> tuple[Entry, int] | None:
        """The entry a snapshot file's header describes and its parent's length (0: none), or None (a
        warning) for a file that is not a whole snapshot of this fingerprint and model."""
        try:
            header = read_header(path, self.fingerprint)
            tokens, layers = tuple(header["tokens"]), list(header.get("layers", []))
            check_layers(layers, self.layout, bool(header.get("rows_only")))
            if path.name != file_name(tokens):  # renamed, or swapped with another
                raise ValueError("not the file its token ids name")
            entry = Entry(tokens, disk_path=path, disk_bytes=path.stat().st_size)
            entry.disk_logits = any(layer[:1] == ["logits"] for layer in layers)
            entry.disk_checksum = header.get("identity") or read_checksum(path)
            entry.disk_rows_bytes = sum(4 * math.prod(layer[1]) for layer in layers if layer[0] == "mla")
            entry.rows_only = bool(header.get("rows_only"))
            return entry, parent_of(header, len(tokens))[0]
        except (OSError, ValueError, TypeError) as error:
            log.warning("prompt cache: %s: %s; skipped", path, error)
            with self._lock:
                self.stats.disk_errors += 1
            return None

    def _folder_mtime(self) -> int | None:
        try:
            return os.stat(self.disk_dir).st_mtime_ns
        except OSError:  # removed while in use: the next write makes it again (`_keep_folder`)
            return None

    def _folder_changed(self) -> bool:
        """Whether files may have come into or left the folder since it was last listed (disk tier)."""
        if self._folder_lock is None:
            return False
        mtime = self._folder_mtime()
        return mtime is not None and mtime != self._listed_mtime

    def adopt_new_files(self) -> None:
        """Where the folder changed since it was last listed, enter the whole snapshot files that came
        into it (another live process of this key wrote them; this process's own are entered as it
        writes them) as *adopted*: restorable here, left to their writer to evict. Adopted files gone
        from the folder are forgotten. A listing, and a header read for each file not seen before."""
        if not self._folder_changed():
            return
        listed_at, mtime = time.time_ns(), self._folder_mtime()
        names = {path.name for path in self.disk_dir.glob(f"*{SUFFIX}")}
        new = sorted(names - self._seen_names)
        # a change within the file system's timestamp granularity of the listing may not move the
        # folder's time again: such a listing is repeated at the next look
        self._listed_mtime = mtime if listed_at - (mtime or 0) > MTIME_GRANULARITY_NS else None
        found = [read for read in map(self._file_entry, (self.disk_dir / name for name in new)) if read]
        with self._lock:
            self._seen_names = names
            for entry in [e for e in self._tree.entries() if e.adopted and e.disk_path.name not in names]:
                self._drop_file(entry, [])  # its writer evicted it
                self._forget_if_gone(entry)
            for read, _ in found:
                if not read.rows_only:
                    self._adopt(read)

    def _adopt(self, read: Entry) -> None:
        """Enter another process's file `read` (under the lock), where no file of its tokens is held."""
        entry = self._tree.insert(Entry(read.tokens, last_used=self._clock))
        if entry.disk_path is None:
            entry.disk_path, entry.disk_bytes, entry.disk_logits = (
                read.disk_path,
                read.disk_bytes,
                read.disk_logits,
            )
            entry.disk_rows_bytes, entry.adopted = read.disk_rows_bytes, True

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


def _on_disk(entry: Entry) -> bool:
    return entry.disk_path is not None and entry.disk_checksum is not None


def _is_rows(layer: KDAState | LatentRows | None) -> bool:
    return isinstance(layer, LatentRows)


def _rows_bytes(snapshot: Snapshot, parent: tuple[int, int] | None) -> int:
    """Bytes of the latent rows a file of `snapshot` holds (past its parent's length)."""
    start = 0 if parent is None else parent[0]
    return sum(4 * (rows.length - start) * rows.buffer.shape[1] for rows in snapshot.latents())
