"""The prompt cache's snapshot files: their format (`encode`, `decode`; the header read and checked alone:
`read_header`, `check_layers`), their names, their reading, and the joining of a file's snapshot with
its parents' latent rows.

A file: MAGIC, u64 header length, JSON header {fingerprint, tokens, layers: [[kind, shape...]],
parent: [length, identity] (absent: none), identity and rows_only (a file trimmed to its rows: its KDA
layers ["kda"] without shapes, no logits)}, the tensors' float32 bytes in layer order (an MLA layer's
rows from the parent's length on), then the xxh3_64 of everything before it (u64). A file's identity,
which its children name, is that checksum of its first writing (`identity` in the header once trimmed).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from k3stream.model.kda import KDAState
from k3stream.model.snapshot import LatentRows, Snapshot, StateLayout

MAGIC = b"K3SNAP02"
SUFFIX = ".k3snap"


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, or ValueError where it is no regular file: a FIFO's open waits for a
    writer without end (here it does not wait), a device reads without end (the start's scan of a
    folder, and a file given to import, take it)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise ValueError("not a regular file")
        os.set_blocking(descriptor, True)
        return open(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_file(path: Path) -> bytearray:
    """A snapshot file's bytes, read into one buffer (the GIL released while the disk reads it; the
    tensors decoded from it share it, nothing is copied again)."""
    with open(path, "rb", buffering=0) as stream:  # a file the start's scan found regular, or wrote
        data = bytearray(os.fstat(stream.fileno()).st_size)
        view, done = memoryview(data), 0
        while done < len(data):
            got = stream.readinto(view[done:])
            if not got:
                raise ValueError("truncated while it was read")
            done += got
    return data


def file_name(tokens: tuple[int, ...]) -> str:
    """A snapshot file's name: a hash of its token ids."""
    return xxhash.xxh3_128_hexdigest(struct.pack(f"<{len(tokens)}q", *tokens)) + SUFFIX


def trailing_checksum(data: bytes | memoryview) -> int:
    """The xxh3_64 a snapshot file's bytes (or their last part) end with."""
    return struct.unpack("<Q", data[-8:])[0]


def read_checksum(path: Path) -> int:
    """A snapshot file's trailing checksum (its children name their parent by it)."""
    with open_regular(path) as stream:
        stream.seek(0, os.SEEK_END)
        if stream.tell() < len(MAGIC) + 16:
            raise ValueError("not a k3stream snapshot")
        stream.seek(-8, os.SEEK_END)
        return trailing_checksum(stream.read(8))


def joined(pieces: list[Snapshot]) -> Snapshot:
    """One snapshot from a file's own (KDA states, logits, its latent rows) and its parents' latent
    rows, nearest parent first."""
    if len(pieces) == 1:
        return pieces[0]
    own, layers = pieces[0], []
    for index, layer in enumerate(own.layers):
        if isinstance(layer, KDAState):
            layers.append(layer)
            continue
        rows = torch.cat([piece.layers[index].rows() for piece in reversed(pieces)])
        layers.append(LatentRows(rows, rows.shape[0]))
    return Snapshot(own.length, tuple(layers), own.logits)


def encode(
    fingerprint: str,
    tokens: tuple[int, ...],
    snapshot: Snapshot,
    parent: tuple[int, int] | None = None,
    start: int | None = None,
    identity: int | None = None,
) -> list[bytes | memoryview]:
    """A snapshot file's bytes, in parts: the header's, a view of each tensor's own memory (nothing
    copied while the GIL is held: a writer thread then never stops the scheduler) and the checksum's;
    with a `parent` (the length and identity of a file of a prefix of `tokens`), only the latent rows
    past it (from `start` of the snapshot's rows: default the parent's length). A snapshot whose KDA
    layers are None is a rows-only file of `identity`."""
    start = (0 if parent is None else parent[0]) if start is None else start
    tensors = list(_tensors(snapshot, start))
    layers = [
        ["kda", list(layer.conv.shape), list(layer.recurrent.shape)]
        if isinstance(layer, KDAState)
        else ["kda"]
        if layer is None
        else ["mla", [layer.length - start, layer.buffer.shape[1]]]
        for layer in snapshot.layers
    ]
    if snapshot.logits is not None:
        layers.append(["logits", list(snapshot.logits.shape)])
    fields = {"fingerprint": fingerprint, "tokens": list(tokens), "layers": layers}
    if parent is not None:
        fields["parent"] = list(parent)
    if any(layer is None for layer in snapshot.layers):
        fields["rows_only"], fields["identity"] = True, identity
    header = json.dumps(fields).encode()
    parts = [
        MAGIC,
        struct.pack("<Q", len(header)),
        header,
        *(memoryview(t.contiguous().numpy()).cast("B") for t in tensors if t.numel()),  # 0 rows: no bytes
    ]
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)  # the GIL released over a large part
    return [*parts, struct.pack("<Q", digest.intdigest())]


