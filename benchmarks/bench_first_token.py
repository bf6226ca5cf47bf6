"""Time to first token of short streamed chat requests against `k3stream serve`, next to the server's own
prefill of each and the model's prefill of the same prompts in process: what is left is overhead.

    python benchmarks/bench_first_token.py [--model demo] [--fresh 3] [--rounds 8] [--clients 4] [--threads 2]

Serves MODEL (default the shipped model) on 127.0.0.1 in a child process and sends streamed chat requests
of a short user message (a different one each request), `max_tokens` 1. Per request, measured at the
client from the moment the request is sent: the response's first byte (its status line), its first event
(the role chunk) and its first content; and the server's prefill of that prompt (`timings.prompt_ms` of
the usage chunk: from the scheduler's admission of the request to its prompt's end). Overhead = first
content less that prefill. Rows: the first request of each of `--fresh` fresh servers, the first
`--clients` requests sent at once to `--fresh` others (first-use costs), then on one warm server
`--rounds` requests one at a time and `--rounds` rounds of `--clients` at once. In process (same threads):
a freshly loaded model's first prefill, then the median of the alone requests' prompts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from k3stream.server.live import ServerProcess

WORDS = ["list", "dict", "path", "time", "json", "math", "sort", "open"]


def message(index: int) -> str:
    """A short user message, different for each request index (the prompt cache cannot restore it)."""
    return f"import {WORDS[index % len(WORDS)]} {index}"


def request_body(index: int, model: str) -> bytes:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message(index)}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    return json.dumps(body).encode()


def timed_request(port: int, model: str, index: int) -> dict[str, float]:
    """Seconds from sending one streamed chat request to its first byte, first event and first content;
    the server's prefill of its prompt (`timings.prompt_ms`: from its admission to its prompt's end);
    and the overhead, its first content less that prefill."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.connect()
    body = request_body(index, model)
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, headers)
    response = connection.getresponse()
    marks = {"first_byte": time.perf_counter() - started}
    if response.status != 200:
        raise RuntimeError(f"status {response.status}: {response.read()[:300]!r}")
    while line := response.readline():
        if not line.startswith(b"data: {"):
            continue
        marks.setdefault("first_event", time.perf_counter() - started)
        chunk = json.loads(line[6:])
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        if "first_content" not in marks and (delta.get("content") or delta.get("reasoning_content")):
            marks["first_content"] = time.perf_counter() - started
        if "timings" in chunk:
            marks["prefill"] = chunk["timings"]["prompt_ms"] / 1000
    connection.close()
    marks["overhead"] = marks["first_content"] - marks["prefill"]
    return marks


def served_rounds(port: int, model: str, rounds: int, clients: int, first_index: int) -> list[list[dict]]:
    """`rounds` rounds of `clients` requests sent at once: each round's requests' marks."""
    results = []
    with ThreadPoolExecutor(clients) as pool:
        for round_index in range(rounds):
            start = first_index + round_index * clients
            results.append(
                list(pool.map(lambda i: timed_request(port, model, i), range(start, start + clients)))
            )
    return results


def first_round(model_name: str, serve_args: list[str], clients: int, first_index: int) -> list[dict]:
    """The marks of a fresh server's first round of `clients` requests."""
    with ServerProcess(model_name, *serve_args) as server:
        return served_rounds(port_of(server), served_name(server), 1, clients, first_index)[0]


def port_of(server: ServerProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


def served_name(server: ServerProcess) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=60)
    connection.request("GET", "/v1/models")
    name = json.loads(connection.getresponse().read())["data"][0]["id"]
    connection.close()
    return name


