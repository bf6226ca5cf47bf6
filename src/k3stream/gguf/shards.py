"""Find every shard of a Kimi-K3 GGUF and check that the set is whole and consistent.

Accepts a single `.gguf`, any shard `NAME-0000K-of-0000N.gguf`, or a directory holding one model.
Split metadata follows llama.cpp's gguf-split: `split.no` (0-based), `split.count` and
`split.tensors.count` in every shard, all other metadata in shard 1.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gguf import GGUFReader

from k3stream.gguf.config import ARCH, field_value
from k3stream.gguf.header import GGUFHeaderError, open_reader

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def set_name(path: Path) -> str:
    """`NAME` of `NAME.gguf` or of any shard `NAME-0000K-of-0000N.gguf`."""
    match = SHARD_NAME.match(path.name)
    return match["stem"] if match else path.name.removesuffix(".gguf")


def _shard_set(path: Path) -> list[Path]:
    """The files of the model `path` names, from the file name alone."""
    match = SHARD_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["index"]) <= count:
        raise ValueError(f"{path}: shard index {match['index']} outside 1..{count}")
    paths = [path.with_name(f"{match['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    for k, shard in enumerate(paths, start=1):
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: missing shard {k} of {count} (named by {path.name})")
    return paths


def _from_directory(directory: Path) -> Path:
    ggufs = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    models = sorted({SHARD_NAME.sub(r"\g<stem>-of-\g<count>", p.name) for p in ggufs})
    if not ggufs:
        raise FileNotFoundError(f"{directory}: no .gguf file in the directory")
    if len(models) > 1:
        raise ValueError(f"{directory}: several GGUF models in the directory: {', '.join(models)}")
    return ggufs[0]


def _split_value(reader: GGUFReader, path: Path, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field_value(field, str(path))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: metadata key {key} must be an integer, got {value!r}")
    return value


def _check_split_keys(paths: list[Path], readers: list[GGUFReader]) -> None:
    count = len(paths)
    total = sum(len(r.tensors) for r in readers)
    for index, (path, reader) in enumerate(zip(paths, readers, strict=True)):
        found = {key: _split_value(reader, path, key) for key in SPLIT_KEYS}
        if count == 1 and found["split.count"] in (None, 1):
            continue
        expected = {"split.no": index, "split.count": count, "split.tensors.count": total}
        for key, want in expected.items():
            if found[key] != want:
                raise ValueError(f"{path}: metadata key {key} is {found[key]}, expected {want}")


def _check_architecture(paths: list[Path], readers: list[GGUFReader]) -> None:
    for index, (path, reader) in enumerate(zip(paths, readers, strict=True)):
        field = reader.fields.get("general.architecture")
        if field is None:
            if index == 0:
                raise ValueError(f"{path}: missing metadata key general.architecture")
            continue  # gguf-split keeps the metadata in shard 1 only
        arch = field_value(field, str(path))
        if arch != ARCH:
            raise ValueError(f"{path}: metadata key general.architecture is {arch!r}, expected {ARCH!r}")


def _check_unique_tensors(paths: list[Path], readers: list[GGUFReader]) -> None:
    owner: dict[str, Path] = {}
    for path, reader in zip(paths, readers, strict=True):
        for tensor in reader.tensors:
            if tensor.name in owner:
                raise ValueError(f"{path}: tensor {tensor.name} is also in {owner[tensor.name]}")
            owner[tensor.name] = path


def _open(path: Path) -> GGUFReader:
    try:
        return open_reader(path)  # the header is checked against the file first
    except GGUFHeaderError:
        raise
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc


def open_shards(path: str | Path) -> list[tuple[Path, GGUFReader]]:
    """Memory-mapped readers of every shard, in order, after checking the set."""
    path = Path(path)
    if path.is_dir():
        path = _from_directory(path)
    elif path.exists() and not path.is_file():  # a memory map needs a file: no pipe, device or socket
        raise ValueError(f"{path}: not a regular file (a pipe, device or socket); give the GGUF file")
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file or directory")
    return open_shard_files(_shard_set(path))


def open_shard_files(paths: list[Path]) -> list[tuple[Path, GGUFReader]]:
    """Memory-mapped readers of the shards `paths` names, in that order, after checking the set: a
    manifest's record of its shards, whatever their file names (a hub cache's hash-named blobs)."""
    readers = [_open(p) for p in paths]
    _check_architecture(paths, readers)
    _check_unique_tensors(paths, readers)
    _check_split_keys(paths, readers)
    return list(zip(paths, readers, strict=True))


def file_output(output: str | os.PathLike[str], what: str) -> Path:
    """`output` as the file a run writes; a folder there, or a path spelled as one (`dir/`, which `Path`
    reads as the file `dir`), is refused in one line naming `what` (the flag) before any work."""
    text = os.fspath(output)
    if Path(text).is_dir() or text.endswith(("/", os.sep)):
        raise IsADirectoryError(f"{what} {text}: names a folder; give the file to write")
    return Path(text)


def refuse_source_output(output: Path, sources: list[Path], what: str) -> None:
    """Raise ValueError (one line) when the output file `output` is one of the files a run reads
    (`sources`: the GGUF's shards, a manifest, a text) by any name or link: writing it would destroy
    what it is made from, whatever `--force` allows."""
    if output.exists():
        for source in sources:
            if output.samefile(source):
                raise ValueError(f"{what} {output} is the source file {source}; choose another path")


def discover_shards(path: str | Path) -> list[Path]:
    """Every shard of the model at `path` (file, any shard, or directory), checked, in order."""
    return [shard for shard, _reader in open_shards(path)]
