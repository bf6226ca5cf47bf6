"""CPU spent per GB of expert-pack reads: into fresh buffers, and into buffers read into before.

    python benchmarks/bench_read_cpu.py MANIFEST [--rounds 3] [--batch 16] [--digest]

Reads every object of the pack with the store's reader (`PackFile`, O_DIRECT, 4 threads, 4 splits per
object), `--batch` objects at a time, alternating per round between a fresh buffer per object (each
page faulted in and zeroed by the kernel on the read's first write, unmapped when freed) and the
store's `RecycledBuffers` (a buffer comes back when its object dies and the next read takes it).
Then the same into recycled buffers through the page cache (buffered reads, the pack's pages dropped
before each pass: what the store does when the pack fits its RAM budget and no memory limit is set).
Prints the process CPU seconds per GB (all threads: reader threads, page faults, digest checks with
`--digest`) and the wall time; on a shared machine compare within a round.
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from k3stream.pack.integrity import object_digest
from k3stream.pack.reader import ExpertPack
from k3stream.store.pack_io import PackFile, ReadRequest, host_buffer
from k3stream.store.reader import RecycledBuffers
from k3stream.testing.cgroups import drop_page_cache


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_all(
    pack: ExpertPack,
    file: PackFile,
    batch: int,
    buffers: RecycledBuffers | None,
    digest: bool,
    keys: list[tuple[int, int]] | None = None,
):
    """(bytes read, CPU seconds, wall seconds) of one pass over the objects `keys` (default: every
    object, in pack order), `batch` at a time."""
    if keys is None:
        keys = [(layer, expert) for layer in pack.moe_layers for expert in range(pack.num_experts)]
    total, cpu, wall = 0, cpu_seconds(), time.perf_counter()
    for start in range(0, len(keys), batch):
        requests, views = [], []
        for key in keys[start : start + batch]:
            offset, nbytes = pack.object_range(*key)
            if buffers is None:
                destination = host_buffer(nbytes, direct_io=True)
                view = destination[:nbytes]
            else:
                destination, view = buffers.take(nbytes)
            requests.append(ReadRequest(f"{key}", offset, nbytes, destination))
            views.append(view)
            total += nbytes
        file.read(requests)
        if digest:
            for view in views:
                object_digest(view)
        del requests, views  # the objects die: recycled buffers come back for the next batch
    return total, cpu_seconds() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="objects read at once (a step's experts)")
    parser.add_argument("--digest", action="store_true", help="also hash each object (xxh3), as the store")
    args = parser.parse_args(argv)
    with ExpertPack(args.manifest) as pack:
        direct = PackFile(pack.path, io_threads=4, read_splits=4, direct_io=True)
        buffered = PackFile(pack.path, io_threads=4, read_splits=4, direct_io=False)
        print(f"pack {pack.path} (O_DIRECT: {direct.direct_io_note}), {args.batch} objects a read")
        print("round  reads     buffers   GB     CPU s/GB  wall GB/s")
        runs = [("O_DIRECT", direct, False), ("O_DIRECT", direct, True), ("buffered", buffered, True)]
        try:
            for round_number in range(1, args.rounds + 1):
                for reads, file, recycled in runs:
                    buffers = RecycledBuffers(pack.object_bytes, args.batch) if recycled else None
                    drop_page_cache(pack.path)
                    nbytes, cpu, wall = read_all(pack, file, args.batch, buffers, args.digest)
                    gb, name = nbytes / 1e9, "recycled" if recycled else "fresh"
                    rates = f"{cpu / gb:9.3f}  {gb / wall:9.2f}"
                    print(f"{round_number:>5}  {reads:<8}  {name:<8} {gb:5.2f}  {rates}")
        finally:
            direct.close()
            buffered.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
