"""Where `k3stream pack` puts a pack and its manifest by default: what the builder writes and the engine
looks for beside a GGUF."""

from __future__ import annotations

from pathlib import Path

from k3stream.gguf.shards import set_name


def default_outputs(shards: list[Path]) -> tuple[Path, Path]:
    """`NAME.expert-major.pack` and its `.manifest.json` next to the shards."""
    first = shards[0].resolve()
    pack = first.parent / f"{set_name(first)}.expert-major.pack"
    return pack, manifest_path_for(pack)


def manifest_path_for(pack: Path) -> Path:
    return pack.with_name(pack.name + ".manifest.json")
