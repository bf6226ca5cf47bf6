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

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from k3stream.experts import ExpertSource
from k3stream.gguf.config import K3Config
from k3stream.model.attn_res import residual_mix
from k3stream.model.experts import GGUFExpertSource
from k3stream.model.hints import HINT_CHOICES, HintLog, sent_kind
from k3stream.model.kda import KDA, KDAState, KDAWeights, shard_kda_weights
from k3stream.model.layers import GGUFTensor, Linear, LoadOptions, bytes_to_matrix, rms_norm
from k3stream.model.mla import MLA, HeadProjection, MLAState, MLAWeights
from k3stream.model.moe import LatentMoE, MoEWeights, Routing, SituMLP
from k3stream.quant.kernels import note_fallbacks, warm_up

AttentionState = KDAState | MLAState


@dataclass
class Layer:
    index: int
    attn: KDA | MLA
    ffn: SituMLP | LatentMoE
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attn_score: torch.Tensor  # fused residual score: proj * norm
    ffn_score: torch.Tensor


@dataclass
class SequenceState:
    """Everything one sequence carries between calls: one attention state per layer."""

    layers: list[AttentionState]
    length: int = 0


class Embedding:
    """Rows of the token table: a dense table on the reference path, else decoded row by row."""

    def __init__(self, table: GGUFTensor, hidden: int, options: LoadOptions) -> None:
        self.table = table if options.in_gguf_types and table.ggml_type is not None else None
        self.dense = None if self.table else table.matrix((-1, hidden), options.dtype)
        self.hidden = hidden

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense[tokens].float()
        rows = self.table.value.reshape(-1, self.table.value.shape[-1])[tokens]
        return bytes_to_matrix(rows, self.table.ggml_type, (len(tokens), self.hidden))


