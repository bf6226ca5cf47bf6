"""A load opens the GGUF once: every shard's header is parsed by one GGUFReader, shared by the pack's
config check, the model and the tokenizer (issue 13: a manifest load used to parse them four times)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import pytest

from k3stream.cli import build_parser
from k3stream.commands.flags import runtime_from_args
from k3stream.engine.loading import load_runtime
from k3stream.pack.builder import build_pack


@pytest.fixture(scope="module")
def split_pack(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    first = tiny_model(shards=3)
    out = tmp_path_factory.mktemp("once")
    return first, build_pack(first, out / "tiny.pack", out / "tiny.manifest.json").manifest


@pytest.fixture
def parsed(monkeypatch) -> Counter:
    """Header parses by file name: the real GGUFReader, counted."""
    counts: Counter = Counter()
    parse = gguf.GGUFReader.__init__

    def counting(self, path, *args, **kwargs):
        counts[Path(path).name] += 1
        parse(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return counts


def load(through: str, first: Path, manifest: Path):
    if through == "command line":  # `k3stream generate`'s load: the memory plan reads the GGUF too
        flags = ["generate", str(manifest), "--memory-limit", "2GiB", "--prompt", "x"]
        return runtime_from_args(build_parser(flags).parse_args(flags))
    return load_runtime(manifest if through == "manifest" else first, stream_experts=through == "manifest")


@pytest.mark.parametrize("through", ["manifest", "gguf", "command line"])
def test_a_load_parses_each_shard_header_once(split_pack, parsed, through):
    first, manifest = split_pack
    shards = sorted(path.name for path in first.parent.glob("*.gguf"))
    assert len(shards) == 3
    runtime = load(through, first, manifest)
    try:
        assert runtime.tokenizer.encode_plain("def f():") and runtime.model.config.n_layers
        assert (runtime.store is not None) == (through != "gguf")
    finally:
        runtime.close()
    assert dict(parsed) == dict.fromkeys(shards, 1)
