"""`k3stream pack GGUF_PATH`: build the expert-major pack and its manifest (resumable)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from k3stream.commands.flags import non_negative, non_negative_count, positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", type=Path, help="a .gguf file, any shard of a split set, or a directory")
    parser.add_argument("--out", help="pack path (default: NAME.expert-major.pack by the shards)")
    parser.add_argument("--manifest", help="manifest path (default: PACK.manifest.json)")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--force", action="store_true", help="replace an existing pack and manifest")
    existing.add_argument(
        "--relink",
        action="store_true",
        help="a copied model folder: check the copy's GGUF and pack against the manifest beside them "
        "(sizes, metadata, sampled checksums; the pack is not read again) and point the manifest's paths "
        "at them",
    )
    paths = parser.add_mutually_exclusive_group()
    paths.add_argument(
        "--absolute-paths",
        dest="relative_paths",
        action="store_false",
        default=False,
        help="store absolute paths, what sglang writes and requires (default); a moved folder "
        "is still read: files gone from their paths are found beside the manifest",
    )
    paths.add_argument(
        "--relative-paths",
        dest="relative_paths",
        action="store_true",
        help="store paths relative to the manifest's directory (sglang's run-time store refuses them)",
    )
    from k3stream.gguf.profile import PROFILES

    parser.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default="generic",
        help="checkpoint profile to enforce: generic (any supported type) or audited (the published recipe; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--safety-margin-gib", type=non_negative, default=2.0, help="free space to keep beyond the pack (GiB)"
    )
    parser.add_argument(
        "--payload-samples",
        type=non_negative_count,
        default=6,
        help="entries compared with the GGUF after writing",
    )
    parser.add_argument("--full-hash", action="store_true", help="store the pack's SHA-256 in the manifest")
    parser.add_argument(
        "--sync-mib",
        type=positive,
        default=256.0,
        help="make progress durable (fsync + journal) every this many MiB",
    )
    parser.add_argument("--full-source-hashes", action="store_true", help="store each shard's SHA-256")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from k3stream.pack.builder import BuildOptions, build_pack

    options = BuildOptions(
        relative_paths=args.relative_paths,
        force=args.force,
        margin_bytes=int(args.safety_margin_gib * 1024**3),
        payload_samples=args.payload_samples,
        full_hash=args.full_hash,
        full_source_hashes=args.full_source_hashes,
        progress=not args.no_progress,
        sync_bytes=int(args.sync_mib * 1024**2),
    )
    if args.relink:
        return _relink(args)
    _check_tokenizer(args.gguf, args.profile)
    with _printed_notes("k3stream.pack.builder"):
        result = build_pack(args.gguf, args.out, args.manifest, options, profile=args.profile)
    method = "copy_file_range" if result.kernel_copy else "pread/pwrite"
    print(f"pack      {result.pack} ({result.size} bytes)")
    print(f"manifest  {result.manifest}")
    print(
        f"copied    {result.copied_bytes} bytes in {result.copy_seconds:.2f} s "
        f"({result.throughput / 1024**2:.1f} MiB/s, {method}); {result.seconds:.2f} s in all"
    )
    print(f"resumed   {result.resumed_bytes} bytes")
    return 0


def _relink(args: argparse.Namespace) -> int:
    from k3stream.pack.relink import relink_pack

    relinked = relink_pack(args.gguf, args.out, args.manifest, args.profile)
    if relinked.written:
        print(f"relinked  {relinked.manifest}: its paths name the files checked against its records")
    else:
        print(
            f"unchanged {relinked.manifest}: already bound to the files checked against its records; "
            "nothing written"
        )
    return 0


def _check_tokenizer(gguf: str, profile: str) -> None:
    """Read the GGUF's tokenizer before any pack is written: a file whose vocabulary no command can run
    (llama.cpp refuses it too) gets its one-line error here, not after the copy."""
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.gguf.reader import K3Checkpoint

    Tokenizer.from_gguf(K3Checkpoint.open(gguf, profile=profile))


@contextmanager
def _printed_notes(logger_name: str) -> Iterator[None]:
    """The library logs (a resumed build, a damaged entry); the command prints them on stdout."""
    logger = logging.getLogger(logger_name)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
