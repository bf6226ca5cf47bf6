"""Expert-pack build throughput against a raw sequential copy of the same bytes on the same disk.

Generates (once, cached) a tiny-architecture Kimi-K3 GGUF whose routed experts total over 1 GiB, then
alternates: a raw copy (copy_file_range of each routed tensor, whole, into one file, then fsync) and
`build_pack` (expert-major reordering, fsync, sampled verification, manifest). Both run cold: the
GGUF and the outputs are evicted from the page cache (posix_fadvise DONTNEED after fsync) before each
run. Prints each run and the median ratio build/raw.

    python benchmarks/bench_pack.py [--cache DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from k3stream.gguf.reader import K3Checkpoint
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.testing.tiny import TinySpec, make_tiny

# 3 MoE layers x 64 experts x 3 roles x 2 MiB (F16 1024 x 1024) = 1.125 GiB of routed experts
SPEC = TinySpec(n_layers=4, n_experts=64, top_k=8, expert_ff=1024, latent=1024, recipe="f16", shards=2)
MIB = 1024**2


def bench_model(cache: Path) -> Path:
    directory = cache / "bench-pack-model-v1"
    first = directory / "tiny-kimi-k3-00001-of-00002.gguf"
    if not first.is_file():
        print(f"generating the benchmark model in {directory} (once)", flush=True)
        make_tiny(directory, SPEC)
    return first


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (written pages are fsynced first, so they are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def expert_ranges(gguf: Path) -> list[tuple[Path, int, int]]:
    tensors = K3Checkpoint.open(gguf).tensors.values()
    return [(info.path, info.data_offset, info.nbytes) for info in tensors if "_exps." in info.name]


def raw_copy(ranges: list[tuple[Path, int, int]], out: Path) -> float:
    """Seconds to copy every routed tensor, whole and in file order, into `out`, fsync included."""
    started = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for path, offset, nbytes in ranges:
            source = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < nbytes:
                    done += os.copy_file_range(source, fd, nbytes - done, offset + done)
            finally:
                os.close(source)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def prepare(paths: list[Path], cold: bool) -> None:
    """Cold: evict every file involved. Warm: read the sources once so both runs find them cached."""
    for path in paths:
        if cold:
            evict(path)
        else:
            with path.open("rb") as stream:
                while stream.read(64 * MIB):
                    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/k3stream-test").expanduser())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm", action="store_true", help="run both with the GGUF in the page cache")
    args = parser.parse_args()
    gguf = bench_model(args.cache)
    shards = sorted(gguf.parent.glob("*.gguf"))
    ranges = expert_ranges(gguf)
    payload = sum(nbytes for _, _, nbytes in ranges)
    state = "warm" if args.warm else "cold"
    print(f"model {gguf.parent}: {payload / MIB:.0f} MiB of experts, {len(ranges)} tensors; {state} cache")
    ratios, copy_ratios, raw_rates, build_rates = [], [], [], []
    with tempfile.TemporaryDirectory(dir=gguf.parent, prefix="bench-") as scratch:
        raw_out, pack = Path(scratch) / "raw.bin", Path(scratch) / "bench.pack"
        for repeat in range(args.repeats):
            prepare(shards, cold=not args.warm)
            raw_seconds = raw_copy(ranges, raw_out)
            evict(raw_out)
            raw_out.unlink()
            prepare(shards, cold=not args.warm)
            result = build_pack(gguf, pack, options=BuildOptions(progress=False))
            evict(result.pack)
            result.pack.unlink()
            result.manifest.unlink()
            raw_rates.append(payload / raw_seconds)
            build_rates.append(payload / result.seconds)
            ratios.append(raw_seconds / result.seconds)
            copy_ratios.append(result.throughput * raw_seconds / payload)
            method = "copy_file_range" if result.kernel_copy else "pread/pwrite"
            print(
                f"run {repeat + 1}: raw copy {raw_rates[-1] / MIB:7.1f} MiB/s | "
                f"build {build_rates[-1] / MIB:7.1f} MiB/s ({result.seconds:.2f} s whole command; "
                f"copy phase {result.throughput / MIB:.1f} MiB/s, {method}) | ratio {ratios[-1]:.2f}",
                flush=True,
            )
    raw, build = statistics.median(raw_rates) / MIB, statistics.median(build_rates) / MIB
    print(
        f"median of {args.repeats} ({state} page cache for both): raw {raw:.1f} MiB/s, "
        f"build {build:.1f} MiB/s; median pairwise ratio "
        f"build/raw {statistics.median(ratios):.2f} (copy phase alone {statistics.median(copy_ratios):.2f}); "
        "target >= 0.80"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
