"""Continuous batching: one thread prefills new requests a chunk at a time between decode steps of every
running sequence.

Requests join and leave between steps. A new request's prompt is restored from the prompt cache as far
as it holds it, then prefilled a chunk per loop (`PrefillChunks`: cut from where its computation
starts; each about the work of `prefill_chunk` tokens at the start of a prompt, fewer tokens deep in a
long one, whose attention covers more rows): a running stream waits at most about one chunk, whatever
another prompt's length. While no sequence decodes, prompts are cut into passes of `pass_rows` rows
instead, the memory plan's for one pass, oldest first: no stream waits on them, and every pass costs a
part that does not grow with its tokens (its kernels' fixed cost; where experts stream from a pack, its
expert reads), which smaller chunks would pay again; but a new prompt's first pass is a chunk where
requests may share its prefix, so those that arrive just after it find its prefill short of the shared
part. No pass holds more rows than `pass_rows`. Copies of whole states are prompt work too: beside
running streams, the restores of requests that start and the snapshots of prompt ends (taken at the
step after the prompt's first token is sent, before its state decodes) take a step without a pass.
Requests that share a prompt prefix no snapshot holds compute it once: the first one's prefill
snapshots where the shared part ends, and the others wait for that snapshot and restore it; a prefill
whose prompt branches off a cached one is snapshotted where it branches, for the requests after it.
Each decode step is one `model.decode_batch` call, so in every MoE layer the union of the batch's
experts is fetched once and shared by all the tokens that routed to it. Results flow back to the HTTP
layer as events through a thread-safe `EventSink`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from k3stream.engine.chunked_prefill import ChunkedPrefill, PrefillChunks, step_together
from k3stream.engine.generate import prefill_last
from k3stream.engine.prompt_cache import PromptCache
from k3stream.engine.radix import common_length
from k3stream.quant.kernels.cpu import release_openmp_workers
from k3stream.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
# prompt tokens prefilled between two decode steps of the running sequences
DEFAULT_PREFILL_CHUNK = 512
# the fewest prompt tokens, shared with a running prefill and beyond the deepest snapshot, for which a
# request waits for that prefill's snapshot instead of computing them, and a prefill is snapshotted
# where its prompt branches off a cached one (docs/prompt-cache.md: why)
DEFAULT_SHARE_TOKENS = 128


@dataclass(frozen=True)
class PieceEvent:
    piece: Any  # what one step released: `kimi_output.Piece` (content, reasoning, tool calls, logprobs)


@dataclass(frozen=True)
class FinishEvent:
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    param: str | None = None  # set: the request's own fault (a 400 naming it), else the server's (a 500)


@dataclass(frozen=True)
class ProgressEvent:
    """How far the prefill of a request's prompt is (llama-server's `prompt_progress`)."""

    total: int
    processed: int
    time_ms: float
    cached: int = 0  # of `processed`, the tokens restored from the prompt cache

    def as_json(self) -> dict[str, Any]:
        """llama-server's `prompt_progress` object."""
        progress = {"total": self.total, "cache": self.cached, "processed": self.processed}
        return {**progress, "time_ms": self.time_ms}


Event = PieceEvent | FinishEvent | ErrorEvent | ProgressEvent


class QueueFull(Exception):
    """The waiting queue is at its bound; the request is refused rather than queued."""


class RequestError(ValueError):
    """Raised by `SequenceLogic`: the request cannot go on through its own fault (a grammar its parser
    cannot follow). It fails as a 400 naming `param` and does not count against the server's health."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SequenceLogic(Protocol):
    """Per-sequence sampling, stop handling and detokenisation: `request_logic.RequestLogic`."""

    finish_reason: str | None
    completion_tokens: int

    def choose(self, logits: Any) -> int:
        """Sample the next token from a `[V]` logits row."""

    def accept(self, token: int) -> Any:
        """Record a generated token; return what it releases (falsy: nothing)."""

    def end(self) -> None:
        """Finish with the tokens so far (`length`): a prompt-only request, which generates none."""


class EventSink:
    """Delivers events from the scheduler thread to one request's asyncio queue as `(choice, event)`:
    the choices of a request with n > 1 share the queue, each with its own index."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[tuple[int, Event]] | None = None,
        choice: int = 0,
    ) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[tuple[int, Event]] = queue if queue is not None else asyncio.Queue()
        self.choice = choice

    def put(self, event: Event) -> None:
        # A closed event loop means the server is shutting down; the event has no one to go to.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (self.choice, event))


