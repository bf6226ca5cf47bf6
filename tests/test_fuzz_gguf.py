"""Hostile GGUFs made from a real tiny model: every integer of its header (counts, lengths, value and
tensor types, dimensions, offsets) set to edge values, the file cut at every field, and metadata keys
given values of another type or out of range. Each is opened, loaded or refused with one line naming
the file (and the key or tensor), never a traceback, a huge allocation or a wrong model."""

from __future__ import annotations

import functools
import math
import shutil
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType
from hypothesis import given, settings
from hypothesis import strategies as st

import k3stream
from fuzzing import SMALL, fuzz_settings
from k3stream.gguf.header import SCALAR_FORMATS, STRING
from k3stream.gguf.reader import K3Checkpoint
from pack_helpers import rewritten

MIB = 1 << 20
UNSIGNED = {1: "B", 2: "H", 4: "I", 8: "Q"}
FUZZ = fuzz_settings(120)


def header_fields(data: bytes) -> list[tuple[str, int, str]]:
    """`(what, byte offset, struct format)` of each integer in a GGUF header (a string array's first
    and last lengths, a number array's first two values), walked from the file's own counts."""
    fields: list[tuple[str, int, str]] = []
    position = 4

    def take(what: str, fmt: str, record: bool = True) -> int:
        nonlocal position
        (value,) = struct.unpack_from("<" + fmt, data, position)
        if record:  # edited as the unsigned integer of its size
            fields.append((what, position, UNSIGNED[struct.calcsize(fmt)]))
        position += struct.calcsize(fmt)
        return value

    take("version", "I")
    tensor_count, kv_count = take("tensor count", "Q"), take("metadata count", "Q")
    for index in range(kv_count):
        key_length = take(f"length of key {index}", "Q")
        key = data[position : position + key_length].decode()
        position += key_length
        vtype = take(f"value type of {key}", "I")
        if vtype in SCALAR_FORMATS:
            take(f"value of {key}", SCALAR_FORMATS[vtype])
        elif vtype == STRING:
            length = take(f"string length of {key}", "Q")  # `position += take()` would lose take's step
            position += length
        else:
            element, length = take(f"array type of {key}", "I"), take(f"array length of {key}", "Q")
            for item in range(length):
                record = item in (0, 1, length - 1)
                if element == STRING:
                    length_of_item = take(f"string {item} length of {key}", "Q", record)
                    position += length_of_item
                else:
                    take(f"item {item} of {key}", SCALAR_FORMATS[element], record)
    for index in range(tensor_count):
        name_length = take(f"name length of tensor {index}", "Q")
        name = data[position : position + name_length].decode()
        position += name_length
        for dim in range(take(f"dimension count of {name}", "I")):
            take(f"dimension {dim} of {name}", "Q")
        take(f"type of {name}", "I")
        take(f"offset of {name}", "Q")
    return fields


def edge_values(original: int, fmt: str) -> list[int]:
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    values = {0, 1, 2, 7, original + 1, original - 1, top, top >> 1, (top >> 1) + 1, 1 << 31, 1 << 16}
    return sorted(v for v in values if 0 <= v <= top and v != original)


@pytest.fixture(scope="module")
def source(tiny_model) -> Path:
    return tiny_model(**SMALL)


@functools.cache
def fields_of(path: Path) -> list[tuple[str, int, str]]:
    """`header_fields` of the file at `path` (not a fixture: hypothesis would print its every field)."""
    return header_fields(path.read_bytes())


def opened_or_refused(path: Path) -> K3Checkpoint | None:
    """The checkpoint at `path`, or None where it is refused in one line naming the file; fails on any
    other outcome (another exception, a message of several lines, seconds or 64 MiB spent)."""
    tracemalloc.start()
    began = time.perf_counter()
    try:
        return K3Checkpoint.open(path)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(str(path)) and "\n" not in message, message
        return None
    finally:
        seconds, peak = time.perf_counter() - began, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert seconds < 2 and peak < 64 * MIB, (seconds, peak)


@FUZZ
@given(data=st.data())
def test_every_header_integer_at_edge_values_is_opened_or_refused_in_one_line(source, tmp_path, data):
    what, offset, fmt = data.draw(st.sampled_from(fields_of(source)), label="field")
    original = struct.unpack_from("<" + fmt, source.read_bytes(), offset)[0]
    value = data.draw(st.sampled_from(edge_values(original, fmt)), label="value")
    path = tmp_path / "mutated.gguf"
    raw = bytearray(source.read_bytes())
    struct.pack_into("<" + fmt, raw, offset, value)
    path.write_bytes(raw)
    checkpoint = opened_or_refused(path)
    if checkpoint is not None:  # a file that opens must load, or be refused naming the file
        try:
            k3stream.load(path).logits([1, 2, 3])
        except ValueError as exc:
            assert str(path) in str(exc) and "\n" not in str(exc), (what, value, str(exc))


@FUZZ
@given(data=st.data())
def test_a_header_cut_at_any_field_is_refused_in_one_line(source, tmp_path, data):
    _what, offset, fmt = data.draw(st.sampled_from(fields_of(source)), label="field")
    cut = offset + data.draw(st.integers(0, struct.calcsize(fmt)), label="bytes into it")
    path = tmp_path / "cut.gguf"
    path.write_bytes(source.read_bytes()[:cut])
    assert opened_or_refused(path) is None


