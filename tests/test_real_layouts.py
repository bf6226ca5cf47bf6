"""Layouts of the GGUFs users download, which k3stream's own writer never makes: another
`general.alignment`, tensors in another order, gguf-split sets whose first shard holds only metadata or
whose cuts fall inside a layer's experts. Each is the same model: packed, verified and streamed, it
gives the original file's logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

import k3stream
from k3stream import LoadOptions
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.reader import ExpertPack
from k3stream.pack.verify import verify_pack
from k3stream.store import ExpertStore
from test_pack_mixed import DYNAMIC, greedy

MIB = 1 << 20
PROMPT = [5, 17, 3, 99, 42]
NOT_COPIED = ("GGUF.", "general.architecture", "general.alignment", "split.")


def _metadata(reader: GGUFReader) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith(NOT_COPIED):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return fields


def _write(path: Path, metadata, tensors, alignment: int, split: tuple[int, int, int] | None) -> None:
    writer = GGUFWriter(path, "kimi-k3" if metadata else None)
    if alignment != 32:
        writer.data_alignment = alignment
        writer.add_custom_alignment(alignment)
    if split is not None:
        writer.add_uint16("split.no", split[0])
        writer.add_uint16("split.count", split[1])
        writer.add_int32("split.tensors.count", split[2])
    for key, value, value_type, sub_type in metadata:
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for tensor in tensors:
        float_type = tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        data = np.asarray(tensor.data) if float_type else np.asarray(tensor.data).view(np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def relaid(source: Path, out: Path, alignment: int = 32, order=list, cuts: tuple[int, ...] = ()) -> Path:
    """`source` written again by gguf's writer with `alignment`, its tensors in `order(tensors)`, cut at
    the tensor indices `cuts` into a gguf-split set (its names and keys, metadata in shard 1 only);
    returns the file or shard 1."""
    reader = GGUFReader(source)
    tensors = order(list(reader.tensors))
    bounds = [0, *cuts, len(tensors)]
    count = len(bounds) - 1
    out.mkdir()
    paths = (
        [out / "m.gguf"]
        if count == 1
        else [out / f"m-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]
    )
    for index, path in enumerate(paths):
        split = None if count == 1 else (index, count, len(tensors))
        metadata = _metadata(reader) if index == 0 else []
        _write(path, metadata, tensors[bounds[index] : bounds[index + 1]], alignment, split)
    return paths[0]


def _expert_cuts(tensors: list) -> tuple[int, ...]:
    """A cut before every routed-expert tensor: a layer's gate, up and down in three shards."""
    return tuple(index for index, tensor in enumerate(tensors) if "_exps." in tensor.name)


LAYOUTS = {
    "alignment 64": dict(alignment=64),
    "alignment 4096": dict(alignment=4096),
    "tensors in reverse order": dict(order=lambda tensors: tensors[::-1]),
    "split, metadata-only first shard": dict(cuts=(0, 80)),
    "split inside each layer's experts, alignment 64": dict(alignment=64, cuts="experts"),
}


@pytest.fixture(scope="module")
def original(tiny_model):
    path = tiny_model(**DYNAMIC)
    return path, greedy(k3stream.load(path), PROMPT, 6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_relaid_file_packs_verifies_and_streams_the_same_logits(original, tmp_path, layout):
    source, (expected_tokens, expected_logits) = original
    spec = dict(LAYOUTS[layout])
    if spec.get("cuts") == "experts":
        spec["cuts"] = _expert_cuts(list(GGUFReader(source).tensors))
    path = relaid(source, tmp_path / "relaid", **spec)
    if spec.get("alignment", 32) != 32:
        assert {t.data_offset % spec["alignment"] for t in GGUFReader(path).tensors} == {0}
    manifest = build_pack(path, options=BuildOptions(progress=False, margin_bytes=0)).manifest
    assert verify_pack(manifest, full=True)["ok"]
    with (
        ExpertPack(manifest) as pack,
        ExpertStore(pack, ram_mib=(pack.top_k + 2) * pack.object_bytes / MIB) as store,
    ):
        tokens, logits = greedy(k3stream.load(path, LoadOptions(expert_source=store)), PROMPT, 6)
        assert store.stats()["pack_reads"] > 0
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)
