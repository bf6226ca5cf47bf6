"""The adapter manifest (SGLANG-KIMI-GGMLMOEPACK-ADAPTER-v1): its schema, reading and type-checking a
manifest, and assembling the manifest of a built pack."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3stream.pack import format as fmt
from k3stream.pack import integrity
from k3stream.pack.fileio import read_bounded
from k3stream.pack.integrity import canonical_sha256, sha256_file, sha256_range
from k3stream.pack.paths import stored_path

FORMAT = "SGLANG-KIMI-GGMLMOEPACK-ADAPTER-v1"
ARCHITECTURE = "KimiLinearForCausalLM"
HIDDEN_ACT = "situ"


def hard_constraints(top_k: int) -> dict[str, Any]:
    """The runtime policy a manifest must state: every selected expert runs, nothing requantized."""
    return {
        "all_selected_experts_must_execute": True,
        "expert_pruning_allowed": False,
        "requantization_allowed": False,
        "top_k": top_k,
        "top_k_is_immutable": True,
    }


# the real model's manifest is a few MiB (tensor records, one digest per expert object)
MAX_MANIFEST_BYTES = 256 << 20


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    try:
        value = json.loads(read_bounded(path, MAX_MANIFEST_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"Kimi-K3 manifest is missing: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: manifest is a directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: manifest is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: manifest is not a JSON object")
    return value


# The types of the manifest fields k3stream reads: a type, {key: spec} for an object (keys optional here;
# the readers name missing ones), or [spec] for a list of items. Integers are non-negative, below 2^63.
_ROLE = {
    "dtype": str,
    "dtype_id": int,
    "logical_shape": [int],
    "expert_bytes": int,
    "entry_count": int,
    "payload_bytes": int,
}
MANIFEST_TYPES: dict[str, Any] = {
    "format": str,
    "complete": bool,
    "hard_constraints": dict,
    "model": {
        "num_hidden_layers": int,
        "active_moe_layer_ids": [int],
        "num_experts": int,
        "num_experts_per_token": int,
        "hidden_size": int,
        "routed_expert_hidden_size": int,
        "moe_intermediate_size": int,
    },
    "source": {
        "summary": dict,
        "inventory_sha256": str,
        "shards": [
            {
                "index": int,
                "path": str,
                "size": int,
                "metadata_nbytes": int,
                "metadata_sha256": str,
                "tensor_count": int,
            }
        ],
        "tensors": [
            {
                "name": str,
                "shape": [int],
                "dtype": str,
                "dtype_id": int,
                "shard_index": int,
                "data_offset": int,
                "nbytes": int,
            }
        ],
    },
    "expert_pack": {
        "path": str,
        "size": int,
        "magic": str,
        "version": int,
        "header_bytes": int,
        "entry_bytes": int,
        "index_count": int,
        "data_start": int,
        "alignment": int,
        "index_sha256": str,
        "physical_role_order": [str],
        "active_moe_layer_ids": [int],
        "num_experts": int,
        "top_k": int,
        "object_bytes": int,
        "roles": {"up": _ROLE, "gate": _ROLE, "down": _ROLE},
    },
    "integrity": dict,
}
_TYPE_NAMES = {int: "a non-negative integer", str: "a string", bool: "true or false", dict: "an object"}


def check_types(value: Any, spec: Any = None, where: str = "") -> None:
    """Raise ValueError (one line naming the field) where `value` does not have the types of `spec`
    (MANIFEST_TYPES by default); fields that are absent are left to the readers' own messages."""
    spec = MANIFEST_TYPES if spec is None else spec
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise _wrong_type(where, "an object", value)
        for key, inner in spec.items():
            if key in value:
                check_types(value[key], inner, f"{where}.{key}" if where else key)
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise _wrong_type(where, "a list", value)
        for index, item in enumerate(value):
            check_types(item, spec[0], f"{where}[{index}]")
    elif spec is int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
            raise _wrong_type(where, _TYPE_NAMES[int], value)
    elif not isinstance(value, spec):
        raise _wrong_type(where, _TYPE_NAMES[spec], value)


def _wrong_type(where: str, wanted: str, value: Any) -> ValueError:
    scalar = isinstance(value, (int, float, str, bool, type(None)))
    shown = json.dumps(value)[:40] if scalar else type(value).__name__
    return ValueError(f"Kimi manifest field {where} must be {wanted}, got {shown}")


