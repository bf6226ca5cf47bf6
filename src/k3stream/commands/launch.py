"""A model command under `torchrun`: start the group, load, shard, then drive (rank 0) or follow."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from k3stream.commands.flags import cache_from_args, check_cache_flags, runtime_from_args
from k3stream.engine.loading import Runtime
from k3stream.engine.parallel import groups
from k3stream.engine.parallel.experts import ExpertExchange, apply_expert_parallel
from k3stream.engine.parallel.runner import DriverModel, follow
from k3stream.engine.parallel.tensor import apply_tensor_parallel
from k3stream.engine.prompt_cache import PromptCache


@contextmanager
def parallel_runtime(
    args: argparse.Namespace,
    on_failure: Callable[[], None] = lambda: None,
    opened: Any = None,
    graceful: bool = False,
) -> Iterator[Runtime | None]:
    """Rank 0's runtime (its model a `DriverModel` when there are several ranks); on the other ranks,
    follows rank 0 until it stops and yields None. One process without torchrun: the plain runtime.
    `opened`: what `open_model` returned, when the command read the GGUF already. `graceful`: the
    followers outlive SIGTERM and Ctrl-C until rank 0 releases them (a server finishing its streams).

    When a peer fails, rank 0's model calls `on_failure()` (a server stops itself) and the failure is
    raised on leaving, also if the caller swallowed it."""
    if hasattr(args, "cache_ram"):
        check_cache_flags(args)  # before the model loads
    parallel = groups.start(args.tp, args.ep, _device_kind(args.device), args.dist_timeout)
    try:
        if parallel.distributed:
            groups.agree(parallel, shared_facts(args))
        runtime = runtime_from_args(args, opened)
        try:
            exchanges = shard(runtime.model, parallel)
            groups.loaded(parallel)
            report = functools.partial(rank_report, runtime, exchanges)
            if not parallel.distributed:
                yield runtime
            elif parallel.driver:
                yield from _drive(runtime, report, on_failure, args.dist_timeout / 2, layout(parallel))
            else:
                if graceful:
                    groups.follow_through_stops()
                _follow(runtime.model, report, parallel.rank, _rank_cache(args, runtime.model, parallel))
                yield None
        finally:
            runtime.close()
    finally:
        groups.stop(parallel)


def shared_facts(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """What every rank's run must share (`groups.agree`): the model's bytes (sizes and sampled windows:
    a copy on another machine agrees, another file does not), the flags that shape the steps and their
    arithmetic, and on CPU the kernels' instruction set (ggml's arithmetic sums in each one's lane
    order). The memory flags (`--ram-mib`, `--memory-limit`) and the expert store's are each rank's own."""
    from k3stream.engine.fingerprints import model_fingerprint
    from k3stream.engine.loading import resolve_model
    from k3stream.gguf.shards import discover_shards
    from k3stream.quant.kernels import cpu

    gguf, _ = resolve_model(args.model, False)
    model = model_fingerprint(discover_shards(gguf), times=False)
    arithmetic = "--float-activations" if args.float_activations else "ggml's (--match-ggml, the default)"
    device = _device_kind(args.device)
    flags = {
        "command": args.command,
        "--tp": args.tp,
        "--ep": args.ep,
        "arithmetic": arithmetic,
        "--dtype": args.dtype,
        "device": device,
        "--ctx": args.ctx,
        "kernel instruction set": cpu.isa() if device == "cpu" and cpu.available() else "none",
    }
    return {"model": (model, f"{gguf} (sampled bytes {model})")} | {
        name: (str(value), str(value)) for name, value in flags.items()
    }


def layout(parallel: groups.Parallel) -> str:
    """A rank's place, as keyed into its prompt-cache snapshots (they hold its shard of a state)."""
    return f"-tp{parallel.tp}-ep{parallel.ep}-rank{parallel.rank}"


def _rank_cache(args: argparse.Namespace, model: Any, parallel: groups.Parallel) -> PromptCache | None:
    """A follower's own prompt cache, where the command has one (rank 0 builds its own the same way)."""
    return cache_from_args(args, model, layout(parallel)) if hasattr(args, "cache_ram") else None


def _drive(
    runtime: Runtime,
    report: Callable[[], Any],
    on_failure: Callable[[], None],
    keepalive_s: float,
    place: str,
) -> Iterator[Runtime]:
    """Rank 0: the caller's runtime with its model wrapped; the followers released at the end."""
    driver = DriverModel(runtime.model, report, on_failure, keepalive_s, place)
    runtime.model = driver
    try:
        yield runtime
    finally:
        driver.close()
    if driver.failure is not None:
        raise driver.failure
    driver.stop()  # not reached when the run failed: the followers see the failure


def _follow(model: Any, report: Callable[[], Any], rank: int, cache: PromptCache | None) -> None:
    """`follow`, with this rank's own failure (its pack, its step) named by rank on the way out."""
    try:
        follow(model, report, cache)
    except groups.PeerFailed:
        raise
    except (ValueError, OSError, RuntimeError) as exc:
        raise RuntimeError(f"rank {rank}: {exc}") from exc
    finally:
        if cache is not None:
            cache.close()  # its queued snapshot files, for the next start


def _device_kind(device: str) -> str:
    """The device kind the model will run on: a GPU for `--device auto` when one is present."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def shard(model: Any, parallel: groups.Parallel) -> list[ExpertExchange]:
    """Tensor- and expert-parallel slices of a loaded model, in place; returns the expert exchanges."""
    if parallel.tp > 1:
        apply_tensor_parallel(model, parallel.rank, parallel.world)
    if parallel.ep > 1:
        return apply_expert_parallel(model, parallel.rank, parallel.world)
    return []


def rank_report(runtime: Runtime, exchanges: list[ExpertExchange]) -> dict[str, int]:
    """What one rank read from its pack and sent in the expert exchange so far."""
    stats = runtime.store.stats() if runtime.store is not None else {}
    return {
        "pack_read_bytes": int(stats.get("pack_read_bytes", 0)),
        "pack_reads": int(stats.get("pack_reads", 0)),
        "pack_read_ns": int(stats.get("pack_read_ns", 0)),
        "exchange_bytes": sum(e.sent_bytes for e in exchanges),
    }


def report_ranks(runtime: Runtime, tokens: int) -> None:
    """One line per rank on stderr: pack bytes read and expert-exchange bytes sent, per token."""
    if not isinstance(runtime.model, DriverModel):
        return
    for rank, report in enumerate(runtime.model.reports()):
        print(
            f"rank {rank}  read {report['pack_reads']} experts, {report['pack_read_bytes'] / 1024:.1f} KiB "
            f"({report['pack_read_bytes'] / max(tokens, 1) / 1024:.1f} KiB per token); sent "
            f"{report['exchange_bytes'] / max(tokens, 1) / 1024:.1f} KiB per token in the expert exchange",
            file=sys.stderr,
        )