def _tensors(snapshot: Snapshot, start: int) -> Iterator[torch.Tensor]:
    for layer in snapshot.layers:
        if isinstance(layer, KDAState):
            yield from (layer.conv, layer.recurrent)
        elif layer is not None:
            yield layer.rows()[start:]
    if snapshot.logits is not None:
        yield snapshot.logits


def read_header(path: Path, fingerprint: str) -> dict[str, Any]:
    with open_regular(path) as stream:
        head = stream.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise ValueError("not a k3stream snapshot")
        (length,) = struct.unpack("<Q", head[len(MAGIC) :])
        header = _parse_header(stream.read(min(length, 1 << 34)), length)
    if header.get("fingerprint") != fingerprint:
        raise ValueError(_foreign(header.get("fingerprint"), fingerprint))
    return header


def _foreign(found: Any, expected: str) -> str:
    """What a snapshot's fingerprint (`computation key-model file`, as the prompt cache keys them) differs
    in: a user who upgraded k3stream or changed the arithmetic has the right model file."""
    if isinstance(found, str) and "-" in expected and found.partition("-")[2] == expected.partition("-")[2]:
        return (
            "a snapshot of this model file computed by another k3stream build or arithmetic "
            "(--match-ggml, --float-activations, --dtype, --device)"
        )
    return "a snapshot of another model file"