@dataclass(eq=False)
class Job:
    """One request inside the scheduler."""

    prompt_tokens: list[int]
    logic: SequenceLogic
    sink: EventSink
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    abandoned: bool = False  # cancelled before it finished: its client left
    failed: bool = False
    state: Any = None
    last_token: int = -1
    last_token_at: float = 0.0
    prompt_done: int = 0  # prompt tokens prefilled so far
    prefill_started_at: float = 0.0
    prefill_done_at: float = 0.0
    forks: list[Job] = field(default_factory=list)  # the request's further choices: they share the prefill
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    prefill: ChunkedPrefill | None = None  # the prompt's prefill while it runs
    # the ended prefill whose prompt end awaits its snapshot: the state takes no decode step until then
    unsaved_end: ChunkedPrefill | None = None
    reading: Future[None] | None = None  # its prompt's snapshot read from disk, before its prefill
    leader: Job | None = None  # the request whose prefill computes this one's shared prefix
    shared_until: int = 0  # the prefix's end: this job's prefill starts once the leader passes it
    share_checked: bool = False  # looked for a leader among the running prefills while it was queued
    reuse_prompt: bool = True  # restore the prompt from the cache (llama-server's cache_prompt)
    # its client streams the prefill's progress (llama-server's return_progress): a `ProgressEvent` at
    # the start and after each pass; without, none, each of which would wake the event loop for nothing
    sends_progress: bool = False
    prompt_only: bool = False  # finish after the prefill with no token (llama-server's n_predict 0)
    wanted_slot: int = -1  # llama-server's `id_slot`: the slot the request asks for (-1: any)
    slot: int = -1  # the slot it runs under, given when it is admitted (`slots.SlotTable`)
    task_id: int = -1  # llama-server's `id_task`: numbers the server's sequences in order of arrival
    arrival: int = -1  # its place among the requests and slot actions the scheduler was given

    @property
    def width(self) -> int:
        """Batch slots the job takes once admitted: one per choice."""
        return 1 + len(self.forks)

    @property
    def active(self) -> bool:
        return not (self.cancelled or self.failed or self.logic.finish_reason is not None)

    def cancel(self) -> None:
        """Called from the HTTP side when the response ends; the scheduler frees the job at the next step."""
        if self.active:
            self.abandoned = True
        self.cancelled = True

    def fail(self, message: str, param: str | None = None) -> None:
        if self.active:
            self.failed = True
            self.sink.put(ErrorEvent(message, param))


def _lowest_free_slot(job: Job, held: set[int]) -> int:
    """The slot `job` asks for, else the lowest one no running sequence holds."""
    if job.wanted_slot >= 0:
        return job.wanted_slot
    return next(slot for slot in itertools.count() if slot not in held)


def _has_work(job: Job) -> bool:
    """Whether the loop has something to do for a running `job`: drop it, step its prefill or decode,
    or start its prefill once its snapshot is read (not while the read goes on, nor for a choice whose
    request's prefill has not ended)."""
    if not job.active:
        return True
    if job.reading is not None:
        return job.reading.done()
    if job.leader is not None:
        return _leader_passed(job)
    return job.prefill is not None or job.last_token >= 0


def _streaming(job: Job) -> bool:
    """Whether `job` streams tokens: a choice does once it has its first token, after its prompt's
    prefill (a fork: its request's)."""
    return job.active and job.prefill is None and job.last_token >= 0


def _decoding(job: Job) -> bool:
    """Whether `job` takes the next decode step: it streams, and its prompt's end is in the cache."""
    return _streaming(job) and job.unsaved_end is None


def _leader_passed(job: Job) -> bool:
    """Whether the prefill `job` waits for has passed its shared prefix (its snapshot is in the
    cache), ended, or will not go on (its request failed, finished or was cancelled)."""
    leader = job.leader
    return not leader.active or leader.prefill is None or leader.prefill.position >= job.shared_until


