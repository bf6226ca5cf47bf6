"""Routing of the shipped trained model on held-out text: eviction policies against Belady, and the
precision of the two expert predictions.

    python benchmarks/bench_routing.py [--model GGUF] [--tokens 2048] [--per-file 256] [--trace OUT.gz]

The held-out standard-library files (`k3stream.train.corpus`, never trained on) are decoded token by
token (teacher forced: each next token is the text's) through an expert store that holds every
expert, so the recorded routing trace is the model's own demand. Printed: every policy's hit rate
against Belady's at 1/8, 1/4 and 1/2 of the experts, and per MoE layer the precision and recall of the
pre-attention hint (a layer's router on its input, before its attention), of the layer-ahead hint
(the next MoE layer's router on this layer's stream after attention) and of the token hint. The same
text is then decoded through a store at each budget with the default configuration (`cycle`, token
hints and adaptive prefetch), prefetch on and off: its RAM hit rate (a prefetched expert a fetch finds
resident is a hit) and pack bytes read per token, against Belady's (who reads each miss, and knows the
future but prefetches nothing). `--trace` keeps the trace
gzipped (`python -m k3stream.store.simulate` reads it). Then `--clients` concurrent sequences (held-out
files, teacher forced) decode together (`decode_batch`) through a store holding a quarter of the
experts: pack bytes read per token at each count.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from pathlib import Path

from k3stream.model.hints import TOKEN_HINT_LEAD, HintLog

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "src" / "k3stream" / "data" / "k3-stdlib-audited.gguf"
MIB = 1 << 20
POLICIES = ["lfu-lru", "lru", "arc", "cycle"]
BUDGETS = (0.125, 0.25, 0.5)


def held_out_token_runs(gguf: Path, total: int, per_file: int) -> list[list[int]]:
    """Up to `per_file` tokens from each held-out file, in order, `total` in all."""
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.train.corpus import read_texts, split_corpus

    corpus = split_corpus()
    tokenizer = Tokenizer.from_gguf(gguf)
    runs, count = [], 0
    for text in read_texts(corpus.root, corpus.held_out):
        ids = tokenizer.encode_plain(text)[: min(per_file, total - count)]
        if len(ids) >= 2:
            runs.append(ids)
            count += len(ids)
        if count >= total:
            break
    return runs


def record(gguf: Path, manifest: Path, trace_path: Path, runs: list[list[int]]) -> HintLog:
    """Decode every run token by token through a store holding all experts, recording the trace."""
    import k3stream
    from k3stream.pack.reader import ExpertPack
    from k3stream.store import ExpertStore

    with ExpertPack(manifest) as pack:
        everything = len(pack.moe_layers) * pack.num_experts * pack.object_bytes / MIB
    with ExpertStore(manifest, ram_mib=everything, prefetch=False, record_trace=trace_path) as store:
        model = k3stream.load(gguf, k3stream.LoadOptions(expert_source=store))
        # predict (and score) both hints on every step; the store, its prefetch off, ignores them
        model.prefetch = model.score_all_hints = True
        decode_runs(model, store, runs)
    return model.hints


def decode_runs(model, store, runs: list[list[int]]) -> None:
    """Each run token by token (teacher forced) from a fresh state, each token ended at the store."""
    for run in runs:
        state = model.new_state()
        for token in run:
            model.decode(state, token)
            store.end_token(1)


def bytes_per_token(gguf: Path, manifest: Path, clients: int, length: int) -> dict:
    """Pack bytes read per token when `clients` held-out sequences decode together at a 1/4 budget."""
    import k3stream
    from k3stream.pack.reader import ExpertPack
    from k3stream.store import ExpertStore

    runs = [r for r in held_out_token_runs(gguf, 4 * clients * length, length) if len(r) == length]
    if len(runs) < clients:
        raise ValueError(f"held-out text: only {len(runs)} files of {length} tokens for {clients} clients")
    with ExpertPack(manifest) as pack:
        budget = len(pack.moe_layers) * pack.num_experts // 4 * pack.object_bytes / MIB
    with ExpertStore(manifest, ram_mib=budget) as store:
        model = k3stream.load(gguf, k3stream.LoadOptions(expert_source=store))
        states = [model.new_state() for _ in range(clients)]
        for step in range(length):
            model.decode_batch(states, [run[step] for run in runs[:clients]])
            store.end_token(clients)
        read = store.stats()["pack_read_bytes"]
    return {"clients": clients, "tokens": clients * length, "bytes_per_token": read / (clients * length)}


def replay(
    gguf: Path,
    manifest: Path,
    runs: list[list[int]],
    fraction: float,
    prefetch: bool = True,
    lead: int = TOKEN_HINT_LEAD,
) -> dict:
    """RAM hit rate, pack bytes and fetch wait per token of the default store holding `fraction` of
    the experts (prefetch on or off, token hints sent `lead` MoE layers early) decoding `runs`."""
    import k3stream
    from k3stream.pack.reader import ExpertPack
    from k3stream.store import ExpertStore

    with ExpertPack(manifest) as pack:
        objects = round(fraction * len(pack.moe_layers) * pack.num_experts)
        ram_mib = objects * pack.object_bytes / MIB
    with ExpertStore(manifest, ram_mib=ram_mib, prefetch=prefetch) as store:
        model = k3stream.load(gguf, k3stream.LoadOptions(expert_source=store))
        model.set_token_hint_lead(lead)
        decode_runs(model, store, runs)
        stats = store.stats()
    ram = stats["tiers"]["ram"]
    return {
        "hit_rate": ram["cache_hits"] / (ram["cache_hits"] + ram["cache_misses"]),
        "bytes_per_token": stats["pack_read_bytes"] / stats["tokens"],
        "fetch_ms_per_token": stats["fetch_ns"] / stats["tokens"] / 1e6,
    }


def default_rows(gguf: Path, manifest: Path, runs: list[list[int]]) -> list[dict]:
    """Per budget, the default store with prefetch on and off."""
    return [
        {
            "fraction": fraction,
            "on": replay(gguf, manifest, runs, fraction),
            "off": replay(gguf, manifest, runs, fraction, prefetch=False),
        }
        for fraction in BUDGETS
    ]


def lead_rows(gguf: Path, manifest: Path, runs: list[list[int]], moe_layers: int) -> list[dict]:
    """At a quarter of the experts, token hints sent 1.. MoE layers early (1 is the default)."""
    return [
        {"lead": lead, **replay(gguf, manifest, runs, 0.25, lead=lead)} for lead in range(1, moe_layers + 1)
    ]


def policy_rows(trace_path: Path) -> tuple[list[dict], dict]:
    from k3stream.store.simulate import hit_rate_table
    from k3stream.store.traces import read_trace

    trace = read_trace(trace_path)
    meta = trace.meta
    total = len(meta["moe_layers"]) * meta["num_experts"]
    sizes = [round(fraction * total) * meta["object_bytes"] / MIB for fraction in BUDGETS]
    keys = sum(len(set(experts)) for _, experts in trace.steps)
    return hit_rate_table(trace.steps, meta["object_bytes"], sizes, POLICIES), {
        "steps": len(trace.steps),
        "tokens": trace.tokens,
        "experts": total,
        "object_bytes": meta["object_bytes"],
        "keys_per_token": keys / trace.tokens,
        "moe_layers": meta["moe_layers"],
    }


def hint_rows(hints: HintLog) -> dict[int, dict]:
    """{layer: {kind: scores}} from the log's {kind: {layer: scores}}."""
    by_layer = hints.by_layer()
    layers = sorted(next(iter(by_layer.values())))
    return {layer: {kind: scores[layer] for kind, scores in by_layer.items()} for layer in layers}