def read_manifest(path: str | os.PathLike[str], sidecar: bool = True) -> dict[str, Any]:
    """A manifest file as a dict, its size bounded and the types of the fields k3stream reads checked;
    with `sidecar`, the checksums recorded beside a manifest without its own (`integrity.with_sidecar`)."""
    manifest = read_json(path)
    check_types(manifest)
    return integrity.with_sidecar(manifest, Path(path)) if sidecar else manifest


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a manifest for the non-expert loader (sglang's loader's checks and messages)."""
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise ValueError("Kimi-K3 manifest format is unsupported")
    if not manifest.get("complete"):
        raise ValueError("Kimi-K3 manifest is incomplete")
    return manifest


def field(manifest: dict[str, Any], *keys: str) -> Any:
    """`manifest[k1][k2]...`, with a one-line error naming the missing field."""
    value: Any = manifest
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"Kimi manifest field is missing: {'.'.join(keys[: depth + 1])}")
        value = value[key]
    return value


def source_section(
    shards: list[dict[str, Any]],
    tensors: Iterable[dict[str, Any]],
    full_source_hashes: bool,
    architecture: str = "kimi-k3",
) -> dict[str, Any]:
    """`source`: summary, shard records, tensor records (sorted by name), and their inventory hash."""
    tensor_records = sorted(tensors, key=lambda record: record["name"])
    inventory = {
        "summary": {
            "architecture": architecture,
            "shard_count": len(shards),
            "tensor_count": len(tensor_records),
            "total_bytes": sum(int(shard["size"]) for shard in shards),
            "full_source_hashes": full_source_hashes,
        },
        "shards": shards,
        "tensors": tensor_records,
    }
    return {**inventory, "inventory_sha256": inventory_sha256(inventory)}


def inventory_sha256(source: dict[str, Any]) -> str:
    """The hash `source.inventory_sha256` must hold: of its summary, shards and tensors."""
    return canonical_sha256({key: field(source, key) for key in ("summary", "shards", "tensors")})


# ------------------------------------------------------------------------------------------------
# assembling a manifest (the builder's; every section but `expert_pack`'s checked figures is made here)


@dataclass
class ManifestOptions:
    """What a built manifest records; `builder.BuildOptions` adds how the build runs."""

    relative_paths: bool = False  # absolute paths: what sglang's run-time store requires
    payload_samples: int = 6
    full_hash: bool = False
    full_source_hashes: bool = False


def role_summary(
    layout: fmt.PackLayout, role_tensors: dict[tuple[int, str], Any], role: str
) -> dict[str, Any]:
    """`expert_pack.roles[role]`, from the role's tensor in the first MoE layer (a `TensorInfo`); the
    payload bytes are every layer's (the first layer's times the layers, with one size for all)."""
    position = fmt.ROLES.index(role)
    info = role_tensors[(layout.moe_layers[0], role)]
    entries = len(layout.moe_layers) * layout.num_experts
    sizes = [layout.sizes_at(p)[position] for p in range(len(layout.moe_layers))]
    return {
        "dtype": info.type_name,
        "dtype_id": info.ggml_type,
        "logical_shape": list(reversed(info.shape[1:])),  # GGML order (in, out), as sglang writes it
        "expert_bytes": sizes[0],
        "entry_count": entries,
        "payload_bytes": layout.num_experts * sum(sizes),
    }


def layer_records(layout: fmt.PackLayout, role_tensors: dict[tuple[int, str], Any]) -> list[dict[str, Any]]:
    """`expert_pack.layers`: each MoE layer's role types and bytes per expert (a mixed recipe's)."""
    return [
        {
            "layer": layer,
            "object_bytes": layout.object_bytes_at(position),
            "roles": {
                role: {
                    "dtype": role_tensors[(layer, role)].type_name,
                    "dtype_id": role_tensors[(layer, role)].ggml_type,
                    "expert_bytes": layout.sizes_at(position)[index],
                }
                for index, role in enumerate(fmt.ROLES)
            },
        }
        for position, layer in enumerate(layout.moe_layers)
    ]


def is_mixed(layout: fmt.PackLayout, role_tensors: dict[tuple[int, str], Any]) -> bool:
    """Whether the MoE layers differ in a role's type or size (the manifest then records each layer)."""
    types = {
        tuple(role_tensors[(layer, role)].ggml_type for role in fmt.ROLES) for layer in layout.moe_layers
    }
    return layout.mixed or len(types) > 1


def expert_pack_section(
    layout: fmt.PackLayout,
    role_tensors: dict[tuple[int, str], Any],
    top_k: int,
    index: Any,
    samples_verified: int,
    sha256: str | None,
) -> dict[str, Any]:
    """`expert_pack` without its path: `index` is the pack's checked header and index (`IndexCheck`)."""
    section: dict[str, Any] = {
        "size": index.size,
        "magic": fmt.MAGIC.rstrip(b"\0").decode("ascii"),
        "version": fmt.VERSION,
        "header_bytes": fmt.HEADER.size,
        "entry_bytes": fmt.ENTRY.size,
        "index_count": layout.index_count,
        "data_start": layout.data_start,
        "alignment": fmt.ALIGNMENT,
        "index_sha256": index.index_sha256,
        "physical_role_order": list(fmt.ROLES),
        "active_moe_layer_ids": list(layout.moe_layers),
        "num_experts": layout.num_experts,
        "top_k": top_k,
        "object_bytes": layout.object_bytes,
        "roles": {role: role_summary(layout, role_tensors, role) for role in fmt.ROLES},
        "payload_samples_verified": samples_verified,
        "full_pack_hash": sha256 is not None,
    }
    if is_mixed(layout, role_tensors):
        section["layers"] = layer_records(layout, role_tensors)
    if sha256 is not None:
        section["sha256"] = sha256
    return section


