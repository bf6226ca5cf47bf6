"""`k3stream serve MODEL`: the OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from k3stream.cli import Terminated, UsageError
from k3stream.server.guard import (
    API_KEY_ENV,
    LLAMA_API_KEY_ENV,
    GuardConfig,
    allowed_hosts_for,
    api_key_from,
)

if TYPE_CHECKING:
    from k3stream.engine.loading import Runtime
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.server.app import ServerConfig
    from k3stream.server.runtime import ServedModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3stream.commands.flags import (
        add_cache_arguments,
        add_model_arguments,
        add_parallel_arguments,
        at_least_one,
        finite,
        non_negative,
        non_negative_count,
        positive,
    )

    # whole flag names only: llama-server's `--timeout 600` must not be taken for --timeout-keep-alive
    parser.allow_abbrev = False
    add_model_arguments(parser)
    add_parallel_arguments(parser)
    add_cache_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on; 0: a free one, named in the startup line"
    )
    parser.add_argument(
        "--served-model-name",
        "--alias",
        "-a",
        default=None,
        help="the `model` clients ask for (default: the GGUF's file name without shard suffix and extension)",
    )
    add_request_default_arguments(parser)
    parser.add_argument(
        "--chat-template-file",
        type=Path,
        default=None,
        help="a Jinja chat template file rendering every chat request instead of the GGUF's",
    )
    parser.add_argument(
        "--chat-template-kwargs",
        type=template_kwargs,
        default={},
        metavar="JSON",
        help="""template variables of every chat request, a JSON object (e.g. '{"thinking": true}'), as """
        "llama-server's; a request's chat_template_kwargs win",
    )
    parser.add_argument(
        "--reasoning-budget",
        type=int,
        default=-1,
        help="llama-server's: -1 thinks as the request asks (default), 0 turns thinking off unless a "
        "request's chat_template_kwargs turn it on",
    )
    parser.add_argument(
        "--jinja", action="store_true", help="accepted as llama-server takes it: templates are always Jinja"
    )
    parser.add_argument(
        "--metrics", action="store_true", help="accepted as llama-server takes it: /metrics is always served"
    )
    parser.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /slots (--no-slots: llama-server's 501 there; default on)",
    )
    parser.add_argument(
        "--props",
        action="store_true",
        help="accept POST /props, as llama-server's --props (default: its 501)",
    )
    parser.add_argument(
        "--ctx",
        "--ctx-size",
        "-c",
        type=int,
        default=None,
        help="context per sequence, prompt plus output (default: the model's, at most 4096; 0: the model's, "
        "as llama-server's -c 0)",
    )
    parser.add_argument(
        "--max-batch",
        "--parallel",
        "-np",
        type=at_least_one,
        default=16,
        help="sequences decoded together per step",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens prefilled between two decode steps of the running streams, at a prompt's start "
        "(deeper chunks take fewer tokens, of equal work; default 512, or less where the memory plan "
        "holds a smaller prefill pass); while no stream decodes, prompts take whole passes' rows (four "
        "chunks, or what the plan holds)",
    )
    parser.add_argument(
        "--cache-share",
        type=int,
        default=None,
        metavar="TOKENS",
        help="a request whose prompt shares at least TOKENS tokens no snapshot holds with another "
        "request's running prefill waits for that prefill's snapshot of them instead of computing them, "
        "and a prefill whose prompt branches off a cached or running one TOKENS or more past what it "
        "restored is snapshotted there (default 128; 0: neither)",
    )
    parser.add_argument(
        "--max-queue",
        type=non_negative_count,
        default=64,
        help="requests waiting beyond the free batch slots; past this the server answers 429",
    )
    parser.add_argument(
        "--max-body-mib",
        type=finite,
        default=4.0,
        help="largest request body in MiB; larger ones get 413 (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=(
            "require `Authorization: Bearer KEY` (or `X-Api-Key: KEY`; several keys comma-separated, as "
            "llama-server takes them) on every path but /health, "
            f"/v1/health, /models, /v1/models and the chat page (default: ${API_KEY_ENV}, else "
            f"llama-server's ${LLAMA_API_KEY_ENV}, if set)"
        ),
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="a file of API keys, one a line (# comments), as llama-server's; taken with --api-key's",
    )
    parser.add_argument(
        "--cors-origins",
        default="",
        help="comma-separated origins whose web pages may call the server (llama-server's flag; localhost: "
        "pages of this machine; *: any; default: none, no CORS headers)",
    )
    parser.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names served besides loopback and --host; * allows any",
    )
    parser.add_argument(
        "--max-connections",
        type=at_least_one,
        default=128,
        help="open connections and requests at once; beyond this the server answers 503",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=non_negative,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (default %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=positive,
        default=10.0,
        help="seconds a connection may take to send a request's headers (default %(default)s)",
    )
    parser.add_argument(
        "--sse-keepalive",
        "--sse-ping-interval",
        type=positive,
        default=15.0,
        help="seconds a stream may stay silent before a `: keep-alive` comment line (default %(default)s)",
    )
    parser.add_argument("--no-webui", action="store_true", help="do not serve the chat page at /")
    parser.add_argument(
        "--slot-save-path",
        type=Path,
        default=None,
        help="directory for POST /slots/{id}?action=save|restore files (default: slot actions off, 501)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default info: one line a request)",
    )


def add_request_default_arguments(parser: argparse.ArgumentParser) -> None:
    """llama-server's sampling flags: what a request that does not name the field gets (without them,
    OpenAI's defaults: temperature 1, no top-k, top-p or min-p, no limit but the context)."""
    parser.add_argument(
        "--n-predict",
        "--predict",
        "-n",
        type=int,
        default=None,
        help="tokens a request that names no max_tokens or n_predict may generate (-1: up to the context)",
    )
    parser.add_argument("--temperature", "--temp", type=float, default=1.0, help="default %(default)s")
    parser.add_argument(
        "--top-k", type=int, default=0, help="0 or less disables, as llama-server's (default %(default)s)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables (default %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 disables (default %(default)s)")
    parser.add_argument(
        "--seed", "-s", type=int, default=None, help="the seed of a request without one (-1: a fresh one)"
    )


