"""Building, verifying and reading expert packs of tiny Kimi-K3 GGUFs (F32 and the Q2_K/Q3_K recipe)."""

from __future__ import annotations

import errno
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from k3stream.cli import main as cli
from k3stream.pack.builder import BuildOptions, Copier, build_lock, build_pack
from k3stream.pack.fileio import write_json_atomic
from k3stream.pack.reader import ExpertPack
from k3stream.pack.verify import verify_pack
from pack_helpers import (
    copy_model,
    file_size_limit,
    model_files,
    oracle_expert_bytes,
    oracle_slice,
    read_index,
    snapshot,
)

SPLIT = {"shards": 2}  # F32, 5 MoE layers x 16 experts, 4096-byte roles: contiguous objects
AUDITED = {  # routed up/gate Q2_K, down Q3_K: 21504/21504/26880-byte roles, padded to 4 KiB
    "recipe": "audited",
    "n_layers": 4,
    "hidden": 256,
    "latent": 256,
    "expert_ff": 256,
    "kv_lora": 256,
    "qk_nope": 32,
    "shards": 2,
}
QUIET = BuildOptions(progress=False)


@pytest.fixture(params=[{}, SPLIT, AUDITED], ids=["single-f32", "split-f32", "split-audited"])
def built(request, tiny_model, tmp_path):
    """A private copy of a tiny model with its pack built at the default place."""
    gguf = copy_model(tiny_model(**request.param), tmp_path / "model")
    return gguf, build_pack(gguf, options=QUIET)


def test_layout_matches_the_published_format(built):
    gguf, result = built
    header, entries = read_index(result.pack)
    experts = {name: count for name, (count, _raw) in oracle_expert_bytes(gguf).items()}
    layers = sorted({int(name.split(".")[1]) for name in experts})
    num_experts = next(iter(experts.values()))
    assert header == (b"GGMLMOEPACKv1\0\0\0", 1, 40, len(layers) * num_experts * 3, header[4])
    assert header[4] == -(-(40 + 152 * header[3]) // 4096) * 4096
    expected_order = [
        (f"blk.{layer}.ffn_{role}_exps.weight", expert)
        for layer in layers
        for expert in range(num_experts)
        for role in ("up", "gate", "down")
    ]
    assert [(name, expert) for name, expert, *_ in entries] == expected_order
    previous_end = header[4]
    for _name, _expert, reserved, offset, nbytes in entries:
        assert reserved == 0 and offset % 4096 == 0 and offset >= previous_end
        assert offset - previous_end < 4096  # only alignment padding between payloads
        previous_end = offset + nbytes
    assert result.pack.stat().st_size == previous_end  # no trailing bytes


def test_payloads_are_verbatim_gguf_slices(built):
    gguf, result = built
    oracle = oracle_expert_bytes(gguf)
    _header, entries = read_index(result.pack)
    with result.pack.open("rb") as pack:
        for name, expert, _reserved, offset, nbytes in entries:
            pack.seek(offset)
            assert pack.read(nbytes) == oracle_slice(oracle, name, expert), (name, expert)


def test_default_outputs_and_verify(built):
    gguf, result = built
    stem = gguf.name.split("-0000")[0].removesuffix(".gguf")
    assert result.pack == gguf.parent / f"{stem}.expert-major.pack"
    assert result.manifest == gguf.parent / f"{stem}.expert-major.pack.manifest.json"
    assert sorted(path.name for path in gguf.parent.iterdir() if "pack" in path.name) == [
        result.pack.name,
        result.manifest.name,
    ]  # no partial, journal or lock left behind
    summary = verify_pack(result.manifest, full=True)
    assert summary["ok"] and summary["payloads_verified"] == summary["index_count"]


def test_reader_slices_match_the_gguf(built):
    gguf, result = built
    oracle = oracle_expert_bytes(gguf)
    with ExpertPack(result.manifest) as pack:
        assert pack.path == result.pack and pack.gguf_paths[0] == gguf
        assert pack.moe_layers == tuple(sorted({int(name.split(".")[1]) for name in oracle}))
        for layer in (pack.moe_layers[0], pack.moe_layers[-1]):
            for expert in (0, pack.num_experts - 1):
                offset, nbytes = pack.object_range(layer, expert)
                data = bytes(pack.read_object(layer, expert))
                assert len(data) == nbytes
                for role, piece in pack.role_slices(layer, expert).items():
                    name = f"blk.{layer}.ffn_{role}_exps.weight"
                    start = piece.offset - offset
                    assert data[start : start + piece.nbytes] == oracle_slice(oracle, name, expert)


def test_reader_serves_threads_at_once_and_refuses_reads_once_closed(built):
    gguf, result = built
    oracle = oracle_expert_bytes(gguf)
    pack = ExpertPack(result.manifest)
    keys = [(layer, expert) for layer in pack.moe_layers for expert in range(pack.num_experts)]
    start = threading.Barrier(4)

    def read_all(shift: int) -> list[bytes]:
        start.wait()  # the four threads read through the one descriptor at the same time
        order = keys[shift:] + keys[:shift]
        return [bytes(pack.read_object(*key)) for key in order]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(read_all, range(0, 4 * 7, 7)))
    for shift, objects in zip(range(0, 4 * 7, 7), results, strict=True):
        for (layer, expert), data in zip(keys[shift:] + keys[:shift], objects, strict=True):
            first, _ = pack.object_range(layer, expert)
            up = pack.role_slices(layer, expert)["up"]
            piece = data[up.offset - first : up.offset - first + up.nbytes]
            assert piece == oracle_slice(oracle, f"blk.{layer}.ffn_up_exps.weight", expert)
    pack.close()
    pack.close()  # idempotent
    with pytest.raises(ValueError, match="closed ExpertPack"):
        pack.read_object(*keys[0])


