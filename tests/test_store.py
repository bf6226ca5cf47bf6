"""The expert store over a real pack built from a tiny Kimi-K3 GGUF: bytes, budgets, pins, I/O, stats."""

from __future__ import annotations

import json
import mmap
import os
import re
import resource
import shutil
import threading

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from k3stream.pack.builder import build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.store import ExpertStore, pack_io
from k3stream.store.pack_io import PackFile, ReadRequest
from k3stream.store.simulate import simulate_policy
from k3stream.store.tiers import tier_budgets
from k3stream.store.traces import read_trace

MIB = 1 << 20
AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)


@pytest.fixture(scope="module")
def packed(tiny_model, tmp_path_factory):
    """(gguf path, ExpertPack) of a tiny audited-recipe model (Q2_K/Q3_K experts, padded objects)."""
    gguf_path = tiny_model(**AUDITED)
    out = tmp_path_factory.mktemp("pack")
    result = build_pack(gguf_path, out / "tiny.pack", out / "tiny.manifest.json")
    return gguf_path, ExpertPack(result.manifest)


def budget(pack: ExpertPack, objects: float) -> float:
    return objects * pack.object_bytes / MIB


def gguf_expert_bytes(gguf_path, layer: int, expert: int) -> dict[str, bytes]:
    """One expert's role bytes straight from the GGUF, read by the gguf package (the oracle)."""
    tensors = {t.name: t for t in GGUFReader(gguf_path).tensors}
    result = {}
    for role in ("up", "gate", "down"):
        tensor = tensors[f"blk.{layer}.ffn_{role}_exps.weight"]
        result[role] = np.asarray(tensor.data).view(np.uint8).reshape(tensor.shape[-1], -1)[expert].tobytes()
    return result


def random_route(rng: np.random.Generator, pack: ExpertPack) -> list[int]:
    return [int(e) for e in rng.choice(pack.num_experts, size=pack.top_k, replace=False)]


def test_fetch_returns_the_gguf_bytes_as_views_of_one_buffer(packed):
    gguf_path, pack = packed
    layer = pack.moe_layers[-1]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), prefetch=False) as store:
        weights = store.fetch(layer, [3, 0, 3, 7])
        assert sorted(weights) == [0, 3, 7]
        for expert in (0, 3, 7):
            expected = gguf_expert_bytes(gguf_path, layer, expert)
            matrices = weights[expert]
            for role in ("up", "gate", "down"):
                matrix = getattr(matrices, role)
                assert matrix.data.numpy().tobytes() == expected[role]
                assert matrix.ggml_type == {"up": 10, "gate": 10, "down": 11}[role]
                assert matrix.shape == (256, 256)
            base = matrices.up.data.untyped_storage().data_ptr()
            assert matrices.down.data.untyped_storage().data_ptr() == base  # one object buffer, zero copy


def test_budget_below_one_working_set_is_refused(packed):
    _, pack = packed
    too_small = budget(pack, pack.top_k - 0.5)
    with pytest.raises(ValueError) as error:
        ExpertStore(pack, ram_mib=too_small)
    message = str(error.value)
    assert "ram budget" in message and f"{too_small:g} MiB" in message
    assert f"{pack.top_k} x {pack.object_bytes} bytes" in message and "\n" not in message


def test_a_gpu_budget_of_0_is_no_gpu_tier_off_cuda_and_refused_on_cuda(packed):
    """`gpu_mib=0` is a budget, not "the default": off CUDA it is no GPU tier; on CUDA the GPU tier is
    where experts compute, so 0 is refused as any budget below one top-k working set (it meant the 18 GiB
    default). `tier_budgets` touches no device, so a CUDA device description runs here."""
    _, pack = packed
    slot, top_k = pack.object_bytes, pack.top_k
    ram = budget(pack, top_k)
    cuda = torch.device("cuda:0")
    assert tier_budgets(torch.device("cpu"), ram, 0, slot, top_k) == {"ram": ram}
    assert tier_budgets(cuda, ram, budget(pack, top_k + 1), slot, top_k) == {
        "gpu": budget(pack, top_k + 1),
        "ram": ram,
    }
    assert tier_budgets(cuda, 0, budget(pack, top_k), slot, top_k) == {"gpu": budget(pack, top_k)}
    with pytest.raises(
        ValueError, match=rf"gpu budget 0 MiB is below one top-k working set .*{top_k} x {slot}"
    ):
        tier_budgets(cuda, ram, 0, slot, top_k)
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        tier_budgets(torch.device("cpu"), ram, budget(pack, top_k), slot, top_k)


