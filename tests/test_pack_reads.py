"""The pack's reader threads on a real pack: a truncated pack or an unreadable file fails in one line
naming the pack and the object, and a close while reads run waits for them and never hangs."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.integrity import ChecksumMismatch, object_digest, object_digester
from k3stream.pack.reader import ExpertPack
from k3stream.quant.kernels import cpu
from k3stream.store import ExpertStore, pack_io
from k3stream.store.pack_io import PackFile, ReadRequest
from k3stream.testing import ggml_oracle
from test_store import packed  # noqa: F401 (a fixture)
from test_store_concurrency import DEADLINE_S, Background

# the objects of the fixture's pack are ~200 KiB: split them into ranges of this many bytes
SPLIT_BYTES = 4096
MIB = 1 << 20
QUIET = BuildOptions(progress=False)


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


def test_a_digest_fed_ranges_out_of_order_is_the_whole_objects_once_every_byte_is_in(packed):  # noqa: F811
    """`OrderedDigest` fed an object's ranges last first: it says nothing until the first range is in,
    then hashes them all in order, equal to the object's digest as the pack records it."""
    _, pack = packed
    data = pack.read_object(pack.moe_layers[0], 3)
    ranges = pack_io.split_ranges(len(data), 4)
    digest = pack_io.OrderedDigest(object_digester())
    for start, length in reversed(ranges):
        assert digest.intdigest(len(data)) is None
        digest.landed(start, np.frombuffer(data, dtype=np.uint8)[start : start + length])
    assert len(ranges) == 4 and digest.intdigest(len(data)) == object_digest(data)
    pack.check_digest(pack.moe_layers[0], 3, digest.intdigest(len(data)))


@pytest.mark.parametrize("direct_io", [False, True])
def test_reads_keep_every_reader_busy_aligned_and_feed_each_objects_digest(packed, direct_io):  # noqa: F811
    """A step's objects, each split in 4 ranges, on 4 readers: all 4 read at once (the depth the
    readers give the disk), every range starts on a 4 KiB boundary into an aligned buffer, the bytes
    read are the objects' and no more, and each object's digest, fed by the readers as its ranges land,
    is its own."""
    _, pack = packed
    requests = [
        ReadRequest(
            request.label,
            request.offset,
            request.nbytes,
            request.dest,
            pack_io.OrderedDigest(object_digester()),
        )
        for request in object_requests(pack, list(range(6)), direct_io)
    ]
    reader = PackFile(
        pack.path, io_threads=4, read_splits=4, direct_io=direct_io, simulated_read_latency_us=3000
    )
    try:
        reader.read(requests, priority=1)
        stats = reader.snapshot()
    finally:
        reader.close()
    assert stats["pack_ranges"] == 4 * len(requests) and stats["pack_unaligned_ranges"] == 0
    assert stats["pack_depth_max"] == 4 and stats["pack_depth_ns"] > 3 * stats["pack_busy_ns"]
    assert stats["pack_read_bytes"] == sum(request.nbytes for request in requests)
    for expert, request in enumerate(requests):
        data = pack.read_object(pack.moe_layers[0], expert)
        assert request.digest.intdigest(request.nbytes) == object_digest(data)


def test_a_damaged_last_range_fails_the_fetch_and_is_never_cached(packed, tmp_path):  # noqa: F811
    """An object split in ranges whose last range carries a flipped bit: the store's fetch of it fails
    with the checksum mismatch (counted), the object is never cached, and its sound neighbours serve."""
    gguf, _ = packed
    built = build_pack(gguf, tmp_path / "tiny.pack", tmp_path / "tiny.manifest.json", options=QUIET)
    pack = ExpertPack(built.manifest)
    layer = pack.moe_layers[0]
    offset, nbytes = pack.object_range(layer, 4)
    with open(pack.path, "r+b") as file:
        file.seek(offset + nbytes - 1)
        last = file.read(1)[0]
        file.seek(offset + nbytes - 1)
        file.write(bytes([last ^ 0x01]))
    budget = 4 * pack.top_k * pack.object_bytes / MIB
    with ExpertStore(pack, ram_mib=budget, prefetch=False, read_splits=4) as store:
        with pytest.raises(ChecksumMismatch, match=f"layer {layer} expert 4 of"):
            store.fetch(layer, [3, 4])
        assert (layer, 4) not in store._compute.buffers
        assert sorted(store.fetch(layer, [3, 5])) == [3, 5]
        stats = store.stats()
    assert stats["integrity_errors"] == 1 and stats["pack_ranges"] > stats["pack_reads"]


def q8_0_product(rows: int, cols: int) -> torch.Tensor:
    """One row of x times a random Q8_0 matrix [rows, cols] on 2 threads (`cpu.products`)."""
    q8_0 = GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(7)
    blocks = ggml_oracle.random_blocks(int(q8_0), rows * cols // GGML_QUANT_SIZES[q8_0][0], rng)
    matrix = torch.from_numpy(blocks.reshape(rows, -1))
    x = torch.from_numpy(rng.standard_normal((1, cols), dtype=np.float32))
    torch.set_num_threads(2)
    return cpu.products(x, [matrix.data_ptr()], [int(q8_0)], [rows], [matrix.shape[1]], [1])


@pytest.mark.skipif(not cpu.available(), reason="the C kernels are not built")
def test_mat_vec_regions_leave_a_cpu_to_the_readers_while_ranges_are_read(packed):  # noqa: F811
    """While a pack range is read or hashed a mat-vec region asked for 2 threads takes 1 (the other CPU
    takes the readers' wake-ups, digests and the disk's interrupts), with the same bits; 2 once the
    reads are in, and 2 throughout with the yield turned off."""
    _, pack = packed
    previous = torch.get_num_threads()
    alone = q8_0_product(512, 1024)
    reader = PackFile(pack.path, io_threads=2, read_splits=4, simulated_read_latency_us=20000)
    try:
        for yielding in (True, False):
            cpu.set_reads_yield(yielding)
            reads = reader.start(object_requests(pack, [0, 1], direct_io=False), priority=1)
            deadline = time.monotonic() + DEADLINE_S
            while not reader.snapshot()["pack_ranges"] and time.monotonic() < deadline:
                time.sleep(0.001)  # until a reader has taken its first range
            seen = {cpu.region_threads(2)}
            beside = q8_0_product(512, 1024)  # 8 ranges at 20 ms on 2 readers: it runs beside them
            seen.add(cpu.region_threads(2))
            assert len(list(reads)) == 2
            assert seen == ({1} if yielding else {2}) and cpu.region_threads(2) == 2
            assert torch.equal(beside, alone)
    finally:
        cpu.set_reads_yield(True)
        torch.set_num_threads(previous)
        reader.close()