def test_role_shapes_are_out_by_in(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(expert_ff=64, latent=32), tmp_path)
    result = build_pack(gguf, options=QUIET)
    with ExpertPack(result.manifest) as pack:
        slices = pack.role_slices(pack.moe_layers[0], 3)
    assert slices["up"].shape == slices["gate"].shape == (64, 32)  # (expert_ff, latent)
    assert slices["down"].shape == (32, 64)  # (latent, expert_ff)
    assert {piece.ggml_type for piece in slices.values()} == {0}
    assert slices["up"].nbytes == 64 * 32 * 4


def test_reader_refuses_unknown_layer_and_expert(tiny_model, tmp_path):
    result = build_pack(copy_model(tiny_model(**SPLIT), tmp_path), options=QUIET)
    with ExpertPack(result.manifest) as pack:
        with pytest.raises(KeyError, match="layer 0 has no routed experts"):
            pack.object_range(0, 0)
        with pytest.raises(KeyError, match="expert 16 is out of range"):
            pack.role_slices(1, 16)


def test_default_manifest_is_absolute_and_survives_moving_the_directory(tiny_model, tmp_path, caplog):
    """sglang's form by default; once the folder moves, its files are found beside the manifest,
    and a note says so once."""
    gguf = copy_model(tiny_model(**SPLIT), tmp_path / "a")
    result = build_pack(gguf, options=QUIET)
    manifest = json.loads(result.manifest.read_text())
    assert manifest["expert_pack"]["path"] == str(result.pack)
    assert [shard["path"] for shard in manifest["source"]["shards"]] == [str(p) for p in model_files(gguf)]
    (tmp_path / "a").rename(tmp_path / "b")
    moved = tmp_path / "b" / result.manifest.name
    with caplog.at_level("WARNING", logger="k3stream.pack.paths"):
        assert verify_pack(moved, full=True)["pack"] == str(tmp_path / "b" / result.pack.name)
        with ExpertPack(moved) as pack:
            assert pack.gguf_paths == model_files(tmp_path / "b" / gguf.name)
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [
        f"manifest paths in {tmp_path / 'a'} are gone: reading those files beside the manifest in "
        f"{tmp_path / 'b'} (folder moved)"
    ]


def test_relative_manifest_survives_moving_the_directory(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path / "a")
    result = build_pack(gguf, options=BuildOptions(relative_paths=True, progress=False))
    manifest = json.loads(result.manifest.read_text())
    assert manifest["expert_pack"]["path"] == result.pack.name
    assert manifest["source"]["shards"][0]["path"] == gguf.name
    (tmp_path / "a").rename(tmp_path / "b")
    assert verify_pack(tmp_path / "b" / result.manifest.name, full=True)["ok"]


def test_absolute_paths(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path / "model")
    out = tmp_path / "elsewhere" / "experts.pack"
    result = build_pack(gguf, out, options=BuildOptions(relative_paths=False, progress=False))
    manifest = json.loads(result.manifest.read_text())
    assert result.manifest == out.with_name("experts.pack.manifest.json")
    assert manifest["expert_pack"]["path"] == str(out)
    assert all(Path(shard["path"]).is_absolute() for shard in manifest["source"]["shards"])
    assert verify_pack(result.manifest)["ok"]


def test_refuses_to_overwrite_without_force(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    first = build_pack(gguf, options=QUIET)
    before = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match="refusing to overwrite existing expert pack"):
        build_pack(gguf, options=QUIET)
    assert snapshot(tmp_path) == before
    second = build_pack(gguf, options=BuildOptions(force=True, progress=False))
    assert second.pack.read_bytes() == first.pack.read_bytes()
    assert verify_pack(second.manifest)["ok"]


