"""Check an expert pack against its manifest, with sglang's messages.

`verify_pack` checks the manifest (format, hard constraints, dimensions, roles), the source shards
(present, same size, same metadata bytes, same tensors and types), and the pack's header and index
(identity and order, alignment, ranges, contiguity, file size, index SHA-256). Without `full` it reads
only the pack's header and index, a sample of the source shards' tensor data (against the
manifest's fingerprints) and a sample of expert objects (each against its recorded xxh3_64 and its GGUF
bytes); with `full` it also hashes the whole pack, checks every object's digest and compares every
payload with the GGUF. Manifests without an `integrity` section (sglang's, older ones) get the
GGUF comparison of the samples only, and the summary says that no checksums were checked.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3stream.gguf.layout import ROUTED_EXPERT_RE, routed_expert_name
from k3stream.gguf.profile import AUDITED_MODEL, PROFILES, recipe_type
from k3stream.pack import format as fmt
from k3stream.pack import integrity
from k3stream.pack.fileio import pread_exact, same_bytes
from k3stream.pack.manifest import FORMAT, field, hard_constraints, inventory_sha256, read_manifest
from k3stream.pack.paths import resolve_path
from k3stream.pack.source import checked_shards, first_shard_path, present_shards
from k3stream.quant.finite import non_finite_problem


def _audited_role_type(role: str) -> tuple[str, int]:
    ggml_type = recipe_type(routed_expert_name(AUDITED_MODEL.moe_layers[0], role))
    return ggml_type.name, int(ggml_type)


AUDITED_ROLE_TYPES = {role: _audited_role_type(role) for role in fmt.ROLES}
INDEX_DTYPE = np.dtype(
    [
        ("name", "u1", (fmt.NAME_BYTES,)),
        ("expert", "<i4"),
        ("reserved", "<i4"),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
    ]
)


@dataclass(frozen=True)
class ModelExpectation:
    """What the runtime requires of a pack: the audited constants or a GGUF's config."""

    num_hidden_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    hidden_size: int
    latent: int
    expert_ff: int
    role_types: dict[str, tuple[str, int]] | None  # None: any type, as long as it matches the GGUF


AUDITED = ModelExpectation(
    num_hidden_layers=AUDITED_MODEL.n_layers,
    num_experts=AUDITED_MODEL.n_experts,
    top_k=AUDITED_MODEL.top_k,
    moe_layers=AUDITED_MODEL.moe_layers,
    hidden_size=AUDITED_MODEL.hidden,
    latent=AUDITED_MODEL.latent,
    expert_ff=AUDITED_MODEL.expert_ff,
    role_types=AUDITED_ROLE_TYPES,
)


def expectation_from_config(config: Any) -> ModelExpectation:
    """The generic profile: dimensions from a `K3Config`."""
    return ModelExpectation(
        config.n_layers,
        config.n_experts,
        config.top_k,
        tuple(config.moe_layers),
        config.hidden,
        config.latent,
        config.expert_ff,
        None,
    )


def gguf_config(first_shard: Path) -> Any:
    from k3stream.gguf.config import K3Config
    from k3stream.gguf.header import open_reader

    return K3Config.from_metadata(open_reader(first_shard).fields, source=str(first_shard))


def expectation_for(
    profile: str, manifest: dict[str, Any], manifest_path: Path, config: Any = None
) -> ModelExpectation:
    if profile == "audited":
        return AUDITED
    if profile != "generic":
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if config is None:
        first = first_shard_path(manifest, manifest_path)
        if not first.is_file():
            raise FileNotFoundError(f"Kimi-K3 GGUF shard is missing or changed: {first}")
        config = gguf_config(first)
    return expectation_from_config(config)


def check_format(manifest: dict[str, Any]) -> None:
    if not manifest.get("complete") or manifest.get("format") != FORMAT:
        raise ValueError("Kimi expert-pack manifest is incomplete or unsupported")


