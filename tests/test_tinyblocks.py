"""Random valid K-quant blocks for large tiny models: decodable, moderate, seeded; llama.cpp runs them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from conftest import requires_llama
from k3stream.testing import tiny
from k3stream.testing.tiny import TinySpec, make_tiny
from k3stream.testing.tinyblocks import BLOCK_BYTES, FAST_TYPES, Q2_K, random_block_slabs
from llama_oracle import llama_runs

AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)


@pytest.mark.parametrize("ggml_type", sorted(FAST_TYPES))
@pytest.mark.parametrize("row", [256, 1024])
def test_blocks_decode_to_moderate_values(ggml_type, row):
    slab_bytes = 7 * BLOCK_BYTES[ggml_type]
    blocks = np.concatenate(list(random_block_slabs((48, row), ggml_type, [0, 1], slab_bytes=slab_bytes)))
    values = dequantize(blocks.reshape(48, -1), GGMLQuantizationType(ggml_type))
    assert values.shape == (48, row) and np.isfinite(values).all()
    assert 0.9 < values.std() * np.sqrt(row) < 1.1  # like the float initialisation: std 1/sqrt(fan_in)
    assert abs(values.mean()) * np.sqrt(row) < 0.1
    assert np.abs(values).max() * np.sqrt(row) < 4


def test_blocks_depend_on_the_seed_only():
    def make(seed):
        return np.concatenate(list(random_block_slabs((4, 512), Q2_K, seed)))

    assert np.array_equal(make([0, 7]), make([0, 7]))
    assert not np.array_equal(make([0, 7]), make([1, 7]))


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="GGML type 13 is not one of"):
        next(random_block_slabs((4, 256), 13, [0]))  # Q5_K


@pytest.fixture(scope="module")
def fast_model(tmp_path_factory):
    """An audited model small enough for a test, with the fast path lowered to cover its experts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny, "FAST_EXPERT_VALUES", 1)
        first = make_tiny(tmp_path_factory.mktemp("fast-a"), TinySpec(**AUDITED))
        second = make_tiny(tmp_path_factory.mktemp("fast-b"), TinySpec(**AUDITED))
    return first, second


def test_fast_path_keeps_same_spec_same_bytes_and_other_tensors(fast_model, tiny_model):
    first, second = fast_model
    assert first.read_bytes() == second.read_bytes()
    fast = {t.name: t for t in GGUFReader(first).tensors}
    slow = {t.name: t for t in GGUFReader(tiny_model(**AUDITED)).tensors}
    assert fast.keys() == slow.keys()
    for name, tensor in fast.items():
        assert tensor.tensor_type == slow[name].tensor_type
        same = np.array_equal(tensor.data, slow[name].data)
        assert same != ("_exps." in name), name  # only routed experts change


@requires_llama
def test_llama_cpp_runs_a_fast_path_model(fast_model):
    [(tokens, logits)] = llama_runs((fast_model[0], "The experts of the layer"))
    assert len(tokens) > 3 and np.isfinite(logits).all()
