"""`k3stream perplexity`: llama-perplexity's numbers on tiny models, its KL-divergence base files."""

from __future__ import annotations

import io
import math
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import k3stream
from conftest import requires_llama
from k3stream.cli import main
from k3stream.engine.perplexity import (
    BaseFile,
    BaseWriter,
    Perplexity,
    chunk_logits,
    dequantize_log_probs,
    file_text,
    plan_chunks,
    quantize_log_probs,
    text_tokens,
    token_nll,
)
from k3stream.gguf.reader import K3Checkpoint
from llama_logits import llama_logits
from pack_helpers import file_size_limit
from test_model import f32_rewrite

TEXT = Path(textwrap.__file__)  # any text the tiny vocabulary tokenizes: a stdlib source file
CTX, CHUNKS = 64, 3
AUDITED = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)  # shapes the audited recipe accepts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _plan(tokenizer, ctx: int = CTX, chunks: int = CHUNKS):
    return plan_chunks(text_tokens(tokenizer, TEXT.read_text()), ctx, chunks)


def _our_ppl(model, plan, batch: int) -> float:
    ppl = Perplexity()
    for index in range(plan.n_chunk):
        ppl.add(token_nll(chunk_logits(model, plan.chunk(index), plan.first, batch), plan.targets(index)))
    return ppl.ppl


def _reference_ppl(chunk_logits_list: list[np.ndarray], plan) -> float:
    """llama-perplexity's scoring written out on full-chunk logits: positions ctx/2 .. ctx-2."""
    nll = []
    for index, logits in enumerate(chunk_logits_list):
        rows = logits[plan.first : plan.ctx - 1].astype(np.float64)
        top = rows.max(axis=1, keepdims=True)
        log_sum = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
        targets = plan.tokens[index * plan.ctx + plan.first + 1 : (index + 1) * plan.ctx]
        nll.append(log_sum - rows[np.arange(len(targets)), targets])
    return math.exp(np.concatenate(nll).mean())


@requires_llama
def test_perplexity_equals_llama_cpp(model_path, tokenizer, tmp_path):
    plan = _plan(tokenizer)
    jobs = [(model_path, plan.chunk(i)) for i in range(plan.n_chunk)]
    reference = _reference_ppl(llama_logits(jobs, tmp_path), plan)
    model = k3stream.load(model_path)
    ours = _our_ppl(model, plan, batch=plan.ctx)
    print(f"PPL ours {ours:.6f}, llama.cpp {reference:.6f}, relative difference {ours / reference - 1:.2e}")
    assert abs(ours / reference - 1) <= 0.005, (ours, reference)
    assert _our_ppl(model, plan, batch=24) == pytest.approx(ours, rel=1e-6)  # batches of any size


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["perplexity", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _value(label: str, out: str) -> float:
    return float(re.search(rf"^{re.escape(label)}\s*:\s*(-?[0-9.]+)", out, re.MULTILINE).group(1))


def test_cli_prints_llama_perplexity_output(model_path, tokenizer, capsys):
    code, out, _ = _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    assert code == 0
    running = re.findall(r"\[(\d+)\]([0-9.]+),", out)
    assert [int(i) for i, _ in running] == [1, 2, 3]
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    expected = _our_ppl(k3stream.load(model_path), _plan(tokenizer), batch=CTX)
    assert float(final.group(1)) == pytest.approx(expected, rel=1e-4)
    assert float(running[-1][1]) == pytest.approx(expected, rel=1e-4)
    assert float(final.group(2)) > 0


def test_the_text_may_come_through_a_pipe(model_path, capsys, tmp_path, monkeypatch):
    """`--file <(...)` and `--file /dev/stdin` are pipes, which llama-perplexity reads as files, and
    `--file -` reads stdin, as generate's: the same output as the file itself; a folder or a missing file
    is one line."""
    import threading

    read_end, write_end = os.pipe()

    def feed() -> None:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(TEXT.read_bytes())

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        piped = _run(capsys, model_path, "--file", f"/dev/fd/{read_end}", "--ctx", CTX, "--chunks", CHUNKS)
    finally:
        feeder.join()
        os.close(read_end)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TEXT.read_bytes())))
    dash = _run(capsys, model_path, "--file", "-", "--ctx", CTX, "--chunks", CHUNKS)
    whole = _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    assert piped[0] == dash[0] == whole[0] == 0 and piped[1] == dash[1] == whole[1]
    for path, message in ((tmp_path, "is a folder"), (tmp_path / "none.txt", "no such file")):
        code, _, err = _run(capsys, model_path, "--file", path, "--ctx", CTX)
        assert code == 1 and err == f"k3stream perplexity: error: --file: {message}: {path}\n"


