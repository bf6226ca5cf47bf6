"""Fingerprints that key the prompt cache's snapshots: of a model's GGUF shards (`model_fingerprint`) and
of how a loaded model computes (`computation_key`: k3stream's own code, the arithmetic options, the
kernels' instruction set), so a snapshot is never reused by another model file, build or arithmetic;
and of a tokenizer (`tokenizer_digest`), under which a saved conversation's token ids keep their text."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from k3stream.model.k3 import K3Model


@functools.cache
def code_fingerprint() -> str:
    """xxh3_64 (hex) of k3stream's own code: every Python file and compiled kernel library of the
    package (another build computes other bits, or may)."""
    package = Path(__file__).resolve().parents[1]
    digest = xxhash.xxh3_64()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".so") and p.is_file()):
        digest.update(f"{path.relative_to(package)}:".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def computation_key(model: K3Model) -> str:
    """How `model` computes, beside its file: k3stream's code, the load options' arithmetic and the
    integer kernels' instruction set (xxh3_64 hex)."""
    from k3stream.quant.kernels import cpu

    isa = cpu.isa() if cpu.available() else "none"
    return xxhash.xxh3_64(f"{code_fingerprint()}|{model.arithmetic}|{isa}".encode()).hexdigest()


def model_fingerprint(shards: list[Path], times: bool = True) -> str:
    """xxh3_64 (hex) of a model's GGUF shards: their sizes, modification times and sampled windows of
    their bytes. The windows leave most of a large shard unread, so a shard rewritten in place with
    bytes changed between them (its size kept) differs by its modification time; a renamed shard keeps
    its fingerprint, a copy made without its time is a miss. `times=False`: sizes and windows only (the
    same model copied to another machine)."""
    from k3stream.pack.integrity import shard_fingerprint

    digest = xxhash.xxh3_64()
    for path in shards:
        stat = os.stat(path)
        windows = shard_fingerprint(Path(path), 0, stat.st_size)
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns if times else ''}:{windows};".encode())
    return digest.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 (hex) of every token's bytes, in id order: a saved conversation's ids mean the same text
    to a tokenizer with this digest."""
    digest = hashlib.sha256()
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.piece(token_id)
        digest.update(len(piece).to_bytes(4, "little") + piece)
    return digest.hexdigest()
