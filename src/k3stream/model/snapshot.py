"""Sequence-state snapshots: what a sequence holds at position p, restorable to the same bits.

A sequence's state (`k3.SequenceState`) is, per layer, a KDA layer's conv history and recurrent state
(fixed size, changed in place by every step: a snapshot copies them) or an MLA layer's latent cache
(one row per token, only ever appended to: a snapshot keeps a reference to the live buffer and its
length, so the snapshots of one conversation share its rows). Nothing else carries over between calls:
the attention-residual bank lives inside one forward, and MLA is NoPE (no positions to keep).

A restored state continues exactly as the cold one would: on the CPU kernels the KDA recurrence runs a
prefill token by token (`kda.KDA.prefill`), and every other product's row is computed from that row
alone, so where a prefill starts does not change a bit. Elsewhere (the chunked torch recurrence, torch's
fallbacks for the C kernels, other devices) a resumed prefill's bits differ from the cold one's
(`restores_exactly`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from k3stream.model.kda import KDAState
from k3stream.model.mla import MLAState

if TYPE_CHECKING:
    from k3stream.model.k3 import K3Model, SequenceState


@dataclass(frozen=True)
class LatentRows:
    """The first `length` rows of an append-only latent buffer (shared with the sequence that wrote it
    and with its other snapshots; `written`: the buffer's count of rows written, `MLAState.written`,
    None for rows of their own)."""

    buffer: torch.Tensor
    length: int
    written: list[int] | None = field(default=None, compare=False)

    def rows(self) -> torch.Tensor:
        return self.buffer[: self.length]

    @property
    def nbytes(self) -> int:
        return self.length * self.buffer.shape[1] * self.buffer.element_size()

    def storage_key(self) -> int:
        return self.buffer.untyped_storage().data_ptr()

    @property
    def storage_bytes(self) -> int:
        return self.buffer.untyped_storage().nbytes()


@dataclass(frozen=True)
class Snapshot:
    """A sequence's state after its first `length` tokens: per layer a KDAState (copies) or LatentRows."""

    length: int
    layers: tuple[KDAState | LatentRows, ...]
    logits: torch.Tensor | None = None  # the last token's [vocab], where the snapshot ends a prefill

    def with_logits(self, logits: torch.Tensor) -> Snapshot:
        return Snapshot(self.length, self.layers, logits.detach().clone())

    @property
    def fixed_bytes(self) -> int:
        """Bytes of the KDA layers' copies (the same at every position) and of the logits."""
        kda = sum(_tensor_bytes(s.conv) + _tensor_bytes(s.recurrent) for s in self._kda())
        return kda + (0 if self.logits is None else _tensor_bytes(self.logits))

    @property
    def latent_bytes(self) -> int:
        """Bytes of the latent rows the snapshot refers to (shared: counted per snapshot here)."""
        return sum(layer.nbytes for layer in self.layers if isinstance(layer, LatentRows))

    @property
    def nbytes(self) -> int:
        return self.fixed_bytes + self.latent_bytes

    def latents(self) -> list[LatentRows]:
        return [layer for layer in self.layers if isinstance(layer, LatentRows)]

    def _kda(self) -> list[KDAState]:
        return [layer for layer in self.layers if isinstance(layer, KDAState)]


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def take_snapshot(state: SequenceState, final: bool = False) -> Snapshot:
    """The state as it is now; the live sequence may go on (its latent appends land past the snapshot's
    rows, its KDA steps change its own tensors). `final`: the state goes no further (a finished
    response; nothing may step it again), so the snapshot takes its KDA tensors instead of copying
    them, and its latent rows get room for a next turn (`_with_room`)."""
    layers: list[KDAState | LatentRows] = []
    for layer in state.layers:
        if isinstance(layer, KDAState):
            conv, recurrent = (_own(tensor, copy=not final) for tensor in (layer.conv, layer.recurrent))
            layers.append(KDAState(conv, recurrent))
        elif isinstance(layer, MLAState):
            rows = LatentRows(layer.buffer, layer.length, layer.written)
            layers.append(_with_room(rows) if final else rows)
        else:
            raise TypeError(f"cannot snapshot a layer state of type {type(layer).__name__}")
    return Snapshot(state.length, tuple(layers))


