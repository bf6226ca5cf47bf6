"""The Kimi-K3 model: hybrid KDA/MLA attention, attention residuals, latent MoE.

    x = embed(tokens); bank = []
    for layer i:
        h = mix(bank, x, attn_score)             # attention residuals, before banking
        if i % block_size == 0: bank += [x]      # the raw layer input
        a = attn(rms(h, attn_norm))
        p = a if banked else x + a               # the running sum restarts after banking
        x = p + ffn(rms(mix(bank, p, ffn_score), ffn_norm))
    logits = lm_head(rms(mix(bank, x, output_score), norm))

Prefill runs one sequence over T tokens; decode runs one token of each of B sequences. Both go
through the same layer loop; only the attention layers see the per-sequence state.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import torch

from k3stream.experts import ExpertSource
from k3stream.gguf.config import K3Config
from k3stream.gguf.layout import check_residual_score, check_ssm_a, is_routed_expert
from k3stream.gguf.weights import nonexpert_tensors
from k3stream.model.attn_res import residual_mix
from k3stream.model.experts import GGUFExpertSource
from k3stream.model.hints import GAP_HINT_RANKS, HINT_CHOICES, TOKEN_HINT_LEAD, HintLog, sent_kinds
from k3stream.model.kda import KDA, KDAWeights, shard_kda_weights
from k3stream.model.layers import GGUFTensor, Linear, rms_norm
from k3stream.model.mla import MLA, HeadProjection, MLAWeights
from k3stream.model.moe import LatentMoE, MoEWeights, Routing, SituMLP, by_votes
from k3stream.model.options import LoadOptions
from k3stream.model.program import DecodeProgram
from k3stream.model.state import Embedding, Layer, SequenceState
from k3stream.model.token_routes import TokenRoutes
from k3stream.quant.kernels import note_fallbacks, warm_up
from k3stream.quant.types import FLOAT_TYPE_IDS

if TYPE_CHECKING:
    from k3stream.gguf.reader import K3Checkpoint

Rows = TypeVar("Rows", torch.Tensor, list[int])


class K3Model:
    # (parameters, bytes) of the GGUF's tensors, set by `load`: llama-server's `n_params` and `size`
    file_weights: tuple[int, int] = (0, 0)

    def __init__(
        self,
        config: K3Config,
        embedding: Embedding,
        layers: list[Layer],
        norm: torch.Tensor,
        output_score: torch.Tensor,
        lm_head: Linear,
        expert_source: ExpertSource,
        device: torch.device,
        prefetch: bool = True,
        prefetch_hint: str = "auto",
    ) -> None:
        if prefetch_hint not in HINT_CHOICES:
            raise ValueError(f"prefetch hint must be one of {', '.join(HINT_CHOICES)}, got {prefetch_hint!r}")
        self.config = config
        self.embedding = embedding
        self.layers = layers
        self.norm = norm
        self.output_score = output_score
        self.lm_head = lm_head
        self.expert_source = expert_source
        self.device = device
        # a source whose prefetch does nothing is told nothing: skip predicting its experts
        self.prefetch = prefetch and expert_source.prefetches
        self.prefetch_hint = prefetch_hint
        self.hints = HintLog()
        self.token_routes = TokenRoutes()
        self._token_sent: dict[int, list[int]] = {}  # per MoE layer: the step's token hint, sent
        # predict (and score) the kind not sent too: a benchmark's choice, since it costs a router product
        self.score_all_hints = False
        self.eps = config.rms_eps
        moe_layers = [layer for layer in layers if isinstance(layer.ffn, LatentMoE)]
        self._next_moe = {
            layer.index: next((m for m in moe_layers if m.index > layer.index), None) for layer in layers
        }
        self._moe_layers = moe_layers
        self.set_token_hint_lead(TOKEN_HINT_LEAD)
        # one-sequence decode steps run as a built program (`program.DecodeProgram`) where they can
        self.use_program = True
        self._program: DecodeProgram | None = None  # the last one built
        self.arithmetic = LoadOptions().arithmetic  # `LoadOptions.arithmetic` of the options it was built by

    def set_token_hint_lead(self, lead: int) -> None:
        """Send each MoE layer's token hint as the MoE layer `lead` before it starts (the first `lead`
        layers' at the step's start); `TOKEN_HINT_LEAD` by default."""
        moe_layers = self._moe_layers
        if not 1 <= lead <= max(len(moe_layers), 1):
            raise ValueError(f"token hint lead must be 1..{len(moe_layers)} MoE layers, got {lead}")
        self._first_token_hints = moe_layers[:lead]
        self._token_hint_from = {
            moe.index: moe_layers[i + lead] for i, moe in enumerate(moe_layers[: len(moe_layers) - lead])
        }

    def new_state(self) -> SequenceState:
        return SequenceState([layer.attn.new_state(self.device) for layer in self.layers])

    def fork_state(self, state: SequenceState) -> SequenceState:
        """An independent copy of `state`: a second continuation of the same prompt."""
        return copy.deepcopy(state)

    @torch.inference_mode()
    def prefill(self, state: SequenceState, tokens: Iterable[int]) -> torch.Tensor:
        """Run `tokens` of one sequence after what `state` holds; logits [T, vocab]."""
        return self.forward(state, self._ids(tokens))

    @torch.inference_mode()
    def prefill_last(self, state: SequenceState, tokens: Iterable[int]) -> torch.Tensor:
        """`prefill` with the logits of the last token alone [vocab]: what generation needs, and what
        llama.cpp computes by default (Kimi-K3's output matrix on every row of a 4,096-token prompt
        would be 4.8 T multiply-adds and 2.7 GB of logits)."""
        return self.forward(state, self._ids(tokens), last_only=True)[0]

    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """`prefill` of checked ids [T] outside inference mode: autograd records it when the weights
        require grad (the trainer's model, `k3stream.train`)."""
        logits = self._forward(
            ids, lambda layer, h, last: layer.attn.prefill(h, state.layers[layer.index], last), last_only
        )
        state.length += len(ids)
        return logits

    @torch.inference_mode()
    def prefill_batch(self, states: list[SequenceState], token_lists: list[list[int]]) -> torch.Tensor:
        """`prefill_last` of several sequences in one pass (in each MoE layer the experts any of them
        routes to are fetched once); the last token's logits of each [B, vocab]. Under
        `kernels.set_row_exact` each row equals that sequence's prefill alone, bit for bit."""
        if len(states) != len(token_lists):
            raise ValueError(f"prefill_batch: {len(states)} states but {len(token_lists)} token lists")
        lists = [self._token_list(tokens) for tokens in token_lists]
        bounds = [0]
        for tokens in lists:
            bounds.append(bounds[-1] + len(tokens))
        spans = list(zip(bounds, bounds[1:], strict=False))

        def attend(layer: Layer, h: torch.Tensor, last: bool) -> torch.Tensor:
            parts = [
                layer.attn.prefill(h[start:end], state.layers[layer.index], last)
                for (start, end), state in zip(spans, states, strict=True)
            ]
            return torch.cat(parts)

        ids = torch.tensor([token for tokens in lists for token in tokens], device=self.device)
        logits = self._forward(ids, attend, ends=[end - 1 for _, end in spans])
        for state, tokens in zip(states, lists, strict=True):
            state.length += len(tokens)
        return logits

    def decode(self, state: SequenceState, token: int) -> torch.Tensor:
        """One token of one sequence; logits [vocab]."""
        return self.decode_batch([state], [token])[0]

    @torch.inference_mode()
    def decode_batch(self, states: list[SequenceState], tokens: list[int]) -> torch.Tensor:
        """One token for each of several sequences (experts fetched once per layer); logits [B, vocab]."""
        check_batch(states, tokens)
        ids = self._token_list(tokens)
        program = self.program_for(states)
        if program is not None:
            logits = program.run(ids[0])
        else:
            logits = self._forward(
                torch.tensor(ids, device=self.device),
                lambda layer, h, _: layer.attn.decode(h, [state.layers[layer.index] for state in states]),
            )
        for state in states:
            state.length += 1
        return logits

    def program_for(self, states: list[SequenceState]) -> DecodeProgram | None:
        """The decode program of a one-sequence step (`program.DecodeProgram`, built again when the
        sequence, its state's tensors, the thread count or the model's layers change), or None where the
        step runs eagerly (several sequences, or a step with no C form)."""
        if len(states) != 1 or not self.use_program:
            return None
        threads = torch.get_num_threads()
        if self._program is None or not self._program.fits(self, states[0], threads):
            self._program = DecodeProgram(self, states[0], threads)
        return self._program if self._program.steps is not None else None

    def logits(self, tokens: Iterable[int]) -> torch.Tensor:
        """Full-sequence logits [T, vocab] from a fresh state."""
        return self.prefill(self.new_state(), tokens)

    def _ids(self, tokens: Iterable[int]) -> torch.Tensor:
        return torch.tensor(self._token_list(tokens), dtype=torch.long, device=self.device)

    def _token_list(self, tokens: Iterable[int]) -> list[int]:
        return token_ids(tokens, self.config.vocab_size)

    def _forward(
        self,
        ids: torch.Tensor,
        attend: Callable[[Layer, torch.Tensor, bool], torch.Tensor],
        last_only: bool = False,
        ends: list[int] | None = None,
    ) -> torch.Tensor:
        x = self.embedding(ids)
        bank: list[torch.Tensor] = []
        by_token = self._token_hints_used()
        token_ids = ids.tolist() if by_token else []
        # with last_only, the last layer's attention takes every row into the state and gives the last
        # row's output alone, the rest of the layer runs on that row (llama.cpp's output rows do the
        # same from after the attention)
        # `ends`: the last row of each sequence of a batched prefill, read past the last attention as
        # last_only's one row is
        kept = ends if ends is not None else [len(ids) - 1] if last_only else None
        last = self.layers[-1].index if kept is not None else None

        def read(index: int, rows: Rows) -> Rows:  # the rows of layer `index` read past its attention
            return _rows_at(rows, kept) if index == last else rows

        step_rows = len(ids)  # the hints' kinds follow the step's rows, the last layer's kept rows or not
        for first in self._first_token_hints if by_token else ():
            self._predict_from_tokens(first, read(first.index, token_ids), step_rows)
        for layer in self.layers:
            if self.prefetch and isinstance(layer.ffn, LatentMoE):
                if by_token and layer.index in self._token_hint_from:
                    ahead = self._token_hint_from[layer.index]
                    self._predict_from_tokens(ahead, read(ahead.index, token_ids), step_rows)
                self._predict("pre-attention", layer, read(layer.index, x), step_rows)
            h = residual_mix(bank, x, layer.attn_score, self.eps)
            banked = layer.index % self.config.block_size == 0
            if banked:
                bank.append(x)
            attended = attend(layer, rms_norm(h, layer.input_norm, self.eps), layer.index == last).float()
            if layer.index == last:
                x, token_ids, bank = read(last, x), read(last, token_ids), [read(last, row) for row in bank]
            prefix = attended if banked else x + attended
            following = self._next_moe[layer.index]
            if self.prefetch and following is not None:
                self._predict("layer-ahead", following, read(following.index, prefix), step_rows)
            h = rms_norm(
                residual_mix(bank, prefix, layer.ffn_score, self.eps), layer.post_attention_norm, self.eps
            )
            x = prefix + layer.ffn(h).float()
            if self.prefetch and isinstance(layer.ffn, LatentMoE):
                self.hints.used(layer.index, layer.ffn.chosen.unique().tolist())
                if by_token:
                    self.token_routes.learn(layer.index, token_ids, layer.ffn.chosen.cpu().numpy())
        x = rms_norm(residual_mix(bank, x, self.output_score, self.eps), self.norm, self.eps)
        return self.lm_head(x).float()

    def _token_hints_used(self) -> bool:
        """Whether token hints may be predicted this step (only then is the routing learned per token)."""
        return self.prefetch and (self.score_all_hints or self.prefetch_hint in ("auto", "token"))

    def _predict(self, kind: str, layer: Layer, stream: torch.Tensor, step_rows: int) -> None:
        """The experts `layer`'s router picks on `stream` (normed as its MoE input is), when `kind` is
        sent to the expert source in a step of `step_rows` rows (or `score_all_hints`): logged, and sent
        if it is (after a token hint, what that left out: `_gap`). A prefill's last layer keeps one row
        past its attention but is still a prefill's layer: its hints are the prefill's."""
        kinds = sent_kinds(self.prefetch_hint, step_rows)
        room, first = self._gap(kind, kinds, layer, stream.shape[0])
        if room and not self.score_all_hints and not self.hints.gap_due(layer.index):
            return  # an untrusted gap hint, between its probes
        sent = kind in kinds and room != 0
        if sent or self.score_all_hints:
            ranked = layer.ffn.ranked(rms_norm(stream, layer.post_attention_norm, self.eps))
            predicted = by_votes(ranked)
            send = predicted if sent else None
            if sent and room is not None:  # the gap: each row's likeliest, those the token hint lacks
                confident = by_votes(ranked[:, : math.ceil(GAP_HINT_RANKS * ranked.shape[1])])
                send = [expert for expert in confident if expert not in first][:room]
                trusted = self.hints.trusted(layer.index)
                self.hints.gap(layer.index, send)
                send = send if trusted else []
            self._hint(kind, layer, predicted, send)

    def _gap(self, kind: str, kinds: tuple[str, ...], layer: Layer, rows: int) -> tuple[int | None, set[int]]:
        """How many experts `kind` may send after the step's token hint for `layer`, and that hint's
        experts: the layer's picks for `rows` rows (top-k a row) less the token hint's experts (None:
        `kind` does not follow a token hint)."""
        if kinds[0] != "token" or kind == "token" or kind not in kinds:
            return None, set()
        first = set(self._token_sent.pop(layer.index, ()))
        return max(0, layer.ffn.routing.top_k * rows - len(first)), first

    def _predict_from_tokens(self, layer: Layer, token_ids: list[int], step_rows: int) -> None:
        """The token hint for `layer` (as `_predict`)."""
        sent = "token" in sent_kinds(self.prefetch_hint, step_rows)
        if sent or self.score_all_hints:
            predicted = self.token_routes.predict(layer.index, token_ids)
            if sent:
                self._token_sent[layer.index] = predicted
            self._hint("token", layer, predicted, predicted if sent else None)

    def _hint(self, kind: str, layer: Layer, predicted: list[int], send: list[int] | None) -> None:
        """Log a prediction and send `send` of it (None: `kind` is not sent; a token id never seen at
        the layer predicts nothing: nothing is sent, and that counts in what the hints sent)."""
        self.hints.predicted(kind, layer.index, predicted)
        if send is not None:
            self.hints.sent(layer.index, send)
        if send:
            self.expert_source.prefetch(layer.index, send)


def _rows_at(rows: Rows, kept: list[int]) -> Rows:
    """Rows `kept` of a tensor's rows or of a list (a tensor's last row alone stays a view)."""
    if isinstance(rows, list):  # token ids: none where token hints are not predicted
        return [rows[i] for i in kept] if rows else rows
    return rows[-1:] if kept == [len(rows) - 1] else rows[kept]


class _Weights:
    """The non-expert tensors by GGUF name (`gguf.layout`'s table), on the model's device."""

    def __init__(
        self, tensors: Mapping[str, GGUFTensor], options: LoadOptions, device: torch.device, source: str
    ) -> None:
        self.tensors = {name: replace(t, value=t.value.to(device)) for name, t in tensors.items()}
        self.options = options
        self.source = source  # the file, named in a refused tensor's message
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        self.used.add(name)
        return self.tensors[name]

    def linear(self, name: str, out_features: int, in_features: int) -> Linear:
        return self.tensor(name).linear(out_features, in_features, self.options)

    def vector(self, name: str) -> torch.Tensor:
        return self.tensor(name).matrix((-1,), torch.float32)

    def score(self, name: str) -> torch.Tensor:
        """An attention-residual score: the fused norm * proj vector the GGUF stores."""
        check_residual_score(tuple(self.tensors[name].value.shape))
        return self.vector(name)

    def decay(self, name: str) -> torch.Tensor:
        """KDA's `ssm_a` as stored (-exp(A_log)), checked as sglang's loader checks it (its message,
        after the file and the tensor)."""
        try:
            check_ssm_a(self.tensors[name].value)
        except ValueError as exc:
            raise ValueError(f"{self.source}: tensor {name}: {exc}") from None
        return self.vector(name)

    def check_all_used(self) -> None:
        """Nothing in the checkpoint is silently ignored: a tensor the model did not take is an error."""
        unused = [name for name in self.tensors if name not in self.used]
        if unused:
            raise ValueError(f"{unused[0]}: a Kimi-K3 tensor the model does not use ({len(unused)} in all)")


def _kda(w: _Weights, p: str, cfg: K3Config, tp: tuple[int, int]) -> KDA:
    heads, dim, e = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden
    inner = heads * dim
    convs = [
        w.tensor(f"{p}ssm_conv1d_{x}.weight").matrix((inner, cfg.conv_kernel), torch.float32) for x in "qkv"
    ]
    weights = KDAWeights(
        q_proj=w.linear(f"{p}attn_q.weight", inner, e),
        k_proj=w.linear(f"{p}attn_k.weight", inner, e),
        v_proj=w.linear(f"{p}attn_v.weight", inner, e),
        g_proj=w.linear(f"{p}ssm_g.weight", inner, e),
        b_proj=w.linear(f"{p}ssm_beta.weight", heads, e),
        f_a_proj=w.linear(f"{p}ssm_f_a.weight", dim, e),
        f_b_proj=w.linear(f"{p}ssm_f_b.weight", inner, dim),
        o_proj=w.linear(f"{p}attn_output.weight", e, inner),
        conv=torch.cat(convs),
        ssm_a=w.decay(f"{p}ssm_a"),
        dt_bias=w.vector(f"{p}ssm_dt.bias"),
        o_norm=w.vector(f"{p}ssm_norm.weight"),
    )
    tp_rank, tp_size = tp
    if tp != (0, 1):
        weights = shard_kda_weights(weights, heads, tp_rank, tp_size, p.rstrip("."))
    return KDA(weights, heads // tp_size, dim, cfg.gate_lower_bound, cfg.rms_eps)


def _mla(w: _Weights, p: str, cfg: K3Config) -> MLA:
    heads, e, q_width = cfg.mla_heads, cfg.hidden, cfg.mla_heads * (cfg.qk_nope + cfg.qk_rope)
    if w.has(f"{p}attn_kv_b.weight"):  # llama.cpp accepts it; the absorbed attention needs the halves
        raise ValueError(
            f"{p}attn_kv_b.weight: an unsplit MLA kv_b is not supported; convert the model with a llama.cpp "
            "that writes attn_k_b and attn_v_b"
        )
    q_lora = w.has(f"{p}attn_q_a.weight")
    weights = MLAWeights(
        q_a_proj=w.linear(f"{p}attn_q_a.weight", cfg.q_lora, e) if q_lora else None,
        q_a_norm=w.vector(f"{p}attn_q_a_norm.weight") if q_lora else None,
        q_b_proj=w.linear(f"{p}attn_q_b.weight", q_width, cfg.q_lora)
        if q_lora
        else w.linear(f"{p}attn_q.weight", q_width, e),
        kv_a_proj=w.linear(f"{p}attn_kv_a_mqa.weight", cfg.kv_lora + cfg.qk_rope, e),
        kv_a_norm=w.vector(f"{p}attn_kv_a_norm.weight"),
        k_b=HeadProjection(w.tensor(f"{p}attn_k_b.weight"), heads, cfg.kv_lora, cfg.qk_nope, w.options),
        v_b=HeadProjection(w.tensor(f"{p}attn_v_b.weight"), heads, cfg.v_head_dim, cfg.kv_lora, w.options),
        g_proj=w.linear(f"{p}attn_gate.weight", heads * cfg.v_head_dim, e)
        if w.has(f"{p}attn_gate.weight")
        else None,
        o_proj=w.linear(f"{p}attn_output.weight", e, heads * cfg.v_head_dim),
    )
    return MLA(weights, heads, cfg.qk_nope, cfg.qk_rope, cfg.kv_lora, cfg.rms_eps, w.options.ggml_arithmetic)


def _situ_mlp(w: _Weights, p: str, suffix: str, cfg: K3Config, width: int) -> SituMLP:
    """The SiTU MLP of `{p}ffn_gate{suffix}.weight` and its up/down (dense: suffix "", shared: "_shexp")."""
    return SituMLP(
        w.linear(f"{p}ffn_gate{suffix}.weight", width, cfg.hidden),
        w.linear(f"{p}ffn_up{suffix}.weight", width, cfg.hidden),
        w.linear(f"{p}ffn_down{suffix}.weight", cfg.hidden, width),
        cfg.situ_beta,
        cfg.situ_linear_beta,
    )


def _moe(w: _Weights, p: str, layer: int, cfg: K3Config, source: ExpertSource) -> LatentMoE:
    shared_width = cfg.expert_ff * cfg.n_shared
    weights = MoEWeights(
        router=w.tensor(f"{p}ffn_gate_inp.weight").linear(
            cfg.n_experts, cfg.hidden, replace(w.options, dtype="float32")
        ),
        correction_bias=w.vector(f"{p}exp_probs_b.bias"),
        routed_down=w.linear(f"{p}ffn_routed_down.weight", cfg.latent, cfg.hidden),
        routed_up=w.linear(f"{p}ffn_routed_up.weight", cfg.hidden, cfg.latent),
        routed_norm=w.vector(f"{p}ffn_routed_norm.weight") if w.has(f"{p}ffn_routed_norm.weight") else None,
        shared=_situ_mlp(w, p, "_shexp", cfg, shared_width) if w.has(f"{p}ffn_gate_shexp.weight") else None,
    )
    routing = Routing(cfg.top_k, cfg.weights_norm, cfg.weights_scale)
    return LatentMoE(
        layer,
        weights,
        source,
        routing,
        cfg.situ_beta,
        cfg.situ_linear_beta,
        cfg.rms_eps,
        w.options.ggml_arithmetic,
        w.options.kernels,
    )


def _layer(
    w: _Weights,
    i: int,
    cfg: K3Config,
    source: ExpertSource,
    tp: tuple[int, int],
) -> Layer:
    p = f"blk.{i}."
    attn = _mla(w, p, cfg) if cfg.is_mla(i) else _kda(w, p, cfg, tp)
    ffn = _moe(w, p, i, cfg, source) if cfg.is_moe(i) else _situ_mlp(w, p, "", cfg, cfg.dense_ff)
    return Layer(
        index=i,
        attn=attn,
        ffn=ffn,
        input_norm=w.vector(f"{p}attn_norm.weight"),
        post_attention_norm=w.vector(f"{p}ffn_norm.weight"),
        attn_score=w.score(f"{p}attn_res_score.weight"),
        ffn_score=w.score(f"{p}ffn_res_score.weight"),
    )


def check_batch(states: list[SequenceState], tokens: list[int]) -> None:
    """A decode step's states and tokens: one token per state, each state once (a sequence takes one
    token a step; a state given twice would take both tokens' updates at one position)."""
    if len(states) != len(tokens):
        raise ValueError(f"decode_batch: {len(states)} states but {len(tokens)} tokens")
    if len({id(state) for state in states}) != len(states):
        raise ValueError("decode_batch: a state is given more than once (a sequence takes one token a step)")


def token_ids(tokens: Iterable[int], vocab: int) -> list[int]:
    """The ids as Python ints, checked: a non-empty flat sequence of integers (ints, numpy or torch
    integers), each in 0..vocab-1; floats, bools and text are refused, never truncated. Checked in
    Python where they are ints already: a decode token then costs no torch operation here."""
    ids = list(tokens)
    if not all(type(token) is int for token in ids):
        try:
            as_tensor = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            as_tensor = torch.empty(0)
        integral = not (
            as_tensor.is_floating_point() or as_tensor.is_complex() or as_tensor.dtype == torch.bool
        )
        if as_tensor.ndim != 1 or not integral:
            raise ValueError(f"expected a non-empty list of integer token ids, got {ids[:4]!r}")
        ids = as_tensor.tolist()
    if not ids:
        raise ValueError("expected a non-empty list of token ids")
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"token id outside 0..{vocab - 1}")
    return ids


def load(checkpoint: K3Checkpoint, options: LoadOptions | None = None) -> K3Model:
    """Build a K3Model from an open checkpoint as `options` say (`LoadOptions`; `k3stream.load` opens a
    path or a manifest and defaults the expert budget to what the memory plan leaves).

    Non-expert weights are read once into anonymous memory in their GGUF types (never through the map,
    so a file that changes later cannot reach the running model). The checkpoint profile is checked
    after loading. `tp_size` > 1 shards only the KDA heads and the forward does no all-reduce (see
    `shard_kda_weights`).
    """
    from k3stream.gguf.profile import get_profile

    options = options or LoadOptions()
    source = options.expert_source
    if source is None:
        routed = sum(t.nbytes for t in checkpoint.tensors.values() if is_routed_expert(t.name))
        budget = int((options.expert_ram_mib or 0.0) * (1 << 20))
        source = GGUFExpertSource(checkpoint, keep=routed <= budget, budget_bytes=budget)
    if options.kernels == "auto":
        matrix_types = {t.ggml_type for t in checkpoint.tensors.values() if len(t.shape) >= 2}
        note_fallbacks(matrix_types, torch.device(options.device))
        warm_up(matrix_types, torch.device(options.device))
    model = build(checkpoint.config, checkpoint_tensors(checkpoint), source, options)
    get_profile(options.profile).check(checkpoint)  # sglang's MLA recipe check, after loading
    tensors = checkpoint.tensors.values()
    model.file_weights = (sum(math.prod(t.shape) for t in tensors), sum(t.nbytes for t in tensors))
    return model


def checkpoint_tensors(checkpoint: K3Checkpoint) -> dict[str, GGUFTensor]:
    """A checkpoint's non-expert tensors by GGUF name, read into memory in their GGUF types (float
    values with type None, else bytes with their type id): what `build` takes."""
    return {
        name: GGUFTensor(value, None if ggml_type in FLOAT_TYPE_IDS else ggml_type, name)
        for name, value, ggml_type in nonexpert_tensors(checkpoint)
    }


def build(
    cfg: K3Config,
    tensors: Mapping[str, GGUFTensor],
    source: ExpertSource,
    options: LoadOptions,
) -> K3Model:
    """A K3Model from its non-expert tensors by GGUF name (`gguf.layout.expected_shapes`' names).

    On the reference path float tensors are used as given, so weights that require grad give a model
    autograd can train (`k3stream.train` builds its model this way)."""
    device = torch.device(options.device)
    w = _Weights(tensors, options, device, cfg.source)
    model = K3Model(
        config=cfg,
        embedding=Embedding(w.tensor("token_embd.weight"), cfg.hidden, options),
        layers=[_layer(w, i, cfg, source, (options.tp_rank, options.tp_size)) for i in range(cfg.n_layers)],
        norm=w.vector("output_norm.weight"),
        output_score=w.score("output_res_score.weight"),
        lm_head=w.linear("output.weight", cfg.vocab_size, cfg.hidden),
        expert_source=source,
        device=device,
        prefetch=options.prefetch,
        prefetch_hint=options.prefetch_hint,
    )
    w.check_all_used()
    model.use_program = options.kernels == "auto"  # the reference path stays the eager forward
    model.arithmetic = options.arithmetic
    return model
