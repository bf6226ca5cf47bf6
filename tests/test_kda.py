"""KDA: the chunked prefill, sglang's packed decode entry points, TP sharding.

The oracle is a float64 token-by-token loop written here from the reference recurrence
(../shared/reference/kimi-k3-architecture.md), with S indexed [key][value].
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NO_C_KERNELS
from k3stream.model.kda import (
    KDA,
    chunked_delta_rule,
    fused_recurrent_gated_delta_rule_packed_decode,
    fused_recurrent_kda_packed_decode,
    shard_kda_weights,
)


def reference_delta_rule(q, k, v, g, beta, state_vk, scale):
    """Token by token in float64: S[i][:] *= exp(g[i]); d = beta (v - S^T k); S += k d^T; o = scale S^T q."""
    s = state_vk.double().transpose(-1, -2).clone()  # [H, K, V]
    outputs = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t].double())[..., None]
        delta = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double()))
        s = s + k[t].double()[..., None] * delta[:, None, :]
        outputs.append(scale * torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(outputs), s.transpose(-1, -2)


def reference_gate(f, A_log, lower_bound):
    a = torch.exp(A_log.double())[:, None]
    if lower_bound is None:
        return -a * torch.log1p(torch.exp(f.double()))
    return lower_bound / (1 + torch.exp(-a * f.double()))


def random_inputs(gen, tokens, heads, dim):
    def unit(*shape):
        x = torch.randn(*shape, generator=gen)
        return x / x.norm(dim=-1, keepdim=True)

    return dict(
        q=unit(tokens, heads, dim),
        k=unit(tokens, heads, dim),
        v=torch.randn(tokens, heads, dim, generator=gen),
        f=torch.randn(tokens, heads, dim, generator=gen) * 2,
        b=torch.randn(tokens, heads, generator=gen) * 2,
        A_log=torch.randn(heads, generator=gen) * 0.5,
        state=torch.randn(heads, dim, dim, generator=gen),
    )


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 150),
    heads=st.integers(1, 3),
    dim=st.sampled_from([4, 8, 16]),
    chunk=st.sampled_from([1, 7, 16, 64]),
    lower_bound=st.sampled_from([None, -5.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_prefill_matches_token_by_token_reference(tokens, heads, dim, chunk, lower_bound, seed):
    x = random_inputs(torch.Generator().manual_seed(seed), tokens, heads, dim)
    g = reference_gate(x["f"], x["A_log"], lower_bound).float()
    beta = torch.sigmoid(x["b"])
    state = x["state"].clone()
    out = chunked_delta_rule(x["q"], x["k"], x["v"], g, beta, state, dim**-0.5, chunk)
    expected, expected_state = reference_delta_rule(x["q"], x["k"], x["v"], g, beta, x["state"], dim**-0.5)
    assert rel(out, expected) < 1e-4
    assert rel(state, expected_state) < 1e-4


def test_chunked_prefill_continues_from_its_own_state():
    x = random_inputs(torch.Generator().manual_seed(3), 90, 2, 8)
    g = reference_gate(x["f"], x["A_log"], -5.0).float()
    beta = torch.sigmoid(x["b"])
    whole_state, split_state = x["state"].clone(), x["state"].clone()
    whole = chunked_delta_rule(x["q"], x["k"], x["v"], g, beta, whole_state, 0.3)
    first = chunked_delta_rule(x["q"][:37], x["k"][:37], x["v"][:37], g[:37], beta[:37], split_state, 0.3)
    rest = chunked_delta_rule(x["q"][37:], x["k"][37:], x["v"][37:], g[37:], beta[37:], split_state, 0.3)
    assert rel(torch.cat([first, rest]), whole) < 1e-5
    assert rel(split_state, whole_state) < 1e-5


def test_chunked_prefill_survives_strong_decay():
    """Cumulative decay far beyond float32's exp range inside one chunk stays finite and exact."""
    x = random_inputs(torch.Generator().manual_seed(4), 64, 1, 8)
    g = torch.full((64, 1, 8), -30.0)
    beta = torch.sigmoid(x["b"])
    state = x["state"].clone()
    out = chunked_delta_rule(x["q"], x["k"], x["v"], g, beta, state, 0.3)
    expected, _ = reference_delta_rule(x["q"], x["k"], x["v"], g, beta, x["state"], 0.3)
    assert torch.isfinite(out).all()
    assert rel(out, expected) < 1e-5