def test_negative_chunks_mean_every_chunk_as_in_llama_perplexity(model_path, capsys, tmp_path):
    """llama-perplexity's `--chunks` defaults to -1: every chunk, as giving no `--chunks`."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:4000])
    runs = [_run(capsys, model_path, "--file", text, "--ctx", CTX, *more) for more in ((), ("--chunks=-1",))]
    assert [code for code, _, _ in runs] == [0, 0]
    finals = [re.search(r"Final estimate: PPL = .*", out).group(0) for _, out, _ in runs]
    assert finals[0] == finals[1]


def test_streamed_experts_give_the_same_perplexity(model_path, capsys, tmp_path):
    """The model loads through the engine's runtime: experts stream from a pack under --ram-mib."""
    from k3stream.pack.builder import BuildOptions, build_pack

    manifest = build_pack(
        model_path, tmp_path / "m.pack", tmp_path / "m.manifest.json", BuildOptions(progress=False)
    ).manifest
    args = ("--file", TEXT, "--ctx", CTX, "--chunks", 2)
    mapped = _run(capsys, model_path, *args)[1]
    code, streamed, _ = _run(capsys, manifest, *args, "--ram-mib", 1)
    assert code == 0 and streamed == mapped


def test_uncertainty_is_llama_cpp_formula():
    nll = np.array([1.0, 2.0, 4.0, 3.0])
    ppl = Perplexity()
    ppl.add(nll[:2])
    ppl.add(nll[2:])
    mean = nll.mean()
    expected = math.exp(mean) * math.sqrt(((nll**2).mean() - mean**2) / (len(nll) - 1))
    assert ppl.ppl == pytest.approx(math.exp(mean))
    assert ppl.uncertainty() == pytest.approx(expected)


def test_chunking_follows_llama_perplexity():
    plan = plan_chunks(list(range(1000)), 100, bos_id=7)
    assert (plan.n_chunk, plan.first, plan.scored) == (10, 50, 49)
    assert plan.chunk(2)[:2] == [7, 201]  # BOS replaces each chunk's first token
    assert plan.targets(2).tolist() == list(range(251, 300))
    assert plan_chunks(list(range(1000)), 100, chunks=3).n_chunk == 3
    with pytest.raises(ValueError, match="only 150 tokens; a context of 100 needs at least 200"):
        plan_chunks(list(range(150)), 100)


@pytest.mark.parametrize("ctx", [3, 100_000])
def test_a_context_out_of_range_names_perplexitys_own_bounds(model_path, capsys, ctx):
    """A chunk needs 4 tokens and fits the model's context: the refusal says both (it said 'between 2
    and ...', the serving floor, at a context too long)."""
    code, _, err = _run(capsys, model_path, "--file", TEXT, "--ctx", ctx)
    context = K3Checkpoint.open(model_path).config.context_length
    assert code == 1
    bounds = f"between 4 and the model's context length {context}"
    assert err == f"k3stream perplexity: error: --ctx {ctx} must be {bounds}\n"


