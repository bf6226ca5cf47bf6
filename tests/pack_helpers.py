"""Helpers shared by the expert-pack tests: private copies of tiny models, GGUF oracles, file snapshots."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from k3stream.gguf.shards import SHARD_NAME

TEST_CACHE = Path(os.environ.get("K3STREAM_TEST_CACHE", "~/.cache/k3stream-test")).expanduser()
# what the tests put in TEST_CACHE: tiny models (and their scratch folders), sglang's downloaded files,
# hypothesis's examples (tests/conftest.py)
TEST_CACHE_ENTRIES = ("tiny-*", ".tiny-*", "sglang-*", "hypothesis")
# what decides a tiny model's bytes besides its spec
GENERATOR_SOURCES = (
    "testing/tiny.py",
    "testing/tinyvocab.py",
    "gguf/writer.py",
    "gguf/vocab.py",
    "testing/iquant_blocks.py",
    "gguf/mixed_recipes.py",
    "gguf/layout.py",
    "gguf/config.py",
    "quant/encode.py",
)


def model_files(first_shard: Path) -> list[Path]:
    """Every file of the model whose first shard (or single file) is `first_shard`."""
    match = SHARD_NAME.match(first_shard.name)
    if match is None:
        return [first_shard]
    return sorted(first_shard.parent.glob(f"{match['stem']}-*-of-*.gguf"))


def copy_model(first_shard: Path, directory: Path) -> Path:
    """Copy a (cached, shared) tiny model into `directory`, so a test may build next to it or change it."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in model_files(first_shard):
        shutil.copyfile(path, directory / path.name)
    return directory / first_shard.name


def oracle_expert_bytes(first_shard: Path) -> dict[str, tuple[int, bytes]]:
    """{routed tensor name: (experts, raw bytes)} read with the `gguf` package alone."""
    result = {}
    for path in model_files(first_shard):
        for tensor in GGUFReader(str(path)).tensors:
            if "_exps." in tensor.name:
                result[tensor.name] = (int(tensor.shape[-1]), np.asarray(tensor.data).tobytes())
    return result


def oracle_slice(tensors: dict[str, tuple[int, bytes]], name: str, expert: int) -> bytes:
    experts, raw = tensors[name]
    size = len(raw) // experts
    return raw[expert * size : (expert + 1) * size]


def read_index(pack: Path) -> tuple[tuple, list[tuple[str, int, int, int, int]]]:
    """The pack's header and index parsed with `struct` from the published layout."""
    with pack.open("rb") as stream:
        header = struct.unpack("<16sIIQQ", stream.read(40))
        entries = []
        for _ in range(header[3]):
            name, expert, reserved, offset, nbytes = struct.unpack("<128siIQQ", stream.read(152))
            entries.append((name.rstrip(b"\0").decode(), expert, reserved, offset, nbytes))
    return header, entries


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under `directory`."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past offset `nbytes` of any file fail with EFBIG, as writes to a full disk fail."""
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)


def open_file_paths() -> list[str]:
    """What each of this process's descriptors refers to (deleted files end in ` (deleted)`)."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
    return paths


def _generator_digest() -> str:
    import k3stream

    package = Path(k3stream.__file__).parent
    digest = hashlib.sha256()
    for name in GENERATOR_SOURCES:
        path = package / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


def cached_tiny(**fields) -> Path:
    """First shard of `make_tiny(TinySpec(**fields))`, generated once per spec and generator version
    into TEST_CACHE: written to a scratch directory there, then renamed whole."""
    from k3stream.gguf.writer import TinySpec, shard_paths
    from k3stream.testing.tiny import make_tiny

    spec = TinySpec(**fields)
    key = hashlib.sha256(f"{spec!r}\n{_generator_digest()}".encode()).hexdigest()[:16]
    directory = TEST_CACHE / f"tiny-{key}"
    if not directory.is_dir():
        TEST_CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=TEST_CACHE, prefix=".tiny-") as scratch:
            make_tiny(Path(scratch) / "model", spec)
            try:
                os.replace(Path(scratch) / "model", directory)
            except OSError:  # another session renamed the same model into place first
                if not directory.is_dir():
                    raise
    return shard_paths(directory, spec.shards)[0]


def clear_test_cache(cache: Path = TEST_CACHE) -> None:
    """Remove what the tests put in `cache`, then the folder itself if that left it empty (it may be a
    folder of the user's own, named by K3STREAM_TEST_CACHE)."""
    if not cache.is_dir():
        return
    for pattern in TEST_CACHE_ENTRIES:
        for entry in cache.glob(pattern):
            shutil.rmtree(entry, ignore_errors=True)
    if not any(cache.iterdir()):
        cache.rmdir()


def rewritten(
    source: Path,
    dst: Path,
    shapes: dict[str, tuple[int, ...]] | None = None,
    drop: set[str] | None = None,
    metadata: dict[str, tuple] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """`source` rewritten (gguf's writer) with the tensors `shapes` names in the numpy shapes given,
    without the tensors `drop` names, the keys of `metadata` set to its `(value, GGUF type[, array
    element type])` and the tensors of `extra` added."""
    shapes, drop, metadata = shapes or {}, drop or set(), metadata or {}
    reader = GGUFReader(source)
    writer = GGUFWriter(dst, "kimi-k3")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in metadata:
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, vtype, *sub_type) in metadata.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type[0] if sub_type else None)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            data = np.asarray(tensor.data)
            shape = shapes.get(tensor.name, data.shape)
            writer.add_tensor(tensor.name, data.reshape(shape), raw_dtype=tensor.tensor_type)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# matrices of the default tiny model and how many GGML dimensions of 1 to append to each: KDA and MLA
# projections, the dense MLP, the shared experts, the head, the embedding, an expert tensor (4-D)
UNIT_MATRICES = {
    "token_embd.weight": 1,
    "output.weight": 1,
    "blk.0.attn_q.weight": 2,
    "blk.0.ffn_down.weight": 1,
    "blk.0.ffn_gate.weight": 1,
    "blk.0.attn_output.weight": 1,
    "blk.3.attn_output.weight": 1,
    "blk.3.attn_gate.weight": 1,
    "blk.3.attn_k_b.weight": 1,
    "blk.1.ffn_down_shexp.weight": 1,
    "blk.1.ffn_up_shexp.weight": 1,
    "blk.1.ffn_gate_exps.weight": 1,
}


def with_leading_ones(source: Path, extra: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The numpy shapes of `source`'s tensors `extra` names with that many leading dimensions of 1."""
    tensors = {t.name: t for t in GGUFReader(source).tensors}
    return {
        name: (1,) * ones + tuple(int(n) for n in reversed(tensors[name].shape))
        for name, ones in extra.items()
    }
