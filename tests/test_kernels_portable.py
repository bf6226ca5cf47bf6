"""The C kernels as other machines get them. The portable build (what a CPU other than x86-64 compiles:
no AVX2 or AVX-512 code, `K3STREAM_PORTABLE_BUILD`): built by setup.py into a temporary directory,
loaded in place of the installed extension in a child process, its products and decoders checked
against `gguf`'s dequantization. An install without the extension (no C compiler): said once, with why
and what to do, and by `k3stream --version`."""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from conftest import NO_C_KERNELS, REQUIRE_ORACLE
from k3stream.cli import main
from k3stream.quant.kernels import cpu
from k3stream.testing import ggml_oracle

ROOT = Path(__file__).resolve().parent.parent

# run in the child: an extension's file in argv[1] (else the installed one) is registered under the
# installed one's name before anything imports k3stream's, so every kernel call below goes through it;
# the outputs' digest tells two builds' bits apart
PORTABLE_CHECK = """
import hashlib, importlib.util, json, sys
if sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("k3stream.quant.kernels._ggml_cpu", sys.argv[1])
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

import numpy as np, torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from k3stream.quant.kernels import QWeight, qmatmul
from k3stream.testing import ggml_oracle
from test_kernels import (CPU_TYPES, FLOATS, Q8_1_TYPES, cpu, reference, relative_error, round_like_ggml,
                          weight)
from test_kernels_iquants import activations_f64, inputs, matrix, product

worst, decoders_exact, digest = 0.0, True, hashlib.sha256()
for qt in CPU_TYPES + FLOATS:  # K-quants, the 32-value types (Q8_0 among them), MXFP4, the floats
    w = weight(qt, 19, 512, seed=4)
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32))
    got = qmatmul(x, w)
    worst = max(worst, relative_error(got, reference(x, w)))
    digest.update(got.numpy().tobytes())
    if int(qt) in cpu.Q8_TYPES and qt not in Q8_1_TYPES:
        got = qmatmul(x, w, match_ggml=True)
        worst = max(worst, relative_error(got, reference(round_like_ggml(x, int(qt)), w)))
        digest.update(got.numpy().tobytes())
iq_checked = ggml_oracle.library() is not None
for qt in (T.IQ2_XXS, T.IQ4_XS, T.IQ1_M, T.TQ1_0, T.TQ2_0):  # i-quants and the ternary types
    rows, cols = 23, 1024
    w, x = matrix(qt, rows, cols, seed=7), inputs(3, cols, seed=8)
    dense = gguf_dequantize(w, qt).astype(np.float64).reshape(rows, cols)
    values = torch.empty(rows * cols)
    cpu.decode_row(int(qt), torch.from_numpy(w.reshape(-1)).data_ptr(), rows * cols, values)
    decoders_exact &= bool(np.array_equal(values.numpy(), dense.reshape(-1).astype(np.float32)))
    got = qmatmul(torch.from_numpy(x), QWeight(torch.from_numpy(w.reshape(-1)), int(qt), (rows, cols)))
    exact = x @ dense.T
    worst = max(worst, float(np.linalg.norm(got.double().numpy() - exact) / np.linalg.norm(exact)))
    got = product(qt, w, x)  # the integer kernels, on ggml's 8-bit activations
    digest.update(got.tobytes())
    if iq_checked:
        expected = np.stack([dense @ activations_f64(row, qt) for row in x])
        worst = max(worst, float(np.linalg.norm(got - expected) / np.linalg.norm(expected)))
print(json.dumps({"isa": cpu.isa(), "report": cpu.kernels_report(), "file": cpu._ggml_cpu().__file__,
                  "worst": worst, "decoders_exact": decoders_exact, "iq_integer_checked": iq_checked,
                  "digest": digest.hexdigest()}))
"""


# a C compiler without OpenMP, as Apple's clang: it refuses -fopenmp, else runs the usual one
NO_OPENMP_CC = """#!/bin/sh
for arg in "$@"; do [ "$arg" = -fopenmp ] && echo "error: unsupported option '-fopenmp'" >&2 && exit 1; done
exec {cc} "$@"
"""


