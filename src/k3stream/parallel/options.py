"""The parallel flags of the model commands (no torch import: `k3stream CMD --help` stays fast)."""

from __future__ import annotations

import argparse

# how long a rank waits in one collective for the others (a stopped peer); a dead one is seen at once
DEFAULT_TIMEOUT_S = 20.0


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tp`/`--ep` (1 or the number of ranks `torchrun` started) and the collective timeout."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: 1 or all (under torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: 1 or all (under torchrun)")
    parser.add_argument(
        "--dist-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a rank waits for the others in one step before failing (default %(default)s)",
    )
