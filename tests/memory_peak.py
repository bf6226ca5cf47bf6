"""The most resident memory a call takes above what the process held before it (Linux)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest

CLEAR_REFS = Path("/proc/self/clear_refs")


def _status(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def peak_above(run: Callable[[], object]) -> int:
    """Bytes `run()` took at its peak above the process's resident set before it (VmHWM, reset). Garbage
    is collected first: an earlier test's model freed by a collection inside `run()` would lower the
    resident set below the baseline and hide the peak."""
    if not CLEAR_REFS.exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    gc.collect()
    CLEAR_REFS.write_text("5")  # VmHWM back to VmRSS
    before = _status("VmRSS:")
    run()
    return _status("VmHWM:") - before
