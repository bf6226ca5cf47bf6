"""`k3stream pack GGUF --relink`: point a copied model folder's manifest at the copy's own files.

A manifest's paths are absolute by default (what sglang writes and requires), so a folder copied while
the original stays names the original's GGUF and pack, and the copy is refused as another model's pack
(`source.check_built_from`). The copy's files are checked against the manifest's records (shard sizes,
metadata SHA-256 and sampled fingerprints, the pack's size and index SHA-256, sampled expert objects
against their checksums and the GGUF: `verify_pack`'s quick check, a few MiB a shard and the index,
never the whole pack), then the manifest is rewritten with the paths a build there would write. Only
the path fields and the inventory hash that covers them change."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from k3stream.gguf.shards import discover_shards, file_output
from k3stream.pack import integrity
from k3stream.pack.builder import build_lock
from k3stream.pack.fileio import write_json_atomic
from k3stream.pack.manifest import field, inventory_sha256, read_manifest
from k3stream.pack.paths import default_outputs, manifest_path_for, stored_path
from k3stream.pack.source import sorted_shards
from k3stream.pack.verify import check_format, verify_pack


class Relinked(NamedTuple):
    manifest: Path
    written: bool  # False: its paths already named the checked files, and nothing was written


def relink_pack(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    profile: str = "generic",
) -> Relinked:
    """Rewrite the manifest beside the GGUF at `gguf_path` (or `manifest`, of the pack at `out`) to name
    that GGUF's shards and that pack, once they are checked to be the files it records; its path, and
    whether it was written (not where it named them already). A one-line error naming the file where a
    copy does not match."""
    shards = discover_shards(gguf_path)
    default_pack, _ = default_outputs(shards)
    pack = file_output(out, "--out").resolve() if out is not None else default_pack
    manifest_path = (
        file_output(manifest, "--manifest").resolve() if manifest is not None else manifest_path_for(pack)
    )
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"no manifest to relink: {manifest_path} (`k3stream pack {gguf_path}` makes one)"
        )
    with build_lock(pack):
        written = read_manifest(manifest_path, sidecar=False)
        check_format(written)
        if inventory_sha256(field(written, "source")) != written["source"].get("inventory_sha256"):
            raise ValueError("Kimi manifest source inventory SHA-256 does not match its records")
        recorded = integrity.with_sidecar(written, manifest_path)  # checksums kept beside it, if any
        relative = not Path(field(written, "expert_pack", "path")).is_absolute()
        paths = _stored_paths(written, shards, pack, manifest_path, relative)
        _check_copy(_relinked(recorded, paths), manifest_path, profile)
        relinked = _relinked(written, paths)
        if relinked == written:
            return Relinked(manifest_path, False)
        write_json_atomic(manifest_path, relinked)
        if recorded is not written:  # the checksums file is bound to the manifest's bytes
            section = {key: value for key, value in recorded["integrity"].items() if key != "recorded_in"}
            integrity.write_sidecar(manifest_path, section)
    return Relinked(manifest_path, True)


def _stored_paths(
    manifest: dict[str, Any], shards: list[Path], pack: Path, manifest_path: Path, relative: bool
) -> dict[str, Any]:
    """The paths a build at `manifest_path` would write: each shard record's (by index), and the pack's."""
    records = sorted_shards(manifest)
    if len(records) != len(shards):
        raise ValueError(
            f"{manifest_path}: built from {len(records)} GGUF shards, {shards[0]} is one of {len(shards)}"
        )
    return {
        "shards": [stored_path(path, manifest_path, relative) for path in shards],
        "pack": stored_path(pack, manifest_path, relative),
    }


def _relinked(manifest: dict[str, Any], paths: dict[str, Any]) -> dict[str, Any]:
    """`manifest` naming `paths`: every shard record, the config and tokenizer (shard 1) and the pack,
    with the inventory hash over the shard records made again."""
    value = copy.deepcopy(manifest)
    for record in field(value, "source", "shards"):
        record["path"] = paths["shards"][int(record["index"])]
    value["source"]["inventory_sha256"] = inventory_sha256(value["source"])
    field(value, "model")["config_path"] = paths["shards"][0]
    field(value, "tokenizer")["path"] = paths["shards"][0]
    field(value, "expert_pack")["path"] = paths["pack"]
    return value


def _check_copy(relinked: dict[str, Any], manifest_path: Path, profile: str) -> None:
    """`verify_pack`'s quick check of `relinked` (written beside `manifest_path`, where its relative paths
    resolve as the manifest's): the files it names are the ones the manifest records."""
    descriptor, name = tempfile.mkstemp(dir=manifest_path.parent, prefix=".relink-", suffix=".json")
    os.close(descriptor)
    trial = Path(name)
    try:
        write_json_atomic(trial, relinked)
        verify_pack(trial, profile=profile)
    except (OSError, ValueError) as exc:
        said = str(exc).replace(str(trial), str(manifest_path))  # the trial's name is nobody's file
        raise ValueError(f"cannot relink {manifest_path}: {said}") from None
    finally:
        trial.unlink(missing_ok=True)