@pytest.mark.parametrize("gate_scale", [0.05, 1.0, 4.9])
def test_factored_and_pairwise_chunk_products_agree(monkeypatch, gate_scale):
    """The factored decay products (a chunk spanning at most FACTORED_DECAY_LIMIT) and the pairwise form
    give the same prefill, up to a decay of 16 x 4.9 = 78 inside a chunk of 16 (the bound's edge)."""
    from k3stream.model import kda

    x = random_inputs(torch.Generator().manual_seed(11), 80, 3, 16)
    g = -gate_scale * torch.rand(80, 3, 16, generator=torch.Generator().manual_seed(12))
    beta = torch.sigmoid(x["b"])
    outs = []
    for limit in (kda.FACTORED_DECAY_LIMIT, -1.0):  # -1: every chunk takes the pairwise form
        monkeypatch.setattr(kda, "FACTORED_DECAY_LIMIT", limit)
        state = x["state"].clone()
        outs.append((chunked_delta_rule(x["q"], x["k"], x["v"], g, beta, state, 0.3, 16), state))
    expected, expected_state = reference_delta_rule(x["q"], x["k"], x["v"], g, beta, x["state"], 0.3)
    for out, state in outs:
        assert rel(out, expected) < 1e-5
        assert rel(state, expected_state) < 1e-5
    assert rel(outs[0][0], outs[1][0]) < 1e-5


@pytest.mark.parametrize("gate_scale", [2.0, 4.9])
def test_factored_products_give_the_pairwise_gradients(monkeypatch, gate_scale):
    """Training differentiates the prefill: the factored products give the pairwise form's gradients,
    finite, up to a span of 16 x 4.9 = 78 (the limit's edge)."""
    from k3stream.model import kda

    x = random_inputs(torch.Generator().manual_seed(13), 48, 2, 16)
    g = -gate_scale * torch.rand(48, 2, 16, generator=torch.Generator().manual_seed(14))
    grads = []
    for limit in (kda.FACTORED_DECAY_LIMIT, -1.0):
        monkeypatch.setattr(kda, "FACTORED_DECAY_LIMIT", limit)
        inputs = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], g, x["b"])]
        q, k, v, gate, b = inputs
        out = chunked_delta_rule(q, k, v, gate, torch.sigmoid(b), x["state"].clone(), 0.3, 16)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads.append([t.grad for t in inputs])
    for factored, pairwise in zip(*grads, strict=True):
        assert torch.isfinite(factored).all()
        assert rel(factored, pairwise) < 1e-4


def packed(q, k, v):
    return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1).contiguous()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("l2norm", [False, True])
def test_kda_packed_decode_matches_reference_and_skips_slot(lower_bound, l2norm):
    gen = torch.Generator().manual_seed(5)
    batch, heads, dim, slots = 3, 2, 8, 5
    x = random_inputs(gen, batch, heads, dim)
    raw_q, raw_k = x["q"] * 3, x["k"] * 0.5  # not unit length: the kernel's l2norm must fix them
    dt_bias = torch.randn(heads * dim, generator=gen)
    pool = torch.randn(slots, heads, dim, dim, generator=gen)
    before = pool.clone()
    indices = torch.tensor([4, -1, 1])
    out = torch.full((batch, 1, heads, dim), 7.0)
    fused_recurrent_kda_packed_decode(
        packed(raw_q if l2norm else x["q"], raw_k if l2norm else x["k"], x["v"]),
        x["f"].flatten(1).contiguous(),
        x["b"].contiguous(),
        x["A_log"],
        dt_bias,
        0.25,
        pool,
        out,
        indices,
        use_qk_l2norm_in_kernel=l2norm,
        lower_bound=lower_bound,
    )
    g = reference_gate(x["f"] + dt_bias.view(heads, dim), x["A_log"], lower_bound)
    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        o, s = reference_delta_rule(
            x["q"][row : row + 1], x["k"][row : row + 1], x["v"][row : row + 1],
            g[row : row + 1], torch.sigmoid(x["b"][row : row + 1]), before[slot], 0.25,
        )  # fmt: skip
        assert rel(out[row, 0], o[0]) < 1e-5
        assert rel(pool[slot], s) < 1e-5
    untouched = [0, 2, 3]
    assert torch.equal(pool[untouched], before[untouched])


