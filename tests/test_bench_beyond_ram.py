"""bench_beyond_ram's pieces: the child memory cgroup (skips where none is writable), the model size, the
table. The benchmark itself takes minutes and is run by hand."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from k3stream.memlimit import MIB
from k3stream.testing.cgroups import ChildCgroup, read_process_io

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_beyond_ram.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_beyond_ram", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def cgroup():
    made = ChildCgroup.create(f"k3stream-test-{id(object())}", 64 * MIB)
    if isinstance(made, str):
        pytest.skip(
            f"no writable memory cgroup: {made} (root in a cgroup v2 with the memory controller "
            "delegated has one)"
        )
    yield made
    made.remove()


def _child(cgroup: ChildCgroup, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=cgroup.join, timeout=60
    )


def test_child_runs_inside_the_group_and_usage_is_reported(cgroup):
    done = _child(cgroup, "print(open('/proc/self/cgroup').read())")
    assert done.returncode == 0, done.stderr
    assert cgroup.path.name in done.stdout
    usage = cgroup.usage()
    assert cgroup.limit_bytes == 64 * MIB
    assert 0 < usage["peak_bytes"] <= 64 * MIB
    assert usage["limit_hits"] is not None


def test_the_limit_holds(cgroup):
    done = _child(cgroup, "import numpy as np; a = np.ones(32 << 20); print(a.sum())")  # 256 MiB
    usage = cgroup.usage()
    assert done.returncode != 0
    assert usage["peak_bytes"] <= 64 * MIB
    assert usage["limit_hits"] > 0


def test_remove_deletes_the_group(cgroup):
    cgroup.remove()
    assert not cgroup.path.exists()


def test_no_cgroup_gives_a_one_line_reason(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/gone\n")
    reason = ChildCgroup.create("x", MIB, tmp_path / "proc", tmp_path / "sys")
    assert isinstance(reason, str) and "no memory cgroup" in reason and "\n" not in reason


def test_v2_without_delegated_memory_gives_a_reason(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/job\n")
    job = tmp_path / "sys" / "job"
    job.mkdir(parents=True)
    (job / "cgroup.controllers").write_text("cpu memory\n")
    (job / "cgroup.subtree_control").mkdir()  # a directory: writing to it fails
    reason = ChildCgroup.create("x", MIB, tmp_path / "proc", tmp_path / "sys")
    assert isinstance(reason, str) and "memory controller is not enabled" in reason


def test_process_io_has_read_bytes():
    assert "read_bytes" in read_process_io()


def test_model_is_at_least_ratio_times_the_limit():
    bench = _bench_module()
    for limit in (200 * MIB, 1536 * MIB):
        spec = bench.model_spec(limit, 2.5)
        moe_layers = spec.n_layers - spec.n_dense
        assert moe_layers * spec.n_experts * bench.OBJECT_BYTES >= 2.5 * limit
        assert spec.top_k / spec.n_experts <= 0.02


def test_i_quant_recipes_have_the_same_parameters_and_their_own_cache(tmp_path):
    bench = _bench_module()
    audited = bench.model_spec(1536 * MIB, 2.5)
    directories = {bench.model_directory(audited, tmp_path).name}
    for recipe in ("iq2_xxs", "iq1_s"):
        spec = bench.model_spec(1536 * MIB, 2.5, recipe=recipe)
        assert spec.recipe == recipe and spec.n_layers == audited.n_layers
        assert (spec.hidden, spec.expert_ff) == (audited.hidden, audited.expert_ff)
        directory = bench.model_directory(spec, tmp_path).name
        assert directory.startswith(recipe) and directory not in directories
        directories.add(directory)


def test_table_and_ratios():
    bench = _bench_module()
    llama = {"prefill_tok_s": 10.0, "decode_tok_s": 1.0, "read_bytes": 4e9, "decode_read_per_token": 5e8}
    k3 = {"prefill_tok_s": 5.0, "decode_tok_s": 3.5, "read_bytes": 1e9, "decode_read_per_token": 5e7}
    lines = bench.table({"llama.cpp": llama, "k3stream": k3})
    assert "llama.cpp" in lines[0] and any("decode tok/s" in line and "3.50" in line for line in lines)
    assert not any("hit rate" in line for line in lines)  # rows nobody reports are left out
    assert bench.ratios(k3, llama) == (
        "k3stream / llama.cpp: prefill 0.50x, decode 3.50x, disk read 0.25x, decode read per token 0.10x"
    )
