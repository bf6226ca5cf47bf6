"""GGUF side: shard discovery, config, reader inventory and views, profiles, inspect, dequantize."""

from __future__ import annotations

import dataclasses
import errno
import json
import mmap
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from conftest import NO_C_KERNELS, requires_llama
from k3stream import cli
from k3stream.commands.dequantize import dequantize_gguf
from k3stream.gguf.config import K3Config
from k3stream.gguf.profile import check_recipe
from k3stream.gguf.reader import K3Checkpoint
from k3stream.gguf.shards import discover_shards
from k3stream.gguf.writer import TinySpec, hparams
from llama_logits import llama_logits, relative_error
from llama_oracle import llama_runs
from pack_helpers import (
    UNIT_MATRICES,
    file_size_limit,
    open_file_paths,
    rewritten,
    with_leading_ones,
)

AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
SHARD = "tiny-kimi-k3-{:05d}-of-00003.gguf"


def rewrite(
    src: Path,
    dst: Path,
    *,
    arch: str = "kimi-k3",
    set_keys: dict[str, tuple[object, GGUFValueType]] | None = None,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    add_tensors: dict[str, np.ndarray] | None = None,
    retype: tuple[GGMLQuantizationType, GGMLQuantizationType] | None = None,
) -> Path:
    """Copy a GGUF with edited metadata or tensors (an independent writer: gguf's own).

    `retype=(old, new)` requantizes every tensor of type `old` as `new`.
    """
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch)
    set_keys = set_keys or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, vtype) in set_keys.items():
        writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors:
        if tensor.name in drop_tensors:
            continue
        data, ggml_type = np.asarray(tensor.data), tensor.tensor_type
        if retype and ggml_type == retype[0]:
            data, ggml_type = gguf_quantize(gguf_dequantize(data, ggml_type), retype[1]), retype[1]
        writer.add_tensor(tensor.name, data, raw_dtype=ggml_type)
    for name, values in (add_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture
def sharded(tiny_model, tmp_path) -> Path:
    """A private copy of a 3-shard tiny model (tests damage it)."""
    source = tiny_model(shards=3).parent
    copy = tmp_path / "sharded"
    shutil.copytree(source, copy)
    return copy


# ---------------------------------------------------------------------------------------------- shards


def test_discover_single_any_shard_and_directory(tiny_model, sharded):
    single = tiny_model()
    assert discover_shards(single) == [single]
    assert discover_shards(single.parent) == [single]
    expected = [sharded / SHARD.format(k) for k in (1, 2, 3)]
    assert discover_shards(sharded / SHARD.format(2)) == expected
    assert discover_shards(sharded) == expected


def test_missing_shard_names_it(sharded):
    (sharded / SHARD.format(2)).unlink()
    with pytest.raises(FileNotFoundError, match=r"00002-of-00003\.gguf: missing shard 2 of 3"):
        discover_shards(sharded / SHARD.format(1))


def test_mismatched_split_count(sharded, tmp_path):
    second = sharded / SHARD.format(2)
    rewrite(second, tmp_path / "x.gguf", set_keys={"split.count": (4, GGUFValueType.UINT16)}).replace(second)
    with pytest.raises(ValueError, match=r"00002-of-00003\.gguf: metadata key split.count is 4, expected 3"):
        discover_shards(sharded)


def test_wrong_architecture(tiny_model, tmp_path):
    bad = rewrite(tiny_model(), tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ValueError, match=r"llama\.gguf: metadata key general.architecture is 'llama'"):
        discover_shards(bad)


def with_non_utf8_string(source: Path, path: Path, key: str) -> Path:
    """A copy of `source` whose metadata string `key` (the first string of an array) starts with 0xFF,
    a byte UTF-8 never holds."""
    shutil.copyfile(source, path)
    field = GGUFReader(source).fields[key]
    value_at = field.offset + 8 + len(key) + 4 + (12 if field.types[0] == GGUFValueType.ARRAY else 0) + 8
    with path.open("r+b") as stream:
        stream.seek(value_at)
        stream.write(b"\xff")
    return path


@pytest.mark.parametrize("key", ["general.name", "tokenizer.ggml.tokens", "tokenizer.chat_template"])
def test_a_string_that_is_not_utf8_is_named_in_one_line(tiny_model, tmp_path, capsys, key):
    """Each command that reads the string refuses the file in one line naming it and the key (not
    Python's bare "'utf-8' codec can't decode"), and writes nothing."""
    path = with_non_utf8_string(tiny_model(), tmp_path / "model.gguf", key)
    commands = {
        "general.name": [["inspect", str(path)]],
        "tokenizer.ggml.tokens": [["generate", str(path), "--prompt", "hi", "--max-tokens", "1"]],
        "tokenizer.chat_template": [["pack", str(path), "--no-progress"]],
    }[key] + [["dequantize", str(path), str(tmp_path / "f32.gguf")]]
    for argv in commands:
        assert cli.main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"k3stream {argv[0]}: error: {path}: metadata key {key} holds a string that is not UTF-8 "
            "(byte 0xff at 0: invalid start byte)"
        ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_duplicate_tensor_across_shards(sharded, tmp_path):
    second = sharded / SHARD.format(2)
    extra = {"token_embd.weight": np.zeros((4, 4), dtype=np.float32)}
    rewrite(second, tmp_path / "x.gguf", add_tensors=extra).replace(second)
    with pytest.raises(
        ValueError, match=r"00002-of-00003\.gguf: tensor token_embd.weight is also in .*00001"
    ):
        discover_shards(sharded)


def test_directory_with_two_models_is_refused(tiny_model, sharded):
    shutil.copy(tiny_model(), sharded)
    with pytest.raises(ValueError, match="several GGUF models"):
        discover_shards(sharded)


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "fields",
    [{}, {"n_layers": 4, "mla_layers": (0, 2), "q_lora": None, "gate_lower_bound": None, "n_dense": 0}],
)
def test_config_values_equal_the_spec(tiny_model, fields):
    spec = TinySpec(**fields)
    config = K3Checkpoint.open(tiny_model(**fields)).config
    same_name = {f.name for f in dataclasses.fields(TinySpec)} & {
        f.name for f in dataclasses.fields(K3Config)
    }
    for name in same_name - {"mla_layers"}:
        assert getattr(config, name) == pytest.approx(getattr(spec, name)), name
    assert config.mla_layers == spec.mla_layer_ids()
    assert config.kda_layers == tuple(i for i in range(spec.n_layers) if i not in spec.mla_layer_ids())
    assert (config.n_heads, config.qk_nope, config.qk_rope) == (spec.kda_heads, spec.qk_nope, spec.qk_rope)
    assert config.dense_layers == tuple(range(spec.n_dense))
    assert config.moe_layers == tuple(range(spec.n_dense, spec.n_layers))
    assert [config.is_mla(i) for i in range(spec.n_layers)] == [
        i in config.mla_layers for i in range(spec.n_layers)
    ]
    assert config.vocab_size == GGUFReader(tiny_model(**fields)).fields["kimi-k3.vocab_size"].contents()


