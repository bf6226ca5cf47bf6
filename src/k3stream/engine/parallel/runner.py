"""Rank 0 drives, the other ranks follow: every forward is one command broadcast from rank 0.

Rank 0 wraps its model in `DriverModel` (the K3Model methods the generation loop and the scheduler
call); each call first broadcasts a command (new state, prefill, decode of a batch) with its token ids,
then runs the forward, in which the ranks meet in the tensor- and expert-parallel collectives. The
other ranks run `follow`: they keep one state per rank-0 state and run the same forwards until rank 0
sends `stop`. Only rank 0 tokenizes, samples and serves; every rank computes the same logits.

With a prompt cache (`engine.prompt_cache`) every rank keeps its own: each snapshots its own shard of a
sequence's state at the same token ids (a follower knows each state's ids from the commands). Rank 0
decides what is restored; a restore counts only when every rank restored that exact prefix (an
all-reduce of one flag), else it is a miss everywhere, so the ranks never continue different states.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from k3stream.engine.parallel.groups import PeerFailed, collective, command_device
from k3stream.engine.prompt_cache import PromptCache
from k3stream.model.kda import KDAState
from k3stream.model.snapshot import prefill_marked_batch

NEW, PREFILL, DECODE, STATS, STOP, NOOP, PREFILL_LAST, PREFILL_BATCH, SAVE, RESTORE = range(10)
HEADER = 5  # op, ids, tokens, dropped states, extra


class DriverModel:
    """Rank 0's model: each call tells the followers what to run, then runs it here too."""

    def __init__(
        self,
        model: Any,
        report: Callable[[], Any] = lambda: None,
        on_failure: Callable[[], None] = lambda: None,
        keepalive_s: float = 5.0,
        layout: str = "",
    ) -> None:
        self.model = model
        self.layout = layout  # this rank's place ("-tp2-ep1-rank0"), keyed into its snapshots' files
        self.report = report
        self.on_failure = on_failure  # called once when a peer failed (the server stops itself)
        self.failure: PeerFailed | None = None
        self._next_id = 0
        self._dropped: list[int] = []
        self._lock = threading.RLock()  # one caller at a time: a command and its forward's collectives
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, args=(keepalive_s,), daemon=True)
        self._keepalive.start()

    def __getattr__(self, name: str) -> Any:  # config, device, layers, expert_source, ...
        return getattr(self.model, name)

    def new_state(self) -> Any:
        with self._lock:
            return self._new_state()

    def _new_state(self) -> Any:
        state = self.model.new_state()
        state.parallel_id = self._next_id
        weakref.finalize(state, self._dropped.append, self._next_id)
        self._send(NEW, [self._next_id], [])
        self._next_id += 1
        return state

    def prefill(self, state: Any, tokens: Iterable[int]) -> torch.Tensor:
        tokens = self._checked(tokens)
        with self._lock:
            self._send(PREFILL, [state.parallel_id], tokens)
            return self._guarded(self.model.prefill, state, tokens)

    def prefill_last(self, state: Any, tokens: Iterable[int]) -> torch.Tensor:
        tokens = self._checked(tokens)
        with self._lock:
            self._send(PREFILL_LAST, [state.parallel_id], tokens, _layout([state], [tokens]))
            return self._guarded(self.model.prefill_last, state, tokens)

    def prefill_batch(self, states: list[Any], token_lists: list[Iterable[int]]) -> torch.Tensor:
        lists = [self._checked(tokens) for tokens in token_lists]
        with self._lock:
            ids, flat = [s.parallel_id for s in states], [t for tokens in lists for t in tokens]
            self._send(PREFILL_BATCH, ids, flat, _layout(states, lists))
            return self._guarded(self.model.prefill_batch, states, lists)

    def save_snapshot(self, state: Any) -> None:
        """Every follower snapshots its shard of `state` into its own cache (at the ids it was fed)."""
        with self._lock:
            self._send(SAVE, [state.parallel_id], [])

    def restored(self, state: Any, tokens: list[int]) -> bool:
        """Whether every follower restored its shard of the snapshot at exactly `tokens` into `state`
        (rank 0 restored its own); where one could not, `state` must be dropped (a miss)."""
        with self._lock:
            self._send(RESTORE, [state.parallel_id], list(tokens))
            return self._guarded(_all_agree, True)

    def decode(self, state: Any, token: int) -> torch.Tensor:
        return self.decode_batch([state], [token])[0]

    def decode_batch(self, states: list[Any], tokens: list[int]) -> torch.Tensor:
        from k3stream.model.k3 import check_batch

        check_batch(states, tokens)
        tokens = self._checked(tokens)
        with self._lock:
            self._send(DECODE, [s.parallel_id for s in states], tokens)
            return self._guarded(self.model.decode_batch, states, tokens)

    def logits(self, tokens: Iterable[int]) -> torch.Tensor:
        return self.prefill(self.new_state(), tokens)

    def reports(self) -> list[Any]:
        """Every rank's `report()` (what it read, say), in rank order."""
        answers: list[Any] = [None] * dist.get_world_size()
        with self._lock:
            self._send(STATS, [], [])
            self._guarded(collective, "gather", dist.gather_object, self.report(), answers, 0)
        return answers

    def close(self) -> None:
        """Stop the keep-alive (the followers are left waiting: `stop` releases them)."""
        self._closed.set()
        self._keepalive.join()

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        self.close()
        with self._lock:
            self._send(STOP, [], [])

    def _keep_alive(self, interval: float) -> None:
        """While rank 0 is idle (a server between requests) the followers wait in a broadcast, which
        times out: an empty command every `interval` keeps them waiting, and finds a dead rank."""
        while not self._closed.wait(interval / 4):
            with self._lock:
                if self.failure is not None:
                    return
                if time.monotonic() - self._last_sent >= interval and not self._closed.is_set():
                    with contextlib.suppress(PeerFailed):  # recorded in self.failure
                        self._send(NOOP, [], [])

    def _checked(self, tokens: Iterable[int]) -> list[int]:
        """Refuse bad ids here, before the followers are told: a bad request must not end them."""
        from k3stream.model.k3 import token_ids

        return token_ids(tokens, self.model.config.vocab_size)

    def _guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        if self.failure is not None:  # the group is gone: fail at once, never wait
            raise self.failure
        try:
            return call(*args)
        except PeerFailed as exc:
            self.failure = exc
            self.on_failure()
            raise
        except Exception as exc:  # this rank's own step (its pack, its reads): the followers are in
            # the step it left, waiting in a collective, so the group cannot go on; this call raises
            # the cause, the run ends naming it
            self.failure = PeerFailed(f"rank 0: {exc}")
            self.on_failure()
            raise

    def _send(self, op: int, ids: list[int], tokens: list[int], extra: list[int] = ()) -> None:
        dropped, self._dropped = self._dropped, []
        extra = list(extra)
        header = torch.tensor([op, len(ids), len(tokens), len(dropped), len(extra)], device=command_device())
        self._last_sent = time.monotonic()
        self._guarded(collective, "a broadcast", dist.broadcast, header, 0)
        payload = torch.tensor(ids + tokens + dropped + extra, dtype=torch.int64, device=command_device())
        if len(payload):
            self._guarded(collective, "a broadcast", dist.broadcast, payload, 0)


