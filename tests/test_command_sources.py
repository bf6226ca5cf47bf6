"""What the commands take as a model: `demo` (the shipped model, packed in the cache on first use) in every
command, and `verify` given a GGUF, its folder or its manifest as the other commands are."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_helpers import packed_tiny

PACKED = "the demo model is packed in"


def k3stream_at_home(home: Path, *argv: str) -> subprocess.CompletedProcess:
    """`k3stream ARGV` in a subprocess whose cache is under `home` (a fresh machine's)."""
    env = {key: value for key, value in os.environ.items() if key != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "k3stream.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def verify(*argv: str) -> tuple[int, str, str]:
    from k3stream.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["verify", *argv])
    return status, out.getvalue(), err.getvalue()


def cache_files(home: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in (home / ".cache").rglob("*") if path.is_file()}


def test_demo_by_name_is_packed_once_then_reused_by_every_command(tmp_path):
    first = k3stream_at_home(
        tmp_path, "generate", "demo", "--prompt", "import os", "--max-tokens", "3", "--threads", "1"
    )
    assert first.returncode == 0, first.stderr
    assert PACKED in first.stderr and "speed   prefill" in first.stderr
    made = cache_files(tmp_path)
    assert any(path.name.endswith(".pack.manifest.json") for path in made)

    for argv in (("inspect", "demo"), ("verify", "demo"), ("bench", "demo", "--decode-tokens", "2")):
        again = k3stream_at_home(tmp_path, *argv)
        assert again.returncode == 0, (argv, again.stderr)
        assert PACKED not in again.stderr
    assert "OK " in k3stream_at_home(tmp_path, "verify", "demo").stdout
    assert cache_files(tmp_path) == made  # nothing made or packed again


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return packed_tiny(tmp_path_factory.mktemp("verify"), n_layers=3, n_experts=8, top_k=2, seed=5)


@pytest.mark.parametrize("given", ["manifest", "gguf", "folder"])
def test_verify_takes_what_the_other_commands_take(packed, given):
    gguf_path, manifest = packed
    source = {"manifest": manifest, "gguf": gguf_path, "folder": gguf_path.parent}[given]
    status, out, err = verify(str(source))
    assert status == 0, err
    assert out.startswith("OK ") and str(manifest.with_suffix("").with_suffix("")) in out


def test_verify_of_an_unpacked_gguf_says_what_it_needs(tmp_path):
    from k3stream.testing.tiny import TinySpec, make_tiny

    gguf_path = make_tiny(tmp_path, TinySpec(n_layers=2, n_experts=4, top_k=2))
    status, out, err = verify(str(gguf_path))
    assert (status, out) == (1, "")
    assert len(err.splitlines()) == 1 and "JSON" not in err
    assert "no expert pack beside it" in err and f"run `k3stream pack {gguf_path}` first" in err


def test_a_pack_copied_beside_another_model_is_refused_by_every_command(packed, tmp_path):
    """Model A's pack and manifest copied into model B's folder (same shapes, other weights): the manifest
    names A's GGUF, so reading it would run A in place of the B asked for."""
    import shutil

    from bench_helpers import run_cli
    from k3stream.testing.tiny import TinySpec, make_tiny

    gguf_a, manifest = packed
    gguf_b = make_tiny(tmp_path, TinySpec(n_layers=3, n_experts=8, top_k=2, seed=6))
    for path in (manifest, manifest.with_suffix("").with_suffix("")):
        shutil.copy(path, tmp_path / path.name)
    for status, _out, err in (verify(str(gguf_b)), run_cli("generate", str(gguf_b), "--prompt", "a")):
        assert status == 1 and len(err.strip().splitlines()) == 1, err
        assert f"built from {gguf_a.resolve()}, not {gguf_b.resolve()}" in err
    unpacked = run_cli("generate", str(gguf_b), "--prompt", "a", "--max-tokens", "1", "--no-stream-experts")
    assert unpacked[0] == 0, unpacked[2]
    assert verify(str(manifest))[0] == 0  # the manifest itself still names A's model


def test_inspect_takes_a_manifest_as_the_other_commands_do(packed, capsys):
    from k3stream.cli import main

    gguf_path, manifest = packed
    assert main(["inspect", str(gguf_path), "--json"]) == 0
    expected = capsys.readouterr().out
    assert main(["inspect", str(manifest), "--json"]) == 0
    assert capsys.readouterr().out == expected


STORE_FLAGS = [
    ("--gpu-mib", "64"),
    ("--direct-io",),
    ("--no-direct-io",),
    ("--policy", "lru"),
    ("--policy", "cycle"),  # a default given explicitly is refused too
    ("--io-threads", "4"),
    ("--prefetch-hint", "auto"),
    ("--no-prefetch",),
]


@pytest.mark.parametrize("flag", STORE_FLAGS)
@pytest.mark.parametrize("source", ["--no-stream-experts", "no pack"])
def test_expert_store_flags_without_a_store_are_refused_in_one_line(packed, tmp_path, flag, source):
    """The store's flags (`--gpu-mib`, `--[no-]direct-io`, `--policy`, `--io-threads`, `--prefetch-hint`,
    `--no-prefetch`) set the expert store, which serves experts from a pack: where experts come from the
    GGUF (`--no-stream-experts`, or no pack beside it) they would do nothing, and the run says so instead
    of going on without them (status 2 beside --no-stream-experts, whatever the model)."""
    import shutil

    from bench_helpers import run_cli

    gguf_path, _ = packed
    if source == "no pack":
        gguf_path = Path(shutil.copy(gguf_path, tmp_path))
    extra = ["--no-stream-experts"] if source == "--no-stream-experts" else []
    status, _out, err = run_cli(
        "generate", str(gguf_path), "--prompt", "a", "--max-tokens", "1", *extra, *flag
    )
    usage = source == "--no-stream-experts"  # flags that contradict each other: a usage error
    assert status == (2 if usage else 1) and len(err.strip().splitlines()) == 1, err
    assert f"{flag[0]} applies to routed experts streamed from an expert pack" in err


@pytest.mark.parametrize("source", ["pack", "--no-stream-experts"])
def test_a_cuda_device_on_a_machine_without_cuda_is_refused_in_one_line(packed, source):
    """`--device cuda` where torch has no CUDA: one line naming the flag, with experts streamed or not
    (from the GGUF it ended in torch's AssertionError traceback)."""
    import torch

    from bench_helpers import run_cli

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    gguf_path, _ = packed
    extra = ["--no-stream-experts"] if source == "--no-stream-experts" else []
    status, _out, err = run_cli("generate", str(gguf_path), "--prompt", "a", "--device", "cuda", *extra)
    assert status == 1 and len(err.strip().splitlines()) == 1, err
    assert "--device cuda: CUDA is not available" in err
