"""Build the expert-major pack and its manifest from a Kimi-K3 GGUF.

Each routed expert slice is copied verbatim (kernel-side `copy_file_range`, falling back to
pread/pwrite) into `PACK.partial`. Progress is recorded durably in a journal sidecar
(`PACK.partial.journal`): the pack data is fsynced before the journal says how many entries are done,
so a build killed at any point resumes from the last journalled entry after checking, byte for byte
against the GGUF, every entry it resumes past (a build stopped after the rename, before the manifest,
checks every entry of the renamed pack). Every object is read back for its checksum and checked there
for NaN or infinite values and scales (`PackPlan.check_finite`): the first bad one stops the build. The
partial file is renamed to the pack only after it is complete, fsynced and sample-verified; the manifest
comes last. A lock file keeps two builders apart.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3stream.gguf.layout import ROUTED_EXPERT_RE, routed_expert_name
from k3stream.gguf.shards import file_output, refuse_source_output
from k3stream.pack import format as fmt
from k3stream.pack.fileio import (
    COPY_CHUNK,
    fsync_directory,
    pread_exact,
    remove_temporaries,
    same_bytes,
    write_json_atomic,
)
from k3stream.pack.integrity import ObjectHasher, object_identity, sha256_file
from k3stream.pack.manifest import (
    ManifestOptions,
    build_manifest,
    expert_pack_section,
    read_json,
    tokenizer_values,
)
from k3stream.pack.paths import default_outputs, manifest_path_for
from k3stream.pack.verify import check_finite_payload, check_index, evenly_spaced

log = logging.getLogger(__name__)

JOURNAL_FORMAT = "k3stream-pack-journal-v1"
DEFAULT_MARGIN_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class PackPlan:
    """What to copy: the checkpoint's routed expert tensors and the pack layout they imply, and the
    tokenizer metadata the manifest records (read before any copy: a key that cannot be read fails first)."""

    checkpoint: Any
    layout: fmt.PackLayout
    role_tensors: dict[tuple[int, str], Any]  # (layer, role) -> TensorInfo
    tokenizer: dict[str, Any]  # every tokenizer.* metadata value by key

    def source(self, index: int) -> tuple[Path, int, str]:
        """(shard path, absolute offset, tensor name) of index entry `index`."""
        layer, expert, role = self.layout.identity(index)
        info = self.role_tensors[(layer, fmt.ROLES[role])]
        return info.path, info.data_offset + expert * info.nbytes // self.layout.num_experts, info.name

    def check_finite(self, ordinal: int, data: bytes) -> None:
        """Refuse object `ordinal` (its pack bytes `data`: up, gate, down and the padding between) where a
        role's payload holds a NaN or infinite value or scale, naming the GGUF, tensor, expert and block."""
        layer, expert = object_identity(self.layout, ordinal)
        position = self.layout.layer_position(layer)
        offsets, sizes = self.layout.offsets_at(position), self.layout.sizes_at(position)
        for role, offset, nbytes in zip(fmt.ROLES, offsets, sizes, strict=True):
            info = self.role_tensors[(layer, role)]
            payload = memoryview(data)[offset : offset + nbytes]
            check_finite_payload(payload, info.ggml_type, f"{info.path}: {info.name} expert {expert}")


def plan_pack(checkpoint: Any) -> PackPlan:
    """Check the routed expert tensors (present, 3-D, evenly sliceable); each MoE layer's role sizes
    follow its tensors' types (a mixed recipe's layers differ)."""
    config = checkpoint.config
    moe_layers = tuple(config.moe_layers)
    if not moe_layers:
        raise ValueError(
            f"{checkpoint.shards[0]}: no routed experts to pack: kimi-k3.leading_dense_block_count "
            f"{config.n_dense} makes all {config.n_layers} layers dense; run the GGUF itself"
        )
    experts = config.n_experts
    role_tensors: dict[tuple[int, str], Any] = {}
    for layer in moe_layers:
        for role in fmt.ROLES:
            info = checkpoint.info(routed_expert_name(layer, role))
            if len(info.shape) != 3 or info.shape[0] != experts or info.nbytes % experts:
                raise ValueError(
                    f"{info.path}: routed expert tensor {info.name} of shape {info.shape} "
                    f"({info.nbytes} bytes) does not split into {experts} experts"
                )
            role_tensors[(layer, role)] = info
    sizes = tuple(
        tuple(role_tensors[(layer, role)].nbytes // experts for role in fmt.ROLES) for layer in moe_layers
    )
    strays = [
        name
        for name in checkpoint.tensors
        if (match := ROUTED_EXPERT_RE.match(name)) and int(match["layer"]) not in moe_layers
    ]
    if strays:
        raise ValueError(f"{checkpoint.shards[0]}: routed expert tensor {strays[0]} in a layer without MoE")
    layout = fmt.PackLayout.of_layers(moe_layers, experts, sizes)
    return PackPlan(checkpoint, layout, role_tensors, tokenizer_values(checkpoint))


# ------------------------------------------------------------------------------------------------
# lock, journal


@contextmanager
def build_lock(pack: Path) -> Iterator[None]:
    """An exclusive flock on `PACK.lock`; a second builder fails at once instead of racing."""
    lock_path = pack.with_name(pack.name + ".lock")
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another k3stream pack build holds {lock_path}") from None
        # the holder before us may have unlinked the file after we opened it: lock the current one
        with suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                break
        os.close(fd)
    try:
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


def journal_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".journal")


