"""Tensor and expert parallelism on this machine: 1, 2 and 4 torchrun ranks (gloo, loopback).

    python benchmarks/bench_parallel.py [--ranks 1,2,4] [--prompt-tokens 32] [--decode-tokens 16]

Makes a tiny audited-recipe Kimi-K3 with more experts than the test models (Q2_K/Q3_K experts), packs
it, and runs the `generate` command's runtime under `torchrun` (tests/parallel_worker.py): one prefill
of a fixed random prompt, then fixed decode tokens (no sampling), with `--tp N --ep N` and `--ep N`.
Every rank's expert RAM budget is the same share of the pack (`--ram-share`), so the ranks' caches add
up as ranks are added.
Prints prefill and decode tok/s and the pack bytes each rank read per token (mean over ranks, and the
busiest rank), each also as a ratio to one rank, each rank's read rate while reading (GB/s), and the
expert-exchange bytes each rank sent per token. `--same-total-cache` splits one budget over the ranks
instead, which isolates the partition: bytes per rank should then be about 1/ranks of one rank's.
Ranks beyond the machine's cores share them: on the 2-core machine 4 ranks measure overhead, not speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_helpers import MIB, pack_expert_bytes, packed_tiny  # noqa: E402

WORKER = ROOT / "tests" / "parallel_worker.py"
SPEC = dict(
    recipe="audited", n_layers=6, hidden=256, n_experts=64, top_k=8, latent=256, expert_ff=256,
    kv_lora=256, qk_nope=32, context_length=1024, seed=5,
)  # fmt: skip


def run(
    manifest: Path, ranks: int, flags: list[str], prompt: list[int], steps: list[int], ram_mib: float
) -> dict:
    """One worker run under torchrun: its logits, every rank's report and the timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pt"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        command += [str(WORKER), str(out), _ids(prompt), _ids(steps), "--", str(manifest), *flags]
        command += ["--ram-mib", f"{ram_mib:.3f}", "--threads", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-6000:])
        return torch.load(out)


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def figures(result: dict, prompt: int, steps: int) -> dict[str, float]:
    tokens = prompt + steps
    reads = [r["pack_read_bytes"] / tokens for r in result["reports"]]
    return {
        "prefill": prompt / result["seconds"]["prefill"],
        "decode": steps / result["seconds"]["decode"],
        "read_mean": sum(reads) / len(reads),
        "read_max": max(reads),
        "sent": max(r["exchange_bytes"] for r in result["reports"]) / tokens,
        "read_gbs": sum(r["pack_read_bytes"] / max(r["pack_read_ns"], 1) for r in result["reports"])
        / len(result["reports"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--ram-share", type=float, default=0.25, help="each rank's budget / pack bytes")
    parser.add_argument(
        "--same-total-cache",
        action="store_true",
        help="split one budget of --ram-share over the ranks instead of giving each rank that budget",
    )
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 500, (args.prompt_tokens,), generator=generator).tolist()
    steps = torch.randint(5, 500, (args.decode_tokens,), generator=generator).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        _gguf, manifest = packed_tiny(Path(tmp), **SPEC)
        ram_mib = pack_expert_bytes(manifest) * args.ram_share / MIB
        print(f"pack {pack_expert_bytes(manifest) / MIB:.1f} MiB of experts, {ram_mib:.2f} MiB RAM per rank")
        print(HEADER)
        base = None
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for flags in configurations(ranks):
                budget = ram_mib / ranks if args.same_total_cache else ram_mib
                f = figures(run(manifest, ranks, flags, prompt, steps, budget), len(prompt), len(steps))
                base = base or f
                print(row(ranks, flags, f, base), flush=True)


HEADER = (
    "ranks  flags          prefill tok/s   decode tok/s    read KiB/rank/token (busiest)  read GB/s/rank"
    "  sent KiB/token"
)


def configurations(ranks: int) -> list[list[str]]:
    if ranks == 1:
        return [[]]
    return [["--tp", str(ranks), "--ep", str(ranks)], ["--ep", str(ranks)]]


def row(ranks: int, flags: list[str], f: dict[str, float], base: dict[str, float]) -> str:
    def ratio(key: str, of: str | None = None) -> str:
        return f"{f[key] / base[of or key]:.2f}x"

    return (
        f"{ranks:5d}  {' '.join(flags) or '-':13s}  {f['prefill']:6.1f} ({ratio('prefill')})"
        f"  {f['decode']:6.1f} ({ratio('decode')})  {f['read_mean'] / 1024:8.1f} ({ratio('read_mean')};"
        f" {ratio('read_max', 'read_mean')})  {f['read_gbs']:6.2f}          {f['sent'] / 1024:8.1f}"
    )


if __name__ == "__main__":
    main()
