"""The prompt cache's directory as a whole (`--cache-dir`): one byte budget (`--cache-disk`) over every
snapshot folder in it, this process's and the *foreign* ones (other computation keys, model files or
ranks: another k3stream build, other arithmetic flags, another model, another `--tp`/`--ep` place).

Only what is ours is counted or removed: folders named `<key>-<fingerprint>[-tp<T>-ep<E>-rank<R>]` (16
hex digits each), and in them files named `<32 hex>.k3snap` (snapshots) or `<that>.tmp<pid>.<thread>`
(`fileio.write_bytes_atomic`'s temporaries). Any other file or folder in the directory stays, uncounted.

Beside other processes on the same directory: a process holds a shared `flock` on its folder while its
cache is open, and the kernel drops it when the process ends, however it ends. A foreign folder's
snapshots are removed only under an exclusive lock taken without waiting, so never while a process that
reads or writes them is alive (another server, another rank); a process that opens the folder meanwhile
waits for the lock and makes the folder again if it was removed. A temporary file is removed, in any
folder, once it has not been written for TEMPORARY_GRACE seconds: a writer writes its file without a
pause but the final fsync, so an older one was left by a writer that died (the pid in its name means
nothing across the hosts or containers that may share the directory).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
FOLDER = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}(-tp[0-9]+-ep[0-9]+-rank[0-9]+)?")
SNAPSHOT = re.compile(r"[0-9a-f]{32}\.k3snap")
TEMPORARY = re.compile(r"[0-9a-f]{32}\.k3snap\.tmp[0-9]+\.[0-9]+")
TEMPORARY_GRACE = 600.0  # seconds since a temporary file was last written before it counts as left


class FolderLock:
    """A shared lock on a cache folder (made if need be) until `release`: while a process holds it, no
    other process removes the folder's snapshots as foreign."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd = _hold(folder)
        self.release = weakref.finalize(self, os.close, self.fd)

    def still_held(self) -> bool:
        """Whether the folder this lock holds is still at its path (not removed while the process ran)."""
        return _still_there(self.fd, self.folder)


def _hold(folder: Path) -> int:
    """A descriptor of `folder` (made if need be) with a shared lock on it, the folder that is there now
    (a trim may have removed the one this process opened while it waited)."""
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # removed by another process's trim since: made again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while another process trims it
        except OSError as error:  # a file system without flock: used unheld
            log.warning("prompt cache: cannot lock %s (%s): other processes may trim it", folder, error)
            return fd
        if _still_there(fd, folder):
            return fd
        os.close(fd)