class K3Model:
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
        # predict (and score) the kind not sent too: a benchmark's choice, since it costs a router product
        self.score_all_hints = False
        self.eps = config.rms_eps
        moe_layers = [layer for layer in layers if isinstance(layer.ffn, LatentMoE)]
        self._next_moe = {
            layer.index: next((m for m in moe_layers if m.index > layer.index), None) for layer in layers
        }

    def new_state(self) -> SequenceState:
        return SequenceState([layer.attn.new_state(self.device) for layer in self.layers])

    @torch.inference_mode()
    def prefill(self, state: SequenceState, tokens: Iterable[int]) -> torch.Tensor:
        """Run `tokens` of one sequence after what `state` holds; logits [T, vocab]."""
        return self.forward(state, self._ids(tokens))

    def forward(self, state: SequenceState, ids: torch.Tensor) -> torch.Tensor:
        """`prefill` of checked ids [T] outside inference mode: autograd records it when the weights
        require grad (the trainer's model, `k3stream.train`)."""
        logits = self._forward(ids, lambda layer, h: layer.attn.prefill(h, state.layers[layer.index]))
        state.length += len(ids)
        return logits

    def decode(self, state: SequenceState, token: int) -> torch.Tensor:
        """One token of one sequence; logits [vocab]."""
        return self.decode_batch([state], [token])[0]

    @torch.inference_mode()
    def decode_batch(self, states: list[SequenceState], tokens: list[int]) -> torch.Tensor:
        """One token for each of several sequences (experts fetched once per layer); logits [B, vocab]."""
        if len(states) != len(tokens):
            raise ValueError(f"decode_batch: {len(states)} states but {len(tokens)} tokens")
        ids = self._ids(tokens)
        logits = self._forward(
            ids, lambda layer, h: layer.attn.decode(h, [state.layers[layer.index] for state in states])
        )
        for state in states:
            state.length += 1
        return logits

    def logits(self, tokens: Iterable[int]) -> torch.Tensor:
        """Full-sequence logits [T, vocab] from a fresh state."""
        return self.prefill(self.new_state(), tokens)

    def _ids(self, tokens: Iterable[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError("expected a non-empty list of token ids")
        vocab = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token id outside 0..{vocab - 1}")
        return ids

    def _forward(
        self, ids: torch.Tensor, attend: Callable[[Layer, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        x = self.embedding(ids)
        bank: list[torch.Tensor] = []
        for layer in self.layers:
            if self.prefetch and isinstance(layer.ffn, LatentMoE):
                self._predict("pre-attention", layer, x)
            h = residual_mix(bank, x, layer.attn_score, self.eps)
            banked = layer.index % self.config.block_size == 0
            if banked:
                bank.append(x)
            attended = attend(layer, rms_norm(h, layer.input_norm, self.eps)).float()
            prefix = attended if banked else x + attended
            following = self._next_moe[layer.index]
            if self.prefetch and following is not None:
                self._predict("layer-ahead", following, prefix)
            h = rms_norm(
                residual_mix(bank, prefix, layer.ffn_score, self.eps), layer.post_attention_norm, self.eps
            )
            x = prefix + layer.ffn(h).float()
            if self.prefetch and isinstance(layer.ffn, LatentMoE):
                self.hints.used(layer.index, layer.ffn.chosen.unique().tolist())
        x = rms_norm(residual_mix(bank, x, self.output_score, self.eps), self.norm, self.eps)
        return self.lm_head(x).float()

    def _predict(self, kind: str, layer: Layer, stream: torch.Tensor) -> None:
        """The experts `layer`'s router picks on `stream` (normed as its MoE input is), when `kind` is
        the hint sent to the expert source (or `score_all_hints`): logged, and sent if it is."""
        sent = kind == sent_kind(self.prefetch_hint, stream.shape[0])
        if not (sent or self.score_all_hints):
            return
        predicted = layer.ffn.predict(rms_norm(stream, layer.post_attention_norm, self.eps))
        self.hints.predicted(kind, layer.index, predicted)
        if sent:
            self.expert_source.prefetch(layer.index, predicted)


class _Weights:
    """The loader's `(runtime_name, tensor)` pairs, looked up by name."""

    def __init__(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        options: LoadOptions,
        device: torch.device,
    ) -> None:
        self.values: dict[str, torch.Tensor] = {name: value.to(device) for name, value in pairs}
        self.options = options

    def has(self, name: str) -> bool:
        return f"{name}.weight" in self.values or f"{name}.qweight" in self.values

    def tensor(self, name: str) -> GGUFTensor:
        """`name` as stored: a float tensor, or bytes with their type at `name + '_type'`."""
        value = self.values[name]
        type_id = self.values.get(f"{name}_type")
        return GGUFTensor(value, None if type_id is None else int(type_id), name)

    def weight(self, name: str) -> GGUFTensor:
        return self.tensor(f"{name}.weight" if f"{name}.weight" in self.values else f"{name}.qweight")

    def linear(self, name: str, out_features: int, in_features: int) -> Linear:
        return self.weight(name).linear(out_features, in_features, self.options)

    def vector(self, name: str) -> torch.Tensor:
        return self.weight(name).matrix((-1,), torch.float32)

    def score(self, prefix: str) -> torch.Tensor:
        """A residual score as the runtime holds it (proj [1, E], norm [E]) fused back to one vector."""
        proj, norm = (self.vector(f"{prefix}_{part}") for part in ("proj", "norm"))
        return proj * norm


def _kda(w: _Weights, p: str, cfg: K3Config, tp: tuple[int, int]) -> KDA:
    heads, dim, e = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden
    inner = heads * dim
    convs = [w.weight(f"{p}{x}_conv1d").matrix((inner, cfg.conv_kernel), torch.float32) for x in "qkv"]
    weights = KDAWeights(
        q_proj=w.linear(f"{p}q_proj", inner, e),
        k_proj=w.linear(f"{p}k_proj", inner, e),
        v_proj=w.linear(f"{p}v_proj", inner, e),
        g_proj=w.linear(f"{p}g_proj", inner, e),
        b_proj=w.linear(f"{p}b_proj", heads, e),
        f_a_proj=w.linear(f"{p}f_a_proj", dim, e),
        f_b_proj=w.linear(f"{p}f_b_proj", inner, dim),
        o_proj=w.linear(f"{p}o_proj", e, inner),
        conv=torch.cat(convs),
        A_log=w.tensor(f"{p}A_log").matrix((-1,), torch.float32),
        dt_bias=w.tensor(f"{p}dt_bias").matrix((-1,), torch.float32),
        o_norm=w.vector(f"{p}o_norm"),
    )
    tp_rank, tp_size = tp
    if tp != (0, 1):
        weights = shard_kda_weights(weights, heads, tp_rank, tp_size, p.rstrip("."))
    return KDA(weights, heads // tp_size, dim, cfg.gate_lower_bound, cfg.rms_eps)


def _mla(w: _Weights, p: str, cfg: K3Config) -> MLA:
    heads, e, q_width = cfg.mla_heads, cfg.hidden, cfg.mla_heads * (cfg.qk_nope + cfg.qk_rope)
    q_lora = w.has(f"{p}q_a_proj")
    weights = MLAWeights(
        q_a_proj=w.linear(f"{p}q_a_proj", cfg.q_lora, e) if q_lora else None,
        q_a_norm=w.vector(f"{p}q_a_layernorm") if q_lora else None,
        q_b_proj=w.linear(f"{p}q_b_proj", q_width, cfg.q_lora)
        if q_lora
        else w.linear(f"{p}q_proj", q_width, e),
        kv_a_proj=w.linear(f"{p}kv_a_proj_with_mqa", cfg.kv_lora + cfg.qk_rope, e),
        kv_a_norm=w.vector(f"{p}kv_a_layernorm"),
        k_b=HeadProjection(w.tensor(f"{p}k_b_qweight"), heads, cfg.kv_lora, cfg.qk_nope, w.options),
        v_b=HeadProjection(w.tensor(f"{p}v_b_qweight"), heads, cfg.v_head_dim, cfg.kv_lora, w.options),
        g_proj=w.linear(f"{p}g_proj", heads * cfg.v_head_dim, e),
        o_proj=w.linear(f"{p}o_proj", e, heads * cfg.v_head_dim),
    )
    return MLA(weights, heads, cfg.qk_nope, cfg.qk_rope, cfg.kv_lora, cfg.rms_eps)


def _situ_mlp(w: _Weights, p: str, cfg: K3Config, width: int) -> SituMLP:
    return SituMLP(
        w.linear(f"{p}gate_proj", width, cfg.hidden),
        w.linear(f"{p}up_proj", width, cfg.hidden),
        w.linear(f"{p}down_proj", cfg.hidden, width),
        cfg.situ_beta,
        cfg.situ_linear_beta,
    )


def _moe(w: _Weights, p: str, layer: int, cfg: K3Config, source: ExpertSource) -> LatentMoE:
    shared_width = cfg.expert_ff * cfg.n_shared
    weights = MoEWeights(
        router=w.weight(f"{p}gate").linear(
            cfg.n_experts, cfg.hidden, replace(w.options, dtype=torch.float32)
        ),
        correction_bias=w.tensor(f"{p}gate.e_score_correction_bias").matrix((-1,), torch.float32),
        routed_down=w.linear(f"{p}routed_expert_down_proj", cfg.latent, cfg.hidden),
        routed_up=w.linear(f"{p}routed_expert_up_proj", cfg.hidden, cfg.latent),
        routed_norm=w.vector(f"{p}routed_expert_norm") if w.has(f"{p}routed_expert_norm") else None,
        shared=_situ_mlp(w, f"{p}shared_experts.", cfg, shared_width)
        if w.has(f"{p}shared_experts.gate_proj")
        else None,
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
        w.options.match_ggml,
        w.options.kernels,
    )


def _layer(
    w: _Weights,
    i: int,
    cfg: K3Config,
    source: ExpertSource,
    tp: tuple[int, int],
) -> Layer:
    p = f"model.layers.{i}."
    attn = _mla(w, f"{p}self_attn.", cfg) if cfg.is_mla(i) else _kda(w, f"{p}self_attn.", cfg, tp)
    ffn = (
        _moe(w, f"{p}mlp.", i, cfg, source) if cfg.is_moe(i) else _situ_mlp(w, f"{p}mlp.", cfg, cfg.dense_ff)
    )
    return Layer(
        index=i,
        attn=attn,
        ffn=ffn,
        input_norm=w.vector(f"{p}input_layernorm"),
        post_attention_norm=w.vector(f"{p}post_attention_layernorm"),
        attn_score=w.score(f"{p}self_attention_res"),
        ffn_score=w.score(f"{p}mlp_res"),
    )


def load(
    path_or_manifest: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    expert_source: ExpertSource | None = None,
    keep_quantized: bool = False,
    profile: str = "generic",
    prefetch: bool = True,
    match_ggml: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    kernels: str = "auto",
    prefetch_hint: str = "auto",
) -> K3Model:
    """Build a K3Model from a GGUF (a file, any shard, a directory) or an expert-pack manifest.

    Non-expert weights are read once into anonymous memory in their GGUF types (never through the map,
    so a file that changes later cannot reach the running model). With `kernels="auto"` (default) every
    product runs on GGUF blocks through `k3stream.quant.kernels`; `kernels="reference"` is the path the
    kernels are tested against: weights dequantized to `dtype` at load, or with `keep_quantized` kept
    in blocks and dequantized a slab at a time; a `dtype` other than float32 implies it. Routed
    experts come from `expert_source` (default: straight from the GGUF). `profile="audited"`
    enforces the published recipe after loading.
    `match_ggml` rounds the inputs of F16/BF16 and block-quantized matrices as llama.cpp's CPU matmul
    does (to F16/BF16, or 8-bit Q8_K/Q8_0 blocks): for comparing with llama.cpp; it costs precision.
    `tp_rank`/`tp_size` load tensor-parallel rank `tp_rank` of `tp_size`: each KDA layer holds only
    that rank's heads (see `shard_kda_weights`), so its output is a partial sum to all-reduce over the
    ranks; nothing else is sharded and the forward does no all-reduce (`k3stream.parallel` shards the
    whole model over a process group and reduces).
    `prefetch_hint` picks the prediction sent to the expert source (`k3stream.model.hints`).
    """
    from k3stream.gguf.profile import get_profile
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.gguf.weights import checkpoint_path, checkpoint_weights

    checkpoint = K3Checkpoint.open(checkpoint_path(path_or_manifest))
    cfg = checkpoint.config
    source = expert_source if expert_source is not None else GGUFExpertSource(checkpoint)
    device = torch.device(device)
    if dtype != torch.float32:
        kernels = "reference"  # re-typed weights are dense matrices
    options = LoadOptions(dtype, keep_quantized, match_ggml, kernels)
    if kernels == "auto":
        matrix_types = {t.ggml_type for t in checkpoint.tensors.values() if len(t.shape) >= 2}
        note_fallbacks(matrix_types, device)
        warm_up(matrix_types, device)
    pairs = checkpoint_weights(checkpoint)
    model = build(cfg, pairs, source, options, device, prefetch, (tp_rank, tp_size), prefetch_hint)
    get_profile(profile).check(checkpoint)  # seed 002: the audited MLA recipe, checked after loading
    return model


def build(
    cfg: K3Config,
    pairs: Iterable[tuple[str, torch.Tensor]],
    source: ExpertSource,
    options: LoadOptions,
    device: torch.device,
    prefetch: bool = True,
    tp: tuple[int, int] = (0, 1),
    prefetch_hint: str = "auto",
) -> K3Model:
    """A K3Model from the loader's `(runtime_name, tensor)` pairs (`gguf.weights.tensor_weights`).

    On the reference path float tensors are used as given, so weights that require grad give a model
    autograd can train (`k3stream.train` builds its model this way)."""
    w = _Weights(pairs, options, device)
    return K3Model(
        config=cfg,
        embedding=Embedding(w.weight("model.embed_tokens"), cfg.hidden, options),
        layers=[_layer(w, i, cfg, source, tp) for i in range(cfg.n_layers)],
        norm=w.vector("model.norm"),
        output_score=w.score("model.output_attn_res"),
        lm_head=w.linear("lm_head", cfg.vocab_size, cfg.hidden),
        expert_source=source,
        device=device,
        prefetch=prefetch,
        prefetch_hint=prefetch_hint,
    )
