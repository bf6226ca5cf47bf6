"""Positional reads shared by the pack builder, verifier and reader: whole ranges, never a short read
mistaken for the end of a range, and no file offset shared between threads."""

from __future__ import annotations

import os
from typing import Any

COPY_CHUNK = 16 * 1024 * 1024


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
