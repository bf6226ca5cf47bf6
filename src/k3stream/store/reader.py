"""The bottom of the tier chain: whole expert objects read from the pack and checked.

Every object read is hashed against the manifest's digest (when the manifest has them) before any
tier holds it, range by range as its reads land (`pack_io.OrderedDigest`); a mismatch is counted and
raised (ChecksumMismatch, an OSError), so its slot is given back and it is never cached.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from k3stream.pack.integrity import object_digester
from k3stream.store.liveness import LiveBuffers
from k3stream.store.pack_io import (
    OrderedDigest,
    PackFile,
    ReadRequest,
    Reads,
    host_buffer,
    prefaulted_buffer,
)

Key = tuple[int, int]


class RecycledBuffers:
    """Host buffers for pack reads, each taken again once the object read into it has died everywhere
    (evicted, no view left), at most `keep` of them waiting.

    A fresh buffer costs the kernel a page fault and a zeroed page per 4 KiB on its first write and an
    unmap when freed: measured 0.26-0.36 CPU seconds per GB read with O_DIRECT, against 0.085-0.091
    into buffers used before (`docs/real-model.md`, Read buffers), CPU the layers computing beside the
    reads lose. An
    object dies when a read's slot evicts it, just before that read takes a buffer, so the buffers
    waiting are the ones about to be reused, and resident expert bytes never exceed what fresh
    buffers would have reached. Every buffer holds `slot_bytes` (the largest object), aligned and
    rounded up to whole 4 KiB blocks, so any object fits it with and without O_DIRECT.

    `prefault_one` makes a buffer before any read needs it, its pages faulted in (the store does it
    in a background thread while the model loads): a read taking one faults nothing. Counts:
    `buffers_made` by a read (faulted in by that read), `buffers_prefaulted` ahead of the reads,
    `buffers_reused` taken from the pool (recycled or made ahead)."""

    def __init__(self, slot_bytes: int, keep: int) -> None:
        self.slot_bytes = slot_bytes
        self.keep = keep
        self._free: deque[np.ndarray] = deque()  # append and pop are atomic: no lock to re-enter
        self._watch: dict[int, weakref.ref] = {}
        self._made = threading.Lock()  # guards the two counts of buffers made
        self.counts = Counter(buffers_made=0, buffers_reused=0, buffers_prefaulted=0)

    def take(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """`(buffer, view of its first nbytes)` for an object to be read into; the buffer comes back
        when that view and every view of it are gone."""
        try:
            base = self._free.pop()
            self.counts["buffers_reused"] += 1
        except IndexError:
            with self._made:
                self.counts["buffers_made"] += 1
            base = host_buffer(self.slot_bytes, direct_io=True)
        view = base[:nbytes]
        ident = id(view)
        self._watch[ident] = weakref.ref(view, lambda _ref: self._give_back(ident, base))
        return base, view

    def _give_back(self, ident: int, base: np.ndarray) -> None:
        self._watch.pop(ident, None)
        if len(self._free) < self.keep:
            self._free.append(base)

    def prefault_one(self, total: int) -> bool:
        """Make one buffer, every page faulted in, into the pool, unless `total` buffers (at most
        `keep`) exist, made here or by reads: whether it made one."""
        with self._made:
            if self.counts["buffers_made"] + self.counts["buffers_prefaulted"] >= min(total, self.keep):
                return False
            self.counts["buffers_prefaulted"] += 1
        self._free.appendleft(prefaulted_buffer(self.slot_bytes))
        return True

    def clear(self) -> None:
        self._free.clear()


class ObjectReads:
    """Objects whose reads `ObjectReader.start` queued: iterating yields each (key, buffer) once read
    and checked (as `ObjectReader.read_each`); `close()` waits for the reads still running."""

    def __init__(
        self, reader: ObjectReader, reads: Reads, keys_of: dict[int, Key], buffers: dict[Key, torch.Tensor]
    ) -> None:
        self._reader, self._reads, self._keys_of, self._buffers = reader, reads, keys_of, buffers

    def __iter__(self) -> Iterator[tuple[Key, torch.Tensor]]:
        with contextlib.closing(self._reads):
            for request in self._reads:
                key = self._keys_of[id(request)]
                self._reader._check(key, self._buffers[key], request.digest)
                yield key, self._buffers.pop(key)

    def close(self) -> None:
        self._reads.close()
        self._buffers.clear()


class ObjectReader:
    def __init__(
        self, pack: Any, file: PackFile, live: LiveBuffers, lock: threading.RLock, buffers: RecycledBuffers
    ) -> None:
        self.pack = pack
        self.file = file
        self._live = live
        self.buffers = buffers
        self._lock = lock  # guards the counters
        self._check_object = getattr(pack, "check_object", None)
        self._check_digest = getattr(pack, "check_digest", None)
        self.integrity_checked = getattr(pack, "checksums", None) is not None
        self.counts = Counter(integrity_errors=0, integrity_check_ns=0, integrity_cpu_ns=0)

    def read(self, keys: list[Key], priority: int) -> dict[Key, torch.Tensor]:
        """Read whole objects into fresh host buffers (`PackFile.read`'s priority: 0 first)."""
        return dict(self.read_each(keys, priority))

    def read_each(self, keys: list[Key], priority: int) -> Iterator[tuple[Key, torch.Tensor]]:
        """`read`, yielding each (key, buffer) as soon as it is read and checked, in the order
        `PackFile.read_each` yields them (the order the tiers admit them, which the policies see).

        The reads are queued in pack order, so the disk sees a step's reads as one forward sweep; a
        read raised by `hurry` is handed over when it lands, not after the keys before it."""
        objects = self.start(keys, priority, read_here=True)
        with contextlib.closing(objects):
            yield from objects

    def start(self, keys: list[Key], priority: int, read_here: bool = False) -> ObjectReads:
        """Queue the reads of `keys` now (`PackFile.start`); iterate or close what it returns."""
        buffers, requests = {}, {}
        for key in keys:
            offset, nbytes = self.pack.object_range(*key)
            destination, array = self.buffers.take(nbytes)
            self._live.track(array)
            buffers[key] = torch.from_numpy(array)
            # hashed range by range as the reads land (`OrderedDigest`), where the pack takes a digest
            digest = OrderedDigest(object_digester()) if self._digests_on_landing() else None
            requests[key] = ReadRequest(
                f"layer {key[0]} expert {key[1]}", offset, nbytes, destination, digest
            )
        reads = self.file.start(list(requests.values()), priority, read_here)
        return ObjectReads(self, reads, {id(request): key for key, request in requests.items()}, buffers)

    def hurry(self, keys: list[Key], priority: int) -> None:
        """Raise the queued reads of these objects to `priority` (`PackFile.hurry`)."""
        if keys:
            self.file.hurry([self.pack.object_range(*key)[0] for key in keys], priority)

    def _digests_on_landing(self) -> bool:
        return self.integrity_checked and self._check_digest is not None

    def _check(self, key: Key, buffer: torch.Tensor, digest: OrderedDigest | None) -> None:
        """Raise (ChecksumMismatch, counted) unless the object `key` read into `buffer` hashes as the
        pack recorded: from the digest its reads fed where they fed it whole, else hashed here."""
        if not self.integrity_checked:
            return
        started, cpu = time.perf_counter_ns(), time.thread_time_ns()
        got = None if digest is None else digest.intdigest(buffer.numel())
        try:
            if got is None:
                self._check_object(*key, buffer.numpy())
            else:
                self._check_digest(*key, got)
        except OSError:
            with self._lock:
                self.counts["integrity_errors"] += 1
            raise
        finally:
            with self._lock:
                fed = 0 if digest is None else digest.cpu_ns
                self.counts["integrity_check_ns"] += time.perf_counter_ns() - started + fed
                self.counts["integrity_cpu_ns"] += time.thread_time_ns() - cpu + fed
