"""Hostile manifests, command-line text and HTTP bodies: each is run or refused in one line (a 4xx naming
the field, over HTTP), never a traceback, a 5xx, a hang or a server that stops answering."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import socket
import struct
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzing import SMALL, fuzz_settings
from k3stream import LoadOptions
from k3stream.engine.loading import load_runtime
from k3stream.pack.builder import BuildOptions, build_pack
from k3stream.pack.manifest import inventory_sha256
from pack_helpers import copy_model

FUZZ = fuzz_settings(80)
DELETE = object()  # a field taken out of the body
HOSTILE = {
    "string": "x",
    "-1": -1,
    "2^64": 1 << 64,
    "1.5": 1.5,
    "NaN": math.nan,
    "null": None,
    "[]": [],
    "{}": {},
    "true": True,
    "deleted": DELETE,
}

# ---- manifests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tiny_model, tmp_path_factory) -> Path:
    """A folder holding a small model, its pack and its manifest (relative paths: copies read theirs)."""
    directory = tmp_path_factory.mktemp("packed")
    options = BuildOptions(progress=False, relative_paths=True, margin_bytes=0)
    return build_pack(copy_model(tiny_model(**SMALL), directory), options=options).manifest


def field_paths(value: object, path: tuple = ()) -> list[tuple]:
    """Every key path of a JSON value (lists: their first two items)."""
    paths = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            paths += field_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:2]):
            paths += field_paths(item, (*path, index))
    return paths


def edited(document: dict, path: tuple, value: object) -> dict:
    changed = copy.deepcopy(document)
    parent = changed
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE and isinstance(parent, list):
        del parent[path[-1]]
    elif value is DELETE:
        parent.pop(path[-1], None)  # an optional field the base body leaves out
    else:
        parent[path[-1]] = value
    return changed


def loaded_or_refused(manifest: Path) -> None:
    """The manifest's model loads and runs a token, or is refused in one line; nothing else."""
    try:
        runtime = load_runtime(manifest, LoadOptions(expert_ram_mib=1, prefetch=False))
    except (ValueError, OSError) as exc:
        assert "\n" not in str(exc), str(exc)
        return
    try:
        assert runtime.model.logits([1, 2]).isfinite().all()
    finally:
        runtime.close()


@FUZZ
@given(data=st.data())
def test_manifest_fields_of_another_type_or_missing_are_run_or_refused(packed, tmp_path_factory, data):
    document = json.loads(packed.read_text())
    path = data.draw(st.sampled_from(field_paths(document)), label="field")
    value = HOSTILE[data.draw(st.sampled_from(sorted(HOSTILE)), label="value")]
    changed = edited(document, path, value)
    if isinstance(changed.get("source"), dict):  # reach the checks past the inventory's hash
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            changed["source"]["inventory_sha256"] = inventory_sha256(changed["source"])
    folder = tmp_path_factory.mktemp("edited")
    for file in packed.parent.iterdir():
        (folder / file.name).symlink_to(file)
    manifest = folder / packed.name
    manifest.unlink()
    manifest.write_text(json.dumps(changed))
    loaded_or_refused(manifest)


@pytest.mark.parametrize(
    ("records", "key"),
    [
        ("shards", "size"),
        ("shards", "metadata_nbytes"),
        ("shards", "metadata_sha256"),
        ("tensors", "name"),
        ("tensors", "shard_index"),
        ("tensors", "dtype"),
    ],
)
def test_a_source_record_without_a_key_is_named(packed, tmp_path, records, key):
    """Loading such a manifest raised KeyError (a traceback from `generate`)."""
    document = json.loads(packed.read_text())
    del document["source"][records][0][key]
    document["source"]["inventory_sha256"] = inventory_sha256(document["source"])
    for file in packed.parent.iterdir():
        (tmp_path / file.name).symlink_to(file)
    manifest = tmp_path / packed.name
    manifest.unlink()
    manifest.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=rf"^Kimi manifest field is missing: source\.{records}\[0\]\.{key}$"):
        load_runtime(manifest, LoadOptions(expert_ram_mib=1, prefetch=False))


# ---- command-line text ---------------------------------------------------------------------------


