"""`k3stream dequantize IN OUT`: rewrite a Kimi-K3 GGUF with every quantized tensor as F32.

Metadata and tokenizer are kept (split keys dropped: the output is one file); F32/F16/BF16 tensors are
copied as they are, unless `--all-f32` widens F16/BF16 to F32 as well (exact: every F16/BF16 value is
an F32 value). Tensors are streamed a slab of rows at a time, so memory stays bounded; an output larger
than the free disk space is refused before anything is written.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import numpy as np

from k3stream.gguf.config import field_value

SLAB_ELEMENTS = 1 << 22  # rows are dequantized ~16 MiB of F32 at a time
# the writer's own (general.alignment: the copy lays its data out at the writer's 32 bytes)
_NOT_COPIED = ("GGUF.", "general.architecture", "general.alignment", "split.")
ALL_F32, MOSTLY_F16 = 0, 1  # general.file_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN", help="a GGUF, any shard of a split set, or a directory")
    parser.add_argument("output", metavar="OUT", help="the F32 GGUF to write (one file)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    parser.add_argument("--all-f32", action="store_true", help="widen F16/BF16 tensors to F32 as well")


def _copy_metadata(writer, checkpoint, out_types: list[int]) -> None:
    """Shard 1's metadata, less the split keys, with general.file_type describing the output."""
    for key, field in checkpoint.fields.items():
        if key.startswith(_NOT_COPIED):
            continue
        if key == "general.file_type":
            writer.add_uint32(key, ALL_F32 if set(out_types) == {0} else MOSTLY_F16)
            continue
        sub_type = field.types[-1] if len(field.types) > 1 else None
        value = field_value(field, str(checkpoint.shards[0]))
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


def _out_type(ggml_type: int, kept: tuple[int, ...]) -> int:
    """`kept` types are copied byte for byte; every other type is rewritten as F32."""
    return ggml_type if ggml_type in kept else ALL_F32


def _row_slabs(info, raw: np.ndarray) -> Iterator[np.ndarray]:
    """F32 rows of a quantized tensor, a bounded slab at a time."""
    from k3stream.quant import dequantize

    n_rows = int(np.prod(info.shape[:-1]))
    rows = raw.reshape(n_rows, info.nbytes // n_rows)
    step = max(1, SLAB_ELEMENTS // info.shape[-1])
    for start in range(0, rows.shape[0], step):
        yield dequantize(np.ascontiguousarray(rows[start : start + step]), info.ggml_type).numpy()


def _write_data(writer, fout, checkpoint, kept: tuple[int, ...]) -> None:
    for name, info in checkpoint.tensors.items():
        writer.write_padding(fout, fout.tell())
        raw = checkpoint.raw(name)
        if info.ggml_type in kept:
            fout.write(memoryview(raw))
            written = info.nbytes
        else:
            written = 0
            for slab in _row_slabs(info, raw):
                fout.write(slab.astype(np.float32, copy=False).tobytes())
                written += slab.nbytes
        writer.write_padding(fout, written)


def dequantize_gguf(source: str | Path, output: str | Path, floats_to_f32: bool = False) -> Path:
    """Write `output`: the checkpoint at `source` with quantized tensors as F32. Returns `output`.

    With `floats_to_f32`, F16/BF16 tensors are widened to F32 too, so every tensor is F32.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from k3stream.gguf.config import ARCH
    from k3stream.gguf.layout import FLOAT_TYPE_IDS
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.gguf.shards import file_output, refuse_source_output
    from k3stream.gguf.writer import check_free_space

    checkpoint = K3Checkpoint.open(source)
    output = file_output(output, "OUT")
    refuse_source_output(output, checkpoint.shards, "the output")
    temp = output.with_name(output.name + ".tmp")
    kept = (ALL_F32,) if floats_to_f32 else FLOAT_TYPE_IDS
    out_types = [_out_type(info.ggml_type, kept) for info in checkpoint.tensors.values()]
    sizes = [
        int(np.prod(info.shape)) * GGML_QUANT_SIZES[GGMLQuantizationType(out_type)][1]
        for info, out_type in zip(checkpoint.tensors.values(), out_types, strict=True)
    ]
    check_free_space(output.parent, sum(sizes))
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(temp, ARCH)
    try:
        _copy_metadata(writer, checkpoint, out_types)
        for info, out_type, n_bytes in zip(checkpoint.tensors.values(), out_types, sizes, strict=True):
            # the numpy dtype only matters when it is uint8 (byte shapes); the GGML type is explicit
            writer.add_tensor_info(
                info.name, info.shape, np.dtype(np.float32), n_bytes, raw_dtype=GGMLQuantizationType(out_type)
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        _write_data(writer, fout, checkpoint, kept)
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(temp, output)
    except BaseException:  # an error or Ctrl-C: no open writer and no half-written OUT.tmp left behind
        with suppress(OSError):  # closing flushes, which fails again on a full disk; the file closes anyway
            writer.close()
        temp.unlink(missing_ok=True)
        raise
    return output


def run(args: argparse.Namespace) -> int:
    from k3stream.gguf.shards import file_output

    output = file_output(args.output, "OUT")
    if output.exists() and not args.force:
        raise FileExistsError(f"{output}: already exists (use --force to overwrite)")
    dequantize_gguf(args.input, output, floats_to_f32=args.all_f32)
    print(output)
    return 0
