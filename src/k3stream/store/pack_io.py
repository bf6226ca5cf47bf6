"""Reading expert objects from the pack: `os.preadv` of aligned ranges in parallel, optional O_DIRECT.

An object is split into `read_splits` ranges whose starts are 4 KiB aligned (pack objects start on
4 KiB boundaries), and the ranges of every object of one request are read at once by a thread pool.
With O_DIRECT each range is read, rounded up to whole 4 KiB blocks, straight into its destination
when that is aligned and has room for the rounding (`host_buffer` makes such buffers), else into an
aligned per-thread bounce buffer and copied out; a short read (Linux returns at most 2 GiB less a page
at once) goes on from the block it stopped at, as buffered reads go on from the byte, until the end of
the file. When the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the file is reopened
buffered and `direct_io_note` says why.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3stream.quant.kernels import cpu

ALIGNMENT = 4096
# below this a split read costs more in thread hand-offs than it gains in parallel I/O
MIN_SPLIT_BYTES = 256 << 10


class OrderedDigest:
    """A streaming digest (`update` in order, `intdigest`) of an object read in ranges that land in any
    order, each range fed to it by the thread that read it, right after its read, in the object's
    order: a range that lands before the ones ahead of it waits in `_landed` and is fed by the thread
    that feeds the range before it. Just read, a range is partly in the CPU's caches: xxh3 took it at
    37 GB/s against 25 in a later pass (2.85 MiB O_DIRECT ranges of the 128-expert slice's pack,
    2026-12-07, the AMD EPYC VM), and the object is checked once its last range is in."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._landed: dict[int, memoryview] = {}  # ranges read, not yet fed: by their start
        self._fed = 0  # bytes fed, from the start
        self._feeding = False  # a thread is feeding the state
        self.cpu_ns = 0  # the feeding threads' CPU time

    def landed(self, start: int, data: np.ndarray) -> None:
        """The range of the object at `start` is read: feed it, and the ranges after it that wait,
        unless another thread feeds (it feeds this one too, in turn)."""
        with self._lock:
            self._landed[start] = memoryview(data).cast("B")
            if self._feeding:
                return
            self._feeding = True
        cpu = time.thread_time_ns()
        while True:
            with self._lock:
                view = self._landed.pop(self._fed, None)
                if view is None:
                    self._feeding = False
                    self.cpu_ns += time.thread_time_ns() - cpu
                    return
                self._fed += len(view)
            self._state.update(view)

    def intdigest(self, nbytes: int) -> int | None:
        """The digest of the object's `nbytes`, or None unless every byte of them was fed."""
        with self._lock:
            return self._state.intdigest() if self._fed == nbytes and not self._feeding else None


@dataclass(frozen=True)
class ReadRequest:
    """Read `nbytes` at pack offset `offset` into `dest` (a writable uint8 numpy array of at least
    `nbytes`; bytes past `nbytes` may be overwritten), each range fed to `digest` as it lands."""

    label: str
    offset: int
    nbytes: int
    dest: np.ndarray
    digest: OrderedDigest | None = None


