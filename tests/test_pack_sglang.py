"""Interoperability with sglang 0.5.23: its validator, writer, manifest writer,
run-time store and non-expert loader read our packs and manifests, and we read theirs.

sglang's modules are pure Python; they are loaded from their files in the sglang wheel, fetched once
with `pip download` into ~/.cache/k3stream-test (or $K3STREAM_TEST_CACHE). They are skipped only when
that download fails (offline), never with K3STREAM_REQUIRE_SGLANG=1; a wheel whose files moved fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3stream.cli import main as cli
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.manifest import load_manifest
from k3stream.pack.reader import ExpertPack
from k3stream.pack.source import checked_shards
from k3stream.pack.verify import verify_pack
from pack_helpers import TEST_CACHE, cached_tiny, copy_model, model_files
from test_pack import AUDITED

SGLANG = "sglang==0.5.23"
SGLANG_FILES = {
    "ggml": "sglang/srt/model_loader/expert_pack/kimi_ggml.py",
    "store": "sglang/srt/layers/moe/expert_pack.py",
    "loader": "sglang/srt/model_loader/kimi_k3_gguf.py",
}
REQUIRE_SGLANG = os.environ.get("K3STREAM_REQUIRE_SGLANG") == "1"
# the audited recipe (sglang's manifest writer insists on Q2_K/Q2_K/Q3_K experts) with top-k 16, which
# it hard-codes in the hard constraints; 21504/21504/26880-byte roles, so objects have padding
SGLANG_MODEL = {**AUDITED, "top_k": 16}  # sglang's validator insists on top-16
ABSOLUTE = BuildOptions(relative_paths=False, progress=False)


class WheelUnavailable(RuntimeError):
    """pip could not download the wheel (offline, or the index does not have it)."""


def _download_wheel(directory: Path) -> Path:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(directory), SGLANG]
    binary = ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.11"]
    binary += ["--platform", "manylinux_2_34_x86_64"]
    errors = []
    for command in (base, base + binary):  # the wheel is cp311-only: ask for it explicitly elsewhere
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            errors.append("timed out")
            continue
        if done.returncode == 0:
            return next(directory.glob("sglang-*.whl"))
        errors.append((done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1])
    raise WheelUnavailable(f"pip download --no-deps {SGLANG} failed: {'; '.join(errors)}")


def _downloaded_wheel(directory: Path) -> Path:
    """The wheel; a failed download skips the sglang tests, or fails them under K3STREAM_REQUIRE_SGLANG=1."""
    try:
        return _download_wheel(directory)
    except WheelUnavailable as exc:
        if REQUIRE_SGLANG:
            pytest.fail(f"K3STREAM_REQUIRE_SGLANG=1 but sglang's code is unavailable: {exc}")
        pytest.skip(f"sglang's code is unavailable: {exc}")


def _extract_sglang_files(target: Path) -> None:
    """Extract sglang's files into a scratch directory, then rename it to `target` whole. A member
    missing from the wheel raises KeyError: a changed wheel fails the tests instead of skipping them."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download, tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        with zipfile.ZipFile(_downloaded_wheel(Path(download))) as archive:
            for member in SGLANG_FILES.values():
                destination = Path(scratch) / "sglang" / member
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(archive.read(member))
        shutil.rmtree(target, ignore_errors=True)  # an incomplete copy left by an older, non-atomic run
        os.replace(Path(scratch) / "sglang", target)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"sglang_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def sglang():
    root = TEST_CACHE / SGLANG.replace("==", "-")
    if not all((root / member).is_file() for member in SGLANG_FILES.values()):
        _extract_sglang_files(root)
    return SimpleNamespace(**{name: _load(name, root / member) for name, member in SGLANG_FILES.items()})