def build_identity(plan: PackPlan) -> dict[str, Any]:
    """What a resumed build must share with the interrupted one: the layout and the source files."""
    sources = []
    for path in plan.checkpoint.shards:
        stat = path.stat()
        sources.append({"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return {
        "format": JOURNAL_FORMAT,
        "index_sha256": plan.layout.index_sha256(),
        "size": plan.layout.total_size,
        "sources": sources,
    }


def write_journal(path: Path, identity: dict[str, Any], entries_done: int) -> None:
    write_json_atomic(path, {"identity": identity, "entries_done": entries_done})


def read_journal(path: Path, identity: dict[str, Any]) -> int | None:
    """Entries the journal says are durable, or None when it is absent, unreadable or for another build."""
    try:
        journal = read_json(path)
    except (FileNotFoundError, ValueError):
        return None
    if journal.get("identity") != identity or not isinstance(journal.get("entries_done"), int):
        return None
    return journal["entries_done"]


# ------------------------------------------------------------------------------------------------
# copying


class Copier:
    """Copies byte ranges between files: `copy_file_range` while the kernel allows, else pread/pwrite."""

    def __init__(self) -> None:
        self.kernel_copy = hasattr(os, "copy_file_range")
        self._buffer: memoryview | None = None

    def copy(self, src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            copied = self._copy_some(src_fd, src_offset + done, dst_fd, dst_offset + done, nbytes - done)
            if copied == 0:
                raise RuntimeError(
                    f"short read from the GGUF at offset {src_offset + done}; "
                    f"{nbytes - done} bytes of the slice remain"
                )
            done += copied

    def _copy_some(self, src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> int:
        if self.kernel_copy:
            try:
                return os.copy_file_range(src_fd, dst_fd, nbytes, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self.kernel_copy = False
        if self._buffer is None:
            self._buffer = memoryview(bytearray(COPY_CHUNK))
        view = self._buffer[: min(nbytes, COPY_CHUNK)]
        got = os.preadv(src_fd, [view], src_offset)
        written = 0
        while written < got:
            written += os.pwrite(dst_fd, view[written:got], dst_offset + written)
        return got


class SourceFiles:
    """Read-only GGUF descriptors, one per routed tensor: the copy reads the up, gate and down tensors of
    a layer in turn, and the kernel's readahead only stays ramped up on a descriptor that reads
    sequentially. The few most recent stay open."""

    KEEP_OPEN = 8

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()

    def fd(self, path: Path, tensor: str) -> int:
        if tensor in self._fds:
            self._fds.move_to_end(tensor)
            return self._fds[tensor]
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._fds[tensor] = fd
        if len(self._fds) > self.KEEP_OPEN:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def first_bad_entry(plan: PackPlan, sources: SourceFiles, partial_fd: int, count: int) -> int:
    """First of entries 0..count-1 whose bytes in the partial pack differ from the GGUF (count if none)."""
    layout = plan.layout
    for index in range(count):
        entry = layout.entry(index)
        path, offset, tensor = plan.source(index)
        if not same_bytes(partial_fd, entry.offset, sources.fd(path, tensor), offset, entry.nbytes):
            return index
    return count


def verify_samples(plan: PackPlan, sources: SourceFiles, pack_fd: int, samples: int) -> int:
    indices = evenly_spaced(plan.layout.index_count, samples)
    for index in indices:
        entry = plan.layout.entry(index)
        path, offset, tensor = plan.source(index)
        if not same_bytes(pack_fd, entry.offset, sources.fd(path, tensor), offset, entry.nbytes):
            raise RuntimeError(
                f"expert-pack payload does not match GGUF source for {entry.name} expert {entry.expert}"
            )
    return len(indices)


# ------------------------------------------------------------------------------------------------
# the build


@dataclass(frozen=True)
class BuildResult:
    pack: Path
    manifest: Path
    size: int
    copied_bytes: int  # payload bytes copied by this run
    resumed_bytes: int  # payload bytes of an interrupted build kept after checking them
    seconds: float  # the whole run
    copy_seconds: float  # copying entries only
    kernel_copy: bool  # copy_file_range did the copying

    @property
    def throughput(self) -> float:
        """Bytes per second of the copy phase."""
        return self.copied_bytes / self.copy_seconds if self.copy_seconds > 0 else 0.0


@dataclass(frozen=True)
class CopyStats:
    copied_bytes: int = 0
    resumed_bytes: int = 0
    seconds: float = 0.0
    kernel_copy: bool = True


@dataclass
class BuildOptions(ManifestOptions):
    """What the manifest records (`ManifestOptions`) and how the build runs."""

    force: bool = False
    margin_bytes: int = DEFAULT_MARGIN_BYTES
    progress: bool = True
    sync_bytes: int = 256 * 1024 * 1024  # fsync the data, then journal the progress, this often


def build_pack(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    options: BuildOptions | None = None,
    profile: str = "generic",
) -> BuildResult:
    """Build (or resume, or finish) the pack and manifest for the GGUF at `gguf_path`."""
    from k3stream.gguf.reader import K3Checkpoint

    options = options or BuildOptions()
    plan = plan_pack(K3Checkpoint.open(gguf_path, profile=profile))
    default_pack, _ = default_outputs(plan.checkpoint.shards)
    pack = file_output(out, "--out").resolve() if out is not None else default_pack
    manifest_path = (
        file_output(manifest, "--manifest").resolve() if manifest is not None else manifest_path_for(pack)
    )
    if pack == manifest_path:
        raise ValueError(f"the pack and its manifest would be one file: {pack}")
    for path, what in ((pack, "the pack"), (manifest_path, "the manifest")):
        refuse_source_output(path, plan.checkpoint.shards, what)
    pack.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(pack):
        return _locked_build(plan, pack, manifest_path, options)


def _locked_build(plan: PackPlan, pack: Path, manifest_path: Path, options: BuildOptions) -> BuildResult:
    started = time.perf_counter()
    partial = pack.with_name(pack.name + ".partial")
    journal = journal_path(partial)
    for written in (journal, manifest_path):  # a killed build's half-written ones: the lock makes them ours
        remove_temporaries(written)
    identity = build_identity(plan)
    done = read_journal(journal, identity)
    finishing = done == plan.layout.index_count and pack.is_file() and not partial.exists()
    sources = SourceFiles()
    hasher = ObjectHasher(plan.layout)
    try:
        if finishing:
            finishing = _finished_copy_intact(plan, pack, partial, manifest_path, sources)
        if finishing:
            stats = CopyStats(resumed_bytes=plan.layout.payload_bytes)
            _hash_all(plan, hasher, pack)
        else:
            _refuse_to_overwrite(pack, manifest_path, options.force)
            stats = _copy_into_partial(plan, partial, journal, identity, done, sources, options, hasher)
        # read back and sample-checked before the rename: a bad copy never gets the final name
        checked = pack if finishing else partial
        pack_section = describe_pack(plan, checked, sources, options.payload_samples, options.full_hash)
        if not finishing:
            os.replace(partial, pack)
            fsync_directory(pack.parent)
        manifest_value = build_manifest(
            plan.checkpoint, plan.tokenizer, pack, manifest_path, pack_section, options, hasher.complete()
        )
        write_json_atomic(manifest_path, manifest_value)
    finally:
        sources.close()
    with suppress(FileNotFoundError):
        journal.unlink()
    return BuildResult(
        pack,
        manifest_path,
        plan.layout.total_size,
        stats.copied_bytes,
        stats.resumed_bytes,
        time.perf_counter() - started,
        stats.seconds,
        stats.kernel_copy,
    )


def _hash_all(plan: PackPlan, hasher: ObjectHasher, pack: Path) -> None:
    fd = os.open(pack, os.O_RDONLY)
    try:
        _hash_and_check(plan, hasher, fd, range(hasher.digests.size))
    finally:
        os.close(fd)


def _hash_and_check(plan: PackPlan, hasher: ObjectHasher, fd: int, ordinals: range) -> None:
    """Each object of `ordinals` hashed and checked for non-finite values as `fd` holds it: the bytes the
    digest reads anyway."""
    for ordinal in ordinals:
        plan.check_finite(ordinal, hasher.hash_object(fd, ordinal))


def _refuse_to_overwrite(pack: Path, manifest_path: Path, force: bool) -> None:
    existing = [path for path in (pack, manifest_path) if path.exists()]
    if existing and not force:
        raise FileExistsError(
            f"refusing to overwrite existing expert pack output {existing[0]} (use --force)"
        )
    # the old manifest goes first, so no complete manifest ever describes a pack being replaced
    for path in reversed(existing):
        path.unlink()


def _intact_entries(plan: PackPlan, path: Path, count: int, sources: SourceFiles) -> int:
    """How many of the first `count` entries of `path` hold their GGUF bytes, each compared in full
    (0 when the file's size, header or index is wrong)."""
    if not path.is_file() or path.stat().st_size != plan.layout.total_size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if pread_exact(fd, plan.layout.data_start, 0) != plan.layout.header_and_index():
            return 0
        return first_bad_entry(plan, sources, fd, count)
    finally:
        os.close(fd)


def _resume_point(plan: PackPlan, partial: Path, journal_done: int | None, sources: SourceFiles) -> int:
    """Entries of an interrupted build that are intact (0 when starting over)."""
    if journal_done is None:
        return 0
    return _intact_entries(plan, partial, min(journal_done, plan.layout.index_count), sources)


def _finished_copy_intact(
    plan: PackPlan, pack: Path, partial: Path, manifest_path: Path, sources: SourceFiles
) -> bool:
    """A build stopped between renaming the pack and writing its manifest: check every entry of the
    pack. A damaged pack goes back to being the partial file (its manifest, if any, first), so the
    copy resumes from its first bad entry."""
    count = plan.layout.index_count
    log.info("resuming %s: the copy had finished; checking every entry against the GGUF", pack)
    intact = _intact_entries(plan, pack, count, sources)
    if intact == count:
        return True
    log.info("%s: entry %d does not match the GGUF; resuming the copy from there", pack, intact)
    manifest_path.unlink(missing_ok=True)
    os.replace(pack, partial)
    fsync_directory(pack.parent)
    return False


def _check_free_space(directory: Path, needed: int, margin: int, reclaimable: int = 0) -> None:
    """`reclaimable`: bytes a stale partial pack holds beyond what is kept; truncating it frees them."""
    free = shutil.disk_usage(directory).free + reclaimable
    if free < needed + margin:
        raise OSError(
            errno.ENOSPC,
            f"not enough free space in {directory} for the expert pack: "
            f"{free} bytes free (counting {reclaimable} held by the stale partial pack), "
            f"{needed} needed plus a {margin}-byte margin",
        )


def _reclaimable(partial: Path, keep: int) -> int:
    """Disk bytes of an existing partial pack beyond its first `keep` bytes (freed by the truncation)."""
    try:
        allocated = partial.stat().st_blocks * 512
    except FileNotFoundError:
        return 0
    return max(0, allocated - keep)


def _copy_into_partial(
    plan: PackPlan,
    partial: Path,
    journal: Path,
    identity: dict[str, Any],
    journal_done: int | None,
    sources: SourceFiles,
    options: BuildOptions,
    hasher: ObjectHasher,
) -> CopyStats:
    """Copy every entry not yet intact in `partial` and fsync it; `hasher` gets every object's digest
    (the kept ones read back first, each copied one read back right after its last role), and each
    object read back is checked for non-finite values."""
    layout = plan.layout
    start = _resume_point(plan, partial, journal_done, sources)
    keep = layout.entry(start).offset if start < layout.index_count else layout.total_size
    keep = keep if start else 0
    reclaimable = _reclaimable(partial, keep)
    _check_free_space(partial.parent, layout.total_size - keep, options.margin_bytes, reclaimable)
    resumed = layout.payload_before(start)
    if start:
        log.info(
            "resuming %s: %d of %d entries intact, %d bytes resumed",
            partial,
            start,
            layout.index_count,
            resumed,
        )
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # everything past the intact entries is rewritten; truncating first makes all padding zeros
        os.ftruncate(fd, keep)
        os.ftruncate(fd, layout.total_size)
        if not start:
            os.pwrite(fd, layout.header_and_index(), 0)
        write_journal(journal, identity, start)
        _hash_and_check(plan, hasher, fd, range(start // len(fmt.ROLES)))
        copier = Copier()
        checkpointer = Checkpointer(fd, journal, identity)
        copy_started = time.perf_counter()
        try:
            copied = _copy_entries(plan, fd, start, sources, copier, checkpointer, options, hasher)
        finally:
            checkpointer.close()
        os.fsync(fd)
        write_journal(journal, identity, layout.index_count)
    finally:
        os.close(fd)
    return CopyStats(copied, resumed, time.perf_counter() - copy_started, copier.kernel_copy)


class Checkpointer:
    """Makes progress durable on a helper thread: fdatasync the partial pack, then journal the entries
    copied before that sync. The copy goes on meanwhile (both calls release the GIL), so reading and
    writing stay overlapped; when syncs fall behind, only the latest request is kept."""

    def __init__(self, fd: int, journal: Path, identity: dict[str, Any]) -> None:
        self._fd, self._journal, self._identity = fd, journal, identity
        self._wanted: int | None = None
        self._busy = False
        self._stop = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="k3stream-pack-journal", daemon=True)
        self._thread.start()

    def request(self, entries_done: int) -> None:
        with self._cond:
            self._wanted = entries_done
            self._cond.notify()

    def drain(self) -> None:
        """Wait until every requested checkpoint is on disk."""
        with self._cond:
            self._cond.wait_for(lambda: (self._wanted is None and not self._busy) or self._error is not None)
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted is not None or self._stop)
                if self._wanted is None:
                    return
                entries, self._wanted, self._busy = self._wanted, None, True
            try:
                os.fdatasync(self._fd)  # data first: the journal may only name durable entries
                write_journal(self._journal, self._identity, entries)
            except BaseException as exc:  # handed to the copying thread by drain()
                self._error = exc
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            if self._error is not None:
                return


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="expert pack",
        disable=not enabled,
        mininterval=0.5,
        dynamic_ncols=True,
    )


def _copy_entries(
    plan: PackPlan,
    fd: int,
    start: int,
    sources: SourceFiles,
    copier: Copier,
    checkpointer: Checkpointer,
    options: BuildOptions,
    hasher: ObjectHasher,
) -> int:
    layout = plan.layout
    copied = 0
    batch_start = layout.entry(start).offset if start < layout.index_count else layout.total_size
    with _progress_bar(layout.payload_bytes, layout.payload_before(start), options.progress) as bar:
        for index in range(start, layout.index_count):
            entry = layout.entry(index)
            path, offset, tensor = plan.source(index)
            copier.copy(sources.fd(path, tensor), offset, fd, entry.offset, entry.nbytes)
            copied += entry.nbytes
            bar.update(entry.nbytes)
            if index % len(fmt.ROLES) == len(fmt.ROLES) - 1:
                ordinal = index // len(fmt.ROLES)
                _hash_and_check(plan, hasher, fd, range(ordinal, ordinal + 1))
            end = entry.offset + entry.nbytes
            if end - batch_start >= options.sync_bytes:
                checkpointer.request(index + 1)
                batch_start = end
    return copied


# ------------------------------------------------------------------------------------------------
# the manifest's `expert_pack` section, from the pack on disk


def describe_pack(
    plan: PackPlan, pack: Path, sources: SourceFiles, samples: int, full_hash: bool
) -> dict[str, Any]:
    """The manifest's `expert_pack` section (no path yet), from the pack on disk: its header and index
    are read back and checked, sampled payloads compared with the GGUF."""
    index = check_index(pack, plan.layout, plan.layout.data_start)
    fd = os.open(pack, os.O_RDONLY)
    try:
        verified = verify_samples(plan, sources, fd, samples)
    finally:
        os.close(fd)
    return expert_pack_section(
        plan.layout,
        plan.role_tensors,
        plan.checkpoint.config.top_k,
        index,
        verified,
        sha256_file(pack) if full_hash else None,
    )
