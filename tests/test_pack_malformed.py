"""Malformed packs, manifests and changed shards: each fails with its (sglang's) one-line message,
through `verify_pack`, the reader and the CLI, and nothing is written."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFReader

from k3stream.cli import main as cli
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.manifest import inventory_sha256, load_manifest
from k3stream.pack.reader import ExpertPack
from k3stream.pack.source import checked_shards
from k3stream.pack.verify import verify_pack
from pack_helpers import copy_model, read_index, snapshot

MANIFEST = "tiny-kimi-k3.expert-major.pack.manifest.json"
PACK = "tiny-kimi-k3.expert-major.pack"
SHARD2 = "tiny-kimi-k3-00002-of-00002.gguf"


@pytest.fixture(scope="module")
def pristine(tiny_model, tmp_path_factory) -> Path:
    """A split F32 model (6 layers, MoE 1..5, 16 experts, top-4) with its pack and manifest; relative
    paths, so each test's copy of the folder reads its own (damaged) files."""
    directory = tmp_path_factory.mktemp("pristine")
    options = BuildOptions(progress=False, relative_paths=True)
    build_pack(copy_model(tiny_model(shards=2), directory), options=options)
    return directory


@pytest.fixture
def work(pristine, tmp_path) -> Path:
    directory = tmp_path / "work"
    shutil.copytree(pristine, directory)
    return directory


def edit_manifest(directory: Path, change: Callable[[dict], None], keep_inventory: bool = True) -> None:
    path = directory / MANIFEST
    manifest = json.loads(path.read_text())
    change(manifest)
    if keep_inventory:  # edits of source records would otherwise stop at the inventory hash
        manifest["source"]["inventory_sha256"] = inventory_sha256(manifest["source"])
    path.write_text(json.dumps(manifest))


def set_pack_size(directory: Path) -> None:
    """After changing the pack's length: make the manifest agree, to reach the later checks."""
    size = (directory / PACK).stat().st_size
    edit_manifest(directory, lambda manifest: manifest["expert_pack"].update(size=size))