def sglang_spec(sglang, gguf: Path):
    """sglang's model spec for a tiny model, handed over directly (its constructor from a config
    enforces the real model's dimensions)."""
    from k3stream.gguf.reader import K3Checkpoint

    config = K3Checkpoint.open(gguf).config
    return sglang.ggml.KimiK3Spec(
        num_hidden_layers=config.n_layers,
        first_k_dense_replace=config.n_dense,
        num_experts=config.n_experts,
        top_k=config.top_k,
        num_shared_experts=config.n_shared,
        hidden_size=config.hidden,
        routed_expert_hidden_size=config.latent,
        moe_intermediate_size=config.expert_ff,
        hidden_act="situ",
        active_moe_layer_ids=tuple(config.moe_layers),
    )


def sglang_expert_tensors(sglang, gguf: Path):
    shards = sglang.ggml.discover_gguf_shards(gguf.parent)
    shard_records, tensors, summary = sglang.ggml.scan_gguf_shards(shards)
    experts = {tensor.expert_key: tensor for tensor in tensors if tensor.expert_key is not None}
    return shard_records, tensors, summary, experts


@pytest.fixture
def our_build(sglang, tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path / "model")
    return gguf, build_pack(gguf, options=ABSOLUTE)


def test_sglang_validator_accepts_our_pack(sglang, our_build):
    gguf, result = our_build
    spec = sglang_spec(sglang, gguf)
    _, _, _, experts = sglang_expert_tensors(sglang, gguf)
    ours = json.loads(result.manifest.read_text())["expert_pack"]
    described = sglang.ggml.validate_ggml_moe_pack(result.pack, experts, spec, payload_samples=6)
    assert described == ours  # every field, index digest and role summaries included
    everything = sglang.ggml.validate_ggml_moe_pack(result.pack, experts, spec, payload_samples=10**6)
    assert everything["payload_samples_verified"] == ours["index_count"]  # all payloads, byte for byte


def test_source_inventory_matches_the_sglang_scan(sglang, our_build):
    gguf, result = our_build
    shard_records, tensors, summary, _ = sglang_expert_tensors(sglang, gguf)
    records = [
        {
            "name": t.name,
            "shape": list(t.shape),
            "dtype": t.dtype,
            "dtype_id": t.dtype_id,
            "shard_index": t.shard_index,
            "data_offset": t.data_offset,
            "nbytes": t.nbytes,
        }
        for t in sorted(tensors, key=lambda t: t.name)
    ]
    inventory = {"summary": summary, "shards": shard_records, "tensors": records}
    expected = {**inventory, "inventory_sha256": sglang.ggml.canonical_sha256(inventory)}
    assert json.loads(result.manifest.read_text())["source"] == expected


def test_sglang_built_pack_and_manifest_are_accepted_here(sglang, tiny_model, tmp_path, monkeypatch):
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path / "model")
    spec = sglang_spec(sglang, gguf)
    _, _, _, experts = sglang_expert_tensors(sglang, gguf)
    pack = tmp_path / "sglang" / "tiny-kimi-k3.expert-major.pack"
    sglang.ggml.write_ggml_moe_pack(pack, experts, spec)
    ours = build_pack(gguf, tmp_path / "ours" / "ours.pack", options=ABSOLUTE)
    assert pack.read_bytes() == ours.pack.read_bytes()

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**spec.__dict__, "num_experts_per_token": spec.top_k}))
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    # sglang's manifest writer, minus its check that the model is the real 2.8T one
    monkeypatch.setattr(sglang.ggml.KimiK3Spec, "validate_kimi_k3", lambda self: None)
    manifest = sglang.ggml.create_manifest(
        gguf_dir=gguf.parent,
        expert_pack=pack,
        model_config=config,
        tokenizer_dir=tmp_path / "tokenizer",
        full_pack_hash=True,
    )
    manifest_path = pack.with_name(pack.name + ".manifest.json")
    sglang.ggml.write_json_atomic(manifest_path, manifest)

    summary = verify_pack(manifest_path, full=True)
    assert (
        summary["sha256_in_manifest"]
        and summary["payloads_verified"] == manifest["expert_pack"]["index_count"]
    )
    with ExpertPack(manifest_path) as reader:
        assert reader.path == pack and reader.top_k == 16
        assert bytes(reader.read_object(1, 5)) == bytes(ExpertPack(ours.manifest).read_object(1, 5))
    assert [path for path, _ in checked_shards(load_manifest(manifest_path), manifest_path)] == sorted(
        gguf.parent.glob("*.gguf")
    )


