"""`k3stream perplexity MODEL --file TEXT`: perplexity and KL divergence as llama-perplexity reports them.

Results go to stdout in llama-perplexity's format (`[1]x,[2]y,...`, `Final estimate: PPL = x +/- y`, and
with `--kl-divergence` its per-chunk table and statistics blocks); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from k3stream.cli import UsageError
from k3stream.commands.flags import STDIN, add_model_arguments, input_file_bytes, runtime_from_args
from k3stream.engine.loading import Runtime, open_model

DEFAULT_CTX = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--file", "-f", default=None, help="text to evaluate (UTF-8; '-': stdin)")
    parser.add_argument(
        "--ctx",
        "--ctx-size",
        "-c",
        type=int,
        default=None,
        help=f"tokens per chunk (default {DEFAULT_CTX} or the model's shorter context, or the base's; 0: the "
        "model's, as llama.cpp's -c 0)",
    )
    parser.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="evaluate at most this many chunks (negative: all)",
    )
    parser.add_argument(
        "--batch", "-b", type=int, default=None, help="tokens per forward call (default: the whole chunk)"
    )
    parser.add_argument(
        "--kl-divergence-base",
        metavar="FILE",
        default=None,
        help="without --kl-divergence: save this run's log-probabilities there; with it: compare with them",
    )
    parser.add_argument(
        "--kl-divergence",
        action="store_true",
        help="compare this model's token distributions with --kl-divergence-base FILE",
    )


def _info(text: str) -> None:
    print(f"perplexity: {text}", file=sys.stderr, flush=True)


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _check_flags(args: argparse.Namespace) -> None:
    if args.kl_divergence and not args.kl_divergence_base:
        raise UsageError("--kl-divergence needs --kl-divergence-base FILE (the saved reference run)")
    if not args.file and not args.kl_divergence:
        raise UsageError("--file TEXT is required (with --kl-divergence the base file's tokens are used)")
    if args.batch is not None and args.batch < 1:
        raise UsageError(f"--batch {args.batch}: must be at least 1")
    if args.chunks is not None and args.chunks < 0:  # llama-perplexity's default, -1: every chunk
        args.chunks = None


def _text_source(args: argparse.Namespace, base: Any) -> str:
    """What the tokens come from, in messages: `--file` (stdin for `-`), else the base file."""
    if args.file == STDIN:
        return "stdin"
    return args.file or str(base.path)


def _plan(args: argparse.Namespace, text: str | None, tokenizer: Any, base: Any, context_length: int) -> Any:
    from k3stream.engine.perplexity import plan_chunks, text_tokens

    default = base.ctx if base is not None else min(DEFAULT_CTX, context_length)
    ctx = context_length if args.ctx == 0 else args.ctx or default  # `-c 0`: the model's, as llama.cpp's
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    source = _text_source(args, base)
    tokens = base.tokens if text is None else text_tokens(tokenizer, text)
    plan = plan_chunks(tokens, ctx, args.chunks, bos_id=bos, source=source, context_length=context_length)
    _info(
        f"{source}: {len(tokens)} tokens; {plan.n_chunk} chunks of n_ctx={plan.ctx}, "
        f"scoring the last {plan.scored} positions of each"
    )
    return plan


class _Chunks:
    """Runs the plan's chunks through the model, with llama-perplexity's timing line after the first."""

    def __init__(self, runtime: Runtime, plan: Any, batch: int | None) -> None:
        self.runtime, self.plan, self.batch = runtime, plan, plan.ctx if batch is None else batch

    def __iter__(self):
        from k3stream.engine.perplexity import chunk_logits

        for index in range(self.plan.n_chunk):
            start = time.perf_counter()
            logits = chunk_logits(self.runtime.model, self.plan.chunk(index), self.plan.first, self.batch)
            if self.runtime.store is not None:
                self.runtime.store.end_token(self.plan.ctx)
            if index == 0:
                seconds = time.perf_counter() - start
                _info(f"{seconds:.2f} seconds per pass - ETA {seconds * self.plan.n_chunk / 60:.2f} minutes")
            yield index, logits


def run_perplexity(runtime: Runtime, plan: Any, args: argparse.Namespace) -> float:
    """Prints `[i]ppl,` per chunk and the final estimate; saves the base when asked. Returns PPL."""
    from k3stream.engine.perplexity import BaseWriter, Perplexity, token_nll

    writer = None
    if args.kl_divergence_base:
        vocab = runtime.model.config.vocab_size
        writer = BaseWriter(args.kl_divergence_base, plan, vocab, Path(args.model).name)
        _info(f"saving the log-probabilities to {args.kl_divergence_base}")
    ppl = Perplexity()
    try:
        for index, logits in _Chunks(runtime, plan, args.batch):
            ppl.add(token_nll(logits, plan.targets(index)))
            if writer is not None:
                writer.add(logits)
            _out(f"[{index + 1}]{ppl.ppl:.4f},")
        if writer is not None:
            writer.close()
    except BaseException as exc:
        if writer is not None:
            writer.abort()
        if isinstance(exc, KeyboardInterrupt) and ppl.count:  # Ctrl-C: a started `[i]ppl,` line ends
            _out("\n")
        raise
    _out("\n")
    error = ppl.uncertainty()
    if error is None:
        _out(f"Final estimate: PPL = {ppl.ppl:.4f} (no uncertainty: the NLL has no spread)\n")
    else:
        _out(f"Final estimate: PPL = {ppl.ppl:.4f} +/- {error:.5f}\n")
    return ppl.ppl


TABLE_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
    "Δp RMS            Same top p\n"
)


def _chunk_row(index: int, kld: Any) -> str:
    import math

    log_ppl, d_log_ppl = kld.log_ppl()
    ratio, d_ratio = kld.log_ppl_ratio()
    mean_kld, d_kld = kld.kld()
    rms, d_rms = kld.p_diff_rms()
    top, d_top = kld.same_top()
    ppl = math.exp(log_ppl)
    return (
        f"{index + 1:4d}    {ppl:9.4f} ± {ppl * d_log_ppl:9.4f}    {ratio:10.5f} ± {d_ratio:10.5f}"
        f"    {mean_kld:10.5f} ± {d_kld:10.5f}    {100 * rms:6.3f} ± {100 * d_rms:6.3f} %"
        f"    {100 * top:6.3f} ± {100 * d_top:6.3f} %\n"
    )


def run_kl_divergence(runtime: Runtime, plan: Any, base: Any, batch: int | None = None) -> Any:
    """Prints llama-perplexity's KLD table and statistics; returns the `KLDivergence` sums."""
    from k3stream.engine.perplexity import KLDivergence, dequantize_log_probs

    kld = KLDivergence()
    rows = base.rows(plan.scored, plan.n_chunk)
    for index, logits in _Chunks(runtime, plan, batch):
        if index == 0:
            _out(TABLE_HEADER)
        lo = index * plan.scored
        span = slice(lo, lo + plan.scored)
        log_p = dequantize_log_probs(next(rows), base.scale[span], base.min_log_prob[span])
        kld.add(logits, log_p, plan.targets(index))
        _out(_chunk_row(index, kld))
    rows.close()
    _out("\n" + "\n".join(statistics_lines(kld)) + "\n")
    return kld