def _layer_range(layers: tuple[int, ...]) -> str:
    if layers and layers == tuple(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return str(list(layers))


def check_model(manifest: dict[str, Any], expected: ModelExpectation) -> None:
    """Hard constraints, dimensions (layers, experts, top-k) and the active MoE layers."""
    if manifest.get("hard_constraints") != hard_constraints(expected.top_k):
        raise ValueError("Kimi manifest hard constraints do not match runtime policy")
    model = field(manifest, "model")
    dimensions = tuple(
        int(field(model, key)) for key in ("num_hidden_layers", "num_experts", "num_experts_per_token")
    )
    wanted = (expected.num_hidden_layers, expected.num_experts, expected.top_k)
    if dimensions != wanted:
        # the audited profile's (top-k 16) words are sglang's, verbatim; a generic model names its own
        raise ValueError(
            f"Kimi expert-pack dimensions {dimensions} != {wanted}; Top-K is immutable at {expected.top_k}"
        )
    active = tuple(int(layer) for layer in field(model, "active_moe_layer_ids"))
    if active != expected.moe_layers:
        raise ValueError(f"Kimi active routed MoE layers must be exactly {_layer_range(expected.moe_layers)}")
    widths = {
        "hidden_size": expected.hidden_size,
        "routed_expert_hidden_size": expected.latent,
        "moe_intermediate_size": expected.expert_ff,
    }
    for key, value in widths.items():
        if int(field(model, key)) != value:
            raise ValueError(f"Kimi manifest model.{key} {model[key]} != {value} of the model")
    pack = field(manifest, "expert_pack")
    for key, value in (
        ("active_moe_layer_ids", list(active)),
        ("num_experts", dimensions[1]),
        ("top_k", dimensions[2]),
    ):
        if field(pack, key) != value:
            raise ValueError(f"Kimi manifest expert_pack.{key} does not match its model section")


def _role_tensors(manifest: dict[str, Any], moe_layers: tuple[int, ...], role: str) -> list[dict]:
    records = {record["name"]: record for record in field(manifest, "source", "tensors")}
    names = [routed_expert_name(layer, role) for layer in moe_layers]
    missing = [name for name in names if name not in records]
    if missing:
        raise ValueError(f"Kimi manifest source has no routed expert tensor {missing[0]}")
    return [records[name] for name in names]


def _check_role_type(
    role: str, summary: dict[str, Any], tensors: list[dict], expected: ModelExpectation
) -> None:
    from gguf import GGMLQuantizationType

    dtype, dtype_id = summary.get("dtype"), summary.get("dtype_id")
    disagreeing = next((tensor for tensor in tensors if tensor["dtype"] != dtype), None)
    if expected.role_types is not None:  # the audited profile: the seed's message
        known = (dtype, dtype_id) == expected.role_types[role]
    else:
        known = dtype in GGMLQuantizationType.__members__ and GGMLQuantizationType[dtype] == dtype_id
        if known and disagreeing is not None:
            raise ValueError(
                f"Kimi expert-pack {role} role is recorded as {dtype} ({dtype_id}), "
                f"its GGUF tensor {disagreeing['name']} is {disagreeing['dtype']}"
            )
    if not known or disagreeing is not None:
        raise ValueError(f"Kimi expert-pack {role} quant type is unsupported")


def _check_role_size(
    role: str,
    summary: dict[str, Any],
    tensors: list[dict],
    expected: ModelExpectation,
    layer_bytes: list | None,
) -> None:
    """`layer_bytes`: the role's bytes per expert in each MoE layer, when the manifest records layers
    (then `tensors` is the first layer's alone: `_layer_sizes` checked the others)."""
    experts = expected.num_experts
    latent_ff = [expected.latent, expected.expert_ff]
    logical = latent_ff if role != "down" else latent_ff[::-1]  # GGML order (in, out)
    entry_count = len(expected.moe_layers) * experts
    payload = (
        entry_count * summary.get("expert_bytes", -1) if layer_bytes is None else experts * sum(layer_bytes)
    )
    for tensor in tensors:
        ok = (
            list(tensor["shape"]) == [*logical, experts]
            and int(tensor["nbytes"]) == int(summary.get("expert_bytes", -1)) * experts
            and summary.get("logical_shape") == logical
            and summary.get("entry_count") == entry_count
            and summary.get("payload_bytes") == payload
        )
        if not ok:
            raise ValueError(
                f"Kimi expert-pack {role} role does not match GGUF tensor {tensor['name']} "
                f"(shape {tensor['shape']}, {tensor['nbytes']} bytes for {experts} experts)"
            )


def _layer_sizes(
    manifest: dict[str, Any], pack: dict[str, Any], expected: ModelExpectation
) -> tuple[tuple[int, int, int], ...] | None:
    """Each MoE layer's (up, gate, down) bytes per expert from `expert_pack.layers` (a mixed recipe's;
    None when the manifest has none), after checking every layer's types and sizes against the GGUF's
    tensor records: a disagreement names the layer and role."""
    layers = pack.get("layers")
    if layers is None:
        return None
    if not isinstance(layers, list) or [_get(record, "layer") for record in layers] != list(
        expected.moe_layers
    ):
        raise ValueError("Kimi expert-pack layers do not list its MoE layers")
    records = {record["name"]: record for record in field(manifest, "source", "tensors")}
    return tuple(
        tuple(_layer_role_bytes(record["layer"], role, record, records, expected) for role in fmt.ROLES)
        for record in layers
    )


def _get(record: Any, key: str) -> Any:
    return record.get(key) if isinstance(record, dict) else None


def _layer_role_bytes(
    layer: int, role: str, record: dict[str, Any], tensors: dict[str, dict], expected: ModelExpectation
) -> int:
    from gguf import GGMLQuantizationType

    summary = _get(_get(record, "roles"), role)
    dtype, dtype_id, expert_bytes = (_get(summary, key) for key in ("dtype", "dtype_id", "expert_bytes"))
    name = routed_expert_name(layer, role)
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"Kimi manifest source has no routed expert tensor {name}")
    known = dtype in GGMLQuantizationType.__members__ and GGMLQuantizationType[dtype] == dtype_id
    if expected.role_types is not None and (dtype, dtype_id) != expected.role_types[role]:
        raise ValueError(f"Kimi expert-pack {role} quant type is unsupported")
    if not known or tensor["dtype"] != dtype:
        raise ValueError(
            f"Kimi expert-pack layer {layer} role {role} is recorded as {dtype} ({dtype_id}), "
            f"its GGUF tensor {name} is {tensor['dtype']}"
        )
    if not isinstance(expert_bytes, int) or int(tensor["nbytes"]) != expert_bytes * expected.num_experts:
        raise ValueError(
            f"Kimi expert-pack layer {layer} role {role} is recorded as {expert_bytes} bytes per expert, "
            f"its GGUF tensor {name} has {tensor['nbytes']} bytes for {expected.num_experts} experts"
        )
    return expert_bytes