def test_force_never_replaces_the_source_gguf_and_the_pack_is_not_its_manifest(tiny_model, tmp_path):
    """--force replaces outputs, never the GGUF they are made from (a shard by its name or a link), and
    the pack and its manifest are two files: each refused in one line before anything is written."""
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    (tmp_path / "link.gguf").symlink_to(sorted(tmp_path.glob("*.gguf"))[1])
    before = snapshot(tmp_path)
    force = BuildOptions(force=True, progress=False)
    for out, manifest in ((gguf, None), (None, gguf), (tmp_path / "x.pack", tmp_path / "link.gguf")):
        with pytest.raises(ValueError, match="is the source file .*; choose another path$"):
            build_pack(gguf, out, manifest, options=force)
    with pytest.raises(ValueError, match="the pack and its manifest would be one file"):
        build_pack(gguf, tmp_path / "x.pack", tmp_path / "x.pack", options=force)
    assert snapshot(tmp_path) == before


def test_pack_and_manifest_outputs_that_name_a_folder_are_refused(tiny_model, tmp_path, capsys):
    """`--out`/`--manifest` naming a folder (one there, or one spelled `dir/` that does not exist yet,
    which was written as the file `dir`) are refused in one line before anything is written, with or
    without --force (an existing folder was 'refusing to overwrite ... use --force', then Errno 21)."""
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    (tmp_path / "folder").mkdir()
    before = snapshot(tmp_path)
    for flag, path in [
        ("--out", f"{tmp_path}/folder"),
        ("--out", f"{tmp_path}/later/"),
        ("--manifest", f"{tmp_path}/later/"),
    ]:
        for force in ((), ("--force",)):
            assert cli(["pack", str(gguf), flag, path, *force]) == 1
            err = capsys.readouterr().err
            assert err.endswith(": names a folder; give the file to write\n") and flag in err, err
            assert len(err.splitlines()) == 1 and snapshot(tmp_path) == before


