"""The tiers of the expert store, one object each, in one chain from the compute tier down.

A tier holds whole expert objects in equal slots within a byte budget: its buffers, the futures of
the loads it is running, and its counters. A miss in a tier loads from the tier `below` it; a miss in
the last tier reads the pack. A tier with an uploader (the GPU tier) places what it loads on its
device; the others keep the host buffer. Every method but `place` runs under the store's lock.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from concurrent.futures import Future
from typing import Any

import torch

from k3stream.store.cache import SlotCache
from k3stream.store.gpu import GpuUploader

MIB = 1 << 20
DEFAULT_GPU_MIB = 18 * 1024
GPU_RESERVE_MIB = 3 * 1024
Key = tuple[int, int]


class Tier:
    """One tier's buffers, slot bookkeeping and counters."""

    def __init__(
        self,
        name: str,
        budget_mib: float,
        slot_bytes: int,
        policy: str,
        layers: list[int],
        below: Tier | None = None,
        uploader: GpuUploader | None = None,
    ) -> None:
        self.name = name
        self.budget_bytes = int(budget_mib * MIB)
        self.cache = SlotCache(self.budget_bytes // slot_bytes, policy, layers)
        self.below = below
        self.uploader = uploader
        self.buffers: dict[Key, torch.Tensor] = {}
        self.ready: dict[Key, Any] = {}  # GPU copy events
        self.loading: dict[Key, Future] = {}
        self.prefetching: set[Key] = set()  # the keys of `loading` that a prefetch loads
        self.demanded: set[Key] = set()  # the keys of `prefetching` a fetch waits for
        # prefetched, or held and named by a hint, for a layer whose step has not come yet: evicted
        # only when nothing else can go; each with the step during which it was marked
        self.fresh: dict[Key, int] = {}
        self.counts = Counter(cache_hits=0, cache_misses=0, cache_evictions=0)

    def lookup(self, key: Key) -> bool:
        """A demand access of `key`: counted, and told to the policy; returns whether it is resident."""
        hit = self.cache.lookup(key)
        self.counts["cache_hits" if hit else "cache_misses"] += 1
        return hit

    def missing(self, keys: list[Key]) -> list[Key]:
        """The `keys` neither resident nor loading."""
        return [key for key in keys if key not in self.buffers and key not in self.loading]

    def room_for(self, count: int, pinned: Collection[Key]) -> bool:
        """Whether `count` more keys fit, evicting only resident keys outside `pinned`."""
        free = self.cache.capacity - self.cache.used()
        if free >= count:
            return True
        pinned_resident = sum(1 for key in pinned if key in self.cache.resident)
        return free + len(self.cache.resident) - pinned_resident >= count

    def speculative(self) -> int:
        """The slots taken by prefetches no fetch has asked for yet."""
        return len(self.prefetching - self.demanded)

    def reserve(self, key: Key, pinned: Collection[Key], prefetch: bool = False) -> None:
        """Take a slot for loading `key`, evicting resident keys outside `pinned`."""
        self.evict(self.cache.reserve(key, pinned, self.fresh))
        self.loading[key] = Future()
        if prefetch:
            self.prefetching.add(key)

    def join(self, key: Key) -> tuple[Future, bool]:
        """A fetch waits for the running load of `key`: (its future, whether a prefetch runs it)."""
        by_prefetch = key in self.prefetching
        if by_prefetch:
            self.demanded.add(key)
        return self.loading[key], by_prefetch

    def place(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """This tier's copy of a host buffer and its ready event (outside the lock: it may upload)."""
        if self.uploader is None:
            return host, None
        return self.uploader.upload(host)

    def install(self, key: Key, buffer: torch.Tensor, ready: Any) -> None:
        """`key` finished loading into its slot; a prefetch no fetch asked for goes in as speculative."""
        unused = key in self.prefetching and key not in self.demanded
        self._settle(key)
        self.buffers[key] = buffer
        if ready is not None:
            self.ready[key] = ready
        self.cache.admit(key, unused)
        self.loading.pop(key).set_result(buffer)

    def cancel(self, key: Key, error: BaseException) -> None:
        """The load of `key` failed: give its slot back and pass `error` to whoever waits for it."""
        self.cache.cancel(key)
        self._settle(key)
        self.loading.pop(key).set_exception(error)

    def evict(self, keys: list[Key]) -> None:
        for key in keys:
            self.buffers.pop(key, None)
            self.ready.pop(key, None)
            self.fresh.pop(key, None)
            self.counts["cache_evictions"] += 1

    def hand_out(self, key: Key, buffer: torch.Tensor) -> None:
        """Make the caller's stream wait for a GPU buffer's copy (nothing to do for host buffers)."""
        if self.uploader is not None:
            self.uploader.hand_out(buffer, self.ready[key])

    def resident_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers.values())

    def snapshot(self) -> dict[str, Any]:
        lookups = self.counts["cache_hits"] + self.counts["cache_misses"]
        stats = {name: int(value) for name, value in self.counts.items()}
        if self.uploader is not None:
            stats["h2d_bytes"] = self.uploader.uploaded_bytes
        stats.update(
            resident_experts=len(self.buffers),
            resident_bytes=self.resident_bytes(),
            capacity_experts=self.cache.capacity,
            budget_bytes=self.budget_bytes,
            policy=self.cache.policy_name,
            hit_rate=self.counts["cache_hits"] / lookups if lookups else 0.0,
        )
        return stats

    def _settle(self, key: Key) -> None:
        self.prefetching.discard(key)
        self.demanded.discard(key)


class FrontTier(Tier):
    """The compute tier, whose buffers `fetch` hands out. It also counts hits per layer and follows
    each prefetch from its load to its first use or its eviction; a lower tier needs neither, since
    the tier above uses what it prefetches at once."""

    def __init__(
        self,
        name: str,
        budget_mib: float,
        slot_bytes: int,
        policy: str,
        layers: list[int],
        below: Tier | None = None,
        uploader: GpuUploader | None = None,
    ) -> None:
        super().__init__(name, budget_mib, slot_bytes, policy, layers, below, uploader)
        self.unused: set[Key] = set()  # resident prefetches no fetch has asked for yet
        # keys read ahead for the fetch that follows (the rest of a step): that fetch counts them as
        # misses, and they are neither prefetch loads nor prefetch uses (they are not predictions)
        self.ahead: set[Key] = set()
        self.addresses: dict[Key, int] = {}  # of each resident host buffer (what `hold` hands out)
        self._stepping: set[int] = set()  # the layers of the latest fetch
        self._step = 0  # steps begun (a fetch of other layers than the one before begins one)
        self.layer_counts = {layer: Counter(hits=0, misses=0) for layer in layers}
        self.prefetch_counts = Counter(
            prefetch_loads=0, prefetch_hits=0, prefetch_unused_evictions=0, prefetch_waits=0
        )

    def read_ahead(self, keys: list[Key]) -> None:
        """`keys` are about to be read for the next fetch; the resident ones stay hits."""
        self.ahead.update(key for key in keys if key not in self.buffers)

    def hold(self, keys: list[Key]) -> None:
        """Keep `keys` for their layer's next step (`fresh`)."""
        self.fresh.update(dict.fromkeys(keys, self._step))

    def fetched(self, keys: list[Key]) -> None:
        """A fetch of `keys` is over: what was read ahead for it has been counted. A fetch of another
        layer ends the previous layer's step: what was kept for that step (marked fresh before it
        began) and not asked for is no longer fresh; what was marked during it is kept for the
        layer's next step (a hint sent after a layer's step for its step in the next token)."""
        self.ahead.difference_update(keys)
        layers = {key[0] for key in keys}
        ended = self._stepping - layers
        if ended:
            began = self._step
            self.fresh = {
                key: marked for key, marked in self.fresh.items() if key[0] not in ended or marked >= began
            }
        if layers != self._stepping:
            self._step += 1
        self._stepping = layers

    def lookup(self, key: Key) -> bool:
        self.fresh.pop(key, None)  # its step came: the step's pins hold it now
        if key in self.ahead:  # read for this very fetch, only earlier: a miss
            self.unused.discard(key)
            self.counts["cache_misses"] += 1
            self.layer_counts[key[0]]["misses"] += 1
            return self.cache.lookup(key)
        hit = super().lookup(key)
        self.layer_counts[key[0]]["hits" if hit else "misses"] += 1
        if hit and key in self.unused:
            self.unused.discard(key)
            self.prefetch_counts["prefetch_hits"] += 1
        return hit

    def lookup_resident(self, keys: list[Key]) -> None:
        """`lookup` of each of `keys`, all of one layer and resident (a step `hold` serves), in one pass:
        the same policy accesses in the same order, the same counts."""
        access, fresh, ahead, unused = self.cache.policy.access, self.fresh, self.ahead, self.unused
        misses = prefetch_hits = 0
        for key in keys:
            access(key)
            fresh.pop(key, None)
            if key in ahead:  # read for this very step, only earlier: a miss
                misses += 1
                unused.discard(key)
            elif key in unused:
                unused.discard(key)
                prefetch_hits += 1
        hits = len(keys) - misses
        layer = self.layer_counts[keys[0][0]]
        self.counts["cache_hits"] += hits
        self.counts["cache_misses"] += misses
        layer["hits"] += hits
        layer["misses"] += misses
        self.prefetch_counts["prefetch_hits"] += prefetch_hits

    def speculative(self) -> int:
        return len(self.unused) + super().speculative()

    def join(self, key: Key) -> tuple[Future, bool]:
        future, by_prefetch = super().join(key)
        self.prefetch_counts["prefetch_waits"] += by_prefetch and key not in self.ahead
        return future, by_prefetch

    def install(self, key: Key, buffer: torch.Tensor, ready: Any) -> None:
        if key in self.prefetching and key not in self.ahead:
            self.prefetch_counts["prefetch_loads"] += 1
            if key not in self.demanded:
                self.unused.add(key)
                self.hold([key])
        super().install(key, buffer, ready)
        if self.uploader is None:
            self.addresses[key] = buffer.data_ptr()

    def evict(self, keys: list[Key]) -> None:
        super().evict(keys)
        for key in keys:
            self.addresses.pop(key, None)
        self.ahead.difference_update(keys)
        unused = self.unused.intersection(keys)
        self.prefetch_counts["prefetch_unused_evictions"] += len(unused)
        self.unused.difference_update(unused)


def make_tiers(
    device: torch.device,
    ram_mib: float,
    gpu_mib: float | None,
    slot_bytes: int,
    top_k: int,
    policy: str,
    layers: list[int],
) -> list[Tier]:
    """The chain for `device`, front first: GPU, then RAM when `ram_mib`, on CUDA; else RAM alone
    (`tier_budgets`; `gpu_mib` None on CUDA: `_default_gpu_mib`)."""
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"expert store device {device} requested but CUDA is not available")
    if cuda and gpu_mib is None:
        gpu_mib = _default_gpu_mib(device)
    budgets = tier_budgets(device, ram_mib, gpu_mib, slot_bytes, top_k)
    if "gpu" not in budgets:
        return [FrontTier("ram", ram_mib, slot_bytes, policy, layers)]
    host = Tier("ram", ram_mib, slot_bytes, policy, layers) if "ram" in budgets else None
    uploader = GpuUploader(device, slot_bytes)
    front = FrontTier("gpu", budgets["gpu"], slot_bytes, policy, layers, below=host, uploader=uploader)
    return [front] if host is None else [front, host]