@pytest.mark.parametrize("escape", ["--no-escape", "--escape"])
@pytest.mark.parametrize("flag", ["--prompt", "--stop"])
def test_text_that_is_not_utf8_is_named(tiny_model, capsys, flag, escape):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates; with --no-escape the tokenizer
    raised "'utf-8' codec can't encode character '\\udcff'", naming no flag; with escapes on (the
    default) the error blamed escapes the text did not hold."""
    from k3stream.cli import main

    text = "caf\udcff"  # argv's decoding of b"caf\xff"
    given = ["--prompt", text] if flag == "--prompt" else ["--prompt", "hi", "--stop", text]
    assert main(["generate", str(tiny_model(**SMALL)), escape, "-n", "1", *given]) == 1
    assert capsys.readouterr().err == f"k3stream generate: error: {flag}: not UTF-8 text (character 3)\n"


def test_tokenizer_time_grows_linearly_on_long_runs_of_one_character(tokenizer):
    """200,000 characters of one kind (one pre-tokenizer piece, or thousands) encode and decode back in
    well under the time a quadratic merge would take (minutes)."""
    began = time.perf_counter()
    for text in ("a", " ", "\x00", "中", "😀", "\n", "a1!中 "):
        long = text * (200_000 // len(text))
        assert tokenizer.decode(tokenizer.encode(long)) == long
    assert time.perf_counter() - began < 30


# ---- HTTP bodies ---------------------------------------------------------------------------------

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/completion": {"prompt": "hi", "n_predict": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"content": "hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
}
# fields the endpoints read besides those of BODIES
FIELDS = (
    "n", "stop", "logit_bias", "tools", "tool_choice", "temperature", "top_p", "top_k", "seed", "stream",
    "response_format", "min_p", "logprobs", "max_completion_tokens", "grammar", "json_schema", "system",
    "stream_options", "parallel_tool_calls", "instructions", "text", "chat_template_kwargs", "thinking",
)  # fmt: skip
BIG = {
    "10^4 stops": ["x"] * 10_000,
    "10^5 characters": "a" * 100_000,
    "depth 200": json.loads("[" * 200 + "]" * 200),
}


@pytest.fixture(scope="module")
def server(tiny_model, one_torch_thread):
    from k3stream.server.app import ServerConfig, create_app
    from k3stream.server.live import ServerThread
    from k3stream.server.runtime import served_from_runtime

    runtime = load_runtime(tiny_model(**SMALL), LoadOptions(prefetch=False))
    served = served_from_runtime(runtime, ctx=128)
    app = create_app(served, ServerConfig(max_batch=2, max_queue=4))
    thread = ServerThread(app).start()
    yield thread.url
    thread.stop()
    app.state.scheduler.stop()
    served.close()


def post(url: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        url, content=body, headers={"content-type": "application/json", **(headers or {})}, timeout=30
    )


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_every_field_of_another_type_gets_a_4xx_and_the_server_goes_on(server, data):
    endpoint = data.draw(st.sampled_from(sorted(BODIES)), label="endpoint")
    paths = field_paths(BODIES[endpoint]) + [(name,) for name in FIELDS]
    path = data.draw(st.sampled_from(paths), label="field")
    values = {**HOSTILE, **BIG}
    value = values[data.draw(st.sampled_from(sorted(values)), label="value")]
    body = json.dumps(edited(BODIES[endpoint], path, value)).encode()
    response = post(server + endpoint, body)
    assert response.status_code < 500, (endpoint, path, response.text[:300])
    if response.status_code == 400 and endpoint != "/v1/messages":  # Anthropic's body has no param
        error = response.json()["error"]
        assert error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"{",
        b"[]",
        b"null",
        b"123",
        b'"text"',
        b"\xff\xfe",
        b"[" * 100_000,
        b'{"prompt": "\\ud800"}',
    ],
)
def test_bodies_that_are_no_json_object_get_400(server, body):
    for endpoint in BODIES:
        response = post(server + endpoint, body)
        assert response.status_code == 400, (endpoint, body[:20], response.text[:200])
    assert post(server + "/v1/completions", json.dumps(BODIES["/v1/completions"]).encode()).status_code == 200


def consts(count: int) -> dict:
    """A schema of `count` alternatives, 2 x count + 2 JSON values: llguidance's compile grows with them."""
    return {"anyOf": [{"const": f"v{k}"} for k in range(count)]}


@pytest.mark.parametrize(
    ("field", "schemas", "param"),
    [
        ("response_format", [consts(10_000)], "response_format.json_schema.schema"),
        ("tools", [consts(10_000)], "tools.0.function.parameters"),
        ("tools", [{"type": "object", **consts(6_000)}] * 6, "tools"),
    ],
)
def test_a_schema_too_large_to_compile_quickly_is_refused_by_name(server, field, schemas, param):
    if field == "response_format":
        body = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schemas[0]}}
        }
    else:
        tools = [
            {"type": "function", "function": {"name": f"f{k}", "parameters": schema}}
            for k, schema in enumerate(schemas)
        ]
        body = {"tools": tools, "tool_choice": "required"}
    response = post(
        server + "/v1/chat/completions", json.dumps({**BODIES["/v1/chat/completions"], **body}).encode()
    )
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == param
    assert "at most" in response.json()["error"]["message"]


def test_a_content_length_larger_than_any_body_is_refused_at_once(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10**15}\r\n\r\n{{}}"
        )
        connection.sendall(request.encode())
        status = connection.recv(4096).split(b"\r\n", 1)[0]
    assert b" 413 " in status, status
    assert post(server + "/v1/completions", json.dumps(BODIES["/v1/completions"]).encode()).status_code == 200


