"""sglang's loader (`k3stream.nonexpert_weights`) on real tiny GGUFs, checked with the `gguf` package.

Expected names come from the reference's name table (../shared/reference/kimi-k3-architecture.md).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader

import k3stream
from k3stream import LoadOptions
from k3stream.gguf.weights import checkpoint_targets, residual_target_value, tensor_weights
from pack_helpers import model_files

AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32, n_experts=8, top_k=2)
# GGUF suffix -> runtime suffix, from the reference document (one entry per role the tiny models have)
REFERENCE_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_routed_down.weight": "mlp.routed_expert_down_proj.weight",
    "ffn_routed_up.weight": "mlp.routed_expert_up_proj.weight",
    "ffn_routed_norm.weight": "mlp.routed_expert_norm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "ssm_g.weight": "self_attn.g_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_gate.weight": "self_attn.g_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_qweight",
    "attn_v_b.weight": "self_attn.v_b_qweight",
    "attn_res_score.weight": ("self_attention_res_proj.weight", "self_attention_res_norm.weight"),
    "ffn_res_score.weight": ("mlp_res_proj.weight", "mlp_res_norm.weight"),
}
TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "output_res_score.weight": ("model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"),
}


def oracle_pairs(path):
    """(runtime name, GGUF tensor) per emitted value, in order, from gguf.GGUFReader and the table."""
    pairs = []
    for tensor in (t for shard in model_files(path) for t in GGUFReader(str(shard)).tensors):
        if tensor.name.endswith("_exps.weight"):
            continue
        if tensor.name in TOP_LEVEL:
            targets = TOP_LEVEL[tensor.name]
        else:
            _blk, layer, suffix = tensor.name.split(".", 2)
            targets = REFERENCE_NAMES[suffix]
            targets = tuple(
                f"model.layers.{layer}.{t}" for t in (targets if isinstance(targets, tuple) else (targets,))
            )
        for target in targets if isinstance(targets, tuple) else (targets,):
            quantized = tensor.tensor_type.name not in ("F32", "F16", "BF16")
            if quantized and target.endswith(".weight"):
                target = target[: -len("weight")] + "qweight"
            if quantized:
                pairs.append((target + "_type", tensor))
            pairs.append((target, tensor))
    return pairs


@pytest.mark.parametrize("spec", [dict(recipe="f32", seed=1), dict(recipe="f16", shards=3, seed=2), AUDITED])
def test_names_order_and_values_match_the_gguf(tiny_model, spec):
    path = tiny_model(**spec)
    emitted = list(k3stream.nonexpert_weights(path))
    expected = oracle_pairs(path)
    assert [name for name, _ in emitted] == [name for name, _ in expected]
    for (name, value), (_, tensor) in zip(emitted, expected, strict=True):
        if name.endswith("qweight_type"):
            assert value.dtype == torch.uint8 and int(value) == int(tensor.tensor_type)
        elif name.endswith(("_res_norm.weight", "attn_res_norm.weight")):
            assert torch.equal(value, torch.ones(tensor.data.shape, dtype=value.dtype))
        elif name.endswith(("_res_proj.weight", "attn_res_proj.weight")):
            assert torch.equal(value, torch.from_numpy(np.array(tensor.data))[None])
        elif name.endswith("A_log"):
            assert torch.equal(value, torch.log(-torch.from_numpy(np.array(tensor.data))))
        else:
            assert value.numpy().tobytes() == np.asarray(tensor.data).tobytes()


def test_quantized_tensors_keep_their_bytes_and_type(tiny_model):
    emitted = dict(k3stream.nonexpert_weights(tiny_model(**AUDITED)))
    mla = next(i for i in range(6) if f"model.layers.{i}.self_attn.k_b_qweight_type" in emitted)
    assert int(emitted[f"model.layers.{mla}.self_attn.k_b_qweight_type"]) == 2  # Q4_0
    assert int(emitted[f"model.layers.{mla}.self_attn.v_b_qweight_type"]) == 10  # Q2_K
    assert emitted[f"model.layers.{mla}.self_attn.k_b_qweight"].dtype == torch.uint8
    assert not any("_exps" in name or ".experts." in name for name in emitted)


def test_residual_scores_split_exactly_and_a_log_round_trips(tiny_model):
    path = tiny_model(recipe="f32", seed=3)
    emitted = dict(k3stream.nonexpert_weights(path))
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFReader(str(path)).tensors}
    for source, prefix in [
        ("output_res_score.weight", "model.output_attn_res"),
        ("blk.2.attn_res_score.weight", "model.layers.2.self_attention_res"),
        ("blk.4.ffn_res_score.weight", "model.layers.4.mlp_res"),
    ]:
        proj, norm = emitted[f"{prefix}_proj.weight"], emitted[f"{prefix}_norm.weight"]
        assert proj.shape == (1, tensors[source].numel())
        assert torch.equal((proj * norm)[0], tensors[source])  # bit for bit
    a_log = emitted["model.layers.0.self_attn.A_log"]
    assert torch.allclose(-torch.exp(a_log), tensors["blk.0.ssm_a"], rtol=2e-7, atol=0)


def test_residual_target_errors():
    with pytest.raises(ValueError, match=r"^invalid Kimi-K3 attention-residual target 2$"):
        residual_target_value(torch.ones(4), 2)
    with pytest.raises(
        ValueError, match=r"^Kimi-K3 attention-residual score must be a vector, got \(2, 2\)$"
    ):
        residual_target_value(torch.ones(2, 2), 0)


def test_non_vector_score_is_rejected_by_the_loader():
    with pytest.raises(ValueError, match=r"score must be a vector, got \(1, 4\)"):
        list(tensor_weights("blk.3.ffn_res_score.weight", torch.ones(1, 4), 0, set()))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([-1.0, 0.5, -2.0, -0.1], "Kimi-K3 GGUF ssm_a must contain only -exp(A_log) values"),
        ([-1.0, 0.0, -2.0, -0.1], "Kimi-K3 GGUF ssm_a must contain only -exp(A_log) values"),
        ([-1.0, float("nan"), -2.0, -0.1], "Kimi-K3 GGUF ssm_a must contain finite floating values"),
        ([-1.0, float("-inf"), -2.0, -0.1], "Kimi-K3 GGUF ssm_a must contain finite floating values"),
    ],
)
def test_bad_ssm_a_in_a_real_file(tiny_model, tmp_path, values, message):
    source = tiny_model(recipe="f32", seed=4)
    path = tmp_path / source.name
    shutil.copyfile(source, path)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.1.ssm_a")
    with path.open("r+b") as stream:
        stream.seek(int(tensor.data_offset))
        stream.write(np.asarray(values, dtype=np.float32).tobytes())
    with pytest.raises(ValueError) as excinfo:
        list(k3stream.nonexpert_weights(path))
    assert str(excinfo.value) == message
    with pytest.raises(ValueError) as excinfo:  # the model reads ssm_a as is: the same, file and tensor named
        k3stream.load(path)
    assert str(excinfo.value) == f"{path}: tensor blk.1.ssm_a: {message}"


def test_integer_ssm_a_is_rejected():
    with pytest.raises(ValueError, match="^Kimi-K3 GGUF ssm_a must contain finite floating values$"):
        list(tensor_weights("blk.0.ssm_a", torch.tensor([-1, -2]), 0, set()))


def test_duplicate_target_is_rejected():
    emitted: set[str] = set()
    list(tensor_weights("blk.0.attn_norm.weight", torch.ones(4), 0, emitted))
    with pytest.raises(
        ValueError, match=r"^duplicate Kimi-K3 target parameter: model.layers.0.input_layernorm.weight$"
    ):
        list(tensor_weights("blk.0.attn_norm.weight", torch.ones(4), 0, emitted))
    list(tensor_weights("blk.1.attn_k_b.weight", torch.zeros(2, 18, dtype=torch.uint8), 2, emitted))
    with pytest.raises(
        ValueError, match=r"^duplicate Kimi-K3 target parameter: model.layers.1.self_attn.k_b_qweight$"
    ):
        list(tensor_weights("blk.1.attn_k_b.weight", torch.zeros(2, 18, dtype=torch.uint8), 2, emitted))


@pytest.mark.parametrize("name", ["blk.0.ssm_conv1d.weight", "token_embd.bias", "blk.x.attn_norm.weight"])
def test_unsupported_names(name):
    with pytest.raises(KeyError) as excinfo:
        checkpoint_targets(name)
    assert excinfo.value.args[0] == f"unsupported Kimi-K3 GGUF tensor name: {name}"


@pytest.fixture(scope="module")
def packed_model(tiny_model, tmp_path_factory):
    from k3stream.pack.builder import build_pack

    directory = tmp_path_factory.mktemp("packed")
    source = tiny_model(recipe="f32", shards=2, seed=5)
    for shard in sorted(source.parent.glob("*.gguf")):
        shutil.copyfile(shard, directory / shard.name)
    first = directory / source.name
    build_pack(first, directory / "experts.pack", directory / "manifest.json")
    return first, directory / "manifest.json"


def test_manifest_gives_the_same_weights_as_the_gguf(packed_model):
    gguf_path, manifest = packed_model
    from_manifest = list(k3stream.nonexpert_weights(manifest))
    from_gguf = list(k3stream.nonexpert_weights(gguf_path))
    assert [n for n, _ in from_manifest] == [n for n, _ in from_gguf]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(from_manifest, from_gguf, strict=True))


def test_manifest_messages(packed_model, tmp_path):
    _, manifest = packed_model
    value = json.loads(manifest.read_text())
    for change, message in [
        ({"complete": False}, "Kimi-K3 manifest is incomplete"),
        ({"format": "other"}, "Kimi-K3 manifest format is unsupported"),
    ]:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**value, **change}))
        with pytest.raises(ValueError) as excinfo:
            list(k3stream.nonexpert_weights(bad))
        assert str(excinfo.value) == message
    moved = json.loads(json.dumps(value))
    moved["source"]["shards"][1]["size"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(moved))
    with pytest.raises(FileNotFoundError, match="Kimi-K3 GGUF shard is missing or changed: "):
        list(k3stream.nonexpert_weights(bad))


def test_audited_profile_rejects_mla_projection_types_at_load(tiny_model):
    """sglang's MLA recipe check: after loading, split MLA layers must keep k_b Q4_0 (checked first)
    and v_b Q2_K."""
    with pytest.raises(ValueError, match=": Kimi-K3 MLA K projection must remain GGUF Q4_0$"):
        k3stream.load(tiny_model(recipe="f32", seed=1), LoadOptions(profile="audited"))


def test_model_loads_from_the_manifest(packed_model):
    gguf_path, manifest = packed_model
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(k3stream.load(manifest).logits(tokens), k3stream.load(gguf_path).logits(tokens))


def test_the_sglang_loader_is_a_generator(tmp_path):
    """As sglang's loader: calling it opens nothing; the first pair asked for opens and checks the file."""
    pairs = k3stream.nonexpert_weights(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        next(pairs)
