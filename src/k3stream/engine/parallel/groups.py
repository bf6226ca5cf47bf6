"""The process group: one per run, every rank in it, started from `torchrun`'s environment."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from k3stream.engine.parallel import DEFAULT_TIMEOUT_S

T = TypeVar("T")

HEARTBEAT_S = 0.25
SILENT_AFTER_S = 2.0  # eight beats
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
    try:
        with _plain_sigterm_while_joining():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except dist.DistStoreError as exc:  # "wait timeout after 20000ms, keys: /default_pg/0//cpu//0/1"
        raise PeerFailed(
            f"rank {os.environ.get('RANK', '?')}: not all {world} ranks joined within {timeout_s:g} s "
            f"(--dist-timeout): a rank that stopped before joining says why in its own output ({exc})"
        ) from None
    global _heartbeat, _plain_sigterm
    _heartbeat = Heartbeat(dist.get_rank(), world)
    if threading.current_thread() is threading.main_thread():
        _plain_sigterm = signal.signal(signal.SIGTERM, _stopped_by_torchrun)
    return Parallel(rank=dist.get_rank(), world=world, tp=tp, ep=ep)


@contextlib.contextmanager
def _plain_sigterm_while_joining() -> Any:
    """SIGTERM ends this process at once while it waits for the others to join: torchrun sends it when a
    rank stopped before joining (rank 0's --port in use, say), and a Python handler would run only
    once the join gave up, after --dist-timeout. Nothing is loaded yet, so nothing needs cleaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped_by_torchrun(signum: int, frame: Any) -> None:
    """torchrun stops the survivors as soon as one rank dies, often before their next collective
    fails: end with the line a failed collective gives, naming the rank that stopped beating. Where
    every rank still beats, the run itself was stopped (a user's SIGTERM or Ctrl-C to torchrun, which
    sends every rank SIGTERM): the process's own SIGTERM handling ends it."""
    silent = _silent_ranks()
    if silent or not callable(_plain_sigterm):
        raise PeerFailed(_failure("a step", RuntimeError("stopped by torchrun"), silent))
    _plain_sigterm(signum, frame)


def follow_through_stops() -> None:
    """Let SIGTERM and Ctrl-C's SIGINT (torchrun passes both to every rank; a terminal sends Ctrl-C to
    every process) pass on this follower: it ends when rank 0 releases it (a server that shut down
    gracefully, its streams finished) or when its group fails, never in the middle of a step."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def agree(parallel: Parallel, facts: dict[str, tuple[str, str]]) -> None:
    """Refuse a run whose ranks differ in what every rank must share (`facts`: a name, then what is
    compared and what the error shows): one line naming the first that differs from rank 0's, raised on
    every rank, before any rank starts loading. Ranks that ran other models, flags or kernels would
    meet in collectives of other sizes (gloo aborts) or silently compute other tokens."""
    every: list[Any] = [None] * parallel.world
    collective("the start check", dist.all_gather_object, every, facts)
    for rank, theirs in enumerate(every[1:], start=1):
        for name, (value, shown) in every[0].items():
            their_value, their_shown = theirs.get(name, ("", "none"))  # none: another k3stream
            if their_value != value:
                raise ValueError(
                    f"rank {rank}'s {name} differs from rank 0's: {their_shown} against {shown} "
                    "(every rank must run the same)"
                )


def loaded(parallel: Parallel) -> None:
    """Wait for every rank to finish loading; a rank that failed to load is named (gloo)."""
    if not parallel.distributed:
        return
    if dist.get_backend() == "gloo":
        timeout = timedelta(seconds=LOAD_TIMEOUT_S)
        collective("loading", dist.monitored_barrier, None, timeout, True)
    else:
        collective("loading", dist.barrier)


def command_device() -> torch.device:
    """Where rank 0's command tensors live: NCCL moves only CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stop(parallel: Parallel) -> None:
    """Leave the process group and stop the heartbeat."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.close()
        _heartbeat = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if parallel.distributed and dist.is_initialized():
        dist.destroy_process_group()


class PeerFailed(RuntimeError):
    """A collective failed: another rank died, stopped or could not take its part in a step."""


class Heartbeat:
    """Each rank bumps its counter in torchrun's store every HEARTBEAT_S; after a failed collective the
    ranks whose counters stand still are the ones that died or stopped (named in the error)."""

    def __init__(self, rank: int, world: int) -> None:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store = dist.PrefixStore(
            "k3stream/heartbeat/", dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        )
        self.rank, self.world = rank, world
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._run, name="k3stream-heartbeat", daemon=True)
        self.thread.start()

    def beat(self) -> list[int]:
        """Bump this rank's counter; every rank's counter."""
        with self.lock:
            self.store.add(str(self.rank), 1)
            return [self.store.add(str(r), 0) for r in range(self.world)]

    def silent_ranks(self) -> list[int]:
        """The other ranks that did not beat during the next few beats."""
        before = self.beat()
        time.sleep(SILENT_AFTER_S)
        after = self.beat()
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def close(self) -> None:
        """Stop beating (before the process exits: the store client must not die mid-call)."""
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # the store went away: the run is ending
            while not self.stopped.wait(HEARTBEAT_S):
                self.beat()


_heartbeat: Heartbeat | None = None
_plain_sigterm: Any = None  # the process's SIGTERM handler before the group's


def collective(what: str, call: Callable[..., T], *args: Any) -> T:
    """`call(*args)`, a torch.distributed collective; a transport failure becomes one PeerFailed line
    naming the ranks that stopped beating."""
    try:
        return call(*args)
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (DistBackendError) for a lost peer
        raise PeerFailed(_failure(what, exc)) from None


def _failure(what: str, exc: RuntimeError, silent: list[int] | None = None) -> str:
    """The line of a failed collective; `silent`: the ranks found silent already (asked when None)."""
    # gloo: "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:42661. This is typically ..."
    detail = re.sub(r"^\[[^\]]*\] ", "", str(exc).split(". ")[0].splitlines()[0]) or type(exc).__name__
    rank = dist.get_rank()
    silent = _silent_ranks() if silent is None else silent
    if not silent:
        return f"rank {rank}: another rank failed during {what} ({detail})"
    names = ", ".join(str(r) for r in silent)
    return f"rank {rank}: rank {names} failed or stopped (no heartbeat) during {what} ({detail})"


def _silent_ranks() -> list[int]:
    """Ask the heartbeat, holding off torchrun's SIGTERM meanwhile (it stops the survivors of a dead
    rank at once) so that this rank can still say which one failed."""
    if _heartbeat is None:
        return []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        return _heartbeat.silent_ranks()
    except Exception:  # the store is gone too (rank 0's node): nothing to name
        return []
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
