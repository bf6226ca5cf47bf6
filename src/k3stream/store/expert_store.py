"""The expert store: an `ExpertSource` over an expert pack, through a GPU tier, a RAM tier and the disk.

The compute tier (GPU when the device is CUDA, else RAM) holds whole expert objects, each one uint8
buffer, and hands out zero-copy views per role. A miss in the GPU tier is served by the RAM tier when
there is one, and a miss there by a read of the pack. Budgets are bytes per tier; a slot is counted
from the moment its load starts, so resident plus loading bytes never exceed a budget.

Pins: the experts of each thread's current step (its latest `fetch`, until its next one, `release()`,
or its exit) and of running loads are never evicted. A demand fetch reserves the slots of all its
misses at once or none, and waits (holding none) only while some load is running, so two fetches can
never wait for each other; when nothing is loading and its misses still do not fit, it raises
WorkingSetTooLarge. `prefetch` loads in the background; a `fetch` that finds its expert still loading
waits for that load instead of reading again (and reads it itself if that prefetch fails). A prefetched
expert that a fetch asked for before it was evicted is a used prefetch, cached like a demand load.

Adaptive prefetch (the default): the experts of every hint that the compute tier lacks (what the hint
reads) are scored against the next fetch of their layer, whether the hint was issued or not, as an
exponentially decayed precision per layer; a layer's hints are issued only while that precision is
at least PREFETCH_MIN_PRECISION. Scoring suppressed hints too is the probe: a layer whose predictions
improve gets prefetch back without spending reads on it. A prefetch never
evicts the experts of a current step and never holds more than SPECULATIVE_SHARE of a tier's slots
with experts no fetch has asked for yet.

After `close()`, `fetch` raises RuntimeError("expert store is closed") and `prefetch` is ignored: it is
a hint, and an engine may still hint while it shuts down.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3stream.store.cache import SlotCache, WorkingSetTooLarge
from k3stream.store.pack_io import PackFile, ReadRequest
from k3stream.store.traces import TraceWriter

MIB = 1 << 20
DEFAULT_GPU_MIB = 18 * 1024
GPU_RESERVE_MIB = 3 * 1024
Key = tuple[int, int]
PREFETCH_MIN_PRECISION = 0.5
PREFETCH_DECAY = 0.75  # the weight of a layer's past hints: a wrong layer turns off after 3 fetches
SPECULATIVE_SHARE = 0.5


def _open_pack(pack: Any) -> Any:
    if isinstance(pack, (str, os.PathLike)):
        from k3stream.pack.reader import ExpertPack

        return ExpertPack(Path(pack))
    return pack


class _Tier:
    """One tier's buffers, slot bookkeeping and counters (guarded by the store's lock)."""

    def __init__(self, name: str, budget_mib: float, slot_bytes: int, policy: str, layers: list[int]) -> None:
        self.name = name
        self.budget_bytes = int(budget_mib * MIB)
        self.cache = SlotCache(self.budget_bytes // slot_bytes, policy, layers)
        self.buffers: dict[Key, torch.Tensor] = {}
        self.ready: dict[Key, Any] = {}  # GPU copy events
        self.loading: dict[Key, Future] = {}
        self.prefetching: set[Key] = set()  # the keys of `loading` that a prefetch loads
        self.demanded: set[Key] = set()  # the keys of `prefetching` a fetch waits for
        self.counts = Counter(cache_hits=0, cache_misses=0, cache_evictions=0, h2d_bytes=0)

    def install(self, key: Key, buffer: torch.Tensor, ready: Any, speculative: bool) -> None:
        self.buffers[key] = buffer
        if ready is not None:
            self.ready[key] = ready
        self.cache.admit(key, speculative)

    def settle(self, key: Key) -> bool:
        """`key` stopped loading; returns whether it was a prefetch no fetch has asked for."""
        unused = key in self.prefetching and key not in self.demanded
        self.prefetching.discard(key)
        self.demanded.discard(key)
        return unused

    def room_for(self, count: int, pinned: Collection[Key]) -> bool:
        """Whether `count` more keys fit, evicting only resident keys outside `pinned`."""
        free = self.cache.capacity - self.cache.used()
        if free >= count:
            return True
        pinned_resident = sum(1 for key in pinned if key in self.cache.resident)
        return free + len(self.cache.resident) - pinned_resident >= count

    def evict(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.buffers.pop(key, None)
            self.ready.pop(key, None)
            self.counts["cache_evictions"] += 1

    def snapshot(self) -> dict[str, Any]:
        lookups = self.counts["cache_hits"] + self.counts["cache_misses"]
        stats = {
            name: int(value)
            for name, value in self.counts.items()
            if name != "h2d_bytes" or self.name == "gpu"
        }
        stats.update(
            resident_experts=len(self.buffers),
            resident_bytes=sum(buffer.numel() for buffer in self.buffers.values()),
            capacity_experts=self.cache.capacity,
            budget_bytes=self.budget_bytes,
            policy=self.cache.policy_name,
            hit_rate=self.counts["cache_hits"] / lookups if lookups else 0.0,
        )
        return stats


class _HintScores:
    """Per MoE layer, the decayed precision of prefetch hints: the share of a hint's experts (those not
    resident when hinted) that the layer's next fetch asked for. A layer starts trusted (1.0). Hints
    are kept per layer, not per thread: a hint is scored by whichever fetch of its layer comes next."""

    def __init__(self, layers: Iterable[int]) -> None:
        self.precision = {layer: 1.0 for layer in layers}
        self.pending: dict[int, set[int]] = {}

    def active(self, layer: int) -> bool:
        return self.precision[layer] >= PREFETCH_MIN_PRECISION

    def hint(self, layer: int, experts: Iterable[int]) -> None:
        self.pending.setdefault(layer, set()).update(experts)

    def score(self, layer: int, experts: Iterable[int]) -> None:
        hinted = self.pending.pop(layer, None)
        if hinted:
            right = len(hinted.intersection(experts)) / len(hinted)
            self.precision[layer] = PREFETCH_DECAY * self.precision[layer] + (1 - PREFETCH_DECAY) * right


class ExpertStore:
    """Serves `fetch(layer, expert_ids)` from an expert pack through budgeted tiers (see module doc)."""

    def __init__(
        self,
        pack: Any,
        ram_mib: float,
        gpu_mib: float | None = None,
        device: str | torch.device = "cpu",
        policy: str = "cycle",
        prefetch: bool = True,
        adaptive_prefetch: bool = True,
        io_threads: int = 4,
        direct_io: bool = False,
        record_trace: str | os.PathLike[str] | None = None,
        read_splits: int = 4,
        simulated_read_latency_us: float = 0.0,
    ) -> None:
        self.pack = _open_pack(pack)
        self._parts_by_layer: dict[int, list[tuple[str, int, int, int, tuple[int, int]]]] = {}
        self.device = torch.device(device)
        self.top_k = int(self.pack.top_k)
        self.num_experts = int(self.pack.num_experts)
        self.moe_layers = frozenset(int(layer) for layer in self.pack.moe_layers)
        self.slot_bytes = max(self.pack.object_range(layer, 0)[1] for layer in self.moe_layers)
        self._tiers = self._make_tiers(ram_mib, gpu_mib, policy)
        self._compute = self._tiers[0]
        self._host = next((tier for tier in self._tiers if tier.name == "ram"), None)
        self._lock = threading.RLock()
        self._slot_freed = threading.Condition(self._lock)
        self._closed = False
        self._pins: Counter[Key] = Counter()
        self._step_pins: dict[int, list[Key]] = {}
        self._prefetched: set[Key] = set()
        self._layer_fetches: Counter[int] = Counter()
        self._adaptive = prefetch and adaptive_prefetch
        self._hints = _HintScores(self.moe_layers)
        self._live: dict[int, weakref.ref] = {}
        self._layer_counts: dict[int, Counter] = {
            layer: Counter(hits=0, misses=0) for layer in self.moe_layers
        }
        self._counts = Counter(
            fetches=0,
            fetch_ns=0,
            tokens=0,
            slot_waits=0,
            prefetch_requests=0,
            read_ahead=0,
            prefetch_loads=0,
            prefetch_hits=0,
            prefetch_unused_evictions=0,
            prefetch_skipped=0,
            prefetch_stale=0,
            prefetch_suppressed=0,
            prefetch_waits=0,
            integrity_errors=0,
            integrity_check_ns=0,
        )
        self._check_object = getattr(self.pack, "check_object", None)
        self.integrity_checked = getattr(self.pack, "checksums", None) is not None
        self._file: PackFile | None = None
        self._uploader = None
        self._prefetcher: ThreadPoolExecutor | None = None
        self._trace: TraceWriter | None = None
        try:
            self._open(io_threads, read_splits, direct_io, simulated_read_latency_us, prefetch, record_trace)
        except BaseException:
            self._release()
            raise

    def _open(
        self,
        io_threads: int,
        read_splits: int,
        direct_io: bool,
        simulated_read_latency_us: float,
        prefetch: bool,
        record_trace: str | os.PathLike[str] | None,
    ) -> None:
        """Open the pack, the uploader, the prefetch thread and the trace (the constructor undoes them
        with `_release` if any step fails)."""
        self._file = PackFile(
            self.pack.path,
            io_threads=io_threads,
            read_splits=read_splits,
            direct_io=direct_io,
            simulated_read_latency_us=simulated_read_latency_us,
        )
        if self.device.type == "cuda":
            from k3stream.store.gpu import GpuUploader

            self._uploader = GpuUploader(self.device, self.slot_bytes)
        if prefetch:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="k3stream-prefetch")
        if record_trace is not None:
            self._trace = TraceWriter(
                record_trace,
                {
                    "source": f"ExpertStore over {self.pack.path}",
                    "moe_layers": sorted(self.moe_layers),
                    "num_experts": self.num_experts,
                    "top_k": self.top_k,
                    "object_bytes": self.slot_bytes,
                },
            )

    def _make_tiers(self, ram_mib: float, gpu_mib: float | None, policy: str) -> list[_Tier]:
        layers = sorted(self.moe_layers)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"expert store device {self.device} requested but CUDA is not available")
            gpu_mib = gpu_mib or self._default_gpu_mib()
            tiers = [_Tier("gpu", gpu_mib, self.slot_bytes, policy, layers)]
            if ram_mib:
                tiers.append(_Tier("ram", ram_mib, self.slot_bytes, policy, layers))
        else:
            if gpu_mib:
                raise ValueError(
                    f"expert store GPU tier (gpu_mib={gpu_mib}) needs a CUDA device, got {self.device}"
                )
            tiers = [_Tier("ram", ram_mib, self.slot_bytes, policy, layers)]
        need = self.top_k * self.slot_bytes
        for tier in tiers:
            if tier.cache.capacity < self.top_k:
                raise ValueError(
                    f"expert store {tier.name} budget {tier.budget_bytes / MIB:g} MiB is below one top-k "
                    f"working set of {need / MIB:g} MiB ({self.top_k} x {self.slot_bytes} bytes)"
                )
        return tiers

    def _default_gpu_mib(self) -> float:
        """The seed's default: up to 18 GiB of the free device memory, leaving 3 GiB free."""
        free_bytes, _total = torch.cuda.mem_get_info(self.device)
        return max(0.0, min(DEFAULT_GPU_MIB, free_bytes / MIB - GPU_RESERVE_MIB))

    @property
    def max_experts_per_fetch(self) -> int:
        """The most distinct experts one `fetch` may ask for: the compute tier's slot count."""
        return self._compute.cache.capacity

    # ---- ExpertSource ---------------------------------------------------------------------------

    def fetch(self, layer: int, expert_ids: Iterable[int]) -> dict[int, Any]:
        """The weights of each requested expert of `layer`, as views of resident objects."""
        started = time.perf_counter_ns()
        keys = self._keys(layer, expert_ids)
        if len(keys) > self.max_experts_per_fetch:
            raise ValueError(
                f"expert store fetch of {len(keys)} experts for layer {layer} exceeds the "
                f"{self._compute.name} tier's {self.max_experts_per_fetch} slots; "
                "fetch at most max_experts_per_fetch at a time"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("expert store is closed")
            self._pin_step(keys)
            self._layer_fetches[layer] += 1
            self._hints.score(layer, [expert for _, expert in keys])
            if self._trace is not None:
                self._trace.step(layer, [expert for _, expert in keys])
        buffers = self._ensure(self._compute, keys, demand=True, keep=True)
        weights = {expert: self._weights((layer, expert), buffers[(layer, expert)]) for _, expert in keys}
        with self._lock:
            self._counts["fetches"] += 1
            self._counts["fetch_ns"] += time.perf_counter_ns() - started
        return weights

    def prefetch(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Start loading these experts in the background; never blocks, never evicts pinned experts.
        Adaptive: only while the layer's hints have been precise enough. Ignored after `close()`."""
        if self._prefetcher is None:
            return
        keys = self._keys(layer, expert_ids)
        if not keys:
            return
        with self._lock:  # close() shuts the prefetcher down only after it set _closed under this lock
            if self._closed:
                return
            self._counts["prefetch_requests"] += len(keys)
            issue = self._issues_prefetch(layer)
            self._hints.hint(layer, [expert for _, expert in self._missing(self._compute, keys)])
            if not issue:
                self._counts["prefetch_suppressed"] += len(keys)
                return
            serial = self._layer_fetches[layer]
            self._prefetcher.submit(self._prefetch_job, keys, serial)

    def read_ahead(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Start loading experts the caller is sure to fetch next (the rest of a step it fetches in
        parts): like `prefetch`, but never scored or suppressed, since it is not a prediction."""
        if self._prefetcher is None:
            return
        keys = self._keys(layer, expert_ids)
        with self._lock:
            if self._closed or not keys:
                return
            self._counts["read_ahead"] += len(keys)
            self._prefetcher.submit(self._prefetch_job, keys, self._layer_fetches[layer])

    def _issues_prefetch(self, layer: int) -> bool:
        """Whether a hint for `layer` is loaded now (always, or while its hints are precise enough)."""
        return self._prefetcher is not None and (not self._adaptive or self._hints.active(layer))

    def release(self) -> None:
        """Unpin the experts of the calling thread's latest fetch (a thread that is done with the store)."""
        with self._lock:
            self._unpin(self._step_pins.pop(threading.get_ident(), []))

    def end_token(self, n_tokens: int = 1) -> None:
        """The engine finished a step that produced `n_tokens` tokens (for bytes per token)."""
        with self._lock:
            self._counts["tokens"] += int(n_tokens)
            if self._trace is not None and not self._closed:
                self._trace.end_token(n_tokens)

    # ---- loading --------------------------------------------------------------------------------

    def _keys(self, layer: int, expert_ids: Iterable[int]) -> list[Key]:
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} is not a routed MoE layer of {self.pack.path}")
        experts = list(dict.fromkeys(int(expert) for expert in expert_ids))
        bad = [expert for expert in experts if not 0 <= expert < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} out of range 0..{self.num_experts - 1} for layer {layer}")
        return [(layer, expert) for expert in experts]

    def _pin_step(self, keys: list[Key]) -> None:
        self._unpin_dead_threads()
        thread = threading.get_ident()
        self._unpin(self._step_pins.get(thread, []))
        self._pins.update(keys)
        self._step_pins[thread] = keys

    def _unpin(self, keys: list[Key]) -> None:
        """Under the lock: drop one pin of each key and wake the fetches waiting for room."""
        for key in keys:
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
        if keys:
            self._slot_freed.notify_all()

    def _unpin_dead_threads(self) -> bool:
        """Under the lock: drop the pins of threads that have exited; returns whether there were any."""
        alive = {thread.ident for thread in threading.enumerate()}
        dead = [ident for ident in self._step_pins if ident not in alive]
        for ident in dead:
            self._unpin(self._step_pins.pop(ident))
        return bool(dead)

    def _prefetch_job(self, keys: list[Key], serial: int) -> None:
        with self._lock:
            if self._layer_fetches[keys[0][0]] != serial:  # its layer was fetched while it queued
                self._counts["prefetch_stale"] += len(keys)
                return
        with contextlib.suppress(OSError):  # a hint only: the demand fetch reads again and reports it
            self._ensure(self._compute, keys, demand=False, keep=False)

    def _ensure(self, tier: _Tier, keys: list[Key], demand: bool, keep: bool) -> dict[Key, torch.Tensor]:
        """Make `keys` resident in `tier`; return their buffers when `keep`. A prefetch skips what does
        not fit. A demand load may evict anything but the current steps; a prefetch keeps its own keys.
        A demand that waited for a prefetch which failed reads that key itself.
        """
        if demand:
            with self._lock:
                for key in keys:
                    self._count_lookup(tier, key)
        found: dict[Key, torch.Tensor] = {}
        while keys:
            with self._lock:
                resident, waits, mine = self._plan(tier, keys, demand, keep)
            found.update(resident)
            if mine:
                found.update(self._load(tier, mine, demand, keep))
            keys = []
            for key, (future, by_prefetch) in waits.items():
                try:
                    found[key] = future.result()
                except Exception:
                    if not by_prefetch:
                        raise
                    keys.append(key)
        return found

    def _count_lookup(self, tier: _Tier, key: Key) -> None:
        hit = tier.cache.lookup(key)
        tier.counts["cache_hits" if hit else "cache_misses"] += 1
        if tier is self._compute:
            self._layer_counts[key[0]]["hits" if hit else "misses"] += 1
            if key in self._prefetched and hit:
                self._prefetched.discard(key)
                self._counts["prefetch_hits"] += 1

    def _plan(
        self, tier: _Tier, keys: list[Key], demand: bool, keep: bool
    ) -> tuple[dict[Key, torch.Tensor], dict[Key, tuple[Future, bool]], list[Key]]:
        """Under the lock: (resident buffers when `keep`, {key: (load to wait for, whether a prefetch
        runs it)}, keys whose slots this call reserved and must load). A demand reserves all its misses
        or none, and waits for room holding none; a prefetch reserves what fits and never waits."""
        if demand:
            missing = self._wait_for_room(tier, keys)
            waits = {key: (tier.loading[key], key in tier.prefetching) for key in keys if key in tier.loading}
            for key in missing:
                self._reserve(tier, key, self._pins)
            for key, (_, by_prefetch) in waits.items():
                if by_prefetch:
                    tier.demanded.add(key)
                    self._counts["prefetch_waits"] += tier is self._compute
        else:
            waits = {}
            missing = self._reserve_what_fits(tier, self._missing(tier, keys), set(self._pins) | set(keys))
        resident = {key: tier.buffers[key] for key in keys if key in tier.buffers} if keep else {}
        return resident, waits, missing

    @staticmethod
    def _missing(tier: _Tier, keys: list[Key]) -> list[Key]:
        return [key for key in keys if key not in tier.buffers and key not in tier.loading]

    def _wait_for_room(self, tier: _Tier, keys: list[Key]) -> list[Key]:
        """Under the lock: wait, holding no reservation, until the missing `keys` fit; return them.
        Only a running load frees a slot (the reservations are all taken by running loads), so with
        none running and no dead thread's pins to drop, waiting would be forever: raise instead."""
        while not tier.room_for(len(missing := self._missing(tier, keys)), self._pins):
            if tier.cache.loading:
                self._counts["slot_waits"] += 1
                self._slot_freed.wait()
            elif not self._unpin_dead_threads():
                raise WorkingSetTooLarge(
                    f"expert store {tier.name} tier ({tier.cache.capacity} slots) cannot hold the pinned "
                    f"working set ({len(self._pins)} experts pinned)"
                )
        return missing

    def _reserve_what_fits(self, tier: _Tier, keys: list[Key], pinned: set[Key]) -> list[Key]:
        """Under the lock: reserve slots for the keys of a prefetch that fit within the tier's share
        for speculation; skip the rest."""
        reserved = []
        share = max(self.top_k, int(tier.cache.capacity * SPECULATIVE_SHARE))
        for key in keys:
            if self._speculative(tier) >= share or not tier.cache.has_room_without(pinned):
                self._counts["prefetch_skipped"] += 1
                continue
            self._reserve(tier, key, pinned)
            tier.prefetching.add(key)
            reserved.append(key)
        return reserved

    def _speculative(self, tier: _Tier) -> int:
        """Under the lock: the slots of `tier` taken by prefetches no fetch has asked for yet."""
        resident = len(self._prefetched) if tier is self._compute else 0
        return resident + len(tier.prefetching - tier.demanded)

    def _reserve(self, tier: _Tier, key: Key, pinned: Collection[Key]) -> None:
        self._evict(tier, tier.cache.reserve(key, pinned))
        tier.loading[key] = Future()

    def _evict(self, tier: _Tier, keys: list[Key]) -> None:
        tier.evict(keys)
        if tier is self._compute:
            unused = self._prefetched.intersection(keys)
            self._counts["prefetch_unused_evictions"] += len(unused)
            self._prefetched.difference_update(unused)

    def _load(self, tier: _Tier, keys: list[Key], demand: bool, keep: bool) -> dict[Key, torch.Tensor]:
        """Fill the reserved slots of `keys` (outside the lock); on failure give the slots back."""
        try:
            if tier.name == "gpu":
                loaded = self._load_gpu(keys, demand)
            else:
                loaded = {key: (buffer, None) for key, buffer in self._read_objects(keys, demand).items()}
        except BaseException as exc:
            with self._lock:
                for key in keys:
                    tier.cache.cancel(key)
                    tier.settle(key)
                    tier.loading.pop(key).set_exception(exc)
                self._slot_freed.notify_all()
            raise
        with self._lock:
            installed = self._install(tier, loaded, demand, keep)
            self._slot_freed.notify_all()
        return installed

    def _install(self, tier: _Tier, loaded: dict, demand: bool, keep: bool) -> dict[Key, torch.Tensor]:
        """Under the lock: move `loaded` (emptied) into `tier`; the buffers too when `keep`.

        A prefetch keeps no reference once the lock is released, so an eviction right after frees
        the buffer at once and live expert bytes stay within the budget.
        """
        kept = {}
        while loaded:
            key = next(iter(loaded))  # in request order, as the simulator admits them
            buffer, ready = loaded.pop(key)
            unused = tier.settle(key)
            tier.install(key, buffer, ready, speculative=unused)
            tier.loading.pop(key).set_result(buffer)
            if keep:
                kept[key] = buffer
            if not demand and tier is self._compute:
                self._counts["prefetch_loads"] += 1
                if unused:
                    self._prefetched.add(key)
        return kept

    def _load_gpu(self, keys: list[Key], demand: bool) -> dict[Key, tuple[torch.Tensor, Any]]:
        if self._host is not None:
            hosts = self._ensure(self._host, keys, demand, keep=True)
            missing = [key for key in keys if key not in hosts]
            hosts.update(self._read_objects(missing, demand))
        else:
            hosts = self._read_objects(keys, demand)
        loaded = {}
        for key in keys:
            buffer, ready = self._uploader.upload(hosts[key])
            loaded[key] = (buffer, ready)
            with self._lock:
                self._tiers[0].counts["h2d_bytes"] += buffer.numel()
        return loaded

    def _read_objects(self, keys: list[Key], demand: bool) -> dict[Key, torch.Tensor]:
        """Read whole objects from the pack into fresh host buffers (prefetches on the background pool).

        The reads are queued in pack order, so the disk sees a step's reads as one forward sweep; the
        buffers keep the requested order (the order the tiers admit them, which the policies see)."""
        buffers, requests = {}, []
        for key in keys:
            offset, nbytes = self.pack.object_range(*key)
            array = np.empty(nbytes, dtype=np.uint8)
            self._track(array)
            buffers[key] = torch.from_numpy(array)
            requests.append(ReadRequest(f"layer {key[0]} expert {key[1]}", offset, nbytes, array))
        if requests:
            self._file.read(sorted(requests, key=lambda request: request.offset), background=not demand)
            self._check_integrity(buffers)
        return buffers

    def _check_integrity(self, buffers: dict[Key, torch.Tensor]) -> None:
        """Hash each object just read against the manifest's digest; a mismatch is counted and raised
        (ChecksumMismatch, an OSError), so its slot is given back and it is never cached."""
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
                    self._counts["integrity_errors"] += 1
        with self._lock:
            self._counts["integrity_check_ns"] += time.perf_counter_ns() - started
        if failure is not None:
            raise failure

    def _track(self, array: np.ndarray) -> None:
        """Remember every host buffer weakly, so tests can sum the bytes still alive."""
        ident = id(array)
        with self._lock:
            self._live[ident] = weakref.ref(array, lambda _ref, ident=ident: self._live.pop(ident, None))

    def _weights(self, key: Key, buffer: torch.Tensor) -> Any:
        from k3stream.model.experts import ExpertMatrix, ExpertWeights

        if self._uploader is not None:
            self._uploader.hand_out(buffer, self._compute.ready[key])
        return ExpertWeights(
            **{
                role: ExpertMatrix(buffer[offset : offset + nbytes], ggml_type, shape)
                for role, offset, nbytes, ggml_type, shape in self._role_parts(key[0])
            }
        )

    def _role_parts(self, layer: int) -> list[tuple[str, int, int, int, tuple[int, int]]]:
        """Each role's (name, offset in the object, bytes, GGML type, shape) for `layer`'s experts: the
        same for every expert of a layer, so worked out once (a fetch hands out views many times)."""
        parts = self._parts_by_layer.get(layer)
        if parts is None:
            start = self.pack.object_range(layer, 0)[0]
            parts = [
                (
                    role,
                    part.offset - start,
                    part.nbytes,
                    int(part.ggml_type),
                    tuple(int(n) for n in part.shape),
                )
                for role, part in self.pack.role_slices(layer, 0).items()
            ]
            self._parts_by_layer[layer] = parts
        return parts

    # ---- accounting -----------------------------------------------------------------------------

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of expert objects each tier holds, loads in progress excluded."""
        with self._lock:
            return {
                tier.name: sum(buffer.numel() for buffer in tier.buffers.values()) for tier in self._tiers
            }

    def live_host_bytes(self) -> int:
        """Bytes of every host expert buffer still alive anywhere (the tiers, a caller's views)."""
        with self._lock:
            arrays = [ref() for ref in list(self._live.values())]
        return sum(array.nbytes for array in arrays if array is not None)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            disk = self._file.snapshot()
            tokens = self._counts["tokens"]
            layers = {
                str(layer): {**counts, "hit_rate": counts["hits"] / max(counts["hits"] + counts["misses"], 1)}
                for layer, counts in sorted(self._layer_counts.items())
            }
            return {
                "pack_path": str(self.pack.path),
                "device": str(self.device),
                "object_bytes": self.slot_bytes,
                **disk,
                "tiers": {tier.name: tier.snapshot() for tier in self._tiers},
                "layers": layers,
                **{name: int(value) for name, value in self._counts.items()},
                "prefetch": self._prefetcher is not None,
                "integrity_checks": self.integrity_checked,
                "prefetch_adaptive": self._adaptive,
                "prefetch_layers": {
                    str(layer): {"precision": precision, "active": self._issues_prefetch(layer)}
                    for layer, precision in sorted(self._hints.precision.items())
                },
                "bytes_per_token": disk["pack_read_bytes"] / tokens if tokens else 0.0,
            }

    def stats_json(self) -> str:
        return json.dumps(self.stats(), indent=2, sort_keys=True)

    def close(self) -> None:
        """Stop: later fetches raise, later prefetches are ignored; waits for the reads in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._release()

    def _release(self) -> None:
        """Shut down whatever the constructor opened (the prefetch thread first: it reads the pack)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        if self._file is not None:
            self._file.close()
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