def test_gated_delta_rule_packed_decode_scalar_gate_and_shared_qk_heads():
    """Scalar gate per value head; two value heads share each q/k head (HV = 2H)."""
    gen = torch.Generator().manual_seed(6)
    batch, q_heads, v_heads, dim = 2, 1, 2, 8
    x = random_inputs(gen, batch, q_heads, dim)
    v = torch.randn(batch, v_heads, dim, generator=gen)
    a, b = torch.randn(batch, v_heads, generator=gen), torch.randn(batch, v_heads, generator=gen)
    A_log, dt_bias = torch.randn(v_heads, generator=gen), torch.randn(v_heads, generator=gen)
    pool = torch.randn(2, v_heads, dim, dim, generator=gen)
    before = pool.clone()
    out = torch.empty(batch, 1, v_heads, dim)
    fused_recurrent_gated_delta_rule_packed_decode(
        packed(x["q"], x["k"], v), a, b, A_log, dt_bias, 0.5, pool, out, torch.tensor([1, 0])
    )
    for row, slot in enumerate([1, 0]):
        gate = -torch.exp(A_log.double()) * torch.log1p(torch.exp(a[row].double() + dt_bias.double()))
        g = gate[None, :, None].expand(1, v_heads, dim)
        q, k = (t[row : row + 1].expand(1, v_heads, dim) for t in (x["q"], x["k"]))
        o, s = reference_delta_rule(
            q, k, v[row : row + 1], g, torch.sigmoid(b[row : row + 1]), before[slot], 0.5
        )
        assert rel(out[row, 0], o[0]) < 1e-5
        assert rel(pool[slot], s) < 1e-5


def valid_kda_args(batch=2, heads=2, dim=4, slots=3):
    return dict(
        mixed_qkv=torch.zeros(batch, 3 * heads * dim),
        a=torch.zeros(batch, heads * dim),
        b=torch.zeros(batch, heads),
        A_log=torch.zeros(heads),
        dt_bias=torch.zeros(heads * dim),
        scale=0.5,
        initial_state=torch.zeros(slots, heads, dim, dim),
        out=torch.zeros(batch, 1, heads, dim),
        ssm_state_indices=torch.arange(batch),
    )


def valid_gdn_args(**kw):
    args = valid_kda_args(**kw)
    args["a"] = torch.zeros(args["b"].shape)
    args["dt_bias"] = torch.zeros(args["A_log"].shape)
    return args