def prefill_seconds(model_name: str, threads: int, indices: list[int]) -> list[float]:
    """The model's prefill of each request's rendered prompt in this process, from a fresh state; the
    first one is a freshly loaded model's first prefill (as a fresh server's first request's)."""
    from k3stream.cli import calm_openmp

    calm_openmp()  # as the `k3stream` command sets its OpenMP workers, before torch loads
    import torch

    from k3stream import LoadOptions
    from k3stream.commands.demo import demo_gguf
    from k3stream.engine.generate import prefill_last
    from k3stream.engine.loading import load_runtime
    from k3stream.server.runtime import served_from_runtime
    from k3stream.server.schemas import ChatCompletionRequest

    torch.set_num_threads(threads)
    served = served_from_runtime(
        load_runtime(demo_gguf() if model_name == "demo" else model_name, LoadOptions())
    )
    try:
        times = []
        for index in indices:
            body = ChatCompletionRequest.model_validate(json.loads(request_body(index, served.name)))
            tokens = served.prepare_chat(body).tokens
            state = served.model.new_state()
            started = time.perf_counter()
            prefill_last(served.model, state, tokens)
            times.append(time.perf_counter() - started)
        return times
    finally:
        served.close()


def prompt_length(port: int, model: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.loads(request_body(0, model))
    connection.request(
        "POST", "/apply-template", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    prompt = json.loads(connection.getresponse().read())["prompt"]
    connection.request("POST", "/tokenize", json.dumps({"content": prompt}).encode())
    tokens = json.loads(connection.getresponse().read())["tokens"]
    connection.close()
    return len(tokens)


def median_ms(results: list[dict], mark: str) -> float:
    return 1000 * statistics.median(result[mark] for result in results)


def row(title: str, rounds: list[list[dict]]) -> str:
    """Medians over the requests, and over the rounds of each round's last first content."""
    marks = {mark: median_ms([r for requests in rounds for r in requests], mark) for mark in MARKS}
    last = 1000 * statistics.median(max(r["first_content"] for r in requests) for requests in rounds)
    figures = " ".join(f"{marks[mark]:>{width - 3}.1f} ms" for mark, width in zip(MARKS, WIDTHS, strict=True))
    return f"{title:<26} {figures} {last:>10.1f} ms"


MARKS = ("first_byte", "first_event", "first_content", "prefill", "overhead")
TITLES = ("first byte", "first event", "first content", "prefill", "overhead")
WIDTHS = (10, 11, 13, 9, 9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rounds", type=int, default=8, help="requests alone, and rounds of --clients")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fresh", type=int, default=3, help="fresh servers for each first-use figure")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, server and in process")
    args = parser.parse_args()
    serve_args = ["--threads", str(args.threads), "--max-batch", str(max(args.clients, 1))]
    fresh_alone = [first_round(args.model, serve_args, 1, 100 * i) for i in range(args.fresh)]
    fresh_round = [first_round(args.model, serve_args, args.clients, 100 * i + 50) for i in range(args.fresh)]
    with ServerProcess(args.model, *serve_args) as server:
        port, model = port_of(server), served_name(server)
        timed_request(port, model, 10_000)  # its first-use costs are the fresh servers' figures
        alone = served_rounds(port, model, args.rounds, 1, 1000)
        together = served_rounds(port, model, args.rounds, args.clients, 2000)
        prompt_tokens = prompt_length(port, model)
    prefills = prefill_seconds(args.model, args.threads, [0, *range(1000, 1000 + args.rounds)])
    first_ms, one_ms = 1000 * prefills[0], 1000 * statistics.median(prefills[1:])
    print(
        f"{args.model}: chat prompts of {prompt_tokens} tokens, max_tokens 1, {args.threads} threads; "
        f"{args.fresh} fresh servers; {args.rounds} requests alone, {args.rounds} rounds of {args.clients}"
    )
    print(
        f"in process: a fresh model's first prefill {first_ms:.1f} ms, then one prompt {one_ms:.1f} ms "
        f"(median)"
    )
    print(
        "medians over the requests; prefill: the server's own (timings.prompt_ms); overhead: first content "
        "less it; last: a round's last first content"
    )
    header = " ".join(f"{title:>{width}}" for title, width in zip(TITLES, WIDTHS, strict=True))
    print(f"{'':<26} {header} {'last':>13}")
    print(row("fresh server, 1 request", fresh_alone))
    print(row(f"fresh server, {args.clients} at once", fresh_round))
    print(row("1 request", alone))
    print(row(f"{args.clients} at once", together), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