def _shared_end(tokens: list[int], leader_tokens: list[int]) -> int:
    """Where a snapshot of the leader's prompt that a prompt of `tokens` can restore ends: their common
    prefix, short of all of `tokens` unless the leader's prompt ends there too (a snapshot inside a
    prefill holds no logits, which a prompt restored whole needs)."""
    end = common_length(tokens, leader_tokens)
    return end - 1 if end == len(tokens) < len(leader_tokens) else end


def request_timings(jobs: list[Job]) -> dict[str, float]:
    """llama-server's `timings` of finished jobs, measured by the scheduler: each prompt's prefill
    counted once (a choice that is another's fork shares its prefill; `prompt_n` the tokens computed,
    `cache_n` those restored from the prompt cache, `prompt_ms` the prefills' times added up) and the
    decoding after them, from the end of the first prefill to the last token of any choice."""
    forks = {fork for job in jobs for fork in job.forks}
    prompts = [job for job in jobs if job not in forks]
    prompt_ms = sum(job.prefill_done_at - job.prefill_started_at for job in prompts) * 1000
    cache_n = sum(job.cached_tokens for job in prompts)
    prompt_n = sum(len(job.prompt_tokens) for job in prompts) - cache_n
    predicted_n = sum(job.logic.completion_tokens for job in jobs)
    decoded_from = min(job.prefill_done_at for job in prompts)
    predicted_ms = max(max(job.last_token_at for job in jobs) - decoded_from, 0.0) * 1000
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n / predicted_ms * 1000 if predicted_ms > 0 else 0.0,
    }


