"""Training on the inference model: parameters by GGUF tensor name, the model built from them each step.

Each step builds a `K3Model` (`model.k3.build`) from every tensor by GGUF name, as the GGUF stores it,
on the reference path, where weights are float tensors used as given;
routed experts come from `ParameterExperts`, an `ExpertSource` whose matrices are F32 views of the
expert parameters, which the kernel seam multiplies with torch's matmul. Autograd follows the same
KDA, MLA, residual and MoE code that serves the GGUF later. The router's correction bias gets no
gradient: after each step it moves by `bias_rate * sign(mean load - load)` (no auxiliary loss).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from k3stream.experts import ROLES, ExpertSource, ExpertWeights
from k3stream.gguf.layout import FLOAT_TYPE_IDS, is_routed_expert, routed_expert_name
from k3stream.gguf.writer import TinySpec, initial_values, tensor_plan, tiny_config
from k3stream.model.k3 import K3Model, build
from k3stream.model.kda import KDA
from k3stream.model.layers import GGUFTensor
from k3stream.model.moe import LatentMoE, Routing
from k3stream.model.options import LoadOptions
from k3stream.quant.kernels import QWeight

F32 = FLOAT_TYPE_IDS[0]
A_LOG_SUFFIX = ".ssm_a"  # stored as -exp(A_log); trained as A_log
BIAS_SUFFIX = ".exp_probs_b.bias"  # the router's correction bias: moved by load, not by gradient
# KDA prefill chunk while training: fewer, larger chunks than inference's 16 (same closed form; the
# per-chunk operations, not the arithmetic, bound a training step on the CPU)
KDA_CHUNK = 64


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 1000
    minutes: float = 18.0
    seq_len: int = 512
    batch: int = 2  # sequences per step
    lr: float = 6e-3
    warmup: int = 10
    weight_decay: float = 0.01
    bias_rate: float = 1e-3
    seed: int = 0


class Parameters:
    """Every tensor of a tiny Kimi-K3 by GGUF name, in its numpy shape, initialised as `make_tiny`'s."""

    def __init__(self, spec: TinySpec, vocab_size: int) -> None:
        self.config = tiny_config(spec, vocab_size)
        self.values: dict[str, torch.Tensor] = {}
        for tensor in tensor_plan(spec, vocab_size):
            value = torch.from_numpy(initial_values(tensor, spec))
            if tensor.name.endswith(A_LOG_SUFFIX):
                value = torch.log(-value)
            self.values[tensor.name] = value.requires_grad_(not tensor.name.endswith(BIAS_SUFFIX))

    def trainable(self) -> list[torch.Tensor]:
        return [value for value in self.values.values() if value.requires_grad]

    def gguf_value(self, name: str) -> torch.Tensor:
        """The tensor as the GGUF stores it (`ssm_a` is -exp(A_log))."""
        value = self.values[name]
        return -torch.exp(value) if name.endswith(A_LOG_SUFFIX) else value

    def gguf_arrays(self) -> dict[str, np.ndarray]:
        """float32 values of every tensor by GGUF name, for `make_tiny(weights=...)`."""
        with torch.no_grad():
            return {name: self.gguf_value(name).numpy().copy() for name in self.values}

    def bias(self, layer: int) -> torch.Tensor:
        return self.values[f"blk.{layer}{BIAS_SUFFIX}"]


class ParameterExperts(ExpertSource):
    """An `ExpertSource` over the expert parameters: F32 matrices viewing them (autograd sees through)."""

    def __init__(self, params: Parameters) -> None:
        self.params = params

    def fetch(self, layer: int, expert_ids: list[int]) -> dict[int, ExpertWeights]:
        tensors = [self.params.values[routed_expert_name(layer, role)] for role in ROLES]
        return {
            e: ExpertWeights(*(QWeight(t[e], F32, (t.shape[1], t.shape[2])) for t in tensors))
            for e in expert_ids
        }