def test_sglang_loader_reads_our_relative_manifest(sglang, tiny_model, tmp_path, monkeypatch):
    """sglang's non-expert loader resolves relative manifest paths against the working directory."""
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path)
    result = build_pack(gguf, options=BuildOptions(relative_paths=True, progress=False))
    monkeypatch.chdir(tmp_path)
    names = [name for name, _tensor in sglang.loader.kimi_k3_nonexpert_weights_iterator(result.manifest)]
    assert "model.embed_tokens.weight" in names and not any("exps" in name for name in names)


def test_sglang_loader_reads_our_default_manifest_from_anywhere(sglang, tiny_model, tmp_path, monkeypatch):
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path / "model")
    result = build_pack(gguf, options=BuildOptions(progress=False))
    monkeypatch.chdir(tmp_path)
    names = [name for name, _tensor in sglang.loader.kimi_k3_nonexpert_weights_iterator(result.manifest)]
    assert "model.embed_tokens.weight" in names


def _sglang_store_refusal(sglang, manifest_path: Path, pack: Path) -> str:
    """What sglang's run-time store says of a manifest, once its hard-coded real-model checks that
    come before the path check are met: a copy beside it claims 93 layers with MoE layers 1..92."""
    manifest = json.loads(manifest_path.read_text())
    manifest["model"].update(num_hidden_layers=93, active_moe_layer_ids=list(range(1, 93)))
    claimed = manifest_path.with_name("claimed.manifest.json")
    claimed.write_text(json.dumps(manifest))
    experts = manifest["model"]["num_experts"]
    with pytest.raises(ValueError) as refusal:
        sglang.store.KimiGGMLExpertPackStore(
            pack, manifest_path=claimed, expected_layers=93, expected_experts=experts, expected_top_k=16
        )
    return str(refusal.value)


PADDED_ROLES = "Kimi expert-pack role sizes do not match object bytes"  # the small model's roles are padded


def test_sglang_store_takes_the_path_of_a_default_build(sglang, tiny_model, tmp_path, monkeypatch):
    """`k3stream pack` with no flags writes the path sglang's store requires; a relative manifest is
    what it refuses (issue 13). The full load of a default build is `test_sglang_store_accepts_our_pack`."""
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path / "model")
    assert cli(["pack", str(gguf), "--no-progress"]) == 0
    manifest = gguf.parent / "tiny-kimi-k3.expert-major.pack.manifest.json"
    pack = gguf.parent / "tiny-kimi-k3.expert-major.pack"
    monkeypatch.chdir(tmp_path)
    # past the path, size, role order and role type checks
    assert _sglang_store_refusal(sglang, manifest, pack) == PADDED_ROLES
    assert cli(["pack", str(gguf), "--no-progress", "--force", "--relative-paths"]) == 0
    refusal = _sglang_store_refusal(sglang, manifest, pack)
    assert refusal == "Kimi manifest expert-pack path does not match pack_path"
    assert cli(["pack", str(gguf), "--no-progress", "--force", "--absolute-paths"]) == 0
    assert _sglang_store_refusal(sglang, manifest, pack) == PADDED_ROLES


