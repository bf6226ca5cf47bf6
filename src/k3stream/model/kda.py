"""Kimi Delta Attention (KDA): short causal convolutions, a per-channel decay gate and the delta rule.

Recurrent state per head is S with layout [V, K] (value rows, key columns), sglang's layout,
so the packed single-token entry points below can update a pool of states in place. Prefill runs the
recurrence chunk by chunk in closed form (the WY/UT transform of fla's chunk_kda); decode takes one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from k3stream.model.layers import JointLinear, Linear, bind_linear, l2_normalize, rms_norm
from k3stream.model.shard import input_columns, output_rows, part, rows_of
from k3stream.quant.kernels import cpu

SOFTPLUS_THRESHOLD = 20.0
SGLANG_L2NORM_EPS = 1e-6  # sglang's KDA kernels' in-kernel q/k norm; the model itself uses the rms eps
# the largest decay (-sum of a channel's gates) a prefill chunk may span for the factored products: the
# factors and the masked-out products stay below exp(80) ~ 5.5e34, inside float32
FACTORED_DECAY_LIMIT = 80.0


@dataclass
class KDAWeights:
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    g_proj: Linear
    b_proj: Linear
    f_a_proj: Linear
    f_b_proj: Linear
    o_proj: Linear
    conv: torch.Tensor  # [3 * d_inner, C]: q, k and v channels stacked
    ssm_a: torch.Tensor  # [H]: -exp(A_log) per head, as the GGUF stores it
    dt_bias: torch.Tensor  # [H * D]
    o_norm: torch.Tensor  # [D]


@dataclass
class KDAState:
    conv: torch.Tensor  # [C - 1, 3 * d_inner]: the last projected q/k/v inputs, oldest first
    recurrent: torch.Tensor  # [H, V, K]
    # rows of the next prefill after which a copy of the state is kept in `marked` (`model.snapshot`)
    marks: tuple[int, ...] = ()
    marked: list[KDAState] = field(default_factory=list)


def kda_gate(f: torch.Tensor, ssm_a: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space decay per key channel; f is [..., H, K] with dt_bias already added, ssm_a [H] the
    GGUF's -exp(A_log)."""
    a = -ssm_a.float()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * f)
    return -a * torch.nn.functional.softplus(f, threshold=SOFTPLUS_THRESHOLD)


