"""An agent session with prompt reuse on and off, side by side: per turn TTFT, prompt tokens computed,
snapshot create/restore ms and bytes per tier; then a restart from the same --cache-dir.

    python benchmarks/bench_sessions.py [--model GGUF] [--turns 8] [--system-tokens 2048]
        [--tool-tokens 300,1000] [--answer-tokens 16] [--cache-every 1024] [--threads 2]
        [--every-sweep 256,1024,4096] [--stall-tokens 4096] [--prefill-chunk 256] [--stall-runs 3]
        [--stalls-only] [--beyond-ram LIMIT [--ratio 2.5]]
        [--shared-clients 4 [--shared-tokens 768] [--suffix-tokens 64,192] [--cache-share N] [--rounds 3]
         [--share-sweep 16,32,64,128,256]]

The workload is an agent harness that keeps its token ids: a system prompt with tool schemas of
`--system-tokens` tokens; each turn appends a tool output of 300-1000 tokens (seeded) and the chat
template's assistant opening, answers greedily for `--answer-tokens` tokens, and appends the answer and
the template's close. Reuse off prefills the whole history every turn (what `serve` did); reuse on
restores the deepest snapshot (`engine.prompt_cache`) and prefills the rest. Every turn's answer must be
the same token for token (checked). Runs through the Python API (`PromptCache.prefill`, `model.decode`),
so a history beyond the model's context metadata runs (the shipped model's is 1,024; its MLA is NoPE).
Then the last turn's TTFT with reuse taken apart (its restore, a fixed cost and a cost per token,
beside reuse off's), and a stream beside a `--stall-tokens` prompt sent to `k3stream serve` in its own
process (`--stalls-only`: that alone). The last lines give, by arithmetic from the measured copy
rate, the bytes and ms of one snapshot of Kimi-K3 at its real dimensions and how many sessions a RAM
budget holds.

`--shared-clients N` runs only this: N clients at once send prompts that share a `--shared-tokens`
prefix no snapshot holds (a new one each round) and differ in a suffix of `--suffix-tokens` tokens, to
`k3stream serve` on the shipped model in its own process (`--prefill-chunk` 512, serve's default, and
`--max-batch N`), with in-batch prefix sharing on (`--cache-share`, default serve's) and off
(`--cache-share 0`), the prompt cache on in both, a round of each in turn: per client its TTFT, the time
to all first tokens, the prompt tokens the server computed (/metrics) and whether every answer (text and
logprobs) is the same with sharing on and off. `--share-sweep` times instead the scheduler alone (in
this process, no HTTP: the requests queued together, so every one finds the first one's prefill
running) for each prefix length given, sharing on (`--cache-share 1`) and off: the threshold's measure.

`--beyond-ram LIMIT` runs the session instead on bench_beyond_ram.py's model (512 experts top-8, its
audited experts >= --ratio x LIMIT, its context metadata a bound on the session's tokens:
`session_bound`; written once into its cache), its experts streaming from the pack, in a child memory
cgroup of LIMIT (the model files' page cache dropped first), planned as `k3stream serve PACK
--memory-limit LIMIT --cache-ram MIB --prefill-chunk N --max-batch 1 --ctx C` plans for a context C of
the session's tokens (`--cache-ram`, the session's state and the prefill passes' rows beside the
experts): the same table, with the bytes read from disk during each prefill (`/proc/self/io`), and the
cgroup's peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import k3stream
from k3stream.engine.chat import ChatTemplate
from k3stream.engine.chunked_prefill import ChunkedPrefill, PrefillChunks, attention_rows_per_token
from k3stream.engine.fingerprints import model_fingerprint
from k3stream.engine.prompt_cache import DEFAULT_EVERY, PromptCache
from k3stream.engine.tokenizer import Tokenizer
from k3stream.gguf.reader import K3Checkpoint
from k3stream.memlimit import GIB, MIB, format_size, parse_size
from k3stream.quant.kernels import set_row_exact
from k3stream.server.app import PREFILL_PASS_PROMPTS
from k3stream.server.scheduler import DEFAULT_PREFILL_CHUNK
from k3stream.testing.cgroups import ChildCgroup, drop_page_cache, read_process_io

SHIPPED = Path(k3stream.__file__).parent / "data" / "k3-stdlib-audited.gguf"
# Kimi-K3 (docs: /reference/kimi-k3-architecture.md): 69 KDA layers of 96 heads x 128, conv 4; 24 MLA
# layers of kv_lora 512 + rope 64; vocabulary 163,840
REAL = dict(kda_layers=69, heads=96, head_dim=128, conv=4, mla_layers=24, latent_width=576, vocab=163840)


@dataclass
class Turn:
    prompt_tokens: int
    computed: int
    ttft_s: float
    cpu_s: float  # CPU time of the prefill, all threads: robust to other processes on the machine
    answer: list[int]
    created: int = 0
    create_ms: float = 0.0
    restore_ms: float = 0.0
    ram_bytes: int = 0
    disk_bytes: int = 0
    read_bytes: int = 0  # read from storage during the prefill (pack, snapshot files)


@dataclass
class Workload:
    system: list[int]
    tools: list[list[int]]
    assistant_open: list[int]
    close: list[int]
    turns: list[Turn] = field(default_factory=list)


def build_workload(tokenizer: Tokenizer, args: argparse.Namespace) -> Workload:
    """Token ids of the system prompt (tool schemas) and of each turn's tool output, seeded."""
    rng = random.Random(args.seed)
    template = ChatTemplate.for_tokenizer(tokenizer)
    schemas = [
        {
            "name": f"tool_{i}",
            "description": " ".join(rng.choices(WORDS, k=24)),
            "parameters": {"type": "object"},
        }
        for i in range(64)
    ]
    system_text = template.render([{"role": "system", "content": "You are an agent."}], tools=schemas)
    system = tokenizer.encode(system_text, allow_special=True)
    while len(system) < args.system_tokens:
        system += tokenizer.encode(" ".join(rng.choices(WORDS, k=64)))
    low, high = (int(x) for x in args.tool_tokens.split(","))
    tools = []
    for turn in range(args.turns + 1):  # the last for the turn after the restart
        text = template.render(
            [{"role": "tool", "tool_call_id": f"call_{turn}", "content": "x"}], add_generation_prompt=False
        )
        body = tokenizer.encode(" ".join(rng.choices(WORDS, k=high)))[: rng.randint(low, high)]
        tools.append(
            tokenizer.encode(text, allow_special=True)[:-3]
            + body
            + tokenizer.encode(text, allow_special=True)[-3:]
        )
    opening = template.render([{"role": "user", "content": ""}], add_generation_prompt=True)
    opening_ids = tokenizer.encode(opening, allow_special=True)
    bare = tokenizer.encode(
        template.render([{"role": "user", "content": ""}], add_generation_prompt=False), allow_special=True
    )
    close = tokenizer.encode(
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", allow_special=True
    )
    return Workload(system[: args.system_tokens], tools, opening_ids[len(bare) :], close)


WORDS = (
    "file",
    "path",
    "line",
    "error",
    "result",
    "value",
    "status",
    "request",
    "response",
    "json",
    "list",
    "object",
    "string",
    "number",
    "token",
    "search",
    "query",
    "read",
    "write",
    "open",
    "close",
    "build",
    "test",
    "run",
    "check",
    "commit",
    "branch",
    "merge",
    "diff",
    "patch",
    "config",
)


def run_sessions(model, workload: Workload, args, cache: PromptCache):
    """The session with reuse on and off, a turn of each in turn (so a busy machine slows both alike);
    off is the engine without a cache, computing as `serve --cache-ram 0` does (row-exact products)."""
    context, on, off = list(workload.system), [], []
    for turn in range(args.turns):
        context += workload.tools[turn] + workload.assistant_open
        on.append(one_turn(model, context, cache, args))
        off.append(one_turn(model, context, None, args))
        context += on[-1].answer + workload.close
    return on, off