def tier_budgets(
    device: torch.device, ram_mib: float, gpu_mib: float | None, slot_bytes: int, top_k: int
) -> dict[str, float]:
    """The MiB of each tier, front first (no device is touched). On CUDA the GPU tier computes, so it is
    always there, `gpu_mib` MiB (a number: 0 is refused as any budget below one top-k working set is),
    then a RAM tier when `ram_mib`; elsewhere RAM alone, and a `gpu_mib` other than None or 0 (no GPU
    tier) is refused (ValueError)."""
    cuda = device.type == "cuda"
    if not cuda and gpu_mib:
        raise ValueError(f"expert store GPU tier (--gpu-mib {gpu_mib:g}) needs a CUDA device, got {device}")
    budgets = {"gpu": float(gpu_mib)} if cuda else {"ram": ram_mib}
    if cuda and ram_mib:
        budgets["ram"] = ram_mib
    for name, mib in budgets.items():
        if int(mib * MIB) // slot_bytes < top_k:
            raise ValueError(
                f"expert store {name} budget {mib:g} MiB is below one top-k working set of "
                f"{_rounded_up(top_k * slot_bytes / MIB)} MiB ({top_k} x {slot_bytes} bytes): "
                f"--{name}-mib takes that or more"
            )
    return budgets


def _rounded_up(mib: float) -> str:
    """`mib` to six decimals, rounded up: a number the user can pass back as the budget (0.220703 MiB
    would floor to a byte count below 4 x 57856)."""
    return f"{math.ceil(mib * 1e6) / 1e6:.6f}".rstrip("0").rstrip(".")


def _default_gpu_mib(device: torch.device) -> float:
    """sglang's default: up to 18 GiB of the free device memory, leaving 3 GiB free."""
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return max(0.0, min(DEFAULT_GPU_MIB, free_bytes / MIB - GPU_RESERVE_MIB))
