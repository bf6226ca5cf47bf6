"""A child memory cgroup under this process's own (cgroup v1 memory controller or v2) for benchmarks.

`ChildCgroup.create(name, limit_bytes)` makes `<own cgroup>/<name>` with the limit, or returns a one-line
reason why it cannot (no memory cgroup mounted, not writable, v2 without the memory controller for
children). A child process joins with `cgroup.join` as its `preexec_fn`; afterwards `usage()` gives
the peak memory, how often the limit was hit and OOM kills, and `remove()` deletes the group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3stream.memlimit import own_memory_cgroup


@dataclass(frozen=True)
class ChildCgroup:
    path: Path
    version: int  # 1 or 2

    @classmethod
    def create(
        cls,
        name: str,
        limit_bytes: int,
        proc: Path = Path("/proc"),
        sys_cgroup: Path = Path("/sys/fs/cgroup"),
    ) -> ChildCgroup | str:
        """The new group, or why there is none (one line)."""
        parent = own_memory_cgroup(proc, sys_cgroup)
        if parent is None:
            return f"no memory cgroup of this process is mounted under {sys_cgroup}"
        version = 2 if (parent / "cgroup.controllers").is_file() else 1
        if version == 2 and not _v2_memory_delegated(parent):
            return f"{parent}/cgroup.subtree_control: the memory controller is not enabled for children"
        path = parent / name
        try:
            path.mkdir(exist_ok=True)
            (path / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(
                f"{limit_bytes}\n"
            )
        except OSError as exc:
            _rmdir(path)
            return f"{path}: cannot create a memory cgroup with a limit ({exc.strerror or exc})"
        return cls(path, version)

    def join(self) -> None:
        """Move the calling process into the group (use as a `subprocess` `preexec_fn`)."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    @property
    def limit_bytes(self) -> int:
        return int(_read(self.path / ("memory.max" if self.version == 2 else "memory.limit_in_bytes")))

    def usage(self) -> dict[str, Any]:
        """Peak bytes, times the limit was hit, OOM kills (None where the kernel does not report it)."""
        if self.version == 2:
            events = _keyed(self.path / "memory.events")
            peak = _read(self.path / "memory.peak")
            return {
                "peak_bytes": int(peak) if peak else None,
                "limit_hits": events.get("max"),
                "oom_kills": events.get("oom_kill"),
            }
        return {
            "peak_bytes": int(_read(self.path / "memory.max_usage_in_bytes") or 0),
            "limit_hits": int(_read(self.path / "memory.failcnt") or 0),
            "oom_kills": _keyed(self.path / "memory.oom_control").get("oom_kill"),
        }

    def page_cache_bytes(self) -> int:
        """File pages (page cache) charged to the group now: memory.stat's `file` (v2) or `cache` (v1)."""
        stat = _keyed(self.path / "memory.stat")
        return int(stat.get("file" if self.version == 2 else "cache", 0))

    def remove(self) -> None:
        """Delete the group (its processes must have exited); v1 first moves its page cache out."""
        if self.version == 1:
            with contextlib.suppress(OSError):
                (self.path / "memory.force_empty").write_text("0\n")
        _rmdir(self.path)


def _v2_memory_delegated(parent: Path) -> bool:
    control = parent / "cgroup.subtree_control"
    if "memory" in _read(control).split():
        return True
    try:
        control.write_text("+memory\n")
    except OSError:
        return False
    return "memory" in _read(control).split()


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _keyed(path: Path) -> dict[str, int]:
    pairs = (line.split() for line in _read(path).splitlines())
    return {pair[0].rstrip(":"): int(pair[1]) for pair in pairs if len(pair) == 2 and pair[1].isdigit()}


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def read_process_io(pid: int | str = "self", proc: Path = Path("/proc")) -> dict[str, int]:
    """`/proc/PID/io` as integers (read_bytes: bytes this process caused to be read from storage)."""
    return _keyed(proc / str(pid) / "io")


def drop_page_cache(*paths: str | os.PathLike[str]) -> None:
    """Ask the kernel to forget these files' cached pages (clean pages; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