def test_config_missing_and_ill_typed_keys(tiny_model, tmp_path):
    missing = rewrite(tiny_model(), tmp_path / "missing.gguf", drop_keys=("kimi-k3.expert_count",))
    with pytest.raises(ValueError, match=r"missing\.gguf: missing metadata key kimi-k3.expert_count$"):
        K3Checkpoint.open(missing)
    typed = {"kimi-k3.expert_count": ("sixteen", GGUFValueType.STRING)}
    ill = rewrite(tiny_model(), tmp_path / "ill.gguf", set_keys=typed)
    with pytest.raises(ValueError, match=r"ill\.gguf: metadata key kimi-k3.expert_count must be an integer"):
        K3Checkpoint.open(ill)


# keys llama.cpp reads as optional (it loads a file without them), and what it takes in their place
LLAMA_OPTIONAL_KEYS = (
    "kimi-k3.vocab_size",  # the tokenizer's token count
    "kimi-k3.expert_weights_scale",  # 1.0
    "kimi-k3.expert_weights_norm",  # false
    "kimi-k3.attention.value_length",  # kv_lora_rank (the MLA latent is the value)
)


def test_keys_llama_cpp_does_without_take_its_defaults(tiny_model, tmp_path):
    source = tiny_model()
    checkpoint = K3Checkpoint.open(rewrite(source, tmp_path / "sparse.gguf", drop_keys=LLAMA_OPTIONAL_KEYS))
    tokens = GGUFReader(source).fields["tokenizer.ggml.tokens"]
    assert checkpoint.config.vocab_size == len(tokens.data) == 593
    assert (checkpoint.config.weights_scale, checkpoint.config.weights_norm) == (1.0, False)
    no_vocab = LLAMA_OPTIONAL_KEYS + ("tokenizer.ggml.tokens",)
    bare = rewrite(source, tmp_path / "bare.gguf", drop_keys=no_vocab)
    with pytest.raises(ValueError, match=r"bare\.gguf: missing metadata key kimi-k3.vocab_size"):
        K3Checkpoint.open(bare)


