"""NaN and infinite weights: found in every type where `gguf.quants.dequantize` (bit-exact with ggml's
decoders) makes a block non-finite, and a GGUF holding one is refused at load in one line naming the file,
the tensor and the block, as llama.cpp's `--check-tensors` refuses it (without that flag llama.cpp
computes NaN logits; k3stream's integer products on 8-bit activations would turn them into finite
nonsense)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

import k3stream
from k3stream.cli import main
from k3stream.gguf.reader import K3Checkpoint
from k3stream.pack import format as fmt
from k3stream.pack.builder import plan_pack
from k3stream.pack.paths import default_outputs
from k3stream.quant import DECODE_ONLY_TYPES, SUPPORTED_TYPES, quantize, type_size
from k3stream.quant.finite import first_non_finite
from k3stream.quant.types import FLOAT_TYPES, T
from k3stream.testing.iquant_blocks import random_blocks

# every byte of NVFP4's UE4M3 scales is a finite scale (ggml_validate_row_data checks nothing there)
CHECKED_TYPES = sorted(SUPPORTED_TYPES - FLOAT_TYPES - {T.NVFP4})
DIMS = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)  # whole 256-blocks for the i-quant recipes


def valid_blocks(qtype: T, n_blocks: int = 4) -> np.ndarray:
    """(n_blocks, block bytes) uint8: random valid blocks of `qtype`, every value finite."""
    block_values = type_size(qtype)[0]
    if qtype in DECODE_ONLY_TYPES:
        return random_blocks(qtype.name, (n_blocks, block_values), [int(qtype)])
    values = np.random.default_rng(int(qtype)).standard_normal((n_blocks, block_values)).astype(np.float32)
    return quantize(values, qtype)


@pytest.mark.parametrize("qtype", CHECKED_TYPES, ids=lambda t: t.name)
def test_a_block_is_found_exactly_when_gguf_decodes_it_to_non_finite_values(qtype):
    """Every four bytes of block 2 in turn set to 0xFF (an fp16 NaN wherever an fp16 field lies within,
    IQ1_M's two top scale nibbles, MXFP4's invalid exponent): `first_non_finite` names block 2 exactly
    when gguf's decoder gives that block a NaN or infinity."""
    blocks = valid_blocks(qtype)
    assert np.isfinite(gguf_dequantize(blocks, qtype)).all()
    assert first_non_finite(blocks, qtype) is None
    found = 0
    for offset in range(blocks.shape[1] - 3):
        damaged = blocks.copy()
        damaged[2, offset : offset + 4] = 0xFF
        with np.errstate(over="ignore", invalid="ignore"):
            decoded_finite = bool(np.isfinite(gguf_dequantize(damaged[2:3], qtype)).all())
        assert first_non_finite(damaged, qtype) == (None if decoded_finite else 2), offset
        found += not decoded_finite
    assert found  # every checked type has a scale that can be damaged


