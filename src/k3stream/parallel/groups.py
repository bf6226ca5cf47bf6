"""The process group: one per run, every rank in it, started from `torchrun`'s environment."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from k3stream.parallel.options import DEFAULT_TIMEOUT_S

T = TypeVar("T")

# the first collective after loading waits for the slowest rank to load
LOAD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Parallel:
    """This process's place: `rank` of `world`; tensor parallel over `tp` ranks, experts over `ep`."""

    rank: int
    world: int
    tp: int
    ep: int

    @property
    def driver(self) -> bool:
        """Rank 0 tokenizes, samples and serves; the others follow its steps."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Parallel(rank=0, world=1, tp=1, ep=1)


def check_sizes(tp: int, ep: int, world: int) -> None:
    """`--tp` and `--ep` are each 1 or the world size, and together use every rank."""
    for flag, size in (("--tp", tp), ("--ep", ep)):
        if size not in (1, world):
            raise ValueError(f"{flag} {size}: must be 1 or the number of ranks ({world})")
    if world > 1 and max(tp, ep) != world:
        raise ValueError(f"{world} ranks but --tp {tp} --ep {ep}: give --tp {world} and/or --ep {world}")


def start(tp: int, ep: int, device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> Parallel:
    """Join the process group `torchrun` describes (gloo on CPU, NCCL on CUDA); none for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_sizes(tp, ep, world)
    if world == 1:
        return SINGLE
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Parallel(rank=dist.get_rank(), world=world, tp=tp, ep=ep)


def loaded(parallel: Parallel) -> None:
    """Wait for every rank to finish loading; a rank that failed to load is named (gloo)."""
    if not parallel.distributed:
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=LOAD_TIMEOUT_S), wait_all_ranks=True)
    else:
        dist.barrier()


def stop(parallel: Parallel) -> None:
    if parallel.distributed and dist.is_initialized():
        dist.destroy_process_group()


class PeerFailed(RuntimeError):
    """A collective failed: another rank died, stopped or could not take its part in a step."""


def collective(what: str, call: Callable[..., T], *args: Any) -> T:
    """`call(*args)`, a torch.distributed collective; a transport failure becomes one PeerFailed line."""
    try:
        return call(*args)
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) for a lost peer
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PeerFailed(f"rank {dist.get_rank()}: another rank failed during {what}: {detail}") from None
