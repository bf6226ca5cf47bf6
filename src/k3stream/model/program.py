"""One sequence's decode step as a program: C calls bound to buffers of their own, built once.

Outside its weight reads, an eager decode token (`k3.K3Model._forward`) spends its time in a few
hundred Python-level steps: wrapper checks, tensor allocations, small torch operations. A
`DecodeProgram` builds the step of one sequence once (its KDA states bound into the calls) as a list of
C calls on fixed buffers (`kernels.cpu.Call`), with Python steps only where the work changes from token
to token: the embedding (a C decode of the token's row), each MoE layer's routed experts (fetched and
computed by the layer's own `routed_pairs`, so any expert source or expert-parallel wrapper serves
them; all in RAM, one C call from their addresses) and MLA's attention over its growing cache (a C
append and a C attention). Those steps call C directly, not torch: in a token whose weight reads have
evicted torch's code and data from the caches, one small torch operation costs 30-120 us. It computes
what `_forward` computes with the same C functions on the same values, so its logits are equal bit for
bit (tested). A model sending token hints (a one-row step's default) gets them, and the pre-attention
hints that follow them, as Python steps where `_forward` sends them, and each MoE layer's routing
learned after it; a model with a step that has no C form here (another device, the reference path, a
wrapped layer, layer-ahead or pre-attention hints alone) keeps the eager forward. `owners` names each
step's part of the model (a layer's attention or feed-forward, a MoE layer's shared experts; None for
the embedding, norms, residual mixes, hints and the head): a profile times the steps part by part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k3stream.model.attn_res import bind_residual_mix
from k3stream.model.hints import sent_kinds
from k3stream.model.kda import KDAState
from k3stream.model.layers import bind_linear, bind_rms_norm
from k3stream.model.moe import LatentMoE
from k3stream.quant.kernels import cpu

if TYPE_CHECKING:
    from k3stream.model.state import DecodedModel, Layer, SequenceState


class DecodeProgram:
    """The decode step of the sequence `state` on `threads` threads: `run(ids)` -> logits [1, V].
    `steps` is None off the CPU kernels and for a model that sends hints other than token hints (the
    caller then runs the eager forward)."""

    def __init__(self, model: DecodedModel, state: SequenceState, threads: int) -> None:
        self.model = model
        self.threads = threads
        self._parts = _parts(model)
        self._state_layers = list(state.layers)
        self._state_buffers = _state_buffers(state)
        self._hint_from = model._token_hint_from  # the token hints' lead (`set_token_hint_lead`)
        self._hinting = _hinting(model)
        self._token = 0
        hidden = model.config.hidden
        self._x = torch.empty(1, hidden)  # the token's embedding: the first layer's input
        self.final = torch.empty(1, hidden)  # the last layer's output, mixed and normed for lm_head
        self._logits = torch.empty(1, model.config.vocab_size)
        self.steps: list[cpu.Call] | None = None
        self.owners: list[object | None] = []  # each step's part of the model (None: between parts)
        if model.device.type == "cpu" and cpu.available() and _hints_in_program(model):
            self.steps = self._build(state)

    def fits(self, model: DecodedModel, state: SequenceState, threads: int) -> bool:
        """Whether this program is the step of `state` in `model` as it is now (the same layers, the
        same state tensors, the same thread count, the same hints and lead)."""
        return (
            threads == self.threads
            and len(state.layers) == len(self._state_layers)
            and all(now is then for now, then in zip(state.layers, self._state_layers, strict=True))
            and _state_buffers(state) == self._state_buffers
            and all(now is then for now, then in zip(_parts(model), self._parts, strict=True))
            and model._token_hint_from is self._hint_from
            and _hinting(model) == self._hinting
        )

    def run(self, token: int) -> torch.Tensor:
        """The logits [1, V] of `token` (a checked id); advances the bound state as `_forward` does."""
        self._token = token
        cpu.run_calls(self.steps)
        return self._logits.clone()

    def _build(self, state: SequenceState) -> list[cpu.Call]:
        """The steps of `_forward` for one token of `state`."""
        model, x = self.model, self._x
        embed = model.embedding.row_writer(self._x)
        steps = [cpu.python_step(lambda: embed(self._token))]
        owners = self.owners

        def owned(part: object | None) -> None:  # the steps appended since the last call are `part`'s
            owners.extend([part] * (len(steps) - len(owners)))

        if model.prefetch:
            steps += [self._token_hint(first) for first in model._first_token_hints]
        bank: list[torch.Tensor] = []
        for layer in model.layers:
            if model.prefetch:
                steps += self._hints_at(layer, x)
            h = x if not bank else self._mix(steps, bank, x, layer.attn_score)
            banked = layer.index % model.config.block_size == 0
            if banked:
                bank.append(x)
            normed = self._norm(steps, h, layer.input_norm)
            attended = torch.empty_like(x)
            owned(None)
            steps += self._attention(layer, normed, attended, state.layers[layer.index])
            owned(layer.attn)
            prefix = attended if banked else torch.empty_like(x)
            if not banked:
                steps.append(cpu.bind_add(x, attended, prefix))
            mixed = self._norm(
                steps, self._mix(steps, bank, prefix, layer.ffn_score), layer.post_attention_norm
            )
            ffn_out = torch.empty_like(x)
            owned(None)
            for part, part_steps in self._ffn(layer, mixed, ffn_out):
                steps += part_steps
                owned(part)
            if model.prefetch and isinstance(layer.ffn, LatentMoE):
                steps.append(cpu.python_step(lambda moe=layer.ffn: self._learn_routes(moe)))
                owned(layer.ffn)
            x = torch.empty_like(x)
            steps.append(cpu.bind_add(prefix, ffn_out, x))
        mixed = self._mix(steps, bank, x, model.output_score)
        steps.append(bind_rms_norm(mixed, model.norm, model.eps, self.final))
        steps.append(bind_linear(model.lm_head, self.final, self._logits, self.threads))
        owned(None)
        return steps

    def _hints_at(self, layer: Layer, x: torch.Tensor) -> list[cpu.Call]:
        """The hint steps at the start of `layer` (input `x`), as `_forward` sends them: the token hint
        of the MoE layer the lead ahead, then the layer's own pre-attention hint where it follows."""
        model = self.model
        steps = []
        if layer.index in model._token_hint_from:
            steps.append(self._token_hint(model._token_hint_from[layer.index]))
        if isinstance(layer.ffn, LatentMoE) and "pre-attention" in sent_kinds(model.prefetch_hint, 1):
            steps.append(cpu.python_step(lambda: model._predict("pre-attention", layer, x, 1)))
        return steps

    def _token_hint(self, layer: Layer) -> cpu.Call:
        """The step sending `layer`'s token hint for the step's token (as `_forward` sends it)."""
        return cpu.python_step(lambda: self.model._predict_from_tokens(layer, [self._token], 1))

    def _learn_routes(self, moe: LatentMoE) -> None:
        """What `_forward` does after a MoE layer of a model sending hints: score the predictions made
        for it, and learn the token's route for the next token hints."""
        chosen = moe.chosen.numpy()  # a view: no torch operation (see `TokenRoutes.learn`)
        self.model.hints.used(moe.layer, chosen.ravel().tolist())  # one row: no sort
        self.model.token_routes.learn(moe.layer, [self._token], chosen)

    def _attention(
        self, layer: Layer, normed: torch.Tensor, out: torch.Tensor, state: object
    ) -> list[cpu.Call]:
        return layer.attn.decode_steps(normed, out, state, self.threads)

    def _ffn(self, layer: Layer, h: torch.Tensor, out: torch.Tensor) -> list[tuple[object, list[cpu.Call]]]:
        """The feed-forward's steps, each run of them with the part it is the work of."""
        if isinstance(layer.ffn, LatentMoE):
            return layer.ffn.decode_parts(h, out, self.threads)
        return [(layer.ffn, [layer.ffn.bind(h, out, self.threads)])]

    def _mix(
        self, steps: list, bank: list[torch.Tensor], current: torch.Tensor, score: torch.Tensor
    ) -> torch.Tensor:
        """`residual_mix(bank, current, score)` into a new buffer (its step appended to `steps`)."""
        out = torch.empty_like(current)
        steps.append(bind_residual_mix(list(bank), current, score, self.model.eps, out))
        return out

    def _norm(self, steps: list, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`rms_norm(x, weight)` into a new buffer (its step appended to `steps`)."""
        out = torch.empty_like(x)
        steps.append(bind_rms_norm(x, weight, self.model.eps, out))
        return out


def _hints_in_program(model: DecodedModel) -> bool:
    """Whether the program sends what `_forward` would send of `model`'s hints in a one-row step: none,
    or the token hints and then any pre-attention hints that follow them (a layer-ahead hint, predicted
    from the stream inside a layer, stays eager)."""
    if not model.prefetch:
        return True
    return sent_kinds(model.prefetch_hint, 1)[0] == "token" and not model.score_all_hints


def _hinting(model: DecodedModel) -> tuple[bool, str, bool]:
    """What decides the hints a model sends."""
    return model.prefetch, model.prefetch_hint, model.score_all_hints


def _parts(model: DecodedModel) -> list[object]:
    """What a program binds of the model: each layer's attention and feed-forward, the output head."""
    return [part for layer in model.layers for part in (layer.attn, layer.ffn)] + [model.lm_head]


def _state_buffers(state: SequenceState) -> list[int]:
    """The addresses of the state's KDA tensors (a prefill replaces a conv history's tensor)."""
    kda = [layer for layer in state.layers if isinstance(layer, KDAState)]
    return [tensor.data_ptr() for layer in kda for tensor in (layer.conv, layer.recurrent)]
