"""`k3stream pack GGUF --relink`: a copied model folder's manifest pointed at the copy's own files after
the copy is checked against it, without reading the pack again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3stream.cli import main as cli
from k3stream.pack.builder import BuildOptions, build_pack
from pack_helpers import copy_model

QUIET = BuildOptions(progress=False)
# created_at and the generator say when and by what a manifest was written, not what it describes
WRITTEN_WHEN = ("created_at", "generator")


def _described(manifest: Path) -> dict:
    return {key: value for key, value in json.loads(manifest.read_text()).items() if key not in WRITTEN_WHEN}


@pytest.fixture(params=[{}, {"shards": 2}], ids=["single", "split"])
def original(request, tiny_model, tmp_path):
    """A private copy of a tiny model, packed where it lies."""
    gguf = copy_model(tiny_model(**request.param), tmp_path / "original")
    return gguf, build_pack(gguf, options=QUIET)


def _copied(gguf: Path, to: Path) -> Path:
    shutil.copytree(gguf.parent, to)
    return to / gguf.name


@pytest.mark.parametrize("sidecar", [False, True], ids=["in-manifest", "sidecar"])
def test_a_copied_folder_relinked_is_the_manifest_a_build_there_writes(original, tmp_path, capsys, sidecar):
    """The copy's GGUF is refused while its manifest names the original (the message says --relink);
    --relink makes its manifest what `pack --force` would write in the copy, checksums recorded beside it
    (`verify --record-checksums`) bound to its bytes again, and the original's manifest stays as it was."""
    from k3stream.engine.loading import open_model
    from k3stream.pack.source import open_checkpoint

    gguf, built = original
    if sidecar:  # sglang's manifest has no checksums: k3stream records them beside it
        value = json.loads(built.manifest.read_text())
        del value["integrity"]
        built.manifest.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
        assert cli(["verify", str(built.manifest), "--record-checksums"]) == 0
    before = built.manifest.read_bytes()
    copy = _copied(gguf, tmp_path / "copy")
    copied_manifest = copy.parent / built.manifest.name
    capsys.readouterr()
    with pytest.raises(ValueError, match=f"built from {gguf}, not {copy}; a copied folder: .* --relink"):
        open_model(str(copy), True)
    assert cli(["pack", str(copy), "--relink"]) == 0
    assert (
        capsys.readouterr().out
        == f"relinked  {copied_manifest}: its paths name the files checked against its records\n"
    )
    assert built.manifest.read_bytes() == before
    assert open_checkpoint(copied_manifest).shards[0] == copy
    assert open_model(str(copy), True)[1] == copied_manifest
    relinked = _described(copied_manifest)
    assert cli(["verify", str(copy)]) == 0
    assert cli(["pack", str(copy), "--force", "--no-progress"]) == 0
    rebuilt = _described(copied_manifest)
    if sidecar:  # a build records its checksums in the manifest
        del rebuilt["integrity"]
    assert relinked == rebuilt


def test_relink_says_when_the_manifest_already_names_its_files_and_writes_nothing(original, tmp_path, capsys):
    """--relink where the manifest already names the checked files (the original folder, or a copy
    relinked once): it says so and nothing is written (the manifest keeps its file and bytes); a copy
    that needs its paths changed is relinked."""
    gguf, built = original
    copy = _copied(gguf, tmp_path / "copy")
    copied_manifest = copy.parent / built.manifest.name
    capsys.readouterr()
    for folder, manifest, first in (
        (gguf, built.manifest, "unchanged"),
        (copy, copied_manifest, "relinked "),
    ):
        said = []
        for _ in range(2):
            before = manifest.stat()
            assert cli(["pack", str(folder), "--relink"]) == 0
            said.append(capsys.readouterr().out)
            kept = (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == (
                before.st_ino,
                before.st_mtime_ns,
            )
            assert kept is said[-1].startswith("unchanged"), said[-1]
        assert said[0].startswith(f"{first} {manifest}: ")
        assert said[1] == (
            f"unchanged {manifest}: already bound to the files checked against its records; nothing written\n"
        )


def test_a_copy_that_is_not_what_the_manifest_records_is_refused_in_one_line(
    original, tmp_path, tiny_model, capsys
):
    """A damaged expert object in the copy's pack, or another model's GGUF in the copy (same shapes,
    other weights): one line naming the file, and the manifest is left as it was."""
    gguf, built = original
    damaged = _copied(gguf, tmp_path / "damaged")
    manifest = damaged.parent / built.manifest.name
    written = manifest.read_bytes()
    pack = damaged.parent / built.pack.name
    data_start = json.loads(written)["expert_pack"]["data_start"]
    with pack.open("r+b") as stream:  # the first object: every quick check samples it
        stream.seek(data_start + 100)
        byte = stream.read(1)
        stream.seek(data_start + 100)
        stream.write(bytes([byte[0] ^ 0x10]))
    capsys.readouterr()
    assert cli(["pack", str(damaged), "--relink"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"k3stream pack: error: cannot relink {manifest}: expert-pack checksum mismatch")
    assert len(err.splitlines()) == 1 and manifest.read_bytes() == written
    other = _copied(gguf, tmp_path / "other")
    shards = sorted(other.parent.glob("*.gguf"))
    reseeded = sorted(tiny_model(shards=len(shards), seed=7).parent.glob("*.gguf"))
    for mine, theirs in zip(shards, reseeded, strict=True):
        shutil.copyfile(theirs, mine)
    assert cli(["pack", str(other), "--relink"]) == 1
    err = capsys.readouterr().err.strip()
    manifest = other.parent / built.manifest.name
    changed = f"Kimi-K3 GGUF shard is missing or changed: {shards[0]}"
    assert err == f"k3stream pack: error: cannot relink {manifest}: {changed}"
    assert not list(other.parent.glob(".relink-*"))


def test_relink_without_a_manifest_says_what_makes_one(tiny_model, tmp_path, capsys):
    gguf = copy_model(tiny_model(), tmp_path / "bare")
    assert cli(["pack", str(gguf), "--relink"]) == 1
    manifest = gguf.parent / "tiny-kimi-k3.expert-major.pack.manifest.json"
    assert capsys.readouterr().err.strip() == (
        f"k3stream pack: error: no manifest to relink: {manifest} (`k3stream pack {gguf}` makes one)"
    )