def check_roles(manifest: dict[str, Any], expected: ModelExpectation) -> fmt.PackLayout:
    """Role order, types and sizes; returns the layout the index must follow."""
    pack = field(manifest, "expert_pack")
    if pack.get("physical_role_order") != list(fmt.ROLES):
        raise ValueError("Kimi expert-pack physical role order is unsupported")
    roles = field(pack, "roles")
    layer_sizes = _layer_sizes(manifest, pack, expected)
    for position, role in enumerate(fmt.ROLES):
        summary = field(roles, role)
        tensors = _role_tensors(manifest, expected.moe_layers, role)
        layer_bytes = None if layer_sizes is None else [sizes[position] for sizes in layer_sizes]
        tensors = tensors if layer_sizes is None else tensors[:1]
        _check_role_type(role, summary, tensors, expected)
        _check_role_size(role, summary, tensors, expected, layer_bytes)
    role_bytes = tuple(int(roles[role]["expert_bytes"]) for role in fmt.ROLES)
    layout = fmt.PackLayout.of_layers(
        expected.moe_layers, expected.num_experts, layer_sizes or (role_bytes,) * len(expected.moe_layers)
    )
    if layer_sizes is not None:
        _check_layer_objects(pack["layers"], layout)
    # the audited runtime (sglang's store) reads an object as up+gate+down with no padding between
    padding_allowed = expected.role_types is None
    if int(field(pack, "object_bytes")) != layout.object_bytes or (
        not padding_allowed and layout.object_bytes != sum(role_bytes)
    ):
        raise ValueError("Kimi expert-pack role sizes do not match object bytes")
    return layout


def _check_layer_objects(layers: list[dict[str, Any]], layout: fmt.PackLayout) -> None:
    """Each layer record's `object_bytes` is what its roles make (aligned), as the layout holds."""
    for position, record in enumerate(layers):
        actual = layout.object_bytes_at(position)
        if record.get("object_bytes") != actual:
            raise ValueError(
                f"Kimi expert-pack layer {record['layer']} is recorded as {record.get('object_bytes')} bytes "
                f"per object, its roles make {actual}"
            )


