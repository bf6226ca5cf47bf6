"""The FastAPI app: OpenAI-compatible completions and chat completions over the batching scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3stream.server.errors import APIError, from_validation_error, invalid_request, redact_paths
from k3stream.server.guard import Guard, GuardConfig
from k3stream.server.kimi_output import Piece
from k3stream.server.metrics import ServerMetrics
from k3stream.server.prompt_reuse import register_cache_metrics
from k3stream.server.request_logic import TokenLogprob
from k3stream.server.runtime import ChatPrompt, ServedModel
from k3stream.server.scheduler import (
    DEFAULT_PREFILL_CHUNK,
    Event,
    EventSink,
    FinishEvent,
    Job,
    PieceEvent,
    QueueFull,
    Scheduler,
)
from k3stream.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

KNOWN_ENDPOINTS = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"})
RequestModel = TypeVar("RequestModel", bound=BaseModel)


# a run of this many failed requests, with no success between, makes /health answer 503
UNHEALTHY_AFTER = 3
# threads that tokenize prompts and render chat templates, off the event loop
TOKENIZER_THREADS = 2


@dataclass
class ServerConfig:
    max_batch: int = 16
    max_queue: int = 64
    guard: GuardConfig = field(default_factory=GuardConfig)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def check(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be at least 0, got {self.max_queue}")
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        self.guard.check()

    def prefill_pass(self, served: ServedModel) -> int:
        """Prompt tokens one prefill pass takes from waiting requests: a chunk of each batch slot's when
        experts stream from a pack (a pass then costs its expert reads, nearly whatever its tokens),
        else one chunk's."""
        return self.prefill_chunk * (self.batch_for(served) if served.store is not None else 1)

    def batch_for(self, served: ServedModel) -> int:
        """`max_batch`, capped where the expert store could not hold one step's experts."""
        return min(self.max_batch, served.batch_limit() or self.max_batch)


