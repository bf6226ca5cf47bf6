"""The most resident memory a call takes above what the process held before it (Linux)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable
from pathlib import Path

import pytest

CLEAR_REFS = Path("/proc/self/clear_refs")


def _status(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def peak_above(run: Callable[[], object]) -> int:
    """Bytes `run()` took at its peak above the process's resident set before it (VmHWM, reset). First
    garbage is collected and the heap's free memory handed back (glibc's `malloc_trim`): in a test
    worker, memory earlier tests freed stays resident in the heap arenas, and `run()` taking it
    would read as no peak at all."""
    if not CLEAR_REFS.exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # no glibc: nothing to hand back
        ctypes.CDLL(None).malloc_trim(0)
    CLEAR_REFS.write_text("5")  # VmHWM back to VmRSS
    before = _status("VmRSS:")
    run()
    return _status("VmHWM:") - before
