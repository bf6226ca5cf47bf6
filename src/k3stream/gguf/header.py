"""Check a GGUF header against its file before `gguf.GGUFReader` parses it.

GGUFReader trusts every count and length it reads: an array header claiming 2^40 elements, millions of
zero-length strings or a tensor count in the billions make it allocate without bound. `check_header`
walks the same structure with `struct` over a memory map, allocating nothing in proportion to what the
file claims, and refuses (one line naming the file and the field) any count, length or offset that the
file's size cannot hold, a big-endian file, or tensor data that does not follow the tensor before it (as
llama.cpp refuses them: a changed type or shape), plus a few limits no real GGUF comes near (LIMITS). It
reads the header only.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
PACK_MAGIC = b"GGMLMOEPACKv1\0\0\0"  # k3stream's expert pack (pack.format), often given in the GGUF's place
# the top-level keys of an expert pack's manifest (pack.manifest writes them), the other file given there
MANIFEST_KEYS = ("format", "expert_pack")
MAX_MANIFEST_BYTES = 1 << 28  # a real model's manifest is a few MiB
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# limits no real GGUF comes near (Kimi-K3: a 163,840-token vocabulary, ~1,500 tensors per shard)
MAX_KEY_BYTES = 65535
MAX_NAME_BYTES = 4096
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 13  # per file (Kimi-K3 has ~2,800 in all); GGUFReader makes several arrays per tensor
MAX_ARRAY_STRINGS = 1 << 18  # per array
MAX_HEADER_STRINGS = 1 << 19  # all string values of the header together

# GGUF value types: struct format of the fixed-size ones; 8 = string, 9 = array
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


MAX_FILE = 1 << 50  # a file claiming more (1 PiB) is crafted, not cut short


def printable(text: str) -> str:
    """`text` with each character that is not printable (a newline, a control byte) as its escape: a
    name read from a file, shown in a one-line message, stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _name(raw: bytes) -> str:
    return printable(raw.decode("utf-8", "replace"))


class GGUFHeaderError(ValueError):
    """A GGUF header whose counts, lengths or offsets its file cannot hold."""


