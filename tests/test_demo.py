"""`k3stream demo` in a subprocess on a fresh cache: copies the shipped trained model, packs it, streams its
experts while continuing a Python prompt; a second run reuses the cache; `--random` makes a random one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from bench_helpers import MIB
from k3stream.commands.demo import DEFAULT_PROMPT, model_folder
from k3stream.gguf import vocab

AUDITED_TYPES = {
    "ffn_up_exps.weight": "Q2_K",
    "ffn_gate_exps.weight": "Q2_K",
    "ffn_down_exps.weight": "Q3_K",
    "attn_k_b.weight": "Q4_0",
    "attn_v_b.weight": "Q2_K",
}


def demo(home: Path, *options: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "XDG_CACHE_HOME"}
    env["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "k3stream.cli", "demo", "--max-tokens", "6", "--threads", "1", *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def field(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label))


def completion(out: str) -> str:
    """The generated text: between the blank line after the prompt line and the blank line before stats."""
    after_prompt = out.split(field(out, "prompt  "), 1)[1]
    return after_prompt.split("\n\nspeed ", 1)[0].strip("\n")


def _cache_numbers(out: str) -> tuple[int, int, float, float]:
    cache = re.search(r"cache   ram: (\d+) hits, (\d+) misses, .*holds ([\d.]+) MiB of its ([\d.]+) MiB", out)
    assert cache is not None, out
    hits, misses, held, budget = cache.groups()
    return int(hits), int(misses), float(held), float(budget)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return home, demo(home)


def test_demo_makes_packs_and_streams_on_a_fresh_machine(first_run):
    home, done = first_run
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "(trained on the Python standard library) (copied in" in field(out, "model ")
    assert "(packed in" in field(out, "pack ")
    (folder,) = (home / ".cache" / "k3stream" / "demo").iterdir()  # the default cache folder
    (pack,) = folder.glob("*.pack")
    budget_mib = float(re.search(r"expert RAM ([\d.]+) MiB", field(out, "budget ")).group(1))
    assert budget_mib * MIB < pack.stat().st_size  # experts must stream

    assert completion(out)
    hits, misses, held, budget = _cache_numbers(out)
    assert misses > 0 and hits + misses > 0
    assert held <= budget == budget_mib
    reads = re.search(r"reads   (\d+) experts read from the pack .*: ([\d.]+) KiB per token", out)
    assert reads is not None and int(reads.group(1)) > 0 and float(reads.group(2)) > 0
    assert re.search(r"prefill \d+ tokens at [\d.]+ tok/s, decode 6 tokens at [\d.]+ tok/s", out)


def test_demo_model_follows_the_audited_recipe(first_run):
    home, _done = first_run
    (gguf_path,) = (home / ".cache" / "k3stream" / "demo").glob("*/*.gguf")
    reader = GGUFReader(str(gguf_path))
    seen = set()
    for tensor in reader.tensors:
        suffix = next((s for s in AUDITED_TYPES if tensor.name.endswith(s)), None)
        if suffix is not None:
            assert tensor.tensor_type.name == AUDITED_TYPES[suffix], tensor.name
            seen.add(suffix)
    assert seen == set(AUDITED_TYPES)


def test_demo_reuses_its_cache(first_run):
    home, first = first_run
    assert first.returncode == 0, first.stderr
    cache = home / ".cache" / "k3stream" / "demo"
    files = {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file()}
    again = demo(home, "--cache-dir", str(cache), "--prompt", "Hello!", "--policy", "arc", "--no-prefetch")
    assert again.returncode == 0, again.stderr
    assert "(cached)" in field(again.stdout, "model ") and "(cached)" in field(again.stdout, "pack ")
    assert completion(again.stdout)
    assert "(0 read ahead, 0 of them used)" in field(again.stdout, "reads ")
    assert {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file()} == files


def test_demo_refuses_a_budget_below_one_working_set(first_run):
    home, _first = first_run
    done = demo(home, "--ram-mib", "0.1")
    assert done.returncode == 1
    assert re.match(
        r"k3stream demo: error: expert store ram budget [\d.]+ MiB is below one top-k working set",
        done.stderr,
    ), done.stderr


def test_demo_continues_the_python_prompt_with_the_trained_model(first_run):
    _home, done = first_run
    assert done.returncode == 0, done.stderr
    assert field(done.stdout, "prompt  ").startswith(f"prompt  {DEFAULT_PROMPT!r}")
    assert "chat template" not in field(done.stdout, "prompt  ")
    assert completion(done.stdout).startswith(DEFAULT_PROMPT)  # the prompt, then its continuation


def test_demo_random_makes_a_random_model_and_chats(tmp_path):
    done = demo(tmp_path, "--random")
    assert done.returncode == 0, done.stderr
    assert "(random weights) (made in" in field(done.stdout, "model ")
    assert "with the chat template" in field(done.stdout, "prompt  ")
    assert completion(done.stdout)


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_help_needs_no_model(command):
    done = subprocess.run(
        [sys.executable, "-m", "k3stream.cli", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "--ram-mib" in done.stdout and "--no-prefetch" in done.stdout and "--policy" in done.stdout


def test_a_changed_chat_template_makes_a_new_random_model_folder(tmp_path, monkeypatch):
    """The random demo's file carries `CHAT_TEMPLATE`: a cached file with another template is not reused."""
    before = model_folder(tmp_path, trained=False)
    monkeypatch.setattr(vocab, "CHAT_TEMPLATE", vocab.CHAT_TEMPLATE + "{# another #}")
    assert model_folder(tmp_path, trained=False) != before