def template_kwargs(text: str) -> dict[str, Any]:
    """argparse type of `--chat-template-kwargs`: a JSON object of plain values, none of the names the
    server sets."""
    from k3stream.server.schemas import RESERVED_TEMPLATE_NAMES

    try:
        variables = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(variables, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of template variables")
    for name, value in variables.items():
        if name in RESERVED_TEMPLATE_NAMES:
            raise argparse.ArgumentTypeError(f"{name!r} is set by the server")
        if not isinstance(value, str | bool | int | float | None):
            raise argparse.ArgumentTypeError(
                f"{name!r}: a variable must be a string, number, boolean or null"
            )
    return variables


def template_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """Every chat request's template variables: `--chat-template-kwargs`, over llama-server's
    `enable_thinking: false` with `--reasoning-budget 0`; a budget of tokens is a one-line error (the
    think block is not cut to a count)."""
    if args.reasoning_budget not in (-1, 0):
        raise UsageError(
            f"--reasoning-budget must be -1 (unrestricted) or 0 (thinking off), got {args.reasoning_budget}"
        )
    off = {"enable_thinking": False} if args.reasoning_budget == 0 else {}
    return {**off, **args.chat_template_kwargs}


def request_defaults(args: argparse.Namespace) -> tuple[Any, int | None]:
    """The `SamplingParams` a request's absent fields take and the tokens one naming no limit may
    generate (None: up to the context), from the flags; a bad value is a one-line error naming it."""
    from k3stream.commands.flags import in_sampling_flags, predict_limit, top_k_flag
    from k3stream.engine.sampling import SamplingParams
    from k3stream.server.schemas import fixed_seed

    try:
        n_predict = None if args.n_predict is None else predict_limit(args.n_predict)
    except ValueError as exc:
        raise UsageError(f"--n-predict {exc}") from None
    try:
        defaults = SamplingParams(
            temperature=args.temperature,
            top_k=top_k_flag(args.top_k),
            top_p=args.top_p,
            min_p=args.min_p,
            seed=fixed_seed(args.seed),
        )
    except ValueError as exc:
        raise in_sampling_flags(exc) from None
    return defaults, n_predict


def run(args: argparse.Namespace) -> int:
    from k3stream.commands.flags import cache_from_args, check_input_file
    from k3stream.commands.launch import parallel_runtime
    from k3stream.engine.loading import resolve_model
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.runtime import served_from_runtime
    from k3stream.server.scheduler import DEFAULT_PREFILL_CHUNK, DEFAULT_SHARE_TOKENS
    from k3stream.server.while_loading import LoadingReplies

    defaults, n_predict = request_defaults(args)
    template_defaults(args)  # a bad value stops the server before the model loads
    if args.chat_template_file is not None:  # before the model loads (minutes for a real one)
        check_input_file(args.chat_template_file, "--chat-template-file")
    config = ServerConfig(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        guard=guard_config(args),
        sse_keepalive_s=args.sse_keepalive,
        webui=not args.no_webui,
        prefill_chunk=DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk,
        share_tokens=DEFAULT_SHARE_TOKENS if args.cache_share is None else args.cache_share,
        slot_save_path=args.slot_save_path,
        slots_endpoint=args.slots,
        props_endpoint=args.props,
    )
    config.check()
    resolve_model(args.model, stream_experts=False)  # a wrong path fails before the port answers 503
    # bound before the model loads (minutes for a real one): a bad --host or --port fails at once, and
    # the port answers llama-server's 503 `Loading model` until the app takes it (rank 0 alone serves)
    follower = os.environ.get("WORLD_SIZE", "1") != "1" and os.environ.get("RANK", "0") != "0"
    listener = None if follower else bind_address(args.host, args.port)
    loading = None
    if listener is not None:
        loading = LoadingReplies(listener).start()
        print(f"k3stream serve: loading; {_url(args.host, listener)} answers 503 until ready", flush=True)
    try:
        # under torchrun rank 0 serves and the others follow; a failed rank stops the server (as Ctrl-C)
        terminated = False
        stop_server = ServerStop()
        with parallel_runtime(args, on_failure=stop_server, graceful=True) as runtime:
            if runtime is None:
                return 0
            chosen = args.prefill_pass  # the pass the memory plan chose (`flags._fitted_plan`)
            config = replace(config, prefill_chunk=chosen.chunk, pass_prompts=chosen.prompts)
            served = served_from_runtime(
                runtime, name=args.served_model_name, ctx=args.ctx, chat_template_file=args.chat_template_file
            )
            served.defaults, served.default_n_predict = defaults, n_predict
            served.template_kwargs = template_defaults(args)
            use_prompt_cache(served, cache_from_args(args, runtime.model))
            app = create_app(served, config)
            settle_heap()
            loading.stop()
            announce(runtime, served, config, _url(args.host, listener))
            terminated = serve_on(app, listener, args.log_level, config, stop_server)
        # a SIGTERM ends the command once the followers are released (the block left without error)
        if terminated:
            raise Terminated
    finally:
        if loading is not None:
            loading.stop()
            listener.close()
    return 0


class ServerStop:
    """What a failed rank calls (on the thread that saw the failure) to stop the server: the graceful
    shutdown a first Ctrl-C starts, the failed requests' error answers sent. Not a signal: where
    torchrun's SIGTERM came first (it stops the survivors of a dead rank), a SIGINT would be uvicorn's
    second signal, which cancels the running requests before their answers go out."""

    def __init__(self) -> None:
        self.server: uvicorn.Server | None = None

    def __call__(self) -> None:
        if self.server is None:  # not serving yet
            os.kill(os.getpid(), signal.SIGINT)
        else:
            self.server.should_exit = True


def use_prompt_cache(served: ServedModel, cache: PromptCache | None) -> None:
    """`cache` as `served`'s prompt cache; the answers the model wrote in ids of its own that its states
    on disk hold (a restart's) are written in those ids again when sent back (`GeneratedRuns.recall`)."""
    served.prompt_cache = cache
    if cache is not None:
        served.generated_runs.recall(cache.held_tokens())


def serve_on(
    app: Any, listener: socket.socket, log_level: str, config: ServerConfig, stop: ServerStop | None = None
) -> bool:
    """uvicorn serving `app` on `listener` until Ctrl-C, SIGTERM or `stop()`; True where a SIGTERM ended
    it."""
    from k3stream.server.guard import uvicorn_options

    options = uvicorn_options(config.guard)
    uvicorn_config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACE_S, **options)
    server = _StreamsEndingServer(uvicorn_config, app.state.scheduler)
    if stop is not None:
        stop.server = server
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on (uvicorn.run drops it)
        pass
    except Terminated:  # and the SIGTERM
        return True
    finally:
        # the app's lifespan stops it too; this covers a uvicorn that never ran its shutdown
        app.state.scheduler.stop()