@pytest.mark.parametrize(
    ("ram_mib", "slot", "top_k"), [(0.02, 12288, 2), (0.3, 208896, 2), (0.2, 47104, 5), (1.37, 94208, 16)]
)
def test_a_budget_below_one_working_set_is_refused_in_the_users_number(ram_mib, slot, top_k):
    """The refusal names the budget as given (`--ram-mib 0.02`), not the bytes it floors to (0.0199995)."""
    with pytest.raises(ValueError) as refused:
        tier_budgets(torch.device("cpu"), ram_mib, None, slot, top_k)
    assert str(refused.value).startswith(
        f"expert store ram budget {ram_mib} MiB is below one top-k working set"
    )
    assert str(refused.value).endswith(f"({top_k} x {slot} bytes): --ram-mib takes that or more")


@pytest.mark.parametrize(("slot", "top_k"), [(57856, 4), (77312, 16), (208896, 2), (47104, 5), (1 << 20, 8)])
def test_the_working_set_a_refusal_names_is_a_budget_that_is_taken(slot, top_k):
    """`--ram-mib` given the working set the refusal names (copied from the error) is taken: the number
    is rounded up, never to one whose bytes floor below the working set (0.220703 for 4 x 57856)."""
    with pytest.raises(ValueError) as refused:
        tier_budgets(torch.device("cpu"), 0.01, None, slot, top_k)
    named = float(re.search(r"working set of ([\d.]+) MiB", str(refused.value)).group(1))
    assert tier_budgets(torch.device("cpu"), named, None, slot, top_k) == {"ram": named}
    assert named - top_k * slot / MIB < 1e-6


@pytest.mark.parametrize("policy", ["lfu-lru", "lru", "arc", "cycle"])
def test_budget_holds_and_current_step_stays_resident_under_prefetch(packed, policy):
    _, pack = packed
    rng = np.random.default_rng(5)
    limit = int(budget(pack, pack.top_k + 2) * MIB)
    with ExpertStore(  # random hints: adaptive prefetch would soon stop loading them
        pack, ram_mib=limit / MIB, policy=policy, prefetch=True, adaptive_prefetch=False, io_threads=3
    ) as store:
        for _ in range(40):
            for index, layer in enumerate(pack.moe_layers):
                ids = random_route(rng, pack)
                weights = store.fetch(layer, ids)
                following = pack.moe_layers[(index + 1) % len(pack.moe_layers)]
                store.prefetch(following, random_route(rng, pack))
                resident = store._compute.buffers  # the current step must survive the prefetch
                assert all((layer, expert) in resident for expert in ids)
                assert store.resident_bytes()["ram"] <= limit
                del weights
                assert store.live_host_bytes() <= limit
            store.end_token(1)
        stats = store.stats()
    assert stats["tiers"]["ram"]["resident_bytes"] <= limit
    assert stats["prefetch_loads"] > 0 and stats["tokens"] == 40


def test_reads_reuse_the_buffers_of_evicted_experts_and_serve_the_gguf_bytes(packed):
    """Streaming through a cache of a few working sets: after the cache first fills, each read lands in
    the buffer of an expert it evicted (no fresh pages to fault in and zero), never in one a caller
    still holds, and every fetch still returns the GGUF's bytes."""
    gguf_path, pack = packed
    rng = np.random.default_rng(11)
    slots = 2 * pack.top_k
    layer = pack.moe_layers[0]
    with ExpertStore(pack, ram_mib=budget(pack, slots), prefetch=False, direct_io=True) as store:
        held = store.fetch(layer, random_route(rng, pack))  # a caller keeps this step's views
        kept = {expert: bytes(weights.gate.data.numpy()) for expert, weights in held.items()}
        store.release()
        for _ in range(30):
            ids = random_route(rng, pack)
            weights = store.fetch(layer, ids)
            expert = ids[0]
            gate = gguf_expert_bytes(gguf_path, layer, expert)["gate"]
            assert weights[expert].gate.data.numpy().tobytes() == gate
            del weights
        stats = store.stats()
        assert {expert: bytes(weights.gate.data.numpy()) for expert, weights in held.items()} == kept
    assert stats["pack_reads"] > 3 * slots
    assert stats["buffers_made"] <= slots + pack.top_k  # the cache, and the step a caller still holds
    assert stats["buffers_reused"] == stats["pack_reads"] - stats["buffers_made"]


