"""Host-to-GPU uploads for the GPU tier: a ring of pinned staging buffers and a side stream.

An upload copies the object into a pinned staging buffer (waiting only for that buffer's previous
copy), enqueues the H2D copy on the side stream and returns the destination with an event; compute
waits on the events of the experts it uses, nothing else. The destination is allocated on the side
stream; the store calls `record_stream` on the compute stream when it hands it out, so the caching
allocator never reuses an evicted buffer while a kernel may still read it.
"""

from __future__ import annotations

import threading

import torch


class GpuUploader:
    def __init__(self, device: torch.device, slot_bytes: int, staging_slots: int = 4) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._staging = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(staging_slots)
        ]
        self._staging_done: list[torch.cuda.Event | None] = [None] * staging_slots
        self._cursor = 0
        self._lock = threading.Lock()
        self.uploaded_bytes = 0

    def upload(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Enqueue a copy of the CPU uint8 tensor `host` to the GPU; (destination, ready event)."""
        with self._lock:
            index = self._cursor
            self._cursor = (index + 1) % len(self._staging)
            previous = self._staging_done[index]
            if previous is not None:
                previous.synchronize()
            stage = self._staging[index][: host.numel()]
            stage.copy_(host)
            with torch.cuda.stream(self.stream):
                target = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
                target.copy_(stage, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self._staging_done[index] = ready
            self.uploaded_bytes += host.numel()
        return target, ready

    @staticmethod
    def hand_out(buffer: torch.Tensor, ready: torch.cuda.Event) -> None:
        """Make the current stream wait for `buffer`'s copy and keep it alive for that stream's kernels."""
        stream = torch.cuda.current_stream(buffer.device)
        stream.wait_event(ready)
        buffer.record_stream(stream)
