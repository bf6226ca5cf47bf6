"""`k3stream make-tiny OUT_DIR [...]`: a random tiny Kimi-K3 GGUF, one flag per `TinySpec` field."""

from __future__ import annotations

import argparse
import dataclasses

from k3stream.gguf.writer import RECIPES, TinySpec
from k3stream.testing.tiny import make_tiny

FLAG_ALIASES = {
    "n_layers": "--layers",
    "n_experts": "--experts",
    "n_dense": "--dense",
    "n_shared": "--shared",
}


def _optional(parse):
    def parse_or_none(text: str):
        return None if text.lower() == "none" else parse(text)

    return parse_or_none


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def field_parser(field: dataclasses.Field):
    if field.name == "mla_layers":
        return _optional(_int_tuple)
    if field.name == "recipe":
        return str
    parse = float if isinstance(field.default, float) or field.name == "gate_lower_bound" else int
    return _optional(parse) if field.default is None or "None" in str(field.type) else parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the GGUF (or its shards) into")
    for field in dataclasses.fields(TinySpec):
        flag = FLAG_ALIASES.get(field.name, "--" + field.name.replace("_", "-"))
        extra = {"choices": RECIPES} if field.name == "recipe" else {}
        parser.add_argument(
            flag,
            dest=field.name,
            type=field_parser(field),
            default=field.default,
            help=f"default {field.default}" + (" ('none' to omit)" if "None" in str(field.type) else ""),
            **extra,
        )


def run(args: argparse.Namespace) -> int:
    spec = TinySpec(**{field.name: getattr(args, field.name) for field in dataclasses.fields(TinySpec)})
    path = make_tiny(args.out_dir, spec)
    print(path)
    return 0