class _Cursor:
    """Reads the header's fields in order, each read checked against the end of the file."""

    def __init__(self, data: memoryview, path: Path) -> None:
        self.data, self.path, self.offset = data, path, 0
        self.strings = 0

    def fail(self, what: str) -> GGUFHeaderError:
        size = len(self.data)
        return GGUFHeaderError(f"{self.path}: not a valid GGUF header: {what} (file is {size} bytes)")

    def cut_short(self, name: str, end: int) -> GGUFHeaderError:
        """A whole header whose data stops inside tensor `name` (ending at byte `end`): a partial file."""
        return GGUFHeaderError(
            f"{self.path}: cut short: tensor {name} ends at byte {end}, the file has {len(self.data)} bytes "
            "(an incomplete download or copy)"
        )

    def take(self, fmt: str, what: str) -> int | float:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise self.fail(f"{what} at byte {self.offset} runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return value

    def skip(self, nbytes: int, what: str) -> None:
        if nbytes > len(self.data) - self.offset:
            raise self.fail(f"{what} of {nbytes} bytes at byte {self.offset} runs past the end of the file")
        self.offset += nbytes

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.take("Q", f"length of {what}")
        if limit is not None and length > limit:
            raise self.fail(f"{what} is {length} bytes long (at most {limit})")
        start = self.offset
        self.skip(length, what)
        return bytes(self.data[start : self.offset])

    def count(self, value: int, per_item: int, limit: int, what: str) -> int:
        """`value` items of at least `per_item` bytes each must fit in the rest of the file and `limit`."""
        if value > limit:
            raise self.fail(f"{what} is {value} (at most {limit})")
        remaining = len(self.data) - self.offset
        if value * per_item > remaining:
            raise self.fail(f"{what} is {value}, more than the remaining {remaining} bytes hold")
        return value


def _value(cursor: _Cursor, vtype: int, key: str) -> object:
    if vtype in SCALAR_FORMATS:
        return cursor.take(SCALAR_FORMATS[vtype], f"value of {key}")
    if vtype == STRING:
        cursor.strings += 1
        cursor.skip(cursor.take("Q", f"length of {key}"), f"string value of {key}")
        return None
    if vtype == ARRAY:
        _array(cursor, key)
        return None
    raise cursor.fail(f"metadata key {key} has unknown value type {vtype}")


def _array(cursor: _Cursor, key: str) -> None:
    element = cursor.take("I", f"array type of {key}")
    length = cursor.take("Q", f"array length of {key}")
    if element in SCALAR_FORMATS:
        size = struct.calcsize(SCALAR_FORMATS[element])
        cursor.count(length, size, 1 << 62, f"array length of {key}")
        cursor.skip(length * size, f"array {key}")
    elif element == STRING:
        cursor.count(length, 8, MAX_ARRAY_STRINGS, f"string array length of {key}")
        cursor.strings += length
        if cursor.strings > MAX_HEADER_STRINGS:
            raise cursor.fail(f"more than {MAX_HEADER_STRINGS} strings in the metadata (at {key})")
        _skip_strings(cursor, length, key)
    else:  # llama.cpp reads no nested arrays either
        raise cursor.fail(f"array {key} has unsupported element type {element}")


def _skip_strings(cursor: _Cursor, count: int, key: str) -> None:
    """Step over `count` length-prefixed strings (the tight loop of a 163,840-token vocabulary)."""
    unpack, data, end = struct.Struct("<Q").unpack_from, cursor.data, len(cursor.data)
    position = cursor.offset
    for _ in range(count):
        if position + 8 > end:
            raise cursor.fail(f"string length in {key} at byte {position} runs past the end of the file")
        position += 8 + unpack(data, position)[0]
        if position > end:
            raise cursor.fail(f"a string in {key} runs past the end of the file")
    cursor.offset = position


def _metadata(cursor: _Cursor, kv_count: int) -> int:
    """Walk the key/value pairs; returns general.alignment."""
    alignment = DEFAULT_ALIGNMENT
    for index in range(kv_count):
        key = _name(cursor.string(f"metadata key {index}", MAX_KEY_BYTES))
        vtype = cursor.take("I", f"value type of {key}")
        value = _value(cursor, vtype, key)
        if key == "general.alignment":
            if vtype != 4:  # llama.cpp refuses any other type (a writer's u64 or i32 of the same value)
                from gguf import GGUFValueType

                given = GGUFValueType(vtype).name.lower()
                raise cursor.fail(f"general.alignment must be a uint32, got a {given}")
            if not value or value & (value - 1):
                raise cursor.fail(f"general.alignment must be a power of two, got {value}")
            alignment = int(value)
    return alignment


def _tensor_infos(cursor: _Cursor, tensor_count: int) -> list[tuple[str, int, int, int, int]]:
    """(name, ggml type, element count, offset, first dimension) of each tensor info."""
    infos = []
    for index in range(tensor_count):
        name = _name(cursor.string(f"name of tensor {index}", MAX_NAME_BYTES))
        n_dims = cursor.take("I", f"dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name} has {n_dims} dimensions (1..{MAX_DIMS})")
        dims = [cursor.take("Q", f"dimension {d} of tensor {name}") for d in range(n_dims)]
        ggml_type = cursor.take("I", f"type of tensor {name}")
        offset = cursor.take("Q", f"data offset of tensor {name}")
        elements = 1
        for dim in dims:
            elements *= dim
        infos.append((name, ggml_type, elements, offset, dims[0]))
    return infos


def _check_tensor_data(cursor: _Cursor, infos: list, data_start: int, alignment: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    room, expected, before = len(cursor.data) - data_start, 0, "nothing"
    for name, ggml_type, elements, offset, first_dim in infos:
        try:
            kind = GGMLQuantizationType(ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise cursor.fail(f"tensor {name} has unknown GGML type {ggml_type}") from None
        if first_dim % block:
            raise cursor.fail(f"tensor {name}: first dimension {first_dim} is not a multiple of {block}")
        nbytes = elements // block * block_bytes
        end = data_start + offset + nbytes
        if offset == expected and offset % alignment == 0 and room - offset < nbytes and end <= MAX_FILE:
            raise cursor.cut_short(name, end)
        if offset % alignment or offset > room or nbytes > room - offset:
            raise cursor.fail(
                f"tensor {name} data ({nbytes} bytes at offset {offset}) lies outside the file's "
                f"{room}-byte data section or off its {alignment}-byte alignment"
            )
        if offset != expected:  # as llama.cpp: each tensor's data follows the one before, in order
            raise cursor.fail(
                f"tensor {name} data is at offset {offset}, but {before} comes before it, ending at "
                f"{expected} (a type, shape or offset was changed)"
            )
        expected = offset + -(-nbytes // alignment) * alignment
        before = f"tensor {name} (GGML type {kind.name} ({ggml_type}), {elements} values)"


def check_header(path: str | os.PathLike[str]) -> None:
    """Raise GGUFHeaderError (one line) unless every count, length and offset of the GGUF header at
    `path` fits the file. Reads only the header; allocates nothing in proportion to what it claims."""
    path = Path(path)
    with path.open("rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        if size < 24:
            raise GGUFHeaderError(f"{path}: not a valid GGUF header: the file is only {size} bytes")
        with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as data:
            if bytes(data[: len(PACK_MAGIC)]) == PACK_MAGIC:
                raise GGUFHeaderError(
                    f"{path}: an expert pack, not a GGUF; give its manifest {path}.manifest.json or the GGUF"
                )
            if path.suffix == ".json" and _is_manifest(data):  # pack and dequantize read GGUFs only
                raise GGUFHeaderError(
                    f"{path}: an expert pack's manifest, not a GGUF; give the GGUF it names"
                )
            _walk(_Cursor(data, path))


def _is_manifest(data: memoryview) -> bool:
    """Whether a file's bytes are a JSON object with a manifest's keys (`MANIFEST_KEYS`)."""
    if bytes(data[:1]) != b"{" or len(data) > MAX_MANIFEST_BYTES:
        return False
    try:
        value = json.loads(bytes(data))
    except ValueError:  # not JSON, or not UTF-8
        return False
    return isinstance(value, dict) and all(key in value for key in MANIFEST_KEYS)


def _walk(cursor: _Cursor) -> None:
    if bytes(cursor.data[:4]) != GGUF_MAGIC:
        raise cursor.fail("the magic is not GGUF")
    cursor.offset = 4
    version = cursor.take("I", "version")
    if version & 0xFFFF == 0:  # as llama.cpp: its tensor data would be read byte-swapped
        raise cursor.fail("the file is big-endian (k3stream reads little-endian GGUFs)")
    if version not in SUPPORTED_VERSIONS:
        raise cursor.fail(f"version {version} is not supported ({', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count = cursor.take("Q", "tensor count")
    kv_count = cursor.take("Q", "metadata count")
    cursor.count(kv_count, 13, MAX_KV, "metadata count")
    alignment = _metadata(cursor, kv_count)
    cursor.count(tensor_count, 28, MAX_TENSORS, "tensor count")
    infos = _tensor_infos(cursor, tensor_count)
    data_start = -(-cursor.offset // alignment) * alignment
    if data_start > len(cursor.data) and infos:
        raise cursor.fail(f"the data section would start at byte {data_start}, past the end of the file")
    _check_tensor_data(cursor, infos, data_start, alignment)


def open_reader(path: str | os.PathLike[str]):  # -> gguf.GGUFReader
    """A `gguf.GGUFReader` of `path` after `check_header`: a hostile header fails in one line instead of
    exhausting memory. The reader is `CompactGGUFReader`: same fields, tensors and `contents()`, but an
    array is not split into one numpy array per element."""
    check_header(path)
    return _compact_reader_class()(str(path), "r")


class _StringParts(Sequence):
    """The `parts` of a string-array field: the fixed parts, then per string its length and its bytes,
    each made (a view of the file) only when asked for."""

    def __init__(self, head: list, data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, order: str):
        self._head, self._data, self._offsets, self._lengths = head, data, offsets, lengths
        self._length_type = np.dtype(np.uint64).newbyteorder(order)

    def __len__(self) -> int:
        return len(self._head) + 2 * len(self._offsets)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < len(self._head):
            return self._head[index]
        string, is_bytes = divmod(index - len(self._head), 2)
        start = int(self._offsets[string])
        if is_bytes:
            return self._data[start + 8 : start + 8 + int(self._lengths[string])]
        return self._data[start : start + 8].view(self._length_type)


@functools.cache
def _compact_reader_class() -> type:
    from gguf import GGUFReader, GGUFValueType
    from gguf.gguf_reader import ReaderField

    class CompactGGUFReader(GGUFReader):
        """GGUFReader whose views are plain arrays over its memory map (not np.memmap, ~3x cheaper) and
        whose arrays are one view (numbers; `data` = [its index]) or lazily made views (strings), so a
        163,840-token vocabulary costs milliseconds, not seconds and hundreds of MiB. `contents()`
        returns what GGUFReader's does."""

        def _get(self, offset, dtype, count=1, override_order=None):  # noqa: ANN001, ANN202
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            array = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return array.view(array.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                start = offs
                key_length, key = self._get_str(offs)
                offs += int(key_length.nbytes + key.nbytes)
                raw_type = self._get(offs, np.uint32)
                offs += int(raw_type.nbytes)
                head = [key_length, key, raw_type]
                if int(raw_type[0]) == GGUFValueType.ARRAY:
                    size, parts, indices, types = self._array(offs, head)
                else:
                    size, value_parts, value_indices, types = self._get_field_parts(offs, raw_type[0])
                    parts, indices = head + value_parts, [i + len(head) for i in value_indices]
                name = str(bytes(key), encoding="utf-8")
                self._push_field(ReaderField(start, name, parts, indices, types), skip_sum=True)
                offs += size
            return offs

        def _array(self, offs: int, head: list) -> tuple[int, Sequence, list[int], list]:
            item_type = self._get(offs, np.uint32)
            length = self._get(offs + 4, np.uint64)
            head = [*head, item_type, length]
            first, count = offs + 12, int(length[0])
            kind = GGUFValueType(int(item_type[0]))
            if kind == GGUFValueType.STRING:
                offsets, lengths, end = self._string_offsets(first, count)
                parts = _StringParts(head, self._plain, offsets, lengths, self.byte_order)
                indices = list(range(len(head) + 1, len(head) + 2 * count, 2))
                return end - offs, parts, indices, [GGUFValueType.ARRAY, kind]
            values = self._get(first, self.gguf_scalar_to_np[kind], count)
            return 12 + int(values.nbytes), [*head, values], [len(head)], [GGUFValueType.ARRAY, kind]

        def _string_offsets(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, int]:
            native = "<Q" if sys.byteorder == "little" else ">Q"
            fmt = native if self.byte_order != "S" else {"<Q": ">Q", ">Q": "<Q"}[native]
            buffer = memoryview(self._plain)
            offsets = np.empty(count, dtype=np.int64)
            lengths = np.empty(count, dtype=np.int64)
            unpack, position = struct.Struct(fmt).unpack_from, first
            for index in range(count):
                (size,) = unpack(buffer, position)
                offsets[index], lengths[index] = position, size
                position += 8 + size
            return offsets, lengths, position

    return CompactGGUFReader
