"""The tiny Kimi-K3 generator: llama.cpp (the oracle) loads and runs what it writes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from conftest import requires_llama
from k3stream import cli
from k3stream.gguf.header import MAX_TENSORS
from k3stream.gguf.vocab import SPECIAL_TOKENS
from k3stream.gguf.writer import check_spec
from k3stream.testing.tiny import TinySpec, make_tiny
from k3stream.testing.tinyvocab import tiny_vocab
from llama_oracle import llama_runs

# shapes that fit the audited recipe's block sizes (K-quants: rows of 256, Q4_0: rows of 32)
AUDITED = dict(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
PROMPT = "Hello, world! The quick brown fox: def f(x): return x * 2  # 日本語 🙂"


@requires_llama
@pytest.mark.parametrize("recipe", ["f32", "f16", "audited"])
def test_llama_cpp_runs_every_recipe_single_and_sharded(tiny_model, recipe):
    fields = AUDITED if recipe == "audited" else {"recipe": recipe}
    (single_tokens, single), (sharded_tokens, sharded) = llama_runs(
        (tiny_model(**fields), PROMPT), (tiny_model(**fields, shards=3), PROMPT)
    )
    assert single.shape == (len(single_tokens), len(tiny_vocab().tokens))
    assert np.isfinite(single).all()
    assert 0.1 < single.std() < 10.0  # the initialisation keeps activations O(1)
    assert single_tokens == sharded_tokens
    np.testing.assert_array_equal(single, sharded)


@requires_llama
def test_f16_recipe_tracks_f32_in_llama_cpp(tiny_model):
    (_, f32), (_, f16) = llama_runs((tiny_model(), PROMPT), (tiny_model(recipe="f16"), PROMPT))
    diff = np.abs(f16 - f32)
    # F16 rounding can flip a top-k expert choice at some positions; most logits still agree closely
    assert np.median(diff) < 0.01 * np.abs(f32).max()
    assert diff[0].max() < 0.02 * np.abs(f32).max()


@requires_llama
def test_variant_shapes_run_in_llama_cpp(tiny_model):
    path = tiny_model(
        n_layers=4, mla_layers=(0, 2), q_lora=None, gate_lower_bound=None, n_shared=0, n_dense=0
    )
    [(_, logits)] = llama_runs((path, PROMPT))
    assert np.isfinite(logits).all()


@requires_llama
def test_llama_cpp_tokenizer_matches_tiktoken_over_the_same_vocab(tiny_model):
    """Two BPE implementations agree: llama.cpp (merges, kimi-k2 pre-tokenizer) and tiktoken (ranks)."""
    import tiktoken

    from k3stream.engine.tokenizer import KIMI_K2_PATTERN, token_text_to_bytes

    vocab = tiny_vocab()
    n_ordinary = len(vocab.tokens) - len(SPECIAL_TOKENS)
    ranks = {token_text_to_bytes(t): i for i, t in enumerate(vocab.tokens[:n_ordinary])}
    encoding = tiktoken.Encoding("tiny", pat_str=KIMI_K2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = PROMPT + "\n\nThe experts of the layer, 12345 values.\tcafé 你好 ÜBER"
    chat = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    (tokens, _), (chat_tokens, _) = llama_runs((tiny_model(), text), (tiny_model(), chat))
    assert tokens == encoding.encode(text)
    assert len(tokens) < len(text.encode()) * 0.7  # the merges compress
    assert chat_tokens[0] == vocab.tokens.index("<|im_user|>")  # special tokens stay whole
    assert chat_tokens[-1] == vocab.eos_id


def test_same_spec_same_bytes_and_seed_changes_them(tmp_path):
    spec = TinySpec(n_layers=4, shards=2)
    first = make_tiny(tmp_path / "a", spec)
    second = make_tiny(tmp_path / "b", spec)
    other = make_tiny(tmp_path / "c", TinySpec(n_layers=4, shards=2, seed=1))
    for name in ("tiny-kimi-k3-00001-of-00002.gguf", "tiny-kimi-k3-00002-of-00002.gguf"):
        assert (first.parent / name).read_bytes() == (second.parent / name).read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert not list((tmp_path / "a").glob("*.tmp"))


def test_recipes_share_values_and_types_follow_the_recipe(tiny_model):
    f32 = {t.name: t for t in GGUFReader(tiny_model()).tensors}
    f16 = {t.name: t for t in GGUFReader(tiny_model(recipe="f16")).tensors}
    assert f16["blk.0.attn_q.weight"].tensor_type.name == "F16"
    assert f16["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    assert f16["blk.0.ssm_conv1d_q.weight"].tensor_type.name == "F32"
    np.testing.assert_array_equal(
        f16["blk.1.ffn_up_exps.weight"].data, f32["blk.1.ffn_up_exps.weight"].data.astype(np.float16)
    )
    audited = {t.name: t.tensor_type.name for t in GGUFReader(tiny_model(**AUDITED)).tensors}
    assert audited["blk.1.ffn_up_exps.weight"] == audited["blk.1.ffn_gate_exps.weight"] == "Q2_K"
    assert audited["blk.1.ffn_down_exps.weight"] == "Q3_K"
    assert audited["blk.3.attn_k_b.weight"] == "Q4_0"
    assert audited["blk.3.attn_v_b.weight"] == "Q2_K"
    assert audited["blk.3.attn_q_b.weight"] == "F32"


def test_metadata_and_tokenizer_keys(tiny_model):
    fields = GGUFReader(tiny_model(shards=2)).fields
    assert fields["general.architecture"].contents() == "kimi-k3"
    assert fields["kimi-k3.attention.head_count_kv"].contents() == [0, 0, 0, 1, 0, 1]
    assert fields["kimi-k3.ssm.conv_kernel"].contents() == 4
    assert fields["kimi-k3.kda.gate_lower_bound"].contents() == -5.0
    assert fields["tokenizer.ggml.pre"].contents() == "kimi-k2"
    assert fields["split.no"].contents() == 0 and fields["split.count"].contents() == 2
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert all(types[tokens.index(t)] == 3 for t in SPECIAL_TOKENS)
    later = GGUFReader(tiny_model(shards=2).with_name("tiny-kimi-k3-00002-of-00002.gguf")).fields
    assert later["general.architecture"].contents() == "kimi-k3" and later["split.no"].contents() == 1
    assert "tokenizer.ggml.tokens" not in later


def test_vocab_padding(tiny_model):
    fields = GGUFReader(tiny_model(vocab=640)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == fields["kimi-k3.vocab_size"].contents() == 640
    assert tokens[-1] == "[PAD639]"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"recipe": "audited"}, "ffn_gate_exps.weight rows of 32 values are not a multiple of 256"),
        ({"kda_heads": 8}, "TinySpec.kda_heads: 8 != TinySpec.mla_heads 4"),
        ({"mla_layers": ()}, "at least one KDA and one MLA layer"),
        ({"mla_layers": (9,)}, "outside 0..5"),
        ({"recipe": "q8"}, "TinySpec.recipe"),
        ({"vocab": 10}, "smaller than the built-in tokenizer"),
        ({"n_layers": 0}, r"TinySpec.n_layers: 0 must be >= 2"),
        ({"seed": -1}, r"TinySpec.seed: -1 must be >= 0"),
        ({"context_length": 1 << 32}, r"kimi-k3.context_length: 4294967296 does not fit the GGUF's uint32"),
        # a context of one token holds no token to generate: `generate` blamed a --ctx 1 nobody gave
        ({"context_length": 1}, r"kimi-k3.context_length must be an integer >= 2, got 1$"),
        ({"n_experts": 1 << 32}, r"kimi-k3.expert_count: 4294967296 does not fit the GGUF's uint32"),
    ],
)
def test_bad_specs_fail_with_one_line(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message) as failure:
        make_tiny(tmp_path, TinySpec(**fields))
    assert "\n" not in str(failure.value)
    assert not list(tmp_path.glob("*.gguf*"))


def test_a_model_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    """The sizes are known before the first byte: a model the disk cannot hold fails at once in one line
    (it wrote until the disk was full, then removed it), and no folder is left behind."""
    import shutil

    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, 1 << 20))
    out = tmp_path / "out"
    assert cli.main(["make-tiny", str(out)]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"not enough free space in {tmp_path}" in error
    assert "1048576 bytes free" in error
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "status", "message"),
    [
        (["--vocab", str(1 << 32)], 2, "kimi-k3.vocab_size: 4294967296 does not fit the GGUF's uint32"),
        (["--vocab", str(10**8), "--hidden", "4096"], 1, "not enough free space in"),
    ],
    ids=["past-uint32", "past-the-disk"],
)
def test_a_huge_vocab_is_refused_at_once(tmp_path, flags, status, message):
    """The sizes are checked before the vocabulary is padded (it built every `[PADi]` token first: a
    huge --vocab ran for minutes, out of memory, before any check)."""
    import resource
    import subprocess
    import sys

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "k3stream", "make-tiny", str(tmp_path / "out"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
    )
    assert done.returncode == status and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith("k3stream make-tiny: error: ") and message in done.stderr
    assert not (tmp_path / "out").exists()


# size flags a user may give 0 or less by mistake; the metadata check would name a GGUF key instead
SIZE_FLAGS = ("--hidden", "--dense-ff", "--kda-head-dim", "--conv-kernel", "--kv-lora", "--v-head-dim")
SIZE_FLAGS += ("--expert-ff", "--latent", "--context-length", "--block-size")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layers", "1"], "--layers: 1 must be >= 2 (a KDA and an MLA layer)"),
        (["--experts", "4", "--top-k", "5"], "--top-k: 5 must be in 1..n_experts (4)"),
        (["--layers", "3", "--dense", "4"], "--dense: 4 must be in 0..n_layers (3)"),
        (["--shards", "0"], "--shards: 0 must be >= 1"),
        (
            ["--kda-heads", "3"],
            "--kda-heads: 3 != --mla-heads 4; Kimi-K3 GGUFs have one attention.head_count for both",
        ),
        (["--experts", "0"], "--experts: 0 must be >= 1"),
        (["--qk-nope", "0"], "--qk-nope: 0 must be >= 1"),
        (["--q-lora", "0"], "--q-lora: 0 must be >= 1"),
        (["--shared", "-1"], "--shared: -1 must be >= 0"),
        (["--qk-rope", "-2"], "--qk-rope: -2 must be >= 0"),
        *[([flag, value], f"{flag}: {value} must be >= 1") for flag in SIZE_FLAGS for value in ("0", "-3")],
        (["--like", "kimi-k3", "--layers", "1"], "--like kimi-k3: --layers 1 must be in 2..93"),
        (["--real-vocab"], "--real-vocab needs --like"),
        (["--like", "kimi-k3", "--real-vocab", "--vocab", "1000"], "--real-vocab and --vocab: give one"),
        (
            ["--like", "kimi-k3", "--experts", "897"],
            "--like kimi-k3: --experts 897 must be in 1..896, the model's routed experts",
        ),
        (
            ["--like", "kimi-k3", "--mla-layers", "0,1"],
            "--mla-layers: llama.cpp needs at least one KDA and one MLA layer",
        ),
        (["--like", "kimi-k3", "--layers", "3", "--mla-layers", "3"], "--mla-layers: (3,) outside 0..2"),
    ],
)
def test_a_spec_error_names_the_flag(tmp_path, capsys, flags, message):
    """make-tiny's users give flags: its refusals name the flag, not the `TinySpec` field behind it."""
    assert cli.main(["make-tiny", str(tmp_path / "out"), *flags]) == 2  # a usage error
    error = capsys.readouterr().err.strip()
    assert error == f"k3stream make-tiny: error: {message}"
    assert not (tmp_path / "out").exists()


