"""A live server of a served model on 127.0.0.1 behind an API key, for the server tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from k3stream.engine.loading import load_runtime
from k3stream.engine.prompt_cache import PromptCache
from k3stream.memlimit import MIB
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import ServedModel, served_from_runtime
from k3stream.server.scheduler import Scheduler


def keyed_server(
    served: ServedModel, api_key: str, *, cors_origins: tuple[str, ...] = (), **config: Any
) -> ServerThread:
    """A server of `served` requiring `api_key` (and answering `cors_origins`' pages), with `config`'s
    `ServerConfig` fields; a `with` block starts and stops it."""
    guard = GuardConfig(api_key=api_key, cors_origins=cors_origins)
    return ServerThread(create_app(served, ServerConfig(guard=guard, **config)))


def cached_served(gguf: Path, cache_name: str, ctx: int) -> Iterator[ServedModel]:
    """`gguf` served at context `ctx` with a 64 MiB prompt cache (`cache_name`, a snapshot every 16 tokens),
    for a fixture to yield from: both are closed after."""
    served = served_from_runtime(load_runtime(gguf), ctx=ctx)
    served.prompt_cache = PromptCache(served.model, cache_name, 64 * MIB, every=16)
    yield served
    served.prompt_cache.close()
    served.close()


def assert_answers_while_held(
    server: ServerThread, monkeypatch, owner: Any, stage: str, send: Callable[[], Any]
) -> None:
    """Hold `owner.stage` once the request `send` makes (on a thread) reaches it, and check that the
    server answers /health meanwhile: the stage runs off the event loop."""
    started, release = threading.Event(), threading.Event()
    stage_now = getattr(owner, stage)

    def held(*args):
        started.set()
        release.wait(20)
        return stage_now(*args)

    monkeypatch.setattr(owner, stage, held)
    sent = threading.Thread(target=send, daemon=True)
    sent.start()
    try:
        assert started.wait(10)
        began = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # the loop is free
        assert time.perf_counter() - began < 5
    finally:
        release.set()
        sent.join(30)


def sse_events(text: str) -> list[dict]:
    """The JSON payloads of a server-sent event stream's `data:` lines, in order."""
    return [
        json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")
    ]


def slow_decode_steps(monkeypatch, seconds: float = 0.01) -> None:
    """Make each token the scheduler emits take `seconds` more: long enough to look at the running
    batch, or to leave a stream, between two of them."""
    emit = Scheduler._emit_token

    def slow(self, job, logits):
        time.sleep(seconds)
        return emit(self, job, logits)

    monkeypatch.setattr(Scheduler, "_emit_token", slow)
