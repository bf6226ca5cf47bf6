"""Sequence-state snapshots: a state restored at position p continues with the cold prefill's bits."""

from __future__ import annotations

import pytest
import torch

import k3stream
from k3stream import LoadOptions
from k3stream.model.snapshot import prefill_marked, restore, restores_exactly, take_snapshot
from k3stream.quant.kernels import set_row_exact

AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32, kda_head_dim=32)
PROMPT = 40


@pytest.fixture(scope="module")
def exact_rows():
    set_row_exact(True)
    yield
    set_row_exact(False)


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory, one_torch_thread, exact_rows):
    """name -> model: the tiny F32 file, the audited recipe (its quantized products in floats, and with
    llama.cpp's integer arithmetic: `match_ggml`), the audited one streamed from its pack, and the F32
    file on the reference path (dense matrices and torch's products: float32, and float16 as
    `--dtype float16` loads it)."""
    from k3stream.engine.loading import load_resolved
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.builder import build_pack

    audited = tiny_model(**AUDITED)
    out = tmp_path_factory.mktemp("pack")
    manifest = build_pack(audited, out / "tiny.pack", out / "tiny.manifest.json").manifest
    streamed = load_resolved(K3Checkpoint.open(audited), manifest, LoadOptions(expert_ram_mib=0.5))
    yield {
        "f32": k3stream.load(tiny_model()),
        "audited": k3stream.load(audited),
        "audited-ggml": k3stream.load(audited, LoadOptions(match_ggml=True)),
        "streamed": streamed.model,
        "reference": k3stream.load(tiny_model(), LoadOptions(kernels="reference")),
        "reference-f16": k3stream.load(tiny_model(), LoadOptions(kernels="reference", dtype="float16")),
    }
    streamed.store.close()


