"""A Kimi-K3 checkpoint: tensor inventory across shards, config, zero-copy views of tensor bytes."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from k3stream.gguf import layout
from k3stream.gguf.config import K3Config, field_value
from k3stream.gguf.profile import get_profile
from k3stream.gguf.shards import open_shard_files, open_shards
from k3stream.gguf.tensors import TensorInfo
from k3stream.gguf.uncached import read_uncached
from k3stream.quant.kernels import cpu

_TYPED_VIEWS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16,  # numpy has no bfloat16: the raw bits
}


def _inventory(shards: list[tuple[Path, GGUFReader]]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for index, (path, reader) in enumerate(shards):
        for t in reader.tensors:
            tensors[t.name] = TensorInfo(
                name=t.name,
                shape=tuple(int(n) for n in reversed(t.shape)),
                ggml_type=int(t.tensor_type),
                shard_index=index,
                path=path,
                data_offset=int(t.data_offset),
                nbytes=int(t.n_bytes),
            )
    return tensors


def check_tensors(config: K3Config, tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Every tensor the config implies is present with its shape, and nothing else is: `tensors` with
    GGML's trailing dimensions of 1 dropped (every later reader, `--tp` slicing included, then sees the
    canonical `(out, in)`)."""
    expected = layout.expected_shapes(config, present=tensors)
    for layer in config.moe_layers if config.n_shared else ():
        layout.check_shared_experts(layer, tensors, config.source)
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            if layout.is_optional(name):
                continue
            raise ValueError(f"{config.source}: missing tensor {name} (expected shape {shape})")
        if layout.is_residual_score(name):
            layout.check_residual_score(info.shape)  # sglang's message before the generic one
        if info.shape not in layout.accepted_shapes(name, shape):
            raise ValueError(f"{info.path}: tensor {name} has shape {info.shape}, the config implies {shape}")
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        info = tensors[unexpected[0]]
        raise ValueError(f"{info.path}: unexpected tensor {info.name} for this Kimi-K3 config")
    return {
        name: replace(info, shape=layout.canonical_shape(info.shape, expected[name]))
        for name, info in tensors.items()
    }


