"""Eviction policies for the expert store and the trace simulator.

A policy tracks the resident keys (layer, expert) of one tier: the tier reports demand accesses,
admissions (demand, or speculative from a prefetch) and removals, and asks for a victim among the keys
that are not pinned. A speculative key nobody has asked for yet is always evicted first (oldest
first), so a wrong prefetch costs a read but never pushes out an expert in use.

- `lfu-lru`: sglang's expert-cache policy. A use counter per key, capped at 255, never decays and
  survives eviction; the least used resident key goes first, ties by least recently used.
- `lru`: least recently used first.
- `arc`: Adaptive Replacement Cache (Megiddo and Modha, 2003), balancing recency and frequency.
- `cycle`: made for the way a MoE model walks its layers. Each token visits the MoE layers in order,
  so an expert of the layer just computed is needed again no sooner than a whole token later, while
  one of the next layer may be needed at once. A key's value is its reuse rate (an exponentially
  decayed count of its uses, half-life `CYCLE_HALF_LIFE_TOKENS` tokens) divided by the number of
  layer steps until its layer comes round again; the lowest value goes. This is Belady's rule
  (evict what is needed furthest in the future) with the future estimated from the past.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

Key = Hashable

SGLANG_FREQUENCY_CAP = 255
SPECULATIVE, DEMANDED = 0, 1  # the first element of a heap priority: unused prefetches go first
# the best hit rate on the synthetic trace of benchmarks/bench_store.py
CYCLE_HALF_LIFE_TOKENS = 1.0


class Policy(Protocol):
    name: str

    def access(self, key: Key) -> None: ...

    def admit(self, key: Key, speculative: bool = False) -> None: ...

    def remove(self, key: Key) -> None: ...

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None: ...


class EvictionPolicy:
    """A policy that ranks keys by a priority which changes only when that key is touched.

    One lazy min-heap serves them all: a key's latest priority is kept in a dict, the heap may hold
    stale entries, and `victim` skips them.
    """

    name = "base"

    def __init__(self) -> None:
        self._clock = 0
        self._priority: dict[Key, Any] = {}
        self._resident: set[Key] = set()
        self._heap: list[tuple[Any, int, Key]] = []
        self._sequence = 0

    def _access_priority(self, key: Key) -> Any:
        """The new priority of `key` after one demand access at the current clock."""
        raise NotImplementedError

    def _admit_priority(self, key: Key) -> Any:
        """The priority of `key` on a demand admission (its miss already called `access`)."""
        raise NotImplementedError

    def access(self, key: Key) -> None:
        """Record one demand access of `key` (a hit, or a miss about to be admitted)."""
        self._clock += 1
        self._set_priority(key, (DEMANDED, self._access_priority(key)))

    def admit(self, key: Key, speculative: bool = False) -> None:
        """`key` became resident after a demand miss, or after a prefetch when `speculative`.

        A prefetched key that no fetch has asked for yet is evicted before any demanded key (oldest
        prefetch first), so a wrong prediction costs a read but never pushes out a useful expert.
        """
        self._resident.add(key)
        self._sequence += 1
        priority = (SPECULATIVE, self._sequence) if speculative else (DEMANDED, self._admit_priority(key))
        self._set_priority(key, priority)

    def remove(self, key: Key) -> None:
        """`key` left the tier."""
        self._resident.discard(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The resident key to evict next among those `evictable` accepts; None if there is none."""
        skipped: list[tuple[Any, int, Key]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            priority, _, key = entry
            if key not in self._resident or self._priority.get(key) != priority:
                continue
            if evictable(key):
                chosen = key
                heapq.heappush(self._heap, entry)
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return chosen

    def _set_priority(self, key: Key, priority: Any) -> None:
        self._priority[key] = priority
        if key in self._resident:
            self._sequence += 1
            heapq.heappush(self._heap, (priority, self._sequence, key))
            if len(self._heap) > 4 * len(self._resident) + 64:
                self._compact()

    def _compact(self) -> None:
        self._heap = [
            entry
            for entry in self._heap
            if entry[2] in self._resident and self._priority[entry[2]] == entry[0]
        ]
        heapq.heapify(self._heap)


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def _access_priority(self, key: Key) -> Any:
        return self._clock

    _admit_priority = _access_priority


class SglangLFULRUPolicy(EvictionPolicy):
    """sglang's reuse-lfu-lru: (capped use count, last use); counts never decay."""

    name = "lfu-lru"

    def __init__(self) -> None:
        super().__init__()
        self._frequency: dict[Key, int] = {}

    def _access_priority(self, key: Key) -> Any:
        frequency = min(self._frequency.get(key, 0) + 1, SGLANG_FREQUENCY_CAP)
        self._frequency[key] = frequency
        return (frequency, self._clock)

    def _admit_priority(self, key: Key) -> Any:
        return (self._frequency.get(key, 0), self._clock)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, 2003), with pins and speculative admissions.

    T1 holds keys used once recently, T2 keys used at least twice; B1 and B2 remember keys recently
    evicted from each. A demand access that finds its key in B1 says T1 was too small, so the target
    size `p` of T1 grows; one found in B2 shrinks it. Eviction takes the least recent evictable key
    of T1 while T1 is over target, else of T2.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.target = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._promote: set[Key] = set()

    def access(self, key: Key) -> None:
        if key in self.t1 or key in self.t2:
            self.t1.pop(key, None)
            self.t2.pop(key, None)
            self.t2[key] = None
        elif key in self.b1:
            self.target = min(self.capacity, self.target + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self._promote.add(key)
        elif key in self.b2:
            self.target = max(0.0, self.target - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self._promote.add(key)

    def admit(self, key: Key, speculative: bool = False) -> None:
        if speculative:
            self.t1[key] = None
            self.t1.move_to_end(key, last=False)
        elif key in self._promote:
            self._promote.discard(key)
            self.t2[key] = None
        elif key not in self.t2:
            self.t1[key] = None

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, 0) is None:
            self.b1[key] = None
        elif self.t2.pop(key, 0) is None:
            self.b2[key] = None
        while len(self.b1) > max(self.capacity - len(self.t1), 0):
            self.b1.popitem(last=False)
        while len(self.b1) + len(self.b2) > self.capacity and self.b2:
            self.b2.popitem(last=False)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        from_t1 = next((key for key in self.t1 if evictable(key)), None)
        from_t2 = next((key for key in self.t2 if evictable(key)), None)
        if from_t1 is not None and (len(self.t1) > self.target or from_t2 is None):
            return from_t1
        return from_t2 if from_t2 is not None else from_t1


class CycleAwarePolicy:
    """See the module doc: value = decayed use rate / layer steps until the key's layer comes again.

    Scores live in the log2 domain, log2(sum over uses of 2^(t_use / half_life)), which does not
    change between uses, so each layer keeps a lazy min-heap of its keys by score; a victim is the
    cheapest head over the layers, after unused prefetches.
    """

    name = "cycle"

    def __init__(self, layers: Sequence[int], half_life_tokens: float = CYCLE_HALF_LIFE_TOKENS) -> None:
        self._position = {layer: index for index, layer in enumerate(sorted(layers))}
        self._cycle = max(len(self._position), 1)
        self._half_life = half_life_tokens * self._cycle  # in layer steps
        self._score: dict[Key, float] = {}
        self._heaps: dict[int, list[tuple[float, int, Key]]] = {}
        # a layer's heap is rid of its stale entries once it grows past its limit: four times the live
        # entries it kept the last time, and 64 (a heap as large as every layer's keys made each push of
        # a many-layer model's decode step climb it, and each clearing a spike of milliseconds)
        self._heap_limits: dict[int, int] = {}
        self._resident: set[Key] = set()
        self._speculative: OrderedDict[Key, None] = OrderedDict()
        self._steps = 0
        self._current: int | None = None
        self._sequence = 0

    def access(self, key: Key) -> None:
        layer = key[0]
        if layer != self._current:
            self._steps += 1
            self._current = layer
        weight = self._steps / self._half_life
        previous = self._score.get(key)
        if previous is not None:
            high, low = (previous, weight) if previous >= weight else (weight, previous)
            weight = high + math.log2(1.0 + 2.0 ** (low - high))
        self._score[key] = weight
        if self._speculative:
            self._speculative.pop(key, None)
        if key in self._resident:
            self._push(key)

    def admit(self, key: Key, speculative: bool = False) -> None:
        self._resident.add(key)
        if speculative:
            self._speculative[key] = None
        else:
            self._push(key)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)
        self._speculative.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        unused = next((key for key in self._speculative if evictable(key)), None)
        if unused is not None:
            return unused
        now = self._steps / self._half_life
        current = self._position.get(self._current, 0)
        best_value, best_key = math.inf, None
        for layer, heap in self._heaps.items():
            head = self._evictable_head(heap, evictable)
            if head is None:
                continue
            steps_away = (self._position.get(layer, 0) - current) % self._cycle or self._cycle
            value = 2.0 ** (self._score[head] - now) / steps_away
            if value < best_value:
                best_value, best_key = value, head
        return best_key

    def _push(self, key: Key) -> None:
        self._sequence += 1
        layer = key[0]
        heap = self._heaps.setdefault(layer, [])
        heapq.heappush(heap, (self._score[key], self._sequence, key))
        if len(heap) > self._heap_limits.get(layer, 64):  # drop stale entries now and then
            live = [
                entry for entry in heap if entry[2] in self._resident and self._score[entry[2]] == entry[0]
            ]
            heapq.heapify(live)
            self._heaps[layer] = live
            self._heap_limits[layer] = 64 + 4 * len(live)

    def _evictable_head(self, heap: list, evictable: Callable[[Key], bool]) -> Key | None:
        """The lowest-score live evictable key of one layer's heap (pinned entries are put back)."""
        pinned, head = [], None
        while heap:
            score, _, key = heap[0]
            if key not in self._resident or key in self._speculative or self._score.get(key) != score:
                heapq.heappop(heap)
            elif evictable(key):
                head = key
                break
            else:
                pinned.append(heapq.heappop(heap))
        for entry in pinned:
            heapq.heappush(heap, entry)
        return head


POLICIES: dict[str, Callable[[int, Sequence[int]], Policy]] = {
    "lfu-lru": lambda capacity, layers: SglangLFULRUPolicy(),
    "lru": lambda capacity, layers: LRUPolicy(),
    "arc": lambda capacity, layers: ARCPolicy(capacity),
    "cycle": lambda capacity, layers: CycleAwarePolicy(layers),
}


def make_policy(name: str, capacity: int, layers: Sequence[int] = ()) -> Policy:
    """A fresh policy by name for a tier of `capacity` objects over MoE `layers` (visited in order)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory(capacity, layers)