class CountingRouting:
    """A layer's `Routing` that also counts how often each expert is chosen (the load)."""

    def __init__(self, routing: Routing, counts: torch.Tensor) -> None:
        self.routing = routing
        self.counts = counts

    def choose(self, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        chosen, weights = self.routing.choose(logits, bias)
        self.counts += torch.bincount(chosen.flatten(), minlength=self.counts.numel())
        return chosen, weights


def build_model(params: Parameters) -> K3Model:
    """The inference model over the current parameters (as the GGUF stores them, reference path)."""
    tensors = {
        name: GGUFTensor(params.gguf_value(name), name=name)
        for name in params.values
        if not is_routed_expert(name)
    }
    source, options = (
        ParameterExperts(params),
        LoadOptions(kernels="reference", match_ggml=False, prefetch=False),
    )
    model = build(params.config, tensors, source, options)
    for layer in model.layers:
        if isinstance(layer.attn, KDA):
            layer.attn.chunk_size = KDA_CHUNK
        if isinstance(layer.ffn, LatentMoE):
            # F32 experts on torch's matmul over the parameters (the reference path would dequantize
            # copies of their bytes, which autograd cannot see through)
            layer.ffn.backend = "auto"
    return model


def count_loads(model: K3Model) -> dict[int, torch.Tensor]:
    """Make every MoE layer count its expert choices; returns the counters by layer."""
    counts = {}
    for layer in model.layers:
        if isinstance(layer.attn, KDA):
            layer.attn.chunk_size = KDA_CHUNK
        if isinstance(layer.ffn, LatentMoE):
            counts[layer.index] = torch.zeros(model.config.n_experts, dtype=torch.long)
            layer.ffn.routing = CountingRouting(layer.ffn.routing, counts[layer.index])
    return counts


def update_biases(params: Parameters, loads: dict[int, torch.Tensor], rate: float) -> None:
    """bias += rate * sign(mean load - load): under-used experts become likelier to be chosen."""
    with torch.no_grad():
        for layer, load in loads.items():
            load = load.float()
            params.bias(layer).add_(rate * torch.sign(load.mean() - load))


def sequence_nll(model: K3Model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood of one sequence ids [T + 1]."""
    logits = model.forward(model.new_state(), ids[:-1])
    return torch.nn.functional.cross_entropy(logits, ids[1:])


@dataclass
class TrainLog:
    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # mean training loss per step
    max_load_ratio: float = 0.0  # last step: the busiest expert's load over the mean, worst layer


def learning_rate(options: TrainOptions, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, options.warmup))
    return options.lr * warm * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def train(
    params: Parameters,
    tokens: np.ndarray,
    options: TrainOptions,
    report: Callable[[TrainLog], None] | None = None,
) -> TrainLog:
    """Train on random windows of `tokens` until `options.steps` or `options.minutes` (first reached)."""
    if len(tokens) <= options.seq_len + 1:
        raise ValueError(f"training text: {len(tokens)} tokens, need more than seq_len {options.seq_len} + 1")
    generator = torch.Generator().manual_seed(options.seed)
    stream = torch.from_numpy(tokens.astype(np.int64))
    optimizer = _optimizer(params, options)
    log, started = TrainLog(), time.perf_counter()
    while True:
        progress = max(log.steps / options.steps, (time.perf_counter() - started) / (60 * options.minutes))
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(options, log.steps, progress)
        starts = torch.randint(0, len(stream) - options.seq_len - 1, (options.batch,), generator=generator)
        loss, loads = _step(params, [stream[s : s + options.seq_len + 1] for s in starts.tolist()])
        torch.nn.utils.clip_grad_norm_(params.trainable(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_biases(params, loads, options.bias_rate)
        log.steps += 1
        log.losses.append(loss)
        log.max_load_ratio = max(float(load.max() / load.float().mean()) for load in loads.values())
        log.seconds = time.perf_counter() - started
        if report is not None:
            report(log)
    return log


def _step(params: Parameters, sequences: list[torch.Tensor]) -> tuple[float, dict[int, torch.Tensor]]:
    """Forward and backward over the sequences; returns the mean loss and the experts' loads."""
    model = build_model(params)
    loads = count_loads(model)
    loss = sum(sequence_nll(model, ids) for ids in sequences) / len(sequences)
    loss.backward()
    return float(loss.detach()), loads


def _optimizer(params: Parameters, options: TrainOptions) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only."""
    trainable = params.trainable()
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": options.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=options.lr, betas=(0.9, 0.95))


def evaluate(params: Parameters, tokens: np.ndarray, seq_len: int, windows: int) -> float:
    """Mean next-token NLL (nats) over `windows` evenly spaced windows of `tokens`."""
    stream = torch.from_numpy(tokens.astype(np.int64))
    count = min(windows, (len(stream) - 1) // seq_len)
    if count < 1:
        raise ValueError(f"held-out text: {len(stream)} tokens, need more than seq_len = {seq_len}")
    step = (len(stream) - seq_len - 1) // max(1, count - 1) if count > 1 else 0
    model = build_model(params)
    with torch.inference_mode():
        losses = [float(sequence_nll(model, stream[i * step : i * step + seq_len + 1])) for i in range(count)]
    return sum(losses) / len(losses)
