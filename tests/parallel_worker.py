"""Run under torchrun by tests/test_parallel.py and benchmarks/bench_parallel.py (one rank: by python
itself, as torchrun's one rank is a plain process too): the `generate` command's own runtime (same
flags, same `parallel_runtime`), a fixed prefill and fixed decode steps, then a second sequence
batched with the first, and on rank 0 the logits and every rank's report saved to OUT (torch.save).
ARITHMETIC, if given, sets the arithmetic whatever the flags' default: `float` (float32 activations)
or `ggml` (`--match-ggml`'s).

    torchrun --nproc-per-node N tests/parallel_worker.py OUT PROMPT_IDS DECODE_IDS [ARITHMETIC] -- FLAGS...
"""

from __future__ import annotations

import sys
import time

import torch

from k3stream.cli import build_parser
from k3stream.commands.launch import parallel_runtime, rank_report


def main(argv: list[str]) -> int:
    out, prompt, steps = argv[0], _ids(argv[1]), _ids(argv[2])
    command = ["generate", *argv[argv.index("--") + 1 :], "--prompt", "unused"]
    args = build_parser(command).parse_args(command)
    if argv[3] != "--":
        args.float_activations = {"float": True, "ggml": False}[argv[3]]
        args.match_ggml = not args.float_activations
    torch.set_num_threads(1)
    with parallel_runtime(args) as runtime:
        if runtime is None:
            return 0
        model = runtime.model
        start = time.perf_counter()
        state = model.new_state()
        logits = [model.prefill(state, prompt)]
        prefilled = time.perf_counter()
        logits += [model.decode(state, token)[None] for token in steps]
        seconds = {"prefill": prefilled - start, "decode": time.perf_counter() - prefilled}
        reports = model.reports() if hasattr(model, "reports") else [rank_report(runtime, [])]
        logits += batched(model, state, prompt, steps)  # timed and counted above: one sequence only
        torch.save({"logits": torch.cat(logits), "reports": reports, "seconds": seconds}, out)
    return 0


def batched(model, state, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """A second sequence, one step of both together (a server's batch), then the first alone after
    the second was dropped (the followers drop theirs too), then a third's `prefill_last`."""
    other = model.new_state()
    logits = [model.prefill(other, prompt[::-1]), model.decode_batch([state, other], steps[:2])]
    del other
    logits.append(model.decode(state, steps[0])[None])
    last = model.new_state()  # generation's prefill: the last token's logits alone
    logits.append(model.prefill_last(last, prompt)[None])
    return logits


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
