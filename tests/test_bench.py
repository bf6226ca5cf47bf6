"""`k3stream bench` on a tiny model: phases, per-tier hit rates, pack reads, sequential read, llama.cpp."""

from __future__ import annotations

import os
import re
import sys

import pytest

from bench_helpers import MIB, bench_json, pack_expert_bytes, packed_tiny, run_cli
from conftest import requires_llama
from k3stream.commands.bench import LLAMA_MISSING

SPEC = dict(n_layers=6, n_dense=1, n_experts=16, top_k=4, seed=11)
MOE_LAYERS = SPEC["n_layers"] - SPEC["n_dense"]
TOKENS = ("--prompt-tokens", "12", "--decode-tokens", "6")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return packed_tiny(tmp_path_factory.mktemp("bench"), **SPEC)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.4f}"


def test_bench_streams_experts_when_the_budget_is_below_the_pack(model):
    gguf_path, manifest = model
    budget = pack_expert_bytes(manifest) // 3
    results = bench_json(gguf_path, "--ram-mib", _mib(budget), *TOKENS)

    prefill, decode = results["k3stream"]["phases"]
    assert (prefill["phase"], prefill["tokens"]) == ("prefill", 12)
    assert (decode["phase"], decode["tokens"]) == ("decode", 6)
    for phase in (prefill, decode):
        assert phase["tokens_per_s"] > 0
        assert list(phase["tiers"]) == ["ram"]
        assert 0.0 <= phase["tiers"]["ram"]["hit_rate"] <= 1.0
    # each decode token looks up top_k distinct experts in every MoE layer
    ram = decode["tiers"]["ram"]
    assert ram["hits"] + ram["misses"] == 6 * MOE_LAYERS * SPEC["top_k"]
    assert decode["pack_reads"] > 0
    assert decode["bytes_per_token"] == decode["pack_read_bytes"] / 6 > 0
    assert decode["read_gb_per_s"] > 0
    # the stall (fetches waiting) next to the time reads took, per token
    assert decode["read_ms_per_token"] > 0 and decode["fetch_wait_ms_per_token"] >= 0
    sequential = results["sequential_read"]
    assert sequential["bytes"] == os.path.getsize(results["pack"]["path"])
    assert sequential["gb_per_s"] > 0
    assert results["k3stream"]["expert_bytes"]["budget"]["ram"] <= budget


def test_bench_reads_nothing_after_warmup_when_the_budget_holds_every_expert(model):
    gguf_path, manifest = model
    everything = pack_expert_bytes(manifest)
    results = bench_json(gguf_path, "--ram-mib", _mib(everything + MIB), *TOKENS)

    prefill, decode = results["k3stream"]["phases"]
    # the warmup ran the same prompt: every fetch hits, and only hints read (a layer's hint reads more
    # of its prediction once its hints were right, `HintScores.allowance`)
    assert prefill["tiers"]["ram"]["hit_rate"] == 1.0
    assert prefill["pack_reads"] == prefill["prefetch"]["loads"]
    store = results["k3stream"]["store"]
    assert store["tiers"]["ram"]["cache_evictions"] == 0
    assert store["pack_reads"] <= MOE_LAYERS * SPEC["n_experts"]  # every expert read at most once


def test_bench_warms_up_with_the_timed_tokens_and_says_what_the_timed_phases_read(model):
    """The warm-up runs the prompt and the tokens the timed decode decodes: with every expert in the
    budget the timed decode's fetches all hit, and the report says what each timed phase read."""
    gguf_path, manifest = model
    flags = ("--ram-mib", _mib(pack_expert_bytes(manifest) + MIB), *TOKENS)
    decode = bench_json(gguf_path, *flags)["k3stream"]["phases"][-1]
    assert decode["tiers"]["ram"]["hit_rate"] == 1.0
    status, out, err = run_cli("bench", str(gguf_path), *flags)
    assert status == 0, err
    warmup = next(line for line in out.splitlines() if line.startswith("warm-up: k3stream ran"))
    assert re.search(
        r"the timed phases read from the pack: prefill \d+ \([\d.]+ KiB a token\), decode", warmup
    )


def test_bench_without_a_pack_reports_speed_only(model):
    gguf_path, _manifest = model
    results = bench_json(gguf_path, "--no-stream-experts", *TOKENS)
    assert "pack" not in results and "sequential_read" not in results
    assert [phase["phase"] for phase in results["k3stream"]["phases"]] == ["prefill", "decode"]
    assert all("tiers" not in phase for phase in results["k3stream"]["phases"])