def test_second_builder_cannot_take_the_lock(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    lock = build_lock(tmp_path / "tiny-kimi-k3.expert-major.pack")
    with lock, pytest.raises(RuntimeError, match="another k3stream pack build holds"):
        build_pack(gguf, options=QUIET)
    assert not list(tmp_path.glob("*.pack*"))


def test_checks_free_space_before_writing(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(OSError, match="not enough free space"):
        build_pack(gguf, options=BuildOptions(margin_bytes=1 << 60, progress=False))
    assert snapshot(tmp_path) == before


def test_cli_pack_and_verify(tiny_model, tmp_path, capsys):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    assert cli(["pack", str(gguf), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "resumed   0 bytes" in out and "copy_file_range" in out
    manifest = tmp_path / "tiny-kimi-k3.expert-major.pack.manifest.json"
    assert cli(["verify", str(manifest), "--full", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["full"] and report["index_count"] == 5 * 16 * 3
    assert cli(["pack", str(gguf), "--no-progress"]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err


def test_quick_verify_samples_payloads_and_full_compares_all(tiny_model, tmp_path, capsys):
    """Scramble every payload byte: quick verify's sampled objects fail their checksums (it read no
    payload before issue 11), --full names the first payload that differs from the GGUF."""
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    result = build_pack(gguf, options=QUIET)
    header, entries = read_index(result.pack)
    with result.pack.open("r+b") as pack:
        for _name, _expert, _reserved, offset, nbytes in entries:
            pack.seek(offset)
            pack.write(os.urandom(nbytes))
    assert cli(["verify", str(result.manifest)]) == 1
    assert "expert-pack checksum mismatch: layer 1 expert 0" in capsys.readouterr().err
    assert cli(["verify", str(result.manifest), "--full"]) == 1
    assert capsys.readouterr().err.strip() == (
        "k3stream verify: error: expert-pack payload does not match GGUF source for "
        "blk.1.ffn_up_exps.weight expert 0"
    )


def test_samples_beyond_the_objects_check_every_object(tiny_model, tmp_path, capsys):
    """More samples than a pack holds objects check all of them: quick verify's 8 samples of 4 objects
    checked only the first two, and `pack --payload-samples 1000000000` looped a billion times."""
    gguf = copy_model(tiny_model(n_layers=2, n_experts=4, top_k=2), tmp_path)  # one MoE layer: 4 objects
    result = build_pack(gguf, options=BuildOptions(payload_samples=1_000_000_000, progress=False))
    pack_section = json.loads(result.manifest.read_text())["expert_pack"]
    assert pack_section["payload_samples_verified"] == 4 * 3  # every entry: 4 experts x 3 roles
    _header, entries = read_index(result.pack)
    with result.pack.open("r+b") as pack:
        for _name, expert, _reserved, offset, nbytes in entries:
            if expert == 3:  # the last object
                pack.seek(offset)
                pack.write(os.urandom(nbytes))
    assert cli(["verify", str(result.manifest)]) == 1
    assert "expert-pack checksum mismatch: layer 1 expert 3" in capsys.readouterr().err


def test_full_verify_checks_the_stored_sha256(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    result = build_pack(gguf, options=BuildOptions(full_hash=True, progress=False))
    manifest = json.loads(result.manifest.read_text())
    assert manifest["expert_pack"]["full_pack_hash"] is True
    _header, entries = read_index(result.pack)
    with result.pack.open("r+b") as pack:  # a padding byte: no payload changes, the file hash does
        pack.seek(entries[0][3] - 1)
        pack.write(b"\1")
    assert verify_pack(result.manifest)["ok"]
    with pytest.raises(ValueError, match="^Kimi expert-pack SHA-256 does not match manifest$"):
        verify_pack(result.manifest, full=True)


def test_audited_profile_rejects_a_tiny_model(tiny_model, tmp_path):
    result = build_pack(copy_model(tiny_model(**AUDITED), tmp_path), options=QUIET)
    assert verify_pack(result.manifest, profile="generic")["ok"]
    with pytest.raises(ValueError, match="^Kimi manifest hard constraints do not match runtime policy$"):
        verify_pack(result.manifest, profile="audited")


def test_any_shard_or_the_directory_names_the_same_outputs(tiny_model, tmp_path):
    gguf = copy_model(tiny_model(**SPLIT), tmp_path)
    second = tmp_path / "tiny-kimi-k3-00002-of-00002.gguf"
    result = build_pack(second, options=QUIET)
    assert result.pack == tmp_path / "tiny-kimi-k3.expert-major.pack"
    again = build_pack(tmp_path, options=BuildOptions(force=True, progress=False))
    assert (again.pack, again.manifest) == (result.pack, result.manifest)
    with ExpertPack(again.manifest) as pack:
        assert pack.gguf_paths == [gguf, second]


def test_copier_fallback_copies_the_same_bytes(tmp_path):
    source, target = tmp_path / "source.bin", tmp_path / "target.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    source.write_bytes(data)
    for kernel_copy in (True, False):
        copier = Copier()
        copier.kernel_copy = kernel_copy
        src, dst = os.open(source, os.O_RDONLY), os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            copier.copy(src, 5, dst, 4096, len(data) - 5)
            with pytest.raises(RuntimeError, match="short read from the GGUF"):
                copier.copy(src, len(data) - 10, dst, 0, 20)
        finally:
            os.close(src)
            os.close(dst)
        assert target.read_bytes()[4096:] == data[5:]


def assert_only_the_old_json(path: Path) -> None:
    assert json.loads(path.read_text()) == {"old": True}
    assert [child.name for child in path.parent.iterdir()] == [path.name]


def test_json_write_failing_midway_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "pack.manifest.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(TypeError):  # json.dump has streamed the list into the temp file by then
        write_json_atomic(path, {"a": list(range(100_000)), "z": object()})
    assert_only_the_old_json(path)


def test_json_write_on_a_full_disk_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "pack.manifest.json"
    write_json_atomic(path, {"old": True})
    with file_size_limit(64 * 1024), pytest.raises(OSError) as failure:
        write_json_atomic(path, {"a": list(range(100_000))})
    assert failure.value.errno == errno.EFBIG and failure.value.filename == str(path)  # `pack` names it
    assert_only_the_old_json(path)


def _split_without_tensors_first(source: Path, directory: Path) -> Path:
    """`source` rewritten (by gguf's own writer) as 2 shards, the metadata alone in shard 1 and every
    tensor in shard 2, as `gguf-split --no-tensor-first-split` writes a set."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(source)
    directory.mkdir()
    paths = [directory / f"split-{k:05d}-of-00002.gguf" for k in (1, 2)]
    for index, path in enumerate(paths):
        writer = GGUFWriter(path, "kimi-k3")
        for key, field in reader.fields.items() if index == 0 else ():
            if not key.startswith("GGUF.") and key != "general.architecture":
                sub_type = field.types[-1] if len(field.types) > 1 else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
        writer.add_uint16("split.no", index)
        writer.add_uint16("split.count", 2)
        writer.add_int32("split.tensors.count", len(reader.tensors))
        for tensor in reader.tensors if index == 1 else ():
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths[0]


def test_a_split_set_whose_first_shard_holds_only_metadata_packs_and_verifies(tiny_model, tmp_path):
    import k3stream

    first = _split_without_tensors_first(tiny_model(), tmp_path / "model")
    result = build_pack(first, options=QUIET)
    assert verify_pack(result.manifest, full=True)["ok"]
    tokens = [5, 70, 300]
    expected = k3stream.load(tiny_model()).logits(tokens)
    assert (k3stream.load(result.manifest).logits(tokens) == expected).all()
