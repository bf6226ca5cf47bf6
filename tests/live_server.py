"""A live server of a served model on 127.0.0.1 behind an API key, for the server tests."""

from __future__ import annotations

from typing import Any

from k3stream.server.app import ServerConfig, create_app
from k3stream.server.guard import GuardConfig
from k3stream.server.live import ServerThread
from k3stream.server.runtime import ServedModel


def keyed_server(
    served: ServedModel, api_key: str, *, cors_origins: tuple[str, ...] = (), **config: Any
) -> ServerThread:
    """A server of `served` requiring `api_key` (and answering `cors_origins`' pages), with `config`'s
    `ServerConfig` fields; a `with` block starts and stops it."""
    guard = GuardConfig(api_key=api_key, cors_origins=cors_origins)
    return ServerThread(create_app(served, ServerConfig(guard=guard, **config)))
