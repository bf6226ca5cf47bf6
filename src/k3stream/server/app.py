"""The FastAPI app: OpenAI-compatible completions and chat completions over the batching scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from k3stream.engine.chunked_prefill import attention_rows_per_token
from k3stream.server.bodies import parse_body
from k3stream.server.endpoints_llama import llama_router
from k3stream.server.errors import APIError, invalid_request, redact_paths, shaped_for
from k3stream.server.grammar import Constraint
from k3stream.server.guard import Guard, GuardConfig, HeadAsGet, cors_options
from k3stream.server.messages import messages_router
from k3stream.server.metrics import ServerMetrics
from k3stream.server.native import native_router
from k3stream.server.openai_chunks import ChatChunks, CompletionChunks
from k3stream.server.prompt_reuse import register_cache_metrics
from k3stream.server.responses import responses_router
from k3stream.server.routes import ANTHROPIC_ENDPOINTS, LLAMA_ENDPOINTS
from k3stream.server.runtime import ChatPrompt, ServedModel
from k3stream.server.scheduler import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SHARE_TOKENS,
    EventSink,
    Job,
    QueueFull,
    Scheduler,
)
from k3stream.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from k3stream.server.slots import SlotTable, slots_router
from k3stream.server.streaming import Stream
from k3stream.server.webui import webui_router

KNOWN_ENDPOINTS = frozenset(
    {
        "/",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/health",
        "/v1/health",
        "/metrics",
        *LLAMA_ENDPOINTS,
        *ANTHROPIC_ENDPOINTS,
    }
)


# a run of this many failed requests, with no success between, makes /health answer 503
UNHEALTHY_AFTER = 3
# threads that tokenize prompts and render chat templates, off the event loop
TOKENIZER_THREADS = 2


# Chunks one prefill pass holds, the rows the memory plan sizes its buffers for: where experts stream from
# a pack a chunk of each of up to four waiting prompts (four share each expert read: a token's pack bytes
# fall to about a quarter), and while no stream decodes all four chunks' rows, oldest prompt first,
# streamed or not. The buffers, which the memory plan takes from the expert budget, stay four chunks'
# (1.9 GiB at Kimi-K3's shapes with 512-token chunks attending 4,096 positions, against 7.6 GiB for a
# chunk of each of 16 batch slots).
PREFILL_PASS_PROMPTS = 4
# the smallest chunk `serve` sizes a prefill pass down to when `--prefill-chunk` is not given
MIN_PREFILL_CHUNK = 32


@dataclass
class ServerConfig:
    max_batch: int = 16
    max_queue: int = 64
    guard: GuardConfig = field(default_factory=GuardConfig)
    # seconds an event stream may stay silent before a `: keep-alive` comment line (proxies close
    # silent connections; a prefill streamed from disk can take minutes)
    sse_keepalive_s: float = 15.0
    webui: bool = True  # the chat page at `/`
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # chunks one prefill pass holds: of as many waiting prompts when experts stream from a pack (at most
    # max_batch), or their rows while no stream decodes; `serve` lowers it, and the chunk, to the pass
    # its memory plan holds (`prefill_passes`)
    pass_prompts: int = PREFILL_PASS_PROMPTS
    slot_save_path: Path | None = None  # where `/slots/{id}?action=save` writes (None: slot actions off)
    share_tokens: int = DEFAULT_SHARE_TOKENS  # `Scheduler`'s: shared uncached prompt tokens worth a wait
    slots_endpoint: bool = True  # `GET /slots` (llama-server's `--no-slots`: its 501)
    props_endpoint: bool = False  # `POST /props` (llama-server's `--props`; without it, its 501)

    def check(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be at least 0, got {self.max_queue}")
        if not self.sse_keepalive_s > 0:
            raise ValueError(f"--sse-keepalive must be above 0 seconds, got {self.sse_keepalive_s}")
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.share_tokens < 0:
            raise ValueError(f"--cache-share must be at least 0, got {self.share_tokens}")
        if self.pass_prompts < 1:
            raise ValueError(f"a prefill pass takes at least 1 prompt, got {self.pass_prompts}")
        if self.slot_save_path is not None and not self.slot_save_path.is_dir():
            raise ValueError(f"--slot-save-path {self.slot_save_path}: not a directory")
        self.guard.check()

    def prefill_pass(self, served: ServedModel) -> int:
        """Prompt tokens one prefill pass takes from waiting requests, in one forward: a chunk of each
        of up to `pass_prompts` of them (at most `max_batch`) when experts stream from a pack (a pass
        then costs its expert reads, nearly whatever its tokens), else one chunk's."""
        prompts = min(self.max_batch, self.pass_prompts) if served.store is not None else 1
        return self.prefill_chunk * prompts

    def pass_rows(self) -> int:
        """Prompt rows one prefill pass may hold, those the memory plan sized its buffers for: while no
        sequence decodes, prompts are prefilled in passes of that many, oldest first."""
        return self.prefill_chunk * self.pass_prompts

    def attention_rows(self, served: ServedModel) -> float | None:
        """`PrefillChunks`' rows_per_token: chunks of equal work where the experts are in RAM, of
        `prefill_chunk` tokens where they stream from a pack (a pass costs its reads)."""
        return None if served.store is not None else attention_rows_per_token(served.model.config)