@requires_llama
def test_a_vocab_size_the_token_list_does_not_fill_is_refused_as_llama_cpp_refuses_it(tiny_model, tmp_path):
    """kimi-k3.vocab_size and the embedding say 600 rows, tokenizer.ggml.tokens holds 597 (a converter
    that dropped padding tokens): llama.cpp sizes the embedding by the tokens and refuses the file; k3stream
    loaded it, and a sampled id past the tokens had no text (a failed answer mid-stream)."""
    import subprocess
    import sys

    source = tiny_model(vocab=600)
    fields = GGUFReader(source).fields
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    arrays = {
        "tokenizer.ggml.tokens": (tokens[:597], GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (types[:597], GGUFValueType.ARRAY),
    }
    path = rewrite(source, tmp_path / "short.gguf", set_keys=arrays)
    load = "import sys, llama_cpp; llama_cpp.Llama(sys.argv[1], n_ctx=32, verbose=False)"
    assert subprocess.run([sys.executable, "-c", load, str(path)], capture_output=True).returncode != 0
    line = (
        f"{path}: metadata key kimi-k3.vocab_size must be 597, the tokens in tokenizer.ggml.tokens, got 600"
    )
    for argv in (["inspect", str(path)], ["pack", str(path), "--no-progress"]):
        assert cli.main(argv) == 1
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        K3Checkpoint.open(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.gguf"]


@requires_llama
def test_default_and_zero_routing_scale_and_norm_match_llama_cpp(tiny_model, tmp_path):
    """llama.cpp weights the routed experts by 1.0 where expert_weights_scale is absent or 0, and does
    not renormalise them without expert_weights_norm: a large rms eps keeps the scale visible after the
    routed output's RMS norm."""
    import k3stream

    eps = {"kimi-k3.attention.layer_norm_rms_epsilon": (0.3, GGUFValueType.FLOAT32)}
    base = rewrite(tiny_model(seed=5), tmp_path / "eps.gguf", set_keys=eps)
    zero = {"kimi-k3.expert_weights_scale": (0.0, GGUFValueType.FLOAT32)}
    paths = [
        rewrite(base, tmp_path / "sparse.gguf", drop_keys=LLAMA_OPTIONAL_KEYS),
        rewrite(base, tmp_path / "zero.gguf", set_keys=zero),
    ]
    tokens = [5, 70, 300, 9, 11, 592]
    references = llama_logits([(path, tokens) for path in paths], tmp_path, n_batch=1)
    for path, reference in zip(paths, references, strict=True):
        assert relative_error(k3stream.load(path).logits(tokens).numpy(), reference) < 1e-4, path.name


@requires_llama
def test_per_layer_arrays_of_head_count_and_feed_forward_length_read_as_llama_cpp(tiny_model, tmp_path):
    """llama.cpp reads attention.head_count and feed_forward_length as one value or an array of one per
    layer (MoE layers' entries unused): such a file gives llama.cpp's logits."""
    import k3stream

    arrays = {
        "kimi-k3.attention.head_count": ([4] * 6, GGUFValueType.ARRAY),
        "kimi-k3.feed_forward_length": ([96, 0, 0, 0, 0, 0], GGUFValueType.ARRAY),
    }
    path = rewrite(tiny_model(seed=6), tmp_path / "arrays.gguf", set_keys=arrays)
    config = K3Checkpoint.open(path).config
    assert (config.n_heads, config.dense_ff) == (4, 96)
    tokens = [5, 70, 300, 9]
    (reference,) = llama_logits([(path, tokens)], tmp_path, n_batch=1)
    assert relative_error(k3stream.load(path).logits(tokens).numpy(), reference) < 1e-4


@requires_llama
@pytest.mark.parametrize(
    "edit",
    [{"set_keys": {"kimi-k3.feed_forward_length": ([0] * 6, GGUFValueType.ARRAY)}},
     {"set_keys": {"kimi-k3.feed_forward_length": (0, GGUFValueType.UINT32)}},
     {"drop_keys": ("kimi-k3.feed_forward_length",)}],
    ids=["zeros", "zero", "absent"],
)  # fmt: skip
def test_a_model_without_dense_layers_needs_no_feed_forward_length(tiny_model, tmp_path, edit):
    """Where every layer is MoE no layer reads feed_forward_length, and llama.cpp takes it optional: a
    file that leaves it out, or gives 0 or zeros per layer, loads, packs and gives llama.cpp's logits."""
    import k3stream
    from k3stream.pack.builder import BuildOptions, build_pack

    path = rewrite(tiny_model(n_dense=0, seed=8), tmp_path / "moe.gguf", **edit)
    assert K3Checkpoint.open(path).config.dense_ff == 0
    tokens = [5, 70, 300, 9, 41]
    (reference,) = llama_logits([(path, tokens)], tmp_path, n_batch=1)
    assert relative_error(k3stream.load(path).logits(tokens).numpy(), reference) < 1e-4
    manifest = build_pack(path, options=BuildOptions(progress=False)).manifest
    assert relative_error(k3stream.load(manifest).logits(tokens).numpy(), reference) < 1e-4


@requires_llama
def test_tensors_with_trailing_unit_dimensions_load_as_llama_cpp_loads_them(tiny_model, tmp_path):
    """GGML ignores trailing dimensions of 1 (numpy's leading ones): llama.cpp runs a norm or a bias
    stored as [64, 1] or [16, 1, 1], a matrix as [64, 96, 1] and an expert tensor as [in, out, n, 1],
    and k3stream gives its logits; a residual score stays refused with sglang's message (its loader
    takes vectors only)."""
    import k3stream

    shapes = {
        "output_norm.weight": (1, 64),
        "blk.1.exp_probs_b.bias": (1, 1, 16),
        "blk.2.ffn_norm.weight": (1, 64),
        "blk.0.ssm_a": (1, 4),
        "blk.3.attn_kv_a_norm.weight": (1, 1, 1, 32),
    }
    source = tiny_model(seed=2)
    shapes |= with_leading_ones(source, UNIT_MATRICES)
    path = rewritten(source, tmp_path / "units.gguf", shapes)
    assert K3Checkpoint.open(path).info("blk.0.ffn_down.weight").shape == (64, 96)
    tokens = [5, 70, 300, 9]
    (reference,) = llama_logits([(path, tokens)], tmp_path, n_batch=1)
    assert relative_error(k3stream.load(path).logits(tokens).numpy(), reference) < 1e-4
    score = {"blk.1.attn_res_score.weight": (1, 64)}
    scored = rewritten(tiny_model(seed=2), tmp_path / "score.gguf", score)
    with pytest.raises(ValueError, match=r"attention-residual score must be a vector, got \(1, 64\)"):
        K3Checkpoint.open(scored)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kimi-k3.attention.head_count", [4, 4, 4, 4, 4, 8], r"head_count must be one value >= 1 for layers"),
        (
            "kimi-k3.feed_forward_length",
            [96, 0],
            r"feed_forward_length must be an integer >= 1 or an array of 6",
        ),
        ("kimi-k3.attention.head_count_kv", [0, 1], "head_count_kv must be an array of 6 values"),
        ("kimi-k3.expert_weights_norm", 1, "expert_weights_norm must be a bool"),
        ("kimi-k3.attention.key_length", 7, "key_length must be 40"),
        ("kimi-k3.expert_used_count", 17, "expert_used_count must be <= expert_count"),
    ],
)
def test_config_rejects_inconsistent_values(key, value, message):
    fields = hparams(TinySpec(), 593) | {key: value}
    with pytest.raises(ValueError, match=f"^model.gguf: metadata key .*{message}"):
        K3Config.from_metadata(fields, source="model.gguf")