def test_an_interrupted_write_leaves_no_file_under_the_final_name(tmp_path):
    """SIGINT removes the temporary file, SIGKILL leaves only it, and the next run replaces it."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    # one 16M-value dense FFN a matrix: seconds of writing, long after the temporary file appears
    command = [
        sys.executable,
        "-m",
        "k3stream",
        "make-tiny",
        str(out),
        "--hidden",
        "2048",
        "--dense-ff",
        "8192",
    ]
    for sig, left in ((signal.SIGINT, []), (signal.SIGKILL, ["tiny-kimi-k3.gguf.tmp"])):
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not list(out.glob("*.tmp")):
            assert child.poll() is None, "make-tiny ended before the signal"
            time.sleep(0.02)
        child.send_signal(sig)
        # after its one line the interpreter may end itself by the signal: a shell shows 130 either way
        assert child.wait(timeout=60) in (
            (130, -signal.SIGINT) if sig == signal.SIGINT else (-signal.SIGKILL,)
        )
        assert sorted(path.name for path in out.iterdir()) == left
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    assert sorted(path.name for path in out.iterdir()) == ["tiny-kimi-k3.gguf"]


def test_more_layers_than_one_file_holds_are_refused_and_shards_hold_them(tmp_path, capsys):
    """A file k3stream's own header check would refuse is never written: the refusal comes at once and
    names --layers; the same layers over more shards pass."""
    out = tmp_path / "out"
    assert cli.main(["make-tiny", str(out), "--layers", "300"]) == 2  # a usage error
    error = capsys.readouterr().err.strip()
    pattern = rf"--layers: 300 layers make (\d+) tensors, \1 a shard; a GGUF holds at most {MAX_TENSORS}"
    assert re.fullmatch(rf"k3stream make-tiny: error: {pattern} \(more shards\)", error), error
    assert not out.exists()
    plan = check_spec(TinySpec(n_layers=300, shards=2), len(tiny_vocab().tokens))
    assert MAX_TENSORS < len(plan) <= 2 * MAX_TENSORS


def test_cli_make_tiny(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["make-tiny", str(out), "--layers", "4", "--mla-layers", "1,3", "--q-lora", "none"]) == 0
    path = capsys.readouterr().out.strip()
    fields = GGUFReader(path).fields
    assert fields["kimi-k3.attention.head_count_kv"].contents() == [0, 1, 0, 1]
    assert "kimi-k3.attention.q_lora_rank" not in fields


@pytest.mark.parametrize("under", ["", "sub/deeper"])
def test_an_out_dir_that_is_or_lies_under_a_file_is_one_line(tmp_path, capsys, under):
    """OUT_DIR naming a file, or a folder below one: one line naming OUT_DIR and the file (it was
    Python's '[Errno 17] File exists' or '[Errno 20] Not a directory'), and the file is kept."""
    taken = tmp_path / "taken"
    taken.write_text("keep")
    out = taken / under if under else taken
    assert cli.main(["make-tiny", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    named = "" if not under else f" {taken}"
    assert err == f"k3stream make-tiny: error: OUT_DIR {out}:{named} is a file, not a folder"
    assert taken.read_text() == "keep"


def test_chat_template_renders_kimi_turns(tiny_model):
    import jinja2

    template = GGUFReader(tiny_model()).fields["tokenizer.chat_template"].contents()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


# shapes whose write takes a second or more: long enough to be stopped midway
LARGE = ["--hidden", "1024", "--experts", "128", "--expert-ff", "512", "--latent", "256", "--layers", "8"]


@pytest.mark.parametrize("command", ["make-tiny", "dequantize"])
def test_sigterm_midway_removes_the_temporary_file(tiny_model, tmp_path, command):
    """`kill` (SIGTERM) cleans up as Ctrl-C does: no `.tmp` left, one line, status 128 + 15."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    if command == "make-tiny":
        argv, temp = [str(out), *LARGE], out / "tiny-kimi-k3.gguf.tmp"
    else:
        fields = dict(n_experts=128, expert_ff=512, latent=256, n_layers=8, hidden=1024, recipe="q8_0")
        argv, temp = [str(tiny_model(**fields)), str(out / "f32.gguf")], out / "f32.gguf.tmp"
    child = subprocess.Popen(
        [sys.executable, "-m", "k3stream", command, *argv], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not temp.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert temp.exists(), "the write ended before it could be stopped"
    child.send_signal(signal.SIGTERM)
    error = child.communicate(timeout=60)[1]
    assert child.returncode == 143 and error == f"k3stream {command}: terminated\n", error[-2000:]
    assert list(out.iterdir()) == []


FLOAT_FLAGS = ("--gate-lower-bound", "--situ-beta", "--situ-linear-beta")


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--rms-eps", "nan", "is not a finite number"),
        ("--rms-eps", "inf", "is not a finite number"),
        ("--rms-eps", "-1", "is not above 0"),
        ("--rms-eps", "0", "is not above 0"),
        *(
            (flag, value, "is not a finite number")
            for flag in FLOAT_FLAGS
            for value in ("nan", "inf", "-inf")
        ),
    ],
)
def test_a_float_field_no_model_can_take_is_the_flags_error(tmp_path, capsys, flag, value, why):
    """make-tiny's float fields go into the GGUF's metadata, which both engines compute with: nan or inf
    in any of them, and an --rms-eps of 0 or below (every norm NaN or a division by 0), are refused
    before anything is written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["make-tiny", str(out), f"{flag}={value}"])
    assert exit_status.value.code == 2 and not out.exists()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"k3stream make-tiny: error: argument {flag}: {value!r} {why}"


@pytest.mark.parametrize(("before", "after"), [("1", "3"), ("3", "2"), ("2", "1")])
def test_force_with_another_shard_count_leaves_exactly_the_new_models_files(tmp_path, capsys, before, after):
    """make-tiny over a model of another `--shards` count is refused naming its file; with --force the
    folder then holds exactly what make-tiny writes into an empty folder, beside the user's own files
    (one named like a shard of another model, one like the model with another suffix), and no pack."""
    from k3stream.pack.builder import BuildOptions, build_pack

    out, fresh = tmp_path / "model", tmp_path / "fresh"
    assert cli.main(["make-tiny", str(out), "--shards", before]) == 0
    old = Path(capsys.readouterr().out.strip())
    build_pack(old, options=BuildOptions(progress=False))
    mine = ["notes.txt", "other-00001-of-00002.gguf", "tiny-kimi-k3.gguf.bak"]
    for name in mine:
        (out / name).write_text("the user's")
    assert cli.main(["make-tiny", str(out), "--shards", after, "--seed", "1"]) == 1
    assert (
        capsys.readouterr().err.strip().endswith(f"refusing to overwrite existing model {old} (use --force)")
    )
    assert cli.main(["make-tiny", str(out), "--shards", after, "--seed", "1", "--force"]) == 0
    assert cli.main(["make-tiny", str(fresh), "--shards", after, "--seed", "1"]) == 0
    written = sorted(path.name for path in fresh.iterdir())
    assert sorted(path.name for path in out.iterdir()) == sorted(written + mine)
    assert all((out / name).read_bytes() == (fresh / name).read_bytes() for name in written)
    assert all((out / name).read_text() == "the user's" for name in mine)


@pytest.mark.parametrize("shards", ["1", "2"])
def test_a_model_made_again_over_its_pack_is_refused_without_force_and_drops_that_pack_with_it(
    tmp_path, capsys, shards
):
    """make-tiny over an existing GGUF is refused in one line naming it, the file kept (it was replaced,
    and the pack beside it then described other weights: every later run stopped at 'shard is missing or
    changed'); with --force the GGUF is replaced and the pack `k3stream pack` made beside it removed, so a
    run reads the new file's experts, and a fresh pack can be made without --force."""
    from k3stream.engine.loading import open_model
    from k3stream.pack.builder import BuildOptions, build_pack

    out = tmp_path / "model"
    assert cli.main(["make-tiny", str(out), "--shards", shards]) == 0
    gguf = Path(capsys.readouterr().out.strip())
    built = build_pack(gguf, options=BuildOptions(progress=False))
    before = gguf.read_bytes()
    assert cli.main(["make-tiny", str(out), "--shards", shards, "--seed", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"k3stream make-tiny: error: refusing to overwrite existing model {gguf} (use --force)"
    assert gguf.read_bytes() == before and built.manifest.is_file()
    assert cli.main(["make-tiny", str(out), "--shards", shards, "--seed", "1", "--force"]) == 0
    assert gguf.read_bytes() != before
    assert sorted(path.name for path in out.iterdir() if ".pack" in path.name) == []
    assert open_model(str(gguf), True)[1] is None  # no pack: the experts come from the new GGUF
    assert build_pack(gguf, options=BuildOptions(progress=False)).manifest == built.manifest
