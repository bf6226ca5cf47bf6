"""Checksums of a pack: the integrity records (an xxh3_64 per expert object, and a sampled fingerprint of
each GGUF shard) and the SHA-256 digests the manifest records (canonical JSON, file ranges, whole files).

They live in the manifest's top-level `integrity` section, which sglang does not read (its
readers look keys up by name and ignore the rest). An expert object's digest covers exactly the bytes
the store reads for it (`object_bytes` from its up offset: up, gate, down and the padding between them),
so the store can check an object as it enters its cache. A shard's fingerprint is xxh3_64 over
`SHARD_SAMPLE_WINDOWS` windows of `SHARD_SAMPLE_BYTES` spread evenly over its tensor data, so a GGUF of
the same shape and metadata but other weights is caught without reading it whole.

A manifest without the section (sglang's) stays as sglang wrote it: `k3stream verify --record-checksums`
verifies its pack in full and records the same section in a sidecar file beside it (`sidecar_path`),
bound to the manifest's bytes, which every reader then takes as the manifest's own. Without either,
nothing is checked: opening the pack warns in one line, and `verify` says so.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from k3stream.pack import format as fmt
from k3stream.pack.fileio import COPY_CHUNK, pread_exact, read_bounded, write_json_atomic

ALGORITHM = "xxh3_64"
SHARD_SAMPLE_WINDOWS = 64
SHARD_SAMPLE_BYTES = 64 << 10
DIGEST_HEX = 16
SIDECAR_FORMAT = "k3stream-checksums/1"
MAX_SIDECAR_BYTES = 64 << 20  # the real model's digests: 16 hex digits for each of 83,328 objects


def canonical_sha256(value: Any) -> str:
    encoded = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(encoded.encode("utf-8")).hexdigest()


def sha256_range(path: Path, offset: int, nbytes: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as stream:
        stream.seek(offset)
        remaining = nbytes
        while remaining:
            chunk = stream.read(min(COPY_CHUNK, remaining))
            if not chunk:
                raise ValueError(f"{path}: file ends {remaining} bytes before offset {offset + nbytes}")
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_range(path, 0, path.stat().st_size)


class ChecksumMismatch(OSError):
    """Bytes read from a pack or a GGUF are not the bytes recorded when the pack was built."""


def object_digest(data: Any) -> int:
    """xxh3_64 of one expert object's bytes (a numpy array, bytes or memoryview)."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B") if not isinstance(data, bytes) else data)


def object_digester() -> Any:
    """A streaming `object_digest`: `update` it with an object's bytes in order, piece by piece, and its
    `intdigest()` is `object_digest` of them all."""
    return xxhash.xxh3_64()


def encode_digests(digests: np.ndarray) -> str:
    """Digests as one hex string, 16 characters (big-endian) per object."""
    return np.asarray(digests, dtype=np.uint64).astype(">u8").tobytes().hex()


def decode_digests(text: Any, count: int, where: str) -> np.ndarray:
    """The uint64 digests of a hex string written by `encode_digests`; one-line errors naming `where`."""
    if not isinstance(text, str) or len(text) != count * DIGEST_HEX:
        raise ValueError(f"Kimi manifest field {where} must be a string of {count} x {DIGEST_HEX} hex digits")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"Kimi manifest field {where} is not hexadecimal") from None
    return np.frombuffer(raw, dtype=">u8").astype(np.uint64)


def object_ordinal(layout: fmt.PackLayout, layer: int, expert: int) -> int:
    return layout.layer_position(layer) * layout.num_experts + expert


def object_identity(layout: fmt.PackLayout, ordinal: int) -> tuple[int, int]:
    """(layer, expert) of the `ordinal`-th object (layer-major)."""
    position, expert = divmod(ordinal, layout.num_experts)
    return layout.moe_layers[position], expert


class ObjectHasher:
    """Collects the digest of every object of a pack as its bytes become final (read back from `fd`)."""

    def __init__(self, layout: fmt.PackLayout) -> None:
        self.layout = layout
        self.digests = np.zeros(len(layout.moe_layers) * layout.num_experts, dtype=np.uint64)
        self.done = np.zeros(self.digests.size, dtype=bool)

    def hash_object(self, fd: int, ordinal: int) -> bytes:
        """Hash object `ordinal` as `fd` holds it; its bytes are returned for whatever else reads them."""
        layer, expert = object_identity(self.layout, ordinal)
        offset = self.layout.object_offset(layer, expert)
        nbytes = self.layout.object_bytes_at(self.layout.layer_position(layer))
        data = pread_exact(fd, nbytes, offset)
        if len(data) != nbytes:
            raise ValueError(f"expert pack ends inside expert {expert} of layer {layer}")
        self.digests[ordinal] = object_digest(data)
        self.done[ordinal] = True
        return data

    def hash_objects(self, fd: int, ordinals: range) -> None:
        for ordinal in ordinals:
            self.hash_object(fd, ordinal)

    def complete(self) -> np.ndarray:
        if not self.done.all():
            raise RuntimeError(f"expert object {int(np.argmin(self.done))} was never hashed")
        return self.digests