COMMON_CASES = [
    ("mixed_qkv", torch.zeros(2, 24, 1), "`mixed_qkv` must be a 2D tensor (got ndim=3)."),
    ("mixed_qkv", torch.zeros(24, 2).T, "`mixed_qkv` must be contiguous in the last dim."),
    ("b", torch.zeros(2), "`a` and `b` must be 2D tensors (got a.ndim=2, b.ndim=1)."),
    ("b", torch.zeros(2, 2).T, "`a`/`b` must be contiguous in the last dim."),
    ("A_log", torch.zeros(2, 1), "`A_log`/`dt_bias` must be 1D tensors."),
    ("A_log", torch.zeros(4)[::2], "`A_log`/`dt_bias` must be contiguous."),
    (
        "ssm_state_indices",
        torch.zeros(2, 1),
        "`ssm_state_indices` must be 1D for packed decode (got ndim=2).",
    ),
    ("out", torch.zeros(2, 4, 2, 1).transpose(1, 3), "`out` must be contiguous."),
    ("A_log", torch.zeros(2, device="meta"), "All inputs must be on the same device."),
    ("b", torch.zeros(3, 2), "Mismatched batch sizes: mixed_qkv.shape[0]=2, a.shape[0]=2, b.shape[0]=3."),
    (
        "ssm_state_indices",
        torch.zeros(3),
        "`ssm_state_indices` must have shape [B] (got (3,); expected (2,)).",
    ),
    ("initial_state", torch.zeros(2, 4, 4), "`initial_state` must be a 4D tensor (got ndim=3)."),
    (
        "initial_state",
        torch.zeros(3, 2, 4, 4).transpose(2, 3),
        "`initial_state` must be contiguous in the last dim.",
    ),
]
KDA_CASES = [
    ("a", torch.zeros(2, 2), "`a` must have shape [B, HV*K] with HV=2, K=4 (got a.shape=(2, 2))."),
    ("b", torch.zeros(2, 3), "`b` must have shape [B, HV] with HV=2 (got b.shape=(2, 3))."),
    ("A_log", torch.zeros(4), "`A_log` must have 2 elements (got 4)."),
    ("dt_bias", torch.zeros(2), "`dt_bias` must have 8 elements (got 2)."),
    ("out", torch.zeros(2, 1, 2, 3), "`out` must have shape (2, 1, 2, 4) (got out.shape=(2, 1, 2, 3))."),
    ("mixed_qkv", torch.zeros(2, 8), "Invalid packed `mixed_qkv` last dim=8 for HV=2, V=4."),
    ("mixed_qkv", torch.zeros(2, 13), "Invalid packed `mixed_qkv` last dim=13 for HV=2, V=4."),
    (
        "mixed_qkv",
        torch.zeros(2, 14),
        "Invalid packed Q size 3: must be divisible by K=4. KDA packed decode requires "
        "num_q_heads == num_k_heads and head_q_dim == head_k_dim.",
    ),
    ("mixed_qkv", torch.zeros(2, 32), "Invalid head config inferred from mixed_qkv: H=3, HV=2."),
]
GDN_CASES = [
    (
        "a",
        torch.zeros(2, 3),
        "`a`/`b` must have shape [B, HV] with HV=2 (got a.shape=(2, 3), b.shape=(2, 2)).",
    ),
    (
        "A_log",
        torch.zeros(4),
        "`A_log` and `dt_bias` must have 2 elements (got A_log.numel()=4, dt_bias.numel()=2).",
    ),
    ("mixed_qkv", torch.zeros(2, 14), "Invalid packed Q size 3: must be divisible by K=4."),
]


@pytest.mark.parametrize(("field", "value", "message"), COMMON_CASES + KDA_CASES)
def test_kda_packed_decode_validation_messages(field, value, message):
    args = valid_kda_args()
    args[field] = value
    with pytest.raises(ValueError) as excinfo:
        fused_recurrent_kda_packed_decode(**args)
    assert str(excinfo.value) == message


@pytest.mark.parametrize(("field", "value", "message"), COMMON_CASES + GDN_CASES)
def test_gated_delta_rule_packed_decode_validation_messages(field, value, message):
    args = valid_gdn_args()
    args[field] = value
    with pytest.raises(ValueError) as excinfo:
        fused_recurrent_gated_delta_rule_packed_decode(**args)
    assert str(excinfo.value) == message


@pytest.fixture(scope="module")
def kda_path(tiny_model):
    return tiny_model(n_layers=3, mla_layers=(2,), kda_heads=4, mla_heads=4, seed=11)


@pytest.fixture(scope="module")
def kda_model(kda_path):
    import k3stream

    return k3stream.load(kda_path)


def load_rank(path, tp_rank: int, tp_size: int):
    import k3stream

    return k3stream.load(path, k3stream.LoadOptions(tp_rank=tp_rank, tp_size=tp_size))


def test_kda_prefill_is_its_decode_steps_and_matches_the_chunked_form(kda_model, monkeypatch):
    """On the CPU a prefill runs the C recurrence token by token, as decoding its tokens one at a time
    does (the same bits for the same projections; those of 70 rows take torch's F32 GEMM, of one row
    the C kernel). The chunked torch form (autograd, other devices) agrees within 1e-5."""
    from k3stream.quant.kernels import cpu

    layer = kda_model.layers[1].attn
    h = torch.randn(70, kda_model.config.hidden, generator=torch.Generator().manual_seed(8))
    prefill_state, decode_state = layer.new_state(), layer.new_state()
    prefilled = layer.prefill(h, prefill_state)
    decoded = torch.cat([layer.decode(h[t : t + 1], [decode_state]) for t in range(h.shape[0])])
    limit = 1e-6 if cpu.available() else 1e-5
    assert rel(decoded, prefilled) < limit
    assert rel(decode_state.recurrent, prefill_state.recurrent) < limit
    monkeypatch.setattr(KDA, "_step_in_c", lambda *_: False)
    chunked_state = layer.new_state()
    chunked = layer.prefill(h, chunked_state)
    assert rel(chunked, prefilled) < 1e-5
    assert rel(chunked_state.recurrent, prefill_state.recurrent) < 1e-5
    assert torch.equal(chunked_state.conv, prefill_state.conv)


