"""Serving throughput under concurrency: 1, 4 and 16 clients against `k3stream serve` on a tiny model.

    python benchmarks/bench_serve.py [--levels 1,4,16] [--requests-per-client 2] [--max-tokens 32]

Makes a tiny Kimi-K3 (more experts than a tiny test model), packs it with the real packer and serves the
manifest with an expert RAM budget well below the pack, so experts stream from disk. For each level a
fresh server (cold cache) answers `clients x requests-per-client` streamed greedy completions. Prints
aggregate tokens/s, mean time to first token (client side, to the first text), and bytes read from the
pack per generated token (from the server's /metrics, so prefill reads count too). Batching lets one
read serve every sequence routed to that expert, so the last column should fall as clients rise.

Two last lines compare constrained decoding (a JSON-schema `response_format`, llguidance computing the
allowed tokens before every token) with free decoding at batch 1 (target: at most 10% more per token):
the server's own wall time per output token (its /metrics histogram), alternating
`--constrained-requests` pairs on one server; and, robust to a busy machine, this thread's CPU time per
token of the same serving logic (`prepare_chat`, `new_sequence`, decode, choose, accept) in process
with every expert in RAM, and the part of it spent in the grammar (mask and advance).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from k3stream.server.live import ServerProcess
from k3stream.testing.tiny import TinySpec, make_tiny

SPEC = TinySpec(n_layers=6, hidden=128, n_experts=64, top_k=4, expert_ff=64, context_length=512, seed=11)
PROMPTS = [
    "Tell me about",
    "The weather today",
    "In the beginning",
    "Once upon a time",
    "Numbers: 1 2 3",
    "def main():",
    "Dear friend,",
    "A list of fruit:",
]


def build_manifest(workdir: Path) -> Path:
    from k3stream.pack.builder import BuildOptions, build_pack

    manifest = workdir / "tiny.manifest.json"
    if manifest.exists():  # made by an earlier run with --workdir
        return manifest
    gguf = make_tiny(workdir / "model", SPEC)
    build_pack(gguf, workdir / "tiny.pack", manifest, BuildOptions(progress=False))
    return manifest


def ram_budget_mib(manifest: Path, fraction: float) -> tuple[float, float]:
    """(budget, pack size) in MiB: `fraction` of the pack, but at least one layer's experts (one step's
    union, even of a batch of 16, fits)."""
    from k3stream.pack.reader import ExpertPack

    with ExpertPack(manifest) as pack:
        pack_bytes = len(pack.moe_layers) * pack.num_experts * pack.object_bytes
        budget = max(fraction * pack_bytes, pack.num_experts * pack.object_bytes)
    return budget / (1 << 20), pack_bytes / (1 << 20)


def scrape(url: str) -> dict[str, float]:
    """`{name: value}` of the server's /metrics samples, labels written `name{label=value}`."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{key}={value}" for key, value in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


class Client:
    """Runs its share of requests one after another, recording time to first text and token counts."""

    def __init__(self, url: str, model: str, index: int, requests: int, max_tokens: int) -> None:
        self.api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        self.model, self.index, self.requests, self.max_tokens = model, index, requests, max_tokens
        self.ttft: list[float] = []
        self.tokens = 0

    def run(self) -> None:
        for request in range(self.requests):
            prompt = f"{PROMPTS[(self.index + request) % len(PROMPTS)]} #{self.index}.{request}"
            started, first = time.perf_counter(), None
            stream = self.api.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - started
                if chunk.usage is not None:
                    self.tokens += chunk.usage.completion_tokens
            self.ttft.append(first if first is not None else time.perf_counter() - started)


def run_level(
    manifest: Path, clients: int, ram_mib: float, args: argparse.Namespace, log: Path
) -> dict[str, float]:
    serve_args = [
        "--ram-mib",
        str(ram_mib),
        "--max-batch",
        str(max(args.levels)),
        "--max-queue",
        "64",
        "--threads",
        str(args.threads),
    ]
    with ServerProcess(manifest, *serve_args, log_path=log) as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        before = scrape(server.url)
        workers = [
            Client(server.url, model, index, args.requests_per_client, args.max_tokens)
            for index in range(clients)
        ]
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda worker: worker.run(), workers))
        elapsed = time.perf_counter() - started
        after = scrape(server.url)
    generated = after["k3stream_generation_tokens_total"] - before["k3stream_generation_tokens_total"]
    read = after["k3stream_expert_bytes_read_total"] - before["k3stream_expert_bytes_read_total"]
    steps = after["k3stream_decode_batch_size_count"] - before["k3stream_decode_batch_size_count"]
    batch_sum = after["k3stream_decode_batch_size_sum"] - before["k3stream_decode_batch_size_sum"]
    return {
        "clients": clients,
        "tokens": sum(w.tokens for w in workers),
        "tokens_per_s": sum(w.tokens for w in workers) / elapsed,
        "ttft_ms": 1000 * statistics.mean(t for w in workers for t in w.ttft),
        "bytes_per_token": read / generated if generated else 0.0,
        "mean_batch": batch_sum / steps if steps else 0.0,
        "ram_hit_rate": after.get("k3stream_expert_hit_rate{tier=ram}", 0.0),
    }


# a string that cannot end within any request here: every constrained token goes through the grammar
LONG_STRING = {
    "type": "json_schema",
    "json_schema": {"name": "text", "schema": {"type": "string", "minLength": 100000}},
}


def per_token_seconds(api: openai.OpenAI, url: str, model: str, max_tokens: int, **fields) -> float:
    """The server's mean time between successive output tokens over one streamed chat request."""
    before = scrape(url)
    stream = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        **fields,
    )
    for _ in stream:
        pass
    after = scrape(url)
    name = "k3stream_time_per_output_token_seconds"
    count = after[f"{name}_count"] - before[f"{name}_count"]
    return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count