def one_turn(model, context: list[int], cache: PromptCache | None, args) -> Turn:
    """One turn's prefill (whole, or in `serve`'s passes of a prompt alone where experts stream from a
    pack: the rows its memory plan holds for a pass) and greedy answer of --answer-tokens."""
    set_row_exact(True)  # a cache's products, and `serve`'s without one (`keep_row_exact`)
    before, read_before = _stats(cache), read_process_io()["read_bytes"]
    start, cpu_start = time.perf_counter(), time.process_time()
    prefill = ChunkedPrefill(model, context, cache)
    chunks = PrefillChunks(args.pass_rows if args.pack else max(len(context), 1))
    while not prefill.step(chunks):
        pass
    state, logits, computed = prefill.state, prefill.logits, len(context) - prefill.reused
    ttft, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    read = read_process_io()["read_bytes"] - read_before
    answer = [int(logits.argmax())]
    prefill.keep_end()  # the prompt's end, once the first token is out (as `serve` does)
    while len(answer) < args.answer_tokens:
        answer.append(int(model.decode(state, answer[-1]).argmax()))
    if cache is not None:
        cache.save(context + answer[:-1], state, final=True)
        cache.flush()  # the files of this turn written, for the disk figures
    after = _stats(cache)
    turn = Turn(len(context), computed, ttft, cpu, answer, read_bytes=read)
    if cache is not None:
        turn.created = after["created"] - before["created"]
        turn.create_ms = 1e3 * (after["create_s"] - before["create_s"])
        turn.restore_ms = 1e3 * (after["restore_s"] - before["restore_s"])
        turn.ram_bytes, turn.disk_bytes = cache.ram_bytes, cache.disk_used
    return turn


def _stats(cache: PromptCache | None) -> dict[str, float]:
    if cache is None:
        return {}
    s = cache.stats
    return {"created": s.snapshots_created, "create_s": s.create_s, "restore_s": s.restore_s}


def repeated_sessions(model, workload: Workload, args, fingerprint: str, cache_dir: str):
    """`args.repeats` sessions, each with a new cache (in `cache_dir/run<i>`): the first session's turns
    with each turn's least TTFT and CPU time over the runs (this machine's other load only adds)."""
    best: tuple[list[Turn], list[Turn]] | None = None
    for run in range(args.repeats):
        directory = Path(cache_dir) / f"run{run}"
        cache = PromptCache(
            model, fingerprint, int(args.cache_ram * MIB), directory, 4 * GIB, args.cache_every
        )
        sides = run_sessions(model, workload, args, cache)
        cache.close()
        if best is None:
            best = sides
            continue
        for kept, new in zip(best, sides, strict=True):
            for turn, again in zip(kept, new, strict=True):
                turn.ttft_s, turn.cpu_s = min(turn.ttft_s, again.ttft_s), min(turn.cpu_s, again.cpu_s)
    return best


def print_side_by_side(on: list[Turn], off: list[Turn]) -> None:
    print(
        f"{'turn':>4} {'prompt':>7} | {'off: computed':>13} {'TTFT ms':>8} {'CPU ms':>8} | "
        f"{'on: computed':>12} {'TTFT ms':>8} {'CPU ms':>8} {'ratio':>6} | {'snaps':>5} {'create ms':>9} "
        f"{'restore ms':>10} {'RAM MiB':>8} {'disk MiB':>8} | {'read MiB off':>12} {'on':>6} | same"
    )
    for i, (a, b) in enumerate(zip(on, off, strict=True), 1):
        print(
            f"{i:>4} {a.prompt_tokens:>7} | {b.computed:>13} {1e3 * b.ttft_s:>8.1f} "
            f"{1e3 * b.cpu_s:>8.1f} | {a.computed:>12} {1e3 * a.ttft_s:>8.1f} {1e3 * a.cpu_s:>8.1f} "
            f"{a.cpu_s / b.cpu_s:>6.3f} | {a.created:>5} {a.create_ms:>9.2f} {a.restore_ms:>10.2f} "
            f"{a.ram_bytes / MIB:>8.2f} {a.disk_bytes / MIB:>8.2f} | {b.read_bytes / MIB:>12.1f} "
            f"{a.read_bytes / MIB:>6.1f} | {a.answer == b.answer}"
        )


def real_model_arithmetic(copy_bytes_per_s: float, ram_gib: float, session_tokens: int) -> list[str]:
    r = REAL
    fixed = (
        r["kda_layers"]
        * (r["heads"] * r["head_dim"] ** 2 + 3 * r["heads"] * r["head_dim"] * (r["conv"] - 1))
        * 4
    )
    fixed_logits = fixed + 4 * r["vocab"]
    per_token = r["mla_layers"] * r["latent_width"] * 4
    session = 2 * fixed_logits + per_token * session_tokens  # prompt end and response end share the rows
    return [
        f"Kimi-K3 at its real dimensions: a snapshot is {fixed_logits / MIB:.0f} MiB of KDA state and logits "
        f"plus {per_token / 1024:.1f} KiB of MLA latents per token (shared along one conversation)",
        f"  at the copy rate measured here ({copy_bytes_per_s / GIB:.2f} GiB/s) one snapshot takes "
        f"{1e3 * fixed_logits / copy_bytes_per_s:.0f} ms; a restore of a {session_tokens}-token session "
        f"{1e3 * fixed / copy_bytes_per_s:.0f} ms where the turn continues its conversation's latent "
        f"buffer, {1e3 * (fixed + per_token * session_tokens) / copy_bytes_per_s:.0f} ms for a branch "
        f"(its rows copied)",
        f"  a {session_tokens}-token session's two live snapshots hold {session / GIB:.2f} GiB: "
        f"--cache-ram {ram_gib:.0f} GiB holds {int(ram_gib * GIB // session)} such sessions",
    ]


def measure_copy_rate() -> float:
    source = torch.randn(64 << 20 >> 2)
    start = time.perf_counter()
    for _ in range(4):
        source.clone()
    return 4 * source.numel() * 4 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(SHIPPED))
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--tool-tokens", default="300,1000")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--cache-every", type=int, default=DEFAULT_EVERY)
    parser.add_argument("--cache-ram", type=float, default=1024.0, help="MiB")
    parser.add_argument(
        "--every-sweep", default="256,1024,4096", help="--cache-every values to time (empty: none)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="sessions run; each turn's least time is shown"
    )
    parser.add_argument(
        "--stall-tokens", type=int, default=4096, help="the long prompt beside a stream (0: skip)"
    )
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--stall-runs", type=int, default=3, help="runs with the long prompt in chunks")
    parser.add_argument(
        "--stalls-only", action="store_true", help="only the stream beside a long prompt (a served model)"
    )
    parser.add_argument(
        "--beyond-ram", default=None, metavar="LIMIT", help="the beyond-memory model in a cgroup of LIMIT"
    )
    parser.add_argument("--ratio", type=float, default=2.5, help="--beyond-ram: model bytes / limit")
    parser.add_argument("--pack", default=None, help=argparse.SUPPRESS)  # the cgroup's child: its pack
    parser.add_argument("--shared-clients", type=int, default=0, help="clients sharing a prefix (0: skip)")
    parser.add_argument("--shared-tokens", type=int, default=768, help="--shared-clients: the prefix")
    parser.add_argument("--suffix-tokens", default="64,192", help="--shared-clients: each one's own part")
    parser.add_argument("--cache-share", type=int, default=None, help="--shared-clients: serve's, on")
    parser.add_argument("--rounds", type=int, default=3, help="--shared-clients: rounds of on and off")
    parser.add_argument("--share-sweep", default="", help="--shared-clients: prefix lengths, scheduler only")
    args = parser.parse_args()
    if args.beyond_ram and args.pack is None:
        beyond_ram(args)
        return
    torch.set_num_threads(args.threads)
    if args.shared_clients:
        share_sweep(args) if args.share_sweep else shared_prefixes(args)
        return
    if args.stalls_only:
        stalls(args)
        return
    tokenizer = Tokenizer.from_gguf(args.model)
    workload = build_workload(tokenizer, args)
    runtime = streamed(args, session_tokens(workload, args)) if args.pack else None
    model = runtime.model if runtime else k3stream.load(args.model)
    fingerprint = model_fingerprint(K3Checkpoint.open(args.model).shards)
    print(f"model {args.model} (context metadata {model.config.context_length}); {args.threads} threads; "
          f"system prompt {len(workload.system)} tokens, tool outputs "
          f"{[len(t) for t in workload.tools[: args.turns]]}")  # fmt: skip
    model.prefill_last(model.new_state(), workload.system[:64])  # warm
    with tempfile.TemporaryDirectory() as cache_dir:
        on, off = repeated_sessions(model, workload, args, fingerprint, cache_dir)
        print(f"\nreuse on (--cache-every {args.cache_every}) and off, side by side")
        print(f"(each turn's least time of {args.repeats} runs; ratio: CPU time on / off):")
        print_side_by_side(on, off)
        same = all(a.answer == b.answer for a, b in zip(on, off, strict=True))
        print(
            f"TTFT at turn {args.turns}: on/off = {on[-1].ttft_s / off[-1].ttft_s:.3f} wall, "
            f"{on[-1].cpu_s / off[-1].cpu_s:.3f} CPU; answers equal every turn: {same}"
        )
        restart(model, workload, args, fingerprint, cache_dir, on)
    if runtime is None:
        last_turn_profile(model, workload, args, fingerprint, on)
        chat_prompt_times(args)
    if runtime is not None:  # the other parts run models of their own
        print(f"pack read by the expert store: {runtime.store.stats()['pack_read_bytes'] / MIB:.0f} MiB")
        print(f"process peak resident memory (VmHWM): {_peak_resident() / MIB:.0f} MiB")
        runtime.close()
        return
    sweep(model, workload, args, fingerprint)
    if args.stall_tokens:
        stalls(args)
        shared_reads(args)
    rate = measure_copy_rate()
    print()
    for line in real_model_arithmetic(rate, 64, 32768):
        print(line)


