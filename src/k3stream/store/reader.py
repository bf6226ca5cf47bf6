"""The bottom of the tier chain: whole expert objects read from the pack and checked.

Every object read is hashed against the manifest's digest (when the manifest has them) before any
tier holds it; a mismatch is counted and raised (ChecksumMismatch, an OSError), so its slot is given
back and it is never cached.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from k3stream.store.liveness import LiveBuffers
from k3stream.store.pack_io import PackFile, ReadRequest, host_buffer

Key = tuple[int, int]


class ObjectReader:
    def __init__(self, pack: Any, file: PackFile, live: LiveBuffers, lock: threading.RLock) -> None:
        self.pack = pack
        self.file = file
        self._live = live
        self._lock = lock  # guards the counters
        self._check_object = getattr(pack, "check_object", None)
        self.integrity_checked = getattr(pack, "checksums", None) is not None
        self.counts = Counter(integrity_errors=0, integrity_check_ns=0)

    def read(self, keys: list[Key], priority: int) -> dict[Key, torch.Tensor]:
        """Read whole objects into fresh host buffers (`PackFile.read`'s priority: 0 first)."""
        return dict(self.read_each(keys, priority))

    def read_each(self, keys: list[Key], priority: int) -> Iterator[tuple[Key, torch.Tensor]]:
        """`read`, yielding each (key, buffer) in the order of `keys` as soon as it is read and checked.

        The reads are queued in pack order, so the disk sees a step's reads as one forward sweep; the
        buffers come in the requested order (the order the tiers admit them, which the policies see)."""
        buffers, requests = {}, {}
        for key in keys:
            offset, nbytes = self.pack.object_range(*key)
            destination = host_buffer(nbytes, self.file.direct_io)
            array = destination[:nbytes]
            self._live.track(array)
            buffers[key] = torch.from_numpy(array)
            requests[key] = ReadRequest(f"layer {key[0]} expert {key[1]}", offset, nbytes, destination)
        keys_of = {id(request): key for key, request in requests.items()}
        with contextlib.closing(self.file.read_each(list(requests.values()), priority)) as reads:
            for request in reads:
                key = keys_of[id(request)]
                self._check({key: buffers[key]})
                yield key, buffers.pop(key)

    def _check(self, buffers: dict[Key, torch.Tensor]) -> None:
        if not self.integrity_checked:
            return
        started = time.perf_counter_ns()
        failure = None
        for key, buffer in buffers.items():
            try:
                self._check_object(*key, buffer.numpy())
            except OSError as exc:
                failure = failure or exc
                with self._lock:
                    self.counts["integrity_errors"] += 1
        with self._lock:
            self.counts["integrity_check_ns"] += time.perf_counter_ns() - started
        if failure is not None:
            raise failure
