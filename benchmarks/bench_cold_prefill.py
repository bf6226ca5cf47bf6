"""A cold prefill (a fresh expert store, nothing of the pack cached) at expert budgets from a tenth of
the pack to all of it: a larger budget must never make it slower.

    python benchmarks/bench_cold_prefill.py [--cache-dir DIR] [--prompt-tokens 16] [--repeat 2]

Writes (or reuses) an audited-recipe model with the real model's sparsity (512 experts, top-8, three
MoE layers), packs it, then for each budget loads a runtime reading the pack with O_DIRECT (no page
cache between runs) and prefills one prompt. Per budget: the prefill time (best of --repeat), experts
read from the pack, the time the model waited in `fetch`, how many hints were loaded and how many of
those a fetch then used, the process's system CPU time and the read buffers made fresh (the others
are recycled: a fresh one costs the kernel a fault and a zeroed page per 4 KiB), with prefetch on,
and the same prefill with prefetch off in the same run. On a shared machine the wall times swing;
the reads and the fetch wait are the steadier figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from k3stream import LoadOptions
from k3stream.engine.loading import StoreOptions, load_runtime
from k3stream.testing.tiny import TinySpec

SPEC = TinySpec(
    n_layers=4,
    recipe="audited",
    hidden=512,
    n_experts=512,
    top_k=8,
    expert_ff=512,
    latent=512,
    kv_lora=256,
    qk_nope=32,
)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3stream-cold-prefill"
SHARES = (0.1, 0.25, 0.5, 1.0)


def ensure_model(cache_dir: Path) -> Path:
    """The packed model's manifest (written once into `cache_dir`)."""
    from k3stream.pack.builder import build_pack
    from k3stream.testing.tiny import make_tiny

    manifest = next(cache_dir.glob("*.manifest.json"), None)
    if manifest is None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        manifest = Path(build_pack(make_tiny(cache_dir, SPEC)).manifest)
    return manifest


def cold_prefill(manifest: Path, ram_mib: float, prompt: list[int], prefetch: bool) -> dict:
    options = LoadOptions(expert_ram_mib=ram_mib, prefetch=prefetch)
    runtime = load_runtime(manifest, options, store_options=StoreOptions(direct_io=True))
    try:
        model = runtime.model
        system = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        start = time.perf_counter()
        model.prefill_last(model.new_state(), prompt)
        seconds = time.perf_counter() - start
        system = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system
        stats = runtime.store.stats()
    finally:
        runtime.close()
    return {
        "seconds": seconds,
        "fetch_s": stats["fetch_ns"] / 1e9,
        "reads": stats["pack_reads"],
        "hinted": stats["prefetch_loads"],
        "hints_used": stats["prefetch_hits"],
        "system_s": system,
        "fresh": stats["buffers_made"],
    }


def best(manifest: Path, ram_mib: float, prompt: list[int], prefetch: bool, repeat: int) -> dict:
    return min(
        (cold_prefill(manifest, ram_mib, prompt, prefetch) for _ in range(repeat)), key=lambda r: r["seconds"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    manifest = ensure_model(args.cache_dir)
    from k3stream.pack.reader import ExpertPack

    with ExpertPack(manifest) as pack:
        layers = sorted(pack.moe_layers)
        pack_mib = len(layers) * pack.num_experts * pack.object_range(layers[0], 0)[1] / 2**20
    prompt = [(7 * i + 3) % 200 + 5 for i in range(args.prompt_tokens)]
    print(
        "budget  prefill s (on / off, ratio)  fetch wait s (on / off)  read  hinted  hints used  sys s  fresh"
    )
    for share in SHARES:
        on = best(manifest, share * pack_mib, prompt, True, args.repeat)
        off = best(manifest, share * pack_mib, prompt, False, args.repeat)
        times = f"{on['seconds']:.3f} / {off['seconds']:.3f} ({on['seconds'] / off['seconds']:.2f})"
        waits = f"{on['fetch_s']:.3f} / {off['fetch_s']:.3f}"
        print(
            f"{share:>6.0%}  {times:>28}  {waits:>23}  {on['reads']:>4}  {on['hinted']:>6}  "
            f"{on['hints_used']:>10}  {on['system_s']:5.2f}  {on['fresh']:>5}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