@dataclass(frozen=True)
class PrefillPass:
    """One prefill pass: `prompts` chunks of `chunk` tokens in one forward (of as many waiting prompts, or
    their rows while no stream decodes)."""

    prompts: int
    chunk: int

    @property
    def tokens(self) -> int:
        return self.prompts * self.chunk


def prefill_passes(chunk: int | None) -> list[PrefillPass]:
    """The prefill passes `serve` can run, largest first: PREFILL_PASS_PROMPTS chunks down to one, then,
    where `chunk` (`--prefill-chunk`) was not given, one chunk halved from DEFAULT_PREFILL_CHUNK down to
    MIN_PREFILL_CHUNK."""
    given = chunk or DEFAULT_PREFILL_CHUNK
    passes = [PrefillPass(prompts, given) for prompts in range(PREFILL_PASS_PROMPTS, 0, -1)]
    size = DEFAULT_PREFILL_CHUNK // 2
    while chunk is None and size >= MIN_PREFILL_CHUNK:
        passes.append(PrefillPass(1, size))
        size //= 2
    return passes


def create_app(served: ServedModel, config: ServerConfig) -> FastAPI:
    """An app serving `served`; its scheduler thread runs while the app's lifespan is active."""
    config.check()
    metrics = ServerMetrics(served.store_stats)
    register_cache_metrics(metrics.registry, served.prompt_cache)
    slots = SlotTable(config.max_batch)
    scheduler = Scheduler(
        served.model,
        metrics,
        max_batch=config.max_batch,
        max_queue=config.max_queue,
        on_tokens=served.end_tokens,
        cache=served.prompt_cache,
        prefill_chunk=config.prefill_chunk,
        prefill_pass=config.prefill_pass(served),
        pass_rows=config.pass_rows(),
        attention_rows=config.attention_rows(served),
        share_tokens=config.share_tokens,
        pick_slot=slots.assign,
        on_finish=slots.finished,
    )

    tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="k3stream-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            await load_first_use(tokenizers)
            yield
        finally:
            scheduler.stop()
            tokenizers.shutdown(wait=False, cancel_futures=True)
            if served.prompt_cache is not None:
                served.prompt_cache.close()  # its queued snapshot files, for the next start

    app = FastAPI(title="k3stream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.guard = config.guard
    app.add_middleware(HeadAsGet)
    app.add_middleware(Guard, config=config.guard)
    cors = cors_options(config.guard)
    if cors is not None:  # outside the guard: a preflight carries no key, and refusals are readable
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: refusals are counted too
    _add_error_handlers(app)
    api = Endpoints(served, scheduler, metrics, tokenizers, config.sse_keepalive_s, slots)
    for path in ("/v1/models", "/models", "/api/tags"):  # llama-server's aliases of the list
        app.get(path)(api.models)
    for prefix in ("/v1", ""):  # llama-server answers OpenAI's paths without /v1 too
        app.post(f"{prefix}/chat/completions")(api.chat_completions)
    app.post("/v1/chat/completions/input_tokens")(api.chat_input_tokens)
    app.post("/v1/completions")(api.completions)  # `/completions` is llama-server's native one
    app.get("/v1/models/{model_id:path}")(api.model)
    app.get("/health")(api.health)
    app.get("/v1/health")(api.health)  # llama-server's alias
    app.get("/metrics")(api.metrics_text)
    app.include_router(llama_router(served, scheduler, tokenizers, config))
    app.include_router(native_router(api))
    app.include_router(messages_router(api))
    app.include_router(responses_router(api))
    app.include_router(slots_router(slots, scheduler, served, config))
    if config.webui:
        app.include_router(webui_router())
    return app


async def load_first_use(tokenizers: ThreadPoolExecutor) -> None:
    """Load before serving what the first requests would otherwise wait for: anyio's asyncio backend
    (Starlette streams a response in an anyio task group, and the backend's import on first use takes
    tens of milliseconds of the event loop) and the tokenizer threads (each started on the first call
    that finds no idle one; all of them wait at one barrier here, so each is started)."""
    async with anyio.create_task_group():
        pass
    loop, started = asyncio.get_running_loop(), threading.Barrier(TOKENIZER_THREADS)
    await asyncio.gather(*(loop.run_in_executor(tokenizers, started.wait) for _ in range(started.parties)))


class Endpoints:
    def __init__(
        self,
        served: ServedModel,
        scheduler: Scheduler,
        metrics: ServerMetrics,
        tokenizers: ThreadPoolExecutor,
        keepalive_s: float,
        slots: SlotTable,
    ) -> None:
        self.served = served
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.keepalive_s = keepalive_s
        self.slots = slots
        self._task_ids = itertools.count()  # llama-server's `id_task` of each sequence

    async def off_loop(self, function: Callable, *args: Any) -> Any:
        """Run tokenizing / template rendering on the tokenizer threads, not the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizers, function, *args)

    async def models(self) -> dict[str, Any]:
        """OpenAI's model list, with llama-server's Ollama-style `models` entry beside it (what
        `/api/tags` answers there too, for clients that list an Ollama server's models)."""
        return {"models": [self._ollama_card()], "object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """OpenAI's model retrieval (`client.models.retrieve`): the served model's card, else a 404."""
        self._check_model(model_id)
        return self._card()

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.served.created,
            "owned_by": "k3stream",
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},  # llama-server's
            "max_model_len": self.served.ctx,
            "meta": self.served.meta(),
        }

    def _ollama_card(self) -> dict[str, Any]:
        """The model as llama-server lists it to Ollama's clients: its name, and empty fields where Ollama
        would give figures of its own store (digest, modification time)."""
        name = self.served.name
        details = {"parent_model": "", "format": "gguf", "family": "", "families": [""]}
        return {
            "name": name,
            "model": name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {**details, "parameter_size": "", "quantization_level": ""},
        }

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
        body = await parse_body(request, CompletionRequest)
        await self.check_request(body)
        prompts = [await self._prompt_ids(prompt) for prompt in body.prompts()]
        # each prompt's own grammar state (compiled on the tokenizer threads: a schema takes milliseconds)
        constraint = self.served.structured_constraint
        constrained = [(tokens, await self.off_loop(constraint, body)) for tokens in prompts]
        jobs = self.submit_prompts(body, constrained, body.token_limit(), top=body.logprobs)
        makers = CompletionChunks.for_choices(self.served.name, jobs, body.timings_per_token)
        stream = self.stream(jobs, makers, body)
        return await stream.respond(request, body.stream, body.include_usage())

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self.off_loop(self.served.encode_prompt, prompt)
        return self.check_ids(prompt)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await self.answer_chat(
            request,
            body,
            lambda jobs: ChatChunks.for_choices(self.served.name, jobs, body.timings_per_token),
        )

    async def chat_input_tokens(self, request: Request) -> dict[str, Any]:
        """llama-server's count of the prompt tokens a chat request would prefill."""
        return await self.input_tokens(await parse_body(request, ChatCompletionRequest))

    async def input_tokens(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """OpenAI's `response.input_tokens` object of the prompt `body` would prefill."""
        await self.check_request(body)
        prompt = await self.off_loop(self.served.prepare_chat, body)
        return {"object": "response.input_tokens", "input_tokens": len(prompt.tokens)}

    async def answer_chat(
        self, request: Request, body: ChatCompletionRequest, shapes: Callable[[list[Job]], Sequence[Any]]
    ) -> Response:
        """Answer a chat request, shaped by the makers `shapes` gives for its jobs (one per choice):
        OpenAI's chunks, or another API's converted into this request (`messages`)."""
        await self.check_request(body)
        prompt = await self.off_loop(self.served.prepare_chat, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs = self.submit(
            body, prompt.tokens, body.token_limit(), prompt_param="messages", top=top, chat=prompt
        )
        stream = self.stream(jobs, shapes(jobs), body)
        return await stream.respond(request, body.stream, body.include_usage())

    def stream(self, jobs: list[Job], makers: Sequence[Any], body: SamplingFields) -> Stream:
        """The response of `jobs` (of the request `body`), shaped by `makers` (one per job)."""
        keepalive_s = body.keepalive_s(self.keepalive_s)
        progress, usage = body.return_progress, body.continuous_usage()
        return Stream(jobs, self.scheduler, makers, keepalive_s, progress, usage)

    async def check_request(self, body: SamplingFields) -> None:
        """A 400 naming the field a request asks for that is not served, checked on the tokenizer
        threads: each tool's JSON Schema takes milliseconds to check, and an agent sends hundreds."""
        await self.off_loop(self._check_request, body)

    def _check_request(self, body: SamplingFields) -> None:
        body.check_supported()
        body.logit_bias_ids(self.served.vocab_size, self.served.encode_text)
        body.stop_ids(self.served.vocab_size)
        if body.n > self.scheduler.max_batch:
            raise invalid_request(
                f"n: at most {self.scheduler.max_batch} choices per request on this server (its batch size)",
                param="n",
            )
        if body.id_slot >= self.slots.count:
            raise invalid_request(
                f"id_slot: this server has {self.slots.count} slots (0 to {self.slots.count - 1})",
                param="id_slot",
            )

    def _check_model(self, model: str) -> None:
        if model != self.served.name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.served.name}`",
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.served.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(
                f"prompt: token id {bad} is outside the vocabulary of {vocab}", param="prompt"
            )
        return ids

    def submit(
        self,
        body: SamplingFields,
        tokens: list[int],
        limit: int | None,
        *,
        top: int | None,
        prompt_param: str = "prompt",
        chat: ChatPrompt | None = None,
        constraint: Constraint | None = None,
        queue: asyncio.Queue | None = None,
        index: int = 0,
    ) -> list[Job]:
        """Queue the request, one job per choice (the first one's prefill shared by all); `limit` the
        tokens it asks for (None: up to the context); `top` is the number of top logprobs per token
        (None: no logprobs); `constraint` a completion's grammar (each further choice follows a copy of
        it, its own state); `queue` and `index` where
        its events go (several prompts of one request share a queue, each its own index)."""
        tokens = body.truncated(tokens, self.served.ctx)
        if self.served.default_n_predict is not None and not body.names_limit():
            limit = self.served.default_n_predict  # `serve -n`: cut to the context
        max_tokens = self._token_budget(len(tokens), limit, prompt_param)
        loop, queue = asyncio.get_running_loop(), queue if queue is not None else asyncio.Queue()
        jobs = []
        for choice in range(body.n):
            logic = self.served.new_sequence(
                body,
                tokens,
                max(max_tokens, 1),  # 0: a prompt-only job, whose logic samples nothing
                chat=chat,
                top_logprobs=top,
                choice=choice,
                constraint=constraint if choice == 0 or constraint is None else constraint.copy(),
            )
            jobs.append(
                Job(
                    prompt_tokens=tokens,
                    logic=logic,
                    sink=EventSink(loop, queue, index + choice),
                    reuse_prompt=body.cache_prompt,
                    sends_progress=body.stream and body.return_progress,
                    prompt_only=max_tokens == 0,
                    wanted_slot=body.id_slot if choice == 0 else -1,
                    task_id=next(self._task_ids),
                )
            )
        jobs[0].forks = jobs[1:]
        try:
            self.scheduler.submit(jobs[0])
        except QueueFull as exc:
            raise APIError(429, str(exc), type="server_overloaded", code="queue_full") from None
        return jobs

    def submit_prompts(
        self,
        body: SamplingFields,
        prompts: list[tuple[list[int], Constraint | None]],
        limit: int | None,
        *,
        top: int | None,
    ) -> list[Job]:
        """Queue each prompt (its token ids and grammar) of a request as `submit` does, their events on
        one queue: choice j of prompt i under index i * n + j (OpenAI's order). If one cannot be
        queued, those queued before it are cancelled."""
        queue: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        try:
            for index, (tokens, constraint) in enumerate(prompts):
                jobs += self.submit(
                    body,
                    tokens,
                    limit,
                    top=top,
                    constraint=constraint,
                    queue=queue,
                    index=index * body.n,
                )
        except APIError:
            for job in jobs:
                job.cancel()
            self.scheduler.wake()
            raise
        return jobs

    def _token_budget(self, prompt_len: int, limit: int | None, prompt_param: str) -> int:
        """Tokens this request may generate: `limit`, cut to the room the context leaves as llama-server
        cuts it (agents ask for 32000 tokens whatever the prompt and the context; the answer then ends
        where the context does, `finish_reason` `length`); a prompt that does not fit is refused."""
        ctx = self.served.ctx
        if prompt_len >= ctx:
            # a prompt of exactly the context fits it but leaves no room for the answer's first token
            room = ", which leaves no room for an answer" if prompt_len == ctx else ""
            raise invalid_request(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{prompt_len} tokens{room}",
                param=prompt_param,
                code="context_length_exceeded",
                figures={"n_prompt_tokens": prompt_len, "n_ctx": ctx},
            )
        room = ctx - prompt_len
        return room if limit is None else min(limit, room)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: APIError) -> Response:
        return exc.response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, _http_detail(exc), type=kind)
        error.message = f"{request.method} {request.url.path}: {error.message}"  # the client's own path
        response = shaped_for(request.url.path, error).response()
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        error = invalid_request(f"invalid request: {exc.errors()[0].get('msg', 'bad input')}")
        return shaped_for(request.url.path, error).response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return shaped_for(request.url.path, error).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


def _http_detail(exc: StarletteHTTPException) -> str:
    """The routing error in words: what this server has instead of a missing endpoint or method."""
    if exc.status_code == 404:
        return "no such endpoint on this server (docs/server-endpoints.md lists its endpoints)"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return f"method not allowed here; this endpoint takes {allowed}" if allowed else str(exc.detail)
    return str(exc.detail)


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
