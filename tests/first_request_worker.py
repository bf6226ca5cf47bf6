"""Run as a script: serve a packed tiny model on a uvicorn thread in this fresh interpreter, send two
streamed chat requests, and print (one JSON line) the modules they imported and the threads they started."""

from __future__ import annotations

import http.client
import json
import sys
import threading

from k3stream import LoadOptions
from k3stream.engine.loading import load_runtime
from k3stream.server.app import ServerConfig, create_app
from k3stream.server.live import ServerThread
from k3stream.server.runtime import served_from_runtime


def streamed_chat(port: int, text: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    assert response.read().rstrip().endswith(b"data: [DONE]")
    connection.close()


def main(manifest: str) -> None:
    served = served_from_runtime(load_runtime(manifest, LoadOptions()))
    with ServerThread(create_app(served, ServerConfig(max_batch=2))) as server:
        http.client.HTTPConnection("127.0.0.1", server.port).connect()  # the client's own first-use imports
        before, threads = set(sys.modules), {thread.name for thread in threading.enumerate()}
        for text in ("hello there", "hello again"):  # the second one's tokens have known routes
            streamed_chat(server.port, text)
        imported = sorted(set(sys.modules) - before)
        started = sorted({thread.name for thread in threading.enumerate()} - threads)
    served.close()
    print(json.dumps({"imported": imported, "threads": started}))


if __name__ == "__main__":
    main(sys.argv[1])