def build(
    tmp_path: Path, portable: bool = True, compiler: str | None = None, python: bool = True
) -> tuple[Path, str]:
    """setup.py's extension with its own flags (and K3STREAM_PORTABLE_BUILD where `portable`; without its
    Python part, K3STREAM_WITHOUT_PYTHON, where not `python`) by `compiler` (else the usual one), under
    tmp_path (its objects in tmp_path / "objects"): its file and the build's output."""
    env = dict(os.environ)
    defines = ["-DK3STREAM_PORTABLE_BUILD"] * portable + ["-DK3STREAM_WITHOUT_PYTHON"] * (not python)
    env["CFLAGS"] = " ".join(filter(None, [os.environ.get("CFLAGS"), *defines]))
    if compiler is not None:
        env["CC"] = compiler
    build = [sys.executable, "setup.py", "-q", "build_ext", "--parallel", "2"]
    build += ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "objects")]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True)
    built = list((tmp_path / "lib").rglob("_ggml_cpu*"))
    # the extension is optional: a file that does not compile leaves setup.py's status 0 and no module
    assert done.returncode == 0 and len(built) == 1, (done.stdout + done.stderr)[-3000:]
    return built[0], done.stdout + done.stderr


def without_openmp(tmp_path: Path) -> str:
    """A C compiler that refuses -fopenmp, as Apple's clang, and else runs the usual one."""
    compiler = tmp_path / "cc"
    compiler.write_text(NO_OPENMP_CC.format(cc=os.environ.get("CC") or sysconfig.get_config_var("CC")))
    compiler.chmod(0o755)
    return str(compiler)