def split_ranges(nbytes: int, splits: int) -> list[tuple[int, int]]:
    """(start, length) parts of an object, none under MIN_SPLIT_BYTES unless the object is smaller;
    starts are 4 KiB aligned when the object is big enough."""
    splits = max(1, min(splits, nbytes // MIN_SPLIT_BYTES))
    alignment = ALIGNMENT if nbytes >= splits * ALIGNMENT else 1
    bounds = [nbytes * part // splits // alignment * alignment for part in range(splits)] + [nbytes]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(splits) if bounds[i + 1] > bounds[i]]


def _aligned_empty(nbytes: int, huge_pages: bool = False) -> np.ndarray:
    """A new page-aligned uint8 array, a mapping of its own: on small pages (advised against
    transparent huge pages) unless `huge_pages`. NumPy advises its large arrays for huge pages, and
    in a memory cgroup a fresh huge page's fault (zeroing 2 MiB, charging it) in a read cost the cold
    prefill of the 128-expert real-dimension slice 1.55-1.63 s of system time at 25% of its experts,
    against 0.38-0.46 s on small pages (`docs/real-model.md`, Read buffers); a read overwrites every
    byte anyway."""
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE"
    if hasattr(mmap, advice):
        mapping.madvise(getattr(mmap, advice))
    return np.frombuffer(mapping, dtype=np.uint8)[:nbytes]  # the array holds the mapping


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def host_buffer(nbytes: int, direct_io: bool) -> np.ndarray:
    """A destination for an `nbytes` object, on small pages (`_aligned_empty`): with O_DIRECT rounded
    up to whole 4 KiB blocks, so the reads land in it without a bounce copy (slice the object's
    `nbytes` off it)."""
    return _aligned_empty(_round_up(nbytes) if direct_io else nbytes)


def prefaulted_buffer(nbytes: int) -> np.ndarray:
    """`host_buffer(nbytes, direct_io=True)` made ahead of the reads, every page faulted in (one write
    a page, in NumPy's loop, which runs without the GIL): a read landing in it faults nothing. On
    transparent huge pages where the kernel allows them: off the reads' path a huge page's fault cost
    less CPU a byte than small pages' (0.25-0.34 against 0.62-0.74 s of system time for 2 GiB, in and
    out of a memory cgroup, on this VM)."""
    buffer = _aligned_empty(_round_up(nbytes), huge_pages=True)
    buffer[:: mmap.PAGESIZE] = 0
    return buffer


class _Task:
    """One queued call: it may sit in the queue twice (`PriorityPool.hurry` queues it again at a
    better priority), and runs once, from whichever entry a worker takes first."""

    __slots__ = ("future", "function", "args", "tag", "taken")

    def __init__(self, function: Callable | None, args: tuple, tag: object = None) -> None:
        self.future: Future = Future()
        self.function, self.args, self.tag = function, args, tag
        self.taken = False


class PriorityPool:
    """Worker threads that take the lowest priority number first (demand reads overtake prefetches);
    a queued call's priority can be raised (`hurry`) while no worker has taken it."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()  # guards each task's `taken` and `_tagged`
        self._tagged: dict[object, list[tuple[int, _Task]]] = {}  # queued tasks by tag, with priority
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def run_here(function: Callable, *args: object) -> Future:
        """Run `function` in the calling thread, its outcome in a finished Future."""
        task = _Task(function, args)
        PriorityPool._run(task)
        return task.future

    def submit(self, priority: int, function: Callable, *args: object, tag: object = None) -> Future:
        """Queue `function(*args)`; `tag` names it for `hurry`."""
        task = _Task(function, args, tag)
        with self._lock:
            if tag is not None:
                self._tagged.setdefault(tag, []).append((priority, task))
            self._queue.put((priority, next(self._order), task))
        return task.future

    def hurry(self, tag: object, priority: int) -> int:
        """Queue again at `priority` the calls tagged `tag` that wait at a worse one and that no worker
        has taken (each runs once, at the better priority); returns how many."""
        with self._lock:
            waiting = self._tagged.get(tag, [])
            raised = [(priority, task) for was, task in waiting if was > priority and not task.taken]
            if raised:
                self._tagged[tag] = [entry for entry in waiting if entry[0] <= priority] + raised
            for _, task in raised:
                self._queue.put((priority, next(self._order), task))
        return len(raised)

    def _work(self) -> None:
        while True:
            task = self._queue.get()[2]
            if task.function is None:
                return
            if self._take(task):
                self._run(task)

    def _take(self, task: _Task) -> bool:
        """Claim a queued task for this worker: False when another entry of it was taken first."""
        with self._lock:
            if task.taken:
                return False
            task.taken = True
            if task.tag is not None:
                left = [entry for entry in self._tagged.get(task.tag, []) if entry[1] is not task]
                if left:
                    self._tagged[task.tag] = left
                else:
                    self._tagged.pop(task.tag, None)
            return True

    @staticmethod
    def _run(task: _Task) -> None:
        """Run one task; its arguments (read buffers) are released when the task is dropped."""
        try:
            task.future.set_result(task.function(*task.args))
        except BaseException as exc:  # handed to the waiting reader
            task.future.set_exception(exc)
        finally:
            task.args = ()

    def shutdown(self) -> None:
        """Finish the queued reads, then stop the workers."""
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._order), _Task(None, ())))
        for thread in self._threads:
            thread.join()


def _as_landed(requests: list[ReadRequest], jobs: dict[int, list[Future]]) -> Iterator[ReadRequest]:
    """The requests, each once all its ranges' futures (`jobs[id(request)]`) are done, in that order."""
    landed: queue.SimpleQueue[ReadRequest] = queue.SimpleQueue()
    lock = threading.Lock()
    left = {id(request): len(jobs[id(request)]) for request in requests}

    def one_done(request: ReadRequest) -> None:
        with lock:
            left[id(request)] -= 1
            last = not left[id(request)]
        if last:
            landed.put(request)

    for request in requests:
        if not jobs[id(request)]:  # nothing to read (an empty object)
            landed.put(request)
        for job in jobs[id(request)]:
            job.add_done_callback(lambda _job, request=request: one_done(request))
    for _ in requests:
        yield landed.get()


def _buffered(path: Path) -> int:
    """A buffered descriptor with read-ahead off: objects are read whole, in the order the model asks
    for them, so the kernel's read-ahead (8 MiB on some devices) would only read bytes nobody uses."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class ReadersBusy:
    """The pack ranges being read or hashed in this process, any store's: the C kernels hear when their
    count leaves zero and when it comes back (`cpu.set_reads_busy`), and their mat-vec regions leave a
    CPU to the readers meanwhile (`cpu.set_reads_yield`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges = 0

    def __enter__(self) -> None:
        with self._lock:
            self._ranges += 1
            if self._ranges == 1:
                cpu.set_reads_busy(True)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._ranges -= 1
            if not self._ranges:
                cpu.set_reads_busy(False)


READERS_BUSY = ReadersBusy()


class ReadDepth:
    """How many pack ranges are being read at once (the queue depth the readers give the disk) and
    what the reads cost the readers' CPU: `pack_ranges` read, `pack_unaligned_ranges` among them (a
    start or a destination off 4 KiB: a bounce copy with O_DIRECT), `pack_busy_ns` (some range in
    flight), `pack_depth_ns` (ranges in flight summed over time: over `pack_busy_ns`, the mean depth
    while busy), `pack_depth_max`, `pack_read_cpu_ns` (the reader threads' CPU time in their reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = time.perf_counter_ns()
        names = ("pack_ranges", "pack_unaligned_ranges", "pack_busy_ns", "pack_depth_ns", "pack_depth_max")
        self.counts = dict.fromkeys((*names, "pack_read_cpu_ns"), 0)

    def _step(self, change: int) -> None:
        """Under the lock: `change` ranges start (1) or end (-1) now."""
        now = time.perf_counter_ns()
        elapsed, self._since = now - self._since, now
        if self._inflight:
            self.counts["pack_busy_ns"] += elapsed
            self.counts["pack_depth_ns"] += elapsed * self._inflight
        self._inflight += change
        self.counts["pack_depth_max"] = max(self.counts["pack_depth_max"], self._inflight)

    @contextlib.contextmanager
    def reading(self, aligned: bool) -> Iterator[None]:
        """Count one range's read around the body (run in the reading thread)."""
        cpu = time.thread_time_ns()
        with self._lock:
            self._step(1)
            self.counts["pack_ranges"] += 1
            self.counts["pack_unaligned_ranges"] += not aligned
        try:
            yield
        finally:
            with self._lock:
                self._step(-1)
                self.counts["pack_read_cpu_ns"] += time.thread_time_ns() - cpu

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class Reads:
    """The reads `PackFile.start` queued: iterating yields each request once its bytes are in (see
    `PackFile.read_each`) and raises the first failure; `close()`, also run when the iteration ends,
    waits for the reads still running and counts them (a holder that stops early, or never iterates,
    closes them)."""

    def __init__(
        self, file: PackFile, requests: list[ReadRequest], priority: int, jobs: dict[int, list[Future]]
    ) -> None:
        self._file, self._requests, self._priority, self._jobs = file, requests, priority, jobs
        self._started = time.perf_counter_ns()
        self._failure: OSError | None = None
        self._open = True

    def __iter__(self) -> Iterator[ReadRequest]:
        jobs = self._jobs
        try:
            for request in _as_landed(self._requests, jobs) if self._priority > 0 else self._requests:
                self._failure = self._file._failure(request, jobs[id(request)])
                if self._failure is not None:
                    break
                yield request
        finally:
            self.close()
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        futures.wait([job for pieces in self._jobs.values() for job in pieces])
        self._file._count(self._requests, self._failure, time.perf_counter_ns() - self._started)
        self._file._reads_done()


class PackFile:
    """The pack opened for reading, with a pool of reader threads and read statistics."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        io_threads: int = 4,
        read_splits: int = 4,
        direct_io: bool = False,
        off_note: str = "not requested",
        simulated_read_latency_us: float = 0.0,
    ) -> None:
        if io_threads <= 0 or read_splits <= 0:
            raise ValueError(
                f"io_threads and read_splits must be positive, got {io_threads} and {read_splits}"
            )
        self.path = Path(path)
        self.read_splits = read_splits
        self.simulated_read_latency_us = float(simulated_read_latency_us)
        self.direct_io = False
        self.direct_io_note = off_note if not direct_io else ""
        self._fd = self._open(direct_io)
        self._local = threading.local()
        self._fallback_lock = threading.Lock()
        self._retired_fds: list[int] = []
        self._pool = PriorityPool(io_threads, "k3stream-pack-read")
        self._readers = threading.Condition()  # guards _closed and _active_reads
        self._closed = False
        self._active_reads = 0
        self._stats_lock = threading.Lock()
        self.stats = {"pack_reads": 0, "pack_read_bytes": 0, "pack_read_ns": 0, "io_errors": 0}
        self.depth = ReadDepth()

    def _open(self, direct_io: bool) -> int:
        if direct_io:
            if not hasattr(os, "O_DIRECT"):
                self.direct_io_note = "O_DIRECT is not available on this platform"
            else:
                try:
                    fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    self.direct_io_note = (
                        f"filesystem refused O_DIRECT ({exc.strerror}); using buffered reads"
                    )
                else:
                    self.direct_io = True
                    self.direct_io_note = "on"
                    return fd
        return _buffered(self.path)

    def read(self, requests: list[ReadRequest], priority: int = 0) -> None:
        """Read every request, all ranges in parallel, after the queued ranges of lower `priority`
        numbers; raises OSError naming the pack and object, RuntimeError once closed."""
        for _ in self.read_each(requests, priority):
            pass

    def read_each(self, requests: list[ReadRequest], priority: int = 0) -> Iterator[ReadRequest]:
        """`read`, yielding each request as soon as its bytes are in: a demand read (priority 0) in
        the given order (its caller needs every request, and what it admits stays in its order), any
        other in the order they land (a read raised by `hurry` is not held behind the requests before
        it). The ranges are queued in pack order, so the disk sees one forward sweep; when this ends
        (consumed, failed or closed early) no read of its requests is still running. A request of one
        range is read in the calling thread (its caller waits for it anyway)."""
        reads = self.start(requests, priority, read_here=True)
        with contextlib.closing(reads):
            yield from reads

    def start(self, requests: list[ReadRequest], priority: int = 0, read_here: bool = False) -> Reads:
        """Queue every range of `requests` now and return them as `Reads` (iterated as `read_each`
        yields; whoever holds them must iterate or close them). With `read_here`, a request of one
        range is read in the calling thread before this returns."""
        with self._readers:
            if self._closed:
                raise RuntimeError(f"expert-pack file {self.path} is closed")
            self._active_reads += 1
        try:
            return Reads(self, requests, priority, self._submit(requests, priority, read_here))
        except BaseException:
            self._reads_done()
            raise

    def _reads_done(self) -> None:
        with self._readers:
            self._active_reads -= 1
            self._readers.notify_all()

    def _submit(self, requests: list[ReadRequest], priority: int, read_here: bool) -> dict[int, list[Future]]:
        """Queue every range of `requests` in pack order: {id(request): its ranges' futures}."""
        parts = [
            (request, start, length)
            for request in sorted(requests, key=lambda request: request.offset)
            for start, length in split_ranges(request.nbytes, self.read_splits)
        ]
        jobs: dict[int, list[Future]] = {id(request): [] for request in requests}
        for part in parts:
            if len(parts) == 1 and read_here:  # one small object: read it here, no hand-off
                job = self._pool.run_here(self._read_range, *part)
            else:
                job = self._pool.submit(priority, self._read_range, *part, tag=part[0].offset)
            jobs[id(part[0])].append(job)
        return jobs

    def hurry(self, offsets: list[int], priority: int) -> int:
        """Raise to `priority` the queued ranges of the requests at these pack offsets (a read a
        prefetch queued that a step now waits for); returns how many ranges moved."""
        return sum(self._pool.hurry(offset, priority) for offset in offsets)

    def _failure(self, request: ReadRequest, jobs: list[Future]) -> OSError | None:
        """Wait for `request`'s ranges: None, or the error naming the pack and object."""
        for job in jobs:
            try:
                job.result()
            except OSError as exc:
                return OSError(
                    exc.errno,
                    f"expert-pack read failed for {request.label} in {self.path}: {exc.strerror or exc}",
                )
        return None

    def _count(self, requests: list[ReadRequest], failure: OSError | None, elapsed: int) -> None:
        with self._stats_lock:
            if failure is not None:
                self.stats["io_errors"] += 1
            else:
                self.stats["pack_reads"] += len(requests)
                self.stats["pack_read_bytes"] += sum(request.nbytes for request in requests)
                self.stats["pack_read_ns"] += elapsed

    def _read_range(self, request: ReadRequest, start: int, length: int) -> None:
        aligned = (
            not (request.offset + start) % ALIGNMENT and not request.dest[start:].ctypes.data % ALIGNMENT
        )
        with READERS_BUSY:
            with self.depth.reading(aligned):
                self._read_range_now(request, start, length)
            if request.digest is not None:
                request.digest.landed(start, request.dest[start : start + length])

    def _read_range_now(self, request: ReadRequest, start: int, length: int) -> None:
        if self.simulated_read_latency_us:
            time.sleep(self.simulated_read_latency_us / 1e6)
        target = request.dest[start : start + length]
        if self.direct_io:
            try:
                self._read_direct(request.offset + start, target, request.dest[start:])
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fall_back_to_buffered(exc)
        self._read_exact(self._fd, request.offset + start, target)

    def _read_direct(self, offset: int, target: np.ndarray, room: np.ndarray) -> None:
        """Read `target` (the start of `room`, which may be written past the target's end)."""
        head = offset % ALIGNMENT
        span = _round_up(head + target.size)
        straight = not head and not target.ctypes.data % ALIGNMENT and room.size >= span
        buffer = room if straight else self._bounce(span)
        got = self._read_blocks(self._fd, offset - head, buffer[:span], head + target.size)
        if got < head + target.size:
            raise OSError(errno.EIO, f"short read: {max(got - head, 0)} of {target.size} bytes at {offset}")
        if not straight:
            target[:] = buffer[head : head + target.size]

    @staticmethod
    def _read_blocks(fd: int, offset: int, buffer: np.ndarray, needed: int) -> int:
        """O_DIRECT reads into `buffer` from `offset` (both aligned) until `needed` bytes are in, each
        short read's remainder read again from the block it stopped at; the bytes read, fewer at the
        end of the file (a read returning nothing, or stopping inside a block, which only the end of
        the file does)."""
        view = memoryview(buffer)
        done = 0
        while done < needed:
            got = os.preadv(fd, [view[done:]], offset + done)
            done += got
            if not got or done % ALIGNMENT:
                break
        return done

    def _bounce(self, nbytes: int) -> np.ndarray:
        """This reader thread's aligned bounce buffer, at least `nbytes`."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            bounce = self._local.bounce = _aligned_empty(nbytes)
        return bounce

    def _fall_back_to_buffered(self, exc: OSError) -> None:
        with self._fallback_lock:
            if self.direct_io:
                # the O_DIRECT descriptor stays open until close(): other reader threads may hold it
                self._retired_fds.append(self._fd)
                self._fd = _buffered(self.path)
                self.direct_io = False
                self.direct_io_note = f"O_DIRECT reads refused ({exc.strerror}); using buffered reads"

    @staticmethod
    def _read_exact(fd: int, offset: int, target: np.ndarray) -> None:
        view = memoryview(target)
        done = 0
        while done < target.size:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"short read: {done} of {target.size} bytes at {offset}")
            done += got

    def snapshot(self) -> dict:
        with self._stats_lock:
            return {
                **self.stats,
                **self.depth.snapshot(),
                "read_splits": self.read_splits,
                "direct_io": self.direct_io,
                "direct_io_note": self.direct_io_note,
                "simulated_read_latency_us": self.simulated_read_latency_us,
            }

    def close(self) -> None:
        """Refuse new reads, let those in flight finish, then stop the readers and close the file."""
        with self._readers:
            if self._closed:
                return
            self._closed = True
            self._readers.wait_for(lambda: self._active_reads == 0)
        self._pool.shutdown()
        for fd in [*self._retired_fds, self._fd]:
            if fd >= 0:
                os.close(fd)
        self._retired_fds, self._fd = [], -1
