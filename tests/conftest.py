"""Shared fixtures: tiny Kimi-K3 GGUFs written by the project's own generator, cached per session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# OpenMP threads (torch's, the C kernels') that wait sleep instead of spinning: with two test workers
# on two cores (or other work on the machine) spinning threads take the cores the others need (a
# worker's products ran 2x slower beside another's). Set before torch or the kernels load OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None
# CI sets it: the llama.cpp-oracle tests fail instead of skipping when the oracle is missing
REQUIRE_ORACLE = os.environ.get("K3STREAM_REQUIRE_ORACLE") == "1"
LLAMA_MISSING = (
    "llama-cpp-python 0.3.36 (the llama.cpp oracle) is not installed: `pip install llama-cpp-python==0.3.36` "
    "builds it from source (PyPI has no wheel; it needs a C++ compiler and cmake); CI installs a prebuilt "
    "wheel"
)
NO_C_KERNELS = (
    "the C kernels were not built: `python3 setup.py build_ext --inplace` builds them (needs a C compiler)"
)
NO_CUDA = "needs a CUDA device: an NVIDIA GPU and a CUDA build of torch"
# the C kernels' instruction sets, each test of them taking each in turn (`take_kernel_isa`)
KERNEL_ISAS = ["avx512", "avx2", "portable"]
if REQUIRE_ORACLE and not HAVE_LLAMA:
    requires_llama = pytest.mark.usefixtures("missing_oracle")
else:
    requires_llama = pytest.mark.skipif(not HAVE_LLAMA, reason=LLAMA_MISSING)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--clear-test-cache",
        action="store_true",
        help="remove the large test models cached across sessions ($K3STREAM_TEST_CACHE, default "
        "~/.cache/k3stream-test) when the session ends",
    )


def pytest_configure(config: pytest.Config) -> None:
    from pack_helpers import TEST_CACHE

    # hypothesis's examples and caches go with the test models, not into the checkout's .hypothesis/
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(TEST_CACHE / "hypothesis"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `interp` cases run only where TRITON_INTERPRET=1 is set (test_kernels_gpu.py's
    `test_interpreter_subprocess` runs them so): elsewhere they are deselected, not skipped."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    elsewhere = [item for item in items if item.get_closest_marker("interp")]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if not item.get_closest_marker("interp")]


def pytest_sessionfinish(session: pytest.Session) -> None:
    worker = hasattr(session.config, "workerinput")  # pytest-xdist's: the others may still use the cache
    if session.config.getoption("--clear-test-cache") and not worker:
        from pack_helpers import clear_test_cache

        clear_test_cache()


@pytest.fixture(scope="session", autouse=True)
def children_temp_folder(tmp_path_factory):
    """Child processes (torchrun's log folders, servers, workers) make their temporary files under
    pytest's own temporary folder, which a passing run removes, instead of the system's."""
    folder = tmp_path_factory.mktemp("children-tmp")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous


@pytest.fixture(scope="session")
def missing_oracle():
    """Fails every llama.cpp-oracle test under K3STREAM_REQUIRE_ORACLE=1 when the oracle is missing."""
    pytest.fail(f"K3STREAM_REQUIRE_ORACLE=1 but {LLAMA_MISSING}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(**spec_fields) -> Path` of the first shard; one file per distinct spec."""
    from k3stream.testing.tiny import TinySpec, make_tiny

    made: dict[tuple, Path] = {}

    def make(**fields) -> Path:
        key = tuple(sorted(fields.items()))
        if key not in made:
            out_dir = tmp_path_factory.mktemp("tiny")
            made[key] = make_tiny(out_dir, TinySpec(**fields))
        return made[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: the tiny models run fastest so, and the test machine's cores are shared."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_path(tiny_model) -> Path:
    """The default tiny F32 model (its built-in tokenizer included)."""
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from k3stream.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


def take_kernel_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the C kernels take `isa` (one of KERNEL_ISAS) through their environment switches; skips
    where this CPU cannot run it."""
    from k3stream.quant.kernels import cpu

    monkeypatch.delenv("K3STREAM_NO_AVX512", raising=False)
    monkeypatch.delenv("K3STREAM_GENERIC_KERNELS", raising=False)
    if isa == "avx2":
        monkeypatch.setenv("K3STREAM_NO_AVX512", "1")
    elif isa == "portable":
        monkeypatch.setenv("K3STREAM_GENERIC_KERNELS", "1")
    if cpu.isa() != isa:
        pytest.skip(f"this CPU does not run the {isa} kernels")
