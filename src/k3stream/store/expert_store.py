"""The expert store: an `ExpertSource` over an expert pack, through a GPU tier, a RAM tier and the disk.

The compute tier (GPU when the device is CUDA, else RAM) holds whole expert objects, each one uint8
buffer, and hands out zero-copy views per role. The store orchestrates one module per job: `tiers`
(one object per tier, in a chain: a miss in a tier loads from the tier below it, a miss in the last
reads the pack), `loading` (the load protocol: reservations, futures, waits for room), `reader` (pack
reads, digest checks), `pins` (each thread's step), `hints` (which prefetch hints to load) and
`liveness` (the record behind `live_host_bytes`).

The experts of each thread's current step (its latest `fetch`, until its next one, `release()`, or its
exit) and of running loads are never evicted. `prefetch` loads in the background; a `fetch` that finds
its expert still loading waits for that load instead of reading again. A prefetched expert that a
fetch asked for before it was evicted is a used prefetch, cached like a demand load.

After `close()`, `fetch` raises RuntimeError("expert store is closed") and `prefetch` is ignored: it is
a hint, and an engine may still hint while it shuts down.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3stream.experts import ExpertMatrix, ExpertWeights, ObjectRole
from k3stream.store.hints import HintScores
from k3stream.store.liveness import LiveBuffers
from k3stream.store.loading import Load, Loader
from k3stream.store.pack_io import PackFile
from k3stream.store.pins import StepPins
from k3stream.store.reader import ObjectReader, ObjectReads, RecycledBuffers
from k3stream.store.tiers import MIB, Key, make_tiers
from k3stream.store.traces import TraceWriter

# the counters of `stats()`, in their order there
COUNTERS = (
    "fetches",
    "fetch_ns",
    "tokens",
    "slot_waits",
    "prefetch_requests",
    "read_ahead",
    "prefetch_loads",
    "prefetch_hits",
    "prefetch_unused_evictions",
    "prefetch_skipped",
    "prefetch_stale",
    "prefetch_suppressed",
    "prefetch_too_large",
    "prefetch_waits",
    "integrity_errors",
    "integrity_check_ns",
    "integrity_cpu_ns",
    "read_ahead_calls",
    "buffers_made",
    "buffers_reused",
    "buffers_prefaulted",
)


def _direct_io(requested: bool | None, ram_mib: float, served_bytes: int, ranks: int) -> tuple[bool, str]:
    """Whether to read the pack with O_DIRECT, and the note when not. None (auto): when the experts
    the store serves (`served_bytes`: the pack, or an expert-parallel rank's share of it) do not fit
    the RAM budget, so their pages would only crowd the page cache and the memory limit (measured
    under a memory cgroup: the limit hit 50x less often, prefill and decode faster)."""
    if requested is not None:
        return requested, "not requested"
    if served_bytes > ram_mib * MIB:
        return True, ""
    served = "the whole pack" if ranks == 1 else f"this rank's share of the pack (1/{ranks})"
    return False, f"off (auto): {served} fits the RAM budget"


def _open_pack(pack: Any) -> Any:
    if isinstance(pack, (str, os.PathLike)):
        from k3stream.pack.reader import ExpertPack

        return ExpertPack(Path(pack))
    return pack


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
        direct_io: bool | None = None,
        record_trace: str | os.PathLike[str] | None = None,
        read_splits: int = 4,
        simulated_read_latency_us: float = 0.0,
        expert_ranks: int = 1,
    ) -> None:
        self.pack = _open_pack(pack)
        self._parts_by_layer: dict[int, list[tuple[str, int, int, int, tuple[int, int]]]] = {}
        self.device = torch.device(device)
        self.top_k = int(self.pack.top_k)
        self.num_experts = int(self.pack.num_experts)
        self.moe_layers = frozenset(int(layer) for layer in self.pack.moe_layers)
        served = len(self.moe_layers) * self.num_experts // expert_ranks  # objects of this rank's share
        self.prefetches = self.reads_ahead = prefetch  # hints and read-ahead load only with a prefetch thread
        self.slot_bytes = max(self.pack.object_range(layer, 0)[1] for layer in self.moe_layers)
        layers = sorted(self.moe_layers)
        self._tiers = make_tiers(self.device, ram_mib, gpu_mib, self.slot_bytes, self.top_k, policy, layers)
        self._compute = self._tiers[0]
        self._lock = threading.RLock()
        self._slot_freed = threading.Condition(self._lock)
        self._closed = False
        self._pins = StepPins(self._slot_freed)
        self._hints = HintScores(layers, adaptive=prefetch and adaptive_prefetch, prior=self.top_k)
        self._live = LiveBuffers()
        self._counts = Counter(
            fetches=0,
            fetch_ns=0,
            tokens=0,
            prefetch_requests=0,
            prefetch_too_large=0,
            read_ahead=0,
            read_ahead_calls=0,
        )
        self._file: PackFile | None = None
        self._prefetcher: ThreadPoolExecutor | None = None  # hints
        self._reader_ahead: ThreadPoolExecutor | None = None  # read-ahead, never queued behind a hint
        self._trace: TraceWriter | None = None
        self._prefaulter: threading.Thread | None = None
        self._prefault_stop = threading.Event()
        try:
            direct = _direct_io(direct_io, ram_mib, served * self.slot_bytes, expert_ranks)
            self._open(io_threads, read_splits, direct, simulated_read_latency_us, prefetch, record_trace)
        except BaseException:
            self._release()
            raise
        buffers = RecycledBuffers(self.slot_bytes, keep=self._compute.cache.capacity)
        if self._compute.name == "ram":
            self._start_prefault(buffers, served)
        self._reader = ObjectReader(self.pack, self._file, self._live, self._lock, buffers)
        self.integrity_checked = self._reader.integrity_checked
        self._loader = Loader(self._reader, self._pins, self._lock, self._slot_freed, self.top_k)

    def _open(
        self,
        io_threads: int,
        read_splits: int,
        direct_io: tuple[bool, str],
        simulated_read_latency_us: float,
        prefetch: bool,
        record_trace: str | os.PathLike[str] | None,
    ) -> None:
        """Open the pack, the prefetch thread and the trace (the constructor undoes them with
        `_release` if any step fails)."""
        self._file = PackFile(
            self.pack.path,
            io_threads=io_threads,
            read_splits=read_splits,
            direct_io=direct_io[0],
            off_note=direct_io[1],
            simulated_read_latency_us=simulated_read_latency_us,
        )
        if prefetch:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="k3stream-prefetch")
            self._reader_ahead = ThreadPoolExecutor(1, thread_name_prefix="k3stream-read-ahead")
            for pool in (self._prefetcher, self._reader_ahead):
                pool.submit(int)  # its thread starts here, not inside the first request's step
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

    def _start_prefault(self, buffers: RecycledBuffers, objects: int) -> None:
        """Make the RAM tier's read buffers (one a slot, no more than the pack has objects), their
        pages faulted in, in a background thread while the model's weights load from disk, whose
        reads leave the CPU idle; the loader then waits for the rest (`wait_for_buffers`). A store
        that serves before they are all made (one used without the loader) goes on making them at the
        lowest priority (nice 19), on the CPU time the compute and the reads leave. The first reads
        into them (a cold prefill) fault nothing: a fresh buffer costs a fault and a zeroed page per
        4 KiB on the read's first write (`docs/real-model.md`, Read buffers).
        The process holds the tier's budget from the load on, as it would once that many experts
        were read."""

        def prefault() -> None:
            lowered = False
            while not self._prefault_stop.is_set() and buffers.prefault_one(objects):
                if not lowered and self._serving():
                    lowered = True
                    with contextlib.suppress(AttributeError, OSError):  # Linux: one thread's nice
                        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)

        self._prefaulter = threading.Thread(target=prefault, name="k3stream-prefault", daemon=True)
        self._prefaulter.start()

    def wait_for_buffers(self) -> None:
        """Return once the RAM tier's read buffers are made (`_start_prefault`; at once without that
        tier). The loader calls it after the model's weights: no read buffer is then made beside the
        first reads (a cold prefill), whatever the budget, so a larger budget's cold prefill does not
        fault more pages than a smaller one's (`docs/real-model.md`)."""
        if self._prefaulter is not None:
            self._prefaulter.join()

    def _serving(self) -> bool:
        """Whether the store was asked for experts yet (a fetch, a hint or a read-ahead)."""
        counts = self._counts
        return bool(counts["fetches"] or counts["prefetch_requests"] or counts["read_ahead"])

    @property
    def max_experts_per_fetch(self) -> int:
        """The most distinct experts one `fetch` may ask for: the compute tier's slot count."""
        return self._compute.cache.capacity

    # ---- ExpertSource ---------------------------------------------------------------------------

    def fetch(self, layer: int, expert_ids: Iterable[int]) -> dict[int, ExpertWeights]:
        """The weights of each requested expert of `layer`, as views of resident objects."""
        started = time.perf_counter_ns()
        keys = self._step_keys(layer, expert_ids)
        with self._lock:
            self._begin_step(layer, keys)
        buffers = self._loader.ensure(self._compute, keys, Load.DEMAND, keep=True)
        weights = {key[1]: self._weights(key, buffers[key]) for key in keys}
        with self._lock:
            self._end_step(keys, started)
        return weights

    def hold(self, layer: int, expert_ids: Iterable[int], objects: np.ndarray) -> bool:
        """`fetch` without views where all of `expert_ids` sit in a host compute tier: their objects'
        addresses into `objects` (see `ExpertSource.hold`); else False, nothing done."""
        started = time.perf_counter_ns()
        keys = self._step_keys(layer, expert_ids)
        with self._lock:
            compute = self._compute
            buffers = compute.buffers
            if compute.uploader is not None or not all(key in buffers for key in keys):
                return False
            self._begin_step(layer, keys)
            compute.lookup_resident(keys)
            addresses = compute.addresses
            objects[:] = [addresses[key] for key in keys]
            self._end_step(keys, started)
        return True

    def object_roles(self, layer: int) -> dict[str, ObjectRole]:
        """Where each role's matrix lies in an object of `layer` (for `hold`)."""
        return {
            role: ObjectRole(offset, ggml_type, shape)
            for role, offset, _, ggml_type, shape in self._role_parts(layer)
        }

    def _step_keys(self, layer: int, expert_ids: Iterable[int]) -> list[Key]:
        """The keys of a fetch, at most the compute tier's slots."""
        keys = self._keys(layer, expert_ids)
        if len(keys) > self.max_experts_per_fetch:
            raise ValueError(
                f"expert store fetch of {len(keys)} experts for layer {layer} exceeds the "
                f"{self._compute.name} tier's {self.max_experts_per_fetch} slots; "
                "fetch at most max_experts_per_fetch at a time"
            )
        return keys

    def _begin_step(self, layer: int, keys: list[Key]) -> None:
        """Under the lock: a fetch of `keys` of `layer` starts (pinned as the thread's step, told to the
        hints and the trace)."""
        if self._closed:
            raise RuntimeError("expert store is closed")
        experts = [expert for _, expert in keys]
        self._pins.pin_step(keys)
        self._hints.fetched(layer, experts)
        if self._trace is not None:
            self._trace.step(layer, experts)

    def _end_step(self, keys: list[Key], started: int) -> None:
        """Under the lock: a fetch of `keys` that began at `started` (ns) is over."""
        self._compute.fetched(keys)
        self._counts["fetches"] += 1
        self._counts["fetch_ns"] += time.perf_counter_ns() - started

    def prefetch(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Start loading these experts in the background; never blocks, never evicts pinned experts.
        Adaptive: only while the layer's hints have been precise enough, and no more of the experts
        it would read than its hints earned (`HintScores.allowance`, the first in `expert_ids`' order);
        beyond the hints' share of the tier, not those (`prefetch_too_large`); a hint naming more absent
        experts than that share, or following a hint of its layer for the same step that may evict,
        reads into free slots only; one for a layer whose step comes after such a large one's reads
        nothing and is not scored. Ignored after `close()`."""
        if self._prefetcher is None:
            return
        keys = self._keys(layer, expert_ids)
        if not keys:
            return
        with self._lock:  # close() shuts the prefetcher down only after it set _closed under this lock
            if self._closed:
                return
            self._counts["prefetch_requests"] += len(keys)
            absent = [expert for _, expert in self._compute.missing(keys)]
            follows = self._hints.follows(layer)
            # a hint naming more absent experts than the hints' share of the tier predicts a step that
            # sweeps the tier (a prefill's hint of most of a layer), however few of them its allowance
            # reads and whether its layer's hints are issued or not: the likeliest up to the share are
            # read, into free slots only (in a cold tier the reads start before the layer's router
            # runs; a warm one keeps what it holds for the step), the rest are dropped; a hint that
            # follows one for the same step that may evict (a prefill's pre-attention hint after its
            # layer-ahead one) fills free slots only too; a hint for a layer whose step comes after a
            # sweeping step (a prefill's hints for its last layer before the first layer's step) reads
            # nothing: that step would evict what it read, unused, into the slots it takes; nor is it
            # scored (whatever its record it reads nothing, and the record decides the reads of the
            # layer's other hints: a prefill's last layer-ahead hint, right ~37% of the time on the
            # slice, switched off the layer's pre-attention hints, right ~87%); the hint after one
            # that filled free slots only, or after another layer's step, is the first for its step
            # that may evict (a prefill's last layer, at its start: the sweep is over)
            share = self._loader.speculative_share(self._compute)
            sweeps = len(absent) > share
            if sweeps:
                self._hints.sweeps(layer)
            behind = self._hints.behind_sweep(layer)
            loaded = [] if behind else self._hints.hinted(layer, len(keys), absent)
            if absent and not loaded and not behind:
                return
            # what the tier holds of the hint is kept for its step as its reads are (`Tier.fresh`:
            # evicted only when nothing else can go): a prefill's sweep of one layer's step would evict
            # the next layer's experts its hint named, to read them again at that layer's router
            self._compute.hold([key for key in keys if key in self._compute.buffers])
            if not absent or behind:  # every one resident or loading, or nothing to read: no job
                return
            too_large = max(0, len(loaded) - share)
            self._counts["prefetch_too_large"] += too_large
            dropped = set(absent[len(loaded) - too_large :])
            keys = sorted(key for key in keys if key[1] not in dropped)  # read in pack order
            load = Load.FILL if sweeps or follows else Load.HINT
            if load is Load.HINT:
                self._hints.evicts(layer)
            self._prefetcher.submit(self._prefetch_job, keys, self._hints.serial(layer), load)

    def read_ahead(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Start loading experts the caller is sure to fetch next (the step it is computing), each
        ready as soon as it is read: like `prefetch`, but never scored, suppressed, dropped as stale
        or held to the speculative share (it is no prediction). Their slots are reserved and their
        pack reads queued (in pack order) in the calling thread, so the disk starts on them without
        waiting for another thread to wake; the read-ahead thread installs each as it lands. They
        stay pinned for the calling thread until it fetches them or a layer other than theirs."""
        if self._reader_ahead is None:
            return
        keys = self._keys(layer, expert_ids)
        with self._lock:
            if self._closed or not keys:
                return
            self._counts["read_ahead"] += len(keys)
            self._counts["read_ahead_calls"] += 1
            self._compute.read_ahead(keys)
            self._pins.pin_ahead(keys)
            missing = self._compute.missing(keys)
            # a hint's reads of these still queued behind other reads: raised to read-ahead's
            self._reader.hurry([key for key in keys if key in self._compute.loading], int(Load.READ_AHEAD))
            if not missing:
                return
            if self._compute.below is not None:  # the reads come through the tier below
                self._reader_ahead.submit(self._read_ahead_job, missing)
                return
            started = self._loader.start(self._compute, missing, Load.READ_AHEAD)
            if started is not None:
                self._install_when_read(*started)

    def _install_when_read(self, keys: list[Key], objects: ObjectReads) -> None:
        """Under the lock: the read-ahead thread installs `keys` as their reads (queued by the caller's
        thread: the disk does not wait for that thread to wake) land, or gives their slots back if
        `close()` drops the job before it runs."""
        job = self._reader_ahead.submit(self._loader.install, self._compute, keys, objects)
        job.add_done_callback(
            lambda done: done.cancelled() and self._loader.abandon(self._compute, keys, objects)
        )

    def ready(self, layer: int, expert_ids: Iterable[int]) -> list[int]:
        """Those of `expert_ids` resident in the compute tier (a fetch of them waits for no read)."""
        with self._lock:
            return [expert for expert in expert_ids if (layer, expert) in self._compute.buffers]

    def resident(self, layer: int) -> None:
        """None: the store's experts come and go with its cache (see `ExpertSource.resident`)."""
        return None

    def release(self) -> None:
        """Unpin the experts of the calling thread's latest fetch (a thread that is done with the store)."""
        with self._lock:
            self._pins.release()

    def end_token(self, n_tokens: int = 1) -> None:
        """The engine finished a step that produced `n_tokens` tokens (for bytes per token)."""
        with self._lock:
            self._counts["tokens"] += int(n_tokens)
            self._hints.step_over()
            if self._trace is not None and not self._closed:
                self._trace.end_token(n_tokens)

    def _keys(self, layer: int, expert_ids: Iterable[int]) -> list[Key]:
        if layer not in self.moe_layers:
            raise ValueError(f"layer {layer} is not a routed MoE layer of {self.pack.path}")
        experts = list(dict.fromkeys(map(int, expert_ids)))
        bad = [expert for expert in experts if not 0 <= expert < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} out of range 0..{self.num_experts - 1} for layer {layer}")
        return [(layer, expert) for expert in experts]

    def _prefetch_job(self, keys: list[Key], serial: int, load: Load) -> None:
        with self._lock:
            if self._hints.stale(keys[0][0], serial, len(keys)):  # its layer was fetched while it queued
                return
        with contextlib.suppress(OSError):  # a hint only: the demand fetch reads again and reports it
            self._loader.ensure(self._compute, keys, load, keep=False)

    def _read_ahead_job(self, keys: list[Key]) -> None:
        with self._lock:  # a fetch that came first has read (and maybe already dropped) the others
            keys = [key for key in keys if key in self._compute.ahead]
        if not keys:
            return
        with contextlib.suppress(OSError):  # the fetch that follows reads again and reports it
            self._loader.ensure(self._compute, keys, Load.READ_AHEAD, keep=False)

    # ---- handing out ----------------------------------------------------------------------------

    def _weights(self, key: Key, buffer: torch.Tensor) -> ExpertWeights:
        self._compute.hand_out(key, buffer)
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
            return {tier.name: tier.resident_bytes() for tier in self._tiers}

    def live_host_bytes(self) -> int:
        """Bytes of every host expert buffer still alive anywhere (the tiers, a caller's views)."""
        return self._live.nbytes()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            disk = self._file.snapshot()
            tokens = self._counts["tokens"]
            layers = {
                str(layer): {**counts, "hit_rate": counts["hits"] / max(counts["hits"] + counts["misses"], 1)}
                for layer, counts in sorted(self._compute.layer_counts.items())
            }
            counts = {
                **self._counts,
                **self._loader.counts,
                **self._reader.counts,
                **self._reader.buffers.counts,
                **self._compute.prefetch_counts,
                **self._hints.counts,
            }
            return {
                "pack_path": str(self.pack.path),
                "device": str(self.device),
                "object_bytes": self.slot_bytes,
                **disk,
                "tiers": {tier.name: tier.snapshot() for tier in self._tiers},
                "layers": layers,
                **{name: int(counts[name]) for name in COUNTERS},
                "prefetch": self._prefetcher is not None,
                "integrity_checks": self.integrity_checked,
                "prefetch_adaptive": self._hints.adaptive,
                "prefetch_layers": self._hints.snapshot(self._prefetcher is not None),
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
        self._reader.buffers.clear()

    def _release(self) -> None:
        """Shut down whatever the constructor opened (the prefetch threads first: they read the pack)."""
        self._prefault_stop.set()
        if self._prefaulter is not None:
            self._prefaulter.join()
        for thread in (self._prefetcher, self._reader_ahead):
            if thread is not None:
                thread.shutdown(wait=True, cancel_futures=True)
        if self._file is not None:
            self._file.close()
        if self._trace is not None:
            self._trace.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
