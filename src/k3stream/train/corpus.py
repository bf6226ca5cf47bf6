"""The training text: the standard library's `.py` files, split by file into train and held-out sets.

The split depends only on each file's path relative to the library root (CRC-32 of the path), so it
is the same on every machine with the same Python version.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

# folders that are not the library itself: installed packages and the library's own test suites
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELD_OUT_EVERY = 20  # one file in 20 is held out


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[str, ...]  # paths relative to root, sorted
    held_out: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % HELD_OUT_EVERY == 0


def source_files(root: Path) -> list[str]:
    """Every `.py` file under `root` outside EXCLUDED_DIRS, as sorted POSIX paths relative to it."""
    found = (path.relative_to(root) for path in root.rglob("*.py"))
    return sorted(path.as_posix() for path in found if not EXCLUDED_DIRS & set(path.parts[:-1]))


def split_corpus(root: Path | None = None) -> Corpus:
    root = stdlib_root() if root is None else root
    files = source_files(root)
    if not files:
        raise ValueError(f"{root}: no .py files to train on")
    held_out = tuple(f for f in files if is_held_out(f))
    return Corpus(root, tuple(f for f in files if not is_held_out(f)), held_out)


def read_texts(root: Path, files: tuple[str, ...], max_bytes: int | None = None) -> list[str]:
    """The files' text in order (undecodable bytes replaced), stopping once `max_bytes` are read."""
    texts: list[str] = []
    total = 0
    for relative in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = (root / relative).read_bytes()
        total += len(data)
        texts.append(data.decode("utf-8", errors="replace"))
    return texts
