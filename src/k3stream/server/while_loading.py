"""llama-server's answer while the model loads: every request gets 503 `Loading model`
(`unavailable_error`) on the port the server will serve, so a client polling `/health` sees the server
coming up instead of a refused connection. The listening socket passes to uvicorn once the app is ready;
connections waiting in its backlog then reach the app."""

from __future__ import annotations

import json
import socket
import threading

# a client gets this long to send its request's headers; the replies come one connection at a time
HEAD_TIMEOUT_S = 1.0
MAX_HEAD_BYTES = 16 << 10
LOADING_BODY = json.dumps(
    {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
).encode()


class LoadingReplies:
    """Answers 503 `Loading model` on `listener` from `start()` until `stop()`, which leaves the socket
    listening for the server that takes it."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="k3stream-loading", daemon=True)

    def start(self) -> LoadingReplies:
        self.listener.listen(128)
        self.listener.settimeout(0.1)  # to see `stop()` between connections
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join()
        self.listener.settimeout(None)

    def __enter__(self) -> LoadingReplies:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was closed under us
                return
            with connection:
                _reply(connection)


def _reply(connection: socket.socket) -> None:
    """Read the request's head (bounded in size and time), answer 503 and close."""
    connection.settimeout(HEAD_TIMEOUT_S)
    head = b""
    try:
        while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
            chunk = connection.recv(4096)
            if not chunk:
                return
            head += chunk
        body = b"" if head.startswith(b"HEAD ") else LOADING_BODY
        connection.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
            + f"Content-Length: {len(LOADING_BODY)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
    except OSError:  # a client that left, or sent nothing in time
        return
