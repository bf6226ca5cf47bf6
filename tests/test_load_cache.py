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
