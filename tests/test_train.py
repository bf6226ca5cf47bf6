"""`k3stream train-tiny`: the inference model trains (loss falls, every weight gets a gradient), the
router bias follows the load, and the written GGUF runs the same in k3stream and in llama.cpp."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import k3stream
from conftest import requires_llama
from k3stream import LoadOptions
from k3stream.commands.train import write_gguf
from k3stream.engine.tokenizer import Tokenizer
from k3stream.gguf.layout import is_routed_expert
from k3stream.gguf.writer import TinySpec
from k3stream.store.simulate import hit_rate_table
from k3stream.store.traces import read_trace
from k3stream.train.corpus import HELD_OUT_EVERY, read_texts, split_corpus
from k3stream.train.trainer import (
    BIAS_SUFFIX,
    Parameters,
    TrainOptions,
    build_model,
    sequence_nll,
    train,
    update_biases,
)
from k3stream.train.vocab import learn_vocab, vocab_tokenizer
from llama_logits import llama_logits, relative_error
from llama_oracle import llama_runs

# every part of the architecture, as small as it goes: KDA layers 0-2, MLA layer 3, dense layer 0
SMALL = TinySpec(
    n_layers=4,
    mla_layers=(3,),
    hidden=32,
    dense_ff=64,
    kda_heads=2,
    kda_head_dim=16,
    mla_heads=2,
    q_lora=16,
    kv_lora=32,
    qk_nope=16,
    v_head_dim=16,
    n_experts=4,
    top_k=2,
    expert_ff=32,
    latent=32,
)
SHIPPED = Path(k3stream.__file__).parent / "data"
TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "k3-stdlib-heldout.trace.jsonl.gz"
SNIPPET = "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(name, os.sep)\n    return 0\n"


@pytest.fixture(scope="module")
def corpus():
    return split_corpus()


@pytest.fixture(scope="module")
def vocab(corpus):
    return learn_vocab(read_texts(corpus.root, corpus.train, 200_000), 512)


@pytest.fixture(scope="module")
def tokens(corpus, vocab):
    tokenizer = vocab_tokenizer(vocab)
    return np.asarray(tokenizer.encode_plain("".join(read_texts(corpus.root, corpus.train, 100_000))))


@pytest.fixture(scope="module")
def trained(vocab, tokens, one_torch_thread):
    params = Parameters(SMALL, len(vocab.tokens))
    options = TrainOptions(steps=30, minutes=2.0, seq_len=32, batch=2, lr=1e-2, warmup=3)
    log = train(params, tokens, options)
    return params, log


def test_corpus_split_is_by_file_deterministic_and_disjoint(corpus):
    again = split_corpus()
    assert again == corpus
    assert not set(corpus.train) & set(corpus.held_out)
    assert all(path.split("/")[0] not in ("test", "site-packages") for path in corpus.train)
    share = len(corpus.held_out) / (len(corpus.train) + len(corpus.held_out))
    assert 0.5 / HELD_OUT_EVERY < share < 2.0 / HELD_OUT_EVERY


def test_vocabulary_is_byte_level_bpe_with_merges_and_round_trips(vocab):
    tokenizer = vocab_tokenizer(vocab)
    ids = tokenizer.encode_plain(SNIPPET)
    assert tokenizer.decode(ids) == SNIPPET
    assert len(ids) < 0.6 * len(SNIPPET.encode())  # learned merges, not bytes
    assert len(vocab.tokens) == 512 and vocab.tokens[vocab.eos_id] == "<|im_end|>"


def test_training_lowers_the_loss(trained):
    _params, log = trained
    assert log.steps == 30
    first, last = np.mean(log.losses[:5]), np.mean(log.losses[-5:])
    assert last < first - 0.3, (first, last)


def test_every_weight_of_the_inference_model_gets_a_gradient(vocab, tokens, one_torch_thread):
    params = Parameters(SMALL, len(vocab.tokens))
    loss = sequence_nll(build_model(params), torch.from_numpy(tokens[:65].astype(np.int64)))
    loss.backward()
    untouched = set()
    for name, value in params.values.items():
        if value.grad is None:
            untouched.add(name)
        elif is_routed_expert(name):
            used = value.grad.flatten(1).abs().sum(1) > 0
            assert used.sum() >= SMALL.top_k, name  # the chosen experts learn
        else:
            assert value.grad.abs().sum() > 0, name
    # the router biases move by the load, never by the loss; layer 0 mixes its attention input before
    # anything is banked, so its attention-residual score is never used
    biases = {name for name in params.values if name.endswith(BIAS_SUFFIX)}
    assert untouched == biases | {"blk.0.attn_res_score.weight"}


def test_router_bias_moves_against_the_load(vocab):
    params = Parameters(SMALL, len(vocab.tokens))
    before = params.bias(1).clone()
    update_biases(params, {1: torch.tensor([5, 1, 3, 3])}, 0.25)
    assert torch.equal(params.bias(1) - before, torch.tensor([-0.25, 0.25, 0.0, 0.0]))


def test_written_gguf_is_the_trained_model(trained, vocab, tmp_path, one_torch_thread):
    params, _log = trained
    path = write_gguf(tmp_path, SMALL, "f32", vocab, params.gguf_arrays())
    ids = vocab_tokenizer(vocab).encode_plain(SNIPPET)
    with torch.inference_mode():
        expected = build_model(params).logits(ids)
    loaded = k3stream.load(path).logits(ids)
    assert relative_error(loaded.numpy(), expected.numpy()) < 1e-5
    assert Tokenizer.from_gguf(path).encode_plain(SNIPPET) == ids


@requires_llama
def test_llama_cpp_runs_the_trained_gguf(trained, vocab, tmp_path, one_torch_thread):
    params, _log = trained
    path = write_gguf(tmp_path, SMALL, "f32", vocab, params.gguf_arrays())
    ids = vocab_tokenizer(vocab).encode_plain(SNIPPET)
    (theirs,) = llama_logits([(path, ids)], tmp_path)
    assert relative_error(k3stream.load(path).logits(ids).numpy(), theirs) <= 1e-3
    ((llama_ids, _),) = llama_runs((path, SNIPPET))
    assert llama_ids == ids  # llama.cpp reads the stored vocabulary as we do


def test_a_shape_the_audited_recipe_cannot_quantize_fails_before_training(tmp_path):
    import argparse

    from k3stream.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "out"), "--latent", "64", "--recipes", "f32,audited"])
    with pytest.raises(ValueError, match=r"recipe audited: blk\.1\.ffn_gate_exps\.weight rows of 64 values"):
        train_command.run(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch", "0"], "--batch must be at least 1, got 0"),  # a ZeroDivisionError traceback
        (["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--lr", "nan"], "--warmup must be >= 0, --lr and --minutes above 0, got 10, nan and"),
    ],
)
def test_training_flags_are_refused_by_name_before_anything_runs(tmp_path, flags, message):
    import argparse

    from k3stream.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        train_command.run(parser.parse_args([str(tmp_path / "out"), *flags]))
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_is_a_file_is_refused_before_training(tmp_path):
    """OUT_DIR naming a file: one line before the corpus is read (it trained for the whole --minutes,
    then failed at mkdir with '[Errno 17] File exists'), and the file is left as it was."""
    import argparse

    from k3stream.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    taken = tmp_path / "taken"
    taken.write_text("keep")
    args = parser.parse_args([str(taken), "--steps", "1", "--text-mib", "0.05", "--recipes", "f32"])
    with pytest.raises(
        NotADirectoryError, match=f"^OUT_DIR {re.escape(str(taken))}: is a file, not a folder$"
    ):
        train_command.run(args)
    assert taken.read_text() == "keep"


def test_too_little_free_space_for_every_recipe_is_refused_before_training(tmp_path, monkeypatch):
    """Room for one recipe's GGUF but not for all of them: one line before the corpus is read (the files
    were written one by one after the training, and a full disk failed the last)."""
    import argparse
    import errno
    import shutil

    from k3stream.commands import train as train_command
    from k3stream.gguf.writer import tensor_data_nbytes

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args([str(out), "--steps", "1", "--text-mib", "0.05", "--recipes", "f32,audited"])
    spec = train_command.spec_from_args(args)
    sizes = [
        tensor_data_nbytes(dataclasses.replace(spec, recipe=r), args.vocab_size) for r in ("f32", "audited")
    ]
    free = sum(sizes) - 1
    assert free >= max(sizes)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    monkeypatch.setattr("k3stream.train.corpus.split_corpus", pytest.fail)  # no training starts
    with pytest.raises(OSError, match=f"^.*not enough free space in {re.escape(str(tmp_path))} ") as failure:
        train_command.run(args)
    assert failure.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_outputs_are_written_leaves_no_file_and_no_folder(tmp_path):
    """The disk fills while the second GGUF is written: no GGUF, train.json or held-out.txt is left, nor the
    folder the command made (an empty OUT_DIR was left), and the error names the file."""
    import argparse
    import errno

    from k3stream.commands import train as train_command
    from pack_helpers import file_size_limit

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    out = tmp_path / "new" / "out"
    args = parser.parse_args([str(out), "--steps", "1", "--text-mib", "0.05", "--recipes", "audited,f32"])
    audited = tensor_data_nbytes_of(train_command.spec_from_args(args), "audited", args.vocab_size)
    with file_size_limit(2 * audited), pytest.raises(OSError) as failure:
        train_command.run(args)
    assert failure.value.errno == errno.EFBIG and failure.value.filename == str(out / "k3-stdlib-f32.gguf")
    assert list(tmp_path.iterdir()) == []


def tensor_data_nbytes_of(spec: TinySpec, recipe: str, vocab_size: int) -> int:
    from k3stream.gguf.writer import tensor_data_nbytes

    return tensor_data_nbytes(dataclasses.replace(spec, recipe=recipe), vocab_size)


def test_shape_flags_reach_the_spec():
    import argparse

    from k3stream.commands import train as train_command

    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    args = parser.parse_args(["out", "--experts", "8", "--hidden", "48", "--seed", "3"])
    spec = train_command.spec_from_args(args)
    assert (spec.n_experts, spec.hidden, spec.seed, spec.latent) == (8, 48, 3, 256)
    assert dataclasses.replace(spec, recipe="audited").recipe == "audited"


def test_shipped_model_is_small_recorded_and_predicts_held_out_python(corpus, one_torch_thread):
    record = json.loads((SHIPPED / "k3-stdlib.json").read_text())
    path = SHIPPED / record["files"]["audited"]
    assert path.stat().st_size <= 25 * 2**20
    assert record["command"].startswith("k3stream train-tiny ") and record["seed"] is not None
    held_out_text = read_texts(corpus.root, corpus.held_out, 8000)
    ids = Tokenizer.from_gguf(path).encode_plain("".join(held_out_text))[:257]
    logits = k3stream.load(path).logits(ids[:-1])
    nll = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))
    # far better than a uniform guess over the vocabulary: the model learned the held-out language
    assert nll < math.log(record["vocab_size"]) - 2.0, nll


def test_committed_trace_is_the_shipped_models_routing_and_belady_bounds_every_policy():
    record = json.loads((SHIPPED / "k3-stdlib.json").read_text())
    trace = read_trace(TRACE)
    spec = record["spec"]
    assert trace.meta["num_experts"] == spec["n_experts"] and trace.meta["top_k"] == spec["top_k"]
    assert len(trace.meta["moe_layers"]) == spec["n_layers"] - spec["n_dense"]
    assert trace.tokens > 0 and all(len(experts) == spec["top_k"] for _layer, experts in trace.steps)
    experts = len(trace.meta["moe_layers"]) * spec["n_experts"]
    sizes = [fraction * experts * trace.meta["object_bytes"] / 2**20 for fraction in (0.25, 0.5)]
    policies = ["lfu-lru", "lru", "arc", "cycle"]
    for row in hit_rate_table(trace.steps, trace.meta["object_bytes"], sizes, policies):
        assert all(row[name] <= row["belady"] for name in policies), row


@requires_llama
def test_greedy_held_out_continuation_equals_llama_cpp_for_64_tokens(corpus, tmp_path, one_torch_thread):
    """The shipped model's exact values in F32 (`dequantize --all-f32`): real, trained activations."""
    from k3stream.commands.dequantize import dequantize_gguf

    record = json.loads((SHIPPED / "k3-stdlib.json").read_text())
    path = dequantize_gguf(SHIPPED / record["files"]["audited"], tmp_path / "shipped-f32.gguf", True)
    text = read_texts(corpus.root, corpus.held_out, 4000)[0]
    prompt = Tokenizer.from_gguf(path).encode_plain(text)[:48]
    model = k3stream.load(path)
    state = model.new_state()
    logits, continuation = model.prefill(state, prompt)[-1], []
    for _ in range(64):
        continuation.append(int(logits.argmax()))
        logits = model.decode(state, continuation[-1])
    (theirs,) = llama_logits([(path, prompt + continuation)], tmp_path)
    # llama.cpp's greedy choice at every position of the same text: its own continuation, token for token
    assert theirs[len(prompt) - 1 : -1].argmax(-1).tolist() == continuation


@requires_llama
def test_llama_cpp_runs_the_shipped_audited_gguf_as_k3stream_does(corpus, tmp_path, one_torch_thread):
    """On the quantized file itself, with activations rounded to 8 bits as llama.cpp's CPU backend does
    (the default)."""
    record = json.loads((SHIPPED / "k3-stdlib.json").read_text())
    path = SHIPPED / record["files"]["audited"]
    ids = Tokenizer.from_gguf(path).encode_plain(read_texts(corpus.root, corpus.held_out, 4000)[0])[:96]
    (theirs,) = llama_logits([(path, ids)], tmp_path)
    ours = k3stream.load(path, LoadOptions(profile="audited")).logits(ids).numpy()
    assert relative_error(ours, theirs) <= 1e-3
