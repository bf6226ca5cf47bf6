"""A build SIGKILLed at any point leaves nothing that looks complete, and rerunning the same command
resumes from the last intact entry (checked against the GGUF) instead of starting over."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3stream.gguf.reader import K3Checkpoint
from k3stream.pack.builder import BuildOptions, BuildResult, build_pack, plan_pack
from k3stream.pack.verify import verify_pack
from pack_helpers import copy_model, read_index

PACK = "tiny-kimi-k3.expert-major.pack"
ENTRY_BYTES = 4096  # every role slice of the split F32 tiny model (32 x 32 floats)
ENTRIES = 5 * 16 * 3
SYNC = ["--sync-mib", str(16 * ENTRY_BYTES / 1024**2)]  # durable progress every 16 entries
KILLER = Path(__file__).with_name("pack_kill.py")


def run_pack(
    gguf: Path, kill_at: str | None = None, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`k3stream pack` in its own process, SIGKILLed at `kill_at` (see pack_kill.py) when given."""
    arguments = [str(gguf), "--no-progress", *SYNC, *extra]
    if kill_at is None:
        command = [sys.executable, "-m", "k3stream.cli", "pack", *arguments]
    else:
        command = [sys.executable, str(KILLER), kill_at, *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def rerun(gguf: Path) -> BuildResult:
    """The same build again, in this process (only the killed runs need their own)."""
    return build_pack(gguf, options=BuildOptions(progress=False, sync_bytes=16 * ENTRY_BYTES))


def journal_entries(directory: Path) -> int:
    return json.loads((directory / f"{PACK}.partial.journal").read_text())["entries_done"]


@pytest.fixture
def model(tiny_model, tmp_path) -> Path:
    return copy_model(tiny_model(shards=2), tmp_path)


@pytest.fixture(scope="module")
def clean_pack(tiny_model, tmp_path_factory) -> bytes:
    """The pack of an uninterrupted build, for comparison."""
    gguf = copy_model(tiny_model(shards=2), tmp_path_factory.mktemp("clean"))
    return build_pack(gguf, options=BuildOptions(progress=False)).pack.read_bytes()


def assert_nothing_complete(directory: Path) -> None:
    assert not (directory / PACK).exists()
    assert not (directory / f"{PACK}.manifest.json").exists()


def test_killed_mid_copy_resumes_from_the_journal(model, clean_pack):
    killed = run_pack(model, kill_at="entry:100")
    assert killed.returncode == -9
    assert_nothing_complete(model.parent)
    durable = journal_entries(model.parent)
    assert durable == 96  # journalled every 16 entries (synced before the kill), never past what was copied
    resumed = run_pack(model)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(rf"^resumed\s+{durable * ENTRY_BYTES} bytes$", resumed.stdout, re.M)
    assert f"{durable} of {ENTRIES} entries intact" in resumed.stdout
    assert (model.parent / PACK).read_bytes() == clean_pack
    assert verify_pack(model.parent / f"{PACK}.manifest.json", full=True)["ok"]
    assert sorted(path.name for path in model.parent.glob(f"{PACK}*")) == [PACK, f"{PACK}.manifest.json"]


def test_resume_checks_the_entries_it_keeps(model, clean_pack):
    assert run_pack(model, kill_at="entry:200").returncode == -9
    assert journal_entries(model.parent) >= 150
    partial = model.parent / f"{PACK}.partial"
    offset = read_index(partial)[1][40][3]  # entry 40: within the journalled, "intact" range
    with partial.open("r+b") as stream:
        stream.seek(offset + 123)
        stream.write(b"\xff")
    assert rerun(model).resumed_bytes == 40 * ENTRY_BYTES
    assert (model.parent / PACK).read_bytes() == clean_pack


def test_resume_checks_the_objects_it_keeps_for_non_finite_values(model):
    """A partial pack a build wrote without the check (here: a kept entry and its GGUF bytes both given a
    NaN after the kill, the GGUF's time restored so the journal still trusts it) is refused when resumed,
    before anything more is copied, naming the GGUF, tensor, expert and value."""
    assert run_pack(model, kill_at="entry:100").returncode == -9
    plan = plan_pack(K3Checkpoint.open(model))
    path, source_offset, tensor = plan.source(40)  # entry 40: within the journalled range
    _, expert, _ = plan.layout.identity(40)
    nan = np.float32(np.nan).tobytes()
    times = path.stat()
    for file, offset in (
        (path, source_offset),
        (model.parent / f"{PACK}.partial", plan.layout.entry(40).offset),
    ):
        with file.open("r+b") as stream:
            stream.seek(offset + 7 * 4)
            stream.write(nan)
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    with pytest.raises(ValueError) as refused:
        rerun(model)
    assert (
        str(refused.value)
        == f"{path}: {tensor} expert {expert}: value 7 is NaN or infinite; its GGUF is damaged"
    )
    assert_nothing_complete(model.parent)
    assert journal_entries(model.parent) == 96  # nothing copied past the kept entries


def test_killed_before_the_first_checkpoint_starts_over(model, clean_pack):
    assert run_pack(model, kill_at="entry:3").returncode == -9
    assert_nothing_complete(model.parent)
    assert journal_entries(model.parent) == 0
    assert rerun(model).resumed_bytes == 0
    assert (model.parent / PACK).read_bytes() == clean_pack


def test_killed_in_a_journal_write_leaves_no_temp_file_after_the_rerun(model, clean_pack):
    assert run_pack(model, kill_at="journal-write").returncode == -9
    assert list(model.parent.glob(f"{PACK}.partial.journal.tmp*"))  # the killed run's atomic write
    rerun(model)
    assert (model.parent / PACK).read_bytes() == clean_pack
    assert sorted(path.name for path in model.parent.glob(f"{PACK}*")) == [PACK, f"{PACK}.manifest.json"]


def test_killed_before_rename(model, clean_pack, capsys, caplog):
    assert run_pack(model, kill_at="before-rename").returncode == -9
    assert_nothing_complete(model.parent)
    capsys.readouterr()
    with caplog.at_level("INFO", logger="k3stream.pack.builder"):
        resumed = rerun(model)
    assert (resumed.resumed_bytes, resumed.copied_bytes) == (ENTRIES * ENTRY_BYTES, 0)
    assert (model.parent / PACK).read_bytes() == clean_pack
    # the library logs its notes and prints nothing (the command prints them)
    assert capsys.readouterr() == ("", "")
    assert f"{ENTRIES} of {ENTRIES} entries intact" in caplog.text


def test_killed_before_the_manifest(model, clean_pack):
    assert run_pack(model, kill_at="before-manifest").returncode == -9
    # the pack is in place but no manifest describes it: nothing can use it yet
    assert not (model.parent / f"{PACK}.manifest.json").exists()
    finished = rerun(model)
    assert (finished.resumed_bytes, finished.copied_bytes) == (ENTRIES * ENTRY_BYTES, 0)
    assert (model.parent / PACK).read_bytes() == clean_pack
    assert verify_pack(model.parent / f"{PACK}.manifest.json", full=True)["ok"]


def test_killed_before_the_manifest_checks_every_entry_of_the_pack(model, clean_pack):
    assert run_pack(model, kill_at="before-manifest").returncode == -9
    pack = model.parent / PACK
    offset = read_index(pack)[1][ENTRIES - 7][3]  # an entry no payload sample looks at
    with pack.open("r+b") as stream:
        stream.seek(offset + 5)
        stream.write(b"\xff")
    finished = rerun(model)
    assert (finished.resumed_bytes, finished.copied_bytes) == ((ENTRIES - 7) * ENTRY_BYTES, 7 * ENTRY_BYTES)
    assert pack.read_bytes() == clean_pack
    assert verify_pack(model.parent / f"{PACK}.manifest.json", full=True)["ok"]


def test_a_journal_for_another_build_is_not_trusted(model, clean_pack):
    assert run_pack(model, kill_at="entry:100").returncode == -9
    journal = model.parent / f"{PACK}.partial.journal"
    state = json.loads(journal.read_text())
    state["identity"]["size"] += 1
    journal.write_text(json.dumps(state))
    assert rerun(model).resumed_bytes == 0
    assert (model.parent / PACK).read_bytes() == clean_pack


def test_forced_rebuild_killed_leaves_no_stale_manifest(model, clean_pack):
    rerun(model)
    killed = run_pack(model, kill_at="entry:50", extra=("--force",))
    assert killed.returncode == -9
    assert_nothing_complete(model.parent)  # the old manifest went first, then the old pack
    assert rerun(model).resumed_bytes == 48 * ENTRY_BYTES
    assert (model.parent / PACK).read_bytes() == clean_pack