def _two_dimensional_score(monkeypatch, tmp_path: Path) -> Path:
    """A tiny GGUF (hidden 256) whose `blk.0.attn_res_score.weight` is (2, 128) instead of (256,)."""
    from k3stream.gguf import writer
    from k3stream.testing.tiny import make_tiny

    plan, name = writer.tensor_plan, "blk.0.attn_res_score.weight"

    def planned(spec, vocab_size):
        tensors = plan(spec, vocab_size)
        return [dataclasses.replace(t, shape=(2, t.shape[0] // 2)) if t.name == name else t for t in tensors]

    monkeypatch.setattr(writer, "tensor_plan", planned)
    return make_tiny(tmp_path, writer.TinySpec(hidden=256))


def test_non_vector_residual_score_raises_the_sglang_message(sglang, tmp_path, monkeypatch):
    """sglang's message, not the generic shape check's, for a 2-D residual score."""
    import numpy as np
    import torch
    from gguf import GGUFReader

    from k3stream.gguf.reader import K3Checkpoint

    gguf = _two_dimensional_score(monkeypatch, tmp_path)
    score = next(t for t in GGUFReader(gguf).tensors if t.name == "blk.0.attn_res_score.weight")
    with pytest.raises(ValueError) as theirs:
        sglang.loader._residual_target_value(torch.from_numpy(np.array(score.data)), 0)
    with pytest.raises(ValueError) as ours:
        K3Checkpoint.open(gguf)
    message = "Kimi-K3 attention-residual score must be a vector, got (2, 128)"
    assert str(ours.value) == str(theirs.value) == message


def _grow(path: Path) -> None:
    with path.open("ab") as stream:
        stream.write(b"\0")


def _rename_tensor(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(b"blk.3.ffn_up_exps.weight")
    raw[at : at + 24] = b"blk.3.ffn_up_exps.weighu"
    path.write_bytes(raw)


@pytest.mark.parametrize(
    "change", [Path.unlink, _grow, _rename_tensor], ids=["missing", "resized", "renamed"]
)
def test_shard_checks_agree_with_the_sglang_loader(sglang, tiny_model, tmp_path, monkeypatch, change):
    gguf = copy_model(tiny_model(**SGLANG_MODEL), tmp_path)
    result = build_pack(gguf, options=BuildOptions(progress=False))
    change(tmp_path / "tiny-kimi-k3-00002-of-00002.gguf")
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError)) as theirs:
        list(sglang.loader.kimi_k3_nonexpert_weights_iterator(result.manifest))
    with pytest.raises((ValueError, FileNotFoundError)) as ours:
        checked_shards(load_manifest(result.manifest), result.manifest)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


# sglang's run-time store hard-codes the real model's structure: 93 layers, MoE 1..92, top-16,
# Q2_K/Q2_K/Q3_K, and (for contiguous objects) role sizes that are multiples of 4096
STORE_MODEL = {
    "recipe": "audited",
    "n_layers": 93,
    "n_experts": 16,
    "top_k": 16,
    "expert_ff": 256,
    "latent": 2048,  # up/gate 172032 bytes (42 pages), down 225280 (55 pages) per expert
    "hidden": 256,
    "kv_lora": 256,
    "qk_nope": 32,
    "shards": 2,
}


@pytest.fixture(scope="session")
def store_model() -> Path:
    """The 93-layer model, cached across sessions (about 0.9 GB; minutes to generate)."""
    return cached_tiny(**STORE_MODEL)


def _linked_model(first_shard: Path, directory: Path) -> Path:
    """The cached model's files hard-linked into `directory` (copied across file systems)."""
    directory.mkdir(parents=True)
    for path in model_files(first_shard):
        try:
            os.link(path, directory / path.name)
        except OSError:
            shutil.copyfile(path, directory / path.name)
    return directory / first_shard.name


@pytest.mark.slow
def test_sglang_store_accepts_our_pack(sglang, store_model, tmp_path):
    """A pack built by `k3stream pack` with no flags loads in sglang's run-time store (issue 13)."""
    gguf = _linked_model(store_model, tmp_path / "model")
    assert cli(["pack", str(gguf)]) == 0  # no flags at all
    pack = gguf.parent / "tiny-kimi-k3.expert-major.pack"
    manifest = pack.with_name(pack.name + ".manifest.json")
    assert verify_pack(manifest)["ok"]  # audited would also want 896 experts
    store = sglang.store.KimiGGMLExpertPackStore(
        pack, manifest_path=manifest, expected_layers=93, expected_experts=16, expected_top_k=16
    )
    try:
        with ExpertPack(manifest) as ours:
            for layer in ours.moe_layers:
                for expert in range(ours.num_experts):
                    assert store.object_offsets[(layer, expert)] == ours.object_range(layer, expert)[0]
            assert store.object_payload_bytes == ours.object_bytes
    finally:
        store.close()