def beyond_ram(args) -> None:
    """This script again, on the beyond-memory model, in a child memory cgroup of `--beyond-ram`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_beyond_ram import DEFAULT_CACHE, ensure_model, model_files, model_spec

    limit = parse_size(args.beyond_ram)
    spec = replace(model_spec(limit, args.ratio), context_length=session_bound(args))
    gguf, manifest = ensure_model(spec, DEFAULT_CACHE)
    files = model_files(gguf, manifest)
    print(
        f"beyond memory: {gguf.name}, experts {format_size(files[1].stat().st_size)} in the pack, "
        f"{spec.n_layers} layers, {spec.n_experts} experts top-{spec.top_k}; cgroup limit "
        f"{format_size(limit)}, --memory-limit the same, --cache-ram {args.cache_ram:g} MiB in its plan",
        flush=True,
    )
    cgroup = ChildCgroup.create(f"bench-sessions-{os.getpid()}", limit)
    if isinstance(cgroup, str):
        print(f"bench_sessions --beyond-ram: skipped: {cgroup}")
        return
    command = [sys.executable, "-u", __file__, *sys.argv[1:], "--model", str(gguf), "--pack", str(manifest)]
    try:
        drop_page_cache(*files)
        done = subprocess.run(command, preexec_fn=cgroup.join)
        usage = cgroup.usage()
    finally:
        cgroup.remove()
    peak = usage["peak_bytes"] or 0
    print(
        f"cgroup: exit status {done.returncode}, peak {peak / MIB:.0f} MiB of {limit / MIB:.0f} MiB, "
        f"limit hit {usage['limit_hits']} times, OOM kills {usage['oom_kills']}"
    )


def _peak_resident() -> int:
    """This process's peak resident set (VmHWM), in bytes: the plan's terms but the page cache's."""
    line = next(
        line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")
    )
    return int(line.split()[1]) * 1024


def session_bound(args) -> int:
    """A power of two above the session's tokens (the system prompt and every turn's longest tool
    output, template and answer, twice over): the beyond-memory model's context metadata, so that
    `serve`'s plan can be given the session's context."""
    turn = max(int(x) for x in args.tool_tokens.split(",")) + args.answer_tokens
    return 1 << math.ceil(math.log2(2 * (args.system_tokens + (args.turns + 1) * turn)))


def session_tokens(workload: Workload, args) -> int:
    """The tokens the session reaches: its system prompt, every turn's tool output (the one after the
    restart too), template and answer."""
    turn = len(workload.assistant_open) + args.answer_tokens + len(workload.close)
    return len(workload.system) + sum(map(len, workload.tools[: args.turns + 1])) + (args.turns + 1) * turn


def streamed(args, ctx: int):
    """The runtime `k3stream serve PACK --memory-limit LIMIT --cache-ram MIB --prefill-chunk N --max-batch 1
    --ctx CTX` would load: serve's flags and memory plan (the session's state and its prefill passes'
    rows among them)."""
    from k3stream.commands import serve
    from k3stream.commands.flags import runtime_from_args

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    served = [args.pack, "--memory-limit", args.beyond_ram, "--threads", str(args.threads), "--device", "cpu"]
    served += ["--cache-ram", f"{args.cache_ram:g}", "--prefill-chunk", str(args.prefill_chunk)]
    serve_args = parser.parse_args([*served, "--max-batch", "1", "--ctx", str(ctx)])
    runtime = runtime_from_args(serve_args)
    args.pass_rows = serve_args.prefill_pass.tokens  # the pass its plan holds: a prompt alone takes it
    print(f"a prompt alone takes passes of {args.pass_rows} rows", flush=True)
    return runtime


def restart(model, workload: Workload, args, fingerprint: str, cache_dir: str, on: list[Turn]) -> None:
    """Turn 9 in a new cache on the same directory (an empty RAM tier): it reuses turn 8's state."""
    context = list(workload.system)
    for turn in range(args.turns):
        context += workload.tools[turn] + workload.assistant_open + on[turn].answer + workload.close
    context += workload.tools[args.turns] + workload.assistant_open
    directory = Path(cache_dir) / "run0"
    restarted = PromptCache(
        model, fingerprint, int(args.cache_ram * MIB), directory, 4 * GIB, args.cache_every
    )
    warm = one_turn(model, context, restarted, args)
    cold = one_turn(model, context, None, args)
    print(
        f"after a restart on the same cache dir, turn {args.turns + 1}: {warm.prompt_tokens} prompt tokens, "
        f"{warm.computed} computed (restore from disk {warm.restore_ms:.1f} ms), TTFT "
        f"{1e3 * warm.ttft_s:.1f} ms (CPU {1e3 * warm.cpu_s:.1f}) against {1e3 * cold.ttft_s:.1f} ms "
        f"(CPU {1e3 * cold.cpu_s:.1f}) with reuse off; same answer: {warm.answer == cold.answer}"
    )


