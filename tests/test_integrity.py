"""Expert-byte integrity: per-object xxh3_64 recorded at pack time and checked as objects enter the store's
cache; quick `verify` catches damaged or swapped packs and GGUFs without `--full`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash

from k3stream.gguf.reader import K3Checkpoint
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.fileio import write_json_atomic
from k3stream.pack.integrity import ChecksumMismatch
from k3stream.pack.reader import ExpertPack
from k3stream.pack.verify import verify_pack
from k3stream.store import ExpertStore
from pack_helpers import copy_model

MIB = 1 << 20
QUIET = BuildOptions(progress=False)
# the fixtures copy model folders and damage the copies: relative paths make a copy read its own files
# (an absolute manifest in a copy reads the original's while they exist)
COPYABLE = BuildOptions(progress=False, relative_paths=True)


def _build(gguf: Path, directory: Path) -> Path:
    model = copy_model(gguf, directory)
    return build_pack(model, options=COPYABLE).manifest


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """(pristine manifest, manifest of a same-shape model with other weights), packed once per module."""
    root = tmp_path_factory.mktemp("integrity")
    return _build(tiny_model(), root / "a"), _build(tiny_model(seed=1), root / "b")


@pytest.fixture
def work(built, tmp_path) -> Path:
    """A private copy of the pristine model folder (GGUF, pack, manifest); returns its manifest."""
    shutil.copytree(built[0].parent, tmp_path / "a")
    return tmp_path / "a" / built[0].name


def _pack_of(manifest: Path) -> Path:
    return manifest.parent / json.loads(manifest.read_text())["expert_pack"]["path"]


def _flip_bit(path: Path, offset: int) -> None:
    with path.open("r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)[0]
        stream.seek(offset)
        stream.write(bytes([byte ^ 0x10]))


def _store(manifest: Path, pack: ExpertPack | None = None) -> ExpertStore:
    pack = pack or ExpertPack(manifest)
    return ExpertStore(pack, ram_mib=pack.top_k * 4 * pack.object_bytes / MIB, prefetch=False)


def test_manifest_records_every_object_digest(built):
    manifest = json.loads(built[0].read_text())
    section = manifest["integrity"]
    with ExpertPack(built[0]) as pack:
        objects = [(layer, expert) for layer in pack.moe_layers for expert in range(pack.num_experts)]
        assert section["algorithm"] == "xxh3_64" and section["objects"] == len(objects)
        digests = [xxhash.xxh3_64_intdigest(bytes(pack.read_object(*key))) for key in objects]
    assert section["object_digests"] == "".join(f"{d:016x}" for d in digests)
    assert set(section["shard_fingerprints"]) == {"0"}


def test_flipped_bit_fails_the_fetch_is_counted_and_never_cached(work):
    with ExpertPack(work) as pack:
        layer = pack.moe_layers[1]
        offset, nbytes = pack.object_range(layer, 5)
    _flip_bit(_pack_of(work), offset + nbytes // 2)
    with _store(work) as store:
        for attempt in (1, 2):  # the bad object is read again, not served from the cache
            with pytest.raises(ChecksumMismatch) as caught:
                store.fetch(layer, [0, 5])
            message = str(caught.value)
            assert f"layer {layer} expert 5 of {_pack_of(work).name}" in message and "\n" not in message
            assert store.stats()["integrity_errors"] == attempt
            assert (layer, 5) not in store._compute.buffers
        assert sorted(store.fetch(layer, [0, 1])) == [0, 1]  # the rest of the pack still serves
        assert store.stats()["integrity_checks"] is True


def test_prefetch_of_a_damaged_object_does_not_poison_the_demand_fetch(work):
    with ExpertPack(work) as pack:
        layer = pack.moe_layers[0]
        offset, _ = pack.object_range(layer, 2)
    _flip_bit(_pack_of(work), offset)
    pack = ExpertPack(work)
    store = ExpertStore(pack, ram_mib=pack.top_k * 4 * pack.object_bytes / MIB, adaptive_prefetch=False)
    with store:
        store.prefetch(layer, [2, 3])
        with pytest.raises(ChecksumMismatch):
            store.fetch(layer, [2])
        assert (layer, 2) not in store._compute.buffers


def test_manifest_without_checksums_still_serves_and_verify_says_so(work, capsys):
    from k3stream.cli import main

    manifest = json.loads(work.read_text())
    del manifest["integrity"]
    write_json_atomic(work, manifest)
    with ExpertPack(work) as pack, _store(work, pack) as store:
        assert pack.checksums is None
        store.fetch(pack.moe_layers[0], [0, 1])
        assert store.stats()["integrity_checks"] is False
    summary = verify_pack(work)
    assert summary["checksums"] is None and summary["objects_hashed"] == 0
    assert main(["verify", str(work)]) == 0
    assert "no checksums" in capsys.readouterr().out


def test_quick_verify_catches_a_damaged_sampled_object(work):
    with ExpertPack(work) as pack:
        offset, _ = pack.object_range(pack.moe_layers[0], 0)  # the first object is always sampled
    _flip_bit(_pack_of(work), offset + 100)
    with pytest.raises(ChecksumMismatch, match="checksum mismatch: layer 1 expert 0 of"):
        verify_pack(work)


def test_quick_verify_catches_a_same_shape_pack_swap(work, built):
    shutil.copyfile(_pack_of(built[1]), _pack_of(work))
    with pytest.raises(ChecksumMismatch, match="checksum mismatch"):
        verify_pack(work)


def test_quick_verify_catches_a_shard_path_to_another_models_gguf(work, built):
    manifest = json.loads(work.read_text())
    other = built[1].parent / Path(manifest["source"]["shards"][0]["path"]).name
    # another model with the same spec but other weights: same size, same metadata bytes
    assert other.stat().st_size == (work.parent / other.name).stat().st_size
    shutil.copyfile(other, work.parent / other.name)
    with pytest.raises(FileNotFoundError, match="Kimi-K3 GGUF shard is missing or changed"):
        verify_pack(work)


def test_full_verify_hashes_every_object(work):
    manifest = json.loads(work.read_text())
    digests = manifest["integrity"]["object_digests"]
    assert verify_pack(work, full=True)["objects_hashed"] == len(digests) // 16
    # a digest no sample reaches (the object before the last): only hashing every object finds it
    manifest["integrity"]["object_digests"] = digests[:-32] + "0" * 16 + digests[-16:]
    write_json_atomic(work, manifest)
    assert verify_pack(work)["ok"]
    with pytest.raises(ChecksumMismatch, match="layer 5 expert 14 of"):
        verify_pack(work, full=True)


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "integrity must be an object"),
        ({"algorithm": "md5"}, "integrity.algorithm"),
        ({"algorithm": "xxh3_64", "objects": "80"}, "integrity.objects"),
        ({"algorithm": "xxh3_64", "objects": 80, "object_digests": 7}, "integrity.object_digests"),
        ({"algorithm": "xxh3_64", "objects": 80, "object_digests": "zz" * 640}, "not hexadecimal"),
    ],
)
def test_malformed_integrity_section_is_a_one_line_error(work, value, message):
    manifest = json.loads(work.read_text())
    manifest["integrity"] = value
    write_json_atomic(work, manifest)
    with pytest.raises(ValueError, match=message):
        ExpertPack(work)


def test_manifest_naming_an_endless_file_is_refused(tmp_path):
    from k3stream.pack.manifest import read_json

    with pytest.raises(ValueError, match="not a regular file"):
        read_json("/dev/zero")
    link = tmp_path / "m.json"
    os.symlink("/dev/zero", link)
    with pytest.raises(ValueError, match="not a regular file"):
        ExpertPack(link)


def test_resumed_build_records_the_same_digests(built, tmp_path):
    """A build that resumes (journal says everything is copied) hashes the kept objects too."""
    from k3stream.pack import builder

    fresh = json.loads(built[0].read_text())["integrity"]["object_digests"]
    folder = tmp_path / "r"
    shutil.copytree(built[0].parent, folder)
    manifest = folder / built[0].name
    manifest.unlink()  # as if killed after the rename, before the manifest
    gguf = next(folder.glob("*.gguf"))
    plan = builder.plan_pack(K3Checkpoint.open(gguf))
    pack = _pack_of(built[0]).name
    partial = folder / (pack + ".partial")
    identity = builder.build_identity(plan)
    builder.write_journal(builder.journal_path(partial), identity, plan.layout.index_count)
    result = build_pack(gguf, options=QUIET)
    assert result.resumed_bytes
    assert json.loads(result.manifest.read_text())["integrity"]["object_digests"] == fresh
    assert np.all(ExpertPack(result.manifest).checksums)


def test_loader_refuses_another_models_gguf_of_the_same_shape(work, built):
    """The non-expert loader (what `k3stream.load(manifest)` runs first) checks the sampled tensor data."""
    from k3stream.pack.source import open_checkpoint

    other = next(built[1].parent.glob("*.gguf"))
    shutil.copyfile(other, work.parent / other.name)
    with pytest.raises(FileNotFoundError, match="Kimi-K3 GGUF shard is missing or changed"):
        open_checkpoint(work)


def test_a_stale_partial_pack_counts_as_free_space(built, tmp_path, monkeypatch):
    """A disk too full for a second copy, holding a stale `.partial` of the full size: its bytes are
    freed by the rebuild, so the build goes ahead instead of refusing until it is deleted by hand."""
    import shutil as shutil_module

    folder = tmp_path / "s"
    shutil.copytree(built[0].parent, folder)
    pack = _pack_of(folder / built[0].name)
    (folder / built[0].name).unlink()
    size = pack.stat().st_size
    pack.rename(pack.with_name(pack.name + ".partial"))  # no journal: the build starts over
    usage = shutil_module.disk_usage(folder)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda _path: usage._replace(free=size // 2))
    result = build_pack(next(folder.glob("*.gguf")), options=BuildOptions(progress=False, margin_bytes=0))
    assert result.size == size and verify_pack(result.manifest)["ok"]


def _without_checksums(manifest: Path) -> bytes:
    """The manifest rewritten without its `integrity` section, as sglang writes them; its new bytes."""
    value = json.loads(manifest.read_text())
    del value["integrity"]
    write_json_atomic(manifest, value)
    return manifest.read_bytes()


def test_a_pack_without_checksums_anywhere_warns_once_at_load(work, caplog):
    _without_checksums(work)
    with caplog.at_level("WARNING"), ExpertPack(work):
        pass
    lines = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert str(work) in lines[0] and "k3stream verify" in lines[0] and "--record-checksums" in lines[0]


def test_verify_records_checksums_beside_a_checksumless_manifest_which_the_store_then_checks(
    work, built, caplog, capsys
):
    """`verify --record-checksums` on a pack whose manifest has none (sglang's): a full verify, then the
    digests in a sidecar file beside the manifest; the manifest and pack bytes stay what sglang reads.
    A pack modified in place afterwards fails its fetch, and the loader checks the shards' samples."""
    from k3stream.cli import main

    manifest_bytes = _without_checksums(work)
    pack_bytes = _pack_of(work).read_bytes()
    assert main(["verify", str(work), "--record-checksums"]) == 0
    out = capsys.readouterr().out
    sidecar = work.with_name(work.name.removesuffix(".json") + ".checksums.json")
    assert sidecar.is_file() and str(sidecar) in out
    assert work.read_bytes() == manifest_bytes and _pack_of(work).read_bytes() == pack_bytes
    recorded = json.loads(built[0].read_text())["integrity"]["object_digests"]
    with caplog.at_level("WARNING"), ExpertPack(work) as pack:
        assert pack.checksums is not None
        assert "".join(f"{int(d):016x}" for d in pack.checksums) == recorded
        layer = pack.moe_layers[1]
        offset, nbytes = pack.object_range(layer, 3)
    assert not [r for r in caplog.records if "checksum" in r.getMessage()]
    summary = verify_pack(work)
    assert summary["checksums"] == "xxh3_64" and summary["checksums_file"] == str(sidecar)
    _flip_bit(_pack_of(work), offset + nbytes // 3)
    with _store(work) as store, pytest.raises(ChecksumMismatch, match=f"layer {layer} expert 3 of"):
        store.fetch(layer, [3])


def test_the_loader_checks_a_recorded_sidecars_shard_samples(work, built):
    from k3stream.cli import main
    from k3stream.pack.source import open_checkpoint

    _without_checksums(work)
    assert main(["verify", str(work), "--record-checksums"]) == 0
    gguf = next(work.parent.glob("*.gguf"))
    info = K3Checkpoint.open(gguf).info("output.weight")
    _flip_bit(gguf, info.data_offset + info.nbytes // 2)
    with pytest.raises(FileNotFoundError, match="Kimi-K3 GGUF shard is missing or changed"):
        open_checkpoint(work)


def test_a_sidecar_of_another_manifest_and_a_second_record_are_one_line_errors(work, capsys):
    from k3stream.cli import main

    assert main(["verify", str(work), "--record-checksums"]) == 1  # the manifest records its own
    assert "already records checksums" in capsys.readouterr().err
    _without_checksums(work)
    assert main(["verify", str(work), "--record-checksums"]) == 0
    value = json.loads(work.read_text())
    value["expert_pack"]["note"] = "rewritten"
    write_json_atomic(work, value)
    with pytest.raises(ValueError, match=r"checksums\.json records checksums of another manifest") as caught:
        ExpertPack(work)
    assert "\n" not in str(caught.value)


def test_recording_checksums_of_a_pack_that_fails_verify_writes_nothing(work, capsys):
    from k3stream.cli import main

    _without_checksums(work)
    with ExpertPack(work) as pack:
        offset, _ = pack.object_range(pack.moe_layers[0], 0)
    _flip_bit(_pack_of(work), offset + 7)
    assert main(["verify", str(work), "--record-checksums"]) == 1
    assert "does not match GGUF source" in capsys.readouterr().err
    assert not list(work.parent.glob("*.checksums.json"))
