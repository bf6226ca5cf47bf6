"""What keeps the server from being stalled or used by strangers, ahead of the endpoints.

- `Guard`, an ASGI middleware: foreign `Host` headers are refused (400; DNS rebinding), every path but
  llama-server's public ones (`routes.needs_api_key`) needs the API key when one is set
  (`Authorization: Bearer KEY` or `X-Api-Key: KEY`, as llama-server reads them: `given_key`; 401 in
  OpenAI's error shape on OpenAI's paths, llama-server's elsewhere; constant-time compare), a request
  body is read in full before the app sees it, at most `max_body_bytes` (413) and within
  `body_timeout_s` (408).
- `cors_options(config)`: Starlette's CORS middleware settings for `--cors-origins` (llama-server's flag):
  none by default, so browsers refuse cross-origin calls unless the origins are named (`localhost`: pages
  of this machine, as llama-server reads it; `*`: any).
- `guarded_h11(header_timeout_s)`: uvicorn's h11 protocol with a deadline for a request's headers,
  from the moment the connection opens or the previous response ends: a connection that sends nothing
  or trickles its headers is closed.
- `uvicorn_options(config)`: keep-alive timeout, connection cap (503 beyond) and that protocol.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from k3stream.server.errors import (
    LLAMA_ERROR_TYPES,
    APIError,
    LlamaError,
    redact_paths,  # noqa: F401 (re-exported)
    shaped_for,
)
from k3stream.server.routes import needs_api_key, openai_path

API_KEY_ENV = "K3STREAM_API_KEY"
LLAMA_API_KEY_ENV = "LLAMA_API_KEY"  # llama-server's
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MIB = 1 << 20


@dataclass
class GuardConfig:
    max_body_bytes: int = 4 * MIB
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOCAL_HOSTS  # "*" allows any Host header
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 128
    cors_origins: tuple[str, ...] = ()  # origins whose pages may call (none: no CORS headers at all)

    def check(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-mib must allow at least 1 KiB, got {self.max_body_bytes} bytes")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.header_timeout_s > 0 or not self.keep_alive_s >= 0:
            raise ValueError(
                "--header-timeout must be above 0 seconds and --timeout-keep-alive at least 0, "
                f"got {self.header_timeout_s} and {self.keep_alive_s}"
            )
        if self.api_key is not None and not self.api_key.replace(",", "").strip():
            raise ValueError("--api-key must not be empty")


def allowed_hosts_for(bind_host: str, extra: list[str] | None) -> tuple[str, ...]:
    """The Host names a server bound to `bind_host` answers: loopback names, the bind address (unless it
    is a wildcard) and `extra` (`--allowed-hosts`; `*` allows any)."""
    hosts = [*LOCAL_HOSTS]
    if bind_host not in ("0.0.0.0", "::", ""):
        hosts.append(bind_host)
    hosts += [host.strip().lower() for host in extra or [] if host.strip()]
    return tuple(dict.fromkeys(hosts))


# llama-server's `--cors-origins localhost`: a page served from this machine, on any port
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def cors_options(config: GuardConfig) -> dict[str, Any] | None:
    """Starlette `CORSMiddleware`'s settings for `config.cors_origins`, None where there are none: the
    origins' pages may send any method and header and their credentials, as llama-server allows them."""
    if not config.cors_origins:
        return None
    named = [origin for origin in config.cors_origins if origin != "localhost"]
    local = LOCAL_ORIGINS if "localhost" in config.cors_origins else None
    return {
        "allow_origins": named,
        "allow_origin_regex": local,
        "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"],
        "allow_headers": ["*"],
        "allow_credentials": True,
    }


def api_key_from(argument: str | None, key_file: Path | None = None) -> str | None:
    """The keys the server requires, comma-separated: `--api-key`'s and `--api-key-file`'s (one a line,
    `#` comment lines and blank lines skipped, as llama-server reads it), else `$K3STREAM_API_KEY`'s, else
    llama-server's `$LLAMA_API_KEY`'s (a server moved from llama-server with its environment stays
    locked). A key file that cannot be read, or holds a key with a comma, is a one-line error naming it."""
    keys = [argument] if argument is not None else []
    if key_file is not None:
        try:
            text = key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {key_file}: {getattr(exc, 'strerror', None) or exc}") from None
        lines = [line.strip() for line in text.splitlines()]
        found = [line for line in lines if line and not line.startswith("#")]
        if any("," in key for key in found):
            raise ValueError(f"--api-key-file {key_file}: a key holds a comma (keys are one a line)")
        if not found:
            raise ValueError(f"--api-key-file {key_file}: no key in it")
        keys += found
    if keys:
        return ",".join(keys)
    return os.environ.get(API_KEY_ENV) or os.environ.get(LLAMA_API_KEY_ENV) or None


