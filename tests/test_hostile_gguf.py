"""Crafted GGUF headers and manifests (issue 11): a one-line error in well under a second and well under
100 MiB, never a traceback, an allocation the file cannot back, or a read without bound."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from k3stream.gguf.header import GGUFHeaderError, check_header
from k3stream.gguf.reader import K3Checkpoint
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.manifest import load_manifest, read_json
from k3stream.pack.reader import ExpertPack
from k3stream.pack.source import checked_shards, first_shard_path
from k3stream.pack.verify import verify_pack
from k3stream.testing.hostile import GGUF_CASES, GGUF_HEAVY_CASES, manifest_cases, write_manifest_case

MIB = 1 << 20


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_crafted_gguf_header_is_refused_quickly_in_one_line(case, tmp_path):
    path = GGUF_CASES[case](tmp_path / "crafted.gguf")
    tracemalloc.start()
    began = time.perf_counter()
    try:
        with pytest.raises(ValueError) as caught:
            K3Checkpoint.open(path)
        seconds = time.perf_counter() - began
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert isinstance(caught.value, GGUFHeaderError)
    assert "\n" not in message and message.startswith(str(path)) and "not a valid GGUF header" in message
    assert seconds < 0.5 and peak < 16 * MIB


@pytest.mark.parametrize("case", list(GGUF_HEAVY_CASES))
def test_largest_legal_headers_stay_cheap(case, tmp_path):
    """At the header limits GGUFReader parses the file; the compact reader keeps that cheap (GGUFReader
    itself made one array per element: seconds and hundreds of MiB, or far more)."""
    path = GGUF_HEAVY_CASES[case](tmp_path / "heavy.gguf")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="missing metadata key"):
            K3Checkpoint.open(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MIB  # the memory, not a wall time: the machine's load must not decide it


def test_compact_reader_reads_what_gguf_reader_reads(tiny_model):
    import numpy as np
    from gguf import GGUFReader

    from k3stream.gguf.header import open_reader

    path = tiny_model(recipe="audited", latent=256, expert_ff=256, kv_lora=256, qk_nope=32)
    theirs, ours = GGUFReader(str(path)), open_reader(path)
    assert list(theirs.fields) == list(ours.fields)
    for key, field in theirs.fields.items():
        assert field.contents() == ours.fields[key].contents(), key
    for a, b in zip(theirs.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == (
            b.name,
            b.tensor_type,
            list(b.shape),
            b.data_offset,
            b.n_bytes,
        )
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))
        assert not b.data.flags.writeable


def test_cli_inspect_of_a_crafted_gguf_prints_one_line(tmp_path, capsys):
    from k3stream.cli import main

    path = GGUF_CASES["array of 2^40 elements"](tmp_path / "crafted.gguf")
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "array length of tokenizer.ggml.token_type" in err


@pytest.mark.parametrize("command", ["inspect", "verify", "pack", "generate"])
def test_the_pack_file_given_as_the_model_points_at_its_manifest(tiny_model, tmp_path, command, capsys):
    """The `.pack` beside the GGUF is not a model path: the line says what the file is and names the
    manifest to give instead, not a bare "not a valid GGUF header: the magic is not GGUF"."""
    from k3stream.cli import main
    from pack_helpers import copy_model

    gguf = copy_model(tiny_model(), tmp_path)
    manifest = build_pack(gguf, options=BuildOptions(progress=False, margin_bytes=0)).manifest
    pack = manifest.with_name(manifest.name.removesuffix(".manifest.json"))
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(pack), *prompt]) == 1
    wanted = f"{pack}: an expert pack, not a GGUF; give its manifest {manifest} or the GGUF"
    assert capsys.readouterr().err == f"k3stream {command}: error: {wanted}\n"


@pytest.mark.parametrize("command", ["pack", "dequantize"])
def test_a_manifest_given_where_a_gguf_must_be_says_so(tiny_model, tmp_path, command, capsys):
    """`pack` and `dequantize` read a GGUF, not the manifest the other commands take: the line says what
    the file is, not a bare "not a valid GGUF header: the magic is not GGUF"."""
    from k3stream.cli import main
    from pack_helpers import copy_model

    shapes = dict(latent=256, expert_ff=256, kv_lora=256, qk_nope=32)  # the recipe's blocks fit
    gguf = copy_model(tiny_model(recipe="dynamic", **shapes), tmp_path)
    manifest = build_pack(gguf, options=BuildOptions(progress=False, margin_bytes=0)).manifest
    output = [str(tmp_path / "f32.gguf")] if command == "dequantize" else []
    assert main([command, str(manifest), *output]) == 1
    wanted = f"{manifest}: an expert pack's manifest, not a GGUF; give the GGUF it names"
    assert capsys.readouterr().err == f"k3stream {command}: error: {wanted}\n"
    assert not (tmp_path / "f32.gguf").exists()


@pytest.mark.parametrize("command", ["pack", "dequantize"])
def test_a_json_file_that_is_no_manifest_is_named_as_no_gguf(tmp_path, command, capsys):
    """A `.json` file that is not an expert pack's manifest (here the shipped model's training record)
    is called what it is not, a GGUF, naming it; not a manifest it is not."""
    from importlib.resources import files

    from k3stream.cli import main

    record = tmp_path / "record.json"
    record.write_bytes(files("k3stream").joinpath("data", "k3-stdlib.json").read_bytes())
    output = [str(tmp_path / "f32.gguf")] if command == "dequantize" else []
    assert main([command, str(record), *output]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"k3stream {command}: error: {record}: not a valid GGUF header: the magic is not GGUF"
    )
    assert "manifest" not in err and err.count("\n") == 1
    assert not (tmp_path / "f32.gguf").exists()


@pytest.mark.parametrize("kept", [0.5, 0.99])
def test_a_gguf_cut_short_says_so_naming_the_first_tensor_it_lacks(tiny_model, tmp_path, kept, capsys):
    """A partial download: whole header, data cut off. The line says the file is cut short, where the
    first tensor it lacks ends and how many bytes the file has, not a bare "not a valid GGUF header"."""
    import shutil

    from gguf import GGUFReader

    from k3stream.cli import main

    source = tiny_model(recipe="iq4_xs", hidden=256, expert_ff=256, latent=256, dense_ff=256)
    path = tmp_path / "partial.gguf"
    shutil.copy(source, path)
    size = int(path.stat().st_size * kept)
    with path.open("r+b") as stream:
        stream.truncate(size)
    lacking = next(t for t in GGUFReader(source).tensors if t.data_offset + t.n_bytes > size)
    end = lacking.data_offset + lacking.n_bytes
    assert main(["inspect", str(path)]) == 1
    wanted = (
        f"k3stream inspect: error: {path}: cut short: tensor {lacking.name} ends at byte {end}, the file "
        f"has {size} bytes (an incomplete download or copy)\n"
    )
    assert capsys.readouterr().err == wanted


@pytest.mark.parametrize("spec", [{}, {"shards": 3}, {"recipe": "f16"}])
def test_real_tiny_ggufs_pass_the_header_check(tiny_model, spec):
    first = tiny_model(**spec)
    for path in sorted(first.parent.glob("*.gguf")):
        check_header(path)


@pytest.mark.parametrize("new_type", ["Q8_0", "IQ1_S"])  # larger: overlaps the next tensor; smaller: a gap
def test_a_tensor_whose_type_was_changed_is_refused_naming_the_next_tensor(tiny_model, tmp_path, new_type):
    """A GGUF with one tensor's type edited reads that tensor's and its neighbour's bytes as something
    else: llama.cpp refuses it (offsets must follow each other), and so must k3stream, before any work."""
    from gguf import GGMLQuantizationType, GGUFReader

    source = tiny_model(recipe="iq2_xxs", latent=256, expert_ff=256)
    tensors = GGUFReader(source).tensors
    index = next(i for i, t in enumerate(tensors) if t.name == "blk.1.ffn_gate_exps.weight")
    data = bytearray(source.read_bytes())
    name = tensors[index].name.encode()
    type_at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4 + 8 * 3
    data[type_at : type_at + 4] = GGMLQuantizationType[new_type].value.to_bytes(4, "little")
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(data)
    with pytest.raises(GGUFHeaderError) as caught:
        K3Checkpoint.open(edited)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(edited))
    assert f"tensor {tensors[index + 1].name} data is at offset" in message


@pytest.fixture(scope="module")
def manifest(tiny_model, tmp_path_factory) -> Path:
    from pack_helpers import copy_model

    model = copy_model(tiny_model(), tmp_path_factory.mktemp("hostile"))
    return build_pack(model, options=BuildOptions(progress=False)).manifest


def _readers():
    return {
        "verify": verify_pack,
        "ExpertPack": ExpertPack,
        "non-expert loader": lambda path: checked_shards(load_manifest(path), path),
        "engine's model resolution": lambda path: first_shard_path(read_json(path), path),
    }


@pytest.mark.parametrize("case", list(manifest_cases(Path("m"))))
def test_hostile_manifest_gives_a_one_line_error(manifest, case):
    path = write_manifest_case(
        manifest, manifest.with_name(f"case-{abs(hash(case))}.json"), manifest_cases(manifest)[case]
    )
    try:
        for name, read in _readers().items():
            began = time.perf_counter()
            try:
                read(path)
            except (ValueError, OSError) as exc:
                assert "\n" not in str(exc), (name, str(exc))
            assert time.perf_counter() - began < 2, name
    finally:
        path.unlink()


def test_wrong_field_types_are_named(manifest, tmp_path):
    path = write_manifest_case(manifest, tmp_path / "m.json", manifest_cases(manifest)["shard index null"])
    with pytest.raises(
        ValueError, match=r"^Kimi manifest field source\.shards\[0\]\.index must be a non-negative"
    ):
        load_manifest(path)


def test_oversized_manifest_is_refused(tmp_path, monkeypatch):
    from k3stream.pack import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1024)
    big = tmp_path / "big.json"
    big.write_text('{"x": "' + "a" * 4096 + '"}')
    with pytest.raises(ValueError, match="larger than"):
        manifest_module.read_json(big)