def causal_conv(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, D] after `history` [C-1, D]; returns (out, new history)."""
    kernel, length = weight.shape[1], x.shape[0]
    window = torch.cat([history, x], dim=0)
    out = window[:length] * weight[:, 0]
    for tap in range(1, kernel):  # a multiply-add per tap: no [T, D, C] windows tensor
        out = out.addcmul(window[tap : tap + length], weight[:, tap])
    return out, window[window.shape[0] - (kernel - 1) :]


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gated delta rule over T tokens in chunks; q, k, g [T, H, K], v [T, H, V], beta [T, H].

    `state` [H, V, K] is read as the state before the first token and overwritten with the state
    after the last. Returns o [T, H, V]. Same recurrence as one `fused_recurrent_kda_packed_decode`
    step per token: S *= exp(g); S += k (beta (v - S k))^T; o = scale S q.
    """
    s = state.float().transpose(1, 2).clone()  # [H, K, V]; a copy, as autograd reads it after `state` changes
    heads_first = [t.float().transpose(0, 1) for t in (q, k, v, g)]
    beta = beta.float().transpose(0, 1)
    outputs = []
    for start in range(0, q.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        qc, kc, vc, gc = (t[:, part] for t in heads_first)
        o, s = _delta_rule_chunk(qc, kc, vc, gc, beta[:, part], s, scale)
        outputs.append(o)
    state.copy_(s.transpose(1, 2))
    return torch.cat(outputs, dim=1).transpose(0, 1)


def _delta_rule_chunk(q, k, v, g, beta, s, scale):
    """One chunk, heads first: q, k, g [H, L, K], v [H, L, V], beta [H, L], s [H, K, V]."""
    length = q.shape[1]
    cum = g.cumsum(1)
    a, p = _decayed_products(q, k, cum)
    k_start = torch.exp(cum) * k
    q_start = torch.exp(cum) * q
    rhs = beta[..., None] * (v - k_start @ s)
    system = beta[..., None] * a + torch.eye(length, device=q.device)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = scale * (q_start @ s + p @ u)
    last = cum[:, -1:, :]
    k_end = torch.exp(last - cum) * k
    s = torch.exp(last).transpose(1, 2) * s + k_end.transpose(1, 2) @ u
    return o, s


def _decayed_products(q, k, cum):
    """a[t, s] = sum_k k_t k_s exp(cum_t - cum_s) for s < t and p[t, s] the same with q_t for s <= t:
    [H, L, L] each. When the chunk's decay spans at most FACTORED_DECAY_LIMIT (always, for a gate with a
    lower bound of -5 over 16 tokens), exp(cum_t - cum_s) = exp(cum_t - mid) exp(mid - cum_s) splits
    into two matrix products whose factors stay within float32; a stronger decay takes the pairwise
    [H, L, L, K] form, whose exponents are <= 0 under the mask."""
    length = q.shape[1]
    span = float((cum[:, 0] - cum[:, -1]).max().detach()) if length > 1 else 0.0
    if span <= FACTORED_DECAY_LIMIT:
        mid = cum[:, length // 2 : length // 2 + 1]
        k_late = k * torch.exp(mid - cum)
        a = (k * torch.exp(cum - mid)) @ k_late.transpose(1, 2)
        p = (q * torch.exp(cum - mid)) @ k_late.transpose(1, 2)
        return a.tril(-1), p.tril()
    inclusive = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    exponent = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~inclusive[:, :, None], float("-inf"))
    key_weighted = torch.exp(exponent) * k[:, None, :, :]  # [H, L(t), L(s), K]
    a = torch.einsum("htsk,htk->hts", key_weighted, k).tril(-1)
    p = torch.einsum("htsk,htk->hts", key_weighted, q)
    return a, p


class KDA:
    """One KDA layer: prefill over a sequence, decode one token for each of several sequences."""

    def __init__(
        self, weights: KDAWeights, heads: int, head_dim: int, lower_bound: float | None, eps: float
    ) -> None:
        self.w = weights
        check_head_vectors(weights.ssm_a, weights.dt_bias, heads, head_dim)
        self.heads = heads
        self.head_dim = head_dim
        self.lower_bound = lower_bound
        self.eps = eps
        self.scale = head_dim**-0.5
        self.chunk_size = 16  # the pairwise decay tensor is [H, L, L, K]: small chunks are faster on CPU
        # q, k, v, g, beta and f_a all project the layer input: one kernel call
        w = weights
        self.projections = JointLinear([w.q_proj, w.k_proj, w.v_proj, w.g_proj, w.b_proj, w.f_a_proj])
        self._conv_by_tap: tuple[tuple[int, int], torch.Tensor] | None = None

    def new_state(self, device: torch.device | str = "cpu") -> KDAState:
        kernel = self.w.conv.shape[1]
        d_inner = self.heads * self.head_dim
        return KDAState(
            conv=torch.zeros(kernel - 1, 3 * d_inner, device=device),
            recurrent=torch.zeros(self.heads, self.head_dim, self.head_dim, device=device),
        )

    def prefill(self, h: torch.Tensor, state: KDAState, last_only: bool = False) -> torch.Tensor:
        """h [T, E] (normed layer input) -> [T, E] ([1, E], the last row's, with `last_only`: the state
        takes every row, the output projection the last alone); advances `state`. On the CPU the C
        recurrence runs the tokens one by one, as T decode steps would (the same bits; 8 heads of 128
        over 128 tokens: ~3x the chunked torch form, which stays for autograd and other devices)."""
        self._check_states([state])
        qkv, g_logits, b_logits, f_a = (part.contiguous() for part in self._project(h))
        if self._step_in_c(qkv, [state]):
            gated = self._recurrent_marked(qkv, g_logits, b_logits, f_a, state)
            return self.w.o_proj((gated[-1:] if last_only else gated).to(h.dtype))
        mixed, state.conv = causal_conv(qkv, state.conv, self.w.conv)
        q, k, v = self._split_activate(mixed)
        beta = torch.sigmoid(b_logits)
        o = chunked_delta_rule(q, k, v, self._gate(f_a), beta, state.recurrent, self.scale, self.chunk_size)
        if last_only:
            o, g_logits = o[-1:], g_logits[-1:]
        return self._output(o, g_logits, h.dtype)

    def decode(self, h: torch.Tensor, states: list[KDAState]) -> torch.Tensor:
        """h [B, E], one token of each of B sequences -> [B, E]; advances each state."""
        self._check_states(states)
        qkv, g_logits, b_logits, f_a = (part.contiguous() for part in self._project(h))
        if self._step_in_c(qkv, states):
            return self.w.o_proj(self._recurrent(qkv, g_logits, b_logits, f_a, states).to(h.dtype))
        mixed_rows = []
        for row, state in enumerate(states):
            mixed_row, state.conv = causal_conv(qkv[row : row + 1], state.conv, self.w.conv)
            mixed_rows.append(mixed_row)
        q, k, v = self._split_activate(torch.cat(mixed_rows))
        # one sequence updates its state in place; several are stacked once and keep views of the stack
        pool = states[0].recurrent[None] if len(states) == 1 else torch.stack([st.recurrent for st in states])
        out = delta_step(q * self.scale, k, v, self._gate(f_a), torch.sigmoid(b_logits), pool)
        if len(states) > 1:
            for state, new in zip(states, pool, strict=True):
                state.recurrent = new
        return self._output(out, g_logits, h.dtype)

    def _conv_taps(self) -> torch.Tensor:
        """The conv weights by tap, [C, 3 H D], as the C recurrence reads them (made again when the
        weights change, as in training)."""
        key = (self.w.conv.data_ptr(), self.w.conv._version)
        if self._conv_by_tap is None or self._conv_by_tap[0] != key:
            self._conv_by_tap = key, self.w.conv.detach().t().contiguous()
        return self._conv_by_tap[1]

    def _recurrent_marked(self, qkv, g_logits, b_logits, f_a, state: KDAState) -> torch.Tensor:
        """`_recurrent` of one state's rows in runs split at its `marks`, a copy of the state kept after
        each (the recurrence goes token by token: the same bits as one run)."""
        bounds = [0, *(mark for mark in state.marks if 0 < mark < qkv.shape[0]), qkv.shape[0]]
        runs = []
        for start, end in zip(bounds, bounds[1:], strict=False):
            rows = (t[start:end] for t in (qkv, g_logits, b_logits, f_a))
            runs.append(self._recurrent(*rows, [state]))
            if end in state.marks:
                state.marked.append(KDAState(state.conv.clone(), state.recurrent.clone()))
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def _recurrent(self, qkv, g_logits, b_logits, f_a, states: list[KDAState]) -> torch.Tensor:
        """The C recurrence over the projections of each state's rows (in order): the gated outputs
        before o_proj [rows, H D]."""
        w = self.w
        gated = cpu.kda_recurrent(
            qkv, [state.conv for state in states], self._conv_taps(), w.f_b_proj(f_a).float(), w.dt_bias,
            w.ssm_a, self.lower_bound, b_logits, [state.recurrent for state in states], g_logits, w.o_norm,
            self.eps, self.scale,
        )  # fmt: skip
        return gated

    def decode_steps(
        self, h: torch.Tensor, out: torch.Tensor, state: KDAState, threads: int
    ) -> list[cpu.Call]:
        """`decode` of one sequence (h [1, E] into out [1, E]) as C calls bound to buffers of their own
        (one Python step where the step after the projections would not run in C); they advance `state`
        in place, as `decode` does."""
        self._check_states([state])
        q_width, k_width, v_width, *rest = self.projections.widths
        joint = h.new_empty(1, sum(self.projections.widths))
        qkv, g_logits, b_logits, f_a = joint.split([q_width + k_width + v_width, *rest], dim=1)
        f = h.new_empty(1, self.w.f_b_proj.out_features)
        gated = torch.empty_like(f)
        if not self._step_in_c(qkv, [state]):
            return [cpu.python_step(lambda: out.copy_(self.decode(h, [state])))]
        w = self.w
        return [
            bind_linear(self.projections, h, joint, threads),
            bind_linear(w.f_b_proj, f_a, f, threads),
            cpu.bind_kda_recurrent(
                (qkv, f, b_logits, g_logits),
                [state.conv],
                [state.recurrent],
                (self._conv_taps(), w.dt_bias, w.ssm_a, w.o_norm),
                (self.lower_bound, self.eps, self.scale),
                gated,
                threads,
            ),
            bind_linear(w.o_proj, gated, out, threads),
        ]

    def _step_in_c(self, qkv: torch.Tensor, states: list[KDAState]) -> bool:
        """Whether the step after the projections takes the C kernel (`steps_cpu.c`): float32 CPU
        tensors it may update in place, none that autograd follows."""
        tensors = [qkv, self.w.conv, self.w.dt_bias, self.w.ssm_a, self.w.o_norm]
        return cpu.takes(tensors + [t for state in states for t in (state.conv, state.recurrent)])

    def _check_states(self, states: list[KDAState]) -> None:
        """One line for a state this layer did not make (the C step would read past its end)."""
        width, taps = self.w.conv.shape
        expected = ((taps - 1, width), (self.heads, self.head_dim, self.head_dim))
        for state in states:
            found = (tuple(state.conv.shape), tuple(state.recurrent.shape))
            if found != expected:
                raise ValueError(
                    f"KDA state of shapes {found} does not fit this layer {expected}: "
                    "pass states made by this model's new_state()"
                )

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of the layer input as float32 views: q|k|v side by side [T, 3 H D], the output
        gate's logits [T, H D], beta's logits [T, H] and the decay's first projection [T, D]."""
        q, k, v, *rest = (part.float() for part in self.projections.parts(h))
        return (torch.cat([q, k, v], dim=1), *rest)

    def _split_activate(self, mixed: torch.Tensor):
        q, k, v = (
            t.reshape(-1, self.heads, self.head_dim) for t in torch.nn.functional.silu(mixed).chunk(3, 1)
        )
        return l2_normalize(q, self.eps), l2_normalize(k, self.eps), v

    def _gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """The log-space decay [T, H, K] from the decay's first projection."""
        f = self.w.f_b_proj(f_a).float().view(-1, self.heads, self.head_dim)
        return kda_gate(f + self.w.dt_bias.view(self.heads, -1), self.w.ssm_a, self.lower_bound)

    def _output(self, o: torch.Tensor, g_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        gate = torch.sigmoid(g_logits).view(-1, self.heads, self.head_dim)
        gated = rms_norm(o, self.w.o_norm, self.eps) * gate
        return self.w.o_proj(gated.flatten(1).to(dtype))


def shard_kda_weights(weights: KDAWeights, heads: int, tp_rank: int, tp_size: int, layer: str) -> KDAWeights:
    """The KDA weights of tensor-parallel rank `tp_rank` of `tp_size`: its heads only, in GGUF types.

    q/k/v/g/f_b/beta and the convs are column-parallel, `ssm_a` and `dt_bias` follow the heads,
    `o_proj` is row-parallel (sum the ranks' outputs), `f_a` is replicated and `o_norm` shared.
    `layer` is the GGUF tensor prefix ("blk.3"): a refusal names the layer or tensor as the file does.
    """
    head_dim = weights.o_norm.numel()
    own_heads = part(heads, tp_rank, tp_size, f"{layer}: {heads} KDA heads")
    channels = part(heads * head_dim, tp_rank, tp_size, f"{layer}: {heads} KDA heads", head_dim)
    d_inner = heads * head_dim
    conv_rows = torch.cat([weights.conv[i * d_inner :][channels] for i in range(3)])
    return replace(
        weights,
        q_proj=output_rows(weights.q_proj, channels),
        k_proj=output_rows(weights.k_proj, channels),
        v_proj=output_rows(weights.v_proj, channels),
        g_proj=output_rows(weights.g_proj, channels),
        f_b_proj=output_rows(weights.f_b_proj, channels),
        b_proj=output_rows(weights.b_proj, own_heads),
        o_proj=input_columns(weights.o_proj, channels, f"{layer}.attn_output.weight", tp_size),
        conv=conv_rows,
        ssm_a=rows_of(weights.ssm_a, own_heads),
        dt_bias=rows_of(weights.dt_bias, channels),
    )


# --- sglang's single-token packed KDA decode entry points, in pure torch ---


def fused_recurrent_gated_delta_rule_packed_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated-delta-rule step with a scalar gate per head: a, b [B, HV]; A_log, dt_bias [HV]."""
    batch = _check_packed_common(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)
    heads_v, _value_dim, _key_dim = initial_state.shape[-3:]
    if a.shape[1] != heads_v or b.shape[1] != heads_v:
        raise ValueError(
            f"`a`/`b` must have shape [B, HV] with HV={heads_v} "
            f"(got a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)})."
        )
    if A_log.numel() != heads_v or dt_bias.numel() != heads_v:
        raise ValueError(
            f"`A_log` and `dt_bias` must have {heads_v} elements "
            f"(got A_log.numel()={A_log.numel()}, dt_bias.numel()={dt_bias.numel()})."
        )
    q_heads = _check_packed_shapes(mixed_qkv, initial_state, out, batch, kda=False)
    x = a.float() + dt_bias.float()
    gate = -torch.exp(A_log.float()) * torch.nn.functional.softplus(x, threshold=SOFTPLUS_THRESHOLD)
    # sglang's kernel rounds beta to b's dtype before using it
    beta = torch.sigmoid(b.float()).to(b.dtype).float()
    key_dim = initial_state.shape[-1]
    _packed_step(
        mixed_qkv,
        gate[..., None].expand(-1, -1, key_dim),
        beta,
        scale,
        initial_state,
        out,
        ssm_state_indices,
        use_qk_l2norm_in_kernel,
        q_heads,
    )
    return out, initial_state


def fused_recurrent_kda_packed_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    out: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA step with a gate per key channel: a [B, HV*K], dt_bias [HV*K], A_log [HV], b [B, HV].

    mixed_qkv [B, 2*H*K + HV*V] holds q, k (H heads of K) and v (HV heads of V) after the conv;
    initial_state [slots, HV, V, K] is updated in place at `ssm_state_indices` (-1 skips a row and
    writes zeros to its output); out [B, 1, HV, V].
    """
    batch = _check_packed_common(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)
    heads_v, _value_dim, key_dim = initial_state.shape[-3:]
    if a.shape[1] != heads_v * key_dim:
        raise ValueError(
            f"`a` must have shape [B, HV*K] with HV={heads_v}, K={key_dim} (got a.shape={tuple(a.shape)})."
        )
    if b.shape[1] != heads_v:
        raise ValueError(f"`b` must have shape [B, HV] with HV={heads_v} (got b.shape={tuple(b.shape)}).")
    check_head_vectors(A_log, dt_bias, heads_v, key_dim)
    q_heads = _check_packed_shapes(mixed_qkv, initial_state, out, batch, kda=True)
    x = (a.float() + dt_bias.float()).view(batch, heads_v, key_dim)
    gate = kda_gate(x, -torch.exp(A_log.float()), lower_bound)
    _packed_step(
        mixed_qkv,
        gate,
        torch.sigmoid(b.float()),
        scale,
        initial_state,
        out,
        ssm_state_indices,
        use_qk_l2norm_in_kernel,
        q_heads,
    )
    return out, initial_state


def check_head_vectors(decay: torch.Tensor, dt_bias: torch.Tensor, heads: int, key_dim: int) -> None:
    """sglang's KDA entry point's checks of its per-head vectors (the decay, `A_log` there, and
    `dt_bias`): what a layer holding another head configuration's vectors fails with."""
    if decay.numel() != heads:
        raise ValueError(f"`A_log` must have {heads} elements (got {decay.numel()}).")
    if dt_bias.numel() != heads * key_dim:
        raise ValueError(f"`dt_bias` must have {heads * key_dim} elements (got {dt_bias.numel()}).")


def _check_packed_common(mixed_qkv, a, b, A_log, dt_bias, initial_state, out, ssm_state_indices) -> int:
    """The checks both of sglang's entry points make first, in their order; returns the batch size."""
    if mixed_qkv.ndim != 2:
        raise ValueError(f"`mixed_qkv` must be a 2D tensor (got ndim={mixed_qkv.ndim}).")
    if mixed_qkv.stride(-1) != 1:
        raise ValueError("`mixed_qkv` must be contiguous in the last dim.")
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"`a` and `b` must be 2D tensors (got a.ndim={a.ndim}, b.ndim={b.ndim}).")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("`a`/`b` must be contiguous in the last dim.")
    if A_log.ndim != 1 or dt_bias.ndim != 1:
        raise ValueError("`A_log`/`dt_bias` must be 1D tensors.")
    if A_log.stride(0) != 1 or dt_bias.stride(0) != 1:
        raise ValueError("`A_log`/`dt_bias` must be contiguous.")
    if ssm_state_indices.ndim != 1:
        raise ValueError(
            f"`ssm_state_indices` must be 1D for packed decode (got ndim={ssm_state_indices.ndim})."
        )
    if not out.is_contiguous():
        raise ValueError("`out` must be contiguous.")
    device = mixed_qkv.device
    if any(t.device != device for t in (a, b, A_log, dt_bias, initial_state, out, ssm_state_indices)):
        raise ValueError("All inputs must be on the same device.")
    batch = mixed_qkv.shape[0]
    if a.shape[0] != batch or b.shape[0] != batch:
        raise ValueError(
            "Mismatched batch sizes: "
            f"mixed_qkv.shape[0]={batch}, a.shape[0]={a.shape[0]}, b.shape[0]={b.shape[0]}."
        )
    if ssm_state_indices.shape[0] != batch:
        raise ValueError(
            f"`ssm_state_indices` must have shape [B] (got {tuple(ssm_state_indices.shape)}; "
            f"expected ({batch},))."
        )
    if initial_state.ndim != 4:
        raise ValueError(f"`initial_state` must be a 4D tensor (got ndim={initial_state.ndim}).")
    if initial_state.stride(-1) != 1:
        raise ValueError("`initial_state` must be contiguous in the last dim.")
    return batch


def _check_packed_shapes(mixed_qkv, initial_state, out, batch: int, kda: bool) -> int:
    """sglang's output and packed-layout checks; returns the number of q/k heads H."""
    heads_v, value_dim, key_dim = initial_state.shape[-3:]
    if out.shape != (batch, 1, heads_v, value_dim):
        raise ValueError(
            f"`out` must have shape {(batch, 1, heads_v, value_dim)} (got out.shape={tuple(out.shape)})."
        )
    qkv_dim = mixed_qkv.shape[1]
    qk_dim = qkv_dim - heads_v * value_dim
    if qk_dim <= 0 or qk_dim % 2 != 0:
        raise ValueError(f"Invalid packed `mixed_qkv` last dim={qkv_dim} for HV={heads_v}, V={value_dim}.")
    q_dim = qk_dim // 2
    if q_dim % key_dim != 0:
        detail = (
            " KDA packed decode requires num_q_heads == num_k_heads and head_q_dim == head_k_dim."
            if kda
            else ""
        )
        raise ValueError(f"Invalid packed Q size {q_dim}: must be divisible by K={key_dim}.{detail}")
    q_heads = q_dim // key_dim
    if q_heads <= 0 or heads_v % q_heads != 0:
        raise ValueError(f"Invalid head config inferred from mixed_qkv: H={q_heads}, HV={heads_v}.")
    return q_heads


def _packed_step(mixed_qkv, gate, beta, scale, initial_state, out, ssm_state_indices, l2norm, q_heads):
    """The shared recurrence of both entry points; gate [B, HV, K] in log space, beta [B, HV]."""
    heads_v, value_dim, key_dim = initial_state.shape[-3:]
    q_dim = q_heads * key_dim
    live = (ssm_state_indices >= 0).nonzero().flatten()
    out.zero_()
    if live.numel() == 0:
        return
    slots = ssm_state_indices[live].long()
    rows = mixed_qkv[live].float()
    q = rows[:, :q_dim].view(-1, q_heads, key_dim)
    k = rows[:, q_dim : 2 * q_dim].view(-1, q_heads, key_dim)
    v = rows[:, 2 * q_dim :].view(-1, heads_v, value_dim)
    if l2norm:
        q = l2_normalize(q, SGLANG_L2NORM_EPS)
        k = l2_normalize(k, SGLANG_L2NORM_EPS)
    group = heads_v // q_heads  # value heads sharing one q/k head
    q = (q * scale).repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    s = initial_state[slots].float()
    out[live, 0] = delta_step(q, k, v, gate[live], beta[live], s).to(out.dtype)
    initial_state[slots] = s.to(initial_state.dtype)


def delta_step(q, k, v, gate, beta, s: torch.Tensor) -> torch.Tensor:
    """One token of B sequences, in place on the float32 states s [B, HV, V, K]: S *= exp(gate);
    S += (beta (v - S k)) k^T; returns S q [B, HV, V]. q (already scaled), k, gate [B, HV, K];
    v [B, HV, V]; beta [B, HV]."""
    s.mul_(torch.exp(gate)[:, :, None, :])
    # S k and S q as products and sums: 3-5x faster than a batched mat-vec (`matmul`) here
    delta = (v - (s * k[:, :, None, :]).sum(-1)) * beta[..., None]
    flat = s.view(-1, *s.shape[2:])  # the rank-one update without a [B, HV, V, K] temporary
    flat.baddbmm_(delta.reshape(-1, delta.shape[-1], 1), k.reshape(-1, 1, k.shape[-1]))
    return (s * q[:, :, None, :]).sum(-1)
