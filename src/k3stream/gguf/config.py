"""Kimi-K3 hyperparameters read from GGUF metadata (`kimi-k3.*` keys)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k3stream.gguf.header import ARRAY, STRING

ARCH = "kimi-k3"
TOKENS_KEY = "tokenizer.ggml.tokens"


def field_value(field: Any, source: str) -> Any:
    """A metadata value as plain Python: a `gguf.ReaderField` is decoded, anything else kept. A string
    that is not UTF-8 is refused in one line naming `source` (the file) and the key."""
    contents = getattr(field, "contents", None)
    if not callable(contents):
        return field
    try:
        return contents()
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{source}: metadata key {field.name} holds a string that is not UTF-8 "
            f"(byte 0x{exc.object[exc.start]:02x} at {exc.start}: {exc.reason})"
        ) from None


class _Keys:
    """Typed access to `kimi-k3.<key>` with one-line errors naming the file and the key."""

    def __init__(self, fields: Mapping[str, Any], source: str):
        self.fields = fields
        self.source = source

    def _raw(self, key: str, required: bool) -> Any:
        full = f"{ARCH}.{key}"
        if full not in self.fields:
            if required:
                raise ValueError(f"{self.source}: missing metadata key {full}")
            return None
        return field_value(self.fields[full], self.source)

    def bad(self, key: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{self.source}: metadata key {ARCH}.{key} must be {expected}, got {value!r}")

    def integer(self, key: str, required: bool = True, minimum: int = 1) -> int | None:
        value = self._raw(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.bad(key, f"an integer >= {minimum}", value)
        return value

    def per_layer(self, key: str, n_layers: int, layers: range) -> int:
        """An integer >= 1, or llama.cpp's per-layer array of `n_layers`: the one value `layers` share
        (k3stream holds one; the other layers' entries are unused, as llama.cpp leaves them). Where no
        layer reads it (feed_forward_length when every layer is MoE) llama.cpp takes it optional: absent,
        0 or an array of zeros read as 0."""
        value = self._raw(key, bool(layers))
        if not layers and value in (None, 0, [0] * n_layers):
            return 0
        if not isinstance(value, list):
            return self.integer(key)
        expected = f"an integer >= 1 or an array of {n_layers} integers"
        if len(value) != n_layers or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self.bad(key, expected, value)
        layers = layers or range(n_layers)  # no layer reads it: the entries must still agree
        used = {value[i] for i in layers}
        if len(used) != 1 or min(used) < 1:
            raise self.bad(key, f"one value >= 1 for layers {layers.start}..{layers.stop - 1}", value)
        return used.pop()

    def number(
        self, key: str, required: bool = True, low: float = -math.inf, high: float = math.inf
    ) -> float | None:
        """A finite number in `low..high`: a NaN or infinite hyperparameter would make every logit NaN
        (or quietly change the model) with nothing naming the key."""
        value = self._raw(key, required)
        if value is None:
            return None
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not math.isfinite(value) or not low <= value <= high:
            bounds = [
                f"{sign} {bound}" for sign, bound in ((">=", low), ("<=", high)) if math.isfinite(bound)
            ]
            raise self.bad(key, " and ".join(["a finite number", *bounds]), value)
        return float(value)

    def flag(self, key: str, default: bool | None = None) -> bool:
        """A bool; `default` (when given) stands in for an absent key."""
        value = self._raw(key, default is None)
        if value is None:
            return bool(default)
        if not isinstance(value, bool):
            raise self.bad(key, "a bool", value)
        return value

    def vocab_size(self) -> int:
        """`vocab_size`, else the tokenizer's token count, as llama.cpp takes it. Where both are given
        they must agree: llama.cpp sizes the embedding by the tokens, and a sampled id past the tokens
        would have no text."""
        value = self.integer("vocab_size", required=False)
        count = self._token_count()
        if value is not None:
            if count and count != value:
                raise self.bad("vocab_size", f"{count}, the tokens in {TOKENS_KEY}", value)
            return value
        if not count:
            raise ValueError(f"{self.source}: missing metadata key {ARCH}.vocab_size (and no tokenizer)")
        return count

    def _token_count(self) -> int:
        """The tokens `tokenizer.ggml.tokens` holds, 0 where it is absent; any value but an array of
        strings is refused naming the key (a number array is one part of a ReaderField, not a count)."""
        tokens = self.fields.get(TOKENS_KEY)
        if tokens is None:
            return 0
        types = getattr(tokens, "types", None)
        if types is None:  # a plain {key: value} mapping
            strings = isinstance(tokens, list) and all(isinstance(token, str) for token in tokens)
        else:
            strings = list(types) == [ARRAY, STRING]
        if not strings:
            raise ValueError(f"{self.source}: metadata key {TOKENS_KEY} must be an array of strings")
        return len(getattr(tokens, "data", tokens))  # ReaderField: one index a token

    def layer_flags(self, key: str, n_layers: int) -> tuple[int, ...]:
        value = self._raw(key, True)
        if not isinstance(value, list) or len(value) != n_layers or any(v not in (0, 1) for v in value):
            raise self.bad(key, f"an array of {n_layers} values 0 (KDA) or 1 (MLA)", value)
        return tuple(int(v) for v in value)


@dataclass(frozen=True)
class K3Config:
    source: str
    n_layers: int
    hidden: int
    vocab_size: int
    context_length: int
    dense_ff: int
    n_heads: int
    head_count_kv: tuple[int, ...]  # per layer: 0 = KDA, 1 = MLA
    rms_eps: float
    q_lora: int | None
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    conv_kernel: int
    kda_head_dim: int
    gate_lower_bound: float | None
    n_experts: int
    top_k: int
    expert_ff: int
    n_shared: int
    n_dense: int
    latent: int
    weights_scale: float
    weights_norm: bool
    gating_func: int
    situ_beta: float
    situ_linear_beta: float
    block_size: int

    @classmethod
    def from_metadata(cls, fields: Mapping[str, Any], source: str) -> K3Config:
        """Build from GGUF metadata (`GGUFReader.fields` or a plain `{key: value}` mapping)."""
        keys = _Keys(fields, source)
        n_layers = keys.integer("block_count")
        n_dense = keys.integer("leading_dense_block_count", minimum=0)
        key_length_mla = keys.integer("attention.key_length_mla")
        qk_rope = keys.integer("rope.dimension_count", minimum=0)
        if key_length_mla <= qk_rope:
            raise keys.bad(
                "attention.key_length_mla", f"greater than rope.dimension_count ({qk_rope})", key_length_mla
            )
        config = cls(
            source=source,
            n_layers=n_layers,
            hidden=keys.integer("embedding_length"),
            vocab_size=keys.vocab_size(),
            context_length=keys.integer("context_length", minimum=2),  # a token and the one it predicts
            dense_ff=keys.per_layer("feed_forward_length", n_layers, range(min(n_dense, n_layers))),
            n_heads=keys.per_layer("attention.head_count", n_layers, range(n_layers)),
            head_count_kv=keys.layer_flags("attention.head_count_kv", n_layers),
            rms_eps=keys.number("attention.layer_norm_rms_epsilon", low=0.0),
            q_lora=keys.integer("attention.q_lora_rank", required=False),
            kv_lora=keys.integer("attention.kv_lora_rank"),
            qk_nope=key_length_mla - qk_rope,
            qk_rope=qk_rope,
            v_head_dim=keys.integer("attention.value_length_mla"),
            conv_kernel=keys.integer("ssm.conv_kernel"),
            kda_head_dim=keys.integer("kda.head_dim"),
            # the log-space decay's bound: above 0 a KDA state grows without bound
            gate_lower_bound=keys.number("kda.gate_lower_bound", required=False, high=0.0),
            n_experts=keys.integer("expert_count"),
            top_k=keys.integer("expert_used_count"),
            expert_ff=keys.integer("expert_feed_forward_length"),
            n_shared=keys.integer("expert_shared_count", minimum=0),
            n_dense=n_dense,
            latent=keys.integer("expert_latent_length"),
            # absent or 0: 1.0, and no renormalisation when absent, as llama.cpp reads them
            weights_scale=keys.number("expert_weights_scale", required=False) or 1.0,
            weights_norm=keys.flag("expert_weights_norm", default=False),
            gating_func=keys.integer("expert_gating_func"),
            situ_beta=keys.number("activation.situ_beta"),
            situ_linear_beta=keys.number("activation.situ_linear_beta", low=0.0),  # 0: no tanh on up
            block_size=keys.integer("attn_res.block_size"),
        )
        config._check_consistency(keys)
        return config

    def _check_consistency(self, keys: _Keys) -> None:
        derived = {
            "attention.key_length": self.kv_lora + self.qk_rope,
            "attention.value_length": self.kv_lora,
        }
        for key, expected in derived.items():  # llama.cpp reads no value_length
            value = keys.integer(key, required=key != "attention.value_length")
            if value not in (expected, None):
                raise keys.bad(key, f"{expected} (kv_lora_rank + rope, kv_lora_rank)", value)
        if self.top_k > self.n_experts:
            raise keys.bad("expert_used_count", f"<= expert_count ({self.n_experts})", self.top_k)
        if self.n_dense > self.n_layers:
            raise keys.bad("leading_dense_block_count", f"<= block_count ({self.n_layers})", self.n_dense)
        if self.situ_beta <= 0:  # situ divides the gate by it
            raise keys.bad("activation.situ_beta", "a number > 0", self.situ_beta)
        if self.gating_func != 2:
            raise keys.bad("expert_gating_func", "2 (sigmoid)", self.gating_func)

    @property
    def kda_heads(self) -> int:
        return self.n_heads

    @property
    def mla_heads(self) -> int:
        return self.n_heads

    @property
    def kda_inner(self) -> int:
        return self.n_heads * self.kda_head_dim

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kv in enumerate(self.head_count_kv) if kv)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kv in enumerate(self.head_count_kv) if not kv)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_dense))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_dense, self.n_layers))

    def is_mla(self, layer: int) -> bool:
        return bool(self.head_count_kv[layer])

    def is_moe(self, layer: int) -> bool:
        return self.n_dense <= layer < self.n_layers
