"""`k3stream make-tiny OUT_DIR [...]`: a random tiny Kimi-K3 GGUF, one flag per `TinySpec` field;
`--like kimi-k3 --layers N` starts from the released model's shapes (`testing.slices`) instead."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from k3stream.cli import UsageError
from k3stream.commands.flags import finite, positive
from k3stream.gguf.shards import SHARD_NAME
from k3stream.gguf.writer import FITTING_SHAPES, FLOAT_RECIPES, RECIPES, TinySpec, check_spec, shard_paths
from k3stream.testing.slices import LIKE, REAL_VOCAB, like
from k3stream.testing.tiny import make_tiny
from k3stream.testing.tinyvocab import tiny_vocab

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


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _yes_no(text: str) -> bool:
    if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "yes", "1")


def field_parser(field: dataclasses.Field):
    if isinstance(field.default, bool):
        return _yes_no
    if field.name == "mla_layers":
        return _optional(_int_tuple)
    if field.name == "recipe":
        return str
    if field.name == "without":
        return _names
    if field.name == "rms_eps":  # nan, inf or 0 and below would give every norm NaN or a division by 0
        return positive
    # a float field is written into the GGUF's metadata, which both engines compute with: finite only
    parse = finite if isinstance(field.default, float) or field.name == "gate_lower_bound" else int
    return _optional(parse) if field.default is None or "None" in str(field.type) else parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the GGUF (or its shards) into")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace the model of the same name in OUT_DIR (its GGUF or shards, whatever their "
        "--shards), and remove the expert pack `k3stream pack` made beside it (a pack of the replaced "
        "weights); other files stay",
    )
    parser.add_argument(
        "--like",
        choices=sorted(LIKE),
        default=None,
        help="a real-dimension slice: the model's shapes and layer pattern for --layers layers "
        "(2 unless given), release-like recipe (q8_0); other flags override",
    )
    parser.add_argument(
        "--real-vocab",
        action="store_true",
        help="with --like: the model's vocabulary size (tokenizer padded)",
    )
    for field in dataclasses.fields(TinySpec):
        extra = {"choices": RECIPES} if field.name == "recipe" else {}
        if field.name in FITTING_SHAPES:
            extra = {
                "help": f"default {field.default} ({FITTING_SHAPES[field.name]} with a quantized recipe)"
            }
        if field.name in DEFAULTS_WITH_LIKE:
            extra["help"] = f"default {field.default} ({DEFAULTS_WITH_LIKE[field.name]} with --like)"
        parser.add_argument(
            flag_of(field.name),
            dest=field.name,
            type=field_parser(field),
            default=argparse.SUPPRESS,  # `run` tells given flags from defaults
            **spec_flag_text(field, field.default) | extra,
        )


# the defaults --like changes that are not the model's shapes
LIKE_LAYERS = 2
DEFAULTS_WITH_LIKE = {"n_layers": str(LIKE_LAYERS), "top_k": "min(16, --experts)", "recipe": "q8_0"}

# the spec fields whose flag needs more words than its default
SPEC_FLAG_TEXT = {
    "mla_layers": {
        "metavar": "I,J,...",
        "help": "MLA layer indices, comma-separated (default or 'none': every 4th from 1, and the last)",
    },
    "vocab": {"help": "vocabulary size, the built-in tokenizer padded with unused tokens (default: its 593)"},
    "release_matrices": {
        "metavar": "true|false",
        "help": "a mixed recipe's other matrices quantized as its releases store them (Q8_0 where it "
        "names none, the token table too); default false, true with --like",
    },
    "without": {
        "metavar": "GROUPS",
        "help": "optional tensors to leave out: attn_gate, shexp (comma-separated)",
    },
}


def spec_flag_text(field: dataclasses.Field, default: object) -> dict[str, str]:
    """argparse's help (and metavar) for the flag of a `TinySpec` field whose default is `default`."""
    if field.name in SPEC_FLAG_TEXT:
        return SPEC_FLAG_TEXT[field.name]
    return {"help": f"default {default}" + (" ('none' to omit)" if "None" in str(field.type) else "")}