# ---------------------------------------------------------------------------------------------- reader


def test_inventory_matches_gguf_reader_and_file_bytes(tiny_model):
    first = tiny_model(**AUDITED, shards=3)
    checkpoint = K3Checkpoint.open(first)
    shards = discover_shards(first)
    seen = set()
    for index, path in enumerate(shards):
        for tensor in GGUFReader(path).tensors:
            info = checkpoint.tensors[tensor.name]
            seen.add(tensor.name)
            assert (info.shard_index, info.path, info.ggml_type) == (index, path, int(tensor.tensor_type))
            assert (info.data_offset, info.nbytes) == (tensor.data_offset, tensor.n_bytes)
            assert info.shape == tuple(reversed(tensor.shape.tolist()))
            block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
            assert info.nbytes == int(np.prod(info.shape)) // block_elems * block_bytes
    assert seen == set(checkpoint.tensors)
    for name in ("blk.3.attn_k_b.weight", "blk.5.ffn_down_exps.weight", "output_norm.weight"):
        info = checkpoint.tensors[name]
        with open(info.path, "rb") as f:
            f.seek(info.data_offset)
            assert checkpoint.raw(name).tobytes() == f.read(info.nbytes)


def _mapped_base(array: np.ndarray) -> object:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def test_raw_and_array_are_read_only_views_of_the_mmap(tiny_model):
    checkpoint = K3Checkpoint.open(tiny_model())
    raw = checkpoint.raw("output.weight")
    assert not raw.flags.owndata and not raw.flags.writeable
    assert isinstance(_mapped_base(raw), mmap.mmap)
    array = checkpoint.array("output.weight")
    assert array.dtype == np.float32 and array.shape == checkpoint.tensors["output.weight"].shape
    assert np.shares_memory(array, raw)
    with pytest.raises(ValueError, match="read-only"):
        array[0, 0] = 1.0


