"""Kimi-K3 GGUFs written from a `TinySpec`: real files (metadata, tokenizer, tensors) that llama.cpp
loads and runs.

`write_model(out_dir, spec, vocab, weights)` writes one file or a split set `NAME-0000K-of-0000N.gguf`
in the spec's recipe, tensors streamed to disk one at a time. Without `weights` the values are
`initial_values` (seeded per tensor, so the same spec gives the same bytes and the recipes share their
values) with scales that keep activations O(1) through the depth; the trainer starts from them.
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3stream.gguf.header import MAX_TENSORS
from k3stream.gguf.layout import OMITTABLE, expected_shapes
from k3stream.gguf.mixed_recipes import WRITABLE_RECIPES, file_type, mixed_type, release_like
from k3stream.gguf.vocab import CHAT_TEMPLATE, Vocab

ARCH = "kimi-k3"
NAME = "tiny-kimi-k3"
FLOAT_RECIPES = ("f32", "f16")
RECIPES = (*FLOAT_RECIPES, "audited", *WRITABLE_RECIPES)

# GGML type ids (gguf.GGMLQuantizationType), spelled here to keep the import light.
F32, F16 = 0, 1

UINT32_MAX = 0xFFFFFFFF  # the GGUF type of every integer key written
FILE_TYPES = {"f32": 0, "f16": 1, "audited": 10}  # general.file_type: ALL_F32, MOSTLY_F16, MOSTLY_Q2_K


@dataclass(frozen=True)
class TinySpec:
    n_layers: int = 6
    mla_layers: tuple[int, ...] | None = None
    hidden: int = 64
    n_dense: int = 1
    dense_ff: int = 96
    kda_heads: int = 4
    kda_head_dim: int = 16
    conv_kernel: int = 4
    gate_lower_bound: float | None = -5.0
    mla_heads: int = 4
    q_lora: int | None = 32
    kv_lora: int = 32
    qk_nope: int = 16
    qk_rope: int = 8
    v_head_dim: int = 16
    n_experts: int = 16
    top_k: int = 4
    expert_ff: int = 32
    latent: int = 32
    n_shared: int = 1
    block_size: int = 2
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_eps: float = 1e-5
    context_length: int = 512
    recipe: str = "f32"
    # a mixed recipe's other matrices as published files store them (`mixed_recipes.release_like`), not
    # F32: real-dimension slices, whose F32 matrices would be gigabytes no release has
    release_matrices: bool = False
    shards: int = 1
    seed: int = 0
    vocab: int | None = None
    # optional tensor groups left out (`gguf.layout.OMITTABLE`: "attn_gate", "shexp"), as llama.cpp runs them
    without: tuple[str, ...] = ()

    def mla_layer_ids(self) -> tuple[int, ...]:
        """MLA layers: as given, else every 4th layer counted from 1 plus the last."""
        if self.mla_layers is not None:
            return tuple(sorted(set(self.mla_layers)))
        return tuple(sorted({i for i in range(self.n_layers) if (i + 1) % 4 == 0} | {self.n_layers - 1}))


# fields of at least 1 (q_lora may also be None: no query compression), and counts that may be 0
POSITIVE_FIELDS = (
    "hidden", "dense_ff", "kda_heads", "kda_head_dim", "conv_kernel", "mla_heads", "q_lora", "kv_lora",
    "qk_nope", "v_head_dim", "n_experts", "expert_ff", "latent", "context_length", "block_size", "shards",
)  # fmt: skip
COUNT_FIELDS = ("qk_rope", "n_shared", "seed")


def _check_sizes(spec: TinySpec) -> None:
    """Sizes named by their fields: the metadata check after this one names GGUF keys, and numpy's
    refusal of a negative seed names nothing."""
    for name in POSITIVE_FIELDS:
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise ValueError(f"TinySpec.{name}: {value} must be >= 1")
    for name in COUNT_FIELDS:
        if getattr(spec, name) < 0:
            raise ValueError(f"TinySpec.{name}: {getattr(spec, name)} must be >= 0")


def _check_spec(spec: TinySpec) -> None:
    if spec.recipe not in RECIPES:
        raise ValueError(f"TinySpec.recipe: {spec.recipe!r} is not one of {', '.join(RECIPES)}")
    _check_sizes(spec)
    if spec.n_layers < 2:
        raise ValueError(f"TinySpec.n_layers: {spec.n_layers} must be >= 2 (a KDA and an MLA layer)")
    mla = spec.mla_layer_ids()
    if any(not 0 <= i < spec.n_layers for i in mla):
        raise ValueError(f"TinySpec.mla_layers: {mla} outside 0..{spec.n_layers - 1}")
    if not mla or len(mla) == spec.n_layers:
        raise ValueError("TinySpec.mla_layers: llama.cpp needs at least one KDA and one MLA layer")
    if spec.kda_heads != spec.mla_heads:
        raise ValueError(
            f"TinySpec.kda_heads: {spec.kda_heads} != TinySpec.mla_heads {spec.mla_heads}; "
            "Kimi-K3 GGUFs have one attention.head_count for both"
        )
    if not 0 < spec.top_k <= spec.n_experts:
        raise ValueError(f"TinySpec.top_k: {spec.top_k} must be in 1..n_experts ({spec.n_experts})")
    if not 0 <= spec.n_dense <= spec.n_layers:  # every layer dense: llama.cpp runs it, with no experts
        raise ValueError(f"TinySpec.n_dense: {spec.n_dense} must be in 0..n_layers ({spec.n_layers})")
    unknown = [group for group in spec.without if group not in OMITTABLE]
    if unknown:
        raise ValueError(f"TinySpec.without: {unknown[0]!r} is not one of {', '.join(OMITTABLE)}")


# ----------------------------------------------------------------------------------------------
# metadata


def hparams(spec: TinySpec, vocab_size: int) -> dict[str, object]:
    """Every `kimi-k3.*` key, with Python types that pick the GGUF types llama.cpp expects."""
    mla = set(spec.mla_layer_ids())
    keys: dict[str, object] = {
        "context_length": spec.context_length,
        "embedding_length": spec.hidden,
        "block_count": spec.n_layers,
        "feed_forward_length": spec.dense_ff,
        "vocab_size": vocab_size,
        "attention.head_count": spec.kda_heads,
        "attention.head_count_kv": [1 if i in mla else 0 for i in range(spec.n_layers)],
        "attention.layer_norm_rms_epsilon": float(spec.rms_eps),
        "attention.kv_lora_rank": spec.kv_lora,
        "attention.key_length": spec.kv_lora + spec.qk_rope,
        "attention.value_length": spec.kv_lora,
        "attention.key_length_mla": spec.qk_nope + spec.qk_rope,
        "attention.value_length_mla": spec.v_head_dim,
        "rope.dimension_count": spec.qk_rope,
        "ssm.conv_kernel": spec.conv_kernel,
        "kda.head_dim": spec.kda_head_dim,
        "expert_count": spec.n_experts,
        "expert_used_count": spec.top_k,
        "expert_feed_forward_length": spec.expert_ff,
        "expert_shared_count": spec.n_shared,
        "leading_dense_block_count": spec.n_dense,
        "expert_weights_scale": 1.0,
        "expert_weights_norm": True,
        "expert_gating_func": 2,  # sigmoid
        "expert_latent_length": spec.latent,
        "activation.situ_beta": float(spec.situ_beta),
        "activation.situ_linear_beta": float(spec.situ_linear_beta),
        "attn_res.block_size": spec.block_size,
    }
    if spec.q_lora is not None:
        keys["attention.q_lora_rank"] = spec.q_lora
    if spec.gate_lower_bound is not None:
        keys["kda.gate_lower_bound"] = float(spec.gate_lower_bound)
    return {f"{ARCH}.{key}": value for key, value in keys.items()}


def _add_value(writer, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _add_tokenizer(writer, vocab: Vocab) -> None:
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "kimi-k2")
    writer.add_array("tokenizer.ggml.tokens", list(vocab.tokens))
    writer.add_array("tokenizer.ggml.token_type", list(vocab.token_types))
    writer.add_array("tokenizer.ggml.merges", list(vocab.merges))
    writer.add_uint32("tokenizer.ggml.bos_token_id", vocab.bos_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab.eos_id)
    writer.add_uint32("tokenizer.ggml.padding_token_id", vocab.pad_id)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def _add_metadata(writer, spec: TinySpec, vocab: Vocab) -> None:
    writer.add_string("general.name", NAME)
    writer.add_uint32("general.file_type", _file_type(spec.recipe))
    writer.add_uint32("general.quantization_version", 2)
    for key, value in hparams(spec, len(vocab.tokens)).items():
        _add_value(writer, key, value)
    _add_tokenizer(writer, vocab)


# ----------------------------------------------------------------------------------------------
# tensors: names and shapes from the layout table; the name picks the initialisation


def tiny_config(spec: TinySpec, vocab_size: int):
    """The `K3Config` a reader builds from the metadata this spec writes."""
    from k3stream.gguf.config import K3Config

    return K3Config.from_metadata(hparams(spec, vocab_size), source="TinySpec")


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]


def tensor_plan(spec: TinySpec, vocab_size: int) -> list[_Tensor]:
    omitted = tuple(suffix for group in spec.without for suffix in OMITTABLE[group])
    shapes = expected_shapes(tiny_config(spec, vocab_size)).items()
    return [_Tensor(name, shape) for name, shape in shapes if not (omitted and name.endswith(omitted))]


# name suffix -> initialisation; anything else is a matrix, normal / sqrt(fan_in)
_INIT_KINDS = {
    "token_embd.weight": "embed",
    "norm.weight": "norm",
    "res_score.weight": "score",
    "exp_probs_b.bias": "bias",
    "ssm_dt.bias": "dt",
    "ssm_a": "ssm_a",
}


def _init_kind(name: str) -> str:
    if "ssm_conv1d_" in name:
        return "conv"
    return next((kind for suffix, kind in _INIT_KINDS.items() if name.endswith(suffix)), "matrix")


def initial_values(tensor: _Tensor, spec: TinySpec) -> np.ndarray:
    """A tensor's random values (also the trainer's initialisation), scaled by its kind."""
    # one generator per tensor name, so values do not depend on the recipe or on tensor order
    rng = np.random.default_rng([spec.seed, zlib.crc32(tensor.name.encode())])
    normal = rng.standard_normal(tensor.shape)
    kind = _init_kind(tensor.name)
    if kind in ("matrix", "score"):
        values = normal / np.sqrt(tensor.shape[-1])
    elif kind == "embed":
        values = normal
    elif kind == "norm":
        values = 1.0 + 0.1 * normal
    elif kind == "bias":
        values = 0.01 * normal
    elif kind == "conv":
        values = 0.5 * normal
    elif kind == "ssm_a":
        values = -np.exp(rng.uniform(0.0, np.log(8.0), tensor.shape))  # -exp(A_log)
    else:  # dt bias
        values = 0.5 * normal - 1.0
    return values.astype(np.float32)


ValuesOf = Callable[[_Tensor, TinySpec], np.ndarray]
# a tensor's bytes in slabs, written instead of its encoded values; None: encode the values
SlabsOf = Callable[[_Tensor, TinySpec, int], Iterable[np.ndarray] | None]


def _given(weights: dict[str, np.ndarray]) -> ValuesOf:
    """Values looked up by tensor name (a trained model's), checked against the plan's shape."""

    def values_of(tensor: _Tensor, spec: TinySpec) -> np.ndarray:
        if tensor.name not in weights:
            raise ValueError(f"weights: no values for tensor {tensor.name}")
        values = np.asarray(weights[tensor.name], dtype=np.float32)
        if values.shape != tensor.shape:
            raise ValueError(f"weights: {tensor.name} has shape {values.shape}, expected {tensor.shape}")
        return values

    return values_of


def ggml_type_for(name: str, ndim: int, recipe: str) -> int:
    if recipe == "audited":  # the published recipe; every tensor it does not name stays F32
        from k3stream.gguf.profile import recipe_type

        audited = recipe_type(name)
        return F32 if audited is None else int(audited)
    # llama.cpp needs vectors and the conv kernels in F32
    if recipe == "f16" and ndim >= 2 and "ssm_conv1d" not in name:
        return F16
    return F32


def tensor_type(tensor: _Tensor, spec: TinySpec) -> int:
    """The GGML type id `spec.recipe` gives `tensor`."""
    if spec.recipe in WRITABLE_RECIPES:
        recipe = WRITABLE_RECIPES[spec.recipe]
        if spec.release_matrices:
            recipe = release_like(recipe)
        return mixed_type(recipe, tensor.name, tensor.shape, first_moe_layer=spec.n_dense)
    return ggml_type_for(tensor.name, len(tensor.shape), spec.recipe)


def _file_type(recipe: str) -> int:
    if recipe in WRITABLE_RECIPES:
        return file_type(WRITABLE_RECIPES[recipe])
    return FILE_TYPES[recipe]


# shapes every recipe's types hold (expert and MLA rows of whole 256-value blocks): `make-tiny` takes them for
# the shapes a quantized recipe's user leaves out
FITTING_SHAPES = {"latent": 256, "expert_ff": 256, "kv_lora": 256, "qk_nope": 32}


def _check_quantizable(tensor: _Tensor, ggml_type: int, recipe: str) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]
    if tensor.shape[-1] % block:
        raise ValueError(
            f"recipe {recipe}: {tensor.name} rows of {tensor.shape[-1]} values are not a multiple of "
            f"{block} ({GGMLQuantizationType(ggml_type).name}); choose shapes that fit the recipe "
            f"({', '.join(f'{name}={size}' for name, size in FITTING_SHAPES.items())} fit every one)"
        )


def _encoded(tensor: _Tensor, spec: TinySpec, values_of: ValuesOf) -> tuple[np.ndarray, int]:
    ggml_type = tensor_type(tensor, spec)
    values = values_of(tensor, spec)
    if ggml_type == F32:
        return values, F32
    if ggml_type == F16:
        return values.astype(np.float16), F16
    from k3stream.quant import quantize

    data = np.asarray(quantize(values, ggml_type), dtype=np.uint8)
    return data.reshape(*tensor.shape[:-1], -1), ggml_type


# ----------------------------------------------------------------------------------------------
# writing


def shard_paths(out_dir: Path, count: int) -> list[Path]:
    if count == 1:
        return [out_dir / f"{NAME}.gguf"]
    return [out_dir / f"{NAME}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]


def _write_shard(
    path: Path,
    tensors: list[_Tensor],
    spec: TinySpec,
    vocab: Vocab,
    split: tuple[int, int, int],
    values_of: ValuesOf,
    slabs_of: SlabsOf | None,
) -> None:
    """One GGUF file, tensors streamed one at a time (large expert tensors in slabs) after the header."""
    from gguf import GGUFWriter

    index, count, total = split
    writer = GGUFWriter(path, ARCH)
    try:
        if index == 0:
            _add_metadata(writer, spec, vocab)
        if count > 1:
            writer.add_uint16("split.no", index)
            writer.add_uint16("split.count", count)
            writer.add_int32("split.tensors.count", total)
        for tensor in tensors:
            _add_tensor_info(writer, tensor, spec)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        for tensor in tensors:
            writer.write_padding(
                fout, _write_overlapped(fout, _tensor_slabs(tensor, spec, values_of, slabs_of))
            )
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
    except BaseException:  # write_model removes the temp file; the writer must not keep it open
        with suppress(OSError):  # closing flushes, which fails again on a full disk; the file closes anyway
            writer.close()
        raise


def _write_overlapped(fout, slabs) -> int:
    """Write each slab while the next one is made (both release the GIL); returns the bytes written."""
    from concurrent.futures import ThreadPoolExecutor

    written = 0
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for slab in slabs:
            if pending is not None:
                written += pending.result()
            pending = pool.submit(fout.write, memoryview(slab).cast("B"))
        if pending is not None:
            written += pending.result()
    return written


def _add_tensor_info(writer, tensor: _Tensor, spec: TinySpec) -> None:
    from gguf import GGMLQuantizationType

    ggml_type = tensor_type(tensor, spec)
    nbytes = _tensor_nbytes(tensor, spec)
    if ggml_type in (F32, F16):
        dtype = np.dtype(np.float32 if ggml_type == F32 else np.float16)
        writer.add_tensor_info(tensor.name, tensor.shape, dtype, nbytes)
        return
    byte_shape = (*tensor.shape[:-1], _row_bytes(tensor.shape[-1], ggml_type))
    quant_type = GGMLQuantizationType(ggml_type)
    writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), nbytes, quant_type)


def _tensor_nbytes(tensor: _Tensor, spec: TinySpec) -> int:
    ggml_type = tensor_type(tensor, spec)
    if ggml_type in (F32, F16):
        return int(np.prod(tensor.shape)) * (4 if ggml_type == F32 else 2)
    return int(np.prod(tensor.shape[:-1])) * _row_bytes(tensor.shape[-1], ggml_type)


def _row_bytes(row_values: int, ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return row_values // block * block_bytes


def _tensor_slabs(tensor: _Tensor, spec: TinySpec, values_of: ValuesOf, slabs_of: SlabsOf | None):
    """The tensor's bytes: what `slabs_of` gives, else its values encoded whole."""
    from k3stream.quant import DECODE_ONLY_TYPES

    ggml_type = tensor_type(tensor, spec)
    slabs = slabs_of(tensor, spec, ggml_type) if slabs_of is not None else None
    if slabs is not None:
        yield from slabs
        return
    if ggml_type in DECODE_ONLY_TYPES:
        from gguf import GGMLQuantizationType

        type_name = GGMLQuantizationType(ggml_type).name
        raise ValueError(f"{tensor.name}: k3stream cannot encode given weights as {type_name}")
    data, _ = _encoded(tensor, spec, values_of)
    yield np.ascontiguousarray(data)


def check_spec(spec: TinySpec, vocab_size: int) -> list[_Tensor]:
    """Raise one line for a spec `write_model` cannot write (shapes its recipe cannot quantize too);
    returns the tensor plan."""
    _check_spec(spec)
    for key, value in hparams(spec, vocab_size).items():
        if isinstance(value, int) and value > UINT32_MAX:
            raise ValueError(f"TinySpec: {key}: {value} does not fit the GGUF's uint32")
    plan = tensor_plan(spec, vocab_size)
    if spec.shards > len(plan):
        raise ValueError(f"TinySpec.shards: {spec.shards} shards for only {len(plan)} tensors")
    per_shard = -(-len(plan) // spec.shards)
    if per_shard > MAX_TENSORS:
        raise ValueError(
            f"TinySpec.n_layers: {spec.n_layers} layers make {len(plan)} tensors, {per_shard} a shard; "
            f"a GGUF holds at most {MAX_TENSORS} (more shards)"
        )
    if spec.recipe not in FLOAT_RECIPES:
        for tensor in plan:
            _check_quantizable(tensor, tensor_type(tensor, spec), spec.recipe)
    return plan


def check_free_space(out: Path, needed: int) -> None:
    """Refuse (one line) tensor data larger than the free space of `out` or its nearest existing folder."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        message = f"not enough free space in {existing} for the model: {free} bytes free, {needed} needed"
        raise OSError(errno.ENOSPC, message)


def check_out_dir(out_dir: str | os.PathLike[str]) -> None:
    """Refuse (one line naming OUT_DIR) a folder to write into that is, or lies under, something other
    than a folder: its nearest existing path must be one."""
    out = Path(out_dir)
    existing = next(path for path in (out, *out.parents) if path.exists())
    if not existing.is_dir():
        what = "" if existing == out else f" {existing}"
        raise NotADirectoryError(f"OUT_DIR {out}:{what} is a file, not a folder")


def tensor_data_nbytes(spec: TinySpec, vocab_size: int) -> int:
    """The tensor data bytes of the GGUF `spec` makes with `vocab_size` tokens (after the spec's checks)."""
    return sum(_tensor_nbytes(tensor, spec) for tensor in check_spec(spec, vocab_size))


def checked_plan(out_dir: str | os.PathLike[str], spec: TinySpec, vocab_size: int) -> list[_Tensor]:
    """The tensors `spec` makes with `vocab_size` tokens, after the spec's checks, `out_dir` and its free
    space (one-line errors, before anything is built or written)."""
    check_out_dir(out_dir)
    plan = check_spec(spec, vocab_size)
    check_free_space(Path(out_dir), sum(_tensor_nbytes(tensor, spec) for tensor in plan))
    return plan


def write_model(
    out_dir: str | os.PathLike[str],
    spec: TinySpec,
    vocab: Vocab,
    weights: dict[str, np.ndarray] | None = None,
    slabs_of: SlabsOf | None = None,
) -> Path:
    """Write a Kimi-K3 GGUF into `out_dir`; return the file (or shard 1) path.

    `weights`: float32 values of every tensor by GGUF name, in its numpy shape (a trained model);
    without them, `initial_values`. `slabs_of` may give a tensor's bytes instead (random test blocks)."""
    values_of = initial_values if weights is None else _given(weights)
    plan = checked_plan(out_dir, spec, len(vocab.tokens))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = shard_paths(out, spec.shards)
    groups = np.array_split(np.arange(len(plan)), spec.shards)
    temps = [path.with_name(path.name + ".tmp") for path in paths]
    index = 0
    try:
        for index, (temp, group) in enumerate(zip(temps, groups, strict=True)):
            split = (index, spec.shards, len(plan))
            _write_shard(temp, [plan[i] for i in group], spec, vocab, split, values_of, slabs_of)
    except BaseException as exc:
        for temp in temps:
            temp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a full disk's error names no file
            exc.filename = str(paths[index])
        raise
    for temp, path in zip(temps, paths, strict=True):
        os.replace(temp, path)
    return paths[0]