def _parse_header(raw: bytes, length: int) -> dict[str, Any]:
    if len(raw) != length:
        raise ValueError("truncated header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"unreadable header ({error})") from None
    if not isinstance(header, dict) or not isinstance(tokens := header.get("tokens"), list):
        raise ValueError("header without token ids")
    if not all(type(token) is int and 0 <= token < 1 << 63 for token in tokens):  # a file name packs them
        raise ValueError("header with token ids that are not integers in 0..2^63-1")
    layers = header.get("layers", [])
    if not isinstance(layers, list) or not all(map(_is_layer, layers)):
        raise ValueError("malformed layer list in the header")
    return header


LAYER_SHAPES = {"kda": (0, 2), "mla": (1,), "logits": (1,)}  # a header layer's kind -> its shape counts


def check_layers(layers: list[list[Any]], layout: StateLayout, rows_only: bool) -> None:
    """A header's layer list (`_is_layer`'s) against the model's `layout`: one line naming the field
    that does not fit (another model's dimensions or layer count, or a hand-edited header, whose file
    passes its checksum). Only a rows-only file has KDA layers without shapes."""
    logits = [index for index, layer in enumerate(layers) if layer[0] == "logits"]
    if logits not in ([], [len(layers) - 1]) or len(layers) - len(logits) != len(layout.layers):
        raise ValueError(
            f"header field layers: {len(layers) - len(logits)} layer states and {len(logits)} logits "
            f"where this model has {len(layout.layers)} layers and logits last"
        )
    for index, (saved, expected) in enumerate(zip(layers[: len(layout.layers)], layout.layers, strict=True)):
        field = f"header field layers[{index}]"
        if saved[0] != expected[0]:
            raise ValueError(f"{field}: {saved[0]} where this model's layer {index} is {expected[0]}")
        if saved[0] == "mla" and (len(saved[1]) != 2 or saved[1][1] != expected[1]):
            raise ValueError(
                f"{field}: mla rows of shape {saved[1]} where this model's are {expected[1]} wide"
            )
        if saved[0] == "kda" and saved[1:] != list(expected[1:]) and not (rows_only and len(saved) == 1):
            shapes = " and ".join(map(str, expected[1:]))
            raise ValueError(f"{field}: kda states of shapes {saved[1:]} where this model's are {shapes}")
    if logits and layers[-1][1] != [layout.vocab]:
        raise ValueError(
            f"header field layers[{logits[0]}]: logits of shape {layers[-1][1]} where this model's are "
            f"[{layout.vocab}]"
        )


def _is_layer(layer: Any) -> bool:
    """A header's layer: its kind, then as many shapes (lists of counts) as the kind has."""
    if not isinstance(layer, list) or not layer or not isinstance(layer[0], str):
        return False
    if len(layer) - 1 not in LAYER_SHAPES.get(layer[0], ()):
        return False
    return all(_is_shape(shape) for shape in layer[1:])


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(type(count) is int and count >= 0 for count in shape)


def parent_of(header: dict[str, Any], length: int) -> tuple[int, int]:
    """The parent a header names: its length and checksum ((0, 0): none)."""
    parent = header.get("parent")
    if parent is None:
        return 0, 0
    if not (isinstance(parent, list) and len(parent) == 2 and all(isinstance(v, int) for v in parent)):
        raise ValueError("malformed parent reference")
    if not 0 < parent[0] < length:
        raise ValueError(f"a parent of {parent[0]} tokens for a snapshot of {length}")
    return parent[0], parent[1]


def decode(
    data: bytes | bytearray, fingerprint: str, tokens: tuple[int, ...], layout: StateLayout
) -> tuple[Snapshot, tuple[int, int], int]:
    """A snapshot from a file's bytes, checked (checksum, fingerprint, token ids, layer shapes against
    the model's `layout`), its parent's length and identity ((0, 0): none) and its own identity; with a
    parent, its MLA layers hold the rows past the parent's length only; a rows-only file's KDA layers
    are None."""
    try:
        return _decode(data, fingerprint, tokens, layout)
    except (TypeError, KeyError, RuntimeError) as error:  # a header that passed its checksum, but odd
        raise ValueError(f"malformed snapshot header ({error})") from None


def _decode(
    data: bytes | bytearray, fingerprint: str, tokens: tuple[int, ...], layout: StateLayout
) -> tuple[Snapshot, tuple[int, int], int]:
    if len(data) < len(MAGIC) + 16 or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a k3stream snapshot")
    data = data if isinstance(data, bytearray) else bytearray(data)  # the tensors share its memory
    body, (checksum,) = memoryview(data)[:-8], struct.unpack("<Q", data[-8:])
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    (length,) = struct.unpack("<Q", body[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = _parse_header(bytes(body[start : start + length]), length)
    if header.get("fingerprint") != fingerprint or tuple(header["tokens"]) != tokens:
        raise ValueError("a snapshot of another model or prompt")
    parent = parent_of(header, len(tokens))
    check_layers(header.get("layers", []), layout, bool(header.get("rows_only")))
    offset, layers, logits = start + length, [], None
    for kind, *shapes in header.get("layers", []):
        tensors = []
        for shape in shapes:
            count = math.prod(shape)
            chunk = body[offset : offset + 4 * count]
            if len(chunk) != 4 * count:
                raise ValueError("tensor data shorter than its header says")
            # 0 rows (the state of no tokens): frombuffer takes no empty buffer
            tensors.append(
                torch.frombuffer(chunk, dtype=torch.float32).view(shape) if count else torch.empty(shape)
            )
            offset += 4 * count
        if kind == "logits":
            logits = tensors[0]
        elif kind == "kda":
            layers.append(KDAState(*tensors) if tensors else None)
        else:
            layers.append(LatentRows(tensors[0], shapes[0][0]))
    if offset != len(body):
        raise ValueError("tensor data longer than its header says")
    latents = {layer.length for layer in layers if isinstance(layer, LatentRows)}
    if latents - {len(tokens) - parent[0]}:
        raise ValueError("latent rows do not fit the snapshot's tokens and parent")
    identity = header.get("identity", checksum) if header.get("rows_only") else checksum
    if not isinstance(identity, int):
        raise ValueError("malformed identity")
    return Snapshot(len(tokens), tuple(layers), logits), parent, identity
