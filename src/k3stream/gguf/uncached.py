"""Reading file bytes into memory without leaving them in the page cache.

Under a memory cgroup the page cache a process fills is charged to its limit: a load that reads
gigabytes of non-expert weights through buffered reads leaves gigabytes of cache charged, and the
limit is then hit (the kernel reclaims) long before any expert is read. `read_uncached` reads a
chunk at a time and drops each chunk's pages right after (posix_fadvise DONTNEED), so the cache it
leaves charged is at most one chunk (read-ahead is turned off for the descriptor: it would cache
past each chunk). Measured against O_DIRECT reads into aligned buffers by
`benchmarks/bench_load_cache.py` (see docs/real-model.md).
"""

from __future__ import annotations

import os

import numpy as np

CHUNK_BYTES = 16 << 20  # read, then dropped from the page cache, this much at a time
# the largest page-cache folio (a PMD, 2 MiB on x86-64 and 4 KiB-page arm64): the kernel drops only
# folios wholly inside a DONTNEED range, and with large folios (ext4, xfs) one straddling each end of
# a range stays cached, measured 167 MiB of a 1.9 GB load in 16 MiB chunks
FOLIO_BYTES = 2 << 20


def read_uncached(descriptor: int, offset: int, out: np.ndarray) -> int:
    """Read `len(out)` bytes of the file at `offset` into the contiguous uint8 `out`, dropping the pages
    read from the page cache chunk by chunk; returns the bytes read (fewer only where the file ends)."""
    # no read-ahead: it would cache (up to the device's read_ahead_kb) past what is read and dropped
    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        size = min(CHUNK_BYTES, len(view) - done)
        got = os.preadv(descriptor, [view[done : done + size]], offset + done)
        if got > 0:
            drop_cached(descriptor, offset + done, got)
        if got <= 0:
            break
        done += got
    return done


def drop_cached(descriptor: int, offset: int, nbytes: int) -> None:
    """Drop the file's cached pages that overlap `offset..offset + nbytes` (clean ones; the folios
    straddling both ends too: a neighbour's bytes there are read again if wanted)."""
    start = offset // FOLIO_BYTES * FOLIO_BYTES
    end = -(-(offset + nbytes) // FOLIO_BYTES) * FOLIO_BYTES
    os.posix_fadvise(descriptor, start, end - start, os.POSIX_FADV_DONTNEED)
