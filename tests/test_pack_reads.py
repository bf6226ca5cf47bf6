"""The pack's reader threads on a real pack: a truncated pack or an unreadable file fails in one line
naming the pack and the object, and a close while reads run waits for them and never hangs."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from k3stream.store import pack_io
from k3stream.store.pack_io import PackFile, ReadRequest
from test_store import packed  # noqa: F401 (a fixture)
from test_store_concurrency import DEADLINE_S, Background

# the objects of the fixture's pack are ~200 KiB: split them into ranges of this many bytes
SPLIT_BYTES = 4096


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch) -> None:
    """Objects split into ranges as the store splits real 12 MB objects."""
    monkeypatch.setattr(pack_io, "MIN_SPLIT_BYTES", SPLIT_BYTES)


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


def test_a_read_the_system_refuses_fails_in_one_line_with_its_error(tmp_path):
    """A read failing in the kernel (a directory opened as the pack: EISDIR) names the pack, the
    object and the system's message."""
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


def test_close_while_reads_run_waits_for_them_and_never_hangs(packed):  # noqa: F811
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


def test_reads_left_unfinished_are_closed_by_their_holder_and_the_file_closes(packed):  # noqa: F811
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
