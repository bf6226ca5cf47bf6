"""bench_real's parts: the per-kind decode profile (engine.layer_profile) and the weight bytes per kind."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

import k3stream
from k3stream.engine.layer_profile import KINDS, profile_decode
from k3stream.model.kda import KDA
from k3stream.model.moe import LatentMoE, SituMLP
from k3stream.testing.tiny import TinySpec

SPEC = TinySpec(n_layers=4, seed=2)  # layer 0 dense, MLA on layer 3, KDA elsewhere
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("use_program", [True, False], ids=["program", "eager"])
def test_the_profile_times_every_kind_and_leaves_the_model_as_it_was(tiny_model, use_program):
    model = k3stream.load(tiny_model(n_layers=4, seed=2))
    model.use_program = use_program
    originals = (KDA.decode, SituMLP.__call__, LatentMoE.__call__, model.use_program)
    state, twin = model.new_state(), model.new_state()
    for sequence in (state, twin):
        model.prefill(sequence, [1, 2, 3])
    model.use_program = False  # an eager step first: MLA's C calls are bound before the profile
    model.decode(state, 4)
    model.use_program = originals[-1]
    profile = profile_decode(model, state, [5, 6, 7])
    assert profile["path"] == ("program" if use_program else "eager")
    assert state.length == 7
    for token in (4, 5, 6, 7):  # the profiled steps computed what unprofiled ones compute
        model.decode(twin, token)
    assert torch.equal(model.decode(state, 8), model.decode(twin, 8))
    assert set(profile["ms_per_token"]) == set(KINDS)
    assert all(profile["ms_per_token"][kind] > 0 for kind in KINDS[:-1])
    assert profile["ms_per_token"]["other"] >= 0
    assert sum(profile["ms_per_token"].values()) == pytest.approx(profile["total_ms_per_token"])
    kernels = profile["kernel_ms_per_token"]  # the C mat-vec calls inside each kind's time
    assert all(0 < kernels[kind] <= profile["ms_per_token"][kind] for kind in KINDS[:-1])
    assert kernels["other"] > 0  # the output head
    assert (KDA.decode, SituMLP.__call__, LatentMoE.__call__, model.use_program) == originals


def test_the_weight_bytes_per_kind_cover_every_layer_matrix(tiny_model, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import KINDS as BENCH_KINDS
    from bench_real import bytes_per_token

    path = tiny_model(n_layers=4, seed=2)
    per_token, counts, experts = bytes_per_token(path, SPEC)
    assert counts == {
        "KDA attention": 3,
        "MLA attention": 1,
        "dense FFN": 1,
        "MoE routed": 3,
        "MoE shared": 3,
    }
    tensors = GGUFReader(path).tensors
    in_layers = sum(
        int(t.n_bytes)
        for t in tensors
        if t.name.startswith("blk.")
        and t.name.split(".")[2] not in ("attn_norm", "ffn_norm")
        and not t.name.split(".")[2].endswith("res_score")
    )
    assert experts == sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    not_read = experts * (1 - SPEC.top_k / SPEC.n_experts)  # the experts a token does not route to
    read = sum(size * counts[kind] for kind in BENCH_KINDS for size in per_token[kind].values())
    assert read == pytest.approx(in_layers - not_read)
    routed_types = {int(t.tensor_type) for t in tensors if "_exps." in t.name or "ffn_gate_inp" in t.name}
    assert routed_types <= set(per_token["MoE routed"])  # by GGML type


def test_the_compute_bound_takes_each_types_rate_on_cached_weights(tiny_model, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import compute_bound_ms, kernel_rates

    # release-like matrices: Q8_0 beside Q2_K and Q3_K experts (K-quant rows of 256 values)
    dims = dict(hidden=256, latent=256, expert_ff=256, dense_ff=256)
    path = tiny_model(n_layers=2, recipe="q8_0", release_matrices=True, **dims)
    quantized = {
        int(t.tensor_type)
        for t in GGUFReader(path).tensors
        if t.name.startswith("blk.") and int(t.tensor_type) != 0 and len(t.shape) >= 2
    }
    assert quantized == {8, 10, 11}
    for q8_activations in (True, False):
        rates = kernel_rates(path, 1, q8_activations, nbytes=64 << 10)
        assert set(rates) == quantized and all(rate > 0 for rate in rates.values())
    # F32 (type 0) has no rate: its bytes add nothing; 3 MB at 1.5 GB/s and 1 MB at 0.5 GB/s: 4 ms
    assert compute_bound_ms({0: 5e6, 8: 3e6, 12: 1e6}, {8: 1.5e9, 12: 0.5e9}) == pytest.approx(4.0)


def test_the_bound_is_the_larger_of_resident_compute_and_reads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import run_table

    row = {
        "name": "10%",
        "k3_decode": 2.0,
        "llama_decode": 1.0,
        "k3_read": 3e8,
        "llama_read": 6e8,
        "hit": 0.5,
        "recall": 0.25,
    }
    reads_bound = run_table([row], 400.0, 5e8)[-1].split(" | ")  # 600 ms of reads, 500 ms measured
    assert reads_bound[5:8] == ["2.00x", "500", "600 / 300"]
    # 450 of the 600 ms of reads were not predicted: 400 + 450 ms
    assert reads_bound[-5:] == ["600.0", "600", "1.20", "850", "1.70 |"]
    compute_bound = run_table([row], 400.0, 1e9)[-1].split(" | ")
    assert compute_bound[-5:] == ["300.0", "400", "0.80", "625", "1.25 |"]
    assert run_table([row], None, 1e9)[-1].split(" | ")[-4:] == ["n/a", "n/a", "n/a", "n/a |"]


def test_the_prefill_bound_is_the_resident_prefill_or_the_reads(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import prefill_table

    cpu = {"user": 1.5, "system": 0.25, "minor_faults": 4096}
    resident = {"name": "resident", "prompt": 16, "k3_prefill": 20.0, "cold_ms": 1000.0, "cold_cpu": cpu}
    resident.update(cold_read=1e9, prefill_read=0)  # 800 ms of compute
    resident.update(cold_buffers=({"buffers_made": 0, "buffers_prefaulted": 1}, 255), cold_wait_ms=300.0)
    streamed = {"name": "10%", "prompt": 16, "k3_prefill": 10.0, "cold_ms": 2500.0, "cold_cpu": cpu}
    streamed.update(cold_read=2e9, prefill_read=5e8)
    streamed.update(cold_buffers=({"buffers_made": 2, "buffers_prefaulted": 0}, 25), cold_wait_ms=1500.0)
    lines = prefill_table([resident, streamed], 1e9)  # reads: 1000 ms resident, 2000 / 500 ms at 10%
    assert lines[-2].split(" | ")[1:] == [
        "1000",
        "1.50 / 0.25",
        "4096",
        "255 / 1, 0",
        "300",
        "1000",
        "1000",
        "1.00",
        "800",
        "0",
        "800",
        "1.00 |",
    ]
    assert lines[-1].split(" | ")[1:] == [
        "2500",
        "1.50 / 0.25",
        "4096",
        "25 / 0, 2",
        "1500",
        "2000",
        "2000",
        "0.80",
        "1600",
        "500",
        "800",
        "0.50 |",
    ]
    assert prefill_table([streamed], 1e9)[-1].split(" | ")[7:9] == ["n/a", "n/a"]  # no resident: no bound


def _disk_read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_the_store_read_rate_reads_whole_objects_from_the_disk(tiny_model, tmp_path, monkeypatch):
    """The decode bound's disk rate: top-k objects a request, from the disk (page cache dropped)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import store_read_rate
    from k3stream.pack.builder import build_pack
    from k3stream.pack.reader import ExpertPack

    manifest = build_pack(tiny_model(n_layers=4, seed=2), tmp_path / "t.pack", tmp_path / "t.json").manifest
    with ExpertPack(manifest) as pack:
        object_bytes, requests = pack.object_bytes, 3 * pack.top_k
    before = _disk_read_bytes()
    depths: list[float] = []
    rate = store_read_rate(manifest, requests // 3, requests * object_bytes, depths=depths)
    read = _disk_read_bytes() - before
    assert rate > 0 and len(depths) == 1 and 1.0 <= depths[0] <= 4.0  # ranges in flight while busy
    blocks = -(-object_bytes // 4096) * 4096  # O_DIRECT reads whole blocks
    assert requests * object_bytes <= read <= requests * blocks + (1 << 20)  # + the pack's index pages


def test_the_ram_rate_is_each_pass_of_a_buffer_read_and_leaves_the_threads_as_they_were():
    import torch

    from k3stream.engine.layer_profile import ram_read_rates

    threads = torch.get_num_threads()
    rates = ram_read_rates(1, size=64 << 20, passes=3)
    assert len(rates) == 3
    assert all(1e8 < rate < 1e13 for rate in rates)  # between 0.1 GB/s and 10 TB/s: a read of RAM
    assert torch.get_num_threads() == threads


def test_the_per_kind_bound_takes_the_resident_runs_fastest_ram_pass(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import kind_ram_rate

    rows = [{"name": "10% of experts"}, {"name": "resident", "ram_rates": [30e9, 62e9, 35e9]}]
    assert kind_ram_rate(rows, [20e9], 2) == 62e9
    assert "fastest 62.0, median 35.0, slowest 30.0 GB/s" in capsys.readouterr().out
    assert kind_ram_rate(rows[:1], [20e9, 25e9], 2) == 25e9  # no resident profile: the start's passes


def test_the_store_read_rate_reads_a_layers_top_k_a_request_the_layers_in_turn(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import decode_reads

    steps = decode_reads([1, 2, 5], 32, 8, 7, seed=3)
    assert [step[0][0] for step in steps] == [1, 2, 5, 1, 2, 5, 1]
    assert all(len({layer for layer, _ in step}) == 1 for step in steps)  # one layer a request
    assert all(len({expert for _, expert in step}) == 8 for step in steps)  # distinct experts
    assert all(0 <= expert < 32 for step in steps for _, expert in step)
    assert len({tuple(step) for step in steps}) > 1  # drawn, not one request repeated
    assert decode_reads([1, 2, 5], 32, 8, 7, seed=3) == steps


def test_the_disk_bound_takes_the_runs_reads_while_the_disk_was_busy(monkeypatch):
    """A decode that read 300 MB in 100 ms of busy disk ran at 3 GB/s: a bound at a slower rate timed
    apart would not be one. Phases reading under 64 MiB are too coarse to rate."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import busy_rate, busy_read_rates

    decode = {"disk": {"bytes": 300_000_000, "busy_ms": 100}}
    assert busy_rate(decode) == pytest.approx(3e9)
    assert busy_rate({"disk": {"bytes": 1 << 20, "busy_ms": 1}}) is None
    assert busy_rate({"disk": {"bytes": 1 << 30, "busy_ms": 0}}) is None
    assert busy_rate({}) is None  # no block device behind the pack
    runs = [
        {"k3": {"phases": {"prefill": {"disk": {"bytes": 1e9, "busy_ms": 800}}, "decode": decode}}},
        {"k3": {"error": "exit status 1"}},
    ]
    assert busy_read_rates(runs) == pytest.approx([1.25e9, 3e9])


@pytest.mark.skipif(not Path("/sys/dev/block").is_dir(), reason="needs /sys/dev/block")
def test_the_child_counts_the_disks_reads_and_busy_time_per_phase(tiny_model, tmp_path, monkeypatch):
    """bench_beyond_ram's k3stream child: each phase's bytes the pack's block device read and the time it
    was busy, at least the bytes the store read from the pack with O_DIRECT in that phase."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_beyond_ram as beyond
    from k3stream.pack.builder import build_pack
    from k3stream.testing.cgroups import ChildCgroup

    gguf = tiny_model(n_layers=4, seed=2)
    manifest = build_pack(gguf, tmp_path / "t.pack", tmp_path / "t.json").manifest
    files = beyond.model_files(gguf, manifest)
    files[-1] = tmp_path / "t.pack"
    if beyond.device_stat(files[-1]) is None:
        pytest.skip("the test's files are on no block device")
    probe = ChildCgroup.create(f"k3stream-test-{id(object())}", 1 << 30)
    if isinstance(probe, str):
        pytest.skip(f"no writable memory cgroup: {probe}")
    probe.remove()
    run = argparse.Namespace(threads=1, decode_tokens=4, limit_bytes=1 << 30)
    run.k3stream_args = ["--ram-mib", "0.15", "--direct-io"]  # a pack over its budget: every phase reads
    result = beyond.run_k3stream(manifest, [1, 2, 3, 4, 5, 6], run, files)
    assert "error" not in result, result.get("error")
    for name in ("cold", "prefill", "decode"):
        phase = result["phases"][name]
        assert phase["disk"]["bytes"] >= phase["pack_read_bytes"] > 0
        assert phase["disk"]["busy_ms"] >= 0


def test_decode_steps_are_compared_by_their_medians(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import decode_step_lines

    rows = [
        # llama.cpp's one slow step (another job's burst) leaves its median at 100 ms
        {"name": "resident", "llama_token_s": [0.1, 0.5, 0.1], "k3_token_s": [0.09, 0.05, 0.08]},
        {"name": "10% of experts", "k3_token_s": [0.2, 0.3]},  # llama.cpp skipped
        {"name": "failed"},
    ]
    lines = decode_step_lines(rows)
    assert lines == [
        "  resident: llama.cpp 100.0 [100.0-500.0], k3stream 80.0 [50.0-90.0] ms a step of 3; "
        "k3stream/llama.cpp 1.25x",
        "  10% of experts: llama.cpp n/a, k3stream 250.0 [200.0-300.0] ms a step of 2; "
        "k3stream/llama.cpp n/a",
    ]


def test_the_read_lines_give_each_phases_depth_range_size_and_cpu_per_token(monkeypatch):
    """A streamed decode of 2 tokens over 3 MoE layers that read 8 ranges of 1 MiB, 4 in flight for 10
    ms: its line says so, per token and per MoE step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_real import read_lines

    reads = {
        "pack_ranges": 8,
        "pack_unaligned_ranges": 0,
        "pack_busy_ns": 10_000_000,
        "pack_depth_ns": 40_000_000,
        "pack_read_cpu_ns": 4_000_000,
        "integrity_cpu_ns": 6_000_000,
        "integrity_check_ns": 6_000_000,
        "read_ahead_calls": 12,
        "read_ahead": 24,
        "pack_reads": 2,
    }
    row = {"name": "10% of experts", "prompt": 16, "decode_tokens": 2, "reads": {"decode": reads}}
    row["read_bytes"] = {"decode": 8 << 20}
    (line,) = read_lines([row, {"name": "resident"}], moe_layers=3)
    assert line == (
        "  10% of experts decode: 8 ranges of 1024 KiB on average (0 off 4 KiB), depth 4.00 while busy "
        "(10 ms busy), CPU per token: readers 2.0 ms, digests 3.0 ms (3.0 ms wall); read-ahead calls "
        "per MoE step 2.0 (4.0 experts)"
    )