def statistics_lines(kld: Any) -> list[str]:
    """llama-perplexity's three closing blocks: perplexity, KL divergence, token probability."""
    return [*_ppl_block(kld), "", *_kld_block(kld), "", *_p_diff_block(kld)]


def _ppl_block(kld: Any) -> list[str]:
    import math

    from k3stream.engine.perplexity import covariance

    (log_q, d_q), (log_b, d_b) = kld.log_ppl(), kld.log_ppl_base()
    cov = covariance(kld.sum_nll, kld.sum_nll_base, kld.sum_nll_nll_base, kld.count)
    ppl_q, ppl_b = math.exp(log_q), math.exp(log_b)
    ratio, d_ratio = kld.log_ppl_ratio()
    cor = cov / (d_q * d_b) if d_q * d_b > 0 else 0.0
    diff_unc = math.sqrt(max((ppl_q * d_q) ** 2 + (ppl_b * d_b) ** 2 - 2 * ppl_q * ppl_b * cov, 0.0))
    return [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {ppl_q:10.6f} ± {ppl_q * d_q:10.6f}",
        f"Mean PPL(base)                : {ppl_b:10.6f} ± {ppl_b * d_b:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {d_ratio:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * d_ratio:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {ppl_q - ppl_b:10.6f} ± {diff_unc:10.6f}",
    ]