def last_turn_profile(model, workload: Workload, args, fingerprint: str, on: list[Turn]) -> None:
    """What the last turn's TTFT with reuse is made of, in CPU time (least of --repeats + 2, the sides
    alternating): its restore; prefills over the restored history of a few new tokens to all of the
    turn's, and cold prefills of a few lengths up to the whole prompt (reuse off's products): a line
    through each gives its fixed cost and its cost per token. Then the turn's new tokens over the
    restored history with MLA's batched attention (not row-exact: its time only), the prompt-end
    snapshot (taken after the first token) and one new token (a pass's own cost)."""
    context = list(workload.system)
    for turn in range(args.turns - 1):
        context += workload.tools[turn] + workload.assistant_open + on[turn].answer + workload.close
    history = len(context) - len(workload.close) - 1  # the last response's end: its snapshot's
    context += workload.tools[args.turns - 1] + workload.assistant_open
    new = len(context) - history
    cache = PromptCache(model, fingerprint, 1 << 30)
    model.prefill_last(model.new_state(), context[:history])  # warm
    cache.prefill(context[:history])
    counts = sorted({1, min(25, new), new // 4, new // 2, new})
    lengths = sorted({min(25, len(context)), len(context) // 4, len(context) // 2, len(context)})
    restores: list[float] = []
    ends: list[float] = []

    def restored(count: int, exact: bool = True, chunks: PrefillChunks | None = None) -> float:
        """The turn as the session runs it: from a snapshot of the history whose rows end its buffer (in
        one pass, or in `chunks`)."""
        one = PromptCache(model, fingerprint, 1 << 30)
        one.save(context[:history], cache.restore_longest(context[:history])[0])
        set_row_exact(exact)
        start = time.process_time()
        prefill = ChunkedPrefill(model, context[: history + count], one)
        restores.append(time.process_time() - start)
        while not prefill.step(chunks or PrefillChunks(len(context))):
            pass
        took = time.process_time() - start
        set_row_exact(True)
        start = time.process_time()
        prefill.keep_end()
        ends.append(time.process_time() - start)
        one.close()
        return took

    def cold(length: int, chunks: PrefillChunks | None = None) -> float:
        """Reuse off as `serve --cache-ram 0` computes it (row-exact products, set above)."""
        start = time.process_time()
        prefill = ChunkedPrefill(model, context[:length])
        while not prefill.step(chunks or PrefillChunks(length)):
            pass
        return time.process_time() - start

    runs = [(("on", n), restored) for n in counts] + [(("off", n), cold) for n in lengths]
    runs.append((("inexact", new), lambda n: restored(n, exact=False)))
    rows = attention_rows_per_token(model.config)
    served = PrefillChunks(DEFAULT_PREFILL_CHUNK, rows)  # beside a running stream
    alone = PrefillChunks(DEFAULT_PREFILL_CHUNK * PREFILL_PASS_PROMPTS, rows)  # no stream decoding
    runs.append((("served on", new), lambda n: restored(n, chunks=served)))
    runs.append((("served off", len(context)), lambda n: cold(n, served)))
    runs.append((("alone on", new), lambda n: restored(n, chunks=alone)))
    runs.append((("alone off", len(context)), lambda n: cold(n, alone)))
    times: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats + 2):
        for key, run in runs:
            times[key] = min(times.get(key, math.inf), run(key[1]))
    cache.close()
    on_fixed, on_token = _line([(n, times[("on", n)]) for n in counts if n > 1])
    off_fixed, off_token = _line([(n, times[("off", n)]) for n in lengths])
    whole_on, whole_off, inexact = times[("on", new)], times[("off", len(context))], times[("inexact", new)]
    print(
        f"\nturn {args.turns} with reuse, in CPU time (least of {args.repeats + 2}): {1e3 * whole_on:.1f} ms "
        f"for {new} new tokens over {history} restored, against {1e3 * whole_off:.1f} ms for all "
        f"{len(context)} with reuse off ({whole_on / whole_off:.3f}x; tokens {new / len(context):.3f}x); "
        f"the restore alone {1e3 * min(restores):.2f} ms, the prompt-end snapshot (after the first "
        f"token) {1e3 * min(ends):.2f} ms"
    )
    print(
        f"  on: {1e3 * on_fixed:.2f} ms fixed + {1e6 * on_token:.1f} us a token (prefills of "
        f"{', '.join(map(str, counts[1:]))} new tokens); off: {1e3 * off_fixed:.2f} ms fixed + "
        f"{1e6 * off_token:.1f} us a token (prefills of {', '.join(map(str, lengths))}); one new token "
        f"over the history {1e3 * times[('on', 1)]:.2f} ms"
    )
    print(
        f"  the same {new} tokens over the restored history with batched MLA queries (torch's "
        f"products; not row-exact): {1e3 * inexact:.1f} ms "
        f"({inexact / whole_off:.3f}x of reuse off): row-exact attention costs "
        f"{1e3 * (whole_on - inexact):.1f} ms "
        f"({whole_on / inexact - 1:+.0%})"
    )
    for label, chunks, key in (
        (f"alone (no stream decoding: passes of {alone.tokens} rows)", alone, "alone"),
        (f"beside a running stream (chunks of {served.tokens})", served, "served"),
    ):
        on_served, off_served = times[(f"{key} on", new)], times[(f"{key} off", len(context))]
        print(
            f"  in `serve`'s passes (--prefill-chunk {DEFAULT_PREFILL_CHUNK}, cut by equal work), {label}: "
            f"reuse on {_passes(chunks, history, len(context))} passes, {1e3 * on_served:.1f} ms; off "
            f"{_passes(chunks, 0, len(context))} passes, {1e3 * off_served:.1f} ms "
            f"({on_served / off_served:.3f}x)"
        )


def _passes(chunks: PrefillChunks, start: int, end: int) -> int:
    """How many of `chunks`' passes a prefill of positions start..end takes."""
    count = 0
    while start < end:
        start, count = chunks.next_end(start, end), count + 1
    return count


def chat_prompt_times(args) -> None:
    """What `serve` spends on a chat turn's prompt before the model: an agent conversation of --turns
    turns (64 tool schemas, tool outputs of --tool-tokens words) rendered and tokenized
    (`ServedModel.encode_chat`), with an empty memo and then again, as the next turn finds it."""
    from k3stream.engine.loading import load_runtime
    from k3stream.server.runtime import TextMemo, served_from_runtime

    rng = random.Random(args.seed)
    served = served_from_runtime(load_runtime(args.model, stream_experts=False))
    functions = [
        {
            "name": f"tool_{i}",
            "description": " ".join(rng.choices(WORDS, k=24)),
            "parameters": {"type": "object"},
        }
        for i in range(64)
    ]
    tools = [{"type": "function", "function": function} for function in functions]
    messages = [{"role": "system", "content": "You are an agent."}]
    for turn in range(args.turns):
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "tool_1", "arguments": "{}"}}
        messages += [
            {"role": "user", "content": "next"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": " ".join(rng.choices(WORDS, k=700))},
            {"role": "assistant", "content": "done " * 10},
        ]
    cold, warm = math.inf, math.inf
    for _ in range(5):
        served.pieces = TextMemo(served.pieces.max_chars)
        start = time.perf_counter()
        ids = served.encode_chat(messages, tools)
        middle = time.perf_counter()
        served.encode_chat(messages, tools)
        cold, warm = min(cold, middle - start), min(warm, time.perf_counter() - middle)
    served.close()
    print(
        f"\na chat turn's prompt in `serve` ({len(ids)} tokens, {len(messages)} messages, 64 tools): "
        f"rendered and tokenized in {1e3 * cold:.2f} ms, {1e3 * warm:.2f} ms with its history's pieces "
        f"in the memo (least of 5)"
    )


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares line through `points`: (intercept, slope)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def sweep(model, workload: Workload, args, fingerprint: str) -> None:
    """Prefill of the whole 8-turn history from nothing with snapshots every N tokens against none: the
    overhead of taking them, and what they hold."""
    values = [int(v) for v in args.every_sweep.split(",") if v]
    if not values:
        return
    context = list(workload.system)
    for tool in workload.tools[: args.turns]:
        context += tool
    set_row_exact(True)
    base = _best_of(3, lambda: model.prefill_last(model.new_state(), context))
    print(
        f"\n--cache-every sweep: one prefill of {len(context)} tokens, {1e3 * base:.1f} CPU ms, no snapshots"
    )
    for every in values:
        caches = iter([PromptCache(model, fingerprint, 1 << 40, every=every) for _ in range(3)])
        cache = None

        def run(fresh=caches) -> None:
            nonlocal cache
            cache = next(fresh)
            cache.prefill(context)

        took = _best_of(3, run)
        print(
            f"  every {every:>5}: {1e3 * took:8.1f} ms ({took / base - 1:+.1%}), "
            f"{cache.stats.snapshots_created} snapshots, {cache.ram_bytes / MIB:.2f} MiB, "
            f"a branch recomputes at most {every} tokens"
        )


def stalls(args) -> None:
    """A client streaming while another sends a `--stall-tokens` prompt to `k3stream serve` in its own
    process (prompt cache on, its default), the prompt prefilled whole, then `--stall-runs` times in
    `--prefill-chunk` chunks: the stream's longest gaps at the client, between the server's sends and
    in the scheduler, against one chunk's prefill (the prompt's first `--prefill-chunk` tokens, timed
    between the runs in this process), one chunk's pass alone in the same server and the run's median
    pass; the run's longest pass (its chunk, wall and CPU time, and who ran and who waited for a CPU
    meanwhile) and the server's garbage collections during the prompt. Then each chunk's time along the
    prompt, cut every `--prefill-chunk` tokens and by equal work (`PrefillChunks`). A tiny model with a
    long enough context (the shipped one's is 1,024)."""
    from k3stream.engine.loading import load_runtime
    from k3stream.testing.tiny import TinySpec, make_tiny

    with tempfile.TemporaryDirectory() as directory:
        spec = TinySpec(
            n_layers=6, hidden=128, n_experts=64, top_k=4, expert_ff=64, context_length=8192, seed=11
        )
        path = make_tiny(Path(directory), spec)
        generator = torch.Generator().manual_seed(args.seed)
        long_prompt = torch.randint(10, 500, (args.stall_tokens,), generator=generator).tolist()
        model = load_runtime(path, stream_experts=False).model
        row_exact = PromptCache(model, "row-exact", MIB)  # open: the products as a served cache has them
        first_chunk = long_prompt[: args.prefill_chunk]
        model.prefill_last(model.new_state(), first_chunk)  # warm
        print(
            f"\na stream beside a {args.stall_tokens}-token prompt (tiny model, context 8192, cache on; "
            f"`k3stream serve --threads {args.threads}` in its own process, the clients in this one):"
        )
        alone, runs = [], []
        settings = [("whole prompt", 1 << 30)] + [
            (f"--prefill-chunk {args.prefill_chunk}", args.prefill_chunk)
        ] * args.stall_runs
        for label, chunk in settings:
            lone = [] if chunk > args.stall_tokens else _lone_chunks(generator, len(first_chunk))
            runs.append((label, stream_beside(path, long_prompt, chunk, args.threads, lone)))
            alone.append(_least(3, lambda: model.prefill_last(model.new_state(), first_chunk)))
        one, one_cpu = min(wall for wall, _ in alone), min(cpu for _, cpu in alone)
        for label, stall in runs:
            longest = ", ".join(f"{1e3 * gap:.0f}" for gap in sorted(stall.gaps)[::-1][:3])
            typical = sorted(stall.passes)[len(stall.passes) // 2]
            print(
                f"  {label:>28}: {len(stall.passes)} passes (median {1e3 * typical:.0f} ms, longest "
                f"{1e3 * max(stall.passes):.0f}); the stream's longest gaps at the client {longest} ms, "
                f"sent {1e3 * max(stall.sent_gaps):.0f}, in the scheduler {1e3 * max(stall.steps):.0f}: "
                f"{max(stall.gaps) / one:.2f}x, {max(stall.sent_gaps) / one:.2f}x and "
                f"{max(stall.steps) / one:.2f}x one chunk alone; {max(stall.gaps) / typical:.2f}x, "
                f"{max(stall.sent_gaps) / typical:.2f}x and {max(stall.steps) / typical:.2f}x the median "
                f"pass; the long prompt's TTFT {stall.prefill_s:.2f} s"
                + _against_beside(stall)
                + _against_lone(stall)
            )
            print(f"  {'':>28}  {_longest_pass(stall, one_cpu)}")
            print(f"  {'':>28}  {_longest_gap(stall)}")
        print(
            f"  one {args.prefill_chunk}-token chunk alone: {1e3 * one:.1f} ms, {1e3 * one_cpu:.1f} ms the "
            f"calling thread's CPU (least of {3 * len(alone)})"
        )
        chunk_times(model, long_prompt, args.prefill_chunk)
        row_exact.close()


def _lone_chunks(generator: torch.Generator, tokens: int) -> list[list[int]]:
    """Six prompts of `tokens` random ids (none shares a prefix with the long prompt to restore)."""
    return [torch.randint(10, 500, (tokens,), generator=generator).tolist() for _ in range(6)]


def _against_beside(stall: Stall) -> str:
    """The stream's longest gap at the client against one chunk's pass beside the stream in the same
    server (the median of the chunk prompts' passes after the long prompt): what one chunk costs where
    the long prompt's chunks ran."""
    if not stall.beside_passes:
        return ""
    one = sorted(stall.beside_passes)[len(stall.beside_passes) // 2]
    spread = ", ".join(f"{1e3 * took:.1f}" for took in sorted(stall.beside_passes))
    return f"; {max(stall.gaps) / one:.2f}x one chunk's pass beside the stream ({spread} ms: the median)"


def _against_lone(stall: Stall) -> str:
    """The stream's longest gap at the client against one chunk's pass alone in the same server (its
    OpenMP threads as `serve` runs them: asleep between parallel regions, each woken per region)."""
    if not stall.lone_pass:
        return ""
    return (
        f"; {max(stall.gaps) / stall.lone_pass:.2f}x one chunk alone in the server "
        f"({1e3 * stall.lone_pass:.1f} ms, least of 3)"
    )


def _longest_pass(stall: Stall, one_cpu: float) -> str:
    """The run's longest pass (its chunks, wall and CPU time), the scheduler thread's most CPU time
    between two decode steps (what other processes on the machine hardly change) against one chunk's
    alone, and the collections the server ran."""
    wall, cpu, blocked, preempted, *spans = stall.longest
    chunks = ", ".join(f"{int(a)}..{int(b)}" for a, b in zip(spans[::2], spans[1::2], strict=True))
    full = [took for took, generation in stall.collections if generation == 2]
    blocks, preemptions = sorted(b for b, _ in stall.switches), sorted(p for _, p in stall.switches)
    typical = [counts[len(counts) // 2] if counts else 0 for counts in (blocks, preemptions)]
    return (
        f"longest pass: positions {chunks or '-'}, {1e3 * wall:.1f} ms ({1e3 * cpu:.1f} ms the "
        f"scheduler thread's CPU; it blocked {int(blocked)} times and was preempted {int(preempted)}, "
        f"in the median pass {typical[0]} and {typical[1]}); its CPU between decode steps at most "
        f"{1e3 * max(stall.step_cpu):.1f} "
        f"ms, {max(stall.step_cpu) / one_cpu:.2f}x one chunk's alone; the server's collections "
        f"meanwhile {len(stall.collections)}, the longest "
        f"{1e3 * max((t for t, _ in stall.collections), default=0):.1f} ms, {len(full)} full"
        + _where_cpu_went(stall.longest_threads)
    )


def _where_cpu_went(times: dict[str, tuple[float, float]]) -> str:
    """Who ran and who waited for a CPU from the start of the pass before the stream's longest wait in
    the scheduler to its decode step (/proc's schedstat: run time, and run-queue delay: ready to run
    while something else held every CPU)."""
    if not times:
        return ""
    groups = ", ".join(
        f"{group} ran {run:.1f} (waited {wait:.1f})"
        for group, (run, wait) in times.items()
        if group != "wall"
    )
    return f"; that pass and its step ({times['wall'][0]:.1f} ms), ms: {groups}"


def chunk_times(model, prompt: list[int], tokens: int) -> None:
    """Each chunk's CPU time along `prompt` (cache on), cut every `tokens` tokens and by equal work."""

    rows = attention_rows_per_token(model.config)
    for label, chunks in (("every", PrefillChunks(tokens)), ("equal work", PrefillChunks(tokens, rows))):
        cache = PromptCache(model, "chunks", 1 << 30)
        prefill, times = ChunkedPrefill(model, prompt, cache), []
        while not prefill.done:
            start = time.process_time()
            prefill.step(chunks)
            times.append(time.process_time() - start)
        cache.close()
        quarters = [times[i * len(times) // 4] for i in range(4)] + [times[-2]]
        print(
            f"  chunks cut {label} {tokens} tokens{'' if label == 'every' else f' (rows/token {rows:.0f})'}: "
            f"{len(times)} chunks, CPU ms at 0, 1/4, 1/2, 3/4 and the last whole one: "
            f"{', '.join(f'{1e3 * t:.0f}' for t in quarters)}; most {1e3 * max(times):.0f}"
        )


def stream_beside(
    path: Path, long_prompt: list[int], chunk: int, threads: int, lone_chunks: list[list[int]]
) -> Stall:
    """A streamed completion while `long_prompt` is prefilled, as users see it: `k3stream serve` in its
    own process (prompt cache on, its default), the clients in this one. The stream's gaps at the
    client, and the scheduler's passes and decode steps from a trace the server writes. `lone_chunks`
    are prompts of one chunk's tokens (other ids than `long_prompt`'s and each other's: the same work as
    its first chunk, nothing to restore): the first half alone before the stream starts (one chunk's
    pass in the server), the second half one at a time beside the stream once the long prompt is done
    (one chunk's pass as the long prompt's passes ran: the same server, threads and stream beside)."""
    import threading

    import openai

    from k3stream.cli import calm_openmp
    from k3stream.server.live import ServerProcess

    arrivals: list[float] = []
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace"
        serve_args = ["--ctx", "8192", "--threads", str(threads), "--max-batch", "4"]
        serve_args += ["--prefill-chunk", str(chunk), "--cache-ram", "256"]
        launcher = [sys.executable, __file__, "--timed-serve", str(trace)]
        # the child loads torch before `cli.main` calms its OpenMP: handed down, as `serve` runs it
        calm_openmp()
        log = Path(directory) / "serve.log"
        with ServerProcess(path, *serve_args, launcher=launcher, log_path=log) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
            name = client.models.list().data[0].id
            alone, beside = lone_chunks[: len(lone_chunks) // 2], lone_chunks[len(lone_chunks) // 2 :]
            lone_from = time.perf_counter()
            for prompt in alone:
                client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
            lone_to = time.perf_counter()
            started, streams = threading.Event(), []

            def stream() -> None:
                chunks = client.completions.create(
                    model=name, prompt="Once upon a time", max_tokens=6000, temperature=0, stream=True,
                    logit_bias=LETTERS, extra_body={"ignore_eos": True},
                )  # fmt: skip
                streams.append(chunks)
                with contextlib.suppress(Exception):  # closed by the main thread once it is done
                    for _ in chunks:
                        arrivals.append(time.perf_counter())
                        started.set()

            streamer = threading.Thread(target=stream)
            streamer.start()
            started.wait()
            time.sleep(0.2)
            begin = time.perf_counter()
            client.completions.create(model=name, prompt=long_prompt, max_tokens=1, temperature=0)
            prefill_s, end = time.perf_counter() - begin, time.perf_counter()
            while arrivals[-1] <= end and streamer.is_alive():  # its chunk after the long prompt's
                time.sleep(0.01)
            beside_from = time.perf_counter()
            for prompt in beside:
                client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
            beside_to = time.perf_counter()
            streaming = streamer.is_alive()
            streams[0].close()
            streamer.join()
        found = _read_trace(trace)
    passes, steps = found["pass"], found["step"]
    # until the stream's first chunk after the long prompt, before the chunk-sized prompts beside it
    during = [(at, cpu) for at, cpu in steps if begin <= at <= beside_from]
    lines = [(at, *times) for at, ends, *times in found["threads"]]  # ends: a pass and its step
    ends = [line[1] for line in found["threads"]]
    spans = [
        (a, b)
        for a, b, a_ends, b_ends in zip(lines, lines[1:], ends, ends[1:], strict=False)
        if not a_ends and b_ends and begin <= a[0] <= end
    ]
    return Stall(
        _gaps(arrivals, begin, beside_from) or [0.0],
        _gaps([at for (at,) in found["sent"]], begin, beside_from) or [0.0],
        prefill_s,
        [took for at, took, *_ in passes if begin <= at <= end],
        [cpu for at, _, cpu, *_ in passes if begin <= at <= end],
        [b[0] - a[0] for a, b in zip(during, during[1:], strict=False)] or [0.0],
        [b[1] - a[1] for a, b in zip(during, during[1:], strict=False)] or [0.0],
        max((p for p in passes if begin <= p[0] <= end), key=lambda p: p[1], default=(0.0,) * 5)[1:],
        [(int(blocked), int(preempted)) for at, _, _, blocked, preempted, *_ in passes if begin <= at <= end],
        [(took, int(kind)) for at, took, kind in found["gc"] if begin <= at <= beside_from],
        _thread_times(max(spans, key=lambda span: span[1][0] - span[0][0], default=None)),
        min((took for at, took, *_ in passes if lone_from <= at <= lone_to), default=0.0),
        [took for at, took, *_ in passes if beside_from <= at <= beside_to] if streaming else [],
        _gap_work([at for (at,) in found["sent"]], passes, begin, beside_from),
    )


# the server's threads and the clients' as `timed_serve` groups them
THREAD_GROUPS = ("scheduler", "kernel workers", "server's other threads", "clients")


def _thread_times(span: tuple[tuple[float, ...], tuple[float, ...]] | None) -> dict[str, tuple[float, float]]:
    """Each group's ms run and ms waited for a CPU between a `threads` line and the next (the wall ms
    between them under `wall`)."""
    if span is None:
        return {}
    start, stop = span
    moved = [1e3 * (b - a) for a, b in zip(start, stop, strict=True)]
    times = {"wall": (moved[0], 0.0)}
    for index, group in enumerate(THREAD_GROUPS):
        times[group] = (moved[1 + 2 * index], moved[2 + 2 * index])
    return times


# the tiny model's byte tokens of a..z, raised: every token the stream samples is whole text, so each
# decode step sends a chunk (a random model's bytes are mostly pieces of UTF-8 characters, held back
# until the character is whole: its client would see one chunk every few steps)
LETTERS = {str(token): 100 for token in range(ord("a"), ord("z") + 1)}


@dataclass
class Stall:
    gaps: list[float]  # between the stream's chunks at the client, during the long prompt
    sent_gaps: list[float]  # between the server's sends of them
    prefill_s: float  # the long prompt's TTFT
    passes: list[float]  # the wall time of each prefill pass
    pass_cpu: list[float]  # the CPU time of each
    steps: list[float]  # wall time between the scheduler's decode steps (the stream's tokens)
    step_cpu: list[float]  # the scheduler thread's CPU time between them
    # the longest pass: wall, CPU, the scheduler thread's switches (`_switches`), each prompt's chunk
    longest: tuple[float, ...]
    switches: list[tuple[int, int]]  # each pass's switches of the scheduler thread (`_switches`)
    collections: list[tuple[float, int]]  # the server's garbage collections then: time, generation
    # where the CPU went from the start of the pass before the stream's longest wait in the scheduler to
    # its next decode step: per group of threads (`THREAD_GROUPS`), ms run and ms waited for a CPU
    longest_threads: dict[str, tuple[float, float]]
    lone_pass: float  # the least wall time of the server's pass of a chunk's prompt alone (0: none sent)
    # the wall time of each pass of a chunk's prompt beside the stream, after the long prompt (none where
    # the stream had ended)
    beside_passes: list[float]
    # the longest gap between the server's sends of the stream's chunks: its length and the passes that
    # ran in it (`pass` trace lines: start, wall, CPU, blocked, preempted, each prompt's chunk)
    gap_work: tuple[float, list[tuple[float, ...]]]


def _gap_work(
    sent: list[float], passes: list[tuple[float, ...]], begin: float, until: float
) -> tuple[float, list[tuple[float, ...]]]:
    """The longest gap between two sends (ending in begin..until) and the passes that ran in it."""
    pairs = [(a, b) for a, b in zip(sent, sent[1:], strict=False) if begin <= b <= until]
    if not pairs:
        return 0.0, []
    a, b = max(pairs, key=lambda pair: pair[1] - pair[0])
    return b - a, [p for p in passes if p[0] < b and p[0] + p[1] > a]


def _longest_gap(stall: Stall) -> str:
    """What ran in the stream's longest gap between the server's sends: each pass's chunks (the long
    prompt's first one starts at 0), wall and CPU time and the scheduler thread's switches in it (a pass
    that began before the gap, or ends after it, included whole)."""
    gap, passes = stall.gap_work
    described = [
        f"{', '.join(f'{int(a)}..{int(b)}' for a, b in zip(p[5::2], p[6::2], strict=True))} "
        f"({1e3 * p[1]:.1f} ms, {1e3 * p[2]:.1f} CPU, blocked {int(p[3])}, preempted {int(p[4])})"
        for p in passes
    ]
    return f"longest gap between sends {1e3 * gap:.1f} ms held passes: {'; '.join(described) or 'none'}"


def _gaps(times: list[float], begin: float, until: float) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False) if begin <= b <= until]


class ThreadClocks:
    """The CPU time each thread of this process and of its parent (the clients) ran and waited for a
    CPU (/proc's schedstat, ns), summed per `THREAD_GROUPS` group: the calling thread (the scheduler),
    the threads Python did not start (the OpenMP workers that run the kernels beside it), this
    process's other threads (event loop, tokenizers, cache reader and writer) and the parent's. Each
    thread's file stays open and is read again from its start: a line costs some microseconds."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], tuple[int, int]] = {}  # what an ended thread ran
        self._groups: dict[tuple[int, int], int] = {}  # each thread's group when first seen

    def line(self, ends: bool) -> str:
        """`threads AT ENDS` and each group's seconds run and waited; `ends`: a pass and its step end."""
        import threading

        python = {thread.native_id for thread in threading.enumerate()}
        me, sums = threading.get_native_id(), [0.0] * (2 * len(THREAD_GROUPS))
        for pid in (os.getpid(), os.getppid()):
            ended = {tid for known, tid in self._last if known == pid}  # their last times still count
            for tid in set(map(int, os.listdir(f"/proc/{pid}/task"))) | ended:
                group = 3 if pid != os.getpid() else 0 if tid == me else 2 if tid in python else 1
                group = self._groups.setdefault((pid, tid), group)
                run, wait = self._read(pid, tid)
                sums[2 * group] += run / 1e9
                sums[2 * group + 1] += wait / 1e9
        return f"threads {time.perf_counter()} {int(ends)} " + " ".join(map(str, sums)) + "\n"

    def _read(self, pid: int, tid: int) -> tuple[int, int]:
        try:
            if (pid, tid) not in self._files:
                self._files[pid, tid] = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
            run, wait, _ = os.pread(self._files[pid, tid], 100, 0).split()
            self._last[pid, tid] = int(run), int(wait)
        except OSError:  # the thread ended
            pass
        return self._last.get((pid, tid), (0, 0))


def timed_serve(trace: str, serve_argv: list[str]) -> int:
    """`k3stream serve` with its scheduler's prefill passes (`pass START WALL CPU BLOCKED PREEMPTED`, the
    scheduler thread's switches in it: `_switches`; and each prompt's chunk `FROM TO`), decode steps
    (`step END CPU`), the streamed chunks its responses send (`sent AT`)
    and the process's garbage collections (`gc START WALL GENERATION`) written to `trace` as they
    happen: perf_counter (the system's monotonic clock, the
    same in every process) and the scheduler thread's CPU clock (on one torch thread, the time of the
    one thread that runs the model, other processes' time not counted)."""
    from k3stream import cli
    from k3stream.server import scheduler, streaming

    real_pass, real_step = scheduler.step_together, scheduler.Scheduler._decode_step
    out = open(trace, "w", buffering=1)  # noqa: SIM115 - open while the server runs

    clocks = ThreadClocks()

    def timed_pass(prefills, chunks) -> None:
        out.write(clocks.line(ends=False))
        pending[:] = [True]
        start, cpu, switches = time.perf_counter(), time.thread_time(), _switches()
        spans = [(prefill.position, prefill.next_end(chunks)) for prefill in prefills]
        real_pass(prefills, chunks)
        blocked, preempted = (b - a for a, b in zip(switches, _switches(), strict=True))
        out.write(f"pass {start} {time.perf_counter() - start} {time.thread_time() - cpu}")
        out.write(f" {blocked} {preempted}" + "".join(f" {a} {b}" for a, b in spans) + "\n")

    def timed_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting[:] = [time.perf_counter()]
        elif collecting:
            at = collecting.pop()
            out.write(f"gc {at} {time.perf_counter() - at} {info['generation']}\n")

    collecting: list[float] = []
    pending: list[bool] = []  # a pass ran since the last decode step
    gc.callbacks.append(timed_gc)

    def timed_step(self) -> None:
        real_step(self)
        out.write(f"step {time.perf_counter()} {time.thread_time()}\n")
        if pending:
            out.write(clocks.line(ends=True))
            pending.clear()

    def timed_chunk(data) -> str:  # a streamed chunk, sent as soon as the response has it
        out.write(f"sent {time.perf_counter()}\n")
        return real_chunk(data)

    scheduler.step_together, scheduler.Scheduler._decode_step = timed_pass, timed_step
    real_chunk, streaming._sse_data = streaming._sse_data, timed_chunk
    return cli.main(serve_argv)


def _switches() -> tuple[int, int]:
    """The calling thread's context switches so far: voluntary (it blocked: on an OpenMP barrier whose
    other thread was late, or on the GIL) and involuntary (another thread took its CPU)."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw


def _read_trace(trace: Path) -> dict[str, list[tuple[float, ...]]]:
    """The trace's lines by kind: `pass`, `step`, `sent`, `gc`."""
    found: dict[str, list[tuple[float, ...]]] = {"pass": [], "step": [], "sent": [], "gc": [], "threads": []}
    for line in trace.read_text().splitlines():
        kind, *values = line.split()
        found[kind].append(tuple(float(v) for v in values))
    return found


def shared_reads(args) -> None:
    """Pack bytes read per prefilled token: one `--stall-tokens`/4-token prompt alone (a pass of four
    chunks' rows at a time), then four at once (their chunks share passes), and one in
    `--prefill-chunk` chunks (its cut beside a running stream; a server whose pass holds one chunk), on
    a tiny model served from its pack with an expert RAM budget of one MoE layer's experts (every pass
    reads most of the pack)."""
    from k3stream.engine.loading import load_runtime
    from k3stream.pack.builder import BuildOptions, build_pack
    from k3stream.pack.reader import ExpertPack
    from k3stream.server.app import ServerConfig
    from k3stream.server.runtime import served_from_runtime
    from k3stream.testing.tiny import TinySpec, make_tiny

    length = max(args.stall_tokens // 4, args.prefill_chunk)
    with tempfile.TemporaryDirectory() as directory:
        spec = TinySpec(
            n_layers=6, hidden=128, n_experts=64, top_k=4, expert_ff=64, context_length=8192, seed=11
        )
        gguf = make_tiny(Path(directory) / "model", spec)
        manifest = Path(directory) / "tiny.manifest.json"
        build_pack(gguf, Path(directory) / "tiny.pack", manifest, BuildOptions(progress=False))
        with ExpertPack(manifest) as pack:
            layer_mib = pack.num_experts * pack.object_bytes / MIB
        served = served_from_runtime(
            load_runtime(manifest, k3stream.LoadOptions(expert_ram_mib=layer_mib)), ctx=8192
        )
        generator = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(10, 500, (length,), generator=generator).tolist() for _ in range(6)]
        config = ServerConfig(max_batch=4, prefill_chunk=args.prefill_chunk)
        (alone, together), passes = _reads_per_token(served, config, [[prompts[0]], prompts[1:5]])
        (chunked,), _ = _reads_per_token(served, replace(config, pass_prompts=1), [[prompts[5]]])
        served.close()
    print(
        f"\npack bytes read per prefilled token ({length}-token prompts, --prefill-chunk "
        f"{args.prefill_chunk}, expert RAM one layer's): one alone {alone / 1024:.1f} KiB, four at once "
        f"{together / 1024:.1f} KiB ({together / alone:.2f}x; {passes} shared passes), one in "
        f"{args.prefill_chunk}-token chunks {chunked / 1024:.1f} KiB (four at once {together / chunked:.2f}x)"
    )


def _reads_per_token(served, config, batches: list[list[list[int]]]) -> tuple[list[float], int]:
    """Pack bytes read per prompt token of each batch of prompts sent at once to a server of `config`,
    and its passes that took several prompts."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from k3stream.server.app import create_app
    from k3stream.server.live import ServerThread

    app = create_app(served, config)
    per_token = []
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

        def prefill(prompt: list[int]) -> None:
            client.completions.create(model=served.name, prompt=prompt, max_tokens=1, temperature=0)

        for batch in batches:
            before = served.store_stats()["pack_read_bytes"]
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(prefill, batch))
            read = served.store_stats()["pack_read_bytes"] - before
            per_token.append(read / sum(map(len, batch)))
    return per_token, app.state.scheduler.snapshot()["batched_prefills"]


@dataclass
class SharedRound:
    ttfts: list[float]  # each client's, from its request
    served: list[float]  # each client's first token from the server's first (empty) chunk: its intake
    all_first_s: float  # from the round's start to the last client's first token
    computed: int  # prompt tokens the server computed (/metrics)
    answers: list[tuple[str, list[float]]]  # each client's text and logprobs


def shared_prefixes(args) -> None:
    """`--shared-clients` clients at once, their prompts sharing a prefix no snapshot holds, against
    `k3stream serve` with in-batch prefix sharing on and off (two servers, a round of each in turn)."""
    from k3stream.server.live import ServerProcess

    tokenizer = Tokenizer.from_gguf(args.model)
    low, high = (int(x) for x in args.suffix_tokens.split(","))
    serve_args = ["--threads", str(args.threads), "--max-batch", str(args.shared_clients)]
    serve_args += ["--cache-ram", f"{args.cache_ram:g}"]
    share = [] if args.cache_share is None else ["--cache-share", str(args.cache_share)]
    results: dict[str, list[SharedRound]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as directory:
        on = ServerProcess(args.model, *serve_args, *share, log_path=Path(directory) / "on.log")
        off = ServerProcess(
            args.model, *serve_args, "--cache-share", "0", log_path=Path(directory) / "off.log"
        )
        with on, off:
            for round_ in range(args.rounds):
                prompts = _shared_prompts(tokenizer, args, random.Random(args.seed + round_), low, high)
                order = [("on", on), ("off", off)][:: 1 if round_ % 2 == 0 else -1]
                for mode, server in order:
                    results[mode].append(_shared_round(server.url, prompts, args.answer_tokens))
    lengths = [len(p) for p in _shared_prompts(tokenizer, args, random.Random(args.seed), low, high)]
    print(
        f"{args.shared_clients} clients at once sharing a {args.shared_tokens}-token prefix (their prompts "
        f"{lengths} tokens in round 1), `k3stream serve {args.model} {' '.join(serve_args)}`; sharing "
        f"on ({' '.join(share) or 'its default'}) and off (--cache-share 0), a round of each in turn, a "
        f"new prefix each round:"
    )
    for mode in ("on", "off"):
        for index, got in enumerate(results[mode]):
            ttfts = ", ".join(f"{1e3 * t:.0f}" for t in got.ttfts)
            served = ", ".join(f"{1e3 * t:.0f}" for t in got.served)
            print(
                f"  {mode:>3} round {index + 1}: computed {got.computed:5d} prompt tokens; TTFT per client "
                f"{ttfts} ms ({served} from the server's first chunk); all first tokens "
                f"{1e3 * got.all_first_s:.0f} ms"
            )
    best = {mode: min(r.all_first_s for r in rounds) for mode, rounds in results.items()}
    last = {mode: min(max(r.served) for r in rounds) for mode, rounds in results.items()}
    computed = {mode: sum(r.computed for r in rounds) for mode, rounds in results.items()}
    same = all(a.answers == b.answers for a, b in zip(results["on"], results["off"], strict=True))
    print(
        f"  all first tokens (least of {args.rounds}): on {1e3 * best['on']:.0f} ms, off "
        f"{1e3 * best['off']:.0f} ms ({best['on'] / best['off']:.2f}x), the last from the server's first "
        f"chunk on {1e3 * last['on']:.0f} ms, off {1e3 * last['off']:.0f} ms "
        f"({last['on'] / last['off']:.2f}x); prompt tokens computed on/off "
        f"{computed['on'] / computed['off']:.2f}x; answers (text and logprobs) equal on and off: {same}"
    )


def share_sweep(args) -> None:
    """For each `--share-sweep` prefix length, --shared-clients requests queued together on a scheduler
    over the shipped model (no HTTP), sharing on and off in turn, --rounds each: the least wall time to
    the last first token and the least CPU time (all threads) of a round."""
    import asyncio

    from k3stream.engine.generate import Sequence
    from k3stream.engine.sampling import SamplingParams
    from k3stream.server.metrics import ServerMetrics
    from k3stream.server.scheduler import EventSink, Job, Scheduler

    model, tokenizer = k3stream.load(args.model), Tokenizer.from_gguf(args.model)
    low, high = (int(x) for x in args.suffix_tokens.split(","))
    cache = PromptCache(model, "sweep", int(args.cache_ram * MIB))
    loop, greedy = asyncio.new_event_loop(), SamplingParams(temperature=0.0, max_tokens=1)

    def run(prompts: list[list[int]], share: int) -> tuple[float, float]:
        scheduler = Scheduler(model, ServerMetrics(), max_batch=len(prompts), max_queue=0, cache=cache,
                              share_tokens=share)  # fmt: skip
        jobs = [Job(ids, Sequence(tokenizer, ids, greedy), EventSink(loop)) for ids in prompts]
        start, cpu = time.perf_counter(), time.process_time()
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        while not all(job.logic.finish_reason for job in jobs):
            time.sleep(0.0005)
        took = (max(job.last_token_at for job in jobs) - start, time.process_time() - cpu)
        scheduler.stop()
        return took

    print(
        f"{args.shared_clients} requests queued together on the scheduler (no HTTP; {args.threads} "
        f"threads, chunks of {DEFAULT_PREFILL_CHUNK}), suffixes {args.suffix_tokens} tokens; least of "
        f"{args.rounds} rounds, a new prefix each, sharing on (--cache-share 1) and off in turn:"
    )
    for length in (int(x) for x in args.share_sweep.split(",")):
        sized = argparse.Namespace(**{**vars(args), "shared_tokens": length})
        times: dict[int, list[tuple[float, float]]] = {1: [], 0: []}
        for round_ in range(args.rounds):
            for share in (1, 0) if round_ % 2 == 0 else (0, 1):  # a new prefix for each: no snapshot
                rng = random.Random(args.seed + 1000 * length + 2 * round_ + share)
                times[share].append(run(_shared_prompts(tokenizer, sized, rng, low, high), share))
        (on_wall, on_cpu), (off_wall, off_cpu) = (
            (min(w for w, _ in times[s]), min(c for _, c in times[s])) for s in (1, 0)
        )
        print(
            f"  prefix {length:5d}: all first tokens on {1e3 * on_wall:6.1f} ms, off {1e3 * off_wall:6.1f} "
            f"ms ({on_wall / off_wall:.2f}x); CPU on {1e3 * on_cpu:6.1f} ms, off {1e3 * off_cpu:6.1f} ms "
            f"({on_cpu / off_cpu:.2f}x)"
        )
    cache.close()
    loop.close()


def _shared_prompts(tokenizer: Tokenizer, args, rng: random.Random, low: int, high: int) -> list[list[int]]:
    """A prefix of --shared-tokens and, per client, a suffix of low..high tokens (from `rng`)."""

    def words(count: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < count:
            ids += tokenizer.encode(" " + " ".join(rng.choices(WORDS, k=count)))
        return ids[:count]

    prefix = words(args.shared_tokens)
    return [prefix + words(rng.randint(low, high)) for _ in range(args.shared_clients)]


def _shared_round(url: str, prompts: list[list[int]], answer_tokens: int) -> SharedRound:
    """The prompts sent at once (streamed, greedy, logprobs): each client's TTFT, the time to the last
    first token, the server's computed prompt tokens and the answers."""
    import threading

    import httpx

    def computed() -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        return sum(
            float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("k3stream_prompt_tokens_total ")
        )

    before, ready = computed(), threading.Barrier(len(prompts) + 1)
    firsts: list[float] = [0.0] * len(prompts)
    ttfts: list[float] = [0.0] * len(prompts)
    served: list[float] = [0.0] * len(prompts)
    answers: list[tuple[str, list[float]]] = [("", [])] * len(prompts)

    def client(index: int) -> None:
        body = {"prompt": prompts[index], "max_tokens": answer_tokens, "temperature": 0, "logprobs": 1}
        body |= {"ignore_eos": True, "stream": True}
        text, logprobs, accepted = "", [], 0.0
        ready.wait()
        sent = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                accepted = accepted or time.perf_counter()  # the server's first chunk holds no token
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    tokens = (choice.get("logprobs") or {}).get("token_logprobs") or []
                    if tokens and not firsts[index]:
                        firsts[index] = time.perf_counter()
                        ttfts[index], served[index] = firsts[index] - sent, firsts[index] - accepted
                    text, logprobs = text + (choice.get("text") or ""), logprobs + tokens
        answers[index] = (text, logprobs)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return SharedRound(ttfts, served, max(firsts) - start, int(computed() - before), answers)


def _least(n: int, function) -> tuple[float, float]:
    """The least wall time of n runs, and the least CPU time of the calling thread."""
    walls, cpus = [], []
    for _ in range(n):
        start, cpu = time.perf_counter(), time.thread_time()
        function()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
    return min(walls), min(cpus)


def _best_of(n: int, function) -> float:
    """The least CPU time of n runs (all threads)."""
    times = []
    for _ in range(n):
        start = time.process_time()
        function()
        times.append(time.process_time() - start)
    return min(times)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--timed-serve"]:  # the server child of `stream_beside`
        raise SystemExit(timed_serve(sys.argv[2], sys.argv[3:]))
    main()
