"""Run under torchrun by tests/test_parallel_cache.py: the `generate` command's runtime with its prompt
cache (`--cache-ram`, `--cache-every`), on rank 0 pairs of logits (a prompt restored from the cache at
p, and the same prompt prefilled cold, then decode steps from each) saved to OUT (torch.save) with the
tokens each restore reused.

    torchrun --nproc-per-node N tests/parallel_cache_worker.py OUT -- GENERATE_FLAGS...
"""

from __future__ import annotations

import sys

import torch

from k3stream.cli import build_parser
from k3stream.commands.flags import cache_from_args
from k3stream.commands.launch import parallel_runtime
from k3stream.engine.chunked_prefill import ChunkedPrefill, PrefillChunks, step_together

CHUNK = 16  # the KDA chunk (`KDA.chunk_size`)
STEPS = 3  # decode steps after each prefill


def main(argv: list[str]) -> int:
    out = argv[0]
    command = ["generate", *argv[argv.index("--") + 1 :], "--prompt", "unused"]
    args = build_parser(command).parse_args(command)
    torch.set_num_threads(1)
    with parallel_runtime(args) as runtime:
        if runtime is None:
            return 0
        model = runtime.model
        cache = cache_from_args(args, model)
        checks = {f"p={p}": restored_at(model, cache, p, seed=p) for p in (0, 1, CHUNK - 1, CHUNK + 1)}
        checks["after decode steps"] = after_decode(model, cache)
        checks["inside a prefill"] = inside_prefill(model, cache, every=args.cache_every)
        checks["batched"] = batched(model, cache)
        cache.close()
        torch.save({"checks": checks, "hits": cache.stats.hits}, out)
    return 0


def ids(model, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (length,), generator=generator).tolist()


def continued(model, state, logits: torch.Tensor) -> torch.Tensor:
    """`logits` and those of STEPS greedy decode steps from `state`."""
    rows = [logits]
    for _ in range(STEPS):
        rows.append(model.decode(state, int(rows[-1].argmax())))
    return torch.stack(rows)


def cold(model, tokens: list[int]) -> torch.Tensor:
    state = model.new_state()
    return continued(model, state, model.prefill_last(state, tokens))


def warm(model, cache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    got = cache.prefill(tokens)
    return got.reused, continued(model, got.state, got.logits)


def restored_at(model, cache, p: int, seed: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A prompt restored at p (its first p tokens' prompt cached first), and cold."""
    tokens = ids(model, 2 * CHUNK + 8, seed=100 + seed)
    if p:
        cache.prefill(tokens[:p])
    return (*warm(model, cache, tokens), cold(model, tokens))


def after_decode(model, cache) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A response's end snapshotted after decode steps, then the next turn restored there."""
    prompt = ids(model, 20, seed=7)
    got = cache.prefill(prompt)
    fed = [int(got.logits.argmax())]
    for _ in range(4):
        fed.append(int(model.decode(got.state, fed[-1]).argmax()))
    cache.save(prompt + fed[:-1], got.state)
    tokens = prompt + fed + ids(model, 9, seed=8)
    return (*warm(model, cache, tokens), cold(model, tokens))


def inside_prefill(model, cache, every: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A branch off a long prompt restored at a snapshot its prefill took inside (at `every`)."""
    prompt = ids(model, 2 * every + 5, seed=9)
    cache.prefill(prompt)
    tokens = prompt[: every + 3] + ids(model, 6, seed=10)
    return (*warm(model, cache, tokens), cold(model, tokens))


def batched(model, cache) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Two prompts sharing a cached system prompt prefilled in one pass (a server's batch)."""
    system = ids(model, 24, seed=11)
    cache.prefill(system)
    prompts = [system + ids(model, 5 + i, seed=12 + i) for i in range(2)]
    prefills = [ChunkedPrefill(model, tokens, cache) for tokens in prompts]
    step_together(prefills, PrefillChunks(512))
    reused = sum(prefill.reused for prefill in prefills)
    warm_rows = torch.stack([prefill.logits for prefill in prefills])
    cold_rows = torch.stack([model.prefill_last(model.new_state(), tokens) for tokens in prompts])
    return reused, warm_rows, cold_rows


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