def prompt(model, length: int = PROMPT, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()


@pytest.mark.parametrize("name", ["f32", "audited", "audited-ggml", "streamed", "reference", "reference-f16"])
def test_a_restored_prefix_continues_with_the_cold_bits(models, name):
    model = models[name]
    tokens = prompt(model)
    chunk = model.layers[0].attn.chunk_size
    assert restores_exactly(model)
    cold_last = model.prefill_last(model.new_state(), tokens)
    cold_rows = model.prefill(model.new_state(), tokens)
    for p in (0, 1, chunk - 1, chunk, chunk + 1, PROMPT - 1):
        live = model.new_state()
        if p:
            model.prefill_last(live, tokens[:p])
        snapshot = take_snapshot(live)
        model.prefill_last(live, tokens[p:])  # the live sequence goes on past the snapshot
        assert torch.equal(model.prefill_last(restore(model, snapshot), tokens[p:]), cold_last), p
        assert torch.equal(model.prefill(restore(model, snapshot), tokens[p:]), cold_rows[p:]), p


@pytest.mark.parametrize("name", ["f32", "audited", "audited-ggml", "reference", "reference-f16"])
def test_a_snapshot_after_decode_steps_restores_the_cold_prefill(models, name):
    model = models[name]
    tokens, state = prompt(model, 20), model.new_state()
    logits = model.prefill_last(state, tokens)
    for _ in range(6):
        tokens.append(int(logits.argmax()))
        logits = model.decode(state, tokens[-1])
    snapshot = take_snapshot(state)
    more = prompt(model, 9, seed=1)
    cold = model.prefill_last(model.new_state(), tokens + more)
    assert snapshot.length == len(tokens)
    assert torch.equal(model.prefill_last(restore(model, snapshot), more), cold)


def test_a_final_snapshot_takes_the_states_tensors_and_restores_the_cold_prefill(models):
    """A state that goes no further (a finished response) is snapshotted without copying its KDA
    tensors (a tensor that is a view of more memory, as a batched step's stack, is copied: the snapshot
    holds its own bytes only), and its latent rows get room for a next turn, which then continues them
    in place, where a full buffer would have been copied at that turn's restore."""
    from k3stream.model.kda import KDAState
    from k3stream.model.mla import MLAState

    model = models["f32"]
    tokens, state = prompt(model, 28), model.new_state()
    logits = model.prefill_last(state, tokens)
    for _ in range(3):
        tokens.append(int(logits.argmax()))
        logits = model.decode(state, tokens[-1])
    kda = [layer for layer in state.layers if isinstance(layer, KDAState)]
    stacked = torch.stack([kda[0].recurrent, kda[0].recurrent])  # as several sequences' step leaves it
    kda[0].recurrent = stacked[1]
    more = prompt(model, 12, seed=1)
    cold = model.prefill_last(model.new_state(), tokens + more)
    full = [layer.buffer.shape[0] for layer in state.layers if isinstance(layer, MLAState)]
    snapshot = take_snapshot(state, final=True)
    taken = [layer for layer in snapshot.layers if isinstance(layer, KDAState)]
    assert taken[0].recurrent.data_ptr() != stacked.data_ptr()
    assert taken[0].recurrent.untyped_storage().nbytes() == taken[0].recurrent.nbytes
    assert [t.conv.data_ptr() for t in taken] == [s.conv.data_ptr() for s in kda]
    assert [t.recurrent.data_ptr() for t in taken[1:]] == [s.recurrent.data_ptr() for s in kda[1:]]
    assert full and all(len(tokens) + len(more) > rows for rows in full)  # no room in the live ones
    restored = restore(model, snapshot, room=len(more))
    latents = [layer for layer in restored.layers if isinstance(layer, MLAState)]
    assert [layer.buffer.data_ptr() for layer in latents] == [r.buffer.data_ptr() for r in snapshot.latents()]
    assert torch.equal(model.prefill_last(restored, more), cold)


def test_snapshots_of_one_sequence_share_its_latent_rows(models):
    model = models["f32"]
    tokens, state = prompt(model), model.new_state()
    model.prefill_last(state, tokens[:10])
    early = take_snapshot(state)
    early_rows = [latent.rows().clone() for latent in early.latents()]
    model.prefill_last(state, tokens[10:14])
    late = take_snapshot(state)
    assert early.latents() and len(early.latents()) == len(late.latents())
    for first, second, saved in zip(early.latents(), late.latents(), early_rows, strict=True):
        assert first.storage_key() == second.storage_key()  # one buffer, two lengths
        assert (first.length, second.length) == (10, 14)
        assert torch.equal(first.rows(), saved)
    restored = restore(model, early)
    model.prefill_last(restored, tokens[20:30])  # a branch from the early snapshot
    for latent, saved in zip(early.latents(), early_rows, strict=True):
        assert torch.equal(latent.rows(), saved)
    row_bytes = sum(4 * latent.buffer.shape[1] for latent in late.latents())
    assert late.nbytes - early.nbytes == 4 * row_bytes  # four more rows a layer, nothing else


def test_a_snapshot_of_another_model_is_refused(models):
    f32, audited = models["f32"], models["audited"]
    state = f32.new_state()
    f32.prefill_last(state, prompt(f32, 4))
    with pytest.raises(ValueError, match="snapshot layer 0 does not fit"):
        restore(audited, take_snapshot(state))


@pytest.mark.parametrize("name", ["f32", "audited-ggml", "streamed"])
def test_snapshots_taken_inside_one_prefill_equal_prefills_that_end_there(models, name):
    model = models[name]
    tokens = prompt(model)
    cold = model.prefill_last(model.new_state(), tokens)
    state = model.new_state()
    model.prefill_last(state, tokens[:3])
    logits, snapshots = prefill_marked(model, state, tokens[3:], [1, 3, 16, 29, PROMPT])
    assert torch.equal(logits, cold)
    assert [snapshot.length for snapshot in snapshots] == [16, 29]
    for snapshot in snapshots:
        resumed = model.prefill_last(restore(model, snapshot), tokens[snapshot.length :])
        assert torch.equal(resumed, cold), snapshot.length
        ended_there = model.new_state()
        model.prefill_last(ended_there, tokens[: snapshot.length])
        for saved, direct in zip(snapshot.layers, take_snapshot(ended_there).layers, strict=True):
            if hasattr(saved, "recurrent"):
                assert torch.equal(saved.recurrent, direct.recurrent) and torch.equal(saved.conv, direct.conv)
            else:
                assert torch.equal(saved.rows(), direct.rows())


@pytest.mark.parametrize("name", ["f32", "audited-ggml", "streamed", "reference", "reference-f16"])
def test_prefills_batched_in_one_pass_give_each_sequence_alone(models, name):
    model = models[name]
    prompts = [prompt(model, length, seed) for length, seed in ((9, 1), (23, 2), (4, 3))]
    alone, states = [], []
    for i, tokens in enumerate(prompts):
        before = prompt(model, 5 * i, seed=10 + i) if i else []  # one starts fresh, two after a history
        state, twin = model.new_state(), model.new_state()
        if before:
            model.prefill_last(state, before)
            model.prefill_last(twin, before)
        alone.append(model.prefill_last(twin, tokens))
        states.append(state)
    batched = model.prefill_batch(states, prompts)
    for i, expected in enumerate(alone):
        assert torch.equal(batched[i], expected), i
    assert [state.length for state in states] == [len(p) + 5 * i for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", ["f32", "audited-ggml", "reference", "reference-f16"])
def test_a_batched_decode_step_gives_each_sequence_its_step_alone(models, name):
    """With the products row-exact (a server's, with a prompt cache or without) a decode step of several
    sequences gives each the logits of its step alone: its answer does not depend on its company."""
    model = models[name]
    histories = [prompt(model, length, seed) for length, seed in ((7, 1), (30, 2), (60, 3))]
    batch, alone = [model.new_state() for _ in histories], [model.new_state() for _ in histories]
    for state, twin, tokens in zip(batch, alone, histories, strict=True):
        model.prefill_last(state, tokens)
        model.prefill_last(twin, tokens)
    stepped = model.decode_batch(batch, [5, 6, 7])
    for row, (twin, token) in enumerate(zip(alone, [5, 6, 7], strict=True)):
        assert torch.equal(stepped[row], model.decode(twin, token)), row
