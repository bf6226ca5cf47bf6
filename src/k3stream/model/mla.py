"""Multi-head latent attention, NoPE and absorbed: the cache holds one latent row per token."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3stream.model.layers import (
    GGUFTensor,
    JointLinear,
    Linear,
    bind_linear,
    bind_rms_norm,
    rms_norm,
)
from k3stream.model.options import LoadOptions
from k3stream.quant.kernels import GroupedProduct, checked_weight, cpu, row_at_a_time, row_exact
from k3stream.quant.rounding import round_like_ggml

QUERY_BLOCK = 512
# multiply-adds of one query's scores (heads x cache rows x row width) up to which the C attention runs,
# and heads up to which it runs at any length: beyond both, torch's two matrix products are faster (4
# heads x 7,194 rows of 264: C 0.73 ms, torch 0.90, on one thread; 1.6 against 1.7-2.3 from memory; 8
# heads about even, 16 twice torch's)
C_ATTENTION_MAX_MACS = 1 << 22
C_ATTENTION_HEADS = 4


# a softmax weight exp(d) of a score d below the largest is 0 where d < FAR_SCORE, in C and in torch
FAR_SCORE = -64.0


def c_attention_rows(heads: int, width: int) -> int | float:
    """Cache rows below which one query's attention (heads x width) runs in C (`_attend_one`)."""
    return math.inf if heads <= C_ATTENTION_HEADS else C_ATTENTION_MAX_MACS // (heads * width) + 1


def softmax_weights(scores: torch.Tensor) -> torch.Tensor:
    """The softmax of `scores` over the last dimension with a weight below exp(FAR_SCORE) of the largest
    as 0, as the C attention takes it (-inf scores included): a trained model's scores span hundreds,
    and the subnormal floats exp gives far below the largest made the weighted sum's products 5-10x
    slower (`benchmarks/bench_attention.py`)."""
    far = (scores - scores.amax(dim=-1, keepdim=True)).clamp(min=FAR_SCORE - 1.0)  # no in-place: autograd
    weights = torch.exp(far).masked_fill(far < FAR_SCORE, 0.0)
    return weights / weights.sum(dim=-1, keepdim=True)


def torch_attend_one(query: torch.Tensor, cache: torch.Tensor, kv: int, scale: float) -> torch.Tensor:
    """One query [H, width] over the cache [T, width] by torch's two products -> [H, kv]."""
    return torch.mm(softmax_weights(torch.mm(query, cache.T) * scale), cache[:, :kv])