def test_expert_slice_is_one_expert(tiny_model):
    checkpoint = K3Checkpoint.open(tiny_model())
    name = "blk.2.ffn_down_exps.weight"
    for expert in (0, 7, 15):
        piece = checkpoint.expert_slice(name, expert)
        assert np.shares_memory(piece, checkpoint.raw(name))
        np.testing.assert_array_equal(piece.view(np.float32), checkpoint.array(name)[expert].ravel())
    with pytest.raises(IndexError, match="expert 16 outside 0..15"):
        checkpoint.expert_slice(name, 16)
    with pytest.raises(ValueError, match="blk.2.ffn_norm.weight is not a routed expert tensor"):
        checkpoint.expert_slice("blk.2.ffn_norm.weight", 0)


def test_quantized_expert_slice_dequantizes_to_that_expert(tiny_model):
    checkpoint = K3Checkpoint.open(tiny_model(**AUDITED))
    name = "blk.1.ffn_up_exps.weight"
    info = checkpoint.tensors[name]
    whole = gguf_dequantize(np.asarray(checkpoint.raw(name)).reshape(info.shape[0], info.shape[1], -1), 10)
    piece = np.asarray(checkpoint.expert_slice(name, 5)).reshape(info.shape[1], -1)
    np.testing.assert_array_equal(gguf_dequantize(piece, 10), whole[5])


def test_shape_mismatch_names_the_tensor(tiny_model, tmp_path):
    changed = {"kimi-k3.expert_feed_forward_length": (64, GGUFValueType.UINT32)}
    bad = rewrite(tiny_model(), tmp_path / "ff.gguf", set_keys=changed)
    with pytest.raises(
        ValueError, match=r"ff\.gguf: tensor blk.1.ffn_gate_exps.weight has shape \(16, 32, 32\)"
    ):
        K3Checkpoint.open(bad)


def test_missing_tensor_named_and_optional_one_allowed(tiny_model, tmp_path):
    bad = rewrite(tiny_model(), tmp_path / "no_a.gguf", drop_tensors=("blk.0.ssm_a",))
    with pytest.raises(ValueError, match=r"no_a\.gguf: missing tensor blk.0.ssm_a "):
        K3Checkpoint.open(bad)
    fine = rewrite(tiny_model(), tmp_path / "no_norm.gguf", drop_tensors=("blk.1.ffn_routed_norm.weight",))
    assert "blk.1.ffn_routed_norm.weight" not in K3Checkpoint.open(fine).tensors


def test_unexpected_tensor_named(tiny_model, tmp_path):
    extra = {"blk.0.rope_freqs.weight": np.zeros(4, dtype=np.float32)}
    bad = rewrite(tiny_model(), tmp_path / "extra.gguf", add_tensors=extra)
    with pytest.raises(ValueError, match=r"extra\.gguf: unexpected tensor blk.0.rope_freqs.weight"):
        K3Checkpoint.open(bad)


# ---------------------------------------------------------------------------------------------- profiles


def test_audited_profile_accepts_the_recipe(tiny_model):
    checkpoint = K3Checkpoint.open(tiny_model(**AUDITED, shards=2), profile="audited")
    assert checkpoint.profile.name == "audited"
    assert check_recipe(checkpoint) == []


def test_check_recipe_lists_every_deviation(tiny_model):
    checkpoint = K3Checkpoint.open(tiny_model())
    deviations = check_recipe(checkpoint)
    spec = TinySpec()
    assert len(deviations) == 3 * (spec.n_layers - spec.n_dense) + 2 * len(spec.mla_layer_ids())
    assert "blk.3.attn_k_b.weight is F32, the audited recipe has Q4_0" in deviations


