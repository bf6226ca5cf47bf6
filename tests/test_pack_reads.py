"""The pack's reader pools, C (`pack_reads.c`) and Python (K3STREAM_PYTHON_READS=1), on a real pack:
a truncated pack or an unreadable file fails in one line naming the pack and the object, a close while
reads run waits for them and never hangs, and the C readers read on while a Python thread holds the GIL.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import numpy as np
import pytest

from k3stream.store import pack_io
from k3stream.store.pack_io import PackFile, ReadRequest
from test_store import packed  # noqa: F401 (a fixture)
from test_store_concurrency import DEADLINE_S, Background

# the objects of the fixture's pack are ~200 KiB: split them as the store splits real 12 MB objects
SPLIT_BYTES = 4096


@pytest.fixture(params=["c", "python"])
def readers(request, monkeypatch) -> str:
    """Which reader pool `PackFile` takes: the C readers (skipped where not built), or Python's."""
    monkeypatch.setattr(pack_io, "MIN_SPLIT_BYTES", SPLIT_BYTES)
    if request.param == "python":
        monkeypatch.setenv("K3STREAM_PYTHON_READS", "1")
    else:
        monkeypatch.delenv("K3STREAM_PYTHON_READS", raising=False)
        if pack_io._native_reads() is None:
            pytest.skip("the C reader extension was not built (python3 setup.py build_ext --inplace)")
    return request.param


def object_requests(pack, experts: list[int], direct_io: bool) -> list[ReadRequest]:
    layer = pack.moe_layers[0]
    requests = []
    for expert in experts:
        offset, nbytes = pack.object_range(layer, expert)
        dest = pack_io.host_buffer(nbytes, direct_io)
        requests.append(ReadRequest(f"layer {layer} expert {expert}", offset, nbytes, dest))
    return requests


@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_truncated_pack_fails_in_one_line_naming_the_pack_and_the_object(
    packed,  # noqa: F811
    tmp_path,
    readers,
    direct_io,
    splits,
):
    """The pack cut inside an object: the objects before it are read whole, then the read fails with
    errno EIO in one line naming the pack, the object and the bytes its last range got."""
    _, pack = packed
    cut = tmp_path / pack.path.name
    shutil.copyfile(pack.path, cut)
    requests = object_requests(pack, [2, 5], direct_io)
    offset, nbytes = requests[1].offset, requests[1].nbytes
    end = offset + nbytes - 1000  # inside the object's last range, not on a block boundary
    with open(cut, "r+b") as file:
        file.truncate(end)
    reader = PackFile(cut, read_splits=splits, direct_io=direct_io)
    assert reader.native_reads == (readers == "c")
    last_start, last_length = pack_io.split_ranges(nbytes, splits)[-1]
    try:
        landed = []
        with pytest.raises(OSError) as failure:
            landed.extend(request.label for request in reader.read_each(requests))
        stats = reader.snapshot()
    finally:
        reader.close()
    expected = (
        f"expert-pack read failed for {requests[1].label} in {cut}: short read: "
        f"{end - offset - last_start} of {last_length} bytes at {offset + last_start}"
    )
    assert str(failure.value) == f"[Errno 5] {expected}" and "\n" not in str(failure.value)
    assert landed == [requests[0].label]
    assert (
        requests[0].dest[: requests[0].nbytes].tobytes() == pack.read_object(pack.moe_layers[0], 2).tobytes()
    )
    assert (stats["io_errors"], stats["pack_reads"]) == (1, 0)


def test_a_read_the_system_refuses_fails_in_one_line_with_its_error(tmp_path, readers):
    """A read failing in the kernel (a directory opened as the pack: EISDIR) names the pack, the
    object and the system's message, on either reader."""
    reader = PackFile(tmp_path, read_splits=2)
    request = ReadRequest("layer 1 expert 7", 0, 4 * SPLIT_BYTES, np.empty(4 * SPLIT_BYTES, dtype=np.uint8))
    try:
        with pytest.raises(IsADirectoryError) as failure:
            reader.read([request], priority=2)
    finally:
        reader.close()
    assert str(failure.value) == (
        f"[Errno 21] expert-pack read failed for layer 1 expert 7 in {tmp_path}: Is a directory"
    )


