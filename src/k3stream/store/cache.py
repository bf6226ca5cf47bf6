"""The bookkeeping of one tier: which keys it holds, which it is loading, and whom to evict.

No data lives here: the store's tiers keep their buffers next to it, and the trace simulator drives
the same object without buffers, so a simulated run and a store run make the same decisions.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

from k3stream.store.policies import make_policy

Key = Hashable


class WorkingSetTooLarge(RuntimeError):
    """Every resident key is pinned, so nothing can make room for one more."""


class SlotCache:
    """`capacity` equal-size slots; a slot is taken by a resident key or by one being loaded."""

    def __init__(self, capacity: int, policy: str, layers: Sequence[int] = ()) -> None:
        self.capacity = capacity
        self.policy_name = policy
        self.policy = make_policy(policy, capacity, layers)
        self.resident: set[Key] = set()
        self.loading: set[Key] = set()

    def used(self) -> int:
        return len(self.resident) + len(self.loading)

    def lookup(self, key: Key) -> bool:
        """A demand access of `key`: tells the policy, returns whether it is resident."""
        self.policy.access(key)
        return key in self.resident

    def reserve(self, key: Key, pinned: Collection[Key], spare: Collection[Key] = ()) -> list[Key]:
        """Take a slot for `key` (about to be loaded), evicting unpinned keys, those in `spare` only when
        nothing else can go; returns the evicted.

        Raises WorkingSetTooLarge when the slots are all pinned or loading.
        """
        evicted = []
        while self.used() >= self.capacity:
            victim = spare and self.policy.victim(lambda c: c not in pinned and c not in spare)
            victim = victim or self.policy.victim(lambda candidate: candidate not in pinned)
            if victim is None:
                raise WorkingSetTooLarge(
                    f"expert cache of {self.capacity} objects cannot evict the active working set "
                    f"({len(pinned)} pinned, {len(self.loading)} loading)"
                )
            self.remove(victim)
            evicted.append(victim)
        self.loading.add(key)
        return evicted

    def has_room_without(self, pinned: Collection[Key]) -> bool:
        """Whether one more key fits, evicting only keys outside `pinned` (for optional prefetches)."""
        if self.used() < self.capacity:
            return True
        return self.policy.victim(lambda candidate: candidate not in pinned) is not None

    def admit(self, key: Key, speculative: bool = False) -> None:
        """`key` finished loading into its reserved slot (`speculative`: loaded by a prefetch)."""
        self.loading.discard(key)
        self.resident.add(key)
        self.policy.admit(key, speculative)

    def cancel(self, key: Key) -> None:
        """The load of `key` failed; give its slot back."""
        self.loading.discard(key)

    def remove(self, key: Key) -> None:
        self.resident.discard(key)
        self.policy.remove(key)
