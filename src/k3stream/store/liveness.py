"""A weak record of every host expert buffer the store made, for `live_host_bytes()`: tests use it to
check that expert bytes alive anywhere (the tiers, a caller's views) stay within the budgets."""

from __future__ import annotations

import threading
import weakref

import numpy as np


class LiveBuffers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[int, weakref.ref] = {}

    def track(self, array: np.ndarray) -> None:
        ident = id(array)
        with self._lock:
            # the callback takes no lock: it runs wherever the array dies, maybe inside `track`
            self._refs[ident] = weakref.ref(array, lambda _ref, ident=ident: self._refs.pop(ident, None))

    def nbytes(self) -> int:
        """Bytes of the tracked buffers still alive."""
        with self._lock:
            arrays = [ref() for ref in list(self._refs.values())]
        return sum(array.nbytes for array in arrays if array is not None)
