"""One request's answer sent to its client: its choices' scheduler events as a server-sent event stream
or as one JSON body, in the shapes of the request's endpoint (`openai_chunks`, `messages`, `responses`,
`native`); a client that leaves cancels its jobs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3stream.server.errors import APIError, invalid_request
from k3stream.server.kimi_output import Piece
from k3stream.server.scheduler import (
    ErrorEvent,
    Event,
    FinishEvent,
    Job,
    PieceEvent,
    ProgressEvent,
    Scheduler,
    request_timings,
)

# the status of a request whose client left before its answer (nginx's "client closed request"): never
# sent, but counted by /metrics apart from the server's failures
CLIENT_CLOSED_REQUEST = 499


class Stream:
    """One request's events (of each of its choices), as a server-sent event stream or as one JSON body."""

    def __init__(
        self,
        jobs: list[Job],
        scheduler: Scheduler,
        chunks: Sequence[Any],
        keepalive_s: float | None = 15.0,  # None: no keep-alive comments
        progress: bool = False,
        running_usage: bool = False,
    ) -> None:
        self.jobs = jobs
        self.queue = jobs[0].sink.queue  # the choices share it
        self.scheduler = scheduler
        # the response's shapes, one per job (`openai_chunks.Chunks`, `native.NativeResult`)
        self.chunks = chunks
        self.keepalive_s = keepalive_s
        self.progress = progress  # send the prefill's progress events (llama-server's return_progress)
        # each JSON chunk carries its choice's usage so far (vLLM's continuous_usage_stats): the tokens
        # its pieces sent, counted here as they go out
        self.running_usage = running_usage
        self._sent_tokens = [0] * len(jobs)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()
        self.scheduler.wake()

    async def respond(self, request: Request, stream: bool, include_usage: bool) -> Response:
        if stream:
            return StreamingResponse(
                self._sse(include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request)

    async def _sse(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            for choice, chunks in enumerate(self.chunks):
                if (first := chunks.first()) is not None:
                    yield _framed(self._with_usage(choice, first))
            finished: dict[int, FinishEvent] = {}
            while len(finished) < len(self.jobs):
                try:
                    choice, event = await asyncio.wait_for(self.queue.get(), self.keepalive_s)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if isinstance(event, ProgressEvent):
                    if self.progress:
                        yield _framed(self.chunks[choice].progress(event))
                elif isinstance(event, PieceEvent):
                    self._sent_tokens[choice] += len(event.piece.tokens)
                    yield _framed(self._with_usage(choice, self.chunks[choice].piece(event.piece)))
                elif isinstance(event, FinishEvent):
                    self._sent_tokens[choice] = event.completion_tokens
                    yield _framed(self._with_usage(choice, self.chunks[choice].last(event.reason)))
                    finished[choice] = event
                else:
                    yield self.chunks[0].error(_event_error(event)).sse()
                    break
            else:
                if include_usage:
                    usage_chunk = self.chunks[0].usage_only(_usage(self.jobs, finished))
                    yield _sse_data({**usage_chunk, "timings": request_timings(self.jobs)})
            yield self.chunks[0].done_line
        finally:
            self.cancel()  # a no-op for a finished job; frees the sequences of a client that left

    async def _whole(self, request: Request) -> Response:
        answers: list[list[Piece]] = [[] for _ in self.jobs]  # each choice's pieces, in order
        finished: dict[int, FinishEvent] = {}
        watcher = asyncio.create_task(watch_disconnect(request))
        try:
            while len(finished) < len(self.jobs):
                got = await self._next_event(watcher)
                if got is None:  # the client left
                    return Response(status_code=CLIENT_CLOSED_REQUEST)
                choice, event = got
                if isinstance(event, ProgressEvent):
                    continue
                if isinstance(event, PieceEvent):
                    answers[choice].append(event.piece)
                elif isinstance(event, FinishEvent):
                    finished[choice] = event
                else:
                    return self.chunks[0].error(_event_error(event)).response()
            choices = [
                c.whole_choice(p, finished[c.index].reason) for c, p in zip(self.chunks, answers, strict=True)
            ]
            usage = _usage(self.jobs, finished)
            return JSONResponse(self.chunks[0].whole(choices, usage, request_timings(self.jobs)))
        finally:
            watcher.cancel()
            self.cancel()

    def _with_usage(self, choice: int, payload: dict[str, Any] | str) -> dict[str, Any] | str:
        """`payload` with its choice's usage so far, where each chunk carries it (`running_usage`):
        the prompt's tokens, and the tokens the choice's chunks sent."""
        if not self.running_usage or not isinstance(payload, dict):
            return payload
        prompt, completion = len(self.jobs[choice].prompt_tokens), self._sent_tokens[choice]
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        return {**payload, "usage": usage}

    async def _next_event(self, watcher: asyncio.Task) -> tuple[int, Event] | None:
        """The next `(choice, event)`; None once `watcher` saw the client go."""
        getter = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        return None


async def watch_disconnect(request: Request) -> None:
    """Returns when the client of a request whose body was read has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(jobs: list[Job], finished: dict[int, FinishEvent]) -> dict[str, Any]:
    """A request's usage from its choices' finish events (by choice): each prompt counted once, by
    its first choice (the others are that one's forks); `reasoning_tokens` the tokens generated inside
    think blocks."""
    forks = {fork for job in jobs for fork in job.forks}
    firsts = [finished[index] for index, job in enumerate(jobs) if job not in forks]
    prompt_tokens = sum(event.prompt_tokens for event in firsts)
    completion_tokens = sum(event.completion_tokens for event in finished.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(event.cached_tokens for event in firsts)},
        "completion_tokens_details": {"reasoning_tokens": sum(job.logic.reasoning_tokens for job in jobs)},
    }


def _event_error(event: ErrorEvent) -> APIError:
    """A failed choice's error: a 400 naming the field where the request was at fault, else a 500."""
    if event.param is not None:
        return invalid_request(event.message, param=event.param)
    return APIError(500, event.message, type="server_error")


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _framed(payload: dict[str, Any] | str) -> str:
    """A maker's payload as stream text: a JSON chunk as one `data:` line; text (events a maker
    frames itself, `messages.MessageShapes`) as it is."""
    return payload if isinstance(payload, str) else _sse_data(payload)