GRACE_S = 5  # how long a stopping server lets its running requests finish
STREAM_END_S = 1  # before the grace ends, what its unfinished streams have to write their end


class _StreamsEndingServer(uvicorn.Server):
    """uvicorn, whose graceful shutdown stops the scheduler `STREAM_END_S` before it cancels what still
    runs: an unfinished stream ends with the scheduler's `the server is shutting down` error event and
    `[DONE]` instead of a body cut in the middle."""

    def __init__(self, config: uvicorn.Config, scheduler: Any) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ending = asyncio.create_task(self._end_streams_later())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    async def _end_streams_later(self) -> None:
        await asyncio.sleep(GRACE_S - STREAM_END_S)
        await asyncio.to_thread(self.scheduler.stop)


def _url(host: str, listener: socket.socket) -> str:
    return f"http://{host}:{listener.getsockname()[1]}"  # the port bound: the free one for --port 0


def announce(runtime: Runtime, served: ServedModel, config: ServerConfig, url: str) -> None:
    """The startup lines: the model, where it listens (the port bound, the free one for --port 0), the
    plan and the access rules."""
    experts = f"streamed from {runtime.manifest}" if runtime.store else "from the GGUF"
    print(
        f"k3stream serve: {served.name} on {url}/v1 (ctx {served.ctx}, max batch {config.max_batch}, "
        f"queue {config.max_queue}, prefill passes of {pass_note(config, served)}, experts {experts})",
        flush=True,
    )
    print(access_note(config.guard), flush=True)
    if config.webui:
        print(f"k3stream serve: chat page at {url}/ (--no-webui to turn it off)", flush=True)