class K3Checkpoint:
    """Open with `K3Checkpoint.open(path)`; holds read-only memory maps, never whole-file reads."""

    def __init__(self, shards: list[tuple[Path, GGUFReader]], profile: Any):
        self._readers = [reader for _path, reader in shards]
        self.shards = [path for path, _reader in shards]
        self.config = K3Config.from_metadata(self._readers[0].fields, source=str(self.shards[0]))
        self.tensors = check_tensors(self.config, _inventory(shards))
        self.profile = profile
        self._descriptors: dict[int, int] = {}
        # `read` drops what it read from the page cache (a load under a memory limit, which that cache
        # would be charged to); expert reads (`read_parts`) keep theirs
        self.uncached_reads = False

    @classmethod
    def open(cls, path: str | Path | list[Path], profile: str = "generic") -> K3Checkpoint:
        """Open a single GGUF, any shard of a split set, a directory, or the list of a set's shard files
        in order; `profile` is checked."""
        shards = open_shard_files(path) if isinstance(path, list) else open_shards(path)
        checkpoint = cls(shards, get_profile(profile))
        checkpoint.profile.check(checkpoint)
        return checkpoint

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self._readers[0].fields.get(key)
        return default if field is None else field_value(field, str(self.shards[0]))

    @property
    def fields(self) -> dict[str, Any]:
        """Shard 1's metadata as `gguf.ReaderField`s (the file's own GGUF.* header fields included)."""
        return self._readers[0].fields

    def info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.shards[0]}: no tensor {name}")
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the shard's memory map (no copy)."""
        info = self.info(name)
        mapped = self._readers[info.shard_index].data
        return mapped[info.data_offset : info.data_offset + info.nbytes]

    def read(self, name: str, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A fresh copy of the tensor's bytes `start..start + nbytes` (default: all) in anonymous
        memory, read from the file, not through the map: its pages never join this process's RSS, and
        a file that shrinks later raises a clear error here instead of a SIGBUS in a mapped read."""
        nbytes = self.info(name).nbytes - start if nbytes is None else nbytes
        if not self.uncached_reads:
            return self.read_parts([(name, start, nbytes)])
        info = self.info(name)
        _check_range(info, name, start, nbytes)
        out = np.empty(nbytes, dtype=np.uint8)
        if read_uncached(self._descriptor(info.shard_index), info.data_offset + start, out) < nbytes:
            raise ValueError(f"{info.path}: tensor {name} is cut short (the file shrank?)")
        return out

    def read_parts(self, parts: Sequence[tuple[str, int, int]]) -> np.ndarray:
        """The bytes `start..start + nbytes` of each `(tensor name, start, nbytes)`, one after another in
        one fresh buffer, each read as `read` reads (a decode step's experts: one allocation, and with
        the C extension one call for all their reads)."""
        descriptors, offsets, lengths = [], [], []
        tensors: dict[str, tuple[TensorInfo, int]] = {}  # each name's info and descriptor, looked up once
        for name, start, nbytes in parts:
            if name not in tensors:
                info = self.info(name)
                tensors[name] = info, self._descriptor(info.shard_index)
            info, descriptor = tensors[name]
            _check_range(info, name, start, nbytes)
            descriptors.append(descriptor)
            offsets.append(info.data_offset + start)
            lengths.append(nbytes)
        out = np.empty(sum(lengths), dtype=np.uint8)
        # fault a fresh buffer's pages in from here first: inside the read they fault one small page at a
        # time, several times slower (a 128-expert model's 270 MB of experts: 0.57 s, against 0.05-0.23 s)
        out[::4096] = 0
        read = cpu.read_parts if cpu.available() else _read_parts
        whole = read(descriptors, offsets, lengths, out)
        if whole < len(parts):
            name = parts[whole][0]
            raise ValueError(f"{self.info(name).path}: tensor {name} is cut short (the file shrank?)")
        return out

    def _descriptor(self, shard: int) -> int:
        """A read-only descriptor of one shard, opened on first use and closed with the checkpoint."""
        if shard not in self._descriptors:
            descriptor = os.open(self.shards[shard], os.O_RDONLY | os.O_CLOEXEC)
            self._descriptors[shard] = descriptor
            weakref.finalize(self, os.close, descriptor)
        return self._descriptors[shard]

    def array(self, name: str) -> np.ndarray:
        """A typed view of an F32/F16 tensor (BF16: its raw uint16 bits), in numpy shape."""
        info = self.info(name)
        dtype = _TYPED_VIEWS.get(GGMLQuantizationType(info.ggml_type))
        if dtype is None:
            raise ValueError(f"{info.path}: tensor {name} is {info.type_name}, not F32/F16/BF16")
        return self.raw(name).view(dtype).reshape(info.shape)

    def expert_slice(self, name: str, expert: int) -> np.ndarray:
        """The bytes of one routed expert of `blk.N.ffn_{gate,up,down}_exps.weight` (a view)."""
        info = self.info(name)
        n_experts = self.config.n_experts
        if not layout.is_routed_expert(name):
            raise ValueError(f"{info.path}: tensor {name} is not a routed expert tensor")
        if not 0 <= expert < n_experts:
            raise IndexError(f"{info.path}: expert {expert} outside 0..{n_experts - 1} for tensor {name}")
        per_expert = info.nbytes // n_experts
        return self.raw(name)[expert * per_expert : (expert + 1) * per_expert]


def _check_range(info: TensorInfo, name: str, start: int, nbytes: int) -> None:
    if start < 0 or nbytes < 0 or start + nbytes > info.nbytes:
        raise ValueError(f"{info.path}: bytes {start}..{start + nbytes} outside tensor {name}")


def _read_parts(descriptors: list[int], offsets: list[int], lengths: list[int], out: np.ndarray) -> int:
    """`cpu.read_parts` in Python (an install without the C extension): how many parts were read whole."""
    view, at = memoryview(out), 0
    for whole, (descriptor, offset, nbytes) in enumerate(zip(descriptors, offsets, lengths, strict=True)):
        done = 0
        while done < nbytes:
            got = os.preadv(descriptor, [view[at + done : at + nbytes]], offset + done)
            if got == 0:
                return whole
            done += got
        at += nbytes
    return len(lengths)
