"""The experts of each thread's current step, pinned in every tier until its next step.

A thread's latest `fetch` stays pinned until its next fetch, `release()`, or its exit; so do the
experts it read ahead, until a fetch asks for them or moves on to another layer (so nothing read for a
step is evicted before the step uses it). A key pinned by several threads counts each pin. Every
method runs under the store's lock; an unpin wakes the fetches that wait for room (`slot_freed`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

Key = tuple[int, int]


class StepPins:
    """The pinned keys (iterate, `in`, `len`) and, per thread, its step."""

    def __init__(self, slot_freed: threading.Condition) -> None:
        self._slot_freed = slot_freed
        self._counts: Counter[Key] = Counter()
        self._steps: dict[int, list[Key]] = {}
        self._ahead: dict[int, set[Key]] = {}  # per thread: read ahead, not fetched yet

    def __iter__(self) -> Iterator[Key]:
        return iter(self._counts)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def pin_ahead(self, keys: list[Key]) -> None:
        """The calling thread will fetch `keys` next (it reads them ahead): pin them until it does."""
        ahead = self._ahead.setdefault(threading.get_ident(), set())
        new = [key for key in dict.fromkeys(keys) if key not in ahead]
        ahead.update(new)
        self._counts.update(new)

    def pin_step(self, keys: list[Key]) -> None:
        """The calling thread's new step: pin `keys`, unpin its previous step, and what it read ahead
        for another layer or is now fetching."""
        self.unpin_dead_threads()
        thread = threading.get_ident()
        self._unpin(self._steps.get(thread, []))
        self._counts.update(keys)
        self._steps[thread] = keys
        ahead = self._ahead.get(thread)
        if ahead:
            layers, fetched = {key[0] for key in keys}, set(keys)
            done = [key for key in ahead if key in fetched or key[0] not in layers]
            ahead.difference_update(done)
            self._unpin(done)

    def release(self) -> None:
        """Unpin the calling thread's step and what it read ahead."""
        thread = threading.get_ident()
        self._unpin(self._steps.pop(thread, []))
        self._unpin(list(self._ahead.pop(thread, ())))

    def unpin_dead_threads(self) -> bool:
        """Drop the pins of threads that have exited; returns whether there were any."""
        others = {*self._steps, *self._ahead} - {threading.get_ident()}  # the calling thread runs
        if not others:  # a decode's one thread: no list of the threads to make
            return False
        alive = {thread.ident for thread in threading.enumerate()}
        dead = [ident for ident in others if ident not in alive]
        for ident in dead:
            self._unpin(self._steps.pop(ident, []))
            self._unpin(list(self._ahead.pop(ident, ())))
        return bool(dead)

    def _unpin(self, keys: list[Key]) -> None:
        counts = self._counts
        for key in keys:
            left = counts[key] - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)  # dict's pop: Counter's `del` runs in Python
        if keys:
            self._slot_freed.notify_all()