def shard_records(
    checkpoint: Any, manifest_path: Path, relative: bool, full_hashes: bool
) -> list[dict[str, Any]]:
    """`source.shards`: each shard's path, size and metadata bytes (and SHA-256 with `full_hashes`)."""
    records = []
    for index, path in enumerate(checkpoint.shards):
        tensors = [info for info in checkpoint.tensors.values() if info.shard_index == index]
        # GGUF tensor offsets start at 0 in the data section, so the first tensor marks its start; a
        # shard of metadata alone (gguf-split --no-tensor-first-split) is all metadata
        metadata_nbytes = min((info.data_offset for info in tensors), default=path.stat().st_size)
        record = {
            "index": index,
            "path": stored_path(path, manifest_path, relative),
            "size": path.stat().st_size,
            "metadata_nbytes": metadata_nbytes,
            "metadata_sha256": sha256_range(path, 0, metadata_nbytes),
            "tensor_count": len(tensors),
        }
        if full_hashes:
            record["sha256"] = sha256_file(path)
        records.append(record)
    return records


def tensor_record(info: Any) -> dict[str, Any]:
    """One `source.tensors` record of a `TensorInfo`."""
    return {
        "name": info.name,
        "shape": list(reversed(info.shape)),  # GGML order, as GGUFReader reports it
        "dtype": info.type_name,
        "dtype_id": info.ggml_type,
        "shard_index": info.shard_index,
        "data_offset": info.data_offset,
        "nbytes": info.nbytes,
    }


def model_section(config: Any, config_path: str, config_sha256: str) -> dict[str, Any]:
    """`model`, from a `K3Config`; the config lives in shard 1's GGUF metadata."""
    return {
        "config_path": config_path,
        "config_sha256": config_sha256,
        "architecture": ARCHITECTURE,
        "num_hidden_layers": config.n_layers,
        "active_moe_layer_ids": list(config.moe_layers),
        "num_experts": config.n_experts,
        "num_experts_per_token": config.top_k,
        "num_shared_experts": config.n_shared,
        "hidden_size": config.hidden,
        "routed_expert_hidden_size": config.latent,
        "moe_intermediate_size": config.expert_ff,
        "hidden_act": HIDDEN_ACT,
    }


def tokenizer_values(checkpoint: Any) -> dict[str, Any]:
    """Every tokenizer.* metadata value by key, decoded (a string that is not UTF-8 fails naming it)."""
    keys = sorted(key for key in checkpoint.fields if key.startswith("tokenizer."))
    return {key: checkpoint.metadata(key) for key in keys}


def tokenizer_section(values: dict[str, Any], first_shard: str) -> dict[str, Any]:
    return {
        "path": first_shard,
        "source": "gguf-metadata",
        "files": [],
        "keys": list(values),
        "inventory_sha256": canonical_sha256(values),
    }


def build_manifest(
    checkpoint: Any,
    tokenizer: dict[str, Any],
    pack: Path,
    manifest_path: Path,
    pack_section: dict[str, Any],
    options: ManifestOptions,
    object_digests: Any,
) -> dict[str, Any]:
    """The whole manifest of a built pack (`pack_section` from `expert_pack_section`, `tokenizer` from
    `tokenizer_values`), `complete`."""
    from k3stream import __version__

    shards = shard_records(checkpoint, manifest_path, options.relative_paths, options.full_source_hashes)
    tensors = [tensor_record(info) for info in checkpoint.tensors.values()]
    first = shards[0]
    return {
        "complete": True,
        "format": FORMAT,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "generator": f"k3stream {__version__}",
        "hard_constraints": hard_constraints(checkpoint.config.top_k),
        "model": model_section(checkpoint.config, first["path"], first["metadata_sha256"]),
        "source": source_section(shards, tensors, options.full_source_hashes),
        "expert_pack": {**pack_section, "path": stored_path(pack, manifest_path, options.relative_paths)},
        "tokenizer": tokenizer_section(tokenizer, first["path"]),
        "integrity": integrity.integrity_section(object_digests, shards, list(checkpoint.shards)),
        "verification": {
            "structure": "complete",
            "payload_samples": options.payload_samples,
            "full_source_hashes": options.full_source_hashes,
            "full_pack_hash": options.full_hash,
        },
    }
