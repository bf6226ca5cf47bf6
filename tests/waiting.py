"""Waiting in a test for something another thread does, within a bound (not a timing assertion)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], what: str, bound_s: float = 60.0) -> None:
    """Return once `condition()` holds; fail naming `what` when it has not within `bound_s` seconds."""
    for _ in range(int(bound_s / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")
