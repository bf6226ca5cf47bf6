"""`k3stream verify SOURCE`: check an expert pack against its manifest and its GGUF. SOURCE is what the
other commands take: the manifest, or a GGUF (a file, any shard, a directory) packed with the default
outputs. `--record-checksums` gives a manifest without checksums (sglang's) a checksums file beside it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3stream.cli import say


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3stream.gguf.profile import AUDITED_MODEL as REAL
    from k3stream.gguf.profile import PROFILES

    parser.add_argument(
        "source",
        type=Path,
        help="the pack's .manifest.json, or a GGUF (any shard, or its directory) with its pack beside it",
    )
    parser.add_argument(
        "--full", action="store_true", help="also hash the whole pack and compare every payload with the GGUF"
    )
    parser.add_argument(
        "--record-checksums",
        action="store_true",
        help="for a manifest without checksums (sglang's): verify in full, then record every object's "
        "checksum beside the manifest (NAME.checksums.json), which every later read checks",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    real = f"{REAL.n_layers} layers, {REAL.n_experts} experts, top-{REAL.top_k}, Q2_K/Q2_K/Q3_K"
    parser.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default="generic",
        help=f"audited: the real Kimi-K3 ({real}); "
        "generic: any model of the same structure, checked against its GGUF config",
    )
    parser.add_argument("--pack", type=Path, help="the pack the manifest must name (default: the manifest's)")


def run(args: argparse.Namespace) -> int:
    from k3stream.pack.verify import verify_pack

    try:
        args.manifest = manifest_of(args.source)
        summary = verify_pack(
            args.manifest,
            full=args.full,
            profile=args.profile,
            pack_path=args.pack,
            record=args.record_checksums,
        )
    except (OSError, ValueError) as exc:
        message = str(exc)
        if args.json:
            print(json.dumps({"ok": False, "manifest": str(args.source), "error": message}))
        else:
            say(f"k3stream verify: error: {message}")
        return 1
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"OK {summary['pack']}: {summary['index_count']} entries, {summary['size']} bytes, "
            f"{summary['moe_layers']} MoE layers x {summary['num_experts']} experts ({checked_text(summary)})"
        )
    return 0


def manifest_of(source: Path) -> Path:
    """The manifest itself, or the one `k3stream pack` writes beside a GGUF by default."""
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.gguf.shards import discover_shards
    from k3stream.pack.builder import plan_pack
    from k3stream.pack.paths import default_outputs
    from k3stream.pack.source import is_manifest, manifest_next_to

    if is_manifest(source):
        return source
    manifest = manifest_next_to(source)
    if manifest is None:
        plan_pack(K3Checkpoint.open(source))  # a GGUF `pack` would refuse says why, not "pack it"
        looked = default_outputs(discover_shards(source))[1].name
        raise FileNotFoundError(
            f"{source}: no expert pack beside it (looked for {looked}); run `k3stream pack {source}` "
            "first, or give the pack's manifest"
        )
    return manifest


def checked_text(summary: dict) -> str:
    """What was checked, in words; says so when the manifest records no checksums."""
    parts = ["header, index, shards"]
    recorded_in = f" (from {summary['checksums_file']})" if summary.get("checksums_file") else ""
    if summary.get("checksums"):
        hashed, algorithm = summary["objects_hashed"], summary["checksums"]
        parts.append(f"shard data samples, {hashed} object {algorithm} checksums{recorded_in}")
    elif summary.get("checksums_recorded"):
        parts.append(f"checksums recorded in {summary['checksums_recorded']}")
    else:
        parts.append("no checksums (the manifest records none: record them with --record-checksums)")
    if summary.get("full"):
        parts.append("SHA-256 and every payload")
    else:
        parts.append(f"{summary['objects_sampled']} sampled objects against the GGUF")
    return ", ".join(parts)
