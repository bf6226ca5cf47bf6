"""The load protocol over the tier chain: reservations, futures and waits for room.

A slot is counted from the moment its load starts, so resident plus loading bytes never exceed a
tier's budget. A demand load reserves the slots of all its misses at once or none, and waits
(holding none) only while some load is running, so two fetches can never wait for each other; when
nothing is loading and its misses still do not fit, it raises WorkingSetTooLarge. It may evict
anything but the pinned steps. A prefetch reserves what fits (a hint within SPECULATIVE_SHARE of the
tier; the part of a hint beyond that share is not read, and a hint that large fills only free
slots, as many as are free), keeps its own keys and never waits. The reader threads serve demand
loads first, then read-ahead, then hints (those filling free slots last). A key already loading is
waited for, not read again, its reads still queued raised to the waiting load's priority
(`ObjectReader.hurry`); a demand that waited for a prefetch which failed loads that key itself.

A miss in a tier loads from the tier below it, and a miss in the last tier reads the pack; what a
prefetch could not fit in the tier below is read from the pack straight through.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from enum import IntEnum

import torch

from k3stream.store.cache import WorkingSetTooLarge
from k3stream.store.pins import StepPins
from k3stream.store.reader import ObjectReader, ObjectReads
from k3stream.store.tiers import Key, Tier

SPECULATIVE_SHARE = 0.5


class Load(IntEnum):
    """Who asks for a load; its value is the priority of its pack reads (lowest first)."""

    DEMAND = 0  # a fetch: counted as lookups, reserves all its misses or waits for room
    READ_AHEAD = 1  # what a fetch will ask for next: a prefetch, not held to the speculative share
    HINT = 2  # a prediction: a prefetch within the speculative share
    FILL = 3  # a prediction larger than that share (a prefill's step sweeps the tier): a hint read
    # only into free slots, evicting nothing (what the step keeps is its own reads' to decide)


class Loader:
    """Makes keys resident in a tier of the chain (each method says whether it runs under the lock)."""

    def __init__(
        self,
        reader: ObjectReader,
        pins: StepPins,
        lock: threading.RLock,
        slot_freed: threading.Condition,
        top_k: int,
    ) -> None:
        self.reader = reader
        self.pins = pins
        self.lock = lock
        self.slot_freed = slot_freed
        self.top_k = top_k
        self.counts = Counter(slot_waits=0, prefetch_skipped=0)

    def ensure(self, tier: Tier, keys: list[Key], load: Load, keep: bool) -> dict[Key, torch.Tensor]:
        """Make `keys` resident in `tier`; return their buffers when `keep` (a prefetch skips what does
        not fit, so it may return fewer)."""
        if load is Load.DEMAND:
            with self.lock:
                for key in keys:
                    tier.lookup(key)
        found: dict[Key, torch.Tensor] = {}
        while keys:
            with self.lock:
                resident, waits, mine = self._plan(tier, keys, load, keep)
            found.update(resident)
            if mine:
                found.update(self._load(tier, mine, load, keep))
            keys = []
            for key, (future, by_prefetch) in waits.items():
                try:
                    found[key] = future.result()
                except Exception:
                    if not by_prefetch:
                        raise
                    keys.append(key)
        return found

    def _plan(
        self, tier: Tier, keys: list[Key], load: Load, keep: bool
    ) -> tuple[dict[Key, torch.Tensor], dict[Key, tuple[Future, bool]], list[Key]]:
        """Under the lock: (resident buffers when `keep`, {key: (load to wait for, whether a prefetch
        runs it)}, keys whose slots this call reserved and must load)."""
        if load is Load.DEMAND:
            missing = self._wait_for_room(tier, keys)
            waits = {key: tier.join(key) for key in keys if key in tier.loading}
            self.reader.hurry(list(waits), int(load))  # a prefetch's reads still queued: now demand
            for key in missing:
                tier.reserve(key, self.pins)
        else:
            waits = {}
            pinned = set(self.pins) | set(keys) | (set(tier.buffers) if load is Load.FILL else set())
            # a fill takes free slots only, which the step it predicts would take anyway: the hints'
            # share keeps speculation from evicting what the tier holds, and a fill evicts nothing
            missing = self._reserve_what_fits(tier, tier.missing(keys), pinned, load is Load.HINT)
        resident = {key: tier.buffers[key] for key in keys if key in tier.buffers} if keep else {}
        return resident, waits, missing

    def _wait_for_room(self, tier: Tier, keys: list[Key]) -> list[Key]:
        """Under the lock: wait, holding no reservation, until the missing `keys` fit; return them.
        Only a running load frees a slot (the reservations are all taken by running loads), so with
        none running and no dead thread's pins to drop, waiting would be forever: raise instead."""
        while not tier.room_for(len(missing := tier.missing(keys)), self.pins):
            if tier.cache.loading:
                self.counts["slot_waits"] += 1
                self.slot_freed.wait()
            elif not self.pins.unpin_dead_threads():
                raise WorkingSetTooLarge(
                    f"expert store {tier.name} tier ({tier.cache.capacity} slots) cannot hold the pinned "
                    f"working set ({len(self.pins)} experts pinned)"
                )
        return missing

    def _reserve_what_fits(
        self, tier: Tier, keys: list[Key], pinned: set[Key], speculative: bool
    ) -> list[Key]:
        """Under the lock: reserve the slots of the keys of a prefetch that fit (a `speculative` one
        within the tier's share for speculation); skip the rest."""
        reserved = []
        share = self.speculative_share(tier)
        for key in keys:
            over_share = speculative and tier.speculative() >= share
            if over_share or not tier.cache.has_room_without(pinned):
                self.counts["prefetch_skipped"] += 1
                continue
            tier.reserve(key, pinned, prefetch=True)
            reserved.append(key)
        return reserved

    def speculative_share(self, tier: Tier) -> int:
        """The slots of `tier` that hints may fill."""
        return max(self.top_k, int(tier.cache.capacity * SPECULATIVE_SHARE))

    def start(self, tier: Tier, keys: list[Key], load: Load) -> tuple[list[Key], ObjectReads] | None:
        """Under the lock, a prefetch into the last tier (its misses read the pack) begun in the
        calling thread: reserve the slots of the `keys` that fit and queue their pack reads at once,
        so the disk starts without waiting for another thread to wake; (the keys reserved, their
        reads), which `install` or `abandon` takes over, or None when none is to be read."""
        mine = self._plan(tier, keys, load, keep=False)[2]
        if not mine:
            return None
        try:
            return mine, self.reader.start(mine, int(load))
        except BaseException as exc:
            self._give_back(tier, mine, exc)
            raise

    def install(self, tier: Tier, keys: list[Key], objects: ObjectReads) -> None:
        """Outside the lock: fill the slots `start` reserved for `keys` as their reads land."""
        self._load(tier, keys, Load.READ_AHEAD, keep=False, arrivals=objects)

    def abandon(self, tier: Tier, keys: list[Key], objects: ObjectReads) -> None:
        """Outside the lock: give back the slots `start` reserved, once their reads have ended."""
        objects.close()
        with self.lock:
            self._give_back(tier, keys, CancelledError(f"{tier.name} tier load abandoned"))

    def _give_back(self, tier: Tier, keys: list[Key], error: BaseException) -> None:
        """Under the lock: the loads of `keys` failed; their slots are free and their waiters told."""
        for key in keys:
            tier.cancel(key, error)
        self.slot_freed.notify_all()

    def _load(
        self,
        tier: Tier,
        keys: list[Key],
        load: Load,
        keep: bool,
        arrivals: ObjectReads | None = None,
    ) -> dict[Key, torch.Tensor]:
        """Fill the reserved slots of `keys` (outside the lock), each as soon as it arrives (from
        `arrivals`, the reads already started, else read here), so a fetch waiting for one need not
        wait for the others; on failure give the slots not filled back."""
        installed: dict[Key, torch.Tensor] = {}
        pending = list(keys)
        if arrivals is None:
            arrivals = self._from_below(tier, keys, load)
        try:
            with contextlib.closing(arrivals):
                for key, host in arrivals:
                    buffer, ready = tier.place(host)
                    del host
                    with self.lock:
                        tier.install(key, buffer, ready)
                        if keep:
                            installed[key] = buffer
                        pending.remove(key)
                        self.slot_freed.notify_all()
                        # dropped before the lock is: another thread may evict the key the moment it
                        # takes the lock, and the buffer must die then, or its bytes and those of the
                        # read that evicted it are alive together, one object over the budget
                        del buffer
        except BaseException as exc:
            with self.lock:
                self._give_back(tier, pending, exc)
            raise
        return installed

    def _from_below(self, tier: Tier, keys: list[Key], load: Load) -> Iterator[tuple[Key, torch.Tensor]]:
        """`keys`' host buffers from the tier below `tier`, in the order of `keys`, or from the pack, as
        `PackFile.read_each` yields them (a prefetch's in the order they land)."""
        if tier.below is None:
            yield from self.reader.read_each(keys, priority=int(load))
            return
        hosts = self.ensure(tier.below, keys, load, keep=True)
        hosts.update(self.reader.read([key for key in keys if key not in hosts], priority=int(load)))
        for key in keys:
            yield key, hosts.pop(key)
