"""GGUFs from other writers than the generator and llama.cpp's quantizer: gguf-py's GGUFWriter with
another data alignment, metadata and tensors in other orders, keys k3stream does not know, and shards
split as gguf-split splits them (the first holding the metadata alone). Each runs as the original does,
bit for bit; what llama.cpp refuses is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import k3stream
from k3stream.cli import main
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.manifest import inventory_sha256
from k3stream.pack.verify import verify_pack
from test_model import tokens_for

SOURCE = dict(
    recipe="dynamic", latent=256, expert_ff=256, kv_lora=256, qk_nope=32, n_layers=3, mla_layers=(2,)
)
TOKENS = 12


def rewrite(
    source: Path,
    out: Path,
    alignment: int | None = None,
    alignment_type: GGUFValueType = GGUFValueType.UINT32,
    reverse: bool = False,
    unknown_keys: bool = False,
    split_max_tensors: int = 0,
    small_first_shard: bool = False,
) -> Path:
    """`source` written again by GGUFWriter; returns the first file written."""
    reader = GGUFReader(source)
    writer = GGUFWriter(
        out,
        arch=reader.fields["general.architecture"].contents(),
        split_max_tensors=split_max_tensors,
        small_first_shard=small_first_shard,
    )
    fields = [f for f in reader.fields.values() if not f.name.startswith(("GGUF.", "general.architecture"))]
    for field in reversed(fields) if reverse else fields:
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    if alignment is not None:
        writer.data_alignment = alignment
        writer.add_key_value("general.alignment", alignment, alignment_type)
    if unknown_keys:
        writer.add_string("someone.else.note", "written by another tool")
        writer.add_array("kimi-k3.future_per_layer_values", [1.5, 2.5, 3.5])
    for tensor in reversed(reader.tensors) if reverse else reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out.with_name(f"{out.stem}-00001-of-{len(writer.tensors):05d}.gguf") if split_max_tensors else out


@pytest.fixture(scope="module")
def original(tiny_model):
    """(path, tokens, logits) of the generator's file."""
    path = tiny_model(**SOURCE)
    model = k3stream.load(path)
    tokens = tokens_for(4, model.config.vocab_size, TOKENS)
    return path, tokens, model.logits(tokens)


@pytest.mark.parametrize(
    "variant",
    [
        dict(alignment=64),
        dict(alignment=256),
        dict(reverse=True, unknown_keys=True),
        dict(split_max_tensors=40, small_first_shard=True),
    ],
    ids=["alignment-64", "alignment-256", "reversed-with-unknown-keys", "split-metadata-first"],
)
def test_another_writers_file_runs_and_packs_as_the_original(original, tmp_path, variant):
    path, tokens, expected = original
    written = rewrite(path, tmp_path / "other.gguf", **variant)
    if variant.get("small_first_shard"):
        assert not GGUFReader(written).tensors and len(list(tmp_path.glob("other-*-of-*.gguf"))) > 2
    assert torch.equal(k3stream.load(written).logits(tokens), expected)
    manifest = build_pack(written, tmp_path / "other.pack", tmp_path / "other.manifest.json").manifest
    assert verify_pack(manifest, full=True)["ok"]


@pytest.mark.parametrize("stored_as", [GGUFValueType.UINT64, GGUFValueType.INT32], ids=lambda t: t.name)
def test_an_alignment_of_another_type_is_refused_naming_its_type(original, tmp_path, capsys, stored_as):
    """llama.cpp refuses general.alignment of any type but uint32, whatever its value."""
    written = rewrite(original[0], tmp_path / "other.gguf", alignment=64, alignment_type=stored_as)
    assert main(["inspect", str(written)]) != 0
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and str(written) in error
    assert f"general.alignment must be a uint32, got a {stored_as.name.lower()}" in error


def hub_cache_layout(shards: list[Path], cache: Path) -> list[Path]:
    """`shards` moved as huggingface_hub stores a download: each file under `blobs/` by its hash, and a
    snapshot folder of relative links by the file's own name; returns the links, in order."""
    blobs, snapshot = cache / "blobs", cache / "snapshots" / "0123abcd" / "UD-Q2_K_XL"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for position, shard in enumerate(sorted(shards)):
        blob = blobs / f"{position:02d}{'f' * 62}"
        shard.rename(blob)
        (snapshot / shard.name).symlink_to(Path("../../../blobs") / blob.name)
    return sorted(snapshot.glob("*.gguf"))


def test_a_split_set_in_a_hub_cache_packs_beside_its_links_and_generates(original, tmp_path, capsys):
    """A download by huggingface_hub: the shards' names are links to hash-named blobs. llama.cpp finds the
    set by the link names; so must the pack and every later run from its manifest."""
    rewrite(original[0], tmp_path / "kimi.gguf", split_max_tensors=30)
    links = hub_cache_layout(list(tmp_path.glob("kimi-*-of-*.gguf")), tmp_path / "hub")
    assert len(links) == 3
    assert main(["pack", str(links[1]), "--no-progress"]) == 0
    assert (links[0].parent / "kimi.expert-major.pack.manifest.json").is_file()
    capsys.readouterr()
    prompt = ["--prompt", "hello", "--max-tokens", "2", "--temperature", "0"]
    assert main(["generate", "-m", str(links[0]), *prompt]) == 0, capsys.readouterr().err


def test_a_manifest_naming_the_blobs_of_a_hub_cache_still_runs(original, tmp_path, capsys):
    """A manifest whose shard paths are the hash-named blobs (its writer followed the links) runs the
    shards it records, in its order: the blobs' names name no split set."""
    rewrite(original[0], tmp_path / "kimi.gguf", split_max_tensors=30)
    links = hub_cache_layout(list(tmp_path.glob("kimi-*-of-*.gguf")), tmp_path / "hub")
    manifest = build_pack(links[0], options=BuildOptions(progress=False)).manifest
    written = json.loads(manifest.read_text())
    for shard in written["source"]["shards"]:
        shard["path"] = str(Path(shard["path"]).resolve())
    written["source"]["inventory_sha256"] = inventory_sha256(written["source"])
    manifest.write_text(json.dumps(written))
    prompt = ["--prompt", "hello", "--max-tokens", "2", "--temperature", "0"]
    assert main(["generate", "-m", str(manifest), *prompt]) == 0, capsys.readouterr().err