@requires_llama
def test_a_model_of_a_short_context_is_scored_in_chunks_of_its_context_by_default(
    tiny_model, tokenizer, capsys, tmp_path
):
    """Without --ctx a chunk is 512 tokens or the model's context where that is shorter, as llama.cpp
    scores it (a 40-token model was refused for a '--ctx 512' nobody gave); a context shorter than a
    chunk's 4 tokens is refused naming the model's context, not a flag."""
    path = tiny_model(context_length=40)
    code, out, err = _run(capsys, path, "--file", TEXT, "--chunks", 2)
    assert code == 0, err
    plan = _plan(tokenizer, ctx=40, chunks=2)
    jobs = [(path, plan.chunk(i)) for i in range(plan.n_chunk)]
    reference = _reference_ppl(llama_logits(jobs, tmp_path), plan)
    final = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))
    assert final == pytest.approx(reference, rel=5e-3)
    code, _, err = _run(capsys, tiny_model(context_length=3), "--file", TEXT)
    assert (code, err) == (
        1,
        "k3stream perplexity: error: the model's context length 3 holds no perplexity chunk (4 tokens)\n",
    )


def test_base_log_probs_round_trip():
    logits = torch.randn(5, 300) * 4
    codes, scale, min_log_prob = quantize_log_probs(logits)
    exact = torch.log_softmax(logits.double(), dim=-1).numpy()
    restored = dequantize_log_probs(codes, scale, min_log_prob)
    kept = exact > exact.max(axis=1, keepdims=True) - 16
    assert np.abs(restored - exact)[kept].max() <= scale.max() * 0.51 + 1e-5
    assert codes.dtype == np.uint16


def test_base_writer_is_atomic(model_path, tokenizer, tmp_path):
    plan = _plan(tokenizer)
    target = tmp_path / "base.npz"
    writer = BaseWriter(target, plan, 10)
    writer.add(torch.zeros(plan.scored, 10))
    with pytest.raises(ValueError, match="rows written"):
        writer.close()  # 1 of 3 chunks
    assert list(tmp_path.iterdir()) == []


def _write_base(target: Path, plan) -> None:
    writer = BaseWriter(target, plan, 10)
    for index in range(plan.n_chunk):
        writer.add(torch.full((plan.scored, 10), float(index)))
    writer.close()


@pytest.mark.parametrize("share", [0, 0.5])  # room for none of it (the metadata fails), for half of it
def test_a_base_that_meets_a_full_disk_leaves_nothing_and_names_its_file(
    tokenizer, tmp_path, monkeypatch, share
):
    """A full disk while the base is written leaves no partial file, no open zip whose collection
    prints a traceback, and an error naming the base file."""
    import gc

    plan = _plan(tokenizer)
    _write_base(tmp_path / "whole.npz", plan)
    room = int((tmp_path / "whole.npz").stat().st_size * share)
    (tmp_path / "whole.npz").unlink()
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    target = tmp_path / "base.npz"
    with pytest.raises(OSError) as failed, file_size_limit(room):
        _write_base(target, plan)
    gc.collect()
    assert failed.value.filename == str(target) and list(tmp_path.iterdir()) == []
    assert unraisable == []


def _kld_run(capsys, model, base, *extra) -> str:
    code, out, err = _run(capsys, model, "--kl-divergence", "--kl-divergence-base", base, *extra)
    assert code == 0, err
    return out


