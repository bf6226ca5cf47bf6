"""The decode program (`k3stream.model.program`): one sequence's decode step built once as C calls on
fixed buffers computes exactly what the eager forward computes, bit for bit, on every kind of layer and
expert source, and is rebuilt whenever what it bound changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3stream
from bench_helpers import MIB, pack_expert_bytes, packed_tiny
from k3stream import LoadOptions
from k3stream.model.moe import LatentMoE

# audited recipe (Q2_K/Q3_K experts, Q4_0/Q2_K MLA heads) or F32; MLA layers, shared experts or none
SPECS = [
    dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32, kda_head_dim=32),
    dict(recipe="f32", n_layers=7, n_experts=32, top_k=16, block_size=2, hidden=96, dense_ff=64),
    dict(recipe="f16", n_shared=0, mla_layers=(2, 4), kda_head_dim=32, q_lora=None),
]


def tokens_for(seed: int, vocab: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, count).tolist()


def decodes(model, prompt: list[int], steps: list[int]) -> torch.Tensor:
    state = model.new_state()
    model.prefill(state, prompt)
    return torch.stack([model.decode(state, token) for token in steps])


def eager_and_program(path, options: LoadOptions | None = None):
    program, eager = (k3stream.load(path, options) for _ in range(2))
    eager.use_program = False
    return program, eager


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_the_program_decodes_what_the_eager_forward_decodes_bit_for_bit(tiny_model, spec, seed, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # F16 products under ggml's arithmetic round their inputs in torch first, a step the program
        # leaves to Python: the F16 model checks the float-activation program
        options = LoadOptions(match_ggml=spec["recipe"] != "f16")
        program, eager = eager_and_program(tiny_model(**spec, seed=seed), options)
        prompt, steps = tokens_for(seed, program.config.vocab_size, 24)[:16], tokens_for(seed + 1, 500, 8)
        assert torch.equal(decodes(program, prompt, steps), decodes(eager, prompt, steps))
        names = [function.__name__ for function, *_ in program._program.steps]  # it ran, mostly in C
        assert names.count("_dropping_result") < len(names) / 4
        # experts all in RAM (256-value K-quant rows, or F32 rows): from their addresses, in C
        assert names.count("chosen_experts") == len(program.config.moe_layers)
        assert eager._program is None
    finally:
        torch.set_num_threads(before)


def test_the_program_is_rebuilt_for_another_sequence_a_prefill_and_a_thread_count(tiny_model):
    """Two sequences decoded in turn, one prefilled again between its tokens, the thread count changed:
    each step is still the eager step."""
    program, eager = eager_and_program(tiny_model(**SPECS[0], seed=7))
    tokens = tokens_for(7, program.config.vocab_size, 40)
    states = {model: [model.new_state(), model.new_state()] for model in (program, eager)}
    logits = {program: [], eager: []}
    before = torch.get_num_threads()
    try:
        for model in (program, eager):
            first, second = states[model]
            model.prefill(first, tokens[:8])
            model.prefill(second, tokens[8:12])
            for step, token in enumerate(tokens[12:30]):
                torch.set_num_threads(1 + step // 9)
                if step == 6:
                    model.prefill(first, tokens[30:34])  # replaces the state's conv histories
                logits[model].append(model.decode(states[model][step % 2], token))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.stack(logits[program]), torch.stack(logits[eager]))


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_program_serves_experts_from_the_store_and_from_an_uncached_gguf(tmp_path, prefetch):
    """A store whose cache holds a third of the experts (read ahead, evicted; hinted or not) and a GGUF
    read at every step: the program's routed experts go through the MoE's own fetch, so they equal the
    eager ones."""
    from k3stream.pack.reader import ExpertPack
    from k3stream.store.expert_store import ExpertStore

    gguf_path, manifest = packed_tiny(tmp_path, n_experts=16, top_k=4, seed=12)
    tokens = tokens_for(12, 500, 28)
    results = []
    for use_program in (True, False):
        with ExpertStore(ExpertPack(manifest), ram_mib=pack_expert_bytes(manifest) / 3 / MIB) as store:
            model = k3stream.load(gguf_path, LoadOptions(expert_source=store, prefetch=prefetch))
            model.use_program = use_program
            results.append(decodes(model, tokens[:12], tokens[12:]))
            assert (model._program is not None and model._program.steps is not None) == use_program
    assert torch.equal(*results)
    program, eager = eager_and_program(gguf_path, LoadOptions(expert_ram_mib=0))
    assert torch.equal(decodes(program, tokens[:12], tokens[12:]), results[1])
    assert program.expert_source.kept_bytes() == 0


def test_the_reference_path_and_a_model_sending_stream_hints_decode_eagerly(tiny_model):
    """The reference path (the kernels' oracle) and a model that sends hints predicted from the stream
    between layers keep the eager forward, and decode as before."""
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.model.experts import GGUFExpertSource
    from source_helpers import RecordingSource

    path = tiny_model(**SPECS[0], seed=9)
    reference = k3stream.load(path, LoadOptions(kernels="reference"))
    source = RecordingSource(GGUFExpertSource(K3Checkpoint.open(path)))
    hinted = k3stream.load(path, LoadOptions(expert_source=source, prefetch_hint="pre-attention"))
    tokens = tokens_for(9, reference.config.vocab_size, 20)
    expected = decodes(k3stream.load(path, LoadOptions(kernels="reference")), tokens[:12], tokens[12:])
    assert torch.equal(decodes(reference, tokens[:12], tokens[12:]), expected)
    assert reference._program is None
    decodes(hinted, tokens[:12], tokens[12:])
    assert hinted._program.steps is None
    assert any(kind == "prefetch" for kind, *_ in hinted.expert_source.calls)


@pytest.mark.parametrize("lead", [1, 2])
def test_a_model_sending_token_hints_decodes_by_program_with_the_eager_hints(tiny_model, lead):
    """Token hints and the pre-attention hints that fill their gaps (a decode step's default): the
    program sends the same hints, in the same order among the fetches, learns the same routes, and
    decodes the same bits as the eager forward."""
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.model.experts import GGUFExpertSource
    from source_helpers import RecordingSource

    path = tiny_model(**SPECS[1], seed=5)
    tokens = tokens_for(5, 500, 24)
    runs = []
    for use_program in (True, False):
        source = RecordingSource(GGUFExpertSource(K3Checkpoint.open(path)))
        model = k3stream.load(path, LoadOptions(expert_source=source))
        model.set_token_hint_lead(lead)
        model.use_program = use_program
        runs.append((decodes(model, tokens[:12], tokens[12:] * 2), source.calls, model))
    (program_logits, program_calls, program), (eager_logits, eager_calls, _) = runs
    assert program._program.steps is not None
    assert torch.equal(program_logits, eager_logits)
    assert program_calls == eager_calls
    assert sum(kind == "prefetch" for kind, *_ in program_calls) > 0
    eager = runs[1][2]
    assert program.hints.by_layer() == eager.hints.by_layer()
    moe = [layer.index for layer in program.layers if isinstance(layer.ffn, LatentMoE)]
    learned = [
        [model.token_routes.predict(layer, [token]) for layer in moe for token in tokens]
        for model in (program, eager)
    ]
    assert learned[0] == learned[1] and any(learned[0])
    # tokens the prompt had not shown: pre-attention hints filled the token hints' gaps
    assert program.hints.summary()["pre-attention"]["predicted"] > 0


@pytest.mark.parametrize("tokens", [[-1], [10**9]])
def test_a_bad_token_is_refused_before_the_program_runs(tiny_model, tokens):
    model = k3stream.load(tiny_model(**SPECS[0], seed=9))
    state = model.new_state()
    model.prefill(state, [1, 2, 3])
    with pytest.raises(ValueError, match="token id outside"):
        model.decode_batch([state], tokens)


def test_the_eager_mla_step_of_one_sequence_follows_whichever_sequence_runs_it(tiny_model):
    """Off the program, an MLA layer decodes one sequence by its C calls bound once a thread: two
    sequences decoded in turn, each alone, give what they give decoded together (MLA's torch steps),
    bit for bit, and the bound step keeps no sequence once it has run."""
    from k3stream.model.mla import MLA

    model = k3stream.load(tiny_model(**SPECS[0], seed=5))
    model.use_program = False
    vocab = model.config.vocab_size
    prompts = [tokens_for(6, vocab, 9), tokens_for(7, vocab, 4)]
    alone, together = [], []
    for states in (alone, together):
        for prompt in prompts:
            states.append(model.new_state())
            model.prefill(states[-1], prompt)
    for step in range(3):
        tokens = [11 + step, 200 + step]
        each = torch.stack([model.decode(state, token) for state, token in zip(alone, tokens, strict=True)])
        assert torch.equal(each, model.decode_batch(together, tokens))
    layers = [layer.attn for layer in model.layers if isinstance(layer.attn, MLA)]
    assert layers and all(layer._bound.state is None and layer._bound.steps for layer in layers)


@pytest.mark.parametrize("where", ["gguf", "store"])
def test_the_eager_moe_step_of_one_row_takes_its_bound_calls_and_equals_the_batched_step(
    tiny_model, tmp_path, where
):
    """Off the program, a MoE layer computes one row by its decode steps bound once a thread (experts
    all in RAM: one `chosen_experts` call from their addresses; from a store: the MoE's own fetch), the
    shared experts called between; two sequences decoded in turn, each alone, give what they give
    decoded together (the multi-row steps), bit for bit, and `chosen` is each step's routing."""
    from k3stream.model.moe import LatentMoE
    from k3stream.pack.reader import ExpertPack
    from k3stream.store.expert_store import ExpertStore

    store = None
    if where == "gguf":
        model = k3stream.load(tiny_model(**SPECS[0], seed=8))
    else:
        path, manifest = packed_tiny(tmp_path, n_experts=16, top_k=4, seed=9)
        store = ExpertStore(ExpertPack(manifest), ram_mib=pack_expert_bytes(manifest) / 3 / MIB)
        model = k3stream.load(path, LoadOptions(expert_source=store))
    try:
        model.use_program = False
        vocab = model.config.vocab_size
        alone, together = [], []
        for states in (alone, together):
            for prompt in (tokens_for(10, vocab, 9), tokens_for(11, vocab, 4)):
                states.append(model.new_state())
                model.prefill(states[-1], prompt)
        moes = [layer.ffn for layer in model.layers if isinstance(layer.ffn, LatentMoE)]
        for step in range(3):
            tokens = [21 + step, 300 + step]
            each, chosen = [], []
            for state, token in zip(alone, tokens, strict=True):
                each.append(model.decode(state, token))
                chosen.append(torch.cat([moe.chosen for moe in moes]))
            assert torch.equal(torch.stack(each), model.decode_batch(together, tokens))
            batched = [moe.chosen for moe in moes]  # [2, k] a layer: row i is sequence i's
            for i in range(2):
                assert torch.equal(chosen[i], torch.cat([rows[i : i + 1] for rows in batched]))
        names = [[function.__name__ for function, *_ in moe._bound.routed_steps] for moe in moes]
        in_c = "chosen_experts" if where == "gguf" else "_dropping_result"
        assert moes and all(in_c in layer for layer in names)
    finally:
        if store is not None:
            store.close()
