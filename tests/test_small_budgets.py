"""Every execution path at expert budgets from one top-k working set up to the whole pack.

The tiny model's routing is diverse (its prompt and decode steps use every routed expert of every MoE
layer: the whole-pack run reads each object once, asserted below), so a budget below the pack makes
each path evict, re-read and stream experts through a cache smaller than a step. Each run is
`tests/parallel_worker.py` (prefill, decode, a batched `decode_batch` of two sequences, `prefill_last`)
under `torchrun` (one rank: a plain process); its logits are held against one process with every
expert in RAM: bit for bit where nothing is summed in another order (one process, expert
parallelism), to 1e-5 with tensor parallelism.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3stream.pack.reader import ExpertPack
from test_parallel import packed_copy, rel, run_worker

# budgets in top-k working sets; None: the whole pack
BUDGETS = (1, 2, 3, 8, None)


@pytest.fixture(scope="module")
def diverse(tiny_model, tmp_path_factory) -> Path:
    """The default tiny F32 model (5 MoE layers of 16 experts, top 4), packed."""
    return packed_copy(tiny_model, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(diverse, tmp_path_factory) -> dict:
    """One process, every expert in RAM: each object read once, and every one of them used."""
    result = run_worker(tmp_path_factory.mktemp("reference"), diverse, 1)
    with ExpertPack(diverse) as pack:
        objects = len(pack.moe_layers) * int(pack.num_experts)
    assert result["reports"][0]["pack_reads"] == objects, "the prompt no longer routes to every expert"
    return result


def budget_mib(manifest: Path, working_sets: int | None) -> float:
    """`working_sets` top-k working sets of the pack's largest object, in MiB (None: the whole pack)."""
    with ExpertPack(manifest) as pack:
        layers = sorted(pack.moe_layers)
        slot = max(pack.object_range(layer, 0)[1] for layer in layers)
        objects = len(layers) * int(pack.num_experts) if working_sets is None else working_sets * pack.top_k
    return objects * slot / 2**20


PATHS = {
    "one process": (1, ()),
    "one process, no prefetch": (1, ("--no-prefetch",)),
    "expert parallel": (2, ("--ep", "2")),
    "expert parallel, no prefetch": (2, ("--ep", "2", "--no-prefetch")),
    "tensor parallel": (2, ("--tp", "2")),
    "tensor and expert parallel": (2, ("--tp", "2", "--ep", "2")),
}


# the quick cases (the others are slow): a step larger than the cache on each kind of path, and the
# expert-parallel regime that once failed (a rank whose experts lay beyond the step's read-ahead window)
QUICK = {
    ("one process", 1),
    ("one process, no prefetch", 3),
    ("expert parallel", 3),
    ("expert parallel, no prefetch", 1),
    ("tensor and expert parallel", 1),
}


def _cases() -> list:
    return [
        pytest.param(
            path,
            working_sets,
            marks=[] if (path, working_sets) in QUICK else [pytest.mark.slow],
            id=f"{path}-{working_sets or 'whole'}",
        )
        for path in PATHS
        for working_sets in BUDGETS
    ]


@pytest.mark.parametrize(("path", "working_sets"), _cases())
def test_every_path_at_every_budget_matches_one_process_with_every_expert(
    diverse, reference, tmp_path, path, working_sets
):
    ranks, flags = PATHS[path]
    result = run_worker(tmp_path, diverse, ranks, *flags, ram_mib=budget_mib(diverse, working_sets))
    if "--tp" in flags:
        assert rel(result["logits"], reference["logits"]) <= 1e-5
    else:
        assert torch.equal(result["logits"], reference["logits"])
    reads = [report["pack_reads"] for report in result["reports"]]
    if working_sets is None:  # every expert fits: each read once, by the rank that owns it
        assert sum(reads) == reference["reports"][0]["pack_reads"] * (2 if flags == ("--tp", "2") else 1)
