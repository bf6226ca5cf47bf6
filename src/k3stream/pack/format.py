"""The GGMLMOEPACKv1 binary layout: header and index structs, and the expert-major layout.

Little-endian. A 40-byte header, then one 152-byte index entry per (MoE layer, expert, role) in the
order layer, expert, role `up, gate, down`, zero padding to a 4096-aligned `data_start`, then each
role slice at a 4096-aligned offset in index order. The file ends at the end of the last payload.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from k3stream.gguf.header import PACK_MAGIC as MAGIC
from k3stream.gguf.layout import routed_expert_name

VERSION = 1
HEADER = struct.Struct("<16sIIQQ")  # magic, version, header_size, index_count, data_start
ENTRY = struct.Struct("<128siIQQ")  # tensor name, expert, reserved, absolute offset, nbytes
ALIGNMENT = 4096
ROLES = ("up", "gate", "down")  # physical order inside an expert object
NAME_BYTES = 128


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Header:
    magic: bytes
    version: int
    header_size: int
    index_count: int
    data_start: int

    def encode(self) -> bytes:
        return HEADER.pack(self.magic, self.version, self.header_size, self.index_count, self.data_start)

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        return cls(*HEADER.unpack(raw))


@dataclass(frozen=True)
class Entry:
    name: str
    expert: int
    offset: int
    nbytes: int
    reserved: int = 0

    def encode(self) -> bytes:
        name = self.name.encode("utf-8")
        if len(name) >= NAME_BYTES:
            raise ValueError(f"expert tensor name is too long for the pack index: {self.name}")
        return ENTRY.pack(name.ljust(NAME_BYTES, b"\0"), self.expert, self.reserved, self.offset, self.nbytes)

    @classmethod
    def decode(cls, raw: bytes) -> Entry:
        name, expert, reserved, offset, nbytes = ENTRY.unpack(raw)
        # undecodable names become U+FFFD and fail the identity check like any other wrong name
        return cls(name.split(b"\0", 1)[0].decode("utf-8", "replace"), expert, offset, nbytes, reserved)


@dataclass(frozen=True)
class PackLayout:
    """Where every role slice of every expert lies; pure arithmetic, no I/O.

    Each slice starts at the next 4096-aligned offset after the previous one, so an object is
    contiguous (no padding between roles) exactly when the up and gate sizes are multiples of 4096,
    as they are for the real model. `role_bytes` are every layer's sizes, unless `layer_role_bytes`
    gives each MoE layer its own (a mixed recipe): then a layer's objects follow the previous layer's,
    each still one contiguous, 4096-aligned read. One size for all layers gives the same bytes either way.
    """

    moe_layers: tuple[int, ...]
    num_experts: int
    role_bytes: tuple[int, int, int]  # up, gate, down bytes of one expert (the first MoE layer's)
    layer_role_bytes: tuple[tuple[int, int, int], ...] | None = None  # per MoE layer, when they differ

    @classmethod
    def of_layers(
        cls, moe_layers: tuple[int, ...], num_experts: int, sizes: tuple[tuple[int, int, int], ...]
    ) -> PackLayout:
        """The layout of MoE layers with these (up, gate, down) bytes per expert, one row a layer."""
        return cls(moe_layers, num_experts, sizes[0], sizes if len(set(sizes)) > 1 else None)

    @property
    def index_count(self) -> int:
        return len(self.moe_layers) * self.num_experts * len(ROLES)

    @property
    def data_start(self) -> int:
        return align_up(HEADER.size + self.index_count * ENTRY.size)

    @property
    def mixed(self) -> bool:
        """Whether the MoE layers differ in their role sizes."""
        return self.layer_role_bytes is not None and len(set(self.layer_role_bytes)) > 1

    def sizes_at(self, position: int) -> tuple[int, int, int]:
        """Up, gate, down bytes of one expert of the `position`-th MoE layer."""
        return self.role_bytes if self.layer_role_bytes is None else self.layer_role_bytes[position]

    def offsets_at(self, position: int) -> tuple[int, int, int]:
        """Offset of each role from the start of its object, in the `position`-th MoE layer."""
        up, gate, _ = self.sizes_at(position)
        gate_offset = align_up(up)
        return 0, gate_offset, align_up(gate_offset + gate)

    def object_bytes_at(self, position: int) -> int:
        """Span of one object of the `position`-th MoE layer: from the start of up to the end of down."""
        return self.offsets_at(position)[2] + self.sizes_at(position)[2]

    @functools.cached_property
    def _layer_starts(self) -> tuple[int, ...]:
        """Offset of each MoE layer's first object, and the end of the last layer's strides."""
        starts = [self.data_start]
        for position in range(len(self.moe_layers)):
            starts.append(starts[-1] + self.num_experts * align_up(self.object_bytes_at(position)))
        return tuple(starts)

    @property
    def role_offsets(self) -> tuple[int, int, int]:
        """Offset of each role from the start of its object (the first MoE layer's)."""
        return self.offsets_at(0)

    @property
    def object_bytes(self) -> int:
        """Span of the largest object (every object's, with one size for all layers)."""
        return max(self.object_bytes_at(p) for p in range(len(self.moe_layers)))

    @property
    def object_stride(self) -> int:
        return align_up(self.object_bytes)

    @property
    def total_size(self) -> int:
        last = len(self.moe_layers) - 1
        return self._layer_starts[-1] - align_up(self.object_bytes_at(last)) + self.object_bytes_at(last)

    @property
    def payload_bytes(self) -> int:
        return self.num_experts * sum(sum(self.sizes_at(p)) for p in range(len(self.moe_layers)))

    def payload_before(self, index: int) -> int:
        """Payload bytes of entries 0..index-1."""
        objects, roles = divmod(index, len(ROLES))
        position, expert = divmod(objects, self.num_experts)
        earlier = self.num_experts * sum(sum(self.sizes_at(p)) for p in range(position))
        if position == len(self.moe_layers):
            return earlier
        sizes = self.sizes_at(position)
        return earlier + expert * sum(sizes) + sum(sizes[:roles])

    def layer_position(self, layer: int) -> int:
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer} has no routed experts in this pack") from None

    def object_offset(self, layer: int, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} is out of range 0..{self.num_experts - 1}")
        position = self.layer_position(layer)
        return self._layer_starts[position] + expert * align_up(self.object_bytes_at(position))

    def identity(self, index: int) -> tuple[int, int, int]:
        """(layer, expert, role position) of index entry `index`."""
        object_index, role = divmod(index, len(ROLES))
        layer_position, expert = divmod(object_index, self.num_experts)
        return self.moe_layers[layer_position], expert, role

    def entry(self, index: int) -> Entry:
        layer, expert, role = self.identity(index)
        position = self.layer_position(layer)
        offset = self.object_offset(layer, expert) + self.offsets_at(position)[role]
        return Entry(routed_expert_name(layer, ROLES[role]), expert, offset, self.sizes_at(position)[role])

    def entry_sizes(self) -> list[int]:
        """Payload bytes of every index entry, in index order."""
        return [n for p in range(len(self.moe_layers)) for n in self.sizes_at(p) * self.num_experts]

    def entry_role_offsets(self) -> list[int]:
        """Offset of every index entry from the start of its object, in index order."""
        return [n for p in range(len(self.moe_layers)) for n in self.offsets_at(p) * self.num_experts]

    def entries(self) -> Iterator[Entry]:
        return (self.entry(index) for index in range(self.index_count))

    def header(self) -> Header:
        return Header(MAGIC, VERSION, HEADER.size, self.index_count, self.data_start)

    def header_and_index(self) -> bytes:
        """Header, index and the zero padding up to data_start: the first data_start bytes."""
        raw = self.header().encode() + b"".join(entry.encode() for entry in self.entries())
        return raw + bytes(self.data_start - len(raw))

    def index_sha256(self) -> str:
        return index_digest(self.header_and_index()[: HEADER.size + self.index_count * ENTRY.size])


def index_digest(header_and_entries: bytes) -> str:
    """SHA-256 over the 40 header bytes followed by every index entry."""
    return hashlib.sha256(header_and_entries).hexdigest()
