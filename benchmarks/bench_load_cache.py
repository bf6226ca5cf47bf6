"""Page cache a non-expert weight load leaves charged to a memory cgroup, by how the weights are read.

    python benchmarks/bench_load_cache.py MODEL.gguf [--limit 2GiB] [--repeat 2]

Each method loads every non-expert tensor of MODEL in a fresh child memory cgroup (the file's page
cache dropped first) and reports the load time, the page cache charged to the group after the load
(memory.stat), the group's peak memory and how often its limit was hit:

- `buffered`: plain reads (a load without `K3Checkpoint.uncached_reads`);
- `fadvise`: `k3stream.gguf.uncached.read_uncached`: 16 MiB reads, each dropped from the cache after;
- `direct`: O_DIRECT reads of 4 KiB-aligned 16 MiB chunks into an aligned buffer, copied out.

Needs a writable memory cgroup (root); prints one line and exits 0 where there is none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from k3stream.memlimit import MIB, parse_size
from k3stream.testing.cgroups import ChildCgroup, drop_page_cache

CHILD = r"""
import json, mmap, os, sys, time
import numpy as np
from k3stream.gguf.reader import K3Checkpoint
from k3stream.gguf.weights import nonexpert_tensors

CHUNK = 16 << 20

def read_direct(checkpoint, name, start=0, nbytes=None):
    info = checkpoint.info(name)
    nbytes = info.nbytes - start if nbytes is None else nbytes
    out = np.empty(nbytes, dtype=np.uint8)
    first = info.data_offset + start
    fd = os.open(checkpoint.shards[info.shard_index], os.O_RDONLY | os.O_DIRECT)
    bounce = mmap.mmap(-1, CHUNK + 4096)
    try:
        done = 0
        while done < nbytes:
            aligned = (first + done) // 4096 * 4096
            skip = first + done - aligned
            length = min(CHUNK, -(-(skip + nbytes - done) // 4096) * 4096)
            got = os.preadv(fd, [memoryview(bounce)[:length]], aligned) - skip
            take = min(got, nbytes - done, length - skip)
            if take <= 0:
                raise ValueError(f"{info.path}: tensor {name} is cut short")
            out[done : done + take] = np.frombuffer(bounce, np.uint8, take, skip)
            done += take
    finally:
        bounce.close()
        os.close(fd)
    return out

method, path = sys.argv[1], sys.argv[2]
checkpoint = K3Checkpoint.open(path)
checkpoint.uncached_reads = method == "fadvise"
if method == "direct":
    K3Checkpoint.read = read_direct
start = time.perf_counter()
total = sum(value.numel() * value.element_size() for _name, value, _type in nonexpert_tensors(checkpoint))
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": total}))
"""
METHODS = ("buffered", "fadvise", "direct")


def run(method: str, model: Path, limit: int) -> dict:
    cgroup = ChildCgroup.create(f"bench-load-{method}-{os.getpid()}", limit)
    if isinstance(cgroup, str):
        raise SystemExit(f"bench_load_cache: skipped: {cgroup}")
    try:
        drop_page_cache(model)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, method, str(model)],
            capture_output=True,
            text=True,
            preexec_fn=cgroup.join,
            check=False,
        )
        if done.returncode:
            raise SystemExit(f"bench_load_cache: {method} failed: {done.stderr.strip().splitlines()[-1:]}")
        return {**json.loads(done.stdout), **cgroup.usage(), "page_cache_bytes": cgroup.page_cache_bytes()}
    finally:
        cgroup.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--limit", default="2GiB", help="the child cgroup's memory limit (%(default)s)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per method; the best time is kept")
    args = parser.parse_args(argv)
    limit = parse_size(args.limit)
    os.sync()  # a freshly written model's dirty pages cannot be dropped
    print(
        f"{'method':<10} {'load s':>7} {'MB/s':>7} {'cache left MiB':>15} {'peak MiB':>9} {'limit hits':>10}"
    )
    for method in METHODS:
        runs = [run(method, args.model, limit) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["seconds"])
        print(
            f"{method:<10} {best['seconds']:>7.2f} {best['bytes'] / best['seconds'] / 1e6:>7.0f} "
            f"{max(r['page_cache_bytes'] for r in runs) / MIB:>15.1f} {best['peak_bytes'] / MIB:>9.0f} "
            f"{best['limit_hits']:>10}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
