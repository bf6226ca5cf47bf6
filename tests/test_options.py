"""`LoadOptions`: what a load takes, checked when it is made, one line naming the field."""

from __future__ import annotations

import dataclasses

import pytest

import k3stream
from conftest import NO_C_KERNELS
from k3stream import LoadOptions
from k3stream.cli import build_parser
from k3stream.commands.flags import load_options
from k3stream.gguf.layout import is_routed_expert
from k3stream.gguf.reader import K3Checkpoint
from k3stream.model import k3
from k3stream.quant.kernels import cpu
from llama_logits import relative_error


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
        ({"expert_ram_mib": "512"}, r"^LoadOptions\.expert_ram_mib must be >= 0 or None, got '512'$"),
        ({"prefetch": "no"}, r"^LoadOptions\.prefetch must be True or False, got 'no'$"),
        ({"match_ggml": "false"}, r"^LoadOptions\.match_ggml must be True or False, got 'false'$"),
        ({"keep_quantized": 1}, r"^LoadOptions\.keep_quantized must be True or False, got 1$"),
    ],
)
def test_a_bad_field_is_refused_naming_it(fields, message):
    with pytest.raises(ValueError, match=message):
        LoadOptions(**fields)


def test_load_takes_its_options_as_load_options(tiny_model):
    with pytest.raises(TypeError, match=r"^k3stream\.load: options must be a LoadOptions, got dict$"):
        k3stream.load(tiny_model(n_layers=2, n_experts=4, top_k=2), {"device": "cpu"})


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


@pytest.mark.skipif(not cpu.available(), reason=NO_C_KERNELS)
def test_ggml_arithmetic_is_the_default_and_float_activations_a_flag(tiny_model):
    """`LoadOptions()` and every model command's default compute as llama.cpp's CPU backend does (8-bit
    activations against quantized matrices: the reference dequantizer's product on inputs rounded as
    ggml rounds them); `--float-activations` and `match_ggml=False` give float32 activations, the
    reference dequantizer's product on the inputs as they are. The two differ visibly."""
    path = tiny_model(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32, seed=4)

    def options(command: str, *flags: str, device: str = "cpu") -> LoadOptions:
        argv = [command, str(path), *(["--prompt", "Hi"] if command == "generate" else []), *flags]
        return load_options(build_parser(argv).parse_args(argv), 1024, device)

    for command in ("generate", "chat", "serve", "bench", "perplexity"):
        assert options(command) == options(command, "--match-ggml") == LoadOptions(expert_ram_mib=1024)
        assert options(command, "--float-activations") == LoadOptions(expert_ram_mib=1024, match_ggml=False)
    assert LoadOptions().ggml_arithmetic
    with pytest.raises(SystemExit):
        options("generate", "--match-ggml", "--float-activations")
    tokens = [1, 2]  # few: 8-bit codes are discontinuous, so two paths equal up to summation order can
    # round one code apart and pick another expert within a few tokens (this model's third token does)
    default = k3stream.load(path).logits(tokens)
    floats = k3stream.load(path, options("generate", "--float-activations")).logits(tokens)
    rounded = k3stream.load(path, LoadOptions(kernels="reference")).logits(tokens)
    reference = k3stream.load(path, LoadOptions(kernels="reference", match_ggml=False)).logits(tokens)
    assert relative_error(default, rounded) < 1e-5 and relative_error(floats, reference) < 1e-5
    assert relative_error(default, floats) > 1e-3


def test_cuda_and_retyped_weights_take_float_activations_and_asking_for_ggml_there_is_refused(tiny_model):
    """ggml's arithmetic is llama.cpp's CPU arithmetic on the GGUF's types: on CUDA and with weights
    re-typed by --dtype the products take float32 activations, and an explicit --match-ggml there is a
    one-line error."""
    assert not LoadOptions(device="cuda").ggml_arithmetic
    assert not LoadOptions(dtype="bfloat16", kernels="reference").ggml_arithmetic
    argv = ["generate", str(tiny_model(seed=5)), "--prompt", "Hi"]
    plain, explicit = (build_parser(a).parse_args(a) for a in (argv, [*argv, "--match-ggml"]))
    assert load_options(plain, 0, "cuda").match_ggml
    with pytest.raises(
        ValueError,
        match=r"^--match-ggml is llama\.cpp's CPU arithmetic on the GGUF's types: products on cuda take",
    ):
        load_options(explicit, 0, "cuda")
    retyped = build_parser(argv).parse_args([*argv, "--match-ggml", "--dtype", "bfloat16"])
    with pytest.raises(
        ValueError, match=r": weights re-typed to bfloat16 take float32 activations \(use --device cpu"
    ):
        load_options(retyped, 0)