# kimi-k3 keys and values of another GGUF type or range; each is refused naming the file and the key
# (or, for a size, the tensor whose shape it contradicts)
HOSTILE_VALUES = {
    "string": ("x", GGUFValueType.STRING, None),
    "NaN": (math.nan, GGUFValueType.FLOAT32, None),
    "infinity": (math.inf, GGUFValueType.FLOAT64, None),
    "-1": (-1, GGUFValueType.INT32, None),
    "0": (0, GGUFValueType.UINT32, None),
    "2^63": (1 << 63, GGUFValueType.UINT64, None),
    "bool": (True, GGUFValueType.BOOL, None),
    "float": (2.5, GGUFValueType.FLOAT32, None),
    "int array": ([1, 2], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "string array": (["a"], GGUFValueType.ARRAY, GGUFValueType.STRING),
}


@settings(FUZZ, max_examples=40)  # each example writes and loads a model
@given(data=st.data())
def test_config_keys_of_another_type_or_range_are_refused_or_load(source, tmp_path, data):
    keys = sorted(key for key in GGUFReader(source).fields if key.startswith("kimi-k3."))
    key = data.draw(st.sampled_from(keys), label="key")
    value, vtype, sub_type = HOSTILE_VALUES[data.draw(st.sampled_from(sorted(HOSTILE_VALUES)), label="value")]
    path = rewritten(source, tmp_path / "typed.gguf", metadata={key: (value, vtype, sub_type)})
    checkpoint = opened_or_refused(path)
    if checkpoint is None:
        return
    logits = k3stream.load(path).logits([1, 2, 3])  # what opens runs, and gives finite logits
    assert logits.isfinite().all(), (key, value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("attention.layer_norm_rms_epsilon", math.nan),
        ("attention.layer_norm_rms_epsilon", -1e-5),
        ("expert_weights_scale", math.inf),
        ("activation.situ_beta", math.nan),
        ("activation.situ_beta", 0.0),
        ("activation.situ_linear_beta", math.nan),
        ("kda.gate_lower_bound", 2.5),
    ],
)
def test_a_non_finite_or_out_of_range_hyperparameter_is_named_at_open(source, tmp_path, key, value):
    """It loaded, and the first forward failed with "non-finite logits" naming neither file nor key
    (situ_linear_beta NaN and a positive gate bound even ran, quietly another model)."""
    path = rewritten(
        source, tmp_path / "hyper.gguf", metadata={f"kimi-k3.{key}": (value, GGUFValueType.FLOAT32)}
    )
    with pytest.raises(ValueError, match=rf"^{path}: metadata key kimi-k3\.{key} must be a (finite )?number"):
        K3Checkpoint.open(path)


@pytest.mark.parametrize("value", [0, 2.5, ["x"]])
def test_token_types_that_are_not_an_integer_array_are_named(source, tmp_path, value):
    """A scalar token_type raised TypeError ("'int' object is not iterable", a traceback); a string
    array said "invalid literal for int()" naming nothing."""
    from k3stream.engine.tokenizer import Tokenizer

    vtype = GGUFValueType.ARRAY if isinstance(value, list) else GGUFValueType.FLOAT32
    if value == 0:
        vtype = GGUFValueType.UINT32
    sub_type = GGUFValueType.STRING if isinstance(value, list) else None
    path = rewritten(
        source, tmp_path / "types.gguf", metadata={"tokenizer.ggml.token_type": (value, vtype, sub_type)}
    )
    with pytest.raises(
        ValueError, match=rf"^{path}: metadata key tokenizer.ggml.token_type must be an array of"
    ):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    ("value", "vtype", "sub_type"),
    [(list(range(593)), GGUFValueType.ARRAY, GGUFValueType.INT32), ("abc", GGUFValueType.STRING, None)],
)
def test_tokens_that_are_not_a_string_array_are_named_at_open(source, tmp_path, value, vtype, sub_type):
    """Tokens that are not an array of strings are the fault of that key, not of kimi-k3.vocab_size
    (a number array must not count as one token)."""
    path = rewritten(
        source, tmp_path / "tokens.gguf", metadata={"tokenizer.ggml.tokens": (value, vtype, sub_type)}
    )
    with pytest.raises(ValueError) as refused:
        K3Checkpoint.open(path)
    assert str(refused.value) == f"{path}: metadata key tokenizer.ggml.tokens must be an array of strings"


def test_a_key_name_holding_a_newline_is_shown_on_one_line(source, tmp_path, capsys):
    """A header error quoted the key's bytes raw: a key holding newlines (a string length off by one
    makes the next key's bytes part of it) printed several lines."""
    from k3stream.cli import main

    path = tmp_path / "newline.gguf"
    shutil.copyfile(source, path)
    raw = bytearray(path.read_bytes())
    offset = next(offset for what, offset, _fmt in header_fields(bytes(raw)) if what == "length of key 0")
    key_length = struct.unpack_from("<Q", raw, offset)[0]
    raw[offset + 8 : offset + 8 + key_length] = b"general\n" + bytes(
        raw[offset + 16 : offset + 8 + key_length]
    )
    struct.pack_into("<I", raw, offset + 8 + key_length, 77)  # an unknown value type: the key is quoted
    path.write_bytes(raw)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "general\\n" in err and str(path) in err


def test_a_tensor_name_holding_a_newline_is_shown_on_one_line(source, tmp_path, capsys):
    """The header passes (a name is any bytes); the model refuses the unknown tensor in one line."""
    import numpy as np

    from k3stream.cli import main

    path = rewritten(source, tmp_path / "named.gguf", extra={"odd\nname": np.zeros(32, dtype=np.float32)})
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "odd\\nname" in err and str(path) in err