@pytest.mark.parametrize("qtype", sorted(FLOAT_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_float_value_is_found_by_its_index(qtype, bad):
    dtype = {T.F32: np.float32, T.F16: np.float16}.get(qtype)
    values = np.linspace(-2, 2, 64, dtype=np.float32)
    values[37] = bad
    raw = (values.astype(dtype) if dtype else (values.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    assert first_non_finite(raw, qtype) == 37
    assert first_non_finite(np.zeros(128, np.uint8), qtype) is None


def damage(path, tensor_name: str, byte: int, data: bytes) -> None:
    """`data` written over the GGUF at `path`, at byte `byte` of tensor `tensor_name`'s data."""
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == tensor_name)
    with path.open("r+b") as stream:
        stream.seek(int(tensor.data_offset) + byte)
        stream.write(data)


def damaged_copy(source, tmp_path, tensor_name: str, byte: int, data: bytes):
    """A copy of the GGUF `source` with `data` written at byte `byte` of tensor `tensor_name`'s data."""
    path = tmp_path / source.name
    shutil.copyfile(source, path)
    damage(path, tensor_name, byte, data)
    return path


@pytest.mark.parametrize(
    ("recipe", "tensor", "byte", "data", "where"),
    [
        # an IQ4_NL attention output (18-byte blocks, d first): block 3's scale an fp16 infinity
        ("iq4_xs", "blk.0.attn_output.weight", 3 * 18, np.float16(np.inf).tobytes(), "the scale of block 3"),
        # an IQ4_XS shared-expert matrix (136-byte blocks, d first): block 1's scale a NaN
        ("iq4_xs", "blk.1.ffn_down_shexp.weight", 136, np.float16(np.nan).tobytes(), "the scale of block 1"),
        # an F32 norm: value 5 NaN
        ("f32", "output_norm.weight", 5 * 4, np.float32(np.nan).tobytes(), "value 5"),
    ],
    ids=["iq4_nl-inf-scale", "iq4_xs-nan-scale", "f32-nan-value"],
)
def test_a_gguf_with_a_non_finite_weight_is_refused_in_one_line(
    tiny_model, tmp_path, capsys, recipe, tensor, byte, data, where
):
    source = tiny_model(recipe=recipe, **DIMS, n_layers=2, mla_layers=(1,), seed=5)
    path = damaged_copy(source, tmp_path, tensor, byte, data)
    expected = f"{path}: tensor {tensor} "
    with pytest.raises(ValueError, match="is NaN or infinite; the file is damaged$") as excinfo:
        k3stream.load(path)
    assert str(excinfo.value).startswith(expected) and f": {where} is NaN" in str(excinfo.value)
    with pytest.raises(ValueError, match="is NaN or infinite"):
        list(k3stream.nonexpert_weights(path))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    for argv in (
        ["generate", str(path), "--prompt", "hi", "--max-tokens", "2", "--no-stream-experts"],
        ["perplexity", str(path), "--file", str(text), "--ctx", "64", "--chunks", "1", "--no-stream-experts"],
    ):
        assert main(argv) != 0
        captured = capsys.readouterr()
        assert captured.out == ""
        error = captured.err.strip().splitlines()[-1]
        assert error.startswith(f"k3stream {argv[0]}: error: {expected}") and where in error, error


# an IQ2_XXS expert of the dynamic recipe: 66-byte blocks, d first
DAMAGED_EXPERT = "blk.2.ffn_up_exps.weight"
EXPERT_BYTES = 256 * 256 // 256 * 66
NAN = np.float16(np.nan).tobytes()


def test_pack_refuses_an_expert_with_a_non_finite_scale_and_leaves_no_pack(tiny_model, tmp_path, capsys):
    """`pack` reads every object back for its checksum and checks it there: a NaN scale in expert 5's
    block 3 is refused in one line naming the GGUF, tensor, expert and block; no pack or manifest is
    left under its name, and a second run refuses it again
    (test_pack_resume: a resumed build checks the objects it keeps)."""
    source = tiny_model(recipe="dynamic", **DIMS)
    path = damaged_copy(source, tmp_path, DAMAGED_EXPERT, 5 * EXPERT_BYTES + 3 * 66, NAN)
    line = f"{path}: {DAMAGED_EXPERT} expert 5: the scale of block 3 is NaN or infinite; its GGUF is damaged"
    pack, manifest = default_outputs([path])
    for _ in range(2):
        assert main(["pack", str(path), "--no-progress"]) == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"k3stream pack: error: {line}"]
        assert not pack.exists() and not manifest.exists()


def test_verify_full_names_an_expert_with_a_non_finite_scale(tiny_model, tmp_path, capsys):
    """Routed experts load when routed, unchecked; `verify --full`, which reads every payload, finds a NaN
    scale that GGUF and pack both hold (a pack sglang's packer wrote: its manifest records no checksums,
    and it does not check) and names pack, tensor, expert and block."""
    source = tiny_model(recipe="dynamic", **DIMS)
    path = tmp_path / source.name
    shutil.copyfile(source, path)
    assert main(["pack", str(path), "--no-progress"]) == 0
    pack, manifest = default_outputs([path])
    recorded = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({key: value for key, value in recorded.items() if key != "integrity"}))
    layout = plan_pack(K3Checkpoint.open(path)).layout
    role_offset = layout.offsets_at(layout.layer_position(2))[fmt.ROLES.index("up")]
    with pack.open("r+b") as stream:
        stream.seek(layout.object_offset(2, 5) + role_offset + 3 * 66)
        stream.write(NAN)
    damage(path, DAMAGED_EXPERT, 5 * EXPERT_BYTES + 3 * 66, NAN)
    assert main(["verify", str(path), "--full"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        f"k3stream verify: error: {pack}: {DAMAGED_EXPERT} expert 5: the scale of block 3 is NaN or "
        "infinite; its GGUF is damaged"
    ]