def patch(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as stream:
        stream.seek(offset)
        stream.write(data)


def entry_offset(index: int) -> int:
    return 40 + 152 * index


def truncate_pack(directory: Path, size: int) -> None:
    with (directory / PACK).open("r+b") as stream:
        stream.truncate(size)
    set_pack_size(directory)


def set_entry(directory: Path, index: int, **fields: int) -> None:
    _header, entries = read_index(directory / PACK)
    name, expert, reserved, offset, nbytes = entries[index]
    values = {"expert": expert, "reserved": reserved, "offset": offset, "nbytes": nbytes, **fields}
    raw = struct.pack(
        "<128siIQQ", name.encode(), values["expert"], values["reserved"], values["offset"], values["nbytes"]
    )
    patch(directory / PACK, entry_offset(index), raw)


def swap_entries(directory: Path, first: int, second: int) -> None:
    raw = (directory / PACK).read_bytes()
    one, two = (raw[entry_offset(i) : entry_offset(i) + 152] for i in (first, second))
    patch(directory / PACK, entry_offset(first), two)
    patch(directory / PACK, entry_offset(second), one)


def append_to_pack(directory: Path, nbytes: int) -> None:
    with (directory / PACK).open("ab") as stream:
        stream.write(bytes(nbytes))


def move_gate_of_first_object(directory: Path) -> None:
    """Gate one page later: aligned, in range, after up, yet not where the object's layout puts it."""
    _header, entries = read_index(directory / PACK)
    set_entry(directory, 1, offset=entries[1][3] + 4096)


def garbage_after_name_nul(directory: Path) -> None:
    """Bytes after a name's NUL: the name still reads the same, but the index digest changes."""
    patch(directory / PACK, entry_offset(0) + 100, b"x")


PACK_CASES = {
    "truncated header": (lambda d: truncate_pack(d, 20), "Kimi expert-pack header is truncated"),
    "truncated index": (lambda d: truncate_pack(d, 40 + 152 * 10), "Kimi expert-pack index is truncated"),
    "wrong magic": (
        lambda d: patch(d / PACK, 0, b"GGMLMOEPACKv2"),
        "Kimi expert-pack header does not match its manifest",
    ),
    "wrong version": (
        lambda d: patch(d / PACK, 16, struct.pack("<I", 2)),
        "Kimi expert-pack header does not match its manifest",
    ),
    "wrong index count": (
        lambda d: patch(d / PACK, 24, struct.pack("<Q", 239)),
        "Kimi expert-pack header does not match its manifest",
    ),
    "nonzero reserved": (
        lambda d: set_entry(d, 7, reserved=1),
        "Kimi expert-pack identity mismatch at index 7",
    ),
    "wrong expert": (lambda d: set_entry(d, 9, expert=2), "Kimi expert-pack identity mismatch at index 9"),
    "roles out of order": (lambda d: swap_entries(d, 3, 4), "Kimi expert-pack identity mismatch at index 3"),
    "unaligned payload": (
        lambda d: set_entry(d, 5, offset=read_index(d / PACK)[1][5][3] + 16),
        "Kimi expert-pack range mismatch at index 5",
    ),
    "overlapping payload": (
        lambda d: set_entry(d, 5, offset=read_index(d / PACK)[1][4][3]),
        "Kimi expert-pack range mismatch at index 5",
    ),
    "wrong payload size": (
        lambda d: set_entry(d, 2, nbytes=4095),
        "Kimi expert-pack range mismatch at index 2",
    ),
    "payload past the end": (
        lambda d: set_entry(d, 239, offset=1 << 40),
        "Kimi expert-pack range mismatch at index 239",
    ),
    "object not contiguous": (move_gate_of_first_object, "Kimi expert object is not contiguous at index 1"),
    "trailing bytes": (
        lambda d: (append_to_pack(d, 4096), set_pack_size(d)),
        "Kimi expert-pack file has trailing or missing bytes",
    ),
    "missing bytes": (
        lambda d: truncate_pack(d, (d / PACK).stat().st_size - 1),
        "Kimi expert-pack range mismatch at index 239",
    ),
    "pack grew": (lambda d: append_to_pack(d, 1), "Kimi expert-pack size does not match its manifest"),
    "index digest": (garbage_after_name_nul, "Kimi expert-pack index SHA-256 does not match manifest"),
}


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def change(manifest: dict) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


MANIFEST_CASES = {
    "complete false": (_set("complete", False), "Kimi expert-pack manifest is incomplete or unsupported"),
    "other format": (
        _set("format", "SGLANG-EXPERTPACK-v1"),
        "Kimi expert-pack manifest is incomplete or unsupported",
    ),
    "hard constraints": (
        _set("hard_constraints", "expert_pruning_allowed", True),
        "Kimi manifest hard constraints do not match runtime policy",
    ),
    "top-k constraint": (
        _set("hard_constraints", "top_k", 16),
        "Kimi manifest hard constraints do not match runtime policy",
    ),
    "dimensions": (
        _set("model", "num_experts", 17),
        "Kimi expert-pack dimensions (6, 17, 4) != (6, 16, 4); Top-K is immutable at 4",
    ),
    "layer count": (
        _set("model", "num_hidden_layers", 93),
        "Kimi expert-pack dimensions (93, 16, 4) != (6, 16, 4); Top-K is immutable at 4",
    ),
    "active layers": (
        _set("model", "active_moe_layer_ids", [1, 2, 3, 4]),
        "Kimi active routed MoE layers must be exactly 1..5",
    ),
    "latent width": (
        _set("model", "routed_expert_hidden_size", 64),
        "Kimi manifest model.routed_expert_hidden_size 64 != 32 of the model",
    ),
    "size": (_set("expert_pack", "size", 4096), "Kimi expert-pack size does not match its manifest"),
    "role order": (
        _set("expert_pack", "physical_role_order", ["down", "gate", "up"]),
        "Kimi expert-pack physical role order is unsupported",
    ),
    "role dtype": (
        _set("expert_pack", "roles", "up", "dtype", "F16"),
        "Kimi expert-pack up quant type is unsupported",
    ),
    "role dtype id": (
        _set("expert_pack", "roles", "down", "dtype_id", 1),
        "Kimi expert-pack down quant type is unsupported",
    ),
    "role bytes": (
        _set("expert_pack", "roles", "gate", "expert_bytes", 2048),
        "Kimi expert-pack gate role does not match GGUF tensor blk.1.ffn_gate_exps.weight",
    ),
    "object bytes": (
        _set("expert_pack", "object_bytes", 12289),
        "Kimi expert-pack role sizes do not match object bytes",
    ),
    "data start": (
        _set("expert_pack", "data_start", 40960),
        "Kimi expert-pack header does not match its manifest",
    ),
    "index digest": (
        _set("expert_pack", "index_sha256", "0" * 64),
        "Kimi expert-pack index SHA-256 does not match manifest",
    ),
    "source records": (
        lambda m: m["source"]["tensors"].pop(),
        "Kimi manifest source inventory SHA-256 does not match its records",
    ),
}


def check_fails(directory: Path, message: str) -> None:
    """verify_pack and the reader fail with `message` (a prefix for the role case); nothing is written."""
    before = snapshot(directory)
    manifest = directory / MANIFEST
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        verify_pack(manifest)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)
    if not message.startswith("Kimi-K3 GGUF"):  # the reader leaves shard checks to verify and the loader
        with pytest.raises((ValueError, FileNotFoundError)) as caught:
            ExpertPack(manifest)
        assert str(caught.value).startswith(message)
    assert snapshot(directory) == before


