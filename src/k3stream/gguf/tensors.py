"""The types a checkpoint's tensors are described by: `TensorInfo` (where one lies, in which type) and
`TensorInventory`, what a profile checks of an open checkpoint (`reader.K3Checkpoint` has it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gguf import GGMLQuantizationType

from k3stream.gguf.config import K3Config


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, (out, in) for matrices
    ggml_type: int
    shard_index: int  # 0-based
    path: Path
    data_offset: int  # absolute in the shard file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


class TensorInventory(Protocol):
    shards: list[Path]
    config: K3Config
    tensors: Mapping[str, TensorInfo]