def flag_of(field_name: str) -> str:
    return FLAG_ALIASES.get(field_name, "--" + field_name.replace("_", "-"))


def in_flag_words(error: ValueError) -> ValueError:
    """`TinySpec`'s messages name its fields; a make-tiny user knows them as flags."""
    text = str(error)
    for field in dataclasses.fields(TinySpec):
        text = re.sub(rf"\bTinySpec\.{field.name}\b", flag_of(field.name), text)
    return ValueError(text.replace("TinySpec: ", ""))


def spec_from_args(args: argparse.Namespace) -> TinySpec:
    given = {
        field.name: getattr(args, field.name) for field in dataclasses.fields(TinySpec) if field.name in args
    }
    if args.like is None:
        if args.real_vocab:
            raise ValueError("--real-vocab needs --like")
        if given.get("recipe", TinySpec.recipe) not in FLOAT_RECIPES:
            given = FITTING_SHAPES | given
        return TinySpec(**given)
    if args.real_vocab:
        if "vocab" in given:
            raise ValueError("--real-vocab and --vocab: give one")
        given["vocab"] = REAL_VOCAB[args.like]
    return like(args.like, given.pop("n_layers", LIKE_LAYERS), **given)


def replace_outputs(out_dir: str, spec: TinySpec, force: bool) -> None:
    """Refuse (one line naming the file) to replace a model of the name make-tiny writes in `out_dir`,
    in any number of shards, unless `force`; with it, remove what was written for that model: its GGUF
    or shards that `spec`'s do not overwrite (another `--shards`), and the pack outputs `k3stream pack`
    wrote beside them by default (pack, manifest, checksums, a partial build and its journal), which
    describe the weights being replaced. Other files in `out_dir` stay."""
    from k3stream.pack.builder import build_lock, journal_path
    from k3stream.pack.integrity import sidecar_path
    from k3stream.pack.paths import default_outputs

    shards = shard_paths(Path(out_dir), spec.shards)
    existing = model_files(Path(out_dir))
    if not existing:
        return
    if not force:
        raise FileExistsError(f"refusing to overwrite existing model {existing[0]} (use --force)")
    pack, manifest = default_outputs(existing)
    partial = pack.with_name(pack.name + ".partial")
    with build_lock(pack):  # refused while a pack build runs on these files
        # the manifest first, so no complete manifest ever describes a pack being removed
        for owned in (manifest, sidecar_path(manifest), pack, partial, journal_path(partial)):
            owned.unlink(missing_ok=True)
        for old in set(existing) - set(shards):
            old.unlink()


def model_files(out_dir: Path) -> list[Path]:
    """The GGUF files of make-tiny's model name in `out_dir`, sorted: `NAME.gguf` and its shards of any
    count (`NAME-0000K-of-0000N.gguf`)."""
    single = shard_paths(out_dir, 1)[0]
    stem = single.name.removesuffix(".gguf")

    def ours(path: Path) -> bool:
        match = SHARD_NAME.match(path.name)
        return path == single or (match is not None and match["stem"] == stem)

    return sorted(path for path in out_dir.glob("*.gguf") if ours(path))


def checked_spec(args: argparse.Namespace) -> TinySpec:
    """The spec the flags describe, its shapes checked against its recipe (`check_spec`, with the vocabulary
    make-tiny writes): a UsageError in flag words, whatever OUT_DIR holds."""
    try:
        spec = spec_from_args(args)
        check_spec(spec, spec.vocab or len(tiny_vocab().tokens))
    except ValueError as error:
        raise UsageError(str(in_flag_words(error))) from None
    return spec


def run(args: argparse.Namespace) -> int:
    spec = checked_spec(args)
    try:
        replace_outputs(args.out_dir, spec, args.force)
        path = make_tiny(args.out_dir, spec)
    except ValueError as error:
        raise in_flag_words(error) from None
    print(path)
    return 0
