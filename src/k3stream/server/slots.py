"""llama-server's slots as k3stream keeps them: each of the batch's places, and the conversation record
of the last request that ran there.

A running sequence holds one slot: the one its request names (`id_slot`; the scheduler defers the
request while another sequence holds it, as llama-server defers a task for a busy slot), else one no
running sequence holds (`SlotTable.assign`). What a slot keeps is the token ids of the last request that
ran under it (its prompt and every generated token but the last: the state the prompt cache snapshots at
a response's end). `POST /slots/{id}?action=save` writes the deepest prompt-cache snapshot of those
tokens to a file under `--slot-save-path` (a slot that ran nothing: the state of no tokens, as
llama-server writes it), `restore` puts a file's state back into the prompt cache
(where the next request whose prompt starts with its tokens reuses it) and makes it the slot's,
`erase` forgets the slot's tokens (the prompt cache keeps its snapshots: other conversations may share
them). An action on a slot a request runs under waits until that request has finished (and the requests
that asked for the slot before the action came), as llama-server defers a slot task, so a save holds the
finished state; its client leaving ends the wait, with nothing done. `GET /slots` lists every slot by
that id: the running sequence under it, else the figures of the last request that finished under it; with
llama-server's `LLAMA_SERVER_SLOTS_DEBUG` set to a non-zero number in the server's environment, also that
request's prompt and generated text. Errors are llama-server's (`errors.LlamaError`).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from k3stream.server.bodies import parse_body
from k3stream.server.endpoints_llama import llama_params
from k3stream.server.errors import LLAMA_ERROR_TYPES, APIError, LlamaError, not_supported
from k3stream.server.runtime import ServedModel
from k3stream.server.scheduler import Job, Scheduler
from k3stream.server.streaming import CLIENT_CLOSED_REQUEST, watch_disconnect

if TYPE_CHECKING:
    from k3stream.server.app import ServerConfig

# characters llama.cpp's fs_validate_filename refuses besides control characters
FORBIDDEN = re.compile(r'[/\\:*?"<>|\x00-\x1f\x7f]')
MAX_FILENAME_BYTES = 255
# how often a slot action waiting for its slot looks again (a poll of the scheduler's running jobs)
SLOT_POLL_S = 0.01


class SlotTable:
    """`count` slots, each the token ids of the last request that finished under it and llama-server's
    figures of that request (thread-safe)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._tokens: list[list[int]] = [[] for _ in range(count)]
        self._tasks: list[dict[str, Any] | None] = [None] * count
        self._texts: list[tuple[list[int], str] | None] = [None] * count  # its prompt ids, generated text
        self._used = [0.0] * count
        self._lock = threading.Lock()

    def assign(self, job: Job, held: set[int]) -> int:
        """The slot an admitted `job` runs under (`Scheduler`'s `pick_slot`): the one it asks for (no
        running sequence holds it: the scheduler defers it until then); for -1 a slot none in `held`
        holds, the one whose tokens share the longest prefix with its prompt, else the least recently
        used one, as llama-server picks."""
        with self._lock:
            best = job.wanted_slot if job.wanted_slot >= 0 else self._best(job.prompt_tokens, held)
            self._used[best] = time.monotonic()
            return best

    def _best(self, prompt: list[int], taken: set[int]) -> int:
        free = [slot for slot in range(self.count) if slot not in taken]
        shared = {slot: _common_prefix(self._tokens[slot], prompt) for slot in free}
        best = max(free, key=lambda slot: (shared[slot], -self._used[slot]))
        return best if shared[best] else min(free, key=lambda slot: self._used[slot])

    def finished(self, job: Job) -> None:
        """Record a finished request's tokens and figures under its slot (`Scheduler`'s `on_finish`, on
        its thread once the request's state is in the prompt cache: a slot's requests finish in order)."""
        if 0 <= job.slot < self.count:
            task = task_fields(job)
            with self._lock:
                self._tokens[job.slot] = job.prompt_tokens + job.generated[:-1]
                self._tasks[job.slot] = task
                self._texts[job.slot] = (job.prompt_tokens, job.logic.sequence.text)
                self._used[job.slot] = time.monotonic()

    def tokens(self, slot: int) -> list[int]:
        with self._lock:
            return list(self._tokens[slot])

    def last_task(self, slot: int) -> dict[str, Any] | None:
        """llama-server's figures of the last request that finished under `slot` (None: none did)."""
        with self._lock:
            return self._tasks[slot]

    def last_texts(self, slot: int) -> tuple[list[int], str] | None:
        """The prompt ids and generated text of the last request that finished under `slot`."""
        with self._lock:
            return self._texts[slot]

    def put(self, slot: int, tokens: list[int]) -> int:
        """Make `tokens` the slot's; the number of tokens it held before."""
        with self._lock:
            before, self._tokens[slot] = len(self._tokens[slot]), list(tokens)
            self._used[slot] = time.monotonic()
            return before


