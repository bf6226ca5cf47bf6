"""`LoadOptions`: what a load takes, checked when it is made, one line naming the field."""

from __future__ import annotations

import dataclasses

import pytest

import k3stream
from k3stream import LoadOptions
from k3stream.gguf.layout import is_routed_expert
from k3stream.gguf.reader import K3Checkpoint
from k3stream.model import k3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"device": "tpu"}, r"^LoadOptions\.device must be one of cpu, cuda, got 'tpu'$"),
        ({"dtype": "float64"}, r"^LoadOptions\.dtype must be one of float32, bfloat16, float16, got"),
        ({"kernels": "fast"}, r"^LoadOptions\.kernels must be one of auto, reference, got 'fast'$"),
        ({"profile": "strict"}, r"^LoadOptions\.profile must be one of generic, audited, got 'strict'$"),
        ({"prefetch_hint": "psychic"}, r"^LoadOptions\.prefetch_hint must be one of auto, pre-attention"),
        ({"dtype": "bfloat16"}, r"^LoadOptions\.dtype bfloat16 re-types weights: needs kernels='reference'$"),
        ({"expert_ram_mib": -1.0}, r"^LoadOptions\.expert_ram_mib must be >= 0 or None, got -1\.0$"),
        ({"expert_ram_mib": float("nan")}, r"^LoadOptions\.expert_ram_mib must be >= 0 or None, got nan$"),
        ({"tp_size": 0}, r"^LoadOptions\.tp_size must be >= 1, got 0$"),
        ({"tp_rank": 2, "tp_size": 2}, r"^LoadOptions\.tp_rank must be in \[0, 2\), got 2$"),
        ({"tp_rank": -1}, r"^LoadOptions\.tp_rank must be in \[0, 1\), got -1$"),
    ],
)
def test_a_bad_field_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message):
        LoadOptions(**fields)


def test_options_are_frozen_and_varied_with_replace():
    options = LoadOptions(kernels="reference")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kernels = "auto"
    bf16 = dataclasses.replace(options, dtype="bfloat16")
    assert (bf16.kernels, bf16.dtype, str(bf16.torch_dtype)) == ("reference", "bfloat16", "torch.bfloat16")
    with pytest.raises(ValueError, match=r"^LoadOptions\.tp_rank"):
        dataclasses.replace(options, tp_rank=1)


def test_the_default_budget_comes_from_the_memory_plan(tiny_model):
    """`k3stream.load` without a budget or a source keeps a tiny model's routed experts in RAM (the
    memory plan leaves far more than they need); `model.k3.load`, and an explicit budget of 0, keep none."""
    path = tiny_model(seed=5)
    checkpoint = K3Checkpoint.open(path)
    routed = sum(t.nbytes for t in checkpoint.tensors.values() if is_routed_expert(t.name))
    assert k3stream.load(path).expert_source.kept_bytes() == routed
    assert k3stream.load(path, LoadOptions(expert_ram_mib=0)).expert_source.kept_bytes() == 0
    assert k3.load(checkpoint).expert_source.kept_bytes() == 0