def test_audited_profile_raises_sglangs_messages(tiny_model, tmp_path):
    k_b = "tensor blk.3.attn_k_b.weight is F32: Kimi-K3 MLA K projection must remain GGUF Q4_0"
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{tiny_model()}: {k_b}')}$"):
        K3Checkpoint.open(tiny_model(), profile="audited")
    audited = tiny_model(**AUDITED)
    values = K3Checkpoint.open(audited).raw("blk.3.attn_v_b.weight")
    v_b = gguf_dequantize(np.asarray(values).reshape(4, 16, -1), 10)
    bad = rewrite(
        audited,
        tmp_path / "v.gguf",
        drop_tensors=("blk.3.attn_v_b.weight",),
        add_tensors={"blk.3.attn_v_b.weight": v_b},
    )
    v_b = "tensor blk.3.attn_v_b.weight is F32: Kimi-K3 MLA V projection must remain GGUF Q2_K"
    with pytest.raises(ValueError, match=rf"^{re.escape(f'{bad}: {v_b}')}$"):
        K3Checkpoint.open(bad, profile="audited")
    assert K3Checkpoint.open(bad).tensors["blk.3.attn_v_b.weight"].type_name == "F32"


def test_unknown_profile(tiny_model):
    with pytest.raises(ValueError, match="unknown checkpoint profile 'strict'"):
        K3Checkpoint.open(tiny_model(), profile="strict")


# ---------------------------------------------------------------------------------------------- inspect


def test_inspect_json(tiny_model, capsys):
    path = tiny_model(**AUDITED, shards=2)
    assert cli.main(["inspect", str(path), "--json", "--profile", "audited"]) == 0
    report = json.loads(capsys.readouterr().out)
    tensors = [t for shard in discover_shards(path) for t in GGUFReader(shard).tensors]
    routed = sum(t.n_bytes for t in tensors if t.name.endswith("_exps.weight"))
    assert report["bytes"]["routed_experts"] == routed
    assert report["bytes"]["non_expert"] == sum(t.n_bytes for t in tensors) - routed
    assert report["bytes"]["expert_object"] == routed // (5 * 16)
    assert report["types"]["Q2_K"]["tensors"] == sum(t.tensor_type.name == "Q2_K" for t in tensors) == 12
    assert [row["attention"] for row in report["layers"]] == ["KDA", "KDA", "KDA", "MLA", "KDA", "MLA"]
    assert [row["ffn"] for row in report["layers"]] == ["dense"] + ["MoE"] * 5
    assert report["profile"] == "audited" and report["audited_recipe"] is True
    assert [s["tensors"] for s in report["shards"]] == [80, 80]
    assert report["config"]["latent"] == 256


def test_inspect_text_and_profile_failure(tiny_model, capsys):
    assert cli.main(["inspect", str(tiny_model())]) == 0
    text = capsys.readouterr().out
    assert "audited recipe: no (19 deviations)" in text
    assert "layers: 0:KDA/dense 1:KDA/MoE 2:KDA/MoE 3:MLA/MoE 4:KDA/MoE 5:MLA/MoE" in text
    assert cli.main(["inspect", str(tiny_model()), "--profile", "audited"]) == 1
    said = (
        f"{tiny_model()}: tensor blk.3.attn_k_b.weight is F32: Kimi-K3 MLA K projection must remain GGUF Q4_0"
    )
    assert capsys.readouterr().err == f"k3stream inspect: error: {said}\n"