def _minor_faults(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_minflt


def test_a_budget_holding_the_pack_reads_into_buffers_faulted_in_ahead(packed):
    """A cold read of every object into a RAM tier that holds them all (a resident budget's cold
    prefill): the buffers were made, their pages faulted in, while nothing read (the model's load),
    so the reads make no buffer and fault almost none of the pages they write."""
    gguf_path, pack = packed
    objects = len(pack.moe_layers) * pack.num_experts
    pages = objects * pack.object_bytes // mmap.PAGESIZE
    with ExpertStore(pack, ram_mib=budget(pack, 2 * objects), prefetch=False, direct_io=True) as store:
        store.wait_for_buffers()
        made_ahead = store.stats()["buffers_prefaulted"]
        before = _minor_faults()
        steps = [
            (layer, range(first, min(first + pack.top_k, pack.num_experts)))
            for layer in pack.moe_layers
            for first in range(0, pack.num_experts, pack.top_k)
        ]
        held = [store.fetch(layer, experts) for layer, experts in steps]
        faults = _minor_faults() - before
        stats = store.stats()
        layer, expert = steps[-1][0], steps[-1][1][-1]
        expected = gguf_expert_bytes(gguf_path, layer, expert)["up"]
        assert held[-1][expert].up.data.numpy().tobytes() == expected
    assert faults < pages // 4, (faults, pages)
    assert stats["pack_reads"] == stats["buffers_reused"] == objects and stats["buffers_made"] == 0
    assert made_ahead == objects  # one a slot, never more than the pack's objects


def test_an_expert_parallel_rank_sizes_its_buffers_and_o_direct_by_its_share(packed):
    """Under `--ep 2` a rank serves half of each layer's experts: a budget of that half holds all it
    serves, so it reads through the page cache as one process does when its budget holds the whole
    pack, and its buffers made ahead stop at its share under a larger budget (the whole pack's size
    made a rank read with O_DIRECT and fault in buffers for experts it never serves)."""
    _, pack = packed
    share = len(pack.moe_layers) * pack.num_experts // 2
    fits = "off (auto): this rank's share of the pack (1/2) fits the RAM budget"
    with ExpertStore(pack, ram_mib=budget(pack, share), prefetch=False, expert_ranks=2) as rank:
        assert rank.stats()["direct_io_note"] == fits
    with ExpertStore(pack, ram_mib=budget(pack, share), prefetch=False) as whole:
        assert whole.stats()["direct_io"] is True or "buffered" in whole.stats()["direct_io_note"]
    with ExpertStore(pack, ram_mib=budget(pack, 4 * share), prefetch=False, expert_ranks=2) as rank:
        rank.wait_for_buffers()
        assert rank.stats()["buffers_prefaulted"] == share


@pytest.mark.parametrize("objects", [2, None])  # two working sets, the whole pack
def test_a_loaded_runtime_made_its_read_buffers_before_it_returns(packed, objects):
    """`load_runtime` returns once the store's read buffers are made (one a slot, no more than the
    pack's objects), whatever the budget: a cold prefill's reads take them. Where the budget holds the
    whole pack they make none; a smaller budget's reads may make one while an evicted object's view is
    still being computed with (its buffer comes back when that view dies)."""
    from k3stream.engine.generate import prefill_last
    from k3stream.engine.loading import load_runtime
    from k3stream.model.options import LoadOptions

    _, pack = packed
    slots = len(pack.moe_layers) * pack.num_experts if objects is None else objects * pack.top_k
    ram_mib = budget(pack, 2 * slots if objects is None else slots)
    runtime = load_runtime(pack.manifest_path, LoadOptions(expert_ram_mib=ram_mib))
    try:
        assert not runtime.store._prefaulter.is_alive()
        assert runtime.store.stats()["buffers_prefaulted"] == slots
        prefill_last(runtime.model, runtime.model.new_state(), list(range(1, 17)))
        stats = runtime.store.stats()
    finally:
        runtime.close()
    assert stats["pack_reads"] > 0 and stats["buffers_prefaulted"] == slots
    assert stats["buffers_reused"] >= min(slots, stats["pack_reads"])
    if objects is None:
        assert stats["buffers_made"] == 0


def test_buffers_made_ahead_stay_within_the_tier_slots(packed):
    """A budget of a few working sets: the buffers made ahead fill its slots, no more, and reads then
    recycle them (the process holds the tier's budget, as it would once that many experts were read)."""
    _, pack = packed
    rng = np.random.default_rng(3)
    slots = 2 * pack.top_k
    layer = pack.moe_layers[0]
    with ExpertStore(pack, ram_mib=budget(pack, slots), prefetch=False) as store:
        store.wait_for_buffers()
        assert store.stats()["buffers_prefaulted"] == slots
        for _ in range(20):
            weights = store.fetch(layer, random_route(rng, pack))
            del weights
        stats = store.stats()
    assert stats["buffers_made"] == 0 and stats["buffers_reused"] == stats["pack_reads"] > slots


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs per-thread rusage (Linux)")
def test_a_buffer_made_ahead_has_its_pages_faulted_in():
    """Writing every page of a prefaulted buffer faults nothing; of a fresh `host_buffer`, every page."""
    nbytes = 8 << 20
    pages = nbytes // mmap.PAGESIZE
    for buffer, most in (
        (pack_io.prefaulted_buffer(nbytes), pages // 16),
        (pack_io.host_buffer(nbytes, True), None),
    ):
        before = _minor_faults(resource.RUSAGE_THREAD)
        buffer[:: mmap.PAGESIZE] = 1
        faults = _minor_faults(resource.RUSAGE_THREAD) - before
        assert buffer.size == nbytes and buffer.ctypes.data % pack_io.ALIGNMENT == 0
        assert faults < most if most is not None else faults >= pages, faults


@pytest.mark.parametrize("policy", ["lfu-lru", "cycle", "arc"])
def test_store_decisions_match_the_simulator_on_its_recorded_trace(packed, tmp_path, policy):
    _, pack = packed
    rng = np.random.default_rng(11)
    trace_path = tmp_path / "trace.jsonl"
    capacity = pack.top_k + 3
    ram_mib = budget(pack, capacity)
    with ExpertStore(pack, ram_mib=ram_mib, policy=policy, prefetch=False, record_trace=trace_path) as store:
        for _ in range(25):
            for layer in pack.moe_layers:
                store.fetch(layer, random_route(rng, pack))
            store.end_token(1)
        stats = store.stats()
    trace = read_trace(trace_path)
    assert trace.tokens == 25 and len(trace.steps) == 25 * len(pack.moe_layers)
    assert trace.meta["object_bytes"] == pack.object_bytes
    simulated = simulate_policy(trace.steps, policy, capacity)
    ram = stats["tiers"]["ram"]
    assert (ram["cache_hits"], ram["cache_misses"]) == (simulated.hits, simulated.misses)
    assert stats["pack_reads"] == simulated.misses
    assert stats["pack_read_bytes"] == simulated.misses * pack.object_bytes
    assert stats["bytes_per_token"] == stats["pack_read_bytes"] / 25


def test_threads_share_one_store(packed):
    gguf_path, pack = packed
    layer = pack.moe_layers[0]
    expected = {e: gguf_expert_bytes(gguf_path, layer, e)["down"] for e in range(pack.num_experts)}
    limit = int(budget(pack, 3 * pack.top_k) * MIB)
    errors = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                ids = random_route(rng, pack)
                weights = store.fetch(layer, ids)
                store.prefetch(layer, random_route(rng, pack))
                for expert in ids:
                    assert weights[expert].down.data.numpy().tobytes() == expected[expert]
                assert store.resident_bytes()["ram"] <= limit
        except Exception as exc:  # reported below, in the main thread
            errors.append(exc)

    with ExpertStore(pack, ram_mib=limit / MIB, io_threads=4) as store:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = store.stats()
    assert not errors, errors
    ram = stats["tiers"]["ram"]
    assert ram["cache_hits"] + ram["cache_misses"] == 3 * 30 * pack.top_k


def test_direct_io_serves_the_same_bytes_or_falls_back(packed):
    gguf_path, pack = packed
    layer = pack.moe_layers[1]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), direct_io=True, read_splits=3) as store:
        weights = store.fetch(layer, [1, 2, 15])
        for expert in (1, 2, 15):
            assert (
                weights[expert].gate.data.numpy().tobytes()
                == gguf_expert_bytes(gguf_path, layer, expert)["gate"]
            )
        stats = store.stats()
    assert stats["direct_io"] is True or "buffered" in stats["direct_io_note"]
    assert stats["read_splits"] == 3 and stats["io_errors"] == 0


