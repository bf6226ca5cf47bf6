"""The prompt cache across `--tp` / `--ep` ranks: real torchrun processes on loopback (gloo), each rank
snapshotting its own shard of the state; a restore continues with the cold prefill's bits (the same
ranks' cold prefill), and a rank lacking a snapshot makes it a miss everywhere, never a wrong answer."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from test_parallel import AUDITED, _env, packed_copy, torchrun

WORKER = Path(__file__).with_name("parallel_cache_worker.py")
CACHE = ("--cache-ram", "64", "--cache-every", "16")


@pytest.fixture(scope="module")
def packed(tiny_model, tmp_path_factory) -> Path:
    return packed_copy(tiny_model, tmp_path_factory)


@pytest.fixture(scope="module")
def audited(tiny_model, tmp_path_factory) -> Path:
    return packed_copy(tiny_model, tmp_path_factory, **AUDITED)


def run_worker(tmp: Path, manifest: Path, ranks: int, *flags: str) -> dict:
    out = tmp / f"cache-{ranks}-{'-'.join(flags)}.pt"
    command = torchrun(ranks, str(WORKER), str(out), "--", str(manifest), *CACHE, *flags)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def assert_restores_are_cold(result: dict) -> None:
    """p = 0, 1, one less and one more than the KDA chunk, after decode steps, inside a prefill and
    batched: each restore reused its prefix and gave the cold prefill's bits, then decode steps' too."""
    reused = {name: got[0] for name, got in result["checks"].items()}
    assert reused == {
        "p=0": 0,
        "p=1": 1,
        "p=15": 15,
        "p=17": 17,
        "after decode steps": 24,
        "inside a prefill": 16,
        "batched": 48,
    }
    for name, (_, restored, cold) in result["checks"].items():
        assert torch.equal(restored, cold), name


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(("--tp", "2", "--ep", "2"), id="tp2-ep2"),
        pytest.param(("--tp", "2"), id="tp2", marks=pytest.mark.slow),
        pytest.param(("--ep", "2"), id="ep2"),
        pytest.param(("--ep", "2", "--ram-mib", "0.2"), id="ep2-streamed", marks=pytest.mark.slow),
    ],
)
def test_a_restore_across_ranks_gives_the_cold_bits(packed, tmp_path, flags):
    assert_restores_are_cold(run_worker(tmp_path, packed, 2, "--ram-mib", "64", *flags))


@pytest.mark.slow
@pytest.mark.parametrize("match_ggml", [False, True], ids=["torch", "ggml"])
def test_a_restore_across_ranks_on_the_audited_recipe_streamed(audited, tmp_path, match_ggml):
    flags = ("--tp", "2", "--ep", "2", "--ram-mib", "0.5", *("--match-ggml",) * match_ggml)
    assert_restores_are_cold(run_worker(tmp_path, audited, 2, *flags))


@pytest.mark.slow
def test_four_tensor_parallel_ranks_sum_in_rank_order(packed, tmp_path):
    """An all-reduce of four ranks sums an element in an order that depends on the rows: with the
    cache on, the partial products are summed in rank order, so a restore keeps the cold bits."""
    assert_restores_are_cold(run_worker(tmp_path, packed, 4, "--ram-mib", "64", "--tp", "4"))


def test_generate_under_torchrun_resumes_from_each_ranks_disk_and_a_bad_file_is_a_miss(packed, tmp_path):
    """`generate --tp 2 --ep 2 --cache-dir`: a second run restores the first one's prompt from every
    rank's own files; with one rank's file cut short the second run is a miss, with the same text."""
    cache_dir = tmp_path / "states"
    generate = ["-m", "k3stream", "generate", str(packed), "--prompt", "hello there", "--max-tokens", "6"]
    generate += ["--temperature", "0", "--tp", "2", "--ep", "2", "--cache-ram", "64"]
    generate += ["--cache-dir", str(cache_dir)]

    def run() -> subprocess.CompletedProcess:
        done = subprocess.run(torchrun(2, *generate), capture_output=True, text=True, timeout=300, env=_env())
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def reused(done: subprocess.CompletedProcess) -> tuple[int, int]:
        found = re.search(r"cache   (\d+) of (\d+) prompt tokens reused", done.stderr)
        return int(found[1]), int(found[2])

    first, second = run(), run()
    prompt = reused(first)[1]
    assert reused(first) == (0, prompt) and reused(second) == (prompt, prompt)
    assert second.stdout == first.stdout
    folders = sorted(path.name[-len("-tp2-ep2-rank0") :] for path in cache_dir.iterdir())
    assert folders == ["-tp2-ep2-rank0", "-tp2-ep2-rank1"]
    (rank1,) = [path for path in cache_dir.iterdir() if path.name.endswith("rank1")]
    for path in rank1.iterdir():
        path.write_bytes(path.read_bytes()[:-9])
    third = run()
    assert reused(third) == (0, prompt) and "checksum mismatch" in third.stderr
    assert "a rank lacks the snapshot" in third.stderr
    assert third.stdout == first.stdout
