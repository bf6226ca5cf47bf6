"""GGUF or manifest? The one place a model path is told apart, and a manifest's source shards found and
checked as sglang's loader checks them before a checkpoint is opened from them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3stream.gguf.shards import discover_shards
from k3stream.pack import integrity
from k3stream.pack.manifest import MANIFEST_TYPES, check_types, field, load_manifest, read_json
from k3stream.pack.paths import default_outputs, resolve_path

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint


def is_manifest(path: Path) -> bool:
    """Whether a model path names an expert-pack manifest (`.json`) rather than a GGUF."""
    return path.suffix == ".json"


def manifest_next_to(gguf_path: Path) -> Path | None:
    """The manifest `k3stream pack` writes beside a GGUF by default, if it is there and was built from
    that GGUF (`check_built_from`)."""
    shards = discover_shards(gguf_path)
    _pack, manifest = default_outputs(shards)
    if not manifest.is_file():
        return None
    named = [resolve_path(shard["path"], manifest) for shard in sorted_shards(read_json(manifest))]
    check_built_from(manifest, named, shards)
    return manifest


def check_built_from(manifest_path: Path, named: list[Path], shards: list[Path]) -> None:
    """ValueError naming both files unless a manifest's source shards (`named`, resolved) are `shards`: a
    pack beside a GGUF whose manifest names other files (copied from another model's folder, or a copied
    folder whose absolute paths still reach the original), or a store over another model's pack, would
    run that other model's experts in place of the ones asked for."""
    given = [Path(shard).resolve() for shard in shards]
    if [Path(path).resolve() for path in named] != given:  # links followed on both sides (a hub cache's)
        built = named[0] if named else "no shards"
        raise ValueError(
            f"{manifest_path}: built from {built}, not {given[0]}; a copied folder: `k3stream pack "
            f"{given[0]} --relink`; another model's pack: `--force` packs this GGUF, or give the manifest "
            "to run the model it names"
        )


def manifest_gguf(manifest_path: Path) -> Path:
    """The first GGUF shard a manifest was built from."""
    return first_shard_path(read_json(manifest_path), manifest_path)


def sorted_shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's `source.shards` records in shard order."""
    shards = field(manifest, "source", "shards")
    check_types(shards, MANIFEST_TYPES["source"]["shards"], "source.shards")  # callers may skip read_manifest
    for position, shard in enumerate(shards):
        _require(shard, SHARD_KEYS, f"source.shards[{position}]")
    return sorted(shards, key=lambda shard: shard["index"])


# the keys of each `source.shards` and `source.tensors` record the checks read
SHARD_KEYS = ("index", "path", "size", "metadata_nbytes", "metadata_sha256")
TENSOR_KEYS = ("name", "shard_index", "dtype")