@pytest.mark.parametrize("splits", [1, 3])
def test_direct_reads_land_in_aligned_buffers_and_bounce_into_the_others(packed, monkeypatch, splits):
    """O_DIRECT reads straight into a `host_buffer` (aligned, rounded up), through the bounce buffer
    into any other destination; both give the object's bytes (objects here are not whole blocks)."""
    _, pack = packed
    monkeypatch.setattr(pack_io, "MIN_SPLIT_BYTES", 4096)
    offset, nbytes = pack.object_range(pack.moe_layers[0], 5)
    assert nbytes % pack_io.ALIGNMENT, "the fixture's objects should end mid-block"
    expected = bytes(pack.read_object(pack.moe_layers[0], 5))
    bounces = []
    bounce = PackFile._bounce
    monkeypatch.setattr(PackFile, "_bounce", lambda self, size: bounces.append(size) or bounce(self, size))
    file = PackFile(pack.path, read_splits=splits, direct_io=True)
    try:
        aligned = pack_io.host_buffer(nbytes, file.direct_io)
        file.read([ReadRequest("aligned", offset, nbytes, aligned)])
        assert aligned[:nbytes].tobytes() == expected
        assert not bounces  # no copy through a bounce buffer
        unaligned = np.zeros(nbytes + 1, dtype=np.uint8)[1:]
        file.read([ReadRequest("unaligned", offset, nbytes, unaligned)])
        assert unaligned.tobytes() == expected
        assert len(bounces) == (splits if file.direct_io else 0)
    finally:
        file.close()


