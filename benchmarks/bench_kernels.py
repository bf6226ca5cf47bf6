"""GB/s of GGUF weight bytes the CPU kernels consume in a decode-style product, against a plain read.

    python benchmarks/bench_kernels.py [--threads 1,2] [--types Q2_K,Q3_K,...] [--experts 16] [--repeat 5]
        [--in-cache]

One step of a real-size Kimi-K3 MoE layer: `--experts` matrices of one expert role (3072 x 3584, the
shape of up and gate), each multiplied by one input row (decode: top-16 experts, one token), through
`k3stream.quant.kernels.grouped_qmatmul` (F32: `qmatmul` per matrix, as a model's F32 projections
run). The same bytes are read by a plain sequential pass (`torch.sum` over them as int64, the same
thread count), the physical limit of reading them from RAM, alternating with the product run for run
(the best of each), so both meet the machine in the same phases.
Every side reads from RAM: the matrices are held in enough copies that all of them together are at least
twice the last-level cache (its size is read from sysfs and printed), and each run, of any side, takes
the next copy in turn, so no run finds in the cache what an earlier one read. `--in-cache` keeps one copy
(with `--experts 2` the matrices fit the L2 or L3: the kernels' compute rate). Printed per type and
thread count: both rates and the ratio; types with integer kernels (`cpu.Q8_TYPES`) also with `match_ggml`
("q8": activations quantized to Q8_K, Q8_0 or Q8_1 as llama.cpp does). Also prints the reference path
(dequantize, then matmul) once. The i-quants and ternary types (which k3stream does not encode) take
random valid blocks.

`--iquants` (the i-quants, TQ1_0, TQ2_0 and MXFP4 on random valid blocks): the integer mat-vec GB/s
(activations quantized to 8 bits in the call, as ggml does), the plain read's and llama.cpp's own: its
`from_float` and then its `vec_dot` (libggml-cpu's function pointers, from llama-cpp-python) over every
row of every matrix, in a loop compiled here with gcc and split over the same threads, alternating run
for run with ours; the ratios to the read and to llama.cpp. Any type with an integer kernel may be
named (`--iquants Q6_K,Q8_0,IQ2_XXS`). `--rows N` gives each matrix N input rows (prefill-shaped: k3stream
takes its multi-row kernels, each weight block decoded once for all the rows, llama.cpp its vec_dot for
every row and input row); "Gw/s" counts weights times input rows a second. `--clock cpu` (with
`--threads 1`) times the calling thread's CPU seconds, which other processes on a shared machine do
not take. `--avx2` (on an AVX-512 machine) also times ours under K3STREAM_NO_AVX512=1 (the AVX2
kernels) in the same alternation: "avx2 GB/s", its ratio to the read and ours to it; `--env NAME=VALUE`
the same with another setting ("env GB/s": e.g. K3STREAM_WIDE_VECTORS=0, Q8_0's eight-row kernel where
a CPU runs 512-bit operations at full width). `--shape 12288x7168`
sets the matrices' rows and columns (a Kimi-K3 trunk projection). `--llama-graph` runs llama.cpp's side
as its CPU backend runs a model's product: a `ggml_mul_mat` graph (`testing.ggml_oracle.MulMat`; for a
prefill-shaped Q8_0 product llamafile's sgemm), the weights copied into ggml's buffer (one graph per
copy of the matrices). The memory held is about twice the last-level cache or one copy, whichever is larger.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from k3stream.quant import quantize
from k3stream.quant.kernels import F32, QWeight, cpu, grouped_qmatmul, qmatmul
from k3stream.testing import ggml_oracle

ROWS, COLS = 3072, 3584  # one Kimi-K3 expert's up (or gate) projection: expert_ff x latent


def last_level_cache_bytes() -> int:
    """The size of the CPU's last-level cache (sysfs, else sysconf; 0 where neither says)."""
    for index in (3, 2):
        size = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if size.exists():
            text = size.read_text().strip()
            return int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return max(os.sysconf(name) for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"))


def copies_for_ram(set_bytes: int, in_cache: bool) -> int:
    """How many copies of `set_bytes` of matrices make a working set of at least twice the last-level
    cache (1 with `in_cache`)."""
    return 1 if in_cache else max(1, -(-2 * last_level_cache_bytes() // set_bytes))


class Rotation:
    """Copies of one set of matrices, handed out in turn: consecutive runs read different memory."""

    def __init__(self, copies: list):
        self.copies, self.taken = copies, 0

    def take(self):
        self.taken += 1
        return self.copies[(self.taken - 1) % len(self.copies)]


def memory_line(in_cache: bool) -> str:
    """The header line that says where the runs read the matrices from."""
    llc = last_level_cache_bytes() / 2**20
    if in_cache:
        return f"last-level cache {llc:.0f} MiB; --in-cache: one copy of the matrices, read again every run"
    return (
        f"last-level cache {llc:.0f} MiB; each type's matrices in enough copies to make {2 * llc:.0f} MiB "
        "or more, every run (of any side) taking the next: all read from RAM"
    )


def matrices(qtype: GGMLQuantizationType, count: int, in_cache: bool) -> Rotation:
    """`count` matrices of `qtype` in copies_for_ram copies, each a list of QWeights."""
    rng = np.random.default_rng(0)
    if qtype in cpu.IQ_TYPES:  # types k3stream does not encode: random valid blocks
        blocks = ggml_oracle.random_blocks(int(qtype), ROWS * COLS // GGML_QUANT_SIZES[qtype][0], rng)
    else:
        blocks = quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    data = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1))
    copies = copies_for_ram(data.numel() * count, in_cache)
    return Rotation(
        [[QWeight(data.clone(), int(qtype), (ROWS, COLS)) for _ in range(count)] for _ in range(copies)]
    )


def plain_read(datas: list[torch.Tensor]) -> list[torch.Tensor]:
    """A sequential pass over the bytes: their sum as int64 words."""
    return [d.view(torch.int64).sum() for d in datas]


def best_seconds(run, repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_both(first, second, repeat: int) -> tuple[float, float]:
    """The fastest of `repeat` runs of each, alternating (the machine's speed drifts within seconds:
    both see the same phases)."""
    fastest_first, fastest_second = best_of_each((first, second), repeat)
    return fastest_first, fastest_second


def best_of_each(runs, repeat: int, clock=time.perf_counter) -> tuple[float, ...]:
    """best_of_both for any number of runs, taken in turn (timed by `clock`)."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, spent in zip(runs, times, strict=True):
            start = clock()
            run()
            spent.append(clock() - start)
    return tuple(min(spent) for spent in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument(
        "--types", default="Q2_K,Q3_K,Q4_0,Q8_0,Q4_K,Q5_K,Q6_K,Q4_1,Q5_0,Q5_1,MXFP4,F16,BF16,F32"
    )
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--in-cache", action="store_true", help="one copy of the matrices (no rotation through RAM)"
    )
    parser.add_argument(
        "--iquants", nargs="?", const=IQUANTS, default="", help=f"these types against llama.cpp ({IQUANTS})"
    )
    parser.add_argument(
        "--rows", type=int, default=1, help="--iquants: input rows (1: decode; more: prefill)"
    )
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="--iquants, one thread: the thread's CPU seconds",
    )
    parser.add_argument("--avx2", action="store_true", help="--iquants: also ours under K3STREAM_NO_AVX512=1")
    parser.add_argument("--env", help="--iquants: also ours under this NAME=VALUE environment setting")
    parser.add_argument(
        "--shape", default=f"{ROWS}x{COLS}", help="--iquants: ROWSxCOLS of each matrix (default %(default)s)"
    )
    parser.add_argument(
        "--llama-graph",
        action="store_true",
        help="--iquants: llama.cpp's side is its ggml_mul_mat graph on its CPU backend (llamafile's sgemm "
        "where it takes the shape) in place of the vec_dot loop",
    )
    args = parser.parse_args()
    if args.iquants:
        return iquants_against_llama_cpp(args)

    x = torch.randn(args.experts, COLS)
    starts = torch.arange(args.experts + 1)
    rows = torch.arange(args.experts)
    each = f"best of {args.repeat}, kernel and read alternating"
    print(f"{args.experts} matrices of {ROWS} x {COLS}, one input row each; {each}")
    print(memory_line(args.in_cache))
    print(f"{'type':9s} {'threads':>7s} {'kernel GB/s':>11s} {'read GB/s':>9s} {'ratio':>6s} {'Gw/s':>6s}")
    for name in args.types.split(","):
        rotation = matrices(GGMLQuantizationType[name], args.experts, args.in_cache)
        total = sum(w.data.numel() for w in rotation.copies[0])

        def read(rotation=rotation):
            return plain_read([w.data for w in rotation.take()])

        for match_ggml in (False, True) if GGMLQuantizationType[name] in cpu.Q8_TYPES else (False,):

            def product(rotation=rotation, match_ggml=match_ggml):
                weights = rotation.take()
                if weights[0].ggml_type == F32:  # a model's F32 mat-vecs: one matrix at a time
                    return [qmatmul(x[i : i + 1], w) for i, w in enumerate(weights)]
                return grouped_qmatmul(x, weights, starts, rows, match_ggml=match_ggml)

            label = name + " q8" * match_ggml
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                kernel, plain = best_of_both(product, read, args.repeat)
                print(
                    f"{label:9s} {threads:7d} {total / kernel / 1e9:11.2f} {total / plain / 1e9:9.2f} "
                    f"{plain / kernel:6.2f} {ROWS * COLS * args.experts / kernel / 1e9:6.2f}"
                )
    torch.set_num_threads(1)
    rotation = matrices(GGMLQuantizationType.Q2_K, args.experts, args.in_cache)
    reference = best_seconds(lambda: grouped_qmatmul(x, rotation.take(), starts, rows, "reference"), 2)
    total = sum(w.data.numel() for w in rotation.copies[0])
    print(f"reference path (dequantize, then matmul), Q2_K, 1 thread: {total / reference / 1e9:.2f} GB/s")


IQUANTS = "IQ2_XXS,IQ1_S,IQ4_XS,IQ2_XS,IQ3_XXS,IQ3_S,IQ2_S,IQ1_M,IQ4_NL,TQ1_0,TQ2_0,MXFP4,NVFP4"
# llama.cpp's mat-vec as its CPU backend runs one (x quantized once, then vec_dot row by row, rows split
# over the threads), on libggml-cpu's function pointers
GGML_ROWS = r"""
#include <stddef.h>
#include <stdint.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*from_float_t)(const float *, void *, int64_t);
void ggml_rows(void *dot, void *from_float, const float *x, int n, int inputs, uint8_t *q8, int64_t q8_bytes,
               const int64_t *matrices, int count, int rows, int64_t row_bytes, float *out, int threads) {
    for (int i = 0; i < inputs; i++) ((from_float_t)from_float)(x + (int64_t)i * n, q8 + i * q8_bytes, n);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < (int64_t)count * rows; r++) {
        const uint8_t *row = (const uint8_t *)(intptr_t)matrices[r / rows] + (r % rows) * row_bytes;
        for (int i = 0; i < inputs; i++)
            ((vec_dot_t)dot)(n, out + (int64_t)i * count * rows + r, 0, row, 0, q8 + i * q8_bytes, 0, 1);
    }
}
"""


def ggml_rows_library() -> ctypes.CDLL:
    """GGML_ROWS compiled here (gcc, OpenMP) into a temporary shared library."""
    with tempfile.TemporaryDirectory(prefix="k3-bench-") as name:  # the loaded library outlives its file
        folder = Path(name)
        (folder / "rows.c").write_text(GGML_ROWS)
        library = folder / "rows.so"
        command = ["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", str(folder / "rows.c"), "-o", str(library)]
        subprocess.run(command, check=True)
        return ctypes.CDLL(str(library))


@dataclass
class IquantCase:
    """One type's matrices (`shape`: rows, cols) for the --iquants table, in copies taken in turn
    (`rotation`: each a list of GGUF byte tensors), and the buffers both sides write; `graphs`: llama.cpp's
    mul_mat graph over each copy (--llama-graph), else empty."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    rotation: Rotation
    row_bytes: int
    q8: np.ndarray
    out: torch.Tensor
    graphs: Rotation | None = None

    @classmethod
    def make(cls, name: str, experts: int, inputs: int, shape: tuple[int, int], in_cache: bool) -> IquantCase:
        qtype = GGMLQuantizationType[name]
        elems, nbytes = GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        blocks = torch.from_numpy(
            ggml_oracle.random_blocks(int(qtype), rows * cols // elems, np.random.default_rng(0)).reshape(-1)
        )
        copies = copies_for_ram(blocks.numel() * experts, in_cache)
        rotation = Rotation([[blocks.clone() for _ in range(experts)] for _ in range(copies)])
        q8 = np.zeros((inputs, cols * 2), dtype=np.uint8)  # each row's 8-bit blocks (under 2 bytes a value)
        return cls(qtype, shape, rotation, cols // elems * nbytes, q8, torch.empty(inputs, experts, rows))

    @property
    def bytes(self) -> int:
        """The bytes of one copy of the matrices (what one run reads)."""
        return sum(d.numel() for d in self.rotation.copies[0])

    def ours(self, x: torch.Tensor) -> torch.Tensor:
        """Every row of x times every matrix of the next copy, one call (a step's experts)."""
        datas = self.rotation.take()
        count, inputs = len(datas), len(x)
        starts, rows = torch.arange(count + 1) * inputs, torch.arange(inputs).repeat(count)
        return cpu.grouped_product(
            x, datas, int(self.qtype), self.shape[0], self.row_bytes, starts, rows, True
        )

    def ours_with(self, x: torch.Tensor, setting: tuple[str, str]) -> torch.Tensor:
        """`ours` under one environment setting (name, value) for the call: K3STREAM_NO_AVX512=1 takes
        the AVX2 kernels."""
        name, value = setting
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return self.ours(x)
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before

    def theirs(self, x: torch.Tensor, library: ctypes.CDLL, threads: int) -> None:
        if self.graphs is not None:
            self.graphs.take()(x.numpy())
            return
        datas = self.rotation.take()
        weights = ggml_oracle._traits(int(self.qtype))
        activations = ggml_oracle._traits(ggml_oracle.activation_type(int(self.qtype)))
        addresses = (ctypes.c_int64 * len(datas))(*[d.data_ptr() for d in datas])
        library.ggml_rows(
            ctypes.c_void_p(weights.vec_dot), ctypes.c_void_p(activations.from_float),
            ctypes.c_void_p(x.data_ptr()), self.shape[1], len(x), ctypes.c_void_p(self.q8.ctypes.data),
            ctypes.c_int64(self.q8.shape[1]), addresses,
            len(datas), self.shape[0], ctypes.c_int64(self.row_bytes),
            ctypes.c_void_p(self.out.data_ptr()), threads,
        )  # fmt: skip

    def open_graphs(self, inputs: int, threads: int) -> None:
        """llama.cpp's mul_mat graph over each copy (--llama-graph)."""
        rows, cols = self.shape
        self.graphs = Rotation(
            [
                ggml_oracle.MulMat(
                    int(self.qtype), [d.numpy().reshape(rows, -1) for d in datas], cols, inputs, threads
                )
                for datas in self.rotation.copies
            ]
        )

    def close_graphs(self) -> None:
        for graph in self.graphs.copies if self.graphs is not None else ():
            graph.close()
        self.graphs = None

    def seconds(
        self,
        x: torch.Tensor,
        library: ctypes.CDLL,
        threads: int,
        repeat: int,
        clock=time.perf_counter,
        setting: tuple[str, str] | None = None,
    ) -> tuple[float, ...]:
        """The best times of ours and llama.cpp's (alternating), of a plain read of the bytes, and (`setting`)
        of ours under that environment setting; every run takes the next copy of the matrices."""
        torch.set_num_threads(threads)
        runs = (
            lambda: self.ours(x),
            lambda: self.theirs(x, library, threads),
            lambda: plain_read(self.rotation.take()),
        )
        also = () if setting is None else ((lambda: self.ours_with(x, setting)),)
        return best_of_each(runs + also, repeat, clock)


def iquants_against_llama_cpp(args: argparse.Namespace) -> None:
    """The --iquants table: `--rows` input rows through `--experts` matrices of each type."""
    if ggml_oracle.library() is None:
        raise SystemExit("--iquants needs llama-cpp-python's libggml-cpu")
    rows, cols = (int(part) for part in args.shape.split("x"))
    library, x = ggml_rows_library(), torch.randn(args.rows, cols)
    llama_avx512 = "with" if ggml_oracle.library().ggml_cpu_has_avx512() else "without"
    theirs = "its mul_mat graph" if args.llama_graph else "its vec_dot loop"
    if args.avx2 and args.env:
        raise SystemExit("--avx2 and --env: name one of them")
    setting = (
        ("K3STREAM_NO_AVX512", "1") if args.avx2 else tuple(args.env.split("=", 1)) if args.env else None
    )
    if setting is not None and len(setting) != 2:
        raise SystemExit(f"--env {args.env}: expected NAME=VALUE")
    alt = "avx2" if args.avx2 else "env"
    print(
        f"{args.experts} matrices of {rows} x {cols} (random valid blocks), {args.rows} input row(s) each; "
        f"best of {args.repeat}, ours, llama.cpp's ({theirs}), the read (--avx2: ours on AVX2; --env: ours "
        f"under it) alternating; "
        f"k3stream's kernels: {cpu.isa()}, llama.cpp's libggml-cpu {llama_avx512} AVX-512"
    )
    print(memory_line(args.in_cache))
    print(f"{'type':8s} {'threads':>7s} {'k3 GB/s':>8s} {'read GB/s':>9s} {'k3/read':>7s} "
          f"{'llama GB/s':>10s} {'k3/llama':>8s} {'k3 Gw/s':>8s} {'llama Gw/s':>10s}"
          + f" {alt + ' GB/s':>9s} {alt + '/read':>9s} {'k3/' + alt:>7s}" * bool(setting))  # fmt: skip
    for name in args.iquants.split(","):
        case = IquantCase.make(name, args.experts, args.rows, (rows, cols), args.in_cache)
        total, products = case.bytes, rows * cols * args.experts * args.rows
        for threads in (int(t) for t in args.threads.split(",")):
            if args.llama_graph:
                case.open_graphs(args.rows, threads)
            clock = time.thread_time if args.clock == "cpu" else time.perf_counter
            kernel, llama, read, *also = case.seconds(x, library, threads, args.repeat, clock, setting)
            print(
                f"{name:8s} {threads:7d} {total / kernel / 1e9:8.2f} {total / read / 1e9:9.2f} "
                f"{read / kernel:7.2f} {total / llama / 1e9:10.2f} {llama / kernel:8.2f} "
                f"{products / kernel / 1e9:8.2f} {products / llama / 1e9:10.2f}"
                + "".join(f" {total / t / 1e9:9.2f} {read / t:9.2f} {t / kernel:7.2f}" for t in also)
            )
            case.close_graphs()


if __name__ == "__main__":
    main()