def _require(record: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in record:
            raise ValueError(f"Kimi manifest field is missing: {where}.{key}")


def first_shard_path(manifest: dict[str, Any], manifest_path: Path) -> Path:
    """Shard 1 of the manifest's source (it holds the config and tokenizer), resolved; not checked."""
    shards = sorted_shards(manifest)
    if not shards:
        raise ValueError("Kimi manifest field is missing: source.shards[0]")
    return resolve_path(shards[0]["path"], manifest_path)


def shard_tensor_types(path: Path, checkpoint: K3Checkpoint | None = None) -> dict[str, str]:
    """{tensor name: GGML type name} of one GGUF file: from `checkpoint`'s inventory when it holds the
    file (its header is parsed already), else read from the file's header."""
    target = path.resolve()
    held = [i for i, shard in enumerate(checkpoint.shards if checkpoint else []) if shard.resolve() == target]
    if held:  # one path resolution per shard, none per tensor
        tensors = checkpoint.tensors.items()
        return {name: info.type_name for name, info in tensors if info.shard_index == held[0]}
    from k3stream.gguf.header import open_reader

    return {tensor.name: tensor.tensor_type.name for tensor in open_reader(path).tensors}


def present_shards(manifest: dict[str, Any], manifest_path: Path) -> list[tuple[dict[str, Any], Path]]:
    """`(record, resolved path)` of every source shard, in shard order, after sglang's loader's first
    check: a missing or resized shard -> FileNotFoundError `Kimi-K3 GGUF shard is missing or changed`."""
    present = []
    for shard in sorted_shards(manifest):
        path = resolve_path(shard["path"], manifest_path)
        if not path.is_file() or path.stat().st_size != int(shard["size"]):
            raise FileNotFoundError(f"Kimi-K3 GGUF shard is missing or changed: {path}")
        present.append((shard, path))
    return present


def checked_shards(
    manifest: dict[str, Any], manifest_path: str | os.PathLike[str], checkpoint: K3Checkpoint | None = None
) -> list[tuple[Path, list[dict]]]:
    """Every source shard of a manifest, checked as sglang's loader does, with its tensor records.

    Missing or resized shard -> FileNotFoundError `Kimi-K3 GGUF shard is missing or changed: {path}`;
    different tensor names -> `Kimi-K3 GGUF shard inventory changed: {path}`; a tensor's GGML type
    differs -> `Kimi-K3 GGUF tensor type changed: {name}`. Returns `[(shard path, [record, ...])]`
    in shard order, each record a `source.tensors` dict of that shard. The tensor types of a shard
    `checkpoint` holds come from it (no second header parse).
    """
    manifest_path = Path(manifest_path)
    records_by_shard: dict[int, list[dict]] = {}
    for position, record in enumerate(field(manifest, "source", "tensors")):
        _require(record, TENSOR_KEYS, f"source.tensors[{position}]")
        records_by_shard.setdefault(int(record["shard_index"]), []).append(record)
    result = []
    for shard, path in present_shards(manifest, manifest_path):
        records = records_by_shard.get(int(shard["index"]), [])
        found = shard_tensor_types(path, checkpoint)
        if set(found) != {record["name"] for record in records}:
            raise ValueError(f"Kimi-K3 GGUF shard inventory changed: {path}")
        for record in records:
            if found[record["name"]] != record["dtype"]:
                raise ValueError(f"Kimi-K3 GGUF tensor type changed: {record['name']}")
        check_shard_identity(manifest, shard, path)
        result.append((path, records))
    return result


def open_checkpoint(path_or_manifest: str | os.PathLike[str]) -> K3Checkpoint:
    """The checkpoint a GGUF path (a file, any shard, a directory) or an expert-pack manifest `.json`
    names. A manifest is checked as sglang's loader checks it (format, completeness, shard sizes,
    inventory, types, identity) and its first shard opened; each shard's header is parsed once."""
    from k3stream.gguf.reader import K3Checkpoint

    path = Path(path_or_manifest)
    if not is_manifest(path):
        return K3Checkpoint.open(path)
    manifest = load_manifest(path)
    present = present_shards(manifest, path)
    if not present:
        raise ValueError("Kimi manifest field is missing: source.shards[0]")
    checkpoint = K3Checkpoint.open([path for _record, path in present])
    checked_shards(manifest, path, checkpoint)
    return checkpoint


def check_shard_identity(manifest: dict[str, Any], shard: dict[str, Any], path: Path) -> None:
    """The shard's metadata bytes (header, key/values, tensor infos) hash as when it was packed, and so
    do the sampled windows of its tensor data when the manifest records them (`integrity`): a GGUF of
    the same size, names and types but other weights is refused with sglang's message."""
    if integrity.sha256_range(path, 0, int(shard["metadata_nbytes"])) != shard["metadata_sha256"]:
        raise FileNotFoundError(f"Kimi-K3 GGUF shard is missing or changed: {path}")
    recorded = integrity.section(manifest)
    if recorded is None:
        return
    fingerprints = recorded.get("shard_fingerprints")
    want = fingerprints.get(str(shard["index"])) if isinstance(fingerprints, dict) else None
    if not isinstance(want, str):
        raise ValueError(f"Kimi manifest field integrity.shard_fingerprints.{shard['index']} is missing")
    if integrity.shard_fingerprint(path, int(shard["metadata_nbytes"]), int(shard["size"])) != want:
        raise FileNotFoundError(f"Kimi-K3 GGUF shard is missing or changed: {path}")
