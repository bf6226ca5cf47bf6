"""Where `k3stream pack` puts a pack and its manifest by default (what the builder writes and the engine
looks for beside a GGUF), and how the paths inside a manifest are written and read.

Paths in a manifest are absolute (our default, and what sglang writes and requires) or
relative to the manifest's directory (`--relative-paths`); both are read. Links are kept, not followed:
a hub cache's shards are links named `NAME-0000K-of-0000N.gguf` to hash-named blobs, and the set is
found by those names. An absolute path that no longer exists is looked for beside the manifest (the
model folder moved), with one logged note.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from k3stream.gguf.shards import set_name

log = logging.getLogger(__name__)


def absolute(path: Path) -> Path:
    """`path` made absolute and normalised, its links kept (`Path.resolve` would follow them)."""
    return Path(os.path.abspath(path))


def default_outputs(shards: list[Path]) -> tuple[Path, Path]:
    """`NAME.expert-major.pack` and its `.manifest.json` next to the shards."""
    first = absolute(shards[0])
    pack = first.parent / f"{set_name(first)}.expert-major.pack"
    return pack, manifest_path_for(pack)


def manifest_path_for(pack: Path) -> Path:
    return pack.with_name(pack.name + ".manifest.json")


def stored_path(path: Path, manifest_path: Path, relative: bool) -> str:
    """How `path` is written into the manifest at `manifest_path`."""
    path = absolute(path)
    if not relative:
        return str(path)
    return os.path.relpath(path, absolute(manifest_path).parent)


def resolve_path(stored: str, manifest_path: Path) -> Path:
    """A manifest path: relative to the manifest's directory, or absolute; an absolute path that is
    gone resolves to the file of that name beside the manifest when there is one (the folder moved)."""
    beside = absolute(manifest_path).parent
    path = absolute(beside / stored)  # an absolute `stored` replaces `beside`
    if not Path(stored).is_absolute() or path.exists():
        return path
    moved = beside / path.name
    if not moved.is_file():
        return path  # the readers name the stored path as missing
    _note_moved(path.parent, beside)
    return moved


_MOVES_NOTED: set[tuple[Path, Path]] = set()


def _note_moved(written: Path, found: Path) -> None:
    """Say once per process and pair of folders that a manifest's files are read from a new place."""
    if (written, found) not in _MOVES_NOTED:
        _MOVES_NOTED.add((written, found))
        note = "manifest paths in %s are gone: reading those files beside the manifest in %s (folder moved)"
        log.warning(note, written, found)