class HeadProjection:
    """x [N, H, in] -> [N, H, out] with a separate matrix per head (k_b, v_b: [H, out, in]).

    Kept in its GGUF type, the heads' matrices go through the kernel seam in one grouped product (F32
    heads too: a decode row's heads take the C mat-vec, so its bits do not depend on its batch); the
    reference path holds dense values.
    """

    def __init__(
        self,
        tensor: GGUFTensor,
        heads: int,
        out_features: int,
        in_features: int,
        options: LoadOptions,
    ) -> None:
        self.heads = heads
        self.rounding_type = tensor.input_rounding(options)
        self.per_head: GroupedProduct | None = None
        if options.in_gguf_types:
            data = tensor.value.reshape(heads, -1)
            shape = (out_features, in_features)
            per_head = [
                checked_weight(f"{tensor.name}[{h}]", data[h], tensor.type_id, shape) for h in range(heads)
            ]
            self.per_head = GroupedProduct(per_head, options.kernels, self.rounding_type is not None)
            self.weight = None
        else:
            self.weight = tensor.matrix((heads, out_features, in_features), options.torch_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:  # a row at a time under `set_row_exact`, as `layers.DenseLinear`
            return row_at_a_time(x, self._dense, most_rows=1)
        rows = x.shape[0]
        starts, order = _rows_by_head(rows, self.heads)
        out = self.per_head(x.reshape(rows * self.heads, -1), starts, order)
        return out.view(self.heads, rows, -1).transpose(0, 1)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        x_rounded = round_like_ggml(x, self.rounding_type).to(self.weight.dtype)
        return torch.einsum("nhi,hoi->nho", x_rounded, self.weight).to(x.dtype)

    def bind(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> cpu.Call:
        """One row's heads, x [H, in] into out [H, out] (contiguous), as a bound C call, or a Python step
        calling the projection where that is not one."""
        starts, order = _rows_by_head(1, self.heads)
        call = self.per_head.bind(x, starts, order, out, threads) if self.per_head is not None else None
        return call or cpu.python_step(lambda: out.copy_(self(x[None])[0]))


def _bind_output_gate(values: torch.Tensor, g_logits: torch.Tensor, out: torch.Tensor) -> cpu.Call:
    """`_output`'s gate (values * sigmoid(g_logits)) into `out` as a bound call: C's where `_output`
    takes it, else torch's."""
    if cpu.takes((values, g_logits, out)):
        return cpu.bind_sigmoid_gate(values, g_logits, out)
    return cpu.python_step(lambda: torch.mul(values, torch.sigmoid(g_logits), out=out))


def _gate_last(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The joint projection's parts: query (or q_a), kv_a, and the output gate's (None without one)."""
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None


@functools.lru_cache(maxsize=64)
def _rows_by_head(rows: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`starts`/`rows` of a grouped product whose matrix h takes rows h, h + H, ... of [N * H, in]."""
    order = torch.arange(rows * heads, dtype=torch.int64).view(rows, heads).T.reshape(-1)
    return torch.arange(0, rows * heads + 1, rows, dtype=torch.int64), order


@dataclass
class MLAWeights:
    q_a_proj: Linear | None  # None: no q-lora, q_b_proj is the full q projection
    q_a_norm: torch.Tensor | None
    q_b_proj: Linear
    kv_a_proj: Linear
    kv_a_norm: torch.Tensor
    k_b: HeadProjection  # q_nope -> latent
    v_b: HeadProjection  # latent -> value
    g_proj: Linear | None  # None: no output gate (llama.cpp's graph then applies none)
    o_proj: Linear


class MLAState:
    """The latent cache of one sequence: [tokens, kv_lora + rope], grown by doubling. A restored state
    may share its buffer with the snapshot it came from (`model.snapshot.restore`): rows are only ever
    appended, and `written` (shared by all the states and snapshots on one buffer) holds how many rows
    anyone wrote into it, so a state appends in place only where its rows end the buffer's; else it
    copies its rows to a buffer of its own first."""

    def __init__(self, width: int, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.zeros(16, width, device=device)
        self.length = 0
        self.written = [0]

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Add rows [T, width]; returns the whole cache [length, width]."""
        needed = self.length + rows.shape[0]
        self._claim(needed)
        self.buffer[self.length : needed] = rows
        self.length = needed
        return self.buffer[:needed]

    def append_row(self, row: torch.Tensor) -> None:
        """`append` of one contiguous float32 CPU row [1, width] by a C copy (a decode step's, which
        then reads `buffer`'s first `length` rows): no torch operation, each costly in a token whose
        weight reads have evicted torch's own code and data from the caches."""
        self._claim(self.length + 1)
        cpu.copy_row(row, self.buffer, self.length)
        self.length += 1

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows in all (at least double the buffer when it grows; rows past `length` are
        never read, so not cleared)."""
        if rows > self.buffer.shape[0]:
            self._own(max(rows, 2 * self.buffer.shape[0]))

    def share(self, buffer: torch.Tensor, length: int, written: list[int]) -> None:
        """Continue from the first `length` rows of `buffer`, shared (`written` its count of rows)."""
        self.buffer, self.length, self.written = buffer, length, written

    def _claim(self, needed: int) -> None:
        """Make rows length..needed this state's to write: in place where no one wrote past its rows."""
        with _CLAIMS:
            if self.written[0] != self.length:
                self._own(max(needed, self.buffer.shape[0]))
            elif needed > self.buffer.shape[0]:
                self._own(max(needed, 2 * self.buffer.shape[0]))
            self.written[0] = needed

    def _own(self, capacity: int) -> None:
        """A buffer of `capacity` rows of this state's own, with its rows."""
        grown = self.buffer.new_empty(capacity, self.buffer.shape[1])
        grown[: self.length] = self.buffer[: self.length]
        self.buffer, self.written = grown, [self.length]


_CLAIMS = threading.Lock()  # the check and the claim of `MLAState.written` together


class MLA:
    """`ggml_order` (the default arithmetic's): the C attention (up to `c_attention_rows`; torch's beyond)
    in the float order of ggml's CPU backend (`cpu.mla_attend`'s)."""

    def __init__(
        self,
        weights: MLAWeights,
        heads: int,
        nope: int,
        rope: int,
        kv_lora: int,
        eps: float,
        ggml_order: bool = False,
    ) -> None:
        self.w = weights
        self.ggml_order = ggml_order
        self.heads = heads
        self.nope = nope
        self.rope = rope
        self.kv_lora = kv_lora
        self.eps = eps
        # llama.cpp's scale, 1 / sqrtf(width) in float32 (one ulp off the double's rounding at 24)
        self.scale = float(1.0 / torch.tensor(float(nope + rope)).sqrt())
        w = weights
        # the query's first projection, kv_a and the output gate all project the layer input: one call
        first = w.q_b_proj if w.q_a_proj is None else w.q_a_proj
        self.projections = JointLinear([first, w.kv_a_proj] + ([] if w.g_proj is None else [w.g_proj]))
        self._bound = threading.local()  # each thread's bound decode step (`_decode_bound`)

    def new_state(self, device: torch.device | str = "cpu") -> MLAState:
        return MLAState(self.kv_lora + self.rope, device)

    def prefill(self, h: torch.Tensor, state: MLAState, last_only: bool = False) -> torch.Tensor:
        """h [T, E] (normed layer input) of one sequence -> [T, E]; appends to its cache. `last_only`:
        every row goes into the cache, the last alone through the attention and output -> [1, E]."""
        offset = state.length
        if last_only:
            cache = state.append(self._cache_rows(self.w.kv_a_proj(h).float()))
            query, _, g_logits = self._project(h[-1:])
            return self._output(self._attend(query, cache, offset + h.shape[0] - 1), g_logits)
        queries, rows, g_logits = self._project(h)
        context = self._attend(queries, state.append(rows), offset)
        return self._output(context, g_logits)

    def decode(self, h: torch.Tensor, states: list[MLAState]) -> torch.Tensor:
        """h [B, E], one token of each of B sequences -> [B, E]. One sequence on the C kernels takes its
        bound step (`decode_steps`, the same values): at Kimi-K3's shapes (2 threads) the layer's time
        beside its kernel calls is 0.4-0.6 ms a token so, 0.8-1.4 ms by the torch steps."""
        if len(states) == 1 and h.shape[0] == 1 and cpu.takes((h,)):
            return self._decode_bound(h, states[0])
        queries, rows, g_logits = self._project(h)
        contexts = [
            self._attend_one(queries[i], state.append(rows[i : i + 1])) for i, state in enumerate(states)
        ]
        return self._output(torch.stack(contexts), g_logits)

    def unbind(self) -> None:
        """Drops the bound decode steps (every thread's): the next one-sequence decode binds them again,
        to the C library's functions as they are then (a profile wraps them)."""
        self._bound = threading.local()

    def _decode_bound(self, h: torch.Tensor, state: MLAState) -> torch.Tensor:
        """`decode` of one sequence by its decode steps, bound once per thread (again for another thread
        count) to buffers of their own and to whichever state runs them."""
        threads, bound = torch.get_num_threads(), self._bound
        if getattr(bound, "threads", None) != threads:
            bound.h, bound.out, bound.state = torch.empty_like(h), torch.empty_like(h), None
            bound.steps = self._steps(bound.h, bound.out, lambda: bound.state, threads)
            bound.threads = threads
        bound.h.copy_(h)
        bound.state = state
        try:
            cpu.run_calls(bound.steps)
        finally:
            bound.state = None
        return bound.out.clone()

    def decode_steps(
        self, h: torch.Tensor, out: torch.Tensor, state: MLAState, threads: int
    ) -> list[cpu.Call]:
        """`decode` of one sequence (h [1, E] into out [1, E]) as C calls bound to buffers of their own,
        the copies between them C calls too, and one Python step: the attention over the growing cache
        (`_attend_step`)."""
        return self._steps(h, out, lambda: state, threads)

    def _steps(
        self, h: torch.Tensor, out: torch.Tensor, state_of: Callable[[], MLAState], threads: int
    ) -> list[cpu.Call]:
        """`decode_steps` with the state the attention step takes found at each run (`state_of`)."""
        w, heads, width = self.w, self.heads, self.nope + self.rope
        joint = h.new_empty(1, sum(self.projections.widths))
        first, compressed, g_logits = _gate_last(joint.split(self.projections.widths, dim=1))
        steps = [bind_linear(self.projections, h, joint, threads)]
        if w.q_a_proj is not None:  # q-lora: `first` is q_a's output, normed before q_b
            q_a, q_flat = torch.empty_like(first), h.new_empty(1, heads * width)
            steps += [
                bind_rms_norm(first, w.q_a_norm, self.eps, q_a),
                bind_linear(w.q_b_proj, q_a, q_flat, threads),
            ]
            first = q_flat
        q = first.view(heads, width)
        q_nope, query = h.new_empty(heads, self.nope), h.new_empty(heads, self.kv_lora + self.rope)
        q_absorbed, row = h.new_empty(heads, self.kv_lora), h.new_empty(1, self.kv_lora + self.rope)
        context, values = torch.empty_like(q_absorbed), h.new_empty(1, w.o_proj.in_features)
        gated = values if g_logits is None else torch.empty_like(g_logits)
        gate = [] if g_logits is None else [_bind_output_gate(values, g_logits, gated)]
        return steps + [
            cpu.bind_copy(q[:, : self.nope], q_nope),
            w.k_b.bind(q_nope, q_absorbed, threads),
            bind_rms_norm(compressed[:, : self.kv_lora], w.kv_a_norm, self.eps, row[:, : self.kv_lora]),
            cpu.bind_copy(q_absorbed, query[:, : self.kv_lora]),
            cpu.bind_copy(q[:, self.nope :], query[:, self.kv_lora :]),
            cpu.bind_copy(compressed[:, self.kv_lora :], row[:, self.kv_lora :]),
            self._attend_step(query, row, state_of, context, threads),
            w.v_b.bind(context, values.view(heads, -1), threads),
            *gate,
            bind_linear(w.o_proj, gated, out, threads),
        ]

    def _attend_step(
        self,
        query: torch.Tensor,
        row: torch.Tensor,
        state_of: Callable[[], MLAState],
        context: torch.Tensor,
        threads: int,
    ) -> cpu.Call:
        """The decode step's new cache row appended to the state `state_of()` and its query's attention
        over the cache into `context`: the C copy and attention on addresses where `_attend_one` would
        run in C, else its torch form."""
        heads, width = query.shape
        c_rows = c_attention_rows(heads, width)  # cache rows (the new one's included) below which C's

        def attend() -> None:
            state = state_of()
            by_c = cpu.takes((query, row, context, state.buffer)) and width == state.buffer.shape[1]
            if not by_c or state.length + 1 >= c_rows:
                context.copy_(self._attend_one(query, state.append(row)))
                return
            state.append_row(row)
            cpu.mla_attend(
                query, state.buffer, self.kv_lora, self.scale, context, state.length, threads, self.ggml_order
            )

        return cpu.python_step(attend)

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Absorbed queries [T, H, kv_lora + rope], new cache rows [T, kv_lora + rope] and the output
        gate's logits [T, H v] (None without a gate)."""
        first, compressed, g_logits = _gate_last([part.float() for part in self.projections.parts(h)])
        if self.w.q_a_proj is not None:  # q-lora: `first` is q_a's output, normed before q_b
            first = self.w.q_b_proj(rms_norm(first.contiguous(), self.w.q_a_norm, self.eps)).float()
        q = first.view(-1, self.heads, self.nope + self.rope)
        q_absorbed = self.w.k_b(q[..., : self.nope])
        return torch.cat([q_absorbed, q[..., self.nope :]], dim=-1), self._cache_rows(compressed), g_logits

    def _cache_rows(self, compressed: torch.Tensor) -> torch.Tensor:
        """Cache rows [T, kv_lora + rope] from kv_a's output: the latent part normed, the rope part as is."""
        latent = rms_norm(compressed[:, : self.kv_lora].contiguous(), self.w.kv_a_norm, self.eps)
        return torch.cat([latent, compressed[:, self.kv_lora :]], dim=1)

    def _attend(self, queries: torch.Tensor, cache: torch.Tensor, offset: int) -> torch.Tensor:
        """Causal attention of queries (positions offset..) over the cache -> latent context [T, H, kv].

        The queries whose decode step attends in C (`_attend_one`) get its bits, in one C call, so their
        rows do not depend on how many tokens go in at once; the rest go QUERY_BLOCK queries at a time
        through torch's products (which round as their query count has them), so the score matrix stays
        bounded. Under `kernels.row_exact()` each query attends as a decode step's does (`_attend_exact`).
        """
        if row_exact():
            return self._attend_exact(queries, cache, offset)
        in_c = self._c_queries(queries, cache, offset)
        parts = [self._attend_rows(queries[:in_c], cache, offset)] if in_c else []
        parts += [
            self._attend_block(queries[i : i + QUERY_BLOCK], cache[: offset + i + QUERY_BLOCK], offset + i)
            for i in range(in_c, queries.shape[0], QUERY_BLOCK)
        ]
        return torch.cat(parts)

    def _c_queries(self, queries: torch.Tensor, cache: torch.Tensor, offset: int) -> int:
        """How many of the first queries (positions offset..) attend in C as their decode steps do."""
        heads, width = queries.shape[1:]
        by_c = cpu.takes((queries, cache)) and cache.shape[1] == width
        return min(max(c_attention_rows(heads, width) - 1 - offset, 0), len(queries)) if by_c else 0

    def _attend_rows(self, queries: torch.Tensor, cache: torch.Tensor, offset: int) -> torch.Tensor:
        """`cpu.mla_attend_rows` of queries at positions offset.. in this layer's order."""
        return cpu.mla_attend_rows(
            queries, cache, offset, self.kv_lora, self.scale, ggml_order=self.ggml_order
        )

    def _attend_exact(self, queries: torch.Tensor, cache: torch.Tensor, offset: int) -> torch.Tensor:
        """Each query over the cache up to its own position with a decode step's bits (which then do not
        depend on where the prefill started): those `_attend_one` runs in C in one C call, the rest one
        at a time."""
        in_c = self._c_queries(queries, cache, offset)
        parts = [self._attend_rows(queries[:in_c], cache, offset)] if in_c else []
        rest = enumerate(queries[in_c:], in_c)
        parts += [self._attend_one(query, cache[: offset + i + 1])[None] for i, query in rest]
        return torch.cat(parts)

    def _attend_one(self, query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The newest position's query [H, kv_lora + rope] over its whole cache -> context [H, kv]
        (`_attend_block` for one query, which masks nothing; in C for float32 CPU tensors of at most
        C_ATTENTION_MAX_MACS multiply-adds)."""
        small = cache.shape[0] < c_attention_rows(*query.shape)
        if small and cpu.takes((query, cache)) and cache.shape[1] == query.shape[1]:
            return cpu.mla_attend(query, cache, self.kv_lora, self.scale, ggml_order=self.ggml_order)
        return torch_attend_one(query, cache, self.kv_lora, self.scale)

    def _attend_block(self, queries: torch.Tensor, cache: torch.Tensor, offset: int) -> torch.Tensor:
        scores = torch.einsum("thd,sd->hts", queries, cache) * self.scale
        positions = torch.arange(queries.shape[0], device=cache.device)[:, None] + offset
        future = torch.arange(cache.shape[0], device=cache.device)[None, :] > positions
        probs = softmax_weights(scores.masked_fill(future, float("-inf")))
        return torch.einsum("hts,sc->thc", probs, cache[:, : self.kv_lora])

    def _output(self, context: torch.Tensor, g_logits: torch.Tensor | None) -> torch.Tensor:
        values = self.w.v_b(context).flatten(1)
        if g_logits is None:
            return self.w.o_proj(values)
        g_logits = g_logits.contiguous()  # several rows' are a strided slice of the projections
        if cpu.takes((values, g_logits)):  # as the decode program's gate (`_bind_output_gate`)
            return self.w.o_proj(cpu.sigmoid_gate(values, g_logits))
        return self.w.o_proj(values * torch.sigmoid(g_logits))