@requires_llama
def test_bench_text_report_with_llama_cpp(model):
    gguf_path, manifest = model
    budget = pack_expert_bytes(manifest) // 2
    status, out, err = run_cli("bench", str(gguf_path), "--ram-mib", _mib(budget), "--llama", *TOKENS)
    assert status == 0, err
    lines = out.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("phase")))
    assert lines[table].split()[:4] == ["phase", "tokens", "tok/s", "ram"]
    assert [line.split()[0] for line in lines[table + 1 : table + 3]] == ["prefill", "decode"]
    assert any(line.startswith("sequential read of the pack:") for line in lines)
    llama = next(line for line in lines if line.startswith("llama.cpp (mmap, 1 threads)"))
    speeds = re.search(
        r"prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s; k3stream decode speed is ([\d.]+)x", llama
    )
    assert speeds is not None, llama
    assert all(float(value) > 0 for value in speeds.groups())
    assert any(line.startswith("warm-up: k3stream and llama.cpp each ran the prompt") for line in lines)
    steps = re.search(r"median decode step ([\d.]+) ms, llama.cpp's ([\d.]+) ms \(([\d.]+)x\)", llama)
    assert steps is not None and all(float(value) > 0 for value in steps.groups()), llama


@requires_llama
def test_bench_llama_takes_the_model_as_every_command_does(tmp_path):
    """llama.cpp gets the first shard whatever the model names: the folder, a later shard."""
    gguf_path, _manifest = packed_tiny(tmp_path, **SPEC, shards=2)
    later = next(path for path in tmp_path.glob("*.gguf") if path != gguf_path)
    for model in (tmp_path, later):
        status, out, err = run_cli("bench", str(model), "--no-stream-experts", "--llama", *TOKENS)
        assert status == 0, err
        assert any(line.startswith("llama.cpp (mmap, 1 threads)") for line in out.splitlines())


def test_bench_llama_without_llama_cpp_keeps_its_own_figures(model, monkeypatch):
    gguf_path, _manifest = model
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed, as on a fresh machine
    status, out, err = run_cli("bench", str(gguf_path), "--no-stream-experts", "--llama", *TOKENS)
    assert status == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if line.startswith(("prefill ", "decode "))] == [
        "prefill",
        "decode",
    ]
    assert lines[-1] == LLAMA_MISSING and "pip install llama-cpp-python==0.3.36" in lines[-1]


def test_bench_rejects_bad_token_counts(model):
    gguf_path, _manifest = model
    status, _out, err = run_cli("bench", str(gguf_path), "--prompt-tokens", "0")
    assert status == 2  # a usage error
    assert err.strip() == (
        "k3stream bench: error: --prompt-tokens must be >= 1 and --decode-tokens >= 0, got 0 and 32"
    )
    status, _out, err = run_cli("bench", str(gguf_path), "--seq-read-mib", "0")  # a ZeroDivisionError
    assert (status, err.strip()) == (2, "k3stream bench: error: --seq-read-mib must be above 0, got 0.0")
    status, _out, err = run_cli("bench", str(gguf_path), "--ctx", "32", *TOKENS[:2], "--decode-tokens", "30")
    assert status == 1 and err.strip() == (
        "k3stream bench: error: --prompt-tokens 12 and --decode-tokens 30 pass the context of 32 tokens "
        "(--ctx)"
    )


def test_bench_plans_memory_for_the_sequence_it_measures(model):
    """Without `--ctx` the memory plan holds the measured sequence, its prompt prefilled in one forward
    (it held a 256-row prefill whatever `--prompt-tokens` asked, and state for 4,096 tokens)."""
    gguf_path, manifest = model
    counts = ("--prompt-tokens", "300", "--decode-tokens", "4")
    status, _out, err = run_cli(
        "bench", str(manifest), "--memory-limit", "4GiB", *counts, "--seq-read-mib", "1"
    )
    assert status == 0, err
    plan = next(line for line in err.splitlines() if line.startswith("memory limit"))
    assert "KV/state for 304 tokens" in plan and "(a prefill of 304 rows)" in plan, plan


@pytest.mark.parametrize(
    ("flags", "path"),
    [((), "program"), (("--no-prefetch",), "program"), (("--prefetch-hint", "layer-ahead"), "eager")],
)
def test_bench_times_the_decode_step_generate_runs(model, flags, path):
    """The decode program where the flags give `generate` and `serve` one (a layer-ahead hint is sent
    from inside a layer: eager), and only the hints that step predicts are scored."""
    gguf_path, manifest = model
    budget = pack_expert_bytes(manifest) // 3
    results = bench_json(gguf_path, "--ram-mib", _mib(budget), *TOKENS, *flags)
    decode = results["k3stream"]["phases"][-1]
    assert decode["path"] == path
    predicted = {kind for kind, hint in decode["hints"].items() if hint["predicted"]}
    if "--no-prefetch" in flags:
        assert predicted == set()
    elif path == "program":  # token hints; pre-attention ones only to fill their gaps
        assert "token" in predicted and "layer-ahead" not in predicted
    else:
        assert predicted == {"layer-ahead", "sent"}