def _own(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """`tensor` for a snapshot: a copy, or itself where it may be taken and is the whole of its memory
    (a view, of a batched step's stack or a prefill's window, is copied: it would hold all of it)."""
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == _tensor_bytes(tensor)
    return tensor.detach() if whole and not copy else tensor.detach().clone()


def _with_room(rows: LatentRows) -> LatentRows:
    """A finished state's latent rows in a buffer with room for a quarter as many again: their own, or
    a copy in one twice their length. A restore continues a buffer in place only where the next turn's
    tokens fit, else copies the rows on that turn's first token's path; copied here, they are copied
    after the response's end is sent (about as often: each copy leaves the old buffer to the older
    snapshots that hold it)."""
    if 4 * rows.buffer.shape[0] >= 5 * rows.length:
        return rows
    buffer = rows.buffer.new_empty(2 * rows.length, rows.buffer.shape[1])
    buffer[: rows.length] = rows.rows()
    return LatentRows(buffer, rows.length, [rows.length])


def restore(model: K3Model, snapshot: Snapshot, room: int = 0) -> SequenceState:
    """A new sequence state equal to the one `snapshot` was taken of (continuing it leaves the snapshot
    and the sequences sharing its rows untouched). Its latent rows are the snapshot's buffer itself
    where they end what was written into it and `room` more rows fit (a conversation's next turn: it
    appends in place, `MLAState`), else a copy with room for twice its tokens and `room` more (a prefill
    about to follow and the response after it then do not grow it)."""
    state = model.new_state()
    check_fits(state, snapshot)
    for index, saved in enumerate(snapshot.layers):
        live = state.layers[index]
        if isinstance(saved, KDAState):
            live.conv.copy_(saved.conv)
            live.recurrent.copy_(saved.recurrent)
        elif _continues(saved, room):
            live.share(saved.buffer, saved.length, saved.written)
        else:
            live.reserve(2 * (saved.length + room))
            live.append(saved.rows())
    state.length = snapshot.length
    return state


def _continues(rows: LatentRows, room: int) -> bool:
    """Whether a restore may share `rows`' buffer: no one wrote past them, and `room` more fit."""
    fits = rows.length + room <= rows.buffer.shape[0]
    return rows.written is not None and rows.written[0] == rows.length and fits


def check_fits(state: SequenceState, snapshot: Snapshot) -> None:
    """One line for a snapshot of another model (layer kinds or shapes differ)."""
    if len(state.layers) != len(snapshot.layers):
        raise ValueError(f"snapshot of {len(snapshot.layers)} layers for a model of {len(state.layers)}")
    for index, (live, saved) in enumerate(zip(state.layers, snapshot.layers, strict=True)):
        if isinstance(live, KDAState) and isinstance(saved, KDAState):
            fits = live.conv.shape == saved.conv.shape and live.recurrent.shape == saved.recurrent.shape
        elif isinstance(live, MLAState) and isinstance(saved, LatentRows):
            fits = live.buffer.shape[1] == saved.buffer.shape[1] and saved.length <= saved.buffer.shape[0]
        else:
            fits = False
        if not fits:
            raise ValueError(f"snapshot layer {index} does not fit this model's layer {index}")


@dataclass(frozen=True)
class StateLayout:
    """The shapes a snapshot of a model's states takes: per layer ("kda", conv shape, recurrent shape)
    or ("mla", row width), and the width of its logits."""

    layers: tuple[tuple[str, list[int], list[int]] | tuple[str, int], ...]
    vocab: int


def state_layout(model: K3Model) -> StateLayout:
    """`model`'s state layout, from a new state of it (its shard's, under `--tp`)."""
    layers: list[tuple[str, list[int], list[int]] | tuple[str, int]] = []
    for layer in model.new_state().layers:
        if isinstance(layer, KDAState):
            layers.append(("kda", list(layer.conv.shape), list(layer.recurrent.shape)))
        else:
            layers.append(("mla", layer.buffer.shape[1]))
    return StateLayout(tuple(layers), model.config.vocab_size)


def restores_exactly(model: K3Model) -> bool:
    """Whether a prefill resumed from a snapshot gets the cold prefill's bits: on the CPU with the C
    kernels (the per-token KDA recurrence). Without them, even at multiples of the KDA chunk, torch's
    fallbacks gave other bits (the tiny model, a restore at 16 continued to 32)."""
    from k3stream.quant.kernels import cpu

    return model.device.type == "cpu" and cpu.available()


def prefill_marked(
    model: K3Model, state: SequenceState, tokens: list[int], marks: list[int]
) -> tuple[torch.Tensor, list[Snapshot]]:
    """`model.prefill_last(state, tokens)` that also snapshots the state at each length in `marks` (sorted,
    inside the prefill) in the same pass: each KDA layer runs its recurrence in runs split there and keeps
    a copy at each; the MLA layers' rows are a length into the buffer the pass fills. No snapshots where
    the recurrence is not the per-token C one (a prefill's positions then group by chunk)."""
    logits, snapshots = prefill_marked_batch(model, [state], [tokens], [marks])
    return logits[0], snapshots[0]


def prefill_marked_batch(
    model: K3Model, states: list[SequenceState], token_lists: list[list[int]], marks: list[list[int]]
) -> tuple[torch.Tensor, list[list[Snapshot]]]:
    """`prefill_marked` of several sequences in one pass (`K3Model.prefill_batch`): the last logits of
    each [B, vocab] and each one's snapshots."""
    insides = [
        tuple(mark - state.length for mark in wanted if state.length < mark < state.length + len(tokens))
        for state, tokens, wanted in zip(states, token_lists, marks, strict=True)
    ]
    kdas = [[layer for layer in state.layers if isinstance(layer, KDAState)] for state in states]
    for kda, inside in zip(kdas, insides, strict=True):
        for layer in kda:
            layer.marks, layer.marked = inside, []
    bases = [state.length for state in states]
    try:
        if len(states) == 1:
            logits = model.prefill_last(states[0], token_lists[0])[None]
        else:
            logits = model.prefill_batch(states, token_lists)
    finally:
        captured = [[layer.marked for layer in kda] for kda in kdas]
        for kda in kdas:
            for layer in kda:
                layer.marks, layer.marked = (), []
    snapshots = [
        _marked_snapshots(state, base, inside, copies)
        for state, base, inside, copies in zip(states, bases, insides, captured, strict=True)
    ]
    return logits, snapshots


def _marked_snapshots(
    state: SequenceState, base: int, inside: tuple[int, ...], captured: list[list[KDAState]]
) -> list[Snapshot]:
    """The snapshots at `base + inside` of a state whose KDA layers kept `captured` copies (none where a
    layer kept fewer: it ran the chunked recurrence)."""
    if any(len(copies) != len(inside) for copies in captured):
        return []
    snapshots = []
    for index, offset in enumerate(inside):
        copies = iter(copies[index] for copies in captured)
        layers = tuple(
            next(copies)
            if isinstance(layer, KDAState)
            else LatentRows(layer.buffer, base + offset, layer.written)
            for layer in state.layers
        )
        snapshots.append(Snapshot(base + offset, layers))
    return snapshots
