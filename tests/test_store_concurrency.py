"""The expert store under concurrency: slot waits, pins of exited threads, prefetches a fetch waited
for, close, and a failed constructor. Every thread is joined with a deadline, so a hang fails the test.

`PrefetchGate` holds the store's prefetch (background) pack reads until the test opens it: the only
way to make a fetch meet a prefetch still in flight without racing a timer. It wraps the pack file's
`read` (the I/O below the store), not the store.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import k3stream.store.pack_io as pack_io
from k3stream.store import ExpertStore
from k3stream.store.cache import WorkingSetTooLarge
from k3stream.store.loading import Load
from k3stream.store.pack_io import PackFile, ReadRequest, Reads
from test_store import budget, gguf_expert_bytes, packed  # noqa: F401 (packed: a fixture)

DEADLINE_S = 10.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class Background:
    """`function()` in a daemon thread; `result()` joins it within the deadline, returns or re-raises."""

    def __init__(self, function: Callable[[], Any]) -> None:
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(function,), daemon=True)
        self._thread.start()

    def _run(self, function: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = function()
        except BaseException as exc:  # re-raised in the test's thread by result()
            self._outcome["error"] = exc

    def result(self) -> Any:
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "the thread did not finish: hung"
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


class PrefetchGate:
    """Holds prefetch reads until `open()`; with `fail`, they then read past the end of the pack and
    fail as a real short read does (counted in io_errors). Demand reads pass straight through."""

    def __init__(self, store: ExpertStore, fail: bool = False) -> None:
        self.reached = threading.Event()
        self._open = threading.Event()
        start = store._file.start
        end = os.path.getsize(store._file.path)

        def gated_start(requests: list[ReadRequest], priority: int = 0, read_here: bool = False) -> Reads:
            if priority:
                self.reached.set()
                if not self._open.wait(DEADLINE_S):
                    raise TimeoutError("the test never opened the prefetch gate")
                if fail:  # fails on the first request, before yielding any
                    requests = [dataclasses.replace(request, offset=end) for request in requests]
            return start(requests, priority, read_here)

        store._file.start = gated_start

    def open(self) -> None:
        self._open.set()


def keys(layer: int, experts: list[int]) -> set[tuple[int, int]]:
    return {(layer, expert) for expert in experts}


def test_two_fetches_that_cannot_both_fit_never_wait_for_each_other(packed):  # noqa: F811
    _, pack = packed
    layer = pack.moe_layers[0]
    outcomes: dict[str, str] = {}
    done = threading.Event()

    def fetch_and_stay(name: str, experts: list[int]) -> None:
        try:
            store.fetch(layer, experts)
            outcomes[name] = "ok"
        except WorkingSetTooLarge:
            outcomes[name] = "too large"
        done.wait(DEADLINE_S)  # alive, so its pins stay

    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), policy="lru") as store:
        gate = PrefetchGate(store)
        store.prefetch(layer, [8, 9])
        assert gate.reached.wait(DEADLINE_S)
        first = Background(lambda: fetch_and_stay("first", [0, 1, 2, 3]))
        wait_until(lambda: store.stats()["slot_waits"] >= 1, "the first fetch to wait for room")
        second = Background(lambda: fetch_and_stay("second", [4, 5, 6, 7]))
        wait_until(lambda: store.stats()["slot_waits"] >= 2, "the second fetch to wait for room")
        assert store._compute.cache.loading == keys(layer, [8, 9])  # waiters hold no reservation
        gate.open()
        wait_until(lambda: len(outcomes) == 2, "both fetches to finish")
        done.set()
        first.result()
        second.result()
    # one fits once the prefetch is done; the other then finds every slot pinned and nothing loading
    assert sorted(outcomes.values()) == ["ok", "too large"]


def test_pins_of_an_exited_thread_and_released_pins_free_their_slots(packed):  # noqa: F811
    _, pack = packed
    layer = pack.moe_layers[0]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), prefetch=False) as store:
        Background(lambda: store.fetch(layer, [0, 1, 2, 3])).result()
        store.fetch(layer, [4, 5, 6, 7])  # the exited thread's experts are evictable
        assert set(store._pins) == keys(layer, [4, 5, 6, 7])
        store.release()
        assert not store._pins
        Background(lambda: store.fetch(layer, [8, 9, 10, 11])).result()  # this thread still lives
        assert store.stats()["tiers"]["ram"]["cache_evictions"] == 8


def test_a_prefetch_a_fetch_waited_for_is_cached_as_a_demand_load(packed):  # noqa: F811
    gguf_path, pack = packed
    layer = pack.moe_layers[0]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k + 1), policy="lru") as store:
        store.fetch(layer, [1, 2, 3, 4])
        gate = PrefetchGate(store)
        store.prefetch(layer, [0])
        assert gate.reached.wait(DEADLINE_S)
        waiting = Background(lambda: store.fetch(layer, [1, 2, 3, 0]))
        wait_until(lambda: store.stats()["prefetch_waits"] == 1, "the fetch to wait for the prefetch")
        gate.open()
        weights = waiting.result()
        assert weights[0].up.data.numpy().tobytes() == gguf_expert_bytes(gguf_path, layer, 0)["up"]
        # 0 was used last, so LRU evicts 4, 1, 2, 3 for the next step; an unused prefetch would go first
        store.fetch(layer, [5, 6, 7, 8])
        assert (layer, 0) in store._compute.buffers
        store.fetch(layer, [0])  # a hit, but not a second use of the same prefetch
        stats = store.stats()
    assert (stats["prefetch_loads"], stats["prefetch_waits"], stats["prefetch_hits"]) == (1, 1, 0)
    assert stats["prefetch_unused_evictions"] == 0


def test_a_fetch_waiting_for_a_failed_prefetch_reads_the_expert_itself(packed):  # noqa: F811
    gguf_path, pack = packed
    layer = pack.moe_layers[1]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), policy="lru") as store:
        gate = PrefetchGate(store, fail=True)
        store.prefetch(layer, [5])
        assert gate.reached.wait(DEADLINE_S)
        waiting = Background(lambda: store.fetch(layer, [5, 6]))
        wait_until(lambda: store.stats()["prefetch_waits"] == 1, "the fetch to wait for the prefetch")
        gate.open()
        weights = waiting.result()
        for expert in (5, 6):
            assert (
                weights[expert].down.data.numpy().tobytes()
                == gguf_expert_bytes(gguf_path, layer, expert)["down"]
            )
        stats = store.stats()
        assert not store._compute.loading and not store._compute.prefetching
    assert (stats["io_errors"], stats["pack_reads"], stats["prefetch_waits"], stats["prefetch_loads"]) == (
        1,
        2,
        1,
        0,
    )


def test_fetch_after_close_raises_and_prefetch_is_ignored(packed, monkeypatch):  # noqa: F811
    _, pack = packed
    layer = pack.moe_layers[0]
    monkeypatch.setattr(pack_io, "MIN_SPLIT_BYTES", 4096)  # split reads, as for real 12 MB objects
    assert len(pack_io.split_ranges(pack.object_bytes, 4)) == 4
    store = ExpertStore(pack, ram_mib=budget(pack, pack.top_k), read_splits=4)
    store.fetch(layer, [0])
    store.close()
    store.prefetch(layer, [1])
    with pytest.raises(RuntimeError, match="^expert store is closed$"):
        Background(lambda: store.fetch(layer, [2])).result()
    store.close()
    assert store.stats()["prefetch_requests"] == 0
    reader = PackFile(pack.path, read_splits=4)
    reader.close()
    request = ReadRequest("layer 1 expert 0", 0, 4 * 4096, np.empty(4 * 4096, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=rf"^expert-pack file {pack.path} is closed$"):
        Background(lambda: reader.read([request])).result()


def test_close_while_fetching_ends_every_fetch(packed, monkeypatch):  # noqa: F811
    """A fetch racing close() returns its experts or raises that the store is closed; none hangs."""
    _, pack = packed
    monkeypatch.setattr(pack_io, "MIN_SPLIT_BYTES", 4096)
    store = ExpertStore(pack, ram_mib=budget(pack, pack.top_k), read_splits=4)

    def fetch_until_closed() -> int:
        for count in range(10_000):
            try:
                store.fetch(
                    pack.moe_layers[count % 2], [count % pack.num_experts, (count + 5) % pack.num_experts]
                )
            except RuntimeError as exc:
                assert "closed" in str(exc)
                return count
        raise AssertionError("the store never closed")

    fetchers = [Background(fetch_until_closed) for _ in range(2)]
    wait_until(lambda: store.stats()["fetches"] >= 10, "some fetches")
    store.close()
    assert sum(fetcher.result() for fetcher in fetchers) >= 10  # each returned, none hung


def test_a_failed_constructor_leaves_no_thread_or_file_open(packed, tmp_path):  # noqa: F811
    _, pack = packed
    threads, fds = set(threading.enumerate()), set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(FileNotFoundError, match="missing"):
            ExpertStore(pack, ram_mib=budget(pack, pack.top_k), record_trace=tmp_path / "missing" / "t.jsonl")
    assert set(threading.enumerate()) <= threads
    assert set(os.listdir("/proc/self/fd")) <= fds


def test_a_queued_call_raised_by_hurry_runs_before_those_it_overtakes_and_runs_once():
    pool = pack_io.PriorityPool(1, "k3stream-test-pool")
    gate, ran = threading.Event(), []
    try:
        pool.submit(0, gate.wait)  # holds the only worker
        jobs = [pool.submit(2, ran.append, name, tag=name) for name in ("a", "b", "c")]
        assert pool.hurry("c", 1) == 1
        assert pool.hurry("c", 1) == 0 and pool.hurry("a", 3) == 0  # already there; never lowered
        gate.set()
        for job in jobs:
            job.result(timeout=DEADLINE_S)
    finally:
        gate.set()
        pool.shutdown()
    assert ran == ["c", "a", "b"]


@pytest.mark.parametrize(("priority", "landed_first"), [(2, True), (0, False)])
def test_prefetch_reads_are_handed_over_as_they_land_and_demand_reads_in_order(
    packed,  # noqa: F811
    priority,
    landed_first,
):
    """A read that `hurry` raised past the one queued before it: a prefetch's (priority > 0) is handed
    over first, as it landed; a demand read (priority 0) keeps its order (what its fetch admits)."""
    _, pack = packed
    layer = pack.moe_layers[0]
    requests = []
    for expert in (0, 1):
        offset, nbytes = pack.object_range(layer, expert)
        requests.append(ReadRequest(f"expert {expert}", offset, nbytes, np.empty(nbytes, dtype=np.uint8)))
    file = PackFile(pack.path, io_threads=1, read_splits=1)
    gate = threading.Event()
    try:
        file._pool.submit(-1, gate.wait)  # holds the only reader until both reads are queued
        handed = Background(lambda: [request.label for request in file.read_each(requests, priority)])
        wait_until(lambda: len(file._pool._tagged) == 2, "both reads queued")
        assert file.hurry([requests[1].offset], priority - 1) == 1
        gate.set()
        order = handed.result()
    finally:
        gate.set()
        file.close()
    assert order == (["expert 1", "expert 0"] if landed_first else ["expert 0", "expert 1"])
    for request in requests:
        assert request.dest.tobytes() == pack.read_object(layer, int(request.label.split()[1])).tobytes()


def test_a_hinted_expert_whose_read_is_still_queued_is_raised_when_a_step_asks_for_it(packed):  # noqa: F811
    """The step reading ahead (then fetching) an expert a hint queued raises that read to its own
    priority (read-ahead, then demand), ahead of the reads queued before it; the others keep theirs."""
    from k3stream.store.loading import Load

    _, pack = packed
    layer = pack.moe_layers[0]
    store = ExpertStore(pack, ram_mib=budget(pack, 4 * pack.top_k), io_threads=1, read_splits=1)
    tagged, gate = store._file._pool._tagged, threading.Event()
    offsets = [pack.object_range(layer, expert)[0] for expert in (0, 1, 2)]
    try:
        store._file._pool.submit(-1, gate.wait)  # holds the only reader
        store.prefetch(layer, [0, 1, 2])
        wait_until(lambda: set(offsets) <= set(tagged), "the hint's reads queued")
        store.read_ahead(layer, [1])
        fetched = Background(lambda: store.fetch(layer, [2]))
        wait_until(lambda: [was for was, _ in tagged.get(offsets[2], [])] == [Load.DEMAND], "the fetch")
        assert [[was for was, _ in tagged[offset]] for offset in offsets[:2]] == [
            [Load.HINT],
            [Load.READ_AHEAD],
        ]
        gate.set()
        assert list(fetched.result()) == [2]
    finally:
        gate.set()
        store.close()


class ReleaseHook:
    """The store's lock as the loader takes it, running `after_release()` in the releasing thread each
    time a `with` block leaves it: the moment another thread may take the lock."""

    def __init__(self, lock: Any, after_release: Callable[[], None]) -> None:
        self._lock, self._after_release = lock, after_release

    def __enter__(self) -> ReleaseHook:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._after_release()


def test_a_load_holds_no_buffer_it_installed_once_it_releases_the_lock(packed):  # noqa: F811
    """Another thread may evict an expert as soon as the load that installed it releases the store's
    lock, and read a new one into a fresh buffer; a load that still held the evicted buffer would keep its
    bytes alive beside the new ones, one object over the budget (`live_host_bytes`, as test_store's
    prefetch test saw under load). Here each prefetched expert is evicted at that moment, as a competing
    load evicts it, and its buffer must die with the eviction."""
    _, pack = packed
    layer = pack.moe_layers[0]
    with ExpertStore(pack, ram_mib=budget(pack, 2 * pack.top_k), prefetch=False) as store:
        tier = store._compute
        evicted, alive = [], []

        def evict_what_a_prefetch_installed() -> None:
            with store._lock:
                keys = sorted(tier.unused)  # resident prefetches no fetch has asked for
                refs = [weakref.ref(tier.buffers[key]) for key in keys]
                for key in keys:
                    tier.cache.remove(key)
                    tier.evict([key])
            evicted.extend(keys)
            alive.extend(key for key, ref in zip(keys, refs, strict=True) if ref() is not None)

        store._loader.lock = ReleaseHook(store._lock, evict_what_a_prefetch_installed)
        store._loader.ensure(tier, [(layer, expert) for expert in range(pack.top_k)], Load.HINT, keep=False)
    assert len(evicted) == pack.top_k
    assert not alive, f"evicted experts {alive} still alive, held by the load that installed them"


def test_read_ahead_queues_its_pack_reads_before_it_returns_while_its_thread_is_busy(packed):  # noqa: F811
    """A step's read-ahead reserves its slots and queues its pack reads in the calling thread: the disk
    starts on them with the read-ahead thread still busy (it only installs what lands)."""
    _, pack = packed
    layer = pack.moe_layers[0]
    store = ExpertStore(pack, ram_mib=budget(pack, 4 * pack.top_k))
    busy = threading.Event()
    try:
        store._reader_ahead.submit(busy.wait, DEADLINE_S)  # the read-ahead thread, taken
        store.read_ahead(layer, [1, 2])
        assert store._file._active_reads == 1 and keys(layer, [1, 2]) <= set(store._compute.loading)
        wait_until(lambda: not store._file._pool._tagged, "the readers to take every range")
        busy.set()
        wait_until(lambda: store.ready(layer, [1, 2]) == [1, 2], "the read-ahead's installs")
        assert set(store.fetch(layer, [1, 2])) == {1, 2}
        assert store.stats()["pack_reads"] == 2
    finally:
        busy.set()
        store.close()


def test_close_gives_back_the_slots_of_a_read_ahead_its_thread_never_installed(packed):  # noqa: F811
    """A read-ahead whose installs are still queued when the store closes: close waits for its reads,
    gives its slots back and returns (nothing is left loading, no read left running)."""
    _, pack = packed
    layer = pack.moe_layers[0]
    store = ExpertStore(pack, ram_mib=budget(pack, 4 * pack.top_k))
    busy = threading.Event()
    store._reader_ahead.submit(busy.wait, DEADLINE_S)
    store.read_ahead(layer, [1, 2, 3])
    closing = Background(store.close)
    wait_until(lambda: store._reader_ahead._shutdown, "close to stop the read-ahead thread")
    with store._reader_ahead._shutdown_lock:  # its queued installs are cancelled by now
        busy.set()
    closing.result()
    assert not store._compute.loading and store._file._active_reads == 0
    assert store._compute.cache.used() == 0


def test_experts_a_store_holds_stay_pinned_through_the_call_at_one_working_set(packed):  # noqa: F811
    """`hold` pins a step's experts as a fetch does: at one working set, another thread's fetch
    during the bound call that computes them (on their addresses, no views) cannot evict them, and the
    call's sum equals the one of the outputs computed on the fetched views; the holding thread's next
    fetch frees them. Without the pins the other fetch would read its experts into their buffers."""
    from k3stream.model.moe import MLP_ROLES
    from k3stream.quant.kernels import Situ, bind_experts_at, cpu, expert_mlp

    _, pack = packed
    layer, held, others = pack.moe_layers[0], [3, 7, 1, 12], [0, 2, 4, 5]
    activation, in_features = Situ(1.5, 0.25), pack.role_slices(layer, 0)["gate"].shape[1]
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((1, in_features), dtype=np.float32))
    weights = torch.from_numpy(rng.random((1, len(held)), dtype=np.float32))
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), prefetch=False) as store:
        fetched = store.fetch(layer, held)
        rows = torch.zeros(len(held), dtype=torch.int64)
        starts = torch.arange(len(held) + 1, dtype=torch.int64)
        pairs = expert_mlp(x, [fetched[e] for e in held], starts, rows, activation, match_ggml=True)
        reference = cpu.combine(pairs, weights)
        del fetched  # no view keeps the objects' buffers alive: only the pins keep them in place
        objects = np.empty(len(held), dtype=np.int64)
        assert store.hold(layer, held, objects)
        places = store.object_roles(layer)
        roles = [(places[n].offset, places[n].ggml_type, places[n].shape) for n in MLP_ROLES]
        out = torch.empty_like(reference)
        sums = (torch.empty_like(pairs), weights, out)
        function, args, kept = bind_experts_at(
            x, torch.from_numpy(objects), roles, activation, *sums, 2, match_ggml=True
        )
        evicting: list[BaseException] = []

        def fetch_others_first(*call_args: int) -> int:
            try:
                Background(lambda: store.fetch(layer, others)).result()
            except WorkingSetTooLarge as refused:
                evicting.append(refused)
            assert store.ready(layer, held) == held
            return function(*call_args)

        cpu.run_calls([(fetch_others_first, args, kept)])
        assert len(evicting) == 1
        assert torch.equal(out, reference)
        objects[0] = 0  # a step not held: the call leaves out alone
        out.fill_(7.0)
        cpu.run_calls([(function, args, kept)])
        assert torch.equal(out, torch.full_like(out, 7.0))
        store.fetch(layer, others)  # this thread's next step: the held experts are evictable
        assert store.ready(layer, held) == []
