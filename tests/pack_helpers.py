"""Helpers shared by the expert-pack tests: private copies of tiny models, GGUF oracles, file snapshots."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader

SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def model_files(first_shard: Path) -> list[Path]:
    """Every file of the model whose first shard (or single file) is `first_shard`."""
    if not SHARD_RE.search(first_shard.name):
        return [first_shard]
    stem = SHARD_RE.sub("", first_shard.name)
    return sorted(first_shard.parent.glob(f"{stem}-*-of-*.gguf"))


def copy_model(first_shard: Path, directory: Path) -> Path:
    """Copy a (cached, shared) tiny model into `directory`, so a test may build next to it or change it."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in model_files(first_shard):
        shutil.copyfile(path, directory / path.name)
    return directory / first_shard.name


def oracle_expert_bytes(first_shard: Path) -> dict[str, tuple[int, bytes]]:
    """{routed tensor name: (experts, raw bytes)} read with the `gguf` package alone."""
    result = {}
    for path in model_files(first_shard):
        for tensor in GGUFReader(str(path)).tensors:
            if "_exps." in tensor.name:
                result[tensor.name] = (int(tensor.shape[-1]), np.asarray(tensor.data).tobytes())
    return result


def oracle_slice(tensors: dict[str, tuple[int, bytes]], name: str, expert: int) -> bytes:
    experts, raw = tensors[name]
    size = len(raw) // experts
    return raw[expert * size : (expert + 1) * size]


def read_index(pack: Path) -> tuple[tuple, list[tuple[str, int, int, int, int]]]:
    """The pack's header and index parsed with `struct` from the published layout."""
    with pack.open("rb") as stream:
        header = struct.unpack("<16sIIQQ", stream.read(40))
        entries = []
        for _ in range(header[3]):
            name, expert, reserved, offset, nbytes = struct.unpack("<128siIQQ", stream.read(152))
            entries.append((name.rstrip(b"\0").decode(), expert, reserved, offset, nbytes))
    return header, entries


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under `directory`."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