def test_kld_of_a_model_against_its_own_base(model_path, capsys, tmp_path):
    base = tmp_path / "base.npz"
    args = ("--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    assert _run(capsys, model_path, *args, "--kl-divergence-base", base)[0] == 0
    saved = BaseFile.open(base)
    assert (saved.ctx, len(saved.tokens), len(saved.scale)) == (CTX, CHUNKS * CTX, CHUNKS * (CTX // 2 - 1))
    saved.close()
    out = _kld_run(capsys, model_path, base, "--batch", 20)  # tokens and ctx come from the base
    assert abs(_value("Mean    KLD", out)) < 1e-4
    assert _value("Maximum KLD", out) < 1e-4
    assert _value("Same top p", out) == 100.0
    assert _value("Mean PPL(Q)/PPL(base)", out) == pytest.approx(1.0, abs=1e-4)
    for label in ("99.0%   KLD", "Median  KLD", "RMS Δp", "Cor(ln(PPL(Q)), ln(PPL(base)))"):
        assert label in out


def test_audited_recipe_against_f32(tiny_model, tmp_path, capsys):
    """The audited file quantizes the F32 recipe's values (same spec and seed): its KLD is the recipe's
    cost. Its F32 rewrite runs the same numbers as the audited file with float32 activations: KLD ~0
    (the default's 8-bit activations are a cost of their own)."""
    from k3stream.commands.dequantize import dequantize_gguf

    audited, f32 = tiny_model(recipe="audited", **AUDITED), tiny_model(recipe="f32", **AUDITED)
    rewrite = dequantize_gguf(audited, tmp_path / "rewrite.gguf", floats_to_f32=True)
    args = ("--file", TEXT, "--ctx", CTX, "--chunks", 2)
    for model, base in ((f32, "f32.npz"), (rewrite, "rewrite.npz")):
        assert _run(capsys, model, *args, "--kl-divergence-base", tmp_path / base)[0] == 0
    recipe_cost = _value("Mean    KLD", _kld_run(capsys, audited, tmp_path / "f32.npz"))
    assert recipe_cost > 0.01
    same_numbers = _kld_run(capsys, audited, tmp_path / "rewrite.npz", "--float-activations")
    assert abs(_value("Mean    KLD", same_numbers)) < 1e-4


def test_the_base_is_never_written_over_the_model_or_the_text(model_path, capsys, tmp_path):
    """--kl-divergence-base FILE names what this run writes: FILE being the model's GGUF (by its name or
    a link) or the evaluated text is refused in one line, and both stay as they were."""
    import shutil

    model, text = tmp_path / "model.gguf", tmp_path / "text.txt"
    shutil.copy(model_path, model)
    (tmp_path / "link.gguf").symlink_to(model)
    text.write_text(TEXT.read_text())
    before = (model.read_bytes(), text.read_bytes())
    for target in (model, tmp_path / "link.gguf", text):
        code, _, err = _run(
            capsys, model, "--file", text, "--ctx", CTX, "--chunks", 2, "--kl-divergence-base", target
        )
        assert code == 1 and len(err.strip().splitlines()) == 1 and "is the source file" in err
    assert (model.read_bytes(), text.read_bytes()) == before


def test_a_base_that_names_a_folder_is_refused_before_the_run(model_path, capsys, tmp_path):
    """--kl-divergence-base naming a folder (one there, which failed at the rename after the whole run,
    or `dir/` that does not exist yet, which was written as the file `dir`): one line, no chunk computed,
    nothing written."""
    (tmp_path / "folder").mkdir()
    for target in (tmp_path / "folder", f"{tmp_path}/later/"):
        code, out, err = _run(
            capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", 2, "--kl-divergence-base", target
        )
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert err.strip().endswith("names a folder; give the file to write") and "[1]" not in out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["folder"]


def test_a_base_in_a_folder_not_made_yet_is_written_there(model_path, capsys, tmp_path):
    """--kl-divergence-base new/sub/base.npz: the folders are made, as `pack --out` and `dequantize`
    make theirs (the run stopped on `[Errno 2]` naming its temporary file), and the base reads back."""
    base = tmp_path / "new" / "sub" / "base.npz"
    args = ("--file", TEXT, "--ctx", CTX, "--chunks", 2)
    code, _, err = _run(capsys, model_path, *args, "--kl-divergence-base", base)
    assert code == 0, err
    assert abs(_value("Mean    KLD", _kld_run(capsys, model_path, base))) < 1e-4
    assert [path.name for path in base.parent.iterdir()] == ["base.npz"]


@pytest.mark.parametrize("batch", [0, -1])
def test_a_batch_below_one_is_refused_before_the_model_loads(model_path, capsys, monkeypatch, batch):
    """--batch 0 ran as the whole chunk while -1 was refused (after the model had loaded)."""
    from k3stream.commands import flags

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(flags, "load_resolved", no_load)
    code, out, err = _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--batch", batch)
    assert (code, out, err) == (2, "", f"k3stream perplexity: error: --batch {batch}: must be at least 1\n")


def test_mismatched_base_is_one_line_error(model_path, capsys, tmp_path):
    base = tmp_path / "base.npz"
    assert (
        _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", 2, "--kl-divergence-base", base)[0]
        == 0
    )
    other = Path(re.__file__)
    cases = {
        ("--ctx", 32, "--file", TEXT): "saved with ctx 64, this run uses --ctx 32",
        ("--file", other): "tokens differ",
        ("--file", TEXT, "--chunks", 3): "holds 2 chunks, this run evaluates 3",
    }
    for extra, message in cases.items():
        code, out, err = _run(capsys, model_path, "--kl-divergence", "--kl-divergence-base", base, *extra)
        lines = err.strip().splitlines()
        assert code == 1 and message in lines[-1] and str(base) in lines[-1], err
        assert lines[-1].startswith("k3stream perplexity: error:") and out == ""
    for path, message in (
        (model_path, "not a k3stream KL-divergence base file"),
        (tmp_path / "no.npz", "no such"),
    ):
        code, _, err = _run(capsys, model_path, "--kl-divergence", "--kl-divergence-base", path)
        assert code == 1 and message in err.strip().splitlines()[-1]


def _llama_base_file(path: Path, plan, chunk_logits_list: list[np.ndarray]) -> Path:
    """`path` written as llama-perplexity writes its KL-divergence base (tools/perplexity: `_logits_`,
    uint32 n_ctx, int32 n_vocab and n_chunk, the int32 tokens, then per scored row float32 scale and
    min_log_prob and a uint16 code per vocabulary entry, padded to an even count), from full-chunk logits."""
    n_vocab = chunk_logits_list[0].shape[1]
    rows = np.concatenate([logits[plan.first : plan.ctx - 1] for logits in chunk_logits_list]).astype(
        np.float32
    )
    top, low = rows.max(axis=1), np.maximum(rows.min(axis=1), rows.max(axis=1) - 16)
    log_sum = np.log(np.exp((rows - top[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    scale = ((top - low) / np.float32(65535)).astype(np.float32)
    codes = np.where(rows > low[:, None], np.rint((rows - low[:, None]) * (1 / scale)[:, None]), 0)
    table = np.zeros((len(rows), 2 * ((n_vocab + 1) // 2) + 4), dtype="<u2")
    table[:, :4] = np.stack([scale, low - top - log_sum], axis=1).astype("<f4").view("<u2")
    table[:, 4 : 4 + n_vocab] = codes
    header = b"_logits_" + np.array([plan.ctx, n_vocab, plan.n_chunk], dtype="<i4").tobytes()
    path.write_bytes(header + plan.tokens.astype("<i4").tobytes() + table.tobytes())
    return path


@requires_llama
def test_a_base_file_llama_perplexity_wrote_is_read(model_path, tokenizer, tmp_path, capsys):
    """A llama.cpp user's base (llama-perplexity --kl-divergence-base, here from llama.cpp's own logits of
    the F32 tiny model, whose odd vocabulary pads each row): its tokens, ctx and rows are read, and the same
    model against it scores llama.cpp's PPL as the base's and a KLD of about 0."""
    plan = _plan(tokenizer)
    base_logits = llama_logits([(model_path, plan.chunk(i)) for i in range(plan.n_chunk)], tmp_path)
    assert base_logits[0].shape[1] % 2  # a padded row
    base = _llama_base_file(tmp_path / "llama.kld", plan, base_logits)
    out = _kld_run(capsys, model_path, base, "--float-activations")  # no --file: the base's tokens
    assert _value("Mean PPL(base)", out) == pytest.approx(_reference_ppl(base_logits, plan), rel=1e-3)
    assert abs(_value("Mean    KLD", out)) < 1e-3
    assert _value("Same top p", out) == 100.0
    base.write_bytes(base.read_bytes()[:-2])
    code, _, err = _run(capsys, model_path, "--kl-divergence", "--kl-divergence-base", base)
    assert code == 1 and f"{base}: llama-perplexity base file of" in err.strip().splitlines()[-1]


def _reference_kld(logits: list[np.ndarray], base_logits: list[np.ndarray], plan) -> float:
    """llama-perplexity's mean KL(base || model) written out on full-chunk logits, in float64."""
    rows = slice(plan.first, plan.ctx - 1)
    log_q = np.concatenate([_log_softmax(chunk[rows]) for chunk in logits])
    log_p = np.concatenate([_log_softmax(chunk[rows]) for chunk in base_logits])
    return float((np.exp(log_p) * (log_p - log_q)).sum(axis=1).mean())


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def _run_in(capsys, arithmetic: str, *argv) -> str:
    """`k3stream perplexity ARGV` with the arithmetic set whatever the flags' default: "float" (float32
    activations) or "ggml" (`--match-ggml`'s); its output."""
    from k3stream.cli import build_parser
    from k3stream.commands import perplexity

    command = ["perplexity", *map(str, argv)]
    args = build_parser(command).parse_args(command)
    args.match_ggml = arithmetic == "ggml"
    args.float_activations = arithmetic == "float"
    assert perplexity.run(args) == 0
    return capsys.readouterr().out


# ggml's arithmetic on a quantized file: llama.cpp's own, up to summation order; on the 6-layer tiny
# models a last-bit difference can round an activation to another 8-bit code or, rarely, route a token
# to another expert, so logits differ by about 1e-2 (the K-quants' audited recipe as much as the rest)
GGML_PPL_TOLERANCE = 0.03


@requires_llama
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["iq2_xxs", "iq1_s", "ternary", "iq4_xs", "dynamic", "audited"])
def test_recipe_perplexity_and_kld_equal_llama_cpp(tiny_model, tokenizer, tmp_path, capsys, recipe):
    """`perplexity` on an i-quant, ternary or dynamic file. Float arithmetic computes the file's
    dequantized weights: llama.cpp's PPL of the F32 rewrite within 0.5%, and the KLD against a base
    saved from the F32 model of the same shapes equals llama.cpp's KLD between those two files within
    0.5%. ggml's arithmetic: llama.cpp's PPL of the quantized file itself (GGML_PPL_TOLERANCE)."""
    path, f32 = tiny_model(recipe=recipe, **AUDITED), tiny_model(recipe="f32", **AUDITED)
    rewrite = f32_rewrite(path, tmp_path)
    plan = _plan(tokenizer)
    chunks = [plan.chunk(i) for i in range(plan.n_chunk)]
    logits = llama_logits([(model, chunk) for model in (path, rewrite, f32) for chunk in chunks], tmp_path)
    n = len(chunks)
    direct, dequantized, base_logits = logits[:n], logits[n : 2 * n], logits[2 * n :]
    args = ("--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    final = r"Final estimate: PPL = ([0-9.]+)"
    ours = float(re.search(final, _run_in(capsys, "float", path, *args)).group(1))
    assert abs(ours / _reference_ppl(dequantized, plan) - 1) <= 0.005
    ggml = float(re.search(final, _run_in(capsys, "ggml", path, *args)).group(1))
    assert abs(ggml / _reference_ppl(direct, plan) - 1) <= GGML_PPL_TOLERANCE
    base = tmp_path / "base.npz"
    _run_in(capsys, "float", f32, *args, "--kl-divergence-base", base)
    kld_out = _run_in(capsys, "float", path, "--kl-divergence", "--kl-divergence-base", base)
    kld = _value("Mean    KLD", kld_out)
    reference_kld = _reference_kld(dequantized, base_logits, plan)
    assert reference_kld > 0.01
    assert kld == pytest.approx(reference_kld, rel=0.005)


def test_the_memory_plan_holds_a_chunk_of_the_default_context(model_path, capsys):
    """Without `--ctx` perplexity evaluates chunks of 512 tokens, each in one forward: its memory plan
    holds the state and activations of one such chunk (it planned a 256-row prefill)."""
    code, _out, err = _run(capsys, model_path, "--file", TEXT, "--chunks", 1, "--memory-limit", "4GiB")
    assert code == 0
    plan = next(line for line in err.splitlines() if line.startswith("memory limit"))
    assert "KV/state for 512 tokens" in plan and "(a prefill of 512 rows)" in plan, plan


@requires_llama
def test_the_file_is_read_as_llama_perplexity_reads_it(model_path, tokenizer, capsys, tmp_path):
    """Its bytes as they are (CRLF and CR stay: they were read as line breaks, other tokens than
    llama.cpp's), one line break at the end dropped as llama's `-f` drops it, and each byte that begins
    no UTF-8 sequence one U+FFFD (a cut character `\\xe4\\xb8` was one U+FFFD, llama.cpp's two)."""
    import llama_cpp

    data = TEXT.read_bytes()[:3000].replace(b"\n", b"\r\n") + b"\rcut \xe4\xb8 \xf0\x9f\x99! caf\xe9\n"
    text = tmp_path / "windows.txt"
    text.write_bytes(data)
    llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    expected = llama.tokenize(data[:-1], add_bos=tokenizer.add_bos, special=False)
    llama.close()
    assert text_tokens(tokenizer, file_text(data)) == expected
    code, _, err = _run(capsys, model_path, "--file", text, "--ctx", 16, "--chunks", 1)
    assert code == 0 and f"perplexity: {text}: {len(expected)} tokens;" in err


def test_ctx_zero_is_the_models_context_as_in_llama_perplexity(tiny_model, capsys):
    """llama-perplexity's `-c 0`: chunks of the context the model file gives, as `generate` and `serve`
    take `-c 0` (not the default 512)."""
    path = tiny_model(context_length=256)
    code, _out, err = _run(capsys, path, "--file", TEXT, "-c", 0, "--chunks", 1)
    assert code == 0, err
    assert f"chunks of n_ctx={K3Checkpoint.open(path).config.context_length}," in err


def test_ctrl_c_ends_the_running_perplexity_line(model_path, monkeypatch, capsys):
    """Ctrl-C between chunks: status 130, and the `[i]ppl,` line so far ends on stdout, so the
    `interrupted` line and the shell's prompt start their own."""

    class CtrlCOnFirstChunk(io.StringIO):
        def write(self, text: str) -> int:
            written = super().write(text)
            if self.getvalue() == text:
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the first chunk prints
            return written

    stdout = CtrlCOnFirstChunk()
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        code, _, err = _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert code == 130 and err.splitlines()[-1] == "k3stream perplexity: interrupted"
    assert re.fullmatch(r"\[1\][0-9.]+,\n", stdout.getvalue())


def test_ctrl_c_before_the_first_chunk_prints_nothing_on_stdout(model_path, monkeypatch, capsys):
    """Ctrl-C while the first chunk runs: stdout stays empty (no empty line), as generate's before its
    first text; the interruption is the one line on stderr, status 130."""
    import k3stream.engine.perplexity

    logits_of_chunk = k3stream.engine.perplexity.chunk_logits

    def ctrl_c_as_it_starts(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C as the first chunk goes in
        return logits_of_chunk(*args, **kwargs)

    monkeypatch.setattr(k3stream.engine.perplexity, "chunk_logits", ctrl_c_as_it_starts)
    try:
        code, out, err = _run(capsys, model_path, "--file", TEXT, "--ctx", CTX, "--chunks", CHUNKS)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert (code, out) == (130, "") and err.splitlines()[-1] == "k3stream perplexity: interrupted"
