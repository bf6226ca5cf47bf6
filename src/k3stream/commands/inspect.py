"""`k3stream inspect PATH [--json] [--profile generic|audited]`: describe a Kimi-K3 GGUF (PATH: the GGUF, any
shard, its directory, or a pack's manifest, which names its GGUF).

Config, layer map (KDA/MLA, dense/MoE), bytes by tensor class, GGML type histogram, the recipe per MoE
layer and role with its bits per weight and bytes per token uncached, shards, the profile in force and
whether the checkpoint follows the audited recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

MAX_NAME_CHARS = 200  # of general.name on the text line (the JSON holds it whole)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k3stream.gguf.profile import PROFILES

    parser.add_argument(
        "path",
        metavar="PATH",
        help="a GGUF, any shard of a split set, a directory, or a pack's manifest (its GGUF)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--profile", default="generic", choices=tuple(PROFILES), help="checkpoint profile to enforce"
    )


def _layer_map(config) -> list[dict[str, Any]]:
    return [
        {
            "layer": i,
            "attention": "MLA" if config.is_mla(i) else "KDA",
            "ffn": "MoE" if config.is_moe(i) else "dense",
            "banked": i % config.block_size == 0,
        }
        for i in range(config.n_layers)
    ]


def _bytes_by_class(checkpoint) -> dict[str, int]:
    from k3stream.gguf.layout import is_routed_expert

    routed = sum(t.nbytes for t in checkpoint.tensors.values() if is_routed_expert(t.name))
    total = sum(t.nbytes for t in checkpoint.tensors.values())
    moe = checkpoint.config.moe_layers
    return {
        "non_expert": total - routed,
        "routed_experts": routed,
        "total": total,
        # one expert's up+gate+down in one layer: the unit an expert pack stores and streams
        "expert_object": routed // (len(moe) * checkpoint.config.n_experts) if moe else 0,
    }


def _type_histogram(checkpoint) -> dict[str, dict[str, int]]:
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for info in checkpoint.tensors.values():
        counts[info.type_name] += 1
        sizes[info.type_name] += info.nbytes
    return {name: {"tensors": counts[name], "bytes": sizes[name]} for name in sorted(counts)}


def _shards(checkpoint) -> list[dict[str, Any]]:
    return [
        {
            "path": str(path),
            "tensors": sum(1 for t in checkpoint.tensors.values() if t.shard_index == index),
            "file_bytes": path.stat().st_size,
        }
        for index, path in enumerate(checkpoint.shards)
    ]


def describe(checkpoint) -> dict[str, Any]:
    """Everything `inspect` reports, as one JSON-ready dict."""
    from k3stream.gguf.profile import check_recipe
    from k3stream.gguf.recipe import recipe_report

    cfg = checkpoint.config
    derived = {"mla_layers": list(cfg.mla_layers), "moe_layers": list(cfg.moe_layers)}
    config = dataclasses.asdict(cfg) | derived
    deviations = check_recipe(checkpoint)
    return {
        "path": str(checkpoint.shards[0]),
        "name": checkpoint.metadata("general.name"),
        "profile": checkpoint.profile.name,
        "audited_recipe": not deviations,
        "recipe_deviations": deviations,
        "config": config,
        "layers": _layer_map(checkpoint.config),
        "bytes": _bytes_by_class(checkpoint),
        "types": _type_histogram(checkpoint),
        "recipe": recipe_report(checkpoint),
        "shards": _shards(checkpoint),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _layer_line(layers: list[dict[str, Any]]) -> str:
    return " ".join(f"{row['layer']}:{row['attention']}/{row['ffn']}" for row in layers)


def _object_text(report: dict[str, Any]) -> str:
    """One expert object's bytes; the range when a mixed recipe gives the layers other sizes (the JSON's
    `expert_object` is then their mean)."""
    sizes = sorted({row["object_bytes"] for row in report["recipe"]["moe_layers"]})
    if len(sizes) > 1:
        return f"expert objects {sizes[0]:,} to {sizes[-1]:,} B by layer"
    return f"one expert object {report['bytes']['expert_object']:,} B"


def shown_name(name: object) -> str:
    """`general.name` as the text line prints it: the file's author chose it, so a character a terminal
    acts on (a control such as ESC, a format mark such as a right-to-left override) is written escaped,
    and a name past MAX_NAME_CHARS is cut."""
    text = str(name)
    if len(text) > MAX_NAME_CHARS:
        text = text[:MAX_NAME_CHARS] + "..."
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)


def format_text(report: dict[str, Any]) -> str:
    from k3stream.gguf.recipe import recipe_lines

    config, sizes, types = report["config"], report["bytes"], report["types"]
    recipe = "yes" if report["audited_recipe"] else f"no ({len(report['recipe_deviations'])} deviations)"
    lines = [
        f"{report['path']}  ({shown_name(report['name'])}, {len(report['shards'])} shard(s))",
        f"profile: {report['profile']}   audited recipe: {recipe}",
        "config: " + ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("source", "head_count_kv")),
        f"layers: {_layer_line(report['layers'])}",
        f"bytes: non-expert {_mib(sizes['non_expert'])}, routed experts {_mib(sizes['routed_experts'])}, "
        f"total {_mib(sizes['total'])}, {_object_text(report)}",
        "types: " + ", ".join(f"{t} {v['tensors']} tensors {_mib(v['bytes'])}" for t, v in types.items()),
        *recipe_lines(report["recipe"]),
        "shards:",
        *(f"  {s['path']}  {s['tensors']} tensors  {_mib(s['file_bytes'])}" for s in report["shards"]),
    ]
    lines += [f"  deviation: {d}" for d in report["recipe_deviations"][:8]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.pack.source import is_manifest, manifest_gguf

    path = Path(args.path)
    report = describe(
        K3Checkpoint.open(manifest_gguf(path) if is_manifest(path) else path, profile=args.profile)
    )
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0
