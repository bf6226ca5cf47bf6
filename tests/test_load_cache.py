"""A load under a memory limit leaves the non-expert weights in anonymous memory, not also in the page
cache charged to the limit: measured in a real child memory cgroup (memory.stat) around a real load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3stream.gguf.layout import is_routed_expert
from k3stream.gguf.reader import K3Checkpoint
from k3stream.memlimit import MIB
from k3stream.testing.cgroups import ChildCgroup, drop_page_cache

LOAD = """
import sys
from k3stream.cli import build_parser
from k3stream.commands.flags import runtime_from_args
flags = ["generate", sys.argv[1], "--prompt", "x"]
runtime_from_args(build_parser(flags).parse_args(flags)).close()
"""
BOUND = 16 * MIB  # the GGUF header's pages, the routed experts (under 1 MiB), one read chunk at most


def test_a_load_in_a_memory_cgroup_leaves_its_weights_out_of_the_page_cache(tiny_model):
    # Q8_0 matrices as releases store them: tensor ends that split the page cache's large folios
    model = tiny_model(
        hidden=1024,
        dense_ff=8192,
        n_dense=4,
        recipe="q8_0",
        expert_ff=256,
        latent=256,
        kv_lora=256,
        qk_nope=32,
    )
    checkpoint = K3Checkpoint.open(model)
    nonexpert = sum(t.nbytes for t in checkpoint.tensors.values() if not is_routed_expert(t.name))
    assert nonexpert > 6 * BOUND
    cgroup = ChildCgroup.create(f"test-load-cache-{os.getpid()}", 4 << 30)
    if isinstance(cgroup, str):
        pytest.skip(cgroup)
    try:
        os.sync()  # the model was just written: dirty pages cannot be dropped
        drop_page_cache(model)
        done = subprocess.run(
            [sys.executable, "-c", LOAD, str(model)], capture_output=True, text=True, preexec_fn=cgroup.join
        )
        assert done.returncode == 0, done.stderr[-2000:]
        cached = cgroup.page_cache_bytes()
    finally:
        cgroup.remove()
    assert cached < BOUND, (
        f"{cached / MIB:.1f} MiB of page cache charged after loading {nonexpert / MIB:.0f} MiB"
    )


def test_uncached_reads_are_the_files_bytes_and_a_shrunk_file_is_named(tiny_model, tmp_path):
    import shutil

    import numpy as np

    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model(seed=3), path)
    checkpoint = K3Checkpoint.open(path)
    checkpoint.uncached_reads = True
    for name in checkpoint.tensors:
        assert np.array_equal(checkpoint.read(name), checkpoint.raw(name))
    assert np.array_equal(checkpoint.read(name, 3, 5), checkpoint.raw(name)[3:8])
    last = max(checkpoint.tensors.values(), key=lambda info: info.data_offset)
    tail = next(name for name, info in checkpoint.tensors.items() if info is last)
    with open(path, "r+b") as handle:
        handle.truncate(last.data_offset + 10)
    with pytest.raises(ValueError, match=f"model.gguf: tensor {tail} is cut short"):
        checkpoint.read(tail)


def test_under_a_memory_limit_the_pack_is_read_with_o_direct_even_where_it_fits(tiny_model, tmp_path):
    """A RAM budget that holds the whole pack reads it buffered only without a memory limit: under one,
    its page cache would be charged to the limit beside the experts read from it (and each byte
    copied once more)."""
    from k3stream.cli import build_parser
    from k3stream.commands.flags import runtime_from_args
    from k3stream.memlimit import memory_limited
    from k3stream.pack.builder import build_pack
    from pack_helpers import copy_model

    manifest = build_pack(copy_model(tiny_model(), tmp_path)).manifest
    for limit, limited in ((["--memory-limit", "8GiB"], True), ([], memory_limited(None))):
        flags = ["generate", str(manifest), "--prompt", "x", "--ram-mib", "4096", *limit]
        runtime = runtime_from_args(build_parser(flags).parse_args(flags))
        try:
            stats = runtime.store.stats()
        finally:
            runtime.close()
        if "refused" in stats["direct_io_note"]:
            pytest.skip(f"{tmp_path}: {stats['direct_io_note']}")
        assert stats["direct_io"] is limited, (limit, stats["direct_io_note"])