_KLD_LEVELS = (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900))
_LOW_LEVELS = (("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001))


def _kld_block(kld: Any) -> list[str]:
    from k3stream.engine.perplexity import median, percentile

    values = kld.sorted_kld()
    mean, error = kld.kld()
    return [
        "====== KL divergence statistics ======",
        f"Mean    KLD: {mean:10.6f} ± {error:10.6f}",
        f"Maximum KLD: {values[-1]:10.6f}",
        *(f"{label}   KLD: {percentile(values, q):10.6f}" for label, q in _KLD_LEVELS),
        f"Median  KLD: {median(values):10.6f}",
        *(f"{label}   KLD: {percentile(values, q):10.6f}" for label, q in _LOW_LEVELS),
        f"Minimum KLD: {values[0]:10.6f}",
    ]


def _p_diff_block(kld: Any) -> list[str]:
    from k3stream.engine.perplexity import mean_and_uncertainty, median, percentile

    values = kld.sorted_p_diff()
    mean, error = mean_and_uncertainty(kld.sum_p_diff, kld.sum_p_diff2, kld.count)
    levels, low = (*_KLD_LEVELS, ("75.0%", 0.750)), (("25.0%", 0.250), *_LOW_LEVELS)
    rms, d_rms = kld.p_diff_rms()
    top, d_top = kld.same_top()
    return [
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * mean:6.3f} ± {100 * error:5.3f} %",
        f"Maximum Δp: {100 * values[-1]:6.3f}%",
        *(f"{label}   Δp: {100 * percentile(values, q):6.3f}%" for label, q in levels),
        f"Median  Δp: {100 * median(values):6.3f}%",
        *(f"{label}   Δp: {100 * percentile(values, q):6.3f}%" for label, q in low),
        f"Minimum Δp: {100 * values[0]:6.3f}%",
        f"RMS Δp    : {100 * rms:6.3f} ± {100 * d_rms:5.3f} %",
        f"Same top p: {100 * top:6.3f} ± {100 * d_top:5.3f} %",
    ]


def run(args: argparse.Namespace) -> int:
    from k3stream.engine.perplexity import BaseFile, check_base_matches, file_text
    from k3stream.engine.tokenizer import Tokenizer
    from k3stream.gguf.shards import file_output, refuse_source_output

    _check_flags(args)
    text = file_text(input_file_bytes(args.file, "--file")) if args.file else None
    base = BaseFile.open(args.kl_divergence_base) if args.kl_divergence else None
    try:
        if base is not None and args.chunks is None:
            args.chunks = len(base.tokens) // base.ctx
        # the tokenizer before the model loads: a bad text or base fails fast
        opened = open_model(args.model, not args.no_stream_experts)
        if args.kl_divergence_base and base is None:  # this run writes the base: never over its inputs
            texts = (opened[1], None if args.file == STDIN else args.file)
            inputs = [*opened[0].shards, *[Path(p) for p in texts if p is not None]]
            target = file_output(args.kl_divergence_base, "--kl-divergence-base")
            refuse_source_output(target, inputs, "--kl-divergence-base")
        plan = _plan(args, text, Tokenizer.from_gguf(opened[0]), base, opened[0].config.context_length)
        args.ctx = plan.ctx  # the memory plan holds one chunk, the largest forward
        if base is not None:
            check_base_matches(base, plan, None, _text_source(args, base))
        runtime = runtime_from_args(args, opened)
        try:
            if base is None:
                run_perplexity(runtime, plan, args)
                return 0
            check_base_matches(base, plan, runtime.model.config.vocab_size, _text_source(args, base))
            run_kl_divergence(runtime, plan, base, args.batch)
        finally:
            runtime.close()
    finally:
        if base is not None:
            base.close()
    return 0
