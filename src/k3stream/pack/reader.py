"""Open a checked expert pack: where each expert object and role slice lies, never touching payloads."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3stream.pack import format as fmt
from k3stream.pack.fileio import pread_into
from k3stream.pack.integrity import ChecksumMismatch, mismatch_message, object_checksums, object_digest
from k3stream.pack.paths import absolute, resolve_path
from k3stream.pack.source import sorted_shards
from k3stream.pack.verify import check_structure

log = logging.getLogger(__name__)
_WARNED: set[Path] = set()  # manifests warned about in this process


def _warn_unchecked(manifest: Path) -> None:
    """One line, once per manifest and process: its objects are read unchecked."""
    if manifest not in _WARNED:
        _WARNED.add(manifest)
        log.warning(
            f"k3stream: {manifest} records no checksums: a pack changed in place would be served unchecked; "
            f"`k3stream verify {manifest} --record-checksums` records them beside it"
        )


@dataclass(frozen=True)
class RoleSlice:
    offset: int  # absolute in the pack file
    nbytes: int
    ggml_type: int
    shape: tuple[int, int]  # (out, in): up/gate (expert_ff, latent), down (latent, expert_ff)


class ExpertPack:
    """An expert pack validated on open (manifest, header and index; no payload bytes are read).

    `profile="audited"` enforces the real model; `"generic"` checks the manifest against the GGUF's
    config (or `config`, a `K3Config`, when given). `pack_path`, when given, must be the manifest's pack.
    """

    def __init__(
        self,
        manifest_path: str | os.PathLike[str],
        profile: str = "generic",
        *,
        config: Any = None,
        pack_path: str | os.PathLike[str] | None = None,
    ) -> None:
        checked = check_structure(
            manifest_path, profile=profile, config=config, pack_path=pack_path, shards=False
        )
        self.manifest = checked.manifest
        self.manifest_path = absolute(checked.manifest_path)
        self.path = checked.pack_path
        self.layout = checked.layout
        self.size = checked.index.size
        self.index_sha256 = checked.index.index_sha256
        self._object_offsets = [int(offset) for offset in checked.index.object_offsets]
        self.top_k = checked.expected.top_k
        roles = self.manifest["expert_pack"]["roles"]
        layers = self.manifest["expert_pack"].get("layers")  # a mixed recipe's types per layer (checked)
        self._layer_types = [
            {role: int((layer["roles"] if layers else roles)[role]["dtype_id"]) for role in fmt.ROLES}
            for layer in (layers or [None] * len(self.layout.moe_layers))
        ]
        self._role_shapes = {role: tuple(reversed(roles[role]["logical_shape"])) for role in fmt.ROLES}
        # xxh3_64 of every object (layer-major) when the manifest or its sidecar records them (ours do;
        # sglang's manifests do not)
        self.checksums = object_checksums(self.manifest, self.layout)
        if self.checksums is None:
            _warn_unchecked(self.manifest_path)
        shards = sorted_shards(self.manifest)
        self.gguf_paths = [resolve_path(shard["path"], self.manifest_path) for shard in shards]
        # one descriptor for every thread (pread has no shared file offset); close() waits for reads in
        # flight, so a descriptor number is never reused under a reader. Closed at the latest when collected.
        self._fd = os.open(self.path, os.O_RDONLY)
        self._close_fd = weakref.finalize(self, os.close, self._fd)
        self._readers = 0
        self._state = threading.Condition()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.layout.moe_layers

    @property
    def num_experts(self) -> int:
        return self.layout.num_experts

    @property
    def object_bytes(self) -> int:
        return self.layout.object_bytes

    def object_range(self, layer: int, expert: int) -> tuple[int, int]:
        """(absolute offset, nbytes) of one expert object: up, gate and down in one contiguous read."""
        self.layout.object_offset(layer, expert)  # range checks with one-line errors
        position = self.layout.layer_position(layer)
        return self._object_offsets[position * self.num_experts + expert], self.layout.object_bytes_at(
            position
        )

    def check_object(self, layer: int, expert: int, data: Any) -> None:
        """Raise ChecksumMismatch (one line: layer, expert, pack) unless `data` hashes as recorded;
        a no-op for a manifest without checksums."""
        if self.checksums is not None:
            self.check_digest(layer, expert, object_digest(data))

    def check_digest(self, layer: int, expert: int, got: int) -> None:
        """`check_object` of an object whose digest (`integrity.object_digest`) is `got`."""
        if self.checksums is None:
            return
        want = int(self.checksums[self.layout.layer_position(layer) * self.num_experts + expert])
        if got != want:
            raise ChecksumMismatch(mismatch_message(layer, expert, self.path, got, want))

    def role_slices(self, layer: int, expert: int) -> dict[str, RoleSlice]:
        start, _ = self.object_range(layer, expert)
        position = self.layout.layer_position(layer)
        offsets, sizes = self.layout.offsets_at(position), self.layout.sizes_at(position)
        return {
            role: RoleSlice(
                start + offsets[index],
                sizes[index],
                self._layer_types[position][role],
                self._role_shapes[role],
            )
            for index, role in enumerate(fmt.ROLES)
        }

    def read_object(self, layer: int, expert: int, buf: bytearray | memoryview | None = None) -> memoryview:
        """The object's bytes via `os.pread`, into `buf` (at least object_bytes long) when given."""
        offset, nbytes = self.object_range(layer, expert)
        view = memoryview(bytearray(nbytes) if buf is None else buf)[:nbytes]
        if len(view) != nbytes:
            raise ValueError(f"read_object: a {len(view)}-byte buffer is smaller than the object ({nbytes})")
        with self._state:
            if not self._close_fd.alive:
                raise ValueError(f"{self.path}: read_object on a closed ExpertPack")
            self._readers += 1
        try:
            got = pread_into(self._fd, view, offset)
        finally:
            with self._state:
                self._readers -= 1
                self._state.notify_all()
        if got != nbytes:
            raise ValueError(f"{self.path}: file ends inside expert {expert} of layer {layer}")
        self.check_object(layer, expert, view)
        return view

    def close(self) -> None:
        with self._state:
            self._state.wait_for(lambda: self._readers == 0)
            self._close_fd()

    def __enter__(self) -> ExpertPack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