# Linux's largest single read (INT_MAX rounded down to a page): a longer preadv returns this many bytes
MAX_READ_BYTES = 0x7FFFF000


@pytest.mark.slow  # a 2 GiB read
def test_a_short_direct_read_reads_the_rest_and_stops_at_the_end_of_the_file(packed, tmp_path):
    """An O_DIRECT read longer than Linux's largest single read comes back short at a block boundary:
    the rest is read from there, as buffered reads do. A read
    across the end of a truncated copy still fails, counting the bytes the file has."""
    _, pack = packed
    with open("/proc/meminfo") as meminfo:
        available_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable"))
    if available_kib < 6 << 20:
        pytest.skip("needs 2 GiB for the read's destination, with room to spare")
    big = tmp_path / "big.pack"
    tail = np.random.default_rng(0).integers(0, 256, 2 * pack_io.ALIGNMENT, dtype=np.uint8).tobytes()
    with open(big, "wb") as out:  # sparse: the holes read as zeros
        out.truncate(MAX_READ_BYTES)
        out.seek(MAX_READ_BYTES)
        out.write(tail)
    file = PackFile(big, read_splits=1, direct_io=True)
    try:
        if not file.direct_io:
            pytest.skip(f"no O_DIRECT here: {file.direct_io_note}")
        dest = pack_io.host_buffer(MAX_READ_BYTES + len(tail), True)
        file.read([ReadRequest("big", 0, dest.size, dest)])
        assert dest[MAX_READ_BYTES:].tobytes() == tail
        del dest
    finally:
        file.close()
    offset, nbytes = pack.object_range(pack.moe_layers[0], 5)
    cut = tmp_path / pack.path.name
    shutil.copyfile(pack.path, cut)
    assert nbytes > pack_io.ALIGNMENT
    os.truncate(cut, offset + pack_io.ALIGNMENT)  # the object's first block, then the end of the file
    file = PackFile(cut, read_splits=1, direct_io=True)
    try:
        with pytest.raises(OSError, match=f"short read: {pack_io.ALIGNMENT} of {nbytes} bytes"):
            file.read([ReadRequest("cut", offset, nbytes, pack_io.host_buffer(nbytes, True))])
    finally:
        file.close()


def _huge_page_kib(array: np.ndarray) -> int:
    """AnonHugePages of the mapping holding `array` (/proc/self/smaps)."""
    address, found = array.ctypes.data, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms ...
                start, end = (int(part, 16) for part in fields[0].split("-"))
                found = start <= address < end
            elif found and fields[0] == "AnonHugePages:":
                return int(fields[1])
    raise AssertionError("the array's mapping is not in /proc/self/smaps")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize("direct_io", [True, False])