@pytest.mark.parametrize(
    "openmp", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["openmp", "no-openmp"]
)
def test_the_portable_build_compiles_and_its_kernels_match_gguf_dequantize(tmp_path, openmp):
    """Every C file compiles without the x86-64 SIMD code (and without OpenMP, on one thread, where the
    compiler has none: the build, the load and `--version` say so), and the module it gives runs each
    type's products (float tile and integer paths) within float32 rounding of gguf's values, its i-quant
    and ternary decoders bit for bit, and every output bit for bit what the installed build's portable
    kernels give."""
    extension, output = build(tmp_path, compiler=None if openmp else without_openmp(tmp_path))
    assert ("has no OpenMP" in output) != openmp
    report = check(extension)
    assert report["isa"] == "portable" and Path(report["file"]) == extension
    one_thread = "C (portable, one thread: built without OpenMP)"
    assert report["report"] == ("C (portable)" if openmp else one_thread)
    assert report["one_thread_warnings"] == (not openmp)
    assert report["decoders_exact"]
    assert report["worst"] <= 1e-5
    assert report["iq_integer_checked"] or not REQUIRE_ORACLE
    if cpu.available():  # the portable kernels the installed build takes on request: the same bits
        assert check(None, K3STREAM_GENERIC_KERNELS="1")["digest"] == report["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["gcc-11", "clang-14"])
def test_compilers_without_the_simd_kernels_build_the_portable_ones(tmp_path, compiler):
    """GCC 11 (no __builtin_shufflevector, no target_clones of x86-64-v3) and clang 14 (CPU feature
    tests it refuses) build the portable kernels on any machine: the same bits as GCC's."""
    if shutil.which(compiler) is None or not cpu.available():
        pytest.skip(f"needs {compiler} and the installed C kernels")
    extension, _ = build(tmp_path, portable=False, compiler=compiler)
    report = check(extension)
    assert report["isa"] == "portable" and report["decoders_exact"] and report["worst"] <= 1e-5
    assert check(None, K3STREAM_GENERIC_KERNELS="1")["digest"] == report["digest"]


# the aarch64 build's test: its compilers (GCC's cross compiler; clang, where it finds no OpenMP for
# aarch64, as Apple's clang: one thread), its emulator, the C program it runs and its threads
CROSS_COMPILERS = ("aarch64-linux-gnu-gcc", "clang-14 --target=aarch64-linux-gnu")
EMULATOR = "qemu-aarch64"
DRIVER = ROOT / "tests" / "kernels_driver.c"
DRIVER_THREADS = 2
# its shapes: (output rows, input features, input rows) of one matrix (one input row: the row kernels;
# 25: every type's multi-row kernels, on two threads), and (input features, hidden, input rows of each
# expert) of a step's routed experts (one without rows)
MATRIX_SHAPES = ((70, 1024, 1), (40, 1024, 25))
EXPERT_SHAPE = (256, 512, (2, 0, 3))
SITU_BETAS = (1.5, 4.0)
TYPE_NAMES = {cpu.INPUT_MAJOR_F32: "input-major F32"}
FLOAT_TYPES = {0: np.float32, 1: np.float16, 30: None}  # BF16 (None): float32's high halves


@pytest.fixture(scope="module")
def native_driver(tmp_path_factory) -> tuple[list[dict], Path, list[list[tuple]]]:
    """The driver's cases, their file and what the driver built for this machine gives on them."""
    folder = tmp_path_factory.mktemp("x86-64")
    cases, inputs = driver_cases(np.random.default_rng(35)), folder / "cases"
    write_cases(inputs, cases)
    native = run_driver(folder, inputs, cases, os.environ.get("CC") or sysconfig.get_config_var("CC"))
    return cases, inputs, native


@pytest.mark.slow
@pytest.mark.skipif(not cpu.available(), reason=NO_C_KERNELS)
@pytest.mark.parametrize("compiler", CROSS_COMPILERS, ids=["gcc", "clang"])
def test_the_aarch64_build_gives_the_x86_portable_kernels_bits(compiler, tmp_path, monkeypatch, request):
    """setup.py builds the kernels for aarch64 (its own flags) and kernels_driver.c runs every type's
    decoder, products (float and 8-bit activations) and routed-expert MLP there under qemu-user: bit for
    bit what the same driver built for x86-64 gives (NaN where it gives NaN), that the installed build's
    portable kernels, and its decoders gguf's dequantization."""
    tools = dict.fromkeys([compiler.split()[0], CROSS_COMPILERS[0], EMULATOR])  # clang takes GCC's libraries
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} (Debian: gcc-aarch64-linux-gnu, clang-14, qemu-user)")
    cases, inputs, native = request.getfixturevalue("native_driver")
    emulated = run_driver(tmp_path, inputs, cases, compiler, EMULATOR)
    monkeypatch.setenv("K3STREAM_GENERIC_KERNELS", "1")
    assert cpu.isa() == "portable"
    for case, got, expected in zip(cases, emulated, native, strict=True):
        name = f"{TYPE_NAMES.get(case['type']) or GGMLQuantizationType(case['type']).name} {case['kind']}"
        assert [status for status, _ in expected] == case["statuses"], name
        for what, result, x86_result in zip(case["results"], got, expected, strict=True):
            assert bits(result) == bits(x86_result), f"{name}: {what}"
        for (status, values), installed in zip(expected, installed_results(case), strict=True):
            assert status != 0 or bits((status, values)) == bits((status, installed)), name


def driver_cases(rng: np.random.Generator) -> list[dict]:
    """Every type with a C kernel: a case of each matrix shape and one of routed experts, on random valid
    blocks (finite scales) and inputs of magnitudes 10^-3..10^3 (of several rows, the last with a NaN and
    an infinity); each with its results' names and the statuses they take (-1: no kernel on 8-bit
    activations)."""
    cases = []
    for qt in [*sorted(cpu.CPU_TYPES), cpu.INPUT_MAJOR_F32]:
        q8_status = 0 if qt in cpu.Q8_TYPES else -1
        for rows, cols, count in MATRIX_SHAPES:
            cases.append({"kind": "matrix", "type": qt, "weight": random_matrix(qt, rows, cols, rng),
                          "x": random_inputs(count, cols, rng, non_finite=count > 1),
                          "results": ("decoded", "float", "8-bit"),
                          "statuses": [-1 if qt == cpu.INPUT_MAJOR_F32 else 0, 0, q8_status]})  # fmt: skip
        if qt == cpu.INPUT_MAJOR_F32:  # `Products`' own layout, not a routed expert's
            continue
        features, hidden, counts = EXPERT_SHAPE
        shapes = ((hidden, features), (hidden, features), (features, hidden))  # gate, up, down
        cases.append({"kind": "experts", "type": qt, "counts": counts, "hidden": hidden,
                      "roles": [[random_matrix(qt, *shape, rng) for _ in counts] for shape in shapes],
                      "rows": rng.integers(0, 3, sum(counts)),
                      "x": random_inputs(3, features, rng, non_finite=True),
                      "results": ("float", "8-bit"), "statuses": [0, q8_status]})  # fmt: skip
    return cases