def task_fields(job: Job) -> dict[str, Any]:
    """llama-server's `/slots` figures of the request `job` runs (or ran): its task id, prompt, sampling
    settings and `next_token`."""
    params, decoded = job.logic.params, job.logic.completion_tokens
    next_token = {
        "has_next_token": job.active,
        "has_new_line": "\n" in job.logic.sequence.text,
        "n_remain": params.max_tokens - decoded,
        "n_decoded": decoded,
    }
    return {
        "id_task": job.task_id,
        "n_prompt_tokens": len(job.prompt_tokens),
        "n_prompt_tokens_processed": max(job.prompt_done - job.cached_tokens, 0),
        "n_prompt_tokens_cache": job.cached_tokens,
        "params": llama_params(params),
        "next_token": [next_token],
    }


def slots_debug() -> bool:
    """llama-server's switch for the slots' texts: `LLAMA_SERVER_SLOTS_DEBUG` read as C's atoi reads it
    (leading digits, else 0), on where it is not 0."""
    number = re.match(r"\s*[+-]?\d+", os.environ.get("LLAMA_SERVER_SLOTS_DEBUG", ""))
    return number is not None and int(number.group()) != 0


class SlotList:
    """`GET /slots`: every slot, as llama-server lists its slots: `is_processing` while a running
    sequence is under it (its figures), else the figures of the last request that ran under it; with
    `texts` (`slots_debug`), that request's `prompt` (its ids as text, special tokens written out) and
    `generated` text too."""

    def __init__(
        self, table: SlotTable, scheduler: Scheduler, n_ctx: int, tokenizer: Any, texts: bool
    ) -> None:
        self.table = table
        self.scheduler = scheduler
        self.n_ctx = n_ctx
        self.tokenizer = tokenizer
        self.texts = texts

    async def list(self, request: Request) -> list[dict[str, Any]]:
        """The slots; with `?fail_on_no_slot` (any value), llama-server's 503 while every slot runs."""
        admitted = [job for job in self.scheduler.active_jobs() if job.state is not None]
        running: dict[int, Job] = {}
        for job in admitted:  # queued requests hold no slot yet
            running.setdefault(job.slot, job)
        if request.query_params.get("fail_on_no_slot") and len(running) >= self.table.count:
            raise LlamaError(503, "no slot available", type=LLAMA_ERROR_TYPES[503])
        slots = [self._slot(slot, running.get(slot)) for slot in range(self.table.count)]
        if self.texts:  # a long prompt's text is made off the event loop
            await asyncio.to_thread(self._add_texts, slots, running)
        return slots

    def _add_texts(self, slots: list[dict[str, Any]], running: dict[int, Job]) -> None:
        for entry in slots:
            job = running.get(entry["id"])
            texts = (
                (job.prompt_tokens, job.logic.sequence.text) if job else self.table.last_texts(entry["id"])
            )
            if texts is not None:
                entry["prompt"], entry["generated"] = self.tokenizer.decode(texts[0]), texts[1]

    def _slot(self, slot: int, job: Job | None) -> dict[str, Any]:
        base = {"id": slot, "n_ctx": self.n_ctx, "speculative": False, "is_processing": job is not None}
        task = task_fields(job) if job is not None else self.table.last_task(slot)
        return {**base, **(task or {})}


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix: a binary search over slice comparisons (C loops, so a
    long conversation's ids take well under a millisecond on the event loop)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def check_filename(name: str) -> None:
    """llama-server's 400 `Invalid filename` for a name that is no plain file name: empty, too long, with
    a path separator, a reserved or control character, `.` or `..`, or leading or trailing spaces."""
    bad = (
        not name
        or len(name.encode()) > MAX_FILENAME_BYTES
        or FORBIDDEN.search(name) is not None
        or name in (".", "..")
        or name != name.strip()
        or name.endswith(".")
    )
    if bad:
        raise LlamaError(400, "Invalid filename")


class SlotFile(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    filename: str = ""


class SlotActions:
    def __init__(
        self, table: SlotTable, scheduler: Scheduler, served: ServedModel, directory: Path | None
    ) -> None:
        self.table = table
        self.scheduler = scheduler
        self.cache = served.prompt_cache
        self.runs = served.generated_runs  # a restored conversation's answers, in the ids the model wrote
        self.directory = directory
        self._turns = [asyncio.Lock() for _ in range(table.count)]  # one action at a time per slot

    async def act(self, request: Request, id_slot: str) -> Response:
        try:
            return await self._act(request, id_slot)
        except LlamaError:
            raise
        except APIError as error:
            raise LlamaError.of(error) from None

    async def _act(self, request: Request, id_slot: str) -> Response:
        slot, action, path = await self._checked(request, id_slot)
        async with self._turns[slot]:
            self.scheduler.claim_slot(slot)
            try:
                if not await self._slot_freed(request, slot):
                    return Response(status_code=CLIENT_CLOSED_REQUEST)
                return JSONResponse(await self._run(action, slot, path))
            finally:
                self.scheduler.release_slot(slot)

    async def _slot_freed(self, request: Request, slot: int) -> bool:
        """Wait until the claimed `slot` is the action's (`Scheduler.take_slot`); False if the client left
        first. The wait ends: the request running under the slot ends within its token limit."""
        watcher = asyncio.create_task(watch_disconnect(request))
        try:
            while not self.scheduler.take_slot(slot):
                if watcher.done():
                    return False
                await asyncio.sleep(SLOT_POLL_S)
            return True
        finally:
            watcher.cancel()

    async def _run(self, action: str, slot: int, path: Path | None) -> dict[str, Any]:
        if action == "erase":
            return {"id_slot": slot, "n_erased": self.table.put(slot, [])}
        if action == "save":
            return await asyncio.to_thread(self._save, slot, path)
        return await asyncio.to_thread(self._restore, slot, path)

    async def _checked(self, request: Request, id_slot: str) -> tuple[int, str, Path | None]:
        """The slot, the action and its file (none for `erase`) a request names; llama-server's errors
        where one is wrong."""
        if self.directory is None:
            raise not_supported("This server does not support slots action. Start it with `--slot-save-path`")
        slot = int(id_slot) if id_slot.isascii() and id_slot.isdigit() else -1
        if not 0 <= slot < self.table.count:
            raise LlamaError(400, "Invalid slot ID")
        action = request.query_params.get("action", "")
        if action == "erase":
            return slot, action, None
        if action not in ("save", "restore"):
            raise LlamaError(400, "Invalid action")
        if self.cache is None or not self.cache.enabled:
            raise not_supported("This server keeps no slot states: the prompt cache is off (--cache-ram 0)")
        if self.cache.peers is not None:  # a file would hold rank 0's share alone: never restorable
            raise not_supported(
                "This server keeps no slot files: under torchrun every rank holds its own share of a slot's "
                "state (its prompt cache with --cache-dir keeps them)"
            )
        body = await parse_body(request, SlotFile)
        check_filename(body.filename)
        return slot, action, self.directory / body.filename

    def _save(self, slot: int, path: Path) -> dict[str, Any]:
        started, filename = time.perf_counter(), path.name
        tokens = self.table.tokens(slot)
        try:
            saved, written = self.cache.export(tokens, path)
        except IsADirectoryError:  # the request's name, not the server, is at fault
            raise LlamaError(400, f"Unable to save slot: {filename} is a folder") from None
        except OSError as error:
            raise LlamaError(500, f"cannot write {filename}: {error.strerror}", type="server_error") from None
        if not written:
            raise LlamaError(
                400, f"slot {slot} holds no state to save: the prompt cache keeps none of its tokens"
            )
        timings = {"save_ms": (time.perf_counter() - started) * 1000}
        return {
            "id_slot": slot,
            "filename": filename,
            "n_saved": saved,
            "n_written": written,
            "timings": timings,
        }

    def _restore(self, slot: int, path: Path) -> dict[str, Any]:
        started, filename = time.perf_counter(), path.name
        try:
            tokens, read = self.cache.import_file(path)
        except (OSError, ValueError) as error:
            reason = "no such file" if isinstance(error, FileNotFoundError) else str(error)
            message = (
                f"Unable to restore slot: No available space in KV cache or invalid slot save file ({reason})"
            )
            raise LlamaError(400, message) from None
        self.table.put(slot, tokens)
        self.runs.recall([tokens])
        timings = {"restore_ms": (time.perf_counter() - started) * 1000}
        return {
            "id_slot": slot,
            "filename": filename,
            "n_restored": len(tokens),
            "n_read": read,
            "timings": timings,
        }


SLOTS_OFF_MESSAGE = "This server does not support slots endpoint. Start it with `--slots`"


def slots_router(
    table: SlotTable, scheduler: Scheduler, served: ServedModel, config: ServerConfig
) -> APIRouter:
    router = APIRouter()
    if config.slots_endpoint:
        router.get("/slots")(SlotList(table, scheduler, served.ctx, served.tokenizer, slots_debug()).list)
    else:
        router.get("/slots")(_slots_off)
    actions = SlotActions(table, scheduler, served, config.slot_save_path)
    router.post("/slots/{id_slot}")(actions.act)
    return router


async def _slots_off() -> None:
    """llama-server's answer under `--no-slots`."""
    raise not_supported(SLOTS_OFF_MESSAGE)
