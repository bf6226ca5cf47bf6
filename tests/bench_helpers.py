"""Helpers for the bench, demo and memory tests: a tiny model with its pack, and `k3stream` run in-process."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

MIB = 1 << 20


def packed_tiny(directory: Path, **spec_fields: Any) -> tuple[Path, Path]:
    """A tiny Kimi-K3 GGUF in `directory` with its expert pack beside it: `(gguf, manifest)`."""
    from k3stream.pack.builder import BuildOptions, build_pack
    from k3stream.testing.tiny import TinySpec, make_tiny

    gguf_path = make_tiny(directory, TinySpec(**spec_fields))
    result = build_pack(gguf_path, options=BuildOptions(progress=False, margin_bytes=0))
    return gguf_path, result.manifest


def pack_expert_bytes(manifest: Path) -> int:
    """Bytes of all expert objects of the pack (what a budget must hold to keep every expert)."""
    from k3stream.pack.reader import ExpertPack

    with ExpertPack(manifest) as pack:
        return len(pack.moe_layers) * pack.num_experts * pack.object_bytes


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`k3stream ARGV` in this process with one torch thread (restored after): (status, stdout, stderr)."""
    import torch

    from k3stream.cli import main

    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main([*argv, "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue(), err.getvalue()


def bench_json(model: Path, *options: str) -> dict[str, Any]:
    status, out, err = run_cli("bench", str(model), "--json", *options)
    assert status == 0, err
    return json.loads(out)