def bind_address(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (a free port for 0), or a one-line error naming the flags."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: {exc.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind(address)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"cannot bind --host {host} --port {port}: {exc.strerror}") from None
    return listener


def settle_heap() -> None:
    """What loading left (the model, the app, the libraries: some 260,000 objects on a tiny model) moved
    into the collector's permanent generation. A full collection runs in whichever thread allocates,
    holding the GIL: over all of them it took 110-230 ms on the two-core VM, and the scheduler, which
    needs the GIL between its kernels, stopped with it (every running stream waited); after this it
    scans only what serving made since."""
    gc.collect()
    gc.freeze()


def guard_config(args: argparse.Namespace) -> GuardConfig:
    """Body limit, API key, allowed Host names and connection limits from the command line."""
    return GuardConfig(
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        api_key=api_key_from(args.api_key, args.api_key_file),
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts.split(",")),
        header_timeout_s=args.header_timeout,
        keep_alive_s=args.timeout_keep_alive,
        max_connections=args.max_connections,
        cors_origins=tuple(origin.strip() for origin in args.cors_origins.split(",") if origin.strip()),
    )


def pass_note(config: ServerConfig, served: ServedModel) -> str:
    """The prefill passes the server runs: `4 x 512 tokens (2048 rows while no stream decodes)` (a chunk
    of each of up to 4 prompts beside running streams)."""
    tokens = config.prefill_pass(served)
    chunks = f"{tokens // config.prefill_chunk} x {config.prefill_chunk} tokens"
    return f"{chunks} ({config.pass_rows()} rows while no stream decodes)"


def access_note(guard: GuardConfig) -> str:
    """One line on who may call: the API key, the Host names served, the body limit."""
    key = (
        "Bearer API key required (health, models and the chat page open)"
        if guard.api_key
        else "no API key (--api-key to require one)"
    )
    hosts = "any Host" if "*" in guard.allowed_hosts else "Host " + ", ".join(guard.allowed_hosts)
    return (
        f"k3stream serve: {key}; {hosts} (--allowed-hosts to add names); "
        f"bodies up to {guard.max_body_bytes / (1 << 20):g} MiB"
    )