def create_app(served: ServedModel, config: ServerConfig) -> FastAPI:
    """An app serving `served`; its scheduler thread runs while the app's lifespan is active."""
    config.check()
    metrics = ServerMetrics(served.store_stats)
    register_cache_metrics(metrics.registry, served.prompt_cache)
    scheduler = Scheduler(
        served.model,
        metrics,
        max_batch=config.batch_for(served),
        max_queue=config.max_queue,
        on_tokens=served.end_tokens,
        cache=served.prompt_cache,
        prefill_chunk=config.prefill_chunk,
        prefill_pass=config.prefill_pass(served),
    )

    tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="k3stream-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()
            tokenizers.shutdown(wait=False, cancel_futures=True)
            if served.prompt_cache is not None:
                served.prompt_cache.close()  # its queued snapshot files, for the next start

    app = FastAPI(title="k3stream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.guard = config.guard
    app.add_middleware(Guard, config=config.guard)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: refusals are counted too
    _add_error_handlers(app)
    api = Endpoints(served, scheduler, metrics, tokenizers)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    return app


class Endpoints:
    def __init__(
        self,
        served: ServedModel,
        scheduler: Scheduler,
        metrics: ServerMetrics,
        tokenizers: ThreadPoolExecutor,
    ) -> None:
        self.served = served
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizers = tokenizers

    async def _off_loop(self, function: Callable, *args: Any) -> Any:
        """Run tokenizing / template rendering on the tokenizer threads, not the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizers, function, *args)

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.served.name,
            "object": "model",
            "created": self.served.created,
            "owned_by": "k3stream",
            "max_model_len": self.served.ctx,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        """200 `ok`, or 503 `unhealthy` with the problems: model files changed since load, or the last
        UNHEALTHY_AFTER requests all failed. No absolute paths."""
        snapshot = self.scheduler.snapshot()
        store = self.served.store_stats()
        problems = self.served.file_problems()
        if snapshot["consecutive_failures"] >= UNHEALTHY_AFTER:
            problems.append(
                f"the last {snapshot['consecutive_failures']} requests failed: {snapshot['last_error']}"
            )
        if snapshot["last_error"] is not None:
            snapshot["last_error"] = redact_paths(snapshot["last_error"])
        if "pack_path" in store:
            store["pack_path"] = os.path.basename(store["pack_path"])
        body = {
            "status": "unhealthy" if problems else "ok",
            "problems": [redact_paths(p) for p in problems],
            **snapshot,
            "max_batch": self.scheduler.max_batch,
            "rss_bytes": process_rss_bytes(),
            "integrity_errors": int(store.get("integrity_errors", 0)),
            "expert_store": store,
        }
        return JSONResponse(body, status_code=503 if problems else 200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_request(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            tokens = await self._off_loop(self.served.encode_prompt, prompt)
        else:
            tokens = self._check_ids(prompt)
        explicit = "max_tokens" in body.model_fields_set
        job = self._submit(
            body, tokens, body.max_tokens, explicit_limit=explicit, prompt_param="prompt", top=body.logprobs
        )
        stream = Stream(job, self.scheduler, _CompletionChunks(self.served.name))
        return await stream.respond(request, body.stream, body.include_usage())

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self._check_request(body)
        prompt = await self._off_loop(self.served.prepare_chat, body)
        limit = body.token_limit()
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = self._submit(
            body,
            prompt.tokens,
            limit,
            explicit_limit=limit is not None,
            prompt_param="messages",
            top=top,
            chat=prompt,
        )
        stream = Stream(job, self.scheduler, _ChatChunks(self.served.name))
        return await stream.respond(request, body.stream, body.include_usage())

    def _check_request(self, body: SamplingFields) -> None:
        body.check_supported()
        if body.model not in (None, self.served.name):
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.served.name}`",
                param="model",
                code="model_not_found",
            )

    def _check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.served.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(
                f"prompt: token id {bad} is outside the vocabulary of {vocab}", param="prompt"
            )
        return ids

    def _submit(
        self,
        body: SamplingFields,
        tokens: list[int],
        limit: int | None,
        *,
        explicit_limit: bool,
        prompt_param: str,
        top: int | None,
        chat: ChatPrompt | None = None,
    ) -> Job:
        """Queue the request; `top` is the number of top logprobs per token (None: no logprobs)."""
        max_tokens = self._token_budget(len(tokens), limit, explicit_limit, prompt_param)
        logic = self.served.new_sequence(body, tokens, max_tokens, chat=chat, top_logprobs=top)
        job = Job(prompt_tokens=tokens, logic=logic, sink=EventSink(asyncio.get_running_loop()))
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(429, str(exc), type="server_overloaded", code="queue_full") from None
        return job

    def _token_budget(self, prompt_len: int, limit: int | None, explicit: bool, prompt_param: str) -> int:
        """Tokens this request may generate; a request that cannot fit the context is refused."""
        ctx = self.served.ctx
        if prompt_len >= ctx:
            raise invalid_request(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{prompt_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = ctx - prompt_len
        if limit is None:
            return room
        if explicit and limit > room:
            raise invalid_request(
                f"This model's maximum context length is {ctx} tokens; the prompt has "
                f"{prompt_len} tokens, so max_tokens can be at most {room}, not {limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return min(limit, room)


class Stream:
    """One request's events, as a server-sent event stream or as one JSON body."""

    def __init__(self, job: Job, scheduler: Scheduler, chunks: _Chunks) -> None:
        self.job = job
        self.scheduler = scheduler
        self.chunks = chunks

    def cancel(self) -> None:
        self.job.cancel()
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
            yield _sse_data(self.chunks.first())
            while True:
                event = await self.job.sink.queue.get()
                if isinstance(event, PieceEvent):
                    yield _sse_data(self.chunks.piece(event.piece))
                    continue
                if isinstance(event, FinishEvent):
                    yield _sse_data(self.chunks.last(event.reason))
                    if include_usage:
                        yield _sse_data(self.chunks.usage_only(_usage(event)))
                else:
                    yield _sse_data(APIError(500, event.message, type="server_error").body())
                yield "data: [DONE]\n\n"
                return
        finally:
            self.cancel()  # a no-op for a finished job; frees the sequence of a client that left

    async def _whole(self, request: Request) -> Response:
        total = Piece()
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            while True:
                event = await self._next_event(watcher)
                if isinstance(event, PieceEvent):
                    total.extend(event.piece)
                elif isinstance(event, FinishEvent):
                    return JSONResponse(self.chunks.whole(total, event.reason, _usage(event)))
                else:
                    return APIError(500, event.message, type="server_error").response()
        finally:
            watcher.cancel()
            self.cancel()

    async def _next_event(self, watcher: asyncio.Task) -> Event:
        """The next event; raises CancelledError once `watcher` saw the client go."""
        getter = asyncio.ensure_future(self.job.sink.queue.get())
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        raise asyncio.CancelledError("client disconnected")


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client of a request whose body was read has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(event: FinishEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Chunks:
    """Response bodies of one endpoint; ids and timestamps are fixed per request."""

    object_whole: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_only(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk, []), "usage": usage}

    def whole(self, total: Piece, reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.object_whole, [self._whole_choice(total, reason)]), "usage": usage}

    def first(self) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._delta_choice(self._opening(), None)])

    def piece(self, piece: Piece) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._delta_choice(self._text(piece), None)])

    def last(self, reason: str) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._delta_choice(self._text(Piece()), reason)])

    def _delta_choice(self, content: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": 0, "logprobs": None, **content, "finish_reason": reason}

    def _opening(self) -> dict[str, Any]:
        raise NotImplementedError

    def _text(self, piece: Piece) -> dict[str, Any]:
        raise NotImplementedError

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionChunks(_Chunks):
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self._offset = 0  # characters of token text before the next token, for `text_offset`

    def _opening(self) -> dict[str, Any]:
        return {"text": ""}

    def _text(self, piece: Piece) -> dict[str, Any]:
        return {"text": piece.content, "logprobs": self._logprobs(piece.logprobs)}

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        logprobs = self._logprobs(total.logprobs)
        return {"index": 0, "text": total.content, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """The completions API's logprobs object (None without logprobs)."""
        if not entries:
            return None
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [_top_dict(entry.top) for entry in entries],
            "text_offset": offsets,
        }


class _ChatChunks(_Chunks):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _opening(self) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}

    def _text(self, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.tool_calls:
            delta["tool_calls"] = [call.openai() for call in piece.tool_calls]
        return {"delta": delta, "logprobs": _chat_logprobs(piece.logprobs)}

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": total.content}
        if total.reasoning:
            message["reasoning_content"] = total.reasoning
        if total.tool_calls:
            message["content"] = total.content or None
            message["tool_calls"] = [_without_index(call.openai()) for call in total.tool_calls]
        logprobs = _chat_logprobs(total.logprobs)
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _top_dict(top: list[TokenLogprob]) -> dict[str, float]:
    """OpenAI's `{token text: logprob}`; of tokens with the same text, the most likely one."""
    listed: dict[str, float] = {}
    for entry in top:
        listed.setdefault(entry.token, entry.logprob)
    return listed


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any] | None:
    return {"content": [entry.openai() for entry in entries]} if entries else None


def _without_index(call: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in call.items() if key != "index"}


async def _parse(request: Request, model: type[RequestModel]) -> RequestModel:
    try:
        body = await request.body()
        if len(body) > 64 * 1024:  # parsing a few MiB takes milliseconds: keep it off the event loop
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: APIError) -> Response:
        return exc.response()

    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return invalid_request(f"invalid request: {exc.errors()[0].get('msg', 'bad input')}").response()

    async def unexpected(_request: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class RequestCounter:
    """ASGI middleware counting responses by endpoint and status (streams count when they start)."""

    def __init__(self, app: Callable, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            endpoint = scope["path"] if scope["path"] in KNOWN_ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()


def process_rss_bytes() -> int:
    """This process's resident set size (Linux), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
