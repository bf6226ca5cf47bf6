"""`--memory-limit`: sizes, cgroup detection on fake /proc and /sys trees, the plan and its refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3stream.memlimit import (
    HEADROOM_BYTES,
    MIB,
    MemoryLimitError,
    ModelNeeds,
    cgroup_limit,
    default_memory_limit,
    own_memory_cgroup,
    parse_size,
    plan_memory,
)

NEEDS = ModelNeeds(
    nonexpert_bytes=100 * MIB,
    state_bytes=10 * MIB,
    working_bytes=20 * MIB,
    object_bytes=MIB,
    top_k=8,
    expert_bytes=4096 * MIB,
    tokens=512,
)
RUNTIME = 200 * MIB
FIXED = RUNTIME + 130 * MIB + HEADROOM_BYTES


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1536M", 1536 * MIB), ("1.5GiB", 1536 * MIB), ("200MiB", 200 * MIB), ("4g", 4 << 30), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_names_the_flag():
    with pytest.raises(ValueError, match=r"--memory-limit: 'lots' is not a size"):
        parse_size("lots")


def test_plan_gives_experts_what_is_left():
    plan = plan_memory(FIXED + 300 * MIB, NEEDS, RUNTIME)
    assert plan.expert_budget == 300 * MIB
    assert "expert RAM budget 300.0 MiB (300 experts" in plan.summary()


def test_the_prompt_cache_comes_out_of_the_expert_budget():
    plan = plan_memory(FIXED + 300 * MIB, NEEDS, RUNTIME, cache_bytes=100 * MIB)
    assert plan.expert_budget == 200 * MIB
    assert "prompt cache 100.0 MiB -> expert RAM budget 200.0 MiB" in plan.summary()
    with pytest.raises(MemoryLimitError, match=r"prompt cache \(100.0 MiB\)"):
        plan_memory(FIXED + 100 * MIB, NEEDS, RUNTIME, cache_bytes=100 * MIB)


def test_plan_never_exceeds_the_routed_experts():
    assert plan_memory(FIXED + 10 * 4096 * MIB, NEEDS, RUNTIME).expert_budget == NEEDS.expert_bytes


def test_plan_holds_exactly_one_working_set():
    assert plan_memory(FIXED + 8 * MIB, NEEDS, RUNTIME).expert_budget == 8 * MIB


def test_plan_refuses_below_one_working_set_in_one_line():
    with pytest.raises(MemoryLimitError) as error:
        plan_memory(FIXED + 8 * MIB - 1, NEEDS, RUNTIME, source="--memory-limit")
    message = str(error.value)
    assert "\n" not in message
    assert "non-expert weights (100.0 MiB)" in message
    assert "top-k working set (8 x 1048576 bytes)" in message
    assert f"needs at least {(FIXED + 8 * MIB) / MIB:.1f} MiB" in message


def _fake_tree(tmp_path: Path, cgroup_lines: str) -> tuple[Path, Path]:
    proc, sys_cgroup = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    sys_cgroup.mkdir()
    return proc, sys_cgroup


def test_cgroup_v1_limit_is_the_smallest_up_the_tree(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "4:memory:/outer/inner\n1:cpu:/\n0::/\n")
    inner = sys_cgroup / "memory" / "outer" / "inner"
    inner.mkdir(parents=True)
    (inner / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (inner.parent / "memory.limit_in_bytes").write_text(f"{1536 * MIB}\n")
    assert own_memory_cgroup(proc, sys_cgroup) == inner
    assert cgroup_limit(inner, sys_cgroup) == 1536 * MIB
    assert default_memory_limit(proc, sys_cgroup) == (1536 * MIB, f"cgroup {inner}")


def test_cgroup_v2_limit(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "0::/job\n")
    job = sys_cgroup / "job"
    job.mkdir()
    (job / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text(f"{200 * MIB}\n")
    assert own_memory_cgroup(proc, sys_cgroup) == job
    assert default_memory_limit(proc, sys_cgroup)[0] == 200 * MIB


def test_no_limit_falls_back_to_available_ram(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "0::/job\n")
    job = sys_cgroup / "job"
    job.mkdir()
    (job / "cgroup.controllers").write_text("memory\n")
    (job / "memory.max").write_text("max\n")
    assert default_memory_limit(proc, sys_cgroup) == (20000000 * 1024, "available RAM")


def test_no_cgroup_mounted_falls_back_to_available_ram(tmp_path):
    proc, sys_cgroup = _fake_tree(tmp_path, "4:memory:/gone\n0::/gone\n")
    assert own_memory_cgroup(proc, sys_cgroup) is None
    assert default_memory_limit(proc, sys_cgroup) == (20000000 * 1024, "available RAM")


def test_pinning_the_malloc_mmap_threshold_reports_whether_it_could():
    from k3stream.memlimit import pin_malloc_mmap_threshold

    assert isinstance(pin_malloc_mmap_threshold(), bool)
