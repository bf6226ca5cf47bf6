"""Rank 0 drives, the other ranks follow: every forward is one command broadcast from rank 0.

Rank 0 wraps its model in `DriverModel` (the K3Model methods the generation loop and the scheduler
call); each call first broadcasts a command (new state, prefill, decode of a batch) with its token ids,
then runs the forward, in which the ranks meet in the tensor- and expert-parallel collectives. The
other ranks run `follow`: they keep one state per rank-0 state and run the same forwards until rank 0
sends `stop`. Only rank 0 tokenizes, samples and serves; every rank computes the same logits.
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

NEW, PREFILL, DECODE, STATS, STOP, NOOP, PREFILL_LAST = range(7)
HEADER = 4  # op, ids, tokens, dropped states


class DriverModel:
    """Rank 0's model: each call tells the followers what to run, then runs it here too."""

    def __init__(
        self,
        model: Any,
        report: Callable[[], Any] = lambda: None,
        on_failure: Callable[[], None] = lambda: None,
        keepalive_s: float = 5.0,
    ) -> None:
        self.model = model
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
            self._send(PREFILL_LAST, [state.parallel_id], tokens)
            return self._guarded(self.model.prefill_last, state, tokens)

    def decode(self, state: Any, token: int) -> torch.Tensor:
        return self.decode_batch([state], [token])[0]

    def decode_batch(self, states: list[Any], tokens: list[int]) -> torch.Tensor:
        if len(states) != len(tokens):
            raise ValueError(f"decode_batch: {len(states)} states but {len(tokens)} tokens")
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
        tokens, vocab = [int(t) for t in tokens], self.model.config.vocab_size
        if not tokens:
            raise ValueError("expected a non-empty list of token ids")
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"token id outside 0..{vocab - 1}")
        return tokens

    def _guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        if self.failure is not None:  # the group is gone: fail at once, never wait
            raise self.failure
        try:
            return call(*args)
        except PeerFailed as exc:
            self.failure = exc
            self.on_failure()
            raise

    def _send(self, op: int, ids: list[int], tokens: list[int]) -> None:
        dropped, self._dropped = self._dropped, []
        header = torch.tensor([op, len(ids), len(tokens), len(dropped)], device=command_device())
        self._last_sent = time.monotonic()
        self._guarded(collective, "a broadcast", dist.broadcast, header, 0)
        payload = torch.tensor(ids + tokens + dropped, dtype=torch.int64, device=command_device())
        if len(payload):
            self._guarded(collective, "a broadcast", dist.broadcast, payload, 0)


def follow(model: Any, report: Callable[[], Any] = lambda: None) -> None:
    """Run rank 0's commands on `model` until it stops; `report()` answers rank 0's `reports()`."""
    states: dict[int, Any] = {}
    while True:
        op, ids, tokens, dropped = _receive()
        for state_id in dropped:
            states.pop(state_id, None)
        if op == STOP:
            return
        if op == NEW:
            states[ids[0]] = model.new_state()
        elif op == PREFILL:
            model.prefill(states[ids[0]], tokens)
        elif op == PREFILL_LAST:
            model.prefill_last(states[ids[0]], tokens)
        elif op == DECODE:
            model.decode_batch([states[i] for i in ids], tokens)
        elif op == STATS:
            collective("gather", dist.gather_object, report(), None, 0)


def _receive() -> tuple[int, list[int], list[int], list[int]]:
    """The next command: op, state ids, token ids, state ids rank 0 dropped."""
    header = torch.empty(HEADER, dtype=torch.int64, device=command_device())
    collective("a broadcast", dist.broadcast, header, 0)
    op, n_ids, n_tokens, n_dropped = header.tolist()
    payload = torch.empty(n_ids + n_tokens + n_dropped, dtype=torch.int64, device=command_device())
    if len(payload):
        collective("a broadcast", dist.broadcast, payload, 0)
    values = payload.tolist()
    return op, values[:n_ids], values[n_ids : n_ids + n_tokens], values[n_ids + n_tokens :]