@pytest.mark.parametrize(
    "spec",
    [
        dict(conv_kernel=4, gate_lower_bound=-5.0, kda_heads=4, kda_head_dim=16),
        dict(conv_kernel=2, gate_lower_bound=None, kda_heads=2, kda_head_dim=40),
        dict(conv_kernel=1, gate_lower_bound=-5.0, kda_heads=1, kda_head_dim=8),
    ],
)
def test_the_c_decode_step_matches_the_torch_one(tiny_model, monkeypatch, spec):
    """`steps_cpu.c` against the torch step it replaces on the CPU: three sequences at different points,
    stepped together; outputs, recurrent states and conv histories."""
    import k3stream
    from k3stream.quant.kernels import cpu

    if not cpu.available():
        pytest.skip(NO_C_KERNELS)
    spec = dict(spec, mla_heads=spec["kda_heads"], n_layers=2, mla_layers=(1,), seed=5)
    layer = k3stream.load(tiny_model(**spec)).layers[0].attn
    h = torch.randn(3, 40, layer.w.q_proj.in_features, generator=torch.Generator().manual_seed(3))
    runs = []
    for in_c in (True, False):
        if not in_c:
            monkeypatch.setattr(KDA, "_step_in_c", lambda *_: False)
        states = [layer.new_state() for _ in range(3)]
        for row, state in enumerate(states):
            layer.prefill(h[row, : 5 * row + 1], state)
        with torch.inference_mode():
            outputs = torch.stack([layer.decode(h[:, t], states) for t in range(16, 40)])
        runs.append(
            (outputs, torch.stack([s.recurrent for s in states]), torch.stack([s.conv for s in states]))
        )
    (c_out, c_rec, c_conv), (t_out, t_rec, t_conv) = runs
    assert rel(c_out, t_out) < 1e-5
    assert rel(c_rec, t_rec) < 1e-5
    assert torch.equal(c_conv, t_conv)


def test_a_state_of_another_shape_is_a_clear_error(kda_model):
    """A state this layer did not make is refused in one line before any kernel reads it."""
    from k3stream.model.kda import KDAState

    layer = kda_model.layers[1].attn
    h = torch.randn(1, kda_model.config.hidden)
    wrong = KDAState(conv=torch.zeros(2, 5), recurrent=torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="does not fit this layer.*new_state"):
        layer.decode(h, [layer.new_state(), wrong])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_ranks_sum_to_the_full_layer(kda_path, kda_model, tp_size):
    ranks = [load_rank(kda_path, rank, tp_size) for rank in range(tp_size)]
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(20, kda_model.config.hidden, generator=gen)
    step = torch.randn(1, kda_model.config.hidden, generator=gen)
    kda_layers = [i for i, layer in enumerate(kda_model.layers) if isinstance(layer.attn, KDA)]
    assert kda_layers == [0, 1]
    for i in kda_layers:
        full = kda_model.layers[i].attn
        per_rank = full.heads // tp_size
        full_state = full.new_state()
        full_prefill, full_decode = full.prefill(h, full_state), full.decode(step, [full_state])
        prefill_sum, decode_sum = torch.zeros_like(full_prefill), torch.zeros_like(full_decode)
        for rank, model in enumerate(ranks):
            layer, own = model.layers[i].attn, slice(rank * per_rank, (rank + 1) * per_rank)
            assert layer.heads == per_rank
            assert torch.equal(layer.w.ssm_a, full.w.ssm_a[own])
            assert torch.equal(layer.w.dt_bias, full.w.dt_bias.view(full.heads, -1)[own].flatten())
            state = layer.new_state()
            prefill_sum += layer.prefill(h, state)  # o_proj is row-parallel: the all-reduce
            decode_sum += layer.decode(step, [state])
            assert rel(state.recurrent, full_state.recurrent[own]) < 1e-5
        assert rel(prefill_sum, full_prefill) < 1e-5
        assert rel(decode_sum, full_decode) < 1e-5


