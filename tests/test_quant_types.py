"""The supported GGML types at the edges: a type k3stream does not know stops every command at load in
one line, and the i-quant/ternary types run through the kernel seam's reference route."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from k3stream.cli import main
from k3stream.quant import IQUANT_TYPES, dequantize
from k3stream.quant.kernels import QWeight, grouped_qmatmul, kernel_for, note_fallbacks, qmatmul
from k3stream.testing.iquant_blocks import random_blocks

T = GGMLQuantizationType
AUDITED_DIMS = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
TENSOR = "blk.1.ffn_gate_exps.weight"


def with_type_id(source: Path, out: Path, tensor: str, type_id: int) -> Path:
    """A copy of `source` whose header gives `tensor` the GGML type id `type_id`."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out.write_bytes(data)
    return out


COMMANDS = {
    "inspect": lambda path, out: ["inspect", str(path)],
    "pack": lambda path, out: ["pack", str(path), "--out", str(out / "x.pack"), "--no-progress"],
    "generate": lambda path, out: ["generate", str(path), "--prompt", "hi", "--max-tokens", "2"],
    "dequantize": lambda path, out: ["dequantize", str(path), str(out / "x.gguf")],
    "verify": lambda path, out: ["verify", str(path)],  # no pack beside it: the type, not "pack it first"
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("tensor", "type_id", "named"),
    [
        (TENSOR, 77, "unknown GGML type 77"),
        (TENSOR, 41, "Q1_0 (41)"),
        ("blk.0.attn_norm.weight", 26, "I32 (26)"),  # F32's size: the header holds, the type does not
    ],
)
def test_a_type_k3stream_does_not_know_stops_at_load_in_one_line(
    tiny_model, tmp_path, capsys, command, tensor, type_id, named
):
    """A future enum value (77) and ones gguf knows but k3stream cannot decode (Q1_0, I32): one line
    naming the file, tensor and type, and nothing written."""
    path = with_type_id(
        tiny_model(recipe="iq2_xxs", **AUDITED_DIMS), tmp_path / "patched.gguf", tensor, type_id
    )
    out = tmp_path / "out"
    out.mkdir()
    assert main(COMMANDS[command](path, out)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert tensor in err and named in err and str(path) in err
    assert not any(out.iterdir()) and sorted(tmp_path.iterdir()) == [out, path]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("qt", sorted(IQUANT_TYPES), ids=lambda t: t.name)
def test_products_of_the_new_types_through_the_seam(qt, backend):
    """qmatmul and grouped products equal the float product of the decoded matrices, by the seam's own
    choice (the reference route, dequantize a slab and multiply, for a type no kernel takes) and by
    the reference route itself."""
    width = 512
    weights = [
        QWeight(
            torch.from_numpy(random_blocks(qt.name, (8, width), [int(qt), e])).reshape(-1), qt, (8, width)
        )
        for e in range(3)
    ]
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(int(qt)))
    dense = [dequantize(w.data.reshape(8, -1), qt) for w in weights]
    assert relative_error(qmatmul(x, weights[0], backend=backend), x @ dense[0].T) <= 1e-5
    starts, rows = torch.tensor([0, 2, 2, 5]), torch.tensor([4, 0, 1, 2, 3])
    got = grouped_qmatmul(x, weights, starts, rows, backend=backend)
    expected = torch.cat([x[[4, 0]] @ dense[0].T, x[[1, 2, 3]] @ dense[2].T])
    assert relative_error(got, expected) <= 1e-5


def test_a_type_without_a_kernel_is_noted_once_at_load():
    """The seam's fallback is announced in one line per type (kernels registered later drop the note)."""
    lines = note_fallbacks(set(IQUANT_TYPES), "cpu")
    assert all(line.endswith("using the reference dequantize path") for line in lines)
    assert len(lines) == sum(kernel_for(t) == "reference" for t in IQUANT_TYPES)


@pytest.mark.parametrize("type_name", ["TQ1_0", "TQ2_0"])
def test_random_ternary_blocks_hold_only_minus_one_zero_one(type_name):
    blocks = random_blocks(type_name, (4, 512), [7])
    decoded = dequantize(blocks, T[type_name]).numpy()
    scale = np.abs(decoded).max()
    assert set(np.unique(np.round(decoded / scale, 6))) == {-1.0, 0.0, 1.0}
    assert 0.5 / np.sqrt(512) < decoded.std() < 2 / np.sqrt(512)
