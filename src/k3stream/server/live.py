"""Run the server on a background thread or in a child process (tests, benchmarks, embedding)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """uvicorn serving `app` on `host` (a free port unless one is given) until `stop()`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        from k3stream.server.guard import uvicorn_options

        guard = getattr(app.state, "guard", None)
        options = uvicorn_options(guard) if guard is not None else {}
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, **options
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="k3stream-uvicorn", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServerProcess:
    """`k3stream serve MODEL ...` in a child process on 127.0.0.1, ready once `/health` answers."""

    def __init__(
        self,
        model: str | Path,
        *serve_args: str,
        port: int | None = None,
        log_path: str | Path | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """`launcher`: the command line that takes `serve MODEL ...` (default `python -m k3stream.cli`)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._command = [
            *(launcher or [sys.executable, "-m", "k3stream.cli"]),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *serve_args,
        ]
        self._log_path = Path(log_path) if log_path else None
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServerProcess:
        if self._log_path is None:
            self._process = subprocess.Popen(
                self._command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
        else:
            with open(self._log_path, "wb") as log:
                self._process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`{' '.join(self._command)}` did not come up: {self._log_tail()}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as response:
                return response.status == 200
        except OSError:  # refused, reset, timed out, or an HTTP error status (URLError)
            return False

    def _log_tail(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        return self._log_path.read_text(errors="replace")[-2000:]

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it ended (None while it runs or before it started)."""
        return None if self._process is None else self._process.poll()

    def stop(self, timeout: float = 15.0) -> None:
        """Ctrl-C, as a user stops it; killed if it has not ended after `timeout` seconds."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that must be given a number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