def sample_offsets(start: int, end: int, windows: int = SHARD_SAMPLE_WINDOWS) -> list[int]:
    """Evenly spaced window starts over [start, end), the last window ending at `end`."""
    span = end - start
    if span <= windows * SHARD_SAMPLE_BYTES:
        return [start + k * SHARD_SAMPLE_BYTES for k in range(-(-span // SHARD_SAMPLE_BYTES))]
    last = end - SHARD_SAMPLE_BYTES
    return sorted({start + round(k * (last - start) / (windows - 1)) for k in range(windows)})


def shard_fingerprint(path: Path, data_start: int, size: int) -> str:
    """xxh3_64 (hex) of the sampled windows of a shard's tensor data [data_start, size)."""
    digest = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in sample_offsets(data_start, size):
            digest.update(pread_exact(fd, min(SHARD_SAMPLE_BYTES, size - offset), offset))
    finally:
        os.close(fd)
    return digest.hexdigest()


def integrity_section(digests: np.ndarray, shards: list[dict[str, Any]], shard_paths: list[Path]) -> dict:
    """The manifest's `integrity` section: per-object digests and per-shard fingerprints."""
    return {
        "algorithm": ALGORITHM,
        "objects": int(len(digests)),
        "object_digests": encode_digests(digests),
        "shard_sample_windows": SHARD_SAMPLE_WINDOWS,
        "shard_sample_bytes": SHARD_SAMPLE_BYTES,
        "shard_fingerprints": {
            str(shard["index"]): shard_fingerprint(path, int(shard["metadata_nbytes"]), int(shard["size"]))
            for shard, path in zip(shards, shard_paths, strict=True)
        },
    }


def section(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's `integrity` section, checked for shape; None when it has none."""
    value = manifest.get("integrity")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("Kimi manifest field integrity must be an object")
    if value.get("algorithm") != ALGORITHM:
        raise ValueError(f"Kimi manifest field integrity.algorithm must be {ALGORITHM!r}")
    return value


def object_checksums(manifest: dict[str, Any], layout: fmt.PackLayout) -> np.ndarray | None:
    """The recorded digest of every object (layer-major), or None for a manifest without them."""
    recorded = section(manifest)
    if recorded is None:
        return None
    count = len(layout.moe_layers) * layout.num_experts
    if recorded.get("objects") != count:
        raise ValueError(f"Kimi manifest field integrity.objects must be {count} for this pack")
    return decode_digests(recorded.get("object_digests"), count, "integrity.object_digests")


def mismatch_message(layer: int, expert: int, pack: Path, got: int, want: int) -> str:
    return (
        f"expert-pack checksum mismatch: layer {layer} expert {expert} of {pack.name} "
        f"({ALGORITHM} {got:016x}, manifest {want:016x}); the pack is damaged or not the one packed"
    )


def sidecar_path(manifest_path: Path) -> Path:
    """Where a checksum-less manifest's checksums are recorded: `NAME.checksums.json` beside `NAME.json`."""
    return manifest_path.with_name(manifest_path.name.removesuffix(".json") + ".checksums.json")


def with_sidecar(manifest: dict[str, Any], manifest_path: Path) -> dict[str, Any]:
    """`manifest` with the `integrity` section its sidecar records (the section's `recorded_in` names the
    file), when it records none itself; one-line errors for a sidecar that is malformed or belongs to
    other manifest bytes."""
    path = sidecar_path(manifest_path)
    if "integrity" in manifest or not path.is_file():
        return manifest
    try:
        recorded = json.loads(read_bounded(path, MAX_SIDECAR_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        recorded = None
    if not isinstance(recorded, dict) or recorded.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path}: not a k3stream checksums file ({SIDECAR_FORMAT})")
    if recorded.get("manifest_sha256") != sha256_file(manifest_path):
        raise ValueError(
            f"{path} records checksums of another manifest than {manifest_path.name} (rewritten since); "
            f"record them again (`k3stream verify {manifest_path} --record-checksums`) or delete the file"
        )
    section = recorded.get("integrity")
    if not isinstance(section, dict):
        raise ValueError(f"{path}: field integrity must be an object")
    return {**manifest, "integrity": {**section, "recorded_in": str(path)}}


def write_sidecar(manifest_path: Path, section: dict[str, Any]) -> Path:
    """`section` recorded beside `manifest_path` (atomically), bound to the manifest's bytes."""
    path = sidecar_path(manifest_path)
    record = {
        "format": SIDECAR_FORMAT,
        "manifest": manifest_path.name,
        "manifest_sha256": sha256_file(manifest_path),
        "integrity": section,
    }
    write_json_atomic(path, record)
    return path