# ---- prompt-cache snapshot files -----------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot_files(tiny_model, tmp_path_factory):
    """A small model, a prompt, and the snapshot files a disk-tier cache wrote for it (their bytes)."""
    import torch

    import k3stream
    from k3stream.engine.fingerprints import model_fingerprint
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.gguf.reader import K3Checkpoint

    path = tiny_model(**SMALL)
    model = k3stream.load(path)
    fingerprint = model_fingerprint(K3Checkpoint.open(path).shards)
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("snapshots")
    cache = PromptCache(model, fingerprint, 64 << 20, folder, 1 << 30, every=16)
    cache.prefill(prompt.tolist())
    cache.close()
    files = {file: file.read_bytes() for file in cache.disk_dir.iterdir()}
    return Saved(model, fingerprint, prompt.tolist(), folder, files)


@dataclass(repr=False)  # hypothesis prints the fixtures of a failing example: not the files' bytes
class Saved:
    model: object
    fingerprint: str
    prompt: list[int]
    folder: Path
    files: dict[Path, bytes]

    def restore(self) -> None:
        """The snapshot files as the fixture wrote them, and no others (a test's cache writes more)."""
        for folder in {path.parent for path in self.files}:
            for path in folder.iterdir():
                if path not in self.files and path.is_file():
                    path.unlink()
        for path, content in self.files.items():
            path.write_bytes(content)


def with_header(data: bytes, key: str, value: object) -> bytes:
    """A snapshot file's bytes with its JSON header's `key` set to `value` (the checksum left as it was)."""
    from k3stream.engine.snapshot_files import MAGIC

    start = len(MAGIC) + 8
    (length,) = struct.unpack("<Q", data[len(MAGIC) : start])
    header = {**json.loads(data[start : start + length]), key: value}
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(raw)) + raw + data[start + length :]


HEADER_VALUES = {
    "ids past 2^63": [1 << 70],
    "negative ids": [-1] * 40,
    "a million ids": list(range(1_000_000)),
    "huge parent": [1 << 70, 1],
    "huge layer": [["kda", [1 << 40, 1 << 40], [1]]],
    "string": "x",
    "null": None,
}


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_a_damaged_snapshot_file_is_a_miss_or_the_cold_answer(snapshot_files, data):
    """Bits flipped, the file cut, its header length or a header field set to anything: a restarted
    cache starts, and the prompt's logits are the cold ones (a header of token ids past 2^63 raised
    struct.error at the start)."""
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.engine.snapshot_files import MAGIC

    model, prompt, files = snapshot_files.model, snapshot_files.prompt, snapshot_files.files
    file = data.draw(st.sampled_from(sorted(files)), label="file")
    original = files[file]
    damage = data.draw(st.sampled_from(["flip", "cut", "header length", "header field"]), label="damage")
    if damage == "flip":
        at = data.draw(st.integers(0, len(original) - 1), label="byte")
        damaged = (
            original[:at] + bytes([original[at] ^ 1 << data.draw(st.integers(0, 7))]) + original[at + 1 :]
        )
    elif damage == "cut":
        damaged = original[: data.draw(st.integers(0, len(original) - 1), label="kept")]
    elif damage == "header length":
        length = data.draw(st.sampled_from([0, 1, 1 << 20, 1 << 33, (1 << 64) - 1]), label="length")
        damaged = MAGIC + struct.pack("<Q", length) + original[len(MAGIC) + 8 :]
    else:
        key = data.draw(st.sampled_from(["tokens", "parent", "layers", "identity", "rows_only"]), label="key")
        damaged = with_header(original, key, HEADER_VALUES[data.draw(st.sampled_from(sorted(HEADER_VALUES)))])
    try:
        file.write_bytes(damaged)
        cache = PromptCache(
            model, snapshot_files.fingerprint, 64 << 20, snapshot_files.folder, 1 << 30, every=16
        )
        asked = [*prompt, 3]
        got = cache.prefill(asked)
        cache.close()
        assert torch_equal(got.logits, model.prefill_last(model.new_state(), asked))
    finally:
        snapshot_files.restore()


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("tokens", [[1 << 70], [-1]])
def test_a_snapshot_header_of_ids_no_file_name_packs_is_skipped_at_the_start(snapshot_files, tokens, caplog):
    """Token ids past 2^63 (or negative) in a header raised struct.error from the cache's start (the
    file name hashes the ids packed as int64): a server with that --cache-dir failed to start."""
    from k3stream.engine.prompt_cache import PromptCache

    (file, original), *_ = snapshot_files.files.items()
    try:
        file.write_bytes(with_header(original, "tokens", tokens))
        cache = PromptCache(
            snapshot_files.model, snapshot_files.fingerprint, 64 << 20, snapshot_files.folder, 1 << 30
        )
        assert cache.stats.disk_errors == 1 and "not integers in 0..2^63-1" in caplog.text
        cache.close()
    finally:
        snapshot_files.restore()


