"""Memory guarantees: a loaded model holds its non-expert weights in their GGUF bytes; loading them peaks
at their size + 10%; an expert RAM budget of B MiB keeps the expert bytes at or below B, end to end
through `k3stream bench`."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import k3stream
from bench_helpers import MIB, bench_json, pack_expert_bytes, packed_tiny
from k3stream import LoadOptions
from k3stream.model.experts import GGUFExpertSource
from pack_helpers import cached_tiny

# Large dense FFNs in three leading dense layers: ~600 MB of non-expert F32 weights, in tensors of 64 MiB
# (the generator holds a few of them at a time), with the small built-in vocabulary so that parsing the
# GGUF's metadata stays small next to the weights.
LARGE_SPEC = dict(hidden=1024, n_dense=3, dense_ff=16384, recipe="f32")

# Peak RSS of a fresh process loading the model (file pages mapped into it count too), above the peak it
# had after its imports. VmHWM rather than ru_maxrss: Linux carries ru_maxrss across execve, so a child
# of a big process (this one, after writing the model) would start with its parent's peak.
PEAK_AFTER_IMPORTS = """
import json, sys
import torch
import k3stream, k3stream.cli, k3stream.engine.loading, k3stream.model.k3, k3stream.gguf.weights

def peak():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

baseline = peak()
"""
MEASURE_LOAD = (
    PEAK_AFTER_IMPORTS
    + """
model = k3stream.load(sys.argv[1])
print(json.dumps({"baseline": baseline, "peak": peak(), "vocab": model.config.vocab_size}))
"""
)

ROUTED_EXPERT = re.compile(r"\.ffn_(up|gate|down)_exps\.weight$")


def nonexpert_bytes(path) -> int:
    """Bytes of every tensor but the routed experts, from the `gguf` package's inventory."""
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if not ROUTED_EXPERT.search(t.name))


def held_bytes(root) -> int:
    """Bytes of every distinct tensor or array buffer reachable from `root` through the garbage collector's
    references (closures, default arguments and bound methods included, but not a function's module
    globals or a C function's module), leaving out expert sources (the routed experts)."""
    skipped = (GGUFExpertSource, type, types.ModuleType, types.BuiltinFunctionType, types.CodeType)
    seen, buffers, pending = set(), {}, [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen or isinstance(obj, skipped):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            pending.extend(
                cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None
            )
            pending.extend([*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()])
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            buffers[storage.data_ptr()] = max(buffers.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            buffers[obj.__array_interface__["data"][0]] = obj.nbytes
        else:
            pending.extend(gc.get_referents(obj))
    return sum(buffers.values())


def small_f32_matrix_bytes(path) -> int:
    """Bytes of the non-expert F32 matrices of at most INPUT_MAJOR_MAX_BYTES: the C products also hold
    each as an input-major copy (row-exact sums at a GEMM's speed). On Kimi-K3 those are a few small
    matrices per layer; on the tiny test models most of the trunk."""
    from k3stream.quant.kernels.seam import INPUT_MAJOR_MAX_BYTES

    return sum(
        int(t.n_bytes)
        for t in GGUFReader(str(path)).tensors
        if t.tensor_type == 0
        and len(t.shape) == 2
        and t.n_bytes <= INPUT_MAJOR_MAX_BYTES
        and not ROUTED_EXPERT.search(t.name)
    )


@pytest.mark.parametrize("recipe", ["f32", "f16", "audited"])
def test_a_loaded_model_holds_its_nonexpert_weights_in_their_gguf_bytes(recipe):
    """Every non-expert matrix in its GGUF bytes, once, plus at most one input-major copy of each small
    F32 matrix (shared by every product over it)."""
    path = cached_tiny(recipe=recipe, latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
    weights = nonexpert_bytes(path)
    held = held_bytes(k3stream.load(path, LoadOptions(expert_ram_mib=0)))
    bound = 1.05 * weights + small_f32_matrix_bytes(path)
    assert weights <= held <= bound, f"{recipe}: {held} bytes held for {weights} in the GGUF"
    if recipe != "f32":  # the walk sees a widening: the reference path holds float32 copies
        widened = held_bytes(k3stream.load(path, LoadOptions(expert_ram_mib=0, kernels="reference")))
        assert widened > 1.05 * weights


@pytest.mark.slow
def test_loading_nonexpert_weights_peaks_within_ten_percent_of_their_size():
    gguf_path = cached_tiny(**LARGE_SPEC)  # ~620 MB: generated once, then reused across sessions
    weights = nonexpert_bytes(gguf_path)
    assert gguf_path.stat().st_size >= 500e6 and weights >= 0.9 * gguf_path.stat().st_size

    done = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, str(gguf_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    grown = measured["peak"] - measured["baseline"]
    assert grown <= 1.10 * weights, (
        f"loading {weights / MIB:.0f} MiB of non-expert weights grew the peak RSS by {grown / MIB:.0f} MiB "
        f"({grown / weights:.2f}x)"
    )


def test_expert_bytes_stay_within_the_ram_budget(tmp_path):
    gguf_path, manifest = packed_tiny(tmp_path, n_experts=16, top_k=4, seed=12)
    budget_mib = pack_expert_bytes(manifest) / 3 / MIB
    results = bench_json(
        gguf_path, "--ram-mib", f"{budget_mib:.4f}", "--prompt-tokens", "12", "--decode-tokens", "8"
    )

    expert_bytes = results["k3stream"]["expert_bytes"]
    budget = expert_bytes["budget"]["ram"]
    assert budget <= budget_mib * MIB
    assert results["k3stream"]["phases"][1]["pack_reads"] > 0  # experts were evicted and read again
    assert 0 < expert_bytes["peak_resident"]["ram"] <= budget
    # every host expert buffer still alive anywhere (tiers, readers, callers), sampled after each step
    assert expert_bytes["peak_live_host"] <= budget


# A generation on an F16 model: non-expert weights stay F16 (2 bytes a value) and nothing makes a float32
# copy of them, so the peak stays at their GGUF bytes plus the expert budget and small working buffers.
F16_SPEC = dict(hidden=1024, n_dense=3, dense_ff=32768, recipe="f16", n_experts=8, top_k=2, seed=5)

MEASURE_GENERATE = (
    PEAK_AFTER_IMPORTS
    + """
k3stream.cli.main(["generate", sys.argv[1], "--prompt", "hello there", "--max-tokens", "6",
                   "--threads", "1", "--temperature", "0"])
print(json.dumps({"baseline": baseline, "peak": peak()}))
"""
)


@pytest.mark.slow
def test_generate_on_an_f16_model_stays_within_its_gguf_bytes():
    gguf_path = cached_tiny(**F16_SPEC)
    weights = nonexpert_bytes(gguf_path)
    experts = gguf_path.stat().st_size - weights  # served from the map: all of them may be touched
    assert weights >= 500e6
    done = subprocess.run(
        [sys.executable, "-c", MEASURE_GENERATE, str(gguf_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    grown = measured["peak"] - measured["baseline"]
    assert grown <= 1.10 * (weights + experts), (
        f"generating on {weights / MIB:.0f} MiB of F16 non-expert weights (+{experts / MIB:.0f} MiB of "
        f"experts) grew the peak RSS by {grown / MIB:.0f} MiB ({grown / (weights + experts):.2f}x)"
    )
