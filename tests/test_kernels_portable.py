"""The C kernels as other machines get them. The portable build (what a CPU other than x86-64 compiles:
no AVX2 or AVX-512 code, `K3STREAM_PORTABLE_BUILD`): built by setup.py into a temporary directory,
loaded in place of the installed extension in a child process, its products and decoders checked
against `gguf`'s dequantization. An install without the extension (no C compiler): said once, with why
and what to do, and by `k3stream --version`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import NO_C_KERNELS, REQUIRE_ORACLE
from k3stream.cli import main
from k3stream.quant.kernels import cpu

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
print(json.dumps({"isa": cpu.isa(), "file": cpu._ggml_cpu().__file__, "worst": worst,
                  "decoders_exact": decoders_exact, "iq_integer_checked": iq_checked,
                  "digest": digest.hexdigest()}))
"""


# a C compiler without OpenMP, as Apple's clang: it refuses -fopenmp, else runs the usual one
NO_OPENMP_CC = """#!/bin/sh
for arg in "$@"; do [ "$arg" = -fopenmp ] && echo "error: unsupported option '-fopenmp'" >&2 && exit 1; done
exec {cc} "$@"
"""


def build(tmp_path: Path, portable: bool = True, compiler: str | None = None) -> tuple[Path, str]:
    """setup.py's extension with its own flags (and K3STREAM_PORTABLE_BUILD where `portable`) by
    `compiler` (else the usual one), under tmp_path: its file and the build's output."""
    env = dict(os.environ)
    if portable:
        env["CFLAGS"] = " ".join(filter(None, [os.environ.get("CFLAGS"), "-DK3STREAM_PORTABLE_BUILD"]))
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
    compiler has none), and the module it gives runs each type's products (float tile and integer
    paths) within float32 rounding of gguf's values, its i-quant and ternary decoders bit for bit, and
    every output bit for bit what the installed build's portable kernels give."""
    extension, output = build(tmp_path, compiler=None if openmp else without_openmp(tmp_path))
    assert ("has no OpenMP" in output) != openmp
    report = check(extension)
    assert report["isa"] == "portable" and Path(report["file"]) == extension
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


def check(extension: Path | None, **environment: str) -> dict:
    """PORTABLE_CHECK's report, in a child with `extension` (None: the installed one) and `environment`."""
    path = os.pathsep.join(
        [*map(str, (ROOT / "tests", ROOT / "src")), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("K3STREAM_GENERIC_KERNELS", "K3STREAM_NO_AVX512")}
    argv = [sys.executable, "-c", PORTABLE_CHECK, *([str(extension)] if extension else [])]
    done = subprocess.run(argv, env=dict(env, PYTHONPATH=path, **environment), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