def test_inspect_escapes_what_a_terminal_would_act_on_in_the_name(tiny_model, tmp_path, capsys):
    """general.name is the file author's text: an escape sequence, a NUL or a right-to-left override is
    printed escaped (it went to the terminal raw), a name of megabytes cut; the JSON keeps it whole."""
    name = "Kimi\u2011K3 \U0001f984 \x1b]0;owned\x07\x1b[2J\u202eRTL\x00" + "x" * 100_000
    path = rewrite(
        tiny_model(), tmp_path / "named.gguf", set_keys={"general.name": (name, GGUFValueType.STRING)}
    )
    assert cli.main(["inspect", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"{path}  (Kimi\u2011K3 \U0001f984 \\x1b]0;owned\\x07\\x1b[2J\\u202eRTL\\x00xxx")
    assert first.endswith("x..., 1 shard(s))") and len(first) < 400 and first.isprintable()
    assert cli.main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == name


# ---------------------------------------------------------------------------------------------- dequantize


def assert_all_f32_as_gguf_dequantizes(before: K3Checkpoint, after: K3Checkpoint) -> None:
    assert list(after.tensors) == list(before.tensors)
    for name, info in before.tensors.items():
        assert after.tensors[name].type_name == "F32"
        expected = gguf_dequantize(np.asarray(before.raw(name)).reshape(*info.shape[:-1], -1), info.ggml_type)
        np.testing.assert_array_equal(after.array(name), expected.reshape(info.shape))


def test_dequantize_rewrite_matches_gguf_dequantize(tiny_model, tmp_path):
    source = tiny_model(**AUDITED, shards=2)
    out = dequantize_gguf(source, tmp_path / "f32.gguf")
    before, after = K3Checkpoint.open(source), K3Checkpoint.open(out)
    assert_all_f32_as_gguf_dequantizes(before, after)
    assert after.metadata("tokenizer.ggml.tokens") == before.metadata("tokenizer.ggml.tokens")
    assert after.metadata("split.count") is None and after.metadata("general.file_type") == 0
    assert after.config == dataclasses.replace(before.config, source=str(out))


@pytest.mark.parametrize("float_type", [GGMLQuantizationType.F16, GGMLQuantizationType.BF16])
def test_all_f32_widens_f16_and_bf16_exactly(tiny_model, tmp_path, float_type):
    source = rewrite(
        tiny_model(recipe="f16"), tmp_path / "in.gguf", retype=(GGMLQuantizationType.F16, float_type)
    )
    kept = K3Checkpoint.open(dequantize_gguf(source, tmp_path / "kept.gguf"))
    assert {info.type_name for info in kept.tensors.values()} == {"F32", float_type.name}
    assert kept.metadata("general.file_type") == 1  # MOSTLY_F16
    widened = tmp_path / "f32.gguf"
    assert cli.main(["dequantize", str(source), str(widened), "--all-f32"]) == 0
    before, after = K3Checkpoint.open(source), K3Checkpoint.open(widened)
    assert_all_f32_as_gguf_dequantizes(before, after)
    assert after.metadata("general.file_type") == 0


@requires_llama
def test_llama_cpp_runs_the_dequantized_rewrite(tiny_model, tmp_path):
    source = tiny_model(**AUDITED)
    out = dequantize_gguf(source, tmp_path / "f32.gguf")
    prompt = "The quick brown fox jumps over the lazy dog."
    (_, quantized), (_, rewritten) = llama_runs((source, prompt), (out, prompt))
    assert np.isfinite(rewritten).all()
    # llama.cpp rounds activations to Q8_K/Q8_0 for quantized weights (and that can flip a routed
    # expert), so the two agree only loosely
    assert np.corrcoef(quantized.ravel(), rewritten.ravel())[0, 1] > 0.9


def test_failed_dequantize_leaves_no_temp_file_or_open_writer(tiny_model, tmp_path):
    source = tiny_model()
    out = tmp_path / "f32.gguf"
    with file_size_limit(source.stat().st_size // 2), pytest.raises(OSError) as failure:
        dequantize_gguf(source, out)
    assert failure.value.errno == errno.EFBIG
    assert list(tmp_path.iterdir()) == []
    assert not [path for path in open_file_paths() if str(out) in path]


def test_dequantize_larger_than_the_free_space_is_refused_before_writing(tiny_model, tmp_path, monkeypatch):
    """An F32 rewrite is up to 16x its quantized source: one that cannot fit fails before the first byte
    (it wrote until the disk was full)."""
    source = tiny_model(**AUDITED)
    needed = sum(int(np.prod(info.shape)) * 4 for info in K3Checkpoint.open(source).tensors.values())
    free = needed - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    with pytest.raises(OSError, match=f"not enough free space in {tmp_path} .*{free} bytes free") as failure:
        dequantize_gguf(source, tmp_path / "f32.gguf")
    assert failure.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("alignment", [64, 4096])
def test_dequantize_of_a_file_with_another_alignment_writes_a_valid_gguf(tiny_model, tmp_path, alignment):
    """general.alignment is the layout of the file that declares it: the F32 copy, laid out by gguf's writer
    at its own 32 bytes, declared the source's and was refused by llama.cpp, k3stream and gguf alike."""
    source, aligned = tiny_model(), tmp_path / "aligned.gguf"
    reader, writer = GGUFReader(source), GGUFWriter(aligned, "kimi-k3")
    writer.data_alignment = alignment
    writer.add_custom_alignment(alignment)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert {int(t.data_offset) % alignment for t in GGUFReader(aligned).tensors} == {0}
    out = dequantize_gguf(aligned, tmp_path / "f32.gguf")
    copied = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    for tensor in reader.tensors:
        assert np.array_equal(copied[tensor.name], np.asarray(tensor.data)), tensor.name
    K3Checkpoint.open(out)


def test_cli_dequantize_refuses_to_overwrite(tiny_model, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep")
    assert cli.main(["dequantize", str(tiny_model()), str(out)]) == 1
    assert out.read_bytes() == b"keep"
    assert cli.main(["dequantize", str(tiny_model()), str(out), "--force"]) == 0
    assert K3Checkpoint.open(out).tensors.keys() == K3Checkpoint.open(tiny_model()).tensors.keys()


def test_cli_dequantize_into_a_new_folder_or_onto_a_folder(tiny_model, tmp_path, capsys):
    """OUT in a folder that does not exist yet is written there (as `pack --out`); OUT naming a folder
    is refused in one line before any work, with or without --force."""
    out = tmp_path / "new" / "f32.gguf"
    assert cli.main(["dequantize", str(tiny_model()), str(out)]) == 0
    assert K3Checkpoint.open(out).tensors.keys() == K3Checkpoint.open(tiny_model()).tensors.keys()
    capsys.readouterr()
    for force in ((), ("--force",)):
        assert cli.main(["dequantize", str(tiny_model()), str(tmp_path / "new"), *force]) == 1
        wanted = f"k3stream dequantize: error: OUT {tmp_path / 'new'}: names a folder; give the file to write"
        wanted += "\n"
        assert capsys.readouterr().err == wanted
    # a folder that does not exist yet, spelled as one (`later/`): refused too, not written as a file
    later = f"{tmp_path / 'later'}/"
    assert cli.main(["dequantize", str(tiny_model()), later]) == 1
    assert (
        capsys.readouterr().err
        == f"k3stream dequantize: error: OUT {later}: names a folder; give the file to write\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["new"]
    assert [path.name for path in (tmp_path / "new").iterdir()] == ["f32.gguf"]


def test_cli_dequantize_never_replaces_its_source_even_with_force(tiny_model, tmp_path, capsys):
    from pack_helpers import copy_model, snapshot

    source = copy_model(tiny_model(shards=2), tmp_path)
    (tmp_path / "link.gguf").symlink_to(sorted(tmp_path.glob("*.gguf"))[1])
    before = snapshot(tmp_path)
    for out in (source, tmp_path / "link.gguf"):  # the named shard, a link to the other one
        assert cli.main(["dequantize", str(source), str(out), "--force"]) == 1
        assert "is the source file" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "in_c,threads", [(True, 1), (True, 2), (False, 1)], ids=["extension", "extension-2-threads", "python"]
)
def test_read_parts_copies_the_file_bytes_and_names_a_tensor_cut_short(
    tiny_model, tmp_path, monkeypatch, in_c, threads
):
    """A decode step's expert reads (`read_parts`, one C call, or os.preadv without the extension): the
    bytes the map holds, in order; a part past the end of a shrunk file is a one-line error naming it.
    The extension reads a megabyte or more on several threads: the same bytes, the same error."""
    import torch

    from k3stream.quant.kernels import cpu

    if in_c and not cpu.available():
        pytest.skip(NO_C_KERNELS)
    monkeypatch.setattr(cpu, "available", lambda: in_c)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model(seed=3), path)
    checkpoint = K3Checkpoint.open(path)
    names = [name for name in checkpoint.tensors if "exps" in name][:3]
    whole = [(name, 0, checkpoint.info(name).nbytes) for name in names]
    many = whole * -(-(1 << 20) // sum(n for *_, n in whole))  # a megabyte and more: threads read it
    for parts in ([(name, 7 * i, 100 + i) for i, name in enumerate(names)] + [(names[0], 0, 0)], many):
        got = checkpoint.read_parts(parts)
        expected = np.concatenate([checkpoint.raw(name)[start : start + n] for name, start, n in parts])
        assert got.flags.writeable and np.array_equal(got, expected)
    last = max(checkpoint.tensors.values(), key=lambda info: info.data_offset)
    tail = next(name for name, info in checkpoint.tensors.items() if info is last)
    with open(path, "r+b") as handle:
        handle.truncate(last.data_offset + 10)
    for before in ([(names[0], 0, 10)], many):
        with pytest.raises(ValueError, match=f"model.gguf: tensor {tail} is cut short"):
            checkpoint.read_parts(before + [(tail, 0, last.nbytes)] + many)