def _layout(states: list[Any], token_lists: list[list[int]]) -> list[int]:
    """A prefill's shape for the followers: each sequence's token count, then its snapshot marks (the
    absolute positions `snapshot.prefill_marked_batch` set on its KDA layers), counted then listed."""
    marks = [_marks(state) for state in states]
    return [len(t) for t in token_lists] + [len(m) for m in marks] + [p for m in marks for p in m]


def _marks(state: Any) -> list[int]:
    kda = next((layer for layer in state.layers if isinstance(layer, KDAState)), None)
    return [] if kda is None else [state.length + offset for offset in kda.marks]


def _all_agree(mine: bool) -> bool:
    """Whether every rank says yes (an all-reduce of one flag)."""
    flag = torch.tensor([int(mine)], dtype=torch.int64, device=command_device())
    collective("an all-reduce", dist.all_reduce, flag, dist.ReduceOp.MIN)
    return bool(flag.item())


class Follower:
    """A follower's sequences: its state and the token ids it was fed for each of rank 0's states, and
    its own prompt cache (or None)."""

    def __init__(self, model: Any, cache: PromptCache | None) -> None:
        self.model, self.cache = model, cache
        self.states: dict[int, Any] = {}
        self.fed: dict[int, list[int]] = {}

    def run(self, op: int, ids: list[int], tokens: list[int], extra: list[int]) -> None:
        if op == NEW:
            self.states[ids[0]], self.fed[ids[0]] = self.model.new_state(), []
        elif op == PREFILL:
            self.model.prefill(self.states[ids[0]], tokens)
            self.fed[ids[0]] += tokens
        elif op in (PREFILL_LAST, PREFILL_BATCH):
            self._prefill(op, ids, tokens, extra)
        elif op == DECODE:
            self.model.decode_batch([self.states[i] for i in ids], tokens)
            for state_id, token in zip(ids, tokens, strict=True):
                self.fed[state_id].append(token)
        elif op == SAVE and self.cache is not None:
            self.cache.save(self.fed[ids[0]], self.states[ids[0]])
        elif op == RESTORE:
            state = self.cache.restore_exact(tokens) if self.cache is not None else None
            if _all_agree(state is not None):
                self.states[ids[0]], self.fed[ids[0]] = state, list(tokens)

    def drop(self, state_id: int) -> None:
        self.states.pop(state_id, None)
        self.fed.pop(state_id, None)

    def _prefill(self, op: int, ids: list[int], tokens: list[int], extra: list[int]) -> None:
        count = len(ids)
        lengths, mark_counts, flat_marks = extra[:count], extra[count : 2 * count], extra[2 * count :]
        bounds = [sum(lengths[:i]) for i in range(count + 1)]
        parts = [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        states = [self.states[i] for i in ids]
        ends = [sum(mark_counts[:i]) for i in range(count + 1)]
        marks = [flat_marks[a:b] for a, b in zip(ends, ends[1:], strict=False)]
        starts = [state.length for state in states]
        if self.cache is not None and any(marks):
            _, inside = prefill_marked_batch(self.model, states, parts, marks)
        elif op == PREFILL_LAST:
            self.model.prefill_last(states[0], parts[0])
            inside = [[]]
        else:
            self.model.prefill_batch(states, parts)
            inside = [[] for _ in states]
        for state_id, part, start, snapshots in zip(ids, parts, starts, inside, strict=True):
            self.fed[state_id] += part
            if self.cache is not None:
                self.cache.note_prefilled(self.fed[state_id], start, start + len(part), snapshots)


def follow(model: Any, report: Callable[[], Any] = lambda: None, cache: PromptCache | None = None) -> None:
    """Run rank 0's commands on `model` until it stops; `report()` answers rank 0's `reports()`; `cache`:
    this rank's prompt cache (rank 0 has one too)."""
    follower = Follower(model, cache)
    while True:
        op, ids, tokens, dropped, extra = _receive()
        for state_id in dropped:
            follower.drop(state_id)
        if op == STOP:
            return
        if op == STATS:
            collective("gather", dist.gather_object, report(), None, 0)
        else:
            follower.run(op, ids, tokens, extra)


def _receive() -> tuple[int, list[int], list[int], list[int], list[int]]:
    """The next command: op, state ids, token ids, state ids rank 0 dropped, extra ints."""
    header = torch.empty(HEADER, dtype=torch.int64, device=command_device())
    collective("a broadcast", dist.broadcast, header, 0)
    op, n_ids, n_tokens, n_dropped, n_extra = header.tolist()
    payload = torch.empty(n_ids + n_tokens + n_dropped + n_extra, dtype=torch.int64, device=command_device())
    if len(payload):
        collective("a broadcast", dist.broadcast, payload, 0)
    values = payload.tolist()
    ends = (n_ids, n_ids + n_tokens, n_ids + n_tokens + n_dropped)
    return op, values[: ends[0]], values[ends[0] : ends[1]], values[ends[1] : ends[2]], values[ends[2] :]