def check_header_fields(pack: dict[str, Any], layout: fmt.PackLayout) -> None:
    """The manifest's description of the header agrees with the format and the layout."""
    described = (
        pack.get("magic"),
        pack.get("version"),
        pack.get("header_bytes"),
        pack.get("entry_bytes"),
        pack.get("alignment"),
        pack.get("index_count"),
    )
    wanted = (
        fmt.MAGIC.rstrip(b"\0").decode("ascii"),
        fmt.VERSION,
        fmt.HEADER.size,
        fmt.ENTRY.size,
        fmt.ALIGNMENT,
        layout.index_count,
    )
    data_start = pack.get("data_start")
    minimum = fmt.HEADER.size + layout.index_count * fmt.ENTRY.size
    if (
        described != wanted
        or not isinstance(data_start, int)
        or data_start < minimum
        or data_start % fmt.ALIGNMENT
    ):
        raise ValueError("Kimi expert-pack header does not match its manifest")


@dataclass(frozen=True)
class IndexCheck:
    """What a checked header and index say: one offset per expert object, and the digest."""

    size: int
    data_start: int
    object_offsets: np.ndarray  # uint64 [len(moe_layers) * num_experts], layer-major
    index_sha256: str


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _expected_names(layout: fmt.PackLayout) -> np.ndarray:
    """[index_count, 128] uint8: the NUL-padded tensor name of every index entry."""
    per_layer = [
        [routed_expert_name(layer, role).encode() for role in fmt.ROLES] for layer in layout.moe_layers
    ]
    names = np.frombuffer(
        b"".join(n.ljust(fmt.NAME_BYTES, b"\0") for row in per_layer for n in row), np.uint8
    )
    names = names.reshape(len(layout.moe_layers), 1, len(fmt.ROLES), fmt.NAME_BYTES)
    return np.broadcast_to(names, (len(layout.moe_layers), layout.num_experts, 3, fmt.NAME_BYTES)).reshape(
        -1, fmt.NAME_BYTES
    )


def _names_up_to_nul(raw_names: np.ndarray) -> np.ndarray:
    """Each name with every byte from its first NUL on zeroed (what a C-string reader sees)."""
    return np.where(np.logical_or.accumulate(raw_names == 0, axis=1), 0, raw_names).astype(np.uint8)


