"""File utilities of the pack: positional reads shared by the builder, verifier and reader (whole ranges,
never a short read mistaken for the end of a range, and no file offset shared between threads), atomic
JSON writes, and bounded reads of a manifest."""

from __future__ import annotations

import glob
import json
import os
import re
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COPY_CHUNK = 16 * 1024 * 1024
TEMP_INFIX = ".tmp"  # write_bytes_atomic's temp file: <name>.tmp<pid>.<thread>


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset`; returns the bytes read, fewer than `len(view)` only at EOF."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    """`nbytes` from `fd` at `offset`, read in bounded chunks; shorter only when the file ends first."""
    parts = []
    while nbytes:
        chunk = os.pread(fd, min(nbytes, COPY_CHUNK), offset)
        if not chunk:
            break
        parts.append(chunk)
        nbytes -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def same_bytes(fd_a: int, offset_a: int, fd_b: int, offset_b: int, nbytes: int, digest: Any = None) -> bool:
    """Whether two ranges hold the same `nbytes`; `digest`, when given, is fed the bytes of `fd_a`."""
    done = 0
    while done < nbytes:
        size = min(COPY_CHUNK, nbytes - done)
        chunk = pread_exact(fd_a, size, offset_a + done)
        if digest is not None:
            digest.update(chunk)
        if len(chunk) != size or chunk != pread_exact(fd_b, size, offset_b + done):
            return False
        done += size
    return True


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, payload: bytes | Sequence[bytes | memoryview]) -> None:
    """`payload` (bytes, or parts written one after another: no joined copy) to a temp file
    (`<name>.tmp<pid>.<thread>`: concurrent writers never share one), fsync, rename, fsync the
    directory: readers see the old file or the new one, and a failure (full disk, Ctrl-C) leaves no
    temp file behind; an OSError names `path`."""
    temporary = path.with_name(f"{path.name}{TEMP_INFIX}{os.getpid()}.{threading.get_ident()}")
    parts = [payload] if isinstance(payload, bytes) else payload
    try:
        with temporary.open("wb", buffering=0) as stream:
            for part in parts:
                _write_all(stream, part)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        temporary.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a full disk's error names no file
            exc.filename = str(path)
        raise
    fsync_directory(path.parent)


def remove_temporaries(path: Path) -> None:
    """Delete the temp files of `write_bytes_atomic(path, ...)` that a killed writer left behind; only
    for a caller that holds the one right to write `path` (a lock), so no live writer owns them."""
    for temporary in path.parent.glob(f"{glob.escape(path.name)}{TEMP_INFIX}*"):
        if re.fullmatch(rf"{re.escape(path.name + TEMP_INFIX)}\d+\.\d+", temporary.name):
            temporary.unlink(missing_ok=True)


def _write_all(stream: Any, data: bytes | memoryview) -> None:
    """All of `data` to an unbuffered file (a raw write may take part of it; the GIL is released
    while the disk takes it)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += stream.write(view[done:])


def write_json_atomic(path: Path, value: Any) -> None:
    """`value` as sorted, indented JSON, by `write_bytes_atomic` (an unserialisable value writes
    nothing)."""
    text = json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them: a device (/dev/zero), a FIFO or an oversized
    file is refused with a one-line error instead of being read without bound."""
    with path.open("rb") as stream:
        if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
            raise ValueError(f"{path}: manifest is not a regular file")
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: manifest is larger than {limit >> 20} MiB")
    return data