def random_matrix(qt: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes a row]: random valid blocks of a quantized type, normal values of a float one (of
    INPUT_MAJOR_F32, [cols, rows] float32 as bytes)."""
    if qt == cpu.INPUT_MAJOR_F32:
        return rng.standard_normal((cols, rows)).astype(np.float32).view(np.uint8).reshape(rows, -1)
    if qt not in FLOAT_TYPES:
        blocks = rows * cols // GGML_QUANT_SIZES[GGMLQuantizationType(qt)][0]
        return ggml_oracle.random_blocks(qt, blocks, rng).reshape(rows, -1)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if FLOAT_TYPES[qt] is None:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.astype(FLOAT_TYPES[qt]).view(np.uint8)


def random_inputs(count: int, cols: int, rng: np.random.Generator, non_finite: bool = False) -> np.ndarray:
    """[count, cols] float32 of magnitudes 10^-3..10^3 (terms that cancel: any other order of the float
    operations shows in the last bits), an all-zero block of 256 in the first row; where `non_finite`, a
    NaN and an infinity in the last row (each of its products a NaN)."""
    x = (rng.standard_normal((count, cols)) * 10.0 ** rng.uniform(-3, 3, (count, cols))).astype(np.float32)
    x[0, :256] = 0.0
    if non_finite:
        x[-1, rng.choice(cols, 2, replace=False)] = np.nan, np.inf
    return x


def write_cases(path: Path, cases: list[dict]) -> None:
    """The cases as kernels_driver.c reads them (its header says how)."""
    parts = [struct.pack("<q", DRIVER_THREADS)]
    for table in cpu._iq_grids():
        parts += [struct.pack("<q", len(table)), table]
    parts.append(struct.pack("<q", len(cases)))
    for case in cases:
        x = case["x"]
        if case["kind"] == "matrix":
            weight = case["weight"]
            sizes = (0, case["type"], len(weight), x.shape[1], weight.shape[1], len(x))
            parts += [struct.pack("<6q", *sizes), weight.tobytes()]
        else:
            (gate, *_), _, (down, *_) = case["roles"]
            starts = np.cumsum([0, *case["counts"]])
            sizes = (1, case["type"], x.shape[1], case["hidden"], len(starts) - 1, len(case["rows"]), len(x))
            parts.append(struct.pack("<9q", *sizes, gate.shape[1], down.shape[1]))
            parts.append(struct.pack("<2f", *SITU_BETAS))
            parts += [starts.astype("<i8").tobytes(), case["rows"].astype("<i8").tobytes()]
            parts += [np.concatenate(role).tobytes() for role in case["roles"]]
        parts.append(x.astype("<f4").tobytes())
    path.write_bytes(b"".join(parts))


def run_driver(
    tmp_path: Path, inputs: Path, cases: list[dict], compiler: str, emulator: str | None = None
) -> list[list[tuple]]:
    """kernels_driver.c linked (statically where it runs under an emulator) with setup.py's objects of the
    portable kernels (without their Python part) by `compiler`, run on `inputs`: each case's results as
    (status, values)."""
    _, output = build(tmp_path, compiler=compiler, python=False)
    program, results = tmp_path / "kernels_driver", tmp_path / "results"
    objects = sorted(map(str, (tmp_path / "objects").rglob("*.o")))
    flags = ["-fopenmp"] * ("has no OpenMP" not in output) + ["-static"] * (emulator is not None)
    link = [*compiler.split(), "-std=gnu11", "-Wall", *flags, str(DRIVER), *objects, "-lm"]
    done = subprocess.run([*link, "-o", str(program)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    command = [*filter(None, [emulator]), str(program), str(inputs), str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "portable", (done.stdout + done.stderr)[-3000:]
    return read_results(results.read_bytes(), cases)


def read_results(data: bytes, cases: list[dict]) -> list[list[tuple]]:
    """kernels_driver.c's results (its header says how), each case's as (status, values)."""
    at, flat = 0, []
    while at < len(data):
        status, count = struct.unpack_from("<2q", data, at)
        flat.append((status, np.frombuffer(data, dtype="<f4", count=count, offset=at + 16)))
        at += 16 + 4 * count
    ends = np.cumsum([len(case["results"]) for case in cases])
    assert len(flat) == ends[-1]
    return [flat[end - len(case["results"]) : end] for case, end in zip(cases, ends, strict=True)]


def bits(result: tuple) -> tuple[int, bytes]:
    """A result (status, values) as bits to compare, every NaN as one: the same float operations make
    NaNs of opposite signs on x86-64 (negative) and aarch64."""
    status, values = result
    return status, np.where(np.isnan(values), np.float32(np.nan), values).tobytes()


def installed_results(case: dict) -> list[np.ndarray | None]:
    """What the installed extension gives for a case (its portable kernels where K3STREAM_GENERIC_KERNELS
    is set): the matrix's decoded values (gguf's dequantization) then its products, or the experts' MLP,
    on float then 8-bit activations (None: the type has no kernel on 8-bit ones)."""
    qt, x = case["type"], torch.from_numpy(case["x"])
    if case["kind"] == "matrix":
        weight, (rows, row_bytes) = torch.from_numpy(case["weight"].reshape(-1)), case["weight"].shape
        picked, starts = torch.arange(len(x)), torch.tensor([0, len(x)])
        decoded = (
            None if qt == cpu.INPUT_MAJOR_F32 else gguf_dequantize(case["weight"], GGMLQuantizationType(qt))
        )
        results = [None if decoded is None else decoded.astype(np.float32).reshape(-1)]
        product = functools.partial(cpu.grouped_product, x, [weight], qt, rows, row_bytes, starts, picked)
    else:
        roles = [
            cpu.Role([torch.from_numpy(m.reshape(-1)) for m in role], qt, len(role[0]), role[0].shape[1])
            for role in case["roles"]
        ]
        starts, picked = torch.tensor(np.cumsum([0, *case["counts"]])), torch.from_numpy(case["rows"])
        results = []
        product = functools.partial(cpu.expert_mlp, x, *roles, starts, picked, *SITU_BETAS)
    results.append(product(False).numpy().reshape(-1))
    results.append(product(True).numpy().reshape(-1) if qt in cpu.Q8_TYPES else None)
    return results


def check(extension: Path | None, **environment: str) -> dict:
    """PORTABLE_CHECK's report, in a child with `extension` (None: the installed one) and `environment`,
    with the times its load warned that the kernels run on one thread."""
    path = os.pathsep.join(
        [*map(str, (ROOT / "tests", ROOT / "src")), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("K3STREAM_GENERIC_KERNELS", "K3STREAM_NO_AVX512")}
    argv = [sys.executable, "-c", PORTABLE_CHECK, *([str(extension)] if extension else [])]
    done = subprocess.run(argv, env=dict(env, PYTHONPATH=path, **environment), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report | {"one_thread_warnings": done.stderr.count(cpu.NO_OPENMP)}


# run in the child: an install whose extension is missing, asked for its version, then loading a model's types
NO_EXTENSION = """
import sys
sys.modules["k3stream.quant.kernels._ggml_cpu"] = None  # its import fails as a missing module's
from k3stream.cli import main
from k3stream.quant.kernels import note_fallbacks
status = main(["--version"])
note_fallbacks({10, 12}, "cpu")
sys.exit(status)
"""


def test_an_install_without_the_c_kernels_says_once_why_it_is_slow_and_what_to_do():
    done = subprocess.run([sys.executable, "-c", NO_EXTENSION], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("CPU kernels: none (the torch reference path)")
    assert done.stderr.count(cpu.NOT_BUILT) == 1
    assert "C compiler" in cpu.NOT_BUILT and "reference path" in cpu.NOT_BUILT
    assert "no cpu kernel for GGML type Q2_K" in done.stderr  # the load's notes still name each type


@pytest.mark.skipif(not cpu.available(), reason=NO_C_KERNELS)
def test_the_version_names_the_kernels_instruction_set(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"CPU kernels: C ({cpu.isa()})")