def check_entries(index: np.ndarray, layout: fmt.PackLayout, data_start: int, file_size: int) -> np.ndarray:
    """Vectorised form of sglang's reader's per-entry loop: the first bad index fails, checked in its
    order (identity, then range, then contiguity). Returns the object offsets."""
    count = layout.index_count
    names_bad = (_names_up_to_nul(index["name"]) != _expected_names(layout)).any(axis=1)
    experts = (np.arange(count) // len(fmt.ROLES)) % layout.num_experts
    identity_bad = names_bad | (index["expert"] != experts) | (index["reserved"] != 0)

    offsets, nbytes = index["offset"], index["nbytes"]
    ends = offsets + nbytes
    previous_ends = np.concatenate([np.array([data_start], dtype=np.uint64), ends[:-1]])
    range_bad = (
        (nbytes != np.array(layout.entry_sizes(), dtype=np.uint64))
        | (offsets % np.uint64(fmt.ALIGNMENT) != 0)
        | (offsets < previous_ends)
        | (ends < offsets)
        | (ends > np.uint64(file_size))
    )

    object_offsets = offsets[0::3]
    expected = np.repeat(object_offsets, 3) + np.array(layout.entry_role_offsets(), dtype=np.uint64)
    contiguity_bad = offsets != expected

    firsts = [
        (_first(mask), order, mask) for order, mask in enumerate((identity_bad, range_bad, contiguity_bad))
    ]
    failures = [(position, order) for position, order, _ in firsts if position is not None]
    if failures:
        position, order = min(failures)
        message = (
            "Kimi expert-pack identity mismatch at index {}",
            "Kimi expert-pack range mismatch at index {}",
            "Kimi expert object is not contiguous at index {}",
        )[order]
        raise ValueError(message.format(position))
    if int(ends[-1]) != file_size:
        raise ValueError("Kimi expert-pack file has trailing or missing bytes")
    return object_offsets


def read_header_and_index(pack_path: Path, layout: fmt.PackLayout, data_start: int) -> tuple[bytes, bytes]:
    """The raw header and index; nothing past the index is read."""
    index_bytes = layout.index_count * fmt.ENTRY.size
    fd = os.open(pack_path, os.O_RDONLY)
    try:
        raw_header = os.pread(fd, fmt.HEADER.size, 0)
        if len(raw_header) != fmt.HEADER.size:
            raise ValueError("Kimi expert-pack header is truncated")
        header = fmt.Header.decode(raw_header)
        if header != fmt.Header(fmt.MAGIC, fmt.VERSION, fmt.HEADER.size, layout.index_count, data_start):
            raise ValueError("Kimi expert-pack header does not match its manifest")
        raw_index = pread_exact(fd, index_bytes, fmt.HEADER.size)
        if len(raw_index) != index_bytes:
            raise ValueError("Kimi expert-pack index is truncated")
    finally:
        os.close(fd)
    return raw_header, raw_index


def check_index(pack_path: Path, layout: fmt.PackLayout, data_start: int) -> IndexCheck:
    """Header, every index entry, file size; returns the object offsets and the index digest."""
    file_size = pack_path.stat().st_size
    raw_header, raw_index = read_header_and_index(pack_path, layout, data_start)
    index = np.frombuffer(raw_index, dtype=INDEX_DTYPE)
    object_offsets = check_entries(index, layout, data_start, file_size)
    digest = hashlib.sha256(raw_header)
    digest.update(raw_index)
    return IndexCheck(file_size, data_start, object_offsets, digest.hexdigest())


def pack_path_of(
    manifest: dict[str, Any], manifest_path: Path, pack_path: str | os.PathLike[str] | None
) -> Path:
    stored = resolve_path(field(manifest, "expert_pack", "path"), manifest_path)
    if pack_path is not None and Path(pack_path).resolve() != stored.resolve():
        raise ValueError(
            f"Kimi manifest expert-pack path does not match pack_path: {manifest_path} names {stored}, "
            f"not {Path(pack_path).resolve()}"
        )
    if not stored.is_file():
        raise FileNotFoundError(
            f"Kimi expert-pack or manifest is missing: {stored}, {manifest_path.resolve()}"
        )
    return stored


@dataclass(frozen=True)
class CheckedPack:
    """A manifest and its pack after the structural checks (header and index only)."""

    manifest: dict[str, Any]
    manifest_path: Path
    pack_path: Path
    expected: ModelExpectation
    layout: fmt.PackLayout
    index: IndexCheck


def check_structure(
    manifest_path: str | os.PathLike[str],
    *,
    profile: str = "generic",
    config: Any = None,
    pack_path: str | os.PathLike[str] | None = None,
    shards: bool = True,
    sidecar: bool = True,
) -> CheckedPack:
    """Everything except payload bytes, in sglang's reader's order; `shards` adds the source checks,
    `sidecar` the checksums recorded beside a manifest without its own."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path, sidecar)
    check_format(manifest)
    if inventory_sha256(field(manifest, "source")) != manifest["source"].get("inventory_sha256"):
        raise ValueError("Kimi manifest source inventory SHA-256 does not match its records")
    if shards:
        checked_shards(manifest, manifest_path)  # names, types, metadata bytes and sampled tensor data
    expected = expectation_for(profile, manifest, manifest_path, config)
    check_model(manifest, expected)
    path = pack_path_of(manifest, manifest_path, pack_path)
    pack = field(manifest, "expert_pack")
    recorded, size = int(field(pack, "size")), path.stat().st_size
    if recorded != size:
        raise ValueError(
            f"Kimi expert-pack size does not match its manifest: {path} is {size} bytes, "
            f"the manifest records {recorded}"
        )
    layout = check_roles(manifest, expected)
    check_header_fields(pack, layout)
    index = check_index(path, layout, int(pack["data_start"]))
    if index.index_sha256 != pack.get("index_sha256"):
        raise ValueError("Kimi expert-pack index SHA-256 does not match manifest")
    return CheckedPack(manifest, manifest_path, path, expected, layout, index)


def evenly_spaced(count: int, samples: int) -> list[int]:
    """`samples` evenly spaced indices of `count` (sglang's choice), first and last included; every index
    where `samples` reaches `count`."""
    samples = min(samples, count)
    if samples <= 1:
        return [0][:samples]
    return [round(k * (count - 1) / (samples - 1)) for k in range(samples)]


def sample_objects(checked: CheckedPack, samples: int) -> list[int]:
    """Evenly spaced object ordinals, first and last included."""
    return evenly_spaced(len(checked.layout.moe_layers) * checked.layout.num_experts, samples)


def check_object_samples(
    checked: CheckedPack, ordinals: list[int], digests: np.ndarray | None, compare_gguf: bool = True
) -> None:
    """Each object of `ordinals`: its xxh3_64 against the manifest (when recorded), then (`compare_gguf`)
    each role's bytes against the GGUF. One-line errors naming layer, expert and pack."""
    layout, sources = checked.layout, payload_sources(checked)
    offsets = checked.index.object_offsets
    fd = os.open(checked.pack_path, os.O_RDONLY)
    shard_fds: dict[Path, int] = {}
    try:
        for ordinal in ordinals:
            layer, expert = integrity.object_identity(layout, ordinal)
            position = layout.layer_position(layer)
            offset = int(offsets[ordinal])
            if digests is not None:
                got = integrity.object_digest(pread_exact(fd, layout.object_bytes_at(position), offset))
                if got != int(digests[ordinal]):
                    want = int(digests[ordinal])
                    message = integrity.mismatch_message(layer, expert, checked.pack_path, got, want)
                    raise integrity.ChecksumMismatch(message)
            for role in range(len(fmt.ROLES) if compare_gguf else 0):
                path, source_offset = entry_source(layout, sources, ordinal * len(fmt.ROLES) + role)
                if path not in shard_fds:
                    shard_fds[path] = os.open(path, os.O_RDONLY)
                role_offset = offset + layout.offsets_at(position)[role]
                nbytes = layout.sizes_at(position)[role]
                if not same_bytes(fd, role_offset, shard_fds[path], source_offset, nbytes):
                    name = routed_expert_name(layer, fmt.ROLES[role])
                    raise ValueError(
                        f"expert-pack payload does not match GGUF source for {name} expert {expert}"
                    )
    finally:
        for descriptor in (fd, *shard_fds.values()):
            os.close(descriptor)


def payload_sources(checked: CheckedPack) -> dict[str, tuple[Path, int]]:
    """{routed tensor name: (shard path, data offset)} from the manifest's source records."""
    shards = {
        int(shard["index"]): resolve_path(shard["path"], checked.manifest_path)
        for shard in checked.manifest["source"]["shards"]
    }
    return {
        record["name"]: (shards[int(record["shard_index"])], int(record["data_offset"]))
        for record in checked.manifest["source"]["tensors"]
        if ROUTED_EXPERT_RE.match(record["name"])
    }


def entry_source(
    layout: fmt.PackLayout, sources: dict[str, tuple[Path, int]], index: int
) -> tuple[Path, int]:
    """Where index entry `index` comes from in the GGUF: (shard path, absolute offset)."""
    layer, expert, role = layout.identity(index)
    path, data_offset = sources[routed_expert_name(layer, fmt.ROLES[role])]
    return path, data_offset + expert * layout.sizes_at(layout.layer_position(layer))[role]


def verify_payloads(checked: CheckedPack) -> str:
    """One sequential pass: SHA-256 of the whole pack, and every payload compared with the GGUF and
    checked for NaN or infinite scales (`check_finite_payload`)."""
    layout, sources = checked.layout, payload_sources(checked)
    types = {
        record["name"]: int(record["dtype_id"])
        for record in checked.manifest["source"]["tensors"]
        if ROUTED_EXPERT_RE.match(record["name"])
    }
    digest = hashlib.sha256()
    offsets = checked.index.object_offsets
    shard_fds: dict[Path, int] = {}
    pack_fd = os.open(checked.pack_path, os.O_RDONLY)
    try:
        position = _hash_span(pack_fd, 0, checked.index.data_start, digest)
        for index in range(layout.index_count):
            layer, expert, role = layout.identity(index)
            layer_position = layout.layer_position(layer)
            offset = int(offsets[index // 3]) + layout.offsets_at(layer_position)[role]
            nbytes = layout.sizes_at(layer_position)[role]
            position = _hash_span(pack_fd, position, offset, digest)
            path, source_offset = entry_source(layout, sources, index)
            if path not in shard_fds:
                shard_fds[path] = os.open(path, os.O_RDONLY)
            name = routed_expert_name(layer, fmt.ROLES[role])
            if not same_bytes(pack_fd, offset, shard_fds[path], source_offset, nbytes, digest):
                raise ValueError(f"expert-pack payload does not match GGUF source for {name} expert {expert}")
            what = f"{checked.pack_path}: {name} expert {expert}"
            check_finite_payload(pread_exact(pack_fd, nbytes, offset), types[name], what)
            position = offset + nbytes
    finally:
        for fd in (pack_fd, *shard_fds.values()):
            os.close(fd)
    return digest.hexdigest()


def check_finite_payload(payload: bytes | memoryview, ggml_type: int, what: str) -> None:
    """A routed expert's bytes hold no NaN or infinite value or scale: what the load checks in every other
    tensor (`gguf.weights.check_finite`), read here where every payload is read anyway."""
    problem = non_finite_problem(np.frombuffer(payload, dtype=np.uint8), ggml_type)
    if problem is not None:
        raise ValueError(f"{what}: {problem}; its GGUF is damaged")


def _hash_span(fd: int, start: int, end: int, digest: Any) -> int:
    digest.update(pread_exact(fd, end - start, start))
    return end


DEFAULT_OBJECT_SAMPLES = 8


def verify_pack(
    manifest_path: str | os.PathLike[str],
    *,
    full: bool = False,
    profile: str = "generic",
    pack_path: str | os.PathLike[str] | None = None,
    object_samples: int = DEFAULT_OBJECT_SAMPLES,
    record: bool = False,
) -> dict[str, Any]:
    """Raise on the first failure (one-line message); return a summary when the pack is sound. `record`
    (a manifest without checksums): verify in full, then record the checksums beside the manifest."""
    full = full or record
    checked = check_structure(manifest_path, profile=profile, pack_path=pack_path, sidecar=not record)
    pack = checked.manifest["expert_pack"]
    digests = integrity.object_checksums(checked.manifest, checked.layout)
    if record and digests is not None:
        raise ValueError(f"{manifest_path}: the manifest already records checksums; nothing to record")
    objects = len(checked.layout.moe_layers) * checked.layout.num_experts
    # quick: a sample, hashed and compared with the GGUF; full: every payload compared with the GGUF,
    # then every object hashed
    ordinals = list(range(objects)) if full else sample_objects(checked, object_samples)
    if not full:
        check_object_samples(checked, ordinals, digests)
    summary: dict[str, Any] = {
        "ok": True,
        "manifest": str(checked.manifest_path.resolve()),
        "pack": str(checked.pack_path),
        "profile": profile,
        "full": full,
        "size": checked.index.size,
        "index_count": checked.layout.index_count,
        "index_sha256": checked.index.index_sha256,
        "moe_layers": len(checked.layout.moe_layers),
        "num_experts": checked.layout.num_experts,
        "object_bytes": checked.layout.object_bytes,
        "checksums": integrity.ALGORITHM if digests is not None else None,
        "checksums_file": checked.manifest.get("integrity", {}).get("recorded_in"),
        "objects_sampled": 0 if full else len(ordinals),
        "objects_hashed": len(ordinals) if digests is not None else 0,
        "shards_fingerprinted": 0 if digests is None else len(checked.manifest["source"]["shards"]),
    }
    if full:
        sha256 = verify_payloads(checked)
        check_object_samples(checked, ordinals, digests, compare_gguf=False)
        if pack.get("sha256") is not None and sha256 != pack["sha256"]:
            raise ValueError("Kimi expert-pack SHA-256 does not match manifest")
        summary.update(
            sha256=sha256,
            payloads_verified=checked.layout.index_count,
            sha256_in_manifest=pack.get("sha256") is not None,
        )
    if record:
        summary["checksums_recorded"] = str(record_checksums(checked))
    return summary


def record_checksums(checked: CheckedPack) -> Path:
    """The `integrity` section of a verified pack (every object's xxh3_64, each shard's fingerprint),
    written beside its manifest (`integrity.write_sidecar`)."""
    hasher = integrity.ObjectHasher(checked.layout)
    fd = os.open(checked.pack_path, os.O_RDONLY)
    try:
        hasher.hash_objects(fd, range(hasher.digests.size))
    finally:
        os.close(fd)
    shards = present_shards(checked.manifest, checked.manifest_path)
    section = integrity.integrity_section(
        hasher.complete(), [record for record, _ in shards], [path for _, path in shards]
    )
    return integrity.write_sidecar(checked.manifest_path, section)