def host_name(header: bytes) -> str:
    """`example.com` of `example.com:8000`, `::1` of `[::1]:8000`, lower case."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def given_key(headers: dict[bytes, bytes]) -> bytes:
    """The key a request sends, read as llama-server reads it: `Authorization`, else Anthropic's
    `X-Api-Key` (which Anthropic's clients send), either with or without a `Bearer ` scheme."""
    given = (headers.get(b"authorization") or headers.get(b"x-api-key") or b"").strip()
    scheme, _, token = given.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else given


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: Host check, API key, bounded body read (see module doc)."""

    def __init__(self, app: Callable, config: GuardConfig) -> None:
        self.app = app
        self.config = config
        # llama-server's `--api-key k1,k2`: any of them opens the server
        self._keys = tuple(key.strip().encode() for key in (config.api_key or "").split(",") if key.strip())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            refusal, receive = await self._read_body(scope, receive)
        if refusal is not None:
            await _send_error(send, shaped_for(scope["path"], refusal))
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if "*" not in self.config.allowed_hosts:
            host = host_name(headers.get(b"host", b""))
            if host not in self.config.allowed_hosts:
                return APIError(
                    400,
                    f"Host header {host!r} is not allowed; start the server with --allowed-hosts to serve it",
                    code="invalid_host",
                )
        if self._keys and needs_api_key(scope["path"]) and not self._key_matches(given_key(headers)):
            return _unauthorized(scope["path"])
        return None

    def _key_matches(self, given: bytes) -> bool:
        return any([hmac.compare_digest(given, key) for key in self._keys])  # each compared, in constant time

    async def _read_body(self, scope: dict, receive: Callable) -> tuple[APIError | None, Callable]:
        """Read the whole body (bounded in size and time); hand the app a receive that replays it."""
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return None, receive
        limit = self.config.max_body_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            return _too_large(limit), receive
        try:
            body = await asyncio.wait_for(_collect(receive, limit), self.config.body_timeout_s)
        except BodyTooLarge:
            return _too_large(limit), receive
        except asyncio.TimeoutError:
            return APIError(
                408,
                f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                code="request_timeout",
            ), receive
        if body is None:  # the client left
            return None, _disconnected
        return None, _replay(body, receive)


async def _collect(receive: Callable, limit: int) -> bytes | None:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _disconnected() -> dict:
    return {"type": "http.disconnect"}


def _unauthorized(path: str) -> APIError:
    """The 401 of a request without the right key: OpenAI's error on its paths, llama-server's own
    (`Invalid API Key`, `authentication_error`) on the others."""
    if openai_path(path):
        message = "Invalid or missing API key: send `Authorization: Bearer KEY` or `X-Api-Key: KEY`"
        return APIError(401, message, code="invalid_api_key")
    return LlamaError(401, "Invalid API Key", type=LLAMA_ERROR_TYPES[401])


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body exceeds the server's limit of {limit / MIB:g} MiB (--max-body-mib)",
        code="request_too_large",
    )


async def _send_error(send: Callable, error: APIError) -> None:
    response = error.response()
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    response.headers["Connection"] = "close"
    await send(
        {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
    )
    await send({"type": "http.response.body", "body": response.body})


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    `header_timeout_s` of it opening or of its previous response (idle and slow-header clients)."""

    class GuardedH11Protocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.close()

    return GuardedH11Protocol


class HeadAsGet:
    """ASGI middleware serving HEAD as GET, as llama-server's cpp-httplib routes it (`wget --spider`
    and `curl -I` health checks): uvicorn, which saw the HEAD, sends the headers without the body."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


def uvicorn_options(config: GuardConfig) -> dict[str, Any]:
    """uvicorn.Config / uvicorn.run keyword arguments that enforce `config`'s connection limits."""
    return {
        "http": guarded_h11(config.header_timeout_s),
        "timeout_keep_alive": config.keep_alive_s,
        "limit_concurrency": config.max_connections,
        "h11_max_incomplete_event_size": 64 * 1024,
    }