def constrained_cost(
    manifest: Path, ram_mib: float, args: argparse.Namespace, log: Path
) -> tuple[float, float]:
    """(free, constrained) median seconds per output token at batch 1, requests alternating."""
    serve_args = ["--ram-mib", str(ram_mib), "--max-batch", "1", "--threads", str(args.threads)]
    with ServerProcess(manifest, *serve_args, log_path=log) as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        free, constrained = [], []
        for _ in range(args.constrained_requests):
            extra = {"extra_body": {"ignore_eos": True}}
            free.append(per_token_seconds(api, server.url, model, args.max_tokens, **extra))
            constrained.append(
                per_token_seconds(api, server.url, model, args.max_tokens, response_format=LONG_STRING)
            )
    return statistics.median(free), statistics.median(constrained)


class TimedConstraint:
    """A request's constraint, adding up this thread's CPU time inside it."""

    def __init__(self, constraint) -> None:
        self.constraint = constraint
        self.seconds = 0.0

    def allowed(self):
        started = time.thread_time()
        allowed = self.constraint.allowed()
        self.seconds += time.thread_time() - started
        return allowed

    def advance(self, token: int) -> None:
        started = time.thread_time()
        self.constraint.advance(token)
        self.seconds += time.thread_time() - started


def serving_cpu_per_token(served, fields: dict, tokens: int) -> tuple[float, float]:
    """CPU seconds of this thread per decoded token of one chat request without HTTP, and of them the
    seconds inside the grammar."""
    from k3stream.server.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0, **fields}
    )
    prompt = served.prepare_chat(body)
    logic = served.new_sequence(body, prompt.tokens, tokens, chat=prompt)
    timed = logic.constraint = TimedConstraint(logic.constraint) if logic.constraint else None
    state = served.model.new_state()
    token = logic.choose(served.model.prefill(state, prompt.tokens)[-1])
    logic.accept(token)
    started, before = time.thread_time(), timed.seconds if timed else 0.0
    while logic.finish_reason is None:
        token = logic.choose(served.model.decode(state, token))
        logic.accept(token)
    steps = logic.completion_tokens - 1
    grammar = (timed.seconds - before) / steps if timed else 0.0
    return (time.thread_time() - started) / steps, grammar


def constrained_cpu_cost(manifest: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    """Median CPU seconds per token of the serving logic in this process, every expert in RAM (no reads):
    (free, constrained, grammar part of constrained)."""
    import torch

    from k3stream import LoadOptions
    from k3stream.engine.loading import load_runtime
    from k3stream.server.runtime import served_from_runtime

    torch.set_num_threads(args.threads)
    options = LoadOptions(expert_ram_mib=ram_budget_mib(manifest, 1.0)[1] + 1)
    served = served_from_runtime(load_runtime(manifest, options))
    try:
        free, constrained = [], []
        for _ in range(args.constrained_requests):
            free.append(serving_cpu_per_token(served, {"ignore_eos": True}, args.max_tokens)[0])
            constrained.append(
                serving_cpu_per_token(served, {"response_format": LONG_STRING}, args.max_tokens)
            )
    finally:
        served.close()
    return (
        statistics.median(free),
        statistics.median(total for total, _ in constrained),
        statistics.median(grammar for _, grammar in constrained),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ram-fraction", type=float, default=0.3, help="expert RAM budget / pack size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) the model and pack here")
    parser.add_argument(
        "--constrained-requests", type=int, default=5, help="free/constrained pairs at batch 1"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3stream-bench-serve-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        manifest = build_manifest(workdir)
        ram_mib, pack_mib = ram_budget_mib(manifest, args.ram_fraction)
        print(
            f"tiny model: {SPEC.n_layers} layers, {SPEC.n_experts} experts, top-{SPEC.top_k}; "
            f"experts {pack_mib:.2f} MiB, expert RAM budget {ram_mib:.2f} MiB; "
            f"{args.requests_per_client} requests x {args.max_tokens} tokens per client"
        )
        header = (
            ("clients", 7),
            ("tokens", 7),
            ("tok/s", 8),
            ("TTFT ms", 8),
            ("mean batch", 10),
            ("RAM hit", 8),
            ("bytes/token", 12),
        )
        print(" ".join(f"{title:>{width}}" for title, width in header))
        for clients in args.levels:
            row = run_level(manifest, clients, ram_mib, args, workdir / f"serve-{clients}.log")
            print(
                f"{row['clients']:>7} {row['tokens']:>7.0f} {row['tokens_per_s']:>8.1f} "
                f"{row['ttft_ms']:>8.1f} {row['mean_batch']:>10.2f} {row['ram_hit_rate']:>8.1%} "
                f"{row['bytes_per_token']:>12.0f}",
                flush=True,
            )
        free, constrained = constrained_cost(manifest, ram_mib, args, workdir / "serve-constrained.log")
        print(
            f"batch 1, {args.max_tokens} tokens, server wall time: free {1000 * free:.2f} ms/token, "
            f"constrained (JSON schema) {1000 * constrained:.2f} ms/token: {constrained / free - 1:+.1%}"
        )
        free, constrained, grammar = constrained_cpu_cost(manifest, args)
        print(
            f"batch 1, {args.max_tokens} tokens, serving logic CPU time, experts resident: free "
            f"{1000 * free:.2f} ms/token, constrained {1000 * constrained:.2f} ms/token "
            f"({constrained / free - 1:+.1%}), of which the grammar {1e6 * grammar:.0f} us "
            f"({grammar / free:.2%} of a free token)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