def test_rank_handed_full_vectors_fails_with_sglangs_message(kda_path, kda_model):
    full = kda_model.layers[1].attn
    rank = load_rank(kda_path, 1, 2).layers[1].attn
    heads, rank_heads, dim = full.heads, rank.heads, full.head_dim
    step = torch.randn(1, kda_model.config.hidden, generator=torch.Generator().manual_seed(12))
    # sglang's text, from the scalar-gate entry point: the rank's state with full-model vectors
    args = valid_gdn_args(batch=1, heads=rank_heads, dim=dim, slots=1)
    args["initial_state"] = rank.new_state().recurrent[None]
    args["A_log"], args["dt_bias"] = full.w.ssm_a, full.w.ssm_a.clone()
    with pytest.raises(ValueError) as excinfo:
        fused_recurrent_gated_delta_rule_packed_decode(**args)
    assert str(excinfo.value) == (
        f"`A_log` and `dt_bias` must have {rank_heads} elements "
        f"(got A_log.numel()={heads}, dt_bias.numel()={heads})."
    )
    # the KDA entry point's checks, made when a rank's layer is handed the full vectors one at a time
    for field, message in (
        ("ssm_a", f"`A_log` must have {rank_heads} elements (got {heads})."),
        ("dt_bias", f"`dt_bias` must have {rank_heads * dim} elements (got {heads * dim})."),
    ):
        handed_full = replace(rank.w, **{field: getattr(full.w, field)})
        with pytest.raises(ValueError) as excinfo:
            KDA(handed_full, rank_heads, dim, rank.lower_bound, rank.eps)
        assert str(excinfo.value) == message
    assert torch.isfinite(rank.decode(step, [rank.new_state()])).all()  # its own vectors are accepted


def test_sharding_rejects_uneven_split_and_bad_ranks(kda_path, kda_model):
    layer = kda_model.layers[1].attn
    with pytest.raises(ValueError, match="^blk.1: 4 KDA heads cannot be split over 3 tensor-parallel ranks$"):
        shard_kda_weights(layer.w, layer.heads, 0, 3, "blk.1")
    for tp_rank, tp_size in ((2, 2), (-1, 2)):
        outside = rf"^blk.1: 4 KDA heads: rank {tp_rank} outside 0\.\.{tp_size - 1}$"
        with pytest.raises(ValueError, match=outside):
            shard_kda_weights(layer.w, layer.heads, tp_rank, tp_size, "blk.1")
    bad_ranks = {(2, 2): r"tp_rank must be in \[0, 2\), got 2", (0, 0): "tp_size must be >= 1, got 0"}
    for (tp_rank, tp_size), message in bad_ranks.items():
        with pytest.raises(ValueError, match=rf"^LoadOptions\.{message}$"):
            load_rank(kda_path, tp_rank, tp_size)


def test_scalar_gate_entry_point_agrees_with_the_per_channel_one():
    """With the same gate input on every key channel, the GDN and KDA entry points are one recurrence."""
    gen = torch.Generator().manual_seed(10)
    batch, heads, dim = 2, 3, 8
    x = random_inputs(gen, batch, heads, dim)
    a, dt_bias = torch.randn(batch, heads, generator=gen), torch.randn(heads, generator=gen)
    mixed = packed(x["q"], x["k"], x["v"])
    pool = torch.randn(2, heads, dim, dim, generator=gen)
    pools = [pool.clone(), pool.clone()]
    outs = [torch.empty(batch, 1, heads, dim) for _ in range(2)]
    indices = torch.tensor([1, 0])
    common = dict(b=x["b"].contiguous(), A_log=x["A_log"], scale=0.3, ssm_state_indices=indices)
    fused_recurrent_gated_delta_rule_packed_decode(
        mixed, a, dt_bias=dt_bias, initial_state=pools[0], out=outs[0], **common
    )
    fused_recurrent_kda_packed_decode(
        mixed,
        a.repeat_interleave(dim, dim=1),
        dt_bias=dt_bias.repeat_interleave(dim),
        initial_state=pools[1],
        out=outs[1],
        **common,
    )
    assert torch.allclose(outs[0], outs[1], rtol=1e-6, atol=1e-7)
    assert torch.allclose(pools[0], pools[1], rtol=1e-6, atol=1e-7)