def _still_there(fd: int, folder: Path) -> bool:
    """Whether `folder` is still the directory `fd` opened (a trim may have removed it meanwhile)."""
    try:
        named, held = os.stat(folder, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _unheld(folder: Path) -> int | None:
    """A descriptor of `folder` locked exclusively, or None where a process holds it (or it is gone)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (or no flock on this file system: left alone all the same)
        os.close(fd)
        return None
    return fd


@dataclass
class OurFile:
    path: Path
    nbytes: int
    mtime: float


@dataclass
class Folder:
    """One snapshot folder's files of our naming."""

    path: Path
    snapshots: list[OurFile] = field(default_factory=list)
    temporaries: list[OurFile] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(file.nbytes for file in self.snapshots + self.temporaries)


@dataclass
class Removed:
    """What the trims of the directory removed besides this folder's own evictions (running totals)."""

    snapshots: int = 0  # of foreign folders no process held
    snapshot_bytes: int = 0
    temporaries: int = 0  # left by writers that died, in any folder
    temporary_bytes: int = 0
    folders: int = 0  # foreign folders emptied


@dataclass
class Foreign:
    """The foreign folders after a trim: their count and bytes on disk; and `beside`, the bytes of the
    files in this process's own folder that it does not hold (another process of the same key and
    place writes there too)."""

    folders: int = 0
    nbytes: int = 0
    beside: int = 0


def scan(root: Path) -> list[Folder]:
    """Every snapshot folder in `root` with its files, by our naming only (no symbolic links)."""
    return [
        _scan_folder(Path(entry.path))
        for entry in _entries(root)
        if FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
    ]


def _scan_folder(path: Path) -> Folder:
    folder = Folder(path)
    for entry in _entries(path):
        kind = (
            folder.snapshots
            if SNAPSHOT.fullmatch(entry.name)
            else folder.temporaries
            if TEMPORARY.fullmatch(entry.name)
            else None
        )
        if kind is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed since it was listed
            continue
        kind.append(OurFile(Path(entry.path), stat.st_size, stat.st_mtime))
    return folder


def _entries(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:  # gone, or not ours to read: nothing counted
        return []


def trim_directory(root: Path, own: str, own_bytes: int, budget: int, removed: Removed) -> Foreign:
    """Remove the temporaries left by dead writers in every folder of `root`; then, while `own_bytes` (the
    snapshots of folder `own` this process holds), the other files of folder `own` and the foreign
    folders' bytes exceed `budget`, the foreign folders' snapshots that no process holds, oldest first (a
    folder left without files of ours goes too). Adds to `removed` (without a lock: one thread at a time
    per `removed`); the foreign folders left, and the bytes beside this process's in its folder."""
    folders = scan(root)
    now = time.time()
    for folder in folders:
        _remove_stale(folder, now, removed)
    in_own = sum(file.nbytes for folder in folders if folder.path.name == own for file in folder.snapshots)
    beside = max(in_own - own_bytes, 0)
    foreign = [folder for folder in folders if folder.path.name != own]
    if own_bytes + beside + sum(folder.nbytes for folder in foreign) > budget:
        foreign = _evict_foreign(foreign, budget - own_bytes - beside, removed)
    return Foreign(len(foreign), sum(folder.nbytes for folder in foreign), beside)


def _remove_stale(folder: Folder, now: float, removed: Removed) -> None:
    for file in list(folder.temporaries):
        if now - file.mtime > TEMPORARY_GRACE and _unlink(file.path):
            folder.temporaries.remove(file)
            removed.temporaries += 1
            removed.temporary_bytes += file.nbytes


def _evict_foreign(foreign: list[Folder], room: int, removed: Removed) -> list[Folder]:
    """The oldest snapshots of the foreign folders no process holds, removed until the foreign folders
    fit `room` (or none is left to remove); the folders left."""
    held: dict[Path, int] = {}
    try:
        for index, folder in enumerate(foreign):
            fd = _unheld(folder.path)
            if fd is not None:
                held[folder.path] = fd
                foreign[index] = _scan_folder(folder.path)  # as it is under the lock
        excess = sum(folder.nbytes for folder in foreign) - room
        _remove_oldest([folder for folder in foreign if folder.path in held], excess, removed)
        left = []
        for folder in foreign:
            if folder.path in held and not folder.snapshots and _rmdir(folder.path):
                removed.folders += 1
            else:
                left.append(folder)
        return left
    finally:
        for fd in held.values():
            os.close(fd)


def _remove_oldest(folders: list[Folder], excess: int, removed: Removed) -> None:
    """The oldest snapshots of `folders` removed until `excess` bytes are (or none is left)."""
    files = sorted(
        ((file, folder) for folder in folders for file in folder.snapshots), key=lambda pair: pair[0].mtime
    )
    for file, folder in files:
        if excess <= 0:
            return
        if _unlink(file.path):
            folder.snapshots.remove(file)
            excess -= file.nbytes
            removed.snapshots += 1
            removed.snapshot_bytes += file.nbytes


def _unlink(path: Path) -> bool:
    """Whether `path` is gone (removed here, or by another process already)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def _rmdir(path: Path) -> bool:
    """Remove an emptied folder (it stays where files not of our naming are left in it)."""
    try:
        path.rmdir()
    except OSError:
        return False
    return True