def test_read_buffers_are_page_aligned_on_small_pages(direct_io):
    """Reads land in fresh memory: a huge page's first touch in a memory cgroup cost the cold prefill
    far more system time than small pages (docs/real-model.md), and the read writes every byte."""
    nbytes = (16 << 20) + 100
    buffer = pack_io.host_buffer(nbytes, direct_io)
    buffer[:] = 7  # every page touched
    assert buffer.ctypes.data % pack_io.ALIGNMENT == 0 and buffer.flags.writeable
    assert buffer.size == (-(-nbytes // pack_io.ALIGNMENT) * pack_io.ALIGNMENT if direct_io else nbytes)
    assert _huge_page_kib(buffer) == 0


def test_o_direct_is_the_default_exactly_when_the_pack_does_not_fit_the_ram_budget(packed):
    _, pack = packed
    every_expert = len(pack.moe_layers) * pack.num_experts
    with ExpertStore(pack, ram_mib=budget(pack, every_expert)) as roomy:
        assert roomy.stats()["direct_io_note"] == "off (auto): the whole pack fits the RAM budget"
    with ExpertStore(pack, ram_mib=budget(pack, every_expert - 1)) as tight:
        stats = tight.stats()
    assert stats["direct_io"] is True or "buffered" in stats["direct_io_note"]
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k), direct_io=False) as refused:
        assert refused.stats()["direct_io_note"] == "not requested"


def test_read_error_names_the_pack_and_expert_and_is_counted(packed, tmp_path):
    _, pack = packed
    shutil.copyfile(pack.path, tmp_path / pack.path.name)
    manifest = json.loads(pack.manifest_path.read_text())
    manifest["expert_pack"]["path"] = str(tmp_path / pack.path.name)  # the copy, not the shared pack
    (tmp_path / pack.manifest_path.name).write_text(json.dumps(manifest))
    copy = ExpertPack(tmp_path / pack.manifest_path.name)
    assert copy.path == tmp_path / pack.path.name
    with ExpertStore(copy, ram_mib=budget(pack, pack.top_k), prefetch=False) as store:
        os.truncate(copy.path, copy.object_range(pack.moe_layers[0], 0)[0])  # the disk loses the payload
        layer = pack.moe_layers[0]
        with pytest.raises(
            OSError, match=rf"expert-pack read failed for layer {layer} expert 5 in .*short read"
        ):
            store.fetch(layer, [5])
        assert store.stats()["io_errors"] == 1
        assert store.resident_bytes()["ram"] == 0
        assert store._compute.cache.used() == 0  # the reserved slot was given back


def test_stats_json_has_sglangs_counters_per_tier_and_per_layer(packed):
    _, pack = packed
    with ExpertStore(pack, ram_mib=budget(pack, 2 * pack.top_k)) as store:
        layer = pack.moe_layers[0]
        store.fetch(layer, [0, 1, 2, 3])
        store.fetch(layer, [0, 1, 2, 4])
        store.end_token(1)
        stats = json.loads(store.stats_json())
    for name in ("pack_reads", "pack_read_bytes", "pack_read_ns", "io_errors", "bytes_per_token"):
        assert name in stats
    ram = stats["tiers"]["ram"]
    for name in ("cache_hits", "cache_misses", "cache_evictions", "resident_experts", "resident_bytes"):
        assert name in ram
    assert ram["policy"] == "cycle"  # the default
    assert (ram["cache_hits"], ram["cache_misses"], stats["pack_reads"]) == (3, 5, 5)
    assert stats["layers"][str(layer)] == {"hits": 3, "misses": 5, "hit_rate": 3 / 8}
    assert stats["bytes_per_token"] == 5 * pack.object_bytes


def test_bad_requests_are_refused(packed):
    _, pack = packed
    with ExpertStore(pack, ram_mib=budget(pack, pack.top_k)) as store:
        with pytest.raises(ValueError, match="layer 0 is not a routed MoE layer"):
            store.fetch(0, [1])
        with pytest.raises(ValueError, match=r"expert ids \[16\] out of range 0\.\.15"):
            store.fetch(pack.moe_layers[0], [16])
        with pytest.raises(ValueError, match="exceeds the ram tier's 4 slots"):
            store.fetch(pack.moe_layers[0], range(5))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ExpertStore(pack, ram_mib=1, gpu_mib=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="requested but CUDA is not available"):
            ExpertStore(pack, ram_mib=1, device="cuda")
    with pytest.raises(
        ValueError, match="unknown eviction policy 'mru'; choose one of lfu-lru, lru, arc, cycle"
    ):
        ExpertStore(pack, ram_mib=1, policy="mru")
