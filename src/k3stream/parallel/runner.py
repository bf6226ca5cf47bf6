"""Rank 0 drives, the other ranks follow: every forward is one command broadcast from rank 0.

Rank 0 wraps its model in `DriverModel` (the K3Model methods the generation loop and the scheduler
call); each call first broadcasts a command (new state, prefill, decode of a batch) with its token ids,
then runs the forward, in which the ranks meet in the tensor- and expert-parallel collectives. The
other ranks run `follow`: they keep one state per rank-0 state and run the same forwards until rank 0
sends `stop`. Only rank 0 tokenizes, samples and serves; every rank computes the same logits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from k3stream.parallel.groups import collective

NEW, PREFILL, DECODE, STATS, STOP = range(5)
HEADER = 4  # op, ids, tokens, dropped states


class DriverModel:
    """Rank 0's model: each call tells the followers what to run, then runs it here too."""

    def __init__(self, model: Any, report: Callable[[], Any] = lambda: None) -> None:
        self.model = model
        self.report = report
        self._next_id = 0
        self._dropped: list[int] = []

    def __getattr__(self, name: str) -> Any:  # config, device, layers, expert_source, ...
        return getattr(self.model, name)

    def new_state(self) -> Any:
        state = self.model.new_state()
        state.parallel_id = self._next_id
        weakref.finalize(state, self._dropped.append, self._next_id)
        self._send(NEW, [self._next_id], [])
        self._next_id += 1
        return state

    def prefill(self, state: Any, tokens: Iterable[int]) -> torch.Tensor:
        tokens = list(tokens)
        self._send(PREFILL, [state.parallel_id], tokens)
        return self.model.prefill(state, tokens)

    def decode(self, state: Any, token: int) -> torch.Tensor:
        return self.decode_batch([state], [token])[0]

    def decode_batch(self, states: list[Any], tokens: list[int]) -> torch.Tensor:
        self._send(DECODE, [s.parallel_id for s in states], list(tokens))
        return self.model.decode_batch(states, tokens)

    def logits(self, tokens: Iterable[int]) -> torch.Tensor:
        return self.prefill(self.new_state(), tokens)

    def reports(self) -> list[Any]:
        """Every rank's `report()` (what it read, say), in rank order."""
        self._send(STATS, [], [])
        answers: list[Any] = [None] * dist.get_world_size()
        collective("gather", dist.gather_object, self.report(), answers, 0)
        return answers

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        self._send(STOP, [], [])

    def _send(self, op: int, ids: list[int], tokens: list[int]) -> None:
        dropped, self._dropped = self._dropped, []
        header = torch.tensor([op, len(ids), len(tokens), len(dropped)], dtype=torch.int64)
        collective("a broadcast", dist.broadcast, header, 0)
        payload = torch.tensor(ids + tokens + dropped, dtype=torch.int64)
        if len(payload):
            collective("a broadcast", dist.broadcast, payload, 0)


def follow(model: Any, report: Callable[[], Any] = lambda: None) -> int:
    """Run rank 0's commands on `model` until it stops; returns the number of forwards run.

    `report()` is this rank's answer when rank 0 gathers the reports."""
    states: dict[int, Any] = {}
    forwards = 0
    while True:
        header = torch.empty(HEADER, dtype=torch.int64)
        collective("a broadcast", dist.broadcast, header, 0)
        op, n_ids, n_tokens, n_dropped = header.tolist()
        payload = torch.empty(n_ids + n_tokens + n_dropped, dtype=torch.int64)
        if len(payload):
            collective("a broadcast", dist.broadcast, payload, 0)
        values = payload.tolist()
        ids, tokens = values[:n_ids], values[n_ids : n_ids + n_tokens]
        for dropped in values[n_ids + n_tokens :]:
            states.pop(dropped, None)
        if op == STOP:
            return forwards
        if op == NEW:
            states[ids[0]] = model.new_state()
        elif op == PREFILL:
            model.prefill(states[ids[0]], tokens)
            forwards += 1
        elif op == DECODE:
            model.decode_batch([states[i] for i in ids], tokens)
            forwards += 1
        elif op == STATS:
            collective("gather", dist.gather_object, report(), None, 0)