class Scheduler:
    """Owns the model; every model call happens on its thread."""

    def __init__(
        self,
        model: Any,
        metrics: ServerMetrics,
        *,
        max_batch: int,
        max_queue: int,
        on_tokens: Any = None,
        cache: PromptCache | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_pass: int | None = None,
        attention_rows: float | None = None,
        share_tokens: int = DEFAULT_SHARE_TOKENS,
        pass_rows: int | None = None,
        pick_slot: Callable[[Job, set[int]], int] | None = None,
        on_finish: Callable[[Job], None] | None = None,
    ) -> None:
        self.model = model
        # the slot an admitted job runs under, given the slots the running ones hold (default: the
        # slot it asks for, else the lowest free one)
        self.pick_slot = pick_slot or _lowest_free_slot
        self.on_finish = on_finish  # told of each finished job once its state is in the prompt cache
        self.cache = cache  # reused prompt states (`engine.prompt_cache`), or None
        # a waiting request whose prompt shares at least this many tokens past its deepest snapshot
        # with a running prefill waits for that prefill's snapshot, and a prefill is snapshotted where
        # its prompt branches off a cached one this many tokens past its start (0: neither; so without
        # a cache)
        sharing = cache is not None and cache.enabled and cache.snapshots_anywhere
        self.share_tokens = share_tokens if sharing else 0
        # where prompts are cut (`attention_rows`: `chunked_prefill.attention_rows_per_token`, or None for
        # chunks of `prefill_chunk` tokens)
        self.chunks = PrefillChunks(prefill_chunk, attention_rows)
        # the work one prefill pass may take from several requests' chunks, as `prefill_pass` tokens at a
        # prompt's start (default: one chunk's)
        pass_tokens = max(prefill_pass or prefill_chunk, prefill_chunk)
        self.pass_budget = self.chunks.budget * pass_tokens / prefill_chunk
        # where prompts are cut while no sequence decodes: passes of `pass_rows` rows (the memory plan's
        # for a pass, which no pass exceeds; default the pass's tokens), of equal work as `chunks`' are
        self.idle_chunks = PrefillChunks(max(pass_rows or pass_tokens, prefill_chunk), attention_rows)
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._on_tokens = on_tokens
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._ends: list[Job] = []  # jobs whose prompt ends await their snapshots (`_save_ends`)
        # slot -> the arrival of the slot action (`claim_slot`) that waits for the slot or holds it
        self._claims: dict[int, int] = {}
        self._acting: set[int] = set()  # the claimed slots whose actions act (`take_slot`)
        self._arrivals = itertools.count()  # numbers requests and slot actions as they come
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="k3stream-scheduler", daemon=True)
        # reads prompts' snapshots from disk (`PromptCache.read_ahead`) while the running ones step
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="k3stream-cache-reader")
        # what the scheduler saw, for /health: decode steps, those with more than one sequence, jobs
        # dropped because their client left, and the most requests ever waiting at once
        self.steps = 0
        self.batched_steps = 0
        self.batched_prefills = 0  # prefill passes over the chunks of several requests
        self.shared_prefills = 0  # requests that waited for another's prefill of their shared prefix
        self.cancelled_jobs = 0
        self.peak_waiting = 0
        # request outcomes, for /health: a run of UNHEALTHY_AFTER failures with no success between
        # makes the server unhealthy until a request succeeds again
        self.completed_jobs = 0
        self.failed_jobs = 0
        self.consecutive_failures = 0
        self.last_error: str | None = None

    def start(self) -> None:
        release_openmp_workers()  # the loading thread's: the scheduler's thread runs the kernels from here
        self._thread.start()

    def stop(self) -> None:
        """Stop after the step in progress and wait for the thread: the model is not used after this."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._reader.shutdown(wait=False, cancel_futures=True)

    def submit(self, job: Job) -> None:
        """Queue `job`; it may wait only while the queue is within `max_queue` plus the free batch slots."""
        with self._wake:
            if len(self._waiting) >= self._waiting_room():
                self._waiting = collections.deque(self._keep_active(self._waiting))
            if len(self._waiting) >= self._waiting_room():
                raise QueueFull(f"the request queue is full ({len(self._waiting)} waiting); retry later")
            job.arrival = next(self._arrivals)
            self._waiting.append(job)
            self.peak_waiting = max(self.peak_waiting, len(self._waiting))
            self._update_gauges()
            self._wake.notify()

    def _waiting_room(self) -> int:
        """Requests that may wait: the queue bound plus the batch slots the next step can fill."""
        return self.max_queue + max(0, self.max_batch - len(self._running))

    def claim_slot(self, slot: int) -> None:
        """Queue a slot action (llama-server's save, restore or erase) on `slot`, one at a time per slot:
        until `release_slot`, the requests that ask for the slot after it wait, and requests for any slot
        take others. It acts once `take_slot` says so; until then it counts as deferred (`/metrics`)."""
        with self._wake:
            self._claims[slot] = next(self._arrivals)
            self._update_gauges()

    def take_slot(self, slot: int) -> bool:
        """Whether the action claiming `slot` may act now, as llama-server runs a slot task it deferred: no
        sequence is under the slot (the last one's finished state is in the prompt cache and given to
        `on_finish`: a job leaves the running ones after `_finish`) and no request that came before the
        action waits for it. Once it may, it acts until `release_slot`."""
        with self._wake:
            claim = self._claims[slot]
            busy = any(job.slot == slot for job in self._running) or any(
                job.active and job.wanted_slot == slot and job.arrival < claim for job in self._waiting
            )
            if not busy:
                self._acting.add(slot)
                self._update_gauges()
            return not busy

    def release_slot(self, slot: int) -> None:
        """End the slot action on `slot`: the requests it kept waiting may run."""
        with self._wake:
            self._claims.pop(slot, None)
            self._acting.discard(slot)
            self._update_gauges()
            self._wake.notify()

    def wake(self) -> None:
        """Make the loop look at its jobs now (after a cancellation)."""
        with self._wake:
            self._wake.notify()

    def active_jobs(self) -> list[Job]:
        """The running jobs, then the waiting ones, as they stand (for /slots)."""
        with self._wake:
            jobs = list(self._running) + list(self._waiting)
        return [job for job in jobs if job.active]

    def snapshot(self) -> dict[str, int]:
        with self._wake:
            waiting, running = len(self._waiting), len(self._running)
        return {
            "waiting": waiting,
            "running": running,
            "active_sequences": waiting + running,
            "steps": self.steps,
            "batched_steps": self.batched_steps,
            "batched_prefills": self.batched_prefills,
            "shared_prefills": self.shared_prefills,
            "cancelled_jobs": self.cancelled_jobs,
            "peak_waiting": self.peak_waiting,
            "completed_jobs": self.completed_jobs,
            "failed_jobs": self.failed_jobs,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }

    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self._drop_finished()
                saved = self._save_ends()
                restored = self._admit_waiting()
                if not ((saved or restored) and any(map(_streaming, self._running))):
                    self._prefill_step()  # beside streams, the states copied are this step's prompt work
                if self._running:
                    self._decode_step()
            except Exception:  # a bug here must not stop the server: fail what runs, go on
                log.exception("scheduler step failed")
                self._fail(list(self._running), "internal error in the batch scheduler")
        self._save_ends()  # prompts whose first tokens went out: a restarted server resumes them
        with self._wake:
            jobs = list(self._running) + list(self._waiting)
        self._fail(jobs, "the server is shutting down", counted=False)

    def _wait_for_work(self) -> bool:
        with self._wake:
            while not (
                self._stopping
                or self._ends
                or any(not job.active for job in self._waiting)
                or self._admissible() is not None
                or any(map(_has_work, self._running))
            ):
                self._wake.wait()
            return not self._stopping

    def _drop_finished(self) -> None:
        """Free the sequences that finished, failed or whose client left, between steps."""
        with self._wake:
            self._running = self._keep_active(self._running)
            self._waiting = collections.deque(self._keep_active(self._waiting))
            self._update_gauges()

    def _keep_active(self, jobs: Any) -> list[Job]:
        """The active jobs of `jobs`, counting the abandoned ones left behind (call with the lock held)."""
        self.cancelled_jobs += sum(job.abandoned for job in jobs if not job.active)
        return [job for job in jobs if job.active]

    def _next_waiting(self) -> Job | None:
        """The next waiting job that fits the batch, moved to the running ones before its prefill
        (/health counts it) with its slots given. A job asking for a slot a running sequence holds, or
        that a slot action which came before it claims, stays queued until that one ends, and those
        behind it go first, as llama-server defers a task for a busy slot; the first other one that does
        not fit the batch keeps its place ahead of the rest."""
        with self._wake:
            self._waiting = collections.deque(self._keep_active(self._waiting))
            job = self._admissible()
            if job is not None:
                self._waiting.remove(job)
                held = self._held_slots() | self._claims.keys()  # the job's own slot is given it anyway
                for choice in (job, *job.forks):
                    choice.slot = self.pick_slot(choice, held)
                    held.add(choice.slot)
                self._running += [job, *self._keep_active(job.forks)]
            self._update_gauges()
            return job

    def _held_slots(self) -> set[int]:
        return {job.slot for job in self._running if job.active}

    def _admissible(self) -> Job | None:
        """The first waiting job whose slot is free, where it fits the batch (call with the lock held).
        The loop sleeps while there is none, rather than spinning while a busy slot's holder waits
        for a snapshot read."""
        held = self._held_slots()
        job = next((job for job in self._waiting if job.active and not self._slot_taken(job, held)), None)
        if job is None:
            return None
        running = {other.slot for other in self._running}
        claimed = self._claims.keys() - running - {job.wanted_slot}  # slots no other choice may take
        return job if len(self._running) + len(claimed) + job.width <= self.max_batch else None

    def _slot_taken(self, job: Job, held: set[int]) -> bool:
        """Whether the slot `job` asks for is held by a running sequence or claimed by a slot action
        that came before it (call with the lock held)."""
        claim = self._claims.get(job.wanted_slot)
        return job.wanted_slot in held or (claim is not None and claim < job.arrival)

    def _admit_waiting(self) -> bool:
        """Start the prefills of waiting requests while the batch has room (their states restored from
        the prompt cache as far as it holds them); a snapshot only a file holds is read first on the
        reader's thread (the running sequences step meanwhile), and its request starts once it is in.
        Whether a start restored a state (its copy is prompt work, as a pass is)."""
        restored = False
        for job in [job for job in self._running if job.reading is not None and job.reading.done()]:
            job.reading = None
            restored |= self._start_prefill(job)
        for job in [job for job in self._running if job.leader is not None and _leader_passed(job)]:
            job.leader = None  # it waits once: a leader that fails or leaves lets it compute alone
            restored |= self._start_prefill(job)
        while (job := self._next_waiting()) is not None:
            self._progress(job, 0)
            if self.cache is not None and job.reuse_prompt and self.cache.needs_read(job.prompt_tokens):
                job.reading = self._reader.submit(self._read_ahead, job.prompt_tokens)
                job.reading.add_done_callback(lambda _: self.wake())
            elif not self._wait_for_leader(job):
                restored |= self._start_prefill(job)
        self._mark_for_queued()
        return restored

    def _wait_for_leader(self, job: Job) -> bool:
        """Make `job` wait for the running prefill that computes most of its prompt's uncached prefix,
        where that is at least `share_tokens`: the leader snapshots where the shared part ends. Whether
        `job` waits."""
        found = self._leader_for(job)
        if found is None:
            return False
        job.leader, job.shared_until = found
        self.shared_prefills += 1
        self.metrics.shared_prefills.inc()
        return True

    def _mark_for_queued(self, leader: Job | None = None) -> None:
        """The queued requests' shared prefixes marked in the running prefills that compute them, so
        their snapshots exist when those requests get a batch slot: a request that arrived since the
        last look against every running prefill, or every queued one against `leader`, a prefill that
        starts (each pair once)."""
        with self._wake:
            queued = [job for job in self._waiting if job.share_checked == (leader is not None)]
        for job in queued:
            job.share_checked = True
            self._leader_for(job, None if leader is None else [leader])

    def _leader_for(self, job: Job, candidates: list[Job] | None = None) -> tuple[Job, int] | None:
        """The running prefill (of `candidates`, default all) sharing the longest prefix with `job`'s
        prompt that it has not passed, and where that prefix ends, marked to be snapshotted there; None
        where no prefill shares `share_tokens` beyond what the cache holds of `job`'s prompt."""
        if not self.share_tokens or not job.reuse_prompt:
            return None
        tokens, best, best_end = job.prompt_tokens, None, self.share_tokens - 1
        for other in self._running if candidates is None else candidates:
            if other is job or not other.active or other.prefill is None:
                continue
            end = _shared_end(tokens, other.prompt_tokens)
            if end > best_end and other.prefill.position < end:
                best, best_end = other, end
        # the cache's lookup only where a prefill shares enough: it walks the prompt's ids
        if best is None or best_end - self.cache.cached_length(tokens) < self.share_tokens:
            return None
        if best_end < len(best.prompt_tokens):  # the prompt's end is snapshotted anyway
            best.prefill.want_snapshot(best_end)
        return best, best_end

    def _read_ahead(self, tokens: list[int]) -> None:
        try:
            self.cache.read_ahead(tokens)
        except Exception:  # the restore reads it again, or computes the prompt
            log.exception("prompt cache: reading a snapshot failed")

    def _start_prefill(self, job: Job) -> bool:
        """`job`'s prefill, restored from the prompt cache as far as it holds the prompt; whether it
        restored a state."""
        if not job.active:
            return False
        try:
            job.prefill = ChunkedPrefill(self.model, job.prompt_tokens, self.cache, job.reuse_prompt)
        except Exception as exc:  # one bad request must not stop the server
            log.exception("prefill failed")
            self._fail_request(job, f"prefill failed: {exc}")
            return False
        job.state, job.cached_tokens = job.prefill.state, job.prefill.reused
        if job.prefill.done:  # the whole prompt was cached
            self._end_prefill(job)
        elif self.share_tokens:
            self._mark_branch(job)
            self._mark_for_queued(job)
        return job.cached_tokens > 0

    def _mark_branch(self, job: Job) -> None:
        """Snapshot `job`'s prefill where its prompt branches off a prompt the cache has seen or one whose
        prefill runs (and has passed that point: `job` came too late to wait for it, and the state there
        is gone), where the shared part beyond what it restored is at least `share_tokens`: the next
        request that shares it (a system prompt sent before, then by two clients) restores it."""
        prefill, tokens = job.prefill, job.prompt_tokens
        others = [other for other in self._running if other is not job and other.prefill is not None]
        shared = [common_length(tokens, other.prompt_tokens) for other in others if other.active]
        branch = max([self.cache.branch_length(tokens), *shared])
        if prefill.position + self.share_tokens <= branch < len(tokens):
            prefill.want_snapshot(branch)

    def _prefill_step(self) -> None:
        """The next chunks of the running prefills, oldest first, in one pass (`_prefill_batch`)."""
        jobs, chunks = self._prefill_batch()
        if not jobs:
            return
        before = [job.prefill.position for job in jobs]
        started = time.perf_counter()
        try:
            step_together([job.prefill for job in jobs], chunks)
        except Exception as exc:  # the requests of a pass that failed fail; the server goes on
            log.exception("prefill failed")
            self._fail(jobs, f"prefill failed: {exc}")
            return
        self.batched_prefills += len(jobs) > 1
        computed = sum(job.prefill.position - start for job, start in zip(jobs, before, strict=True))
        self._count_tokens(computed)
        self.metrics.add_prompt_tokens(computed, time.perf_counter() - started)
        for job in jobs:
            if job.prefill.done:
                self._end_prefill(job)
            else:
                self._progress(job, job.prefill.position)

    def _prefill_batch(self) -> tuple[list[Job], PrefillChunks]:
        """The prefilling jobs of the next pass and where it cuts their prompts: the oldest, then the
        next ones while their chunks' work together stays within the pass's budget and their rows
        within the memory plan's (one only for a model with no batched prefill). Beside a decoding
        sequence, `chunks` within `pass_budget`: the stream waits about one chunk. With none decoding no
        one waits on the pass, and it takes `idle_chunks` (requests that wait for a snapshot or a disk read
        start after it either way), but for a new prompt's first pass where requests may share its
        prefix (`_in_chunks`)."""
        waiting = [job for job in self._running if job.active and job.prefill is not None]
        if not waiting:
            return [], self.chunks
        if self._in_chunks(waiting[0]):
            chunks, budget = self.chunks, self.pass_budget
        else:
            chunks, budget = self.idle_chunks, self.idle_chunks.budget
        batch, work, rows = [], 0.0, 0
        for job in waiting:
            start, end = job.prefill.position, job.prefill.next_end(chunks)
            cost = chunks.cost(start, end)
            over = work + cost > budget or rows + end - start > self.idle_chunks.tokens
            if batch and (over or not hasattr(self.model, "prefill_batch")):
                break
            batch.append(job)
            work, rows = work + cost, rows + end - start
        return batch, chunks

    def _in_chunks(self, oldest: Job) -> bool:
        """Whether the next pass is cut in chunks: a sequence decodes beside it, or the oldest prefill
        starts a prompt no snapshot held (nothing restored) where requests may share its prefix:
        clients that send one system prompt together arrive during that first chunk, find the prefill
        short of the shared part and wait for its snapshot, where one pass over the whole prompt would
        have passed it before they came."""
        fresh = self.share_tokens > 0 and oldest.prefill.position == 0
        return fresh or any(map(_streaming, self._running))

    def _end_prefill(self, job: Job) -> None:
        """The prompt is in `job`'s state: its choices start from its last logits. The prompt's end goes
        into the prompt cache at the next step, once their first tokens are sent (`_save_ends`)."""
        prefill, job.prefill = job.prefill, None
        self._progress(job, len(job.prompt_tokens))
        for choice, choice_logits in self._share_prefill(job, prefill.logits):
            if choice.prompt_only:
                choice.logic.end()
                choice.last_token_at = time.perf_counter()
                self._finish(choice)
            else:
                self._emit_token(choice, choice_logits)
        if prefill.end_unsaved:
            job.unsaved_end = prefill
            self._ends.append(job)

    def _save_ends(self) -> bool:
        """Snapshot the prompt ends of the prefills that ended at the last step, before their states
        take a decode step (a copy of the state, as long as a pass beside the running streams where the
        state is large, so it is a step's prompt work of its own); whether there were any."""
        ends, self._ends = self._ends, []
        for job in ends:
            prefill, job.unsaved_end = job.unsaved_end, None
            try:
                prefill.keep_end()
            except Exception:  # a cache that cannot keep a state costs the next turn time, nothing else
                log.exception("prompt cache: saving a prompt's state failed")
        return bool(ends)

    def _progress(self, job: Job, processed: int) -> None:
        """Record how many prompt tokens of `job` are prefilled, and send it where its client asked."""
        now = time.perf_counter()
        if processed == 0:
            job.prefill_started_at = now
        if processed == len(job.prompt_tokens):
            job.prefill_done_at = now
        job.prompt_done = processed
        if job.sends_progress:
            elapsed_ms = (now - job.prefill_started_at) * 1000
            job.sink.put(ProgressEvent(len(job.prompt_tokens), processed, elapsed_ms, job.cached_tokens))

    def _share_prefill(self, job: Job, logits: Any) -> list[tuple[Job, Any]]:
        """`job` and its forks with their first logits: each fork starts from a copy of `job`'s state
        where the model can copy one (`fork_state`), else from a prefill of its own."""
        fork_state = getattr(type(self.model), "fork_state", None)
        shared = [(job, logits)]
        for fork in job.forks:
            fork.cached_tokens = job.cached_tokens  # the prefill's figures are the fork's too
            fork.prefill_started_at, fork.prefill_done_at = job.prefill_started_at, job.prefill_done_at
            fork.prompt_done = job.prompt_done
            try:
                if fork_state is not None:
                    fork.state = fork_state(self.model, job.state)
                    shared.append((fork, logits))
                    continue
                fork.state = self.model.new_state()
                shared.append((fork, prefill_last(self.model, fork.state, fork.prompt_tokens)))
                self._count_tokens(len(fork.prompt_tokens))
            except Exception as exc:
                log.exception("prefill failed")
                self._fail_request(fork, f"prefill failed: {exc}")
        return shared

    def _decode_step(self) -> None:
        batch = [job for job in self._running if _decoding(job)]
        if not batch:
            return
        self.metrics.batch_size.observe(len(batch))
        started = time.perf_counter()
        try:
            logits = self.model.decode_batch([job.state for job in batch], [job.last_token for job in batch])
        except Exception as exc:  # fail this batch's requests, keep serving
            log.exception("decode step failed")
            self._fail(batch, f"decode failed: {exc}")
            return
        self._count_tokens(len(batch))
        self.metrics.add_decode_step(len(batch), time.perf_counter() - started)
        self.steps += 1
        self.batched_steps += len(batch) > 1
        for row, job in enumerate(batch):
            if not job.cancelled:
                self._emit_token(job, logits[row])

    def _emit_token(self, job: Job, logits: Any) -> None:
        """Sample a token for `job`, send its text, and finish the job if it stopped."""
        try:
            token = job.logic.choose(logits)
            piece = job.logic.accept(token)
        except RequestError as exc:
            job.fail(str(exc), exc.param)
            return
        except Exception as exc:
            log.exception("sampling failed")
            self._fail_request(job, f"sampling failed: {exc}")
            return
        now = time.perf_counter()
        if job.logic.completion_tokens == 1:
            self.metrics.time_to_first_token.observe(now - job.submitted_at)
        else:
            self.metrics.time_per_output_token.observe(now - job.last_token_at)
        job.last_token, job.last_token_at = token, now
        job.generated.append(token)
        self.metrics.add_generated_token()
        if piece:
            job.sink.put(PieceEvent(piece))
        if job.logic.finish_reason is not None:
            self._finish(job)

    def _finish(self, job: Job) -> None:
        """Send the finished `job`'s last event and keep its state in the prompt cache."""
        self.completed_jobs += 1
        self.consecutive_failures = 0
        finish = FinishEvent(
            job.logic.finish_reason,
            len(job.prompt_tokens),
            job.logic.completion_tokens,
            job.cached_tokens,
        )
        job.sink.put(finish)
        self._save_response(job)
        if self.on_finish is not None:
            self.on_finish(job)

    def _save_response(self, job: Job) -> None:
        """The finished job's state into the prompt cache, after its last event is sent: its prompt and
        every generated token but the last (never fed to the model; after one token that is the prompt's
        end, which `_end_prefill` keeps with its logits). The state goes no further, so the snapshot takes
        its tensors (no copy)."""
        if self.cache is None or len(job.generated) < 2:
            return
        try:
            self.cache.save(job.prompt_tokens + job.generated[:-1], job.state, final=True)
        except Exception:  # a cache that cannot keep a state costs the next turn time, nothing else
            log.exception("prompt cache: saving a response's state failed")

    def _count_tokens(self, n: int) -> None:
        if self._on_tokens is not None:
            self._on_tokens(n)

    def _fail_request(self, job: Job, message: str) -> None:
        """Fail one request because serving it went wrong (counted for /health)."""
        if job.active:
            self.failed_jobs += 1
            self.consecutive_failures += 1
            self.last_error = message
        job.fail(message)

    def _fail(self, jobs: list[Job], message: str, counted: bool = True) -> None:
        for job in jobs:
            if counted:
                self._fail_request(job, message)
            else:
                job.fail(message)
        self._drop_finished()

    def _update_gauges(self) -> None:
        self.metrics.set_waiting(len(self._waiting), len(self._claims.keys() - self._acting))
        self.metrics.set_running(len(self._running))