def test_close_while_reads_run_waits_for_them_and_never_hangs(packed, readers):  # noqa: F811
    """`close()` called while a step's reads are queued and running returns once they are done: the
    reads land whole, later reads are refused, and nothing hangs (each wait has a deadline)."""
    _, pack = packed
    experts = list(range(12))
    requests = object_requests(pack, experts, direct_io=False)
    reader = PackFile(pack.path, io_threads=2, read_splits=4, simulated_read_latency_us=5000)
    started = threading.Event()

    def read_all() -> list[str]:
        reads = reader.start(requests, priority=1)
        started.set()
        return sorted(request.label for request in reads)

    reading = Background(read_all)
    assert started.wait(DEADLINE_S)
    Background(reader.close).result()  # 48 ranges at 5 ms on 2 readers: it waits ~0.1 s
    assert reading.result() == sorted(request.label for request in requests)
    for expert, request in zip(experts, requests, strict=True):
        assert (
            request.dest[: request.nbytes].tobytes() == pack.read_object(pack.moe_layers[0], expert).tobytes()
        )
    assert reader.snapshot()["pack_reads"] == len(requests)
    with pytest.raises(RuntimeError, match="is closed"):
        reader.read(requests[:1])


def test_reads_left_unfinished_are_closed_by_their_holder_and_the_file_closes(packed, readers):  # noqa: F811
    """A holder that takes one object and stops (or never iterates) closes its reads; the file then
    closes at once, with no reader left running."""
    _, pack = packed
    reader = PackFile(pack.path, io_threads=2, read_splits=4, simulated_read_latency_us=2000)
    first = object_requests(pack, list(range(8)), direct_io=False)
    never = object_requests(pack, list(range(8, 12)), direct_io=False)
    reads = reader.start(first, priority=2)
    next(iter(reads))
    reads.close()
    reader.start(never, priority=3).close()
    Background(reader.close).result()
    assert reader._active_reads == 0


def test_the_c_readers_read_while_a_python_thread_holds_the_gil(packed, readers):  # noqa: F811
    """Reads queued, then the calling thread computes in Python without letting the GIL go: the C
    readers read every range meanwhile (Python reader threads would wait for the GIL)."""
    if readers != "c":
        pytest.skip("Python reader threads need the GIL to take each range")
    _, pack = packed
    reader = PackFile(pack.path, io_threads=2, read_splits=4)
    reader.range_times = []
    requests = object_requests(pack, list(range(16)), direct_io=False)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # no other Python thread runs until this one blocks
    try:
        queued = time.perf_counter_ns()
        reads = reader.start(requests, priority=1)
        while time.perf_counter_ns() - queued < 300_000_000:  # pure Python: holds the GIL
            pass
        held_until = time.perf_counter_ns()
        assert sorted(request.label for request in reads) == sorted(request.label for request in requests)
    finally:
        sys.setswitchinterval(interval)
        reader.close()
    assert len(reader.range_times) == 4 * len(requests)
    assert all(queued <= ended < held_until for _, _, ended in reader.range_times)


def test_a_batch_larger_than_the_queue_waits_for_room_and_lands_whole(packed, readers):  # noqa: F811
    """More ranges in one call than the C readers' queue holds (4,096): the call waits for room while
    the readers drain it, and every byte lands where it belongs."""
    _, pack = packed
    reader = PackFile(pack.path, io_threads=2, read_splits=1)
    size = pack.path.stat().st_size // SPLIT_BYTES * SPLIT_BYTES
    offsets = [(block * 7919 * SPLIT_BYTES) % size for block in range(5000)]
    destination = np.empty((len(offsets), SPLIT_BYTES), dtype=np.uint8)
    rows = zip(offsets, destination, strict=True)
    requests = [ReadRequest(f"block {offset}", offset, SPLIT_BYTES, row) for offset, row in rows]
    try:
        landed = Background(lambda: sum(1 for _ in reader.read_each(requests, priority=2))).result()
    finally:
        reader.close()
    assert landed == len(requests)
    whole = np.fromfile(pack.path, dtype=np.uint8)
    for offset, row in zip(offsets, destination, strict=True):
        assert np.array_equal(row, whole[offset : offset + SPLIT_BYTES])