def print_report(rows: list[dict], info: dict, hints: dict[int, dict]) -> None:
    print(
        f"\n## eviction: {info['tokens']} held-out tokens, {info['steps']} steps, {info['experts']} experts"
    )
    print("budget    " + "  ".join(f"{name:>8}" for name in (*POLICIES, "belady")) + "   best/belady")
    for row, fraction in zip(rows, BUDGETS, strict=False):
        best = max(row[name] for name in POLICIES)
        cells = "  ".join(f"{100 * row[name]:>7.1f}%" for name in (*POLICIES, "belady"))
        print(f"{fraction:>6.1%}    {cells}   {best / row['belady']:.3f}")
    print("\n## predictions per MoE layer: precision / recall")
    for layer, summary in hints.items():
        cells = "  ".join(
            f"{kind} {100 * s['precision']:5.1f}% / {100 * s['recall']:5.1f}%" for kind, s in summary.items()
        )
        print(f"layer {layer}: {cells}")


def print_default(rows: list[dict], policies: list[dict], info: dict) -> None:
    print("\n## the default store (cycle, token hints) decoding the same text: RAM hit rate, KiB per token")
    print("budget    prefetch on           prefetch off          Belady             on/Belady (hits, bytes)")
    for row, policy in zip(rows, policies, strict=False):
        belady_bytes = (1 - policy["belady"]) * info["keys_per_token"] * info["object_bytes"]
        on, off = row["on"], row["off"]
        cells = "  ".join(
            f"{100 * cell['hit_rate']:5.1f}% {cell['bytes_per_token'] / 1024:7.1f} KiB"
            for cell in (on, off, {"hit_rate": policy["belady"], "bytes_per_token": belady_bytes})
        )
        ratios = f"{on['hit_rate'] / policy['belady']:.2f}x, {on['bytes_per_token'] / belady_bytes:.2f}x"
        print(f"{row['fraction']:>6.1%}    {cells}    {ratios}")