@pytest.mark.parametrize("case", PACK_CASES, ids=list(PACK_CASES))
def test_malformed_pack(work, case):
    damage, message = PACK_CASES[case]
    damage(work)
    check_fails(work, message)


@pytest.mark.parametrize("case", MANIFEST_CASES, ids=list(MANIFEST_CASES))
def test_edited_manifest(work, case):
    change, message = MANIFEST_CASES[case]
    edit_manifest(work, change, keep_inventory=case != "source records")
    check_fails(work, message)


def test_cli_prints_one_line_and_fails(work, capsys):
    swap_entries(work, 3, 4)
    assert cli(["verify", str(work / MANIFEST)]) == 1
    assert (
        capsys.readouterr().err == "k3stream verify: error: Kimi expert-pack identity mismatch at index 3\n"
    )
    assert cli(["verify", str(work / MANIFEST), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["error"] == "Kimi expert-pack identity mismatch at index 3"


def test_a_pack_cut_short_names_its_file_and_both_sizes(work, capsys):
    """A pack copied in part (an interrupted rsync, a full disk): the one line says which file and by how
    much, after sglang's words."""
    size = (work / PACK).stat().st_size
    with (work / PACK).open("r+b") as stream:
        stream.truncate(size // 2)
    wanted = (
        f"Kimi expert-pack size does not match its manifest: {work / PACK} is {size // 2} bytes, "
        f"the manifest records {size}"
    )
    assert cli(["verify", str(work / MANIFEST)]) == 1
    assert capsys.readouterr().err == f"k3stream verify: error: {wanted}\n"
    with pytest.raises(ValueError) as caught:
        ExpertPack(work / MANIFEST)
    assert str(caught.value) == wanted


def test_manifest_naming_another_pack(work, tmp_path):
    (work / PACK).rename(work / "moved.pack")
    check_fails(work, "Kimi expert-pack or manifest is missing")
    (work / "moved.pack").rename(work / PACK)
    named = (
        f"Kimi manifest expert-pack path does not match pack_path: {work / MANIFEST} names "
        f"{(work / PACK).resolve()}, not {(tmp_path / 'other.pack').resolve()}"
    )
    for opened in (verify_pack, ExpertPack):
        with pytest.raises(ValueError) as caught:
            opened(work / MANIFEST, pack_path=tmp_path / "other.pack")
        assert str(caught.value) == named


def test_audited_profile_messages(work):
    with pytest.raises(ValueError, match="^Kimi manifest hard constraints do not match runtime policy$"):
        verify_pack(work / MANIFEST, profile="audited")
    edit_manifest(work, _set("hard_constraints", "top_k", 16))
    # the audited profile's words are sglang's, verbatim
    with pytest.raises(
        ValueError,
        match=r"^Kimi expert-pack dimensions \(6, 16, 4\) != \(93, 896, 16\); Top-K is immutable at 16$",
    ):
        verify_pack(work / MANIFEST, profile="audited")
    edit_manifest(
        work, lambda m: m["model"].update(num_hidden_layers=93, num_experts=896, num_experts_per_token=16)
    )
    with pytest.raises(ValueError, match=r"^Kimi active routed MoE layers must be exactly 1\.\.92$"):
        verify_pack(work / MANIFEST, profile="audited")


# ------------------------------------------------------------------------------------------------
# shards changed after packing


def tensor_type_offset(path: Path, name: str) -> int:
    """File offset of a tensor info's GGML type field (after its name and dimensions)."""
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return tensor.field.offset + 8 + len(name) + 4 + 8 * len(tensor.shape)


def grow_shard(directory: Path) -> None:
    with (directory / SHARD2).open("ab") as stream:
        stream.write(b"\0")


def rename_general_name(directory: Path) -> None:
    """Same size, same tensors, other metadata bytes."""
    shard = directory / "tiny-kimi-k3-00001-of-00002.gguf"
    raw = shard.read_bytes()
    patch(shard, raw.index(b"tiny-kimi-k3"), b"tiny-kimi-k4")


def rename_tensor(directory: Path) -> None:
    raw = (directory / SHARD2).read_bytes()
    patch(directory / SHARD2, raw.index(b"blk.4.ffn_up_exps.weight"), b"blk.4.ffn_up_exps.weighu")


def change_type(directory: Path) -> None:
    """F32 -> I32, a type of the same size (one of another size breaks the data layout, which the header
    check refuses first)."""
    patch(
        directory / SHARD2,
        tensor_type_offset(directory / SHARD2, "blk.5.ffn_norm.weight"),
        struct.pack("<I", 26),
    )


SHARD_CASES = {
    "shard missing": (lambda d: (d / SHARD2).unlink(), "Kimi-K3 GGUF shard is missing or changed: {shard2}"),
    "shard resized": (grow_shard, "Kimi-K3 GGUF shard is missing or changed: {shard2}"),
    "shard metadata": (rename_general_name, "Kimi-K3 GGUF shard is missing or changed: {shard1}"),
    "tensor renamed": (rename_tensor, "Kimi-K3 GGUF shard inventory changed: {shard2}"),
    "tensor type": (change_type, "Kimi-K3 GGUF tensor type changed: blk.5.ffn_norm.weight"),
}


@pytest.mark.parametrize("case", SHARD_CASES, ids=list(SHARD_CASES))
def test_shard_changed_after_packing(work, case):
    change, message = SHARD_CASES[case]
    change(work)
    message = message.format(shard1=work / "tiny-kimi-k3-00001-of-00002.gguf", shard2=work / SHARD2)
    check_fails(work, message)
    if case != "shard metadata":  # the loader's checks are sglang's: size, names, types
        with pytest.raises((ValueError, FileNotFoundError), match=f"^{message}$"):
            checked_shards(load_manifest(work / MANIFEST), work / MANIFEST)


def test_checked_shards_returns_records_per_shard(pristine):
    shards = checked_shards(load_manifest(pristine / MANIFEST), pristine / MANIFEST)
    assert [path.name for path, _ in shards] == ["tiny-kimi-k3-00001-of-00002.gguf", SHARD2]
    for path, records in shards:
        assert sorted(r["name"] for r in records) == sorted(t.name for t in GGUFReader(str(path)).tensors)


def test_load_manifest_messages(work):
    edit_manifest(work, _set("complete", False))
    with pytest.raises(ValueError, match="^Kimi-K3 manifest is incomplete$"):
        load_manifest(work / MANIFEST)
    edit_manifest(work, _set("format", "other"))
    with pytest.raises(ValueError, match="^Kimi-K3 manifest format is unsupported$"):
        load_manifest(work / MANIFEST)
    (work / MANIFEST).write_text("{")
    with pytest.raises(ValueError, match="manifest is not valid JSON"):
        load_manifest(work / MANIFEST)


def test_builder_refuses_a_broken_gguf_and_writes_nothing(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(shards=2), tmp_path)
    with gguf.open("r+b") as stream:
        stream.truncate(1000)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as caught:
        build_pack(gguf, options=BuildOptions(progress=False))
    assert "\n" not in str(caught.value) and str(gguf) in str(caught.value)
    assert snapshot(tmp_path) == before
