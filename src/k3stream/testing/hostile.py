"""Crafted hostile inputs for robustness tests and `benchmarks/bench_hostile.py`: GGUF headers whose counts,
lengths and offsets lie, and manifests whose fields do. Each maker writes one small file and returns its
path; none of them is a valid model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

MAGIC = b"GGUF"
U8, U32, STRING, ARRAY = 0, 4, 8, 9


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(tensors: int, kvs: int, version: int = 3) -> bytes:
    return MAGIC + struct.pack("<IQQ", version, tensors, kvs)


def _kv_u32(key: bytes, value: int) -> bytes:
    return _string(key) + struct.pack("<II", U32, value)


def _arch() -> bytes:
    return _string(b"general.architecture") + struct.pack("<I", STRING) + _string(b"kimi-k3")


def _tensor_info(name: bytes, dims: list[int], ggml_type: int, offset: int) -> bytes:
    packed = struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    return _string(name) + packed + struct.pack("<IQ", ggml_type, offset)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def huge_array(path: Path) -> Path:
    """A 164-byte file whose uint8 array claims 2^40 elements."""
    body = _arch() + _string(b"tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, U8, 1 << 40)
    data = _header(0, 2) + body
    return _write(path, data + bytes(164 - len(data)))


def zero_length_strings(path: Path, mib: int = 64) -> Path:
    """A string array of (mib MiB / 8) zero-length strings: GGUFReader makes arrays for each."""
    count = (mib << 20) // 8
    body = _arch() + _string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, count)
    with path.open("wb") as stream:
        stream.write(_header(0, 2) + body)
        stream.truncate(len(_header(0, 2) + body) + count * 8)  # sparse zeros: every length is 0
    return path


def huge_tensor_count(path: Path) -> Path:
    return _write(path, _header(1 << 60, 1) + _arch() + bytes(64))


def huge_kv_count(path: Path) -> Path:
    return _write(path, _header(0, 1 << 62) + _arch() + bytes(64))


def huge_key_length(path: Path) -> Path:
    return _write(path, _header(0, 1) + struct.pack("<Q", 1 << 63) + bytes(64))


def huge_string_value(path: Path) -> Path:
    body = _string(b"general.architecture") + struct.pack("<IQ", STRING, (1 << 64) - 1)
    return _write(path, _header(0, 1) + body + bytes(32))


def offset_beyond_eof(path: Path) -> Path:
    info = _tensor_info(b"token_embd.weight", [64, 16], 0, 1 << 40)
    data = _header(1, 1) + _arch() + info
    return _write(path, data + bytes(-len(data) % 32) + bytes(64 * 16 * 4))


def tensor_larger_than_file(path: Path) -> Path:
    info = _tensor_info(b"token_embd.weight", [1 << 32, 1 << 31], 0, 0)
    data = _header(1, 1) + _arch() + info
    return _write(path, data + bytes(-len(data) % 32) + bytes(256))


def overlapping_tensors(path: Path) -> Path:
    """Two F32 tensors, the second's data inside the first's (as when a tensor's type is changed to a
    larger one): a reader would serve one's bytes as the other's."""
    infos = _tensor_info(b"a", [64], 0, 0) + _tensor_info(b"b", [32], 0, 128)
    data = _header(2, 1) + _arch() + infos
    return _write(path, data + bytes(-len(data) % 32) + bytes(512))


def too_many_dims(path: Path) -> Path:
    data = _header(1, 1) + _arch() + _string(b"x") + struct.pack("<I", 1 << 31) + bytes(64)
    return _write(path, data)


def unknown_tensor_type(path: Path) -> Path:
    data = _header(1, 1) + _arch() + _tensor_info(b"x", [32], 9999, 0)
    return _write(path, data + bytes(-len(data) % 32) + bytes(256))


def nested_array(path: Path) -> Path:
    body = _arch() + _string(b"general.nested") + struct.pack("<IIQ", ARRAY, ARRAY, 1 << 30)
    return _write(path, _header(0, 2) + body + bytes(64))


def bad_alignment(path: Path) -> Path:
    return _write(path, _header(0, 2) + _arch() + _kv_u32(b"general.alignment", 3) + bytes(32))


def unknown_value_type(path: Path) -> Path:
    return _write(path, _header(0, 1) + _string(b"general.x") + struct.pack("<I", 77) + bytes(32))


def truncated_header(path: Path) -> Path:
    """A plausible header cut off in the middle of a string."""
    return _write(path, (_header(0, 2) + _arch() + _string(b"general.name") + struct.pack("<I", STRING))[:-2])


def big_endian(path: Path) -> Path:
    """A header written on a big-endian machine: its tensor data would be read byte-swapped."""
    arch = struct.pack(">Q", 20) + b"general.architecture" + struct.pack(">IQ", STRING, 7) + b"kimi-k3"
    return _write(path, MAGIC + struct.pack(">IQQ", 3, 0, 1) + arch + bytes(32))


def not_gguf(path: Path) -> Path:
    return _write(path, b"PK\x03\x04" + bytes(200))


def many_strings(path: Path) -> Path:
    """The most zero-length strings one array may hold (2^18 - 1): legal, and must stay cheap to read."""
    return _strings(path, (1 << 18) - 1)


def _strings(path: Path, count: int) -> Path:
    body = _arch() + _string(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, count)
    return _write(path, _header(0, 2) + body + bytes(8 * count))


def big_number_array(path: Path) -> Path:
    """A uint8 array of 16 Mi elements, all in the file: GGUFReader made an array per element."""
    count = 16 << 20
    body = _arch() + _string(b"tokenizer.ggml.token_type") + struct.pack("<IIQ", ARRAY, U8, count)
    with path.open("wb") as stream:
        stream.write(_header(0, 2) + body)
        stream.truncate(len(_header(0, 2) + body) + count)
    return path


def many_tensors(path: Path) -> Path:
    """The most tensor infos a file may hold (2^13 - 1), each a 32-element F32 tensor after the one before."""
    count = (1 << 13) - 1
    infos = b"".join(_tensor_info(b"t%d" % index, [32], 0, 128 * index) for index in range(count))
    data = _header(count, 1) + _arch() + infos
    return _write(path, data + bytes(-len(data) % 32) + bytes(128 * count))


# within the header limits, so GGUFReader parses them: they must still cost little (not a model either)
GGUF_HEAVY_CASES: dict[str, Callable[[Path], Path]] = {
    "262,143 zero-length strings": many_strings,
    "uint8 array of 16 Mi elements": big_number_array,
    "8,191 tensor infos": many_tensors,
}

GGUF_CASES: dict[str, Callable[[Path], Path]] = {
    "array of 2^40 elements": huge_array,
    "64 MiB of zero-length strings": zero_length_strings,
    "2^60 tensors": huge_tensor_count,
    "2^62 metadata pairs": huge_kv_count,
    "2^63-byte key": huge_key_length,
    "2^64-1-byte string value": huge_string_value,
    "tensor offset beyond EOF": offset_beyond_eof,
    "tensor larger than the file": tensor_larger_than_file,
    "tensor data overlapping another's": overlapping_tensors,
    "2^31 dimensions": too_many_dims,
    "unknown tensor type": unknown_tensor_type,
    "nested array of 2^30": nested_array,
    "alignment 3": bad_alignment,
    "unknown value type": unknown_value_type,
    "header cut short": truncated_header,
    "not a GGUF": not_gguf,
    "big-endian file": big_endian,
}


# ---- manifests ---------------------------------------------------------------------------------------


def manifest_cases(manifest: Path) -> dict[str, Callable[[dict], dict | str]]:
    """Edits of a good manifest (as a dict) into hostile ones; a str result is written as raw text."""

    def shard(field: str, value: object) -> Callable[[dict], dict]:
        def edit(m: dict) -> dict:
            m["source"]["shards"][0][field] = value
            return m

        return edit

    def pack(field: str, value: object) -> Callable[[dict], dict]:
        def edit(m: dict) -> dict:
            m["expert_pack"][field] = value
            return m

        return edit

    def model(field: str, value: object) -> Callable[[dict], dict]:
        def edit(m: dict) -> dict:
            m["model"][field] = value
            return m

        return edit

    return {
        "shard path /dev/zero": shard("path", "/dev/zero"),
        "shard path a directory": shard("path", "/"),
        "shard size a string": shard("size", "12"),
        "shard index null": shard("index", None),
        "shards not a list": lambda m: {**m, "source": {**m["source"], "shards": "x"}},
        "tensors of numbers": lambda m: {**m, "source": {**m["source"], "tensors": [1, 2]}},
        "pack path /dev/zero": pack("path", "/dev/zero"),
        "pack path a number": pack("path", 7),
        "pack size negative": pack("size", -1),
        "roles a list": pack("roles", []),
        "object_bytes a float": pack("object_bytes", 1.5),
        "layers a string": model("active_moe_layer_ids", "1..5"),
        "num_experts huge": model("num_experts", 1 << 62),
        "integrity a string": lambda m: {**m, "integrity": "x"},
        "digests short": lambda m: {**m, "integrity": {**m["integrity"], "object_digests": "00"}},
        "deeply nested JSON": lambda m: "[" * 100000 + "]" * 100000,
        "not JSON": lambda m: "\x00\xff garbage",
        "a JSON list": lambda m: "[]",
    }


def write_manifest_case(source: Path, target: Path, edit: Callable[[dict], dict | str]) -> Path:
    value = edit(json.loads(source.read_text()))
    target.write_text(value if isinstance(value, str) else json.dumps(value))
    return target