def print_leads(rows: list[dict]) -> None:
    print("\n## the token hint's horizon at 1/4 of the experts (sent N MoE layers before its layer)")
    for row in rows:
        default = " (default)" * (row["lead"] == TOKEN_HINT_LEAD)
        print(
            f"lead {row['lead']}: RAM hits {100 * row['hit_rate']:5.1f}%  "
            f"{row['bytes_per_token'] / 1024:6.1f} KiB/token  "
            f"fetch {row['fetch_ms_per_token']:.2f} ms/token{default}"
        )


def print_clients(rows: list[dict]) -> None:
    print("\n## concurrent clients at 1/4 of the experts: pack KiB read per token")
    for row in rows:
        ratio = row["bytes_per_token"] / rows[0]["bytes_per_token"]
        print(f"{row['clients']:>3} clients: {row['bytes_per_token'] / 1024:8.1f} KiB ({ratio:.2f}x of 1)")


def main(argv: list[str] | None = None) -> int:
    from k3stream.pack.builder import BuildOptions, build_pack

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=MODEL, help="an audited GGUF (default: the shipped one)"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens in all")
    parser.add_argument("--per-file", type=int, default=256, help="tokens from each held-out file")
    parser.add_argument("--trace", type=Path, default=None, help="keep the trace here, gzipped")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--clients", default="1,4,16", help="concurrent sequences, comma-separated")
    parser.add_argument("--client-tokens", type=int, default=128, help="tokens each client decodes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        gguf = work / args.model.name
        shutil.copyfile(args.model, gguf)
        manifest = build_pack(gguf, options=BuildOptions(progress=False)).manifest
        runs = held_out_token_runs(gguf, args.tokens, args.per_file)
        trace_path = work / "trace.jsonl"
        hints = hint_rows(record(gguf, manifest, trace_path, runs))
        rows, info = policy_rows(trace_path)
        defaults = default_rows(gguf, manifest, runs)
        leads = lead_rows(gguf, manifest, runs, len(info["moe_layers"]))
        counts = [int(c) for c in args.clients.split(",") if c]
        clients = [bytes_per_token(gguf, manifest, c, args.client_tokens) for c in counts]
        if args.trace is not None:
            with open(args.trace, "wb") as out, gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as packed:
                packed.write(trace_path.read_bytes())
    print_report(rows, info, hints)
    print_default(defaults, rows, info)
    print_leads(leads)
    print_clients(clients)
    if args.json is not None:
        figures = {
            "policies": rows,
            "trace": info,
            "hints": hints,
            "default": defaults,
            "leads": leads,
            "clients": clients,
        }
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