# ---- KL-divergence base files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def kld_base(model_path, tmp_path_factory) -> tuple[Path, Path]:
    """The default tiny model and a KL-divergence base `k3stream perplexity` wrote of it."""
    import textwrap

    from k3stream.cli import main

    base = tmp_path_factory.mktemp("kld") / "base.zip"
    args = ["perplexity", str(model_path), "--file", textwrap.__file__, "--ctx", "32", "--chunks", "2"]
    assert main([*args, "--kl-divergence-base", str(base)]) == 0
    return model_path, base


def with_member(base: Path, target: Path, name: str, payload: bytes) -> Path:
    """A copy of the zip `base` whose member `name` holds `payload`, every other member as it was."""
    import zipfile

    with zipfile.ZipFile(base) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as copy:
        for info in source.infolist():
            copy.writestr(info.filename, payload if info.filename == name else source.read(info))
    return target


def npy_claiming(shape: tuple[int, ...]) -> bytes:
    """A .npy header of int32 `shape` followed by 64 bytes: an array its member cannot hold."""
    import io

    import numpy as np

    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": "<i4", "fortran_order": False, "shape": shape})
    return stream.getvalue() + bytes(64)


@pytest.mark.parametrize("damage", ["claims 4 TB", "bomb", "flipped", "object dtype"])
def test_a_damaged_kl_divergence_base_is_refused_in_one_line(kld_base, tmp_path, capsys, damage):
    """A member's header claiming 10^12 elements raised MemoryError; 200 MiB of zeros compressed into a
    few hundred KiB was read whole; a flipped bit raised zlib.error or BadZipFile: each a traceback."""
    import io
    import zipfile

    import numpy as np

    from k3stream.cli import main

    model, base = kld_base
    damaged = tmp_path / "damaged.zip"
    if damage == "claims 4 TB":
        with_member(base, damaged, "tokens.npy", npy_claiming((10**12,)))
    elif damage == "bomb":
        stream = io.BytesIO()
        np.save(stream, np.zeros(50_000_000, dtype=np.int32))
        with_member(base, damaged, "tokens.npy", stream.getvalue())
    elif damage == "object dtype":
        header = b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (4,), }"
        with_member(base, damaged, "tokens.npy", header.ljust(128 - 1, b" ") + b"\n" + bytes(32))
    else:
        data = bytearray(base.read_bytes())
        with zipfile.ZipFile(base) as archive:
            info = archive.getinfo("scale.npy")
        name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
        data[info.header_offset + 30 + name_length + extra_length + 4] ^= 0x10  # in its deflated bytes
        damaged.write_bytes(data)
    tracemalloc.start()
    try:
        assert main(["perplexity", str(model), "--kl-divergence", "--kl-divergence-base", str(damaged)]) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{damaged}: not a k3stream KL-divergence base file" in err, err
    assert peak < 64 << 20  # the bomb's 200 MB of tokens is never made


def test_a_fifo_a_folder_or_a_link_loop_among_snapshot_files_is_skipped(snapshot_files, caplog):
    """A FIFO named like a snapshot hung the cache's start for good (its open waits for a writer): a
    server with that --cache-dir never answered. Each such entry is now skipped with a warning."""
    import os
    import threading

    from k3stream.engine.prompt_cache import PromptCache

    folder = next(iter(snapshot_files.files)).parent
    odd = [folder / f"{'f' * 32}.k3snap", folder / f"{'d' * 32}.k3snap", folder / "loop.k3snap"]
    os.mkfifo(odd[0])
    odd[1].mkdir()
    odd[2].symlink_to(odd[2])
    started: list[PromptCache] = []

    def start() -> None:
        started.append(
            PromptCache(
                snapshot_files.model, snapshot_files.fingerprint, 64 << 20, snapshot_files.folder, 1 << 30
            )
        )

    try:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(30)
        if thread.is_alive():  # unblock the FIFO's open, so the thread ends
            os.close(os.open(odd[0], os.O_WRONLY | os.O_NONBLOCK))
            thread.join(5)
            pytest.fail("the cache's start hung on a FIFO in its folder")
        assert started[0].stats.disk_errors == 3
        assert caplog.text.count("not a regular file") == 2 and "symbolic links" in caplog.text
        prompt = [*snapshot_files.prompt, 3]
        assert started[0].prefill(prompt).reused == len(snapshot_files.prompt)  # the real file still serves
        started[0].close()
    finally:
        odd[0].unlink()
        odd[1].rmdir()
        odd[2].unlink()
        snapshot_files.restore()
