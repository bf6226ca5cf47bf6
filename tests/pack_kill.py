"""`python tests/pack_kill.py STAGE PACK_ARGS...`: run the real `k3stream pack PACK_ARGS...` and SIGKILL
it at STAGE. The builder holds no test hook: this process alone wraps the calls that mark each stage.

STAGE is `entry:K` (after K entries copied by this run, once the checkpoints requested so far are
durable), `before-rename` (the complete partial pack is about to get its final name) or
`before-manifest` (the manifest is about to be written) or `journal-write` (the first journal is
written to its temp file, not yet renamed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from k3stream import cli
from k3stream.pack import builder


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_after_entries(count: int) -> None:
    checkpointers: list[builder.Checkpointer] = []

    class RecordedCheckpointer(builder.Checkpointer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            checkpointers.append(self)

    copy_entry = builder.Copier.copy
    copied = 0

    def copy_then_maybe_die(self, *args) -> None:
        nonlocal copied
        if copied == count:
            checkpointers[-1].drain()  # so the test knows what the journal holds when the kill comes
            die()
        copied += 1
        copy_entry(self, *args)

    builder.Checkpointer = RecordedCheckpointer
    builder.Copier.copy = copy_then_maybe_die


def kill_before_rename() -> None:
    replace = os.replace

    def die_on_pack_rename(source, target, **kwargs) -> None:
        if Path(source).name.endswith(".partial"):
            die()
        replace(source, target, **kwargs)

    builder.os.replace = die_on_pack_rename


def kill_before_manifest() -> None:
    write_json = builder.write_json_atomic

    def die_on_manifest(path: Path, value) -> None:
        if path.name.endswith(".manifest.json"):
            die()
        write_json(path, value)

    builder.write_json_atomic = die_on_manifest


def kill_in_journal_write() -> None:
    replace = os.replace

    def die_on_journal_rename(source, target, **kwargs) -> None:
        if ".journal.tmp" in Path(source).name:
            die()
        replace(source, target, **kwargs)

    builder.os.replace = die_on_journal_rename


def main(stage: str, pack_args: list[str]) -> int:
    if stage.startswith("entry:"):
        kill_after_entries(int(stage.removeprefix("entry:")))
    elif stage == "before-rename":
        kill_before_rename()
    elif stage == "before-manifest":
        kill_before_manifest()
    elif stage == "journal-write":
        kill_in_journal_write()
    else:
        raise SystemExit(f"unknown kill stage {stage!r}")
    return cli.main(["pack", *pack_args])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2:]))
