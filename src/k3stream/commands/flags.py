"""The flags the model commands share, and what they ask for: the runtime, the sampling, the prompt
(no torch import at module level: `k3stream CMD --help` stays fast)."""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from k3stream.cli import UsageError
from k3stream.engine.chat import ChatTemplate
from k3stream.engine.loading import Runtime, StoreOptions, load_resolved, open_model
from k3stream.engine.parallel import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from k3stream.engine.prompt_cache import PromptCache
    from k3stream.gguf.reader import K3Checkpoint
    from k3stream.memlimit import MemoryPlan, ServedShape
    from k3stream.model.options import LoadOptions
    from k3stream.server.app import PrefillPass

DEFAULT_DISK_GIB = 16.0  # --cache-disk where --cache-dir is given alone
Number = TypeVar("Number", int, float)


def finite(text: str) -> float:
    """argparse type of sizes and times: a finite number (inf or nan would reach an int() or a budget)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _at_least(text: str, value: Number, least: int, refusal: str) -> Number:
    """`value`, read from `text`, where it is at least `least`; else argparse's `refusal` of `text`."""
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r} {refusal}")
    return value


def non_negative(text: str) -> float:
    """argparse type of budgets: a finite number, 0 or more."""
    return _at_least(text, finite(text), 0, "is below 0")


def at_least_one(text: str) -> int:
    """argparse type of counts of 1 or more (sequences, connections)."""
    return _at_least(text, int(text), 1, "is not a count of 1 or more")


def non_negative_count(text: str) -> int:
    """argparse type of counts that may be 0 (samples, entries)."""
    return _at_least(text, int(text), 0, "is below 0")


# the most threads a thread flag takes: llama.cpp's own cap (GGML_MAX_N_THREADS), far above any core
# count a CPU host has; a count in the thousands fails in the thread library (then segfaults in torch)
MAX_THREADS = 512


def threads(text: str) -> int:
    """argparse type of `--threads`: an integer up to `MAX_THREADS` (0 or less: every core)."""
    value = int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r} is above {MAX_THREADS} threads (llama.cpp's cap)")
    return value


def positive(text: str) -> float:
    """argparse type of scales such as an epsilon: a finite number above 0."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def count(text: str) -> int:
    """argparse type of thread counts: an integer, 1 to `MAX_THREADS`."""
    return _at_least(text, threads(text), 1, "is not a count of 1 or more")


def memory_size(text: str) -> str:
    """argparse type of `--memory-limit`: the size as given, once it reads as one (`parse_size`)."""
    from k3stream.memlimit import parse_size

    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--memory-limit: ")) from None
    return text


MODEL_HELP = "a Kimi-K3 GGUF (any shard), an expert-pack manifest (.json), or demo (the shipped model)"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, as the positional or llama.cpp's `-m MODEL` (`cli` refuses neither given), and how it
    loads."""
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=MODEL_HELP)
    parser.add_argument("-m", "--model", dest="model", default=None, help="the model, as llama.cpp's -m")
    parser.add_argument(
        "--ram-mib",
        type=non_negative,
        default=None,
        help="RAM budget of the expert store (MiB); without a pack, the GGUF's routed experts stay in RAM "
        "when all of them fit it; default: what --memory-limit leaves for experts",
    )
    parser.add_argument(
        "--memory-limit",
        metavar="SIZE",
        type=memory_size,
        default=None,
        help="memory k3stream may use (e.g. 1.5GiB, 1536M); sizes the expert RAM budget after non-expert "
        "weights, KV/state and working buffers (default: the memory cgroup's limit, else available RAM)",
    )
    parser.add_argument(
        "--gpu-mib",
        type=non_negative,
        default=None,
        help="GPU budget of the expert store (MiB); on CUDA, where experts compute, at least one top-k "
        "working set (default: up to 18 GiB of the free device memory, leaving 3 GiB)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="compute type; bfloat16 or float16 re-types the weights to dense matrices of that type and "
        "takes the reference products (default float32: the GGUF types through the kernels)",
    )
    parser.add_argument(
        "--threads",
        "-t",
        type=threads,
        default=None,
        help=f"torch CPU threads, at most {MAX_THREADS} (llama.cpp's cap); 0 or less: every core, as "
        "llama.cpp's -t (default: every core)",
    )
    add_arithmetic_arguments(parser)
    parser.add_argument(
        "--no-stream-experts",
        action="store_true",
        help="serve routed experts from the GGUF mmap even when a pack is there",
    )
    add_store_arguments(parser)


def add_arithmetic_arguments(parser: argparse.ArgumentParser) -> None:
    """`--match-ggml` (the default) or `--float-activations`: how CPU products compute."""
    arithmetic = parser.add_mutually_exclusive_group()
    arithmetic.add_argument(
        "--match-ggml",
        action="store_true",
        help="the default: CPU products compute as llama.cpp's CPU backend does (activations quantized to "
        "8 bits a row and integer dot products against quantized weights, F16/BF16 inputs rounded): "
        "faster, and closer to llama.cpp on a quantized file",
    )
    arithmetic.add_argument(
        "--float-activations",
        action="store_true",
        help="products with float32 activations: dequantized weight tiles times unrounded inputs; the "
        "path the reference dequantizer is tested against (CUDA products always take it)",
    )


SERVED_CONTEXT = "the model's context, at most 4096"  # `memlimit.served_tokens`' default


def add_context_argument(parser: argparse.ArgumentParser, default: str = SERVED_CONTEXT) -> None:
    """`--ctx`: the context a sequence may reach, which the memory plan sizes KV/state and a prefill's
    activations for (a command serving sequences adds its own); `default` says what it is left out."""
    parser.add_argument(
        "--ctx",
        "--ctx-size",
        "-c",
        type=int,
        default=None,
        help="tokens a sequence may reach, prompt plus output: the memory plan reserves KV/state and "
        f"prefill buffers for this many (default: {default}; 0: the model's)",
    )


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The expert store's flags (they apply when experts stream from a pack): None where not given, so
    a flag given where experts come from the GGUF is refused; `store_options` and `load_options` resolve
    the defaults the help names."""
    from k3stream.model.hints import HINT_CHOICES
    from k3stream.store.policies import POLICIES

    defaults = StoreOptions()
    parser.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=None,
        help=f"expert eviction policy (default {defaults.policy})",
    )
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="no background reads of the experts the next layers may need",
    )
    parser.add_argument(
        "--prefetch-hint",
        choices=list(HINT_CHOICES),
        default=None,
        help="which prediction is prefetched: a MoE layer's router on its input (pre-attention), on the "
        "previous layer's stream after attention (layer-ahead, a MoE block earlier), the experts the layer "
        "last picked for each token id (token, a MoE layer earlier), or auto: layer-ahead then pre-attention "
        "in steps of 8 or more rows (prefill); token, then the likeliest pre-attention picks it lacks where "
        "those have been right, otherwise (default)",
    )
    parser.add_argument(
        "--io-threads",
        type=count,
        default=None,
        help=f"pack read threads, 1 to {MAX_THREADS} (default {defaults.io_threads})",
    )
    parser.add_argument(
        "--direct-io",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read the pack with O_DIRECT, bypassing the page cache (default: when the pack, or an --ep "
        "rank's share of it, does not fit the RAM budget)",
    )


def check_input_file(path: str | Path, flag: str) -> None:
    """Raise (one line naming `flag`) unless `path` can be read as a file: a folder or a missing path
    is refused; a pipe (`<(...)`, /dev/stdin) is read as a file."""
    if Path(path).is_dir():
        raise IsADirectoryError(f"{flag}: is a folder: {path}")
    if not Path(path).exists():
        raise FileNotFoundError(f"{flag}: no such file: {path}")


STDIN = "-"  # a file flag's value that reads stdin, as llama.cpp's `-f -`


def input_file_bytes(path: str | Path, flag: str) -> bytes:
    """The bytes of the file `flag` names, stdin's for `-`; a one-line error naming `flag` and the file
    where it is missing or unreadable."""
    if str(path) == STDIN:
        return sys.stdin.buffer.read()
    check_input_file(path, flag)
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None


def prompt_file_text(path: Path, flag: str) -> str:
    """A prompt file's text as llama-cli reads `-f` and `-sysf`: its bytes as they are (a CRLF stays)
    less one line break at the end (an editor's), `-` stdin's; a one-line error naming `flag` and the
    file where it is missing, unreadable or not UTF-8."""
    data = input_file_bytes(path, flag)
    try:
        return data.decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None


class SystemPromptFile:
    """argparse type of `--system-prompt-file`: the file, read by `system_prompt` after parsing (it shares
    `--system`'s destination, so the last of the two given wins, as in llama-cli)."""

    def __init__(self, text: str):
        self.path = Path(text)


def add_system_arguments(parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
    """llama-cli's `-sys`/`--system-prompt` and `-sysf`/`--system-prompt-file` (the last given wins)."""
    parser.add_argument(
        "--system",
        "--system-prompt",
        "-sys",
        default=None,
        help=f"system message at the start of the conversation{help_suffix}",
    )
    parser.add_argument(
        "--system-prompt-file",
        "-sysf",
        dest="system",
        type=SystemPromptFile,
        metavar="FILE",
        help="a file holding the system message (UTF-8), as llama-cli's; the last of --system and this "
        f"given wins{help_suffix}",
    )


def system_prompt(args: argparse.Namespace) -> str | None:
    """The system message the flags give: `--system`, or the text of `--system-prompt-file`."""
    if isinstance(args.system, SystemPromptFile):
        return prompt_file_text(args.system.path, "--system-prompt-file")
    return args.system


def predict_limit(value: int) -> int | None:
    """A token limit as llama.cpp's `-n` takes it: 1 or more, or -1 (and -2): None, until the context is
    full; anything else is a ValueError."""
    if value in (-1, -2):
        return None
    if value < 1:
        raise ValueError(f"must be -1 (until the context is full) or at least 1, got {value}")
    return value


def predict_count(text: str) -> int | None:
    """argparse type of `--max-tokens` (`predict_limit`)."""
    try:
        return predict_limit(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    parser.add_argument(
        "--max-tokens",
        "--n-predict",
        "--predict",
        "-n",
        type=predict_count,
        default=max_tokens,
        help="tokens to generate; -1: until the context is full (default %(default)s)",
    )
    parser.add_argument(
        "--temperature", "--temp", type=float, default=0.8, help="0 is greedy (default %(default)s)"
    )
    parser.add_argument("--top-k", type=int, default=40, help="0 or less disables (default %(default)s)")
    parser.add_argument("--top-p", type=float, default=0.95, help="1 disables (default %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.05, help="0 disables (default %(default)s)")
    parser.add_argument("--repeat-penalty", type=float, default=1.0, help="1 disables (default %(default)s)")
    parser.add_argument(
        "--repeat-last-n",
        type=int,
        default=64,
        help="last tokens of prompt and output the repeat, frequency and presence penalties count, as "
        "llama-cli's; -1 all, 0 none (default %(default)s)",
    )
    for penalty, what in (("frequency", "once per occurrence"), ("presence", "once")):
        parser.add_argument(
            f"--{penalty}-penalty",
            type=float,
            default=0.0,
            help=f"subtracted from a counted token's logit {what}, as llama-cli's; 0 disables (default 0)",
        )
    parser.add_argument(
        "--seed", "-s", type=int, default=None, help="makes sampling reproducible (-1: a fresh seed)"
    )
    parser.add_argument(
        "--stop",
        "--reverse-prompt",
        "-r",
        action="append",
        default=[],
        help="stop string, as llama-cli's -r (repeatable)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never draw the end-of-sequence or end-of-turn tokens: generate --max-tokens, as llama-cli's",
    )


def add_escape_argument(parser: argparse.ArgumentParser, where: str) -> None:
    """llama-cli's `-e`/`--escape` (its default) and `--no-escape`, over the texts `where` names."""
    parser.add_argument(
        "--escape",
        "-e",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"replace escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xHH) in {where}, as llama-cli does "
        "(default; --no-escape takes them as written)",
    )


def top_k_flag(value: int) -> int:
    """`--top-k` as `SamplingParams` takes it: llama.cpp disables top-k at 0 or less, vLLM and sglang at
    -1, as a request's `top_k` does here; all of them keep every token (0)."""
    return max(value, 0)


def sampling_params(args: argparse.Namespace) -> Any:
    """`SamplingParams` from the sampling flags; llama-cli's `--seed -1` (its default, as
    4294967295 is) draws a fresh seed, as no seed does, and its `--top-k -1` keeps every token."""
    from k3stream.engine.sampling import SamplingParams
    from k3stream.server.schemas import fixed_seed

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=top_k_flag(args.top_k),
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repeat_penalty,
            repetition_last_n=args.repeat_last_n,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
            penalty_last_n=args.repeat_last_n,  # llama.cpp's penalties sampler counts one window
            seed=fixed_seed(args.seed),
            max_tokens=sys.maxsize if args.max_tokens is None else args.max_tokens,  # the context bounds it
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise in_sampling_flags(exc) from None


# `SamplingParams`' field names in its messages, and the flags that set them
SAMPLING_FLAGS = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repeat-penalty",
    "repeat_last_n": "--repeat-last-n",
    "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty",
    "seed": "--seed",
}


def in_sampling_flags(error: ValueError) -> UsageError:
    """A `SamplingParams` refusal in the words of the flag that gave the value ("top_p must be ..." ->
    "--top-p must be ...")."""
    field, _, rest = str(error).partition(" ")
    return UsageError(f"{SAMPLING_FLAGS[field]} {rest}" if field in SAMPLING_FLAGS else str(error))


def with_ends(params: Any, tokenizer: Any, stop_ids: tuple[int, ...]) -> Any:
    """`params` ending at `stop_ids` (a chat's end-of-turn tokens) and the file's end-of-generation tokens;
    with `ignore_eos` (`--ignore-eos`) those tokens are never drawn instead, as llama-cli bans them, so
    the answer runs to --max-tokens."""
    if not params.ignore_eos:
        return replace(params, stop_token_ids=stop_ids)
    ends = sorted({*stop_ids, *tokenizer.end_ids})
    return replace(params, logit_bias=(*params.logit_bias, *((token, -math.inf) for token in ends)))


# llama-cli's escapes (`-e`, its default): a backslash and one of these characters, or `x` and two hex
# digits (one byte); a backslash before anything else stays as written
ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"'": b"'", b'"': b'"', b"\\": b"\\"}
ESCAPE_RE = re.compile(rb"\\(x[0-9A-Fa-f]{2}|.)", re.DOTALL)


def user_text(text: str, flag: str, escape: bool) -> str:
    """`text` as given (a flag, stdin, a typed message): its escapes replaced where `escape` (llama-cli's
    default), and UTF-8 text either way, else a one-line error naming `flag` (bytes that are not UTF-8
    reach Python's arguments and stdin as lone surrogates, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{flag}: not UTF-8 text (character {exc.start})") from None
    return process_escapes(text, flag) if escape else text


def process_escapes(text: str, flag: str) -> str:
    """`text` with llama-cli's escape sequences replaced (`\\n` a line break, `\\x41` the byte 0x41);
    a one-line error naming `flag` where the bytes they make are not UTF-8 text."""

    def replaced(match: re.Match[bytes]) -> bytes:
        code = match.group(1)
        return bytes([int(code[1:], 16)]) if len(code) == 3 else ESCAPES.get(code, match.group(0))

    escaped = ESCAPE_RE.sub(replaced, text.encode("utf-8", errors="surrogateescape"))
    try:
        return escaped.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{flag}: its escapes make bytes that are not UTF-8 text (byte {exc.start}); --no-escape takes "
            "them as written"
        ) from None


def _expert_ram_mib(args: argparse.Namespace, checkpoint: K3Checkpoint, manifest: Path | None) -> float:
    """`--ram-mib`, else the budget `--memory-limit` leaves (printed on stderr when a limit was given or
    binds); refuses a limit too small."""
    from k3stream.memlimit import MIB, default_expert_ram_mib, pin_malloc_mmap_threshold

    cache_bytes = int(cache_ram_mib(args) * MIB)  # the prompt cache of serve, chat and generate
    shape = served_shape(args)
    if manifest is None and args.memory_limit is None:  # the GGUF's experts, kept in RAM when all fit
        if args.ram_mib is not None:
            return args.ram_mib
        return default_expert_ram_mib(checkpoint, shape, cache_bytes)
    pin_malloc_mmap_threshold()  # expert buffers churn: keep freed ones from bloating the heap
    if args.ram_mib is not None and args.memory_limit is None:
        return args.ram_mib
    if manifest is not None:  # the store's slot; a rank's share of the pack's experts under --ep
        from k3stream.pack.builder import plan_pack

        slot = plan_pack(checkpoint).layout.object_bytes
        shape = replace(shape, slot_bytes=slot, expert_ranks=getattr(args, "ep", 1))
    plan = _fitted_plan(args, checkpoint, shape, cache_bytes)
    if args.ram_mib is not None:
        print(f"{plan.summary()}; --ram-mib {args.ram_mib:g} MiB in use instead", file=sys.stderr)
        return args.ram_mib
    if args.memory_limit is not None or plan.expert_budget < plan.needs.expert_bytes:  # the limit binds
        print(plan.summary(), file=sys.stderr)
    return plan.expert_budget / MIB


def served_shape(args: argparse.Namespace) -> ServedShape:
    """What the command serves, for its memory plan: the context (`--ctx`), the sequences at once (a
    server's `--max-batch`) and, for a command that prefills in passes (`serve`), its largest pass
    (`args.prefill_pass`; `_fitted_plan` lowers it to what the limit holds)."""
    from k3stream.memlimit import ServedShape

    passes = _prefill_passes(args)
    if passes:
        args.prefill_pass = passes[0]
    return ServedShape(
        ctx=getattr(args, "ctx", None),
        sequences=getattr(args, "max_batch", 1),
        prefill_rows=passes[0].tokens if passes else None,
    )


def _prefill_passes(args: argparse.Namespace) -> list[PrefillPass]:
    """The prefill passes of a command that prefills in chunks (`serve`), largest first; none where a
    prompt is prefilled whole."""
    if not hasattr(args, "prefill_chunk"):
        return []
    from k3stream.server.app import prefill_passes

    return prefill_passes(args.prefill_chunk)


def _fitted_plan(
    args: argparse.Namespace, checkpoint: K3Checkpoint, shape: ServedShape, cache_bytes: int
) -> MemoryPlan:
    """The plan for `shape` under `--memory-limit`; for a command that prefills in passes, with the
    largest pass (`args.prefill_pass`) that leaves the experts at least half the budget the smallest
    pass leaves: a larger pass reads each expert once for more prompts (or more of one prompt's
    tokens), but decode lives on the expert cache. The one-line refusal only when one prompt's smallest
    chunk does not fit."""
    from k3stream.memlimit import MemoryLimitError, plan_for_model

    passes = _prefill_passes(args)
    if not passes:
        return plan_for_model(checkpoint, args.memory_limit, shape, cache_bytes)
    args.prefill_pass = passes[-1]
    smallest = plan_for_model(
        checkpoint, args.memory_limit, replace(shape, prefill_rows=passes[-1].tokens), cache_bytes
    )
    for prefill_pass in passes[:-1]:
        try:
            plan = plan_for_model(
                checkpoint, args.memory_limit, replace(shape, prefill_rows=prefill_pass.tokens), cache_bytes
            )
        except MemoryLimitError:
            continue
        if 2 * plan.expert_budget >= smallest.expert_budget:
            args.prefill_pass = prefill_pass
            return plan
    return smallest


def size_context(args: argparse.Namespace, config: Any, tokens: int) -> None:
    """Without `--ctx`, the context the memory plan holds is the `tokens` the run reaches (at most the
    model's): its KV/state, and its prompt prefilled in one forward."""
    if args.ctx is None:
        args.ctx = min(max(tokens, 2), config.context_length)


def reached_tokens(args: argparse.Namespace, prompt_tokens: int) -> int:
    """The tokens a run of `prompt_tokens` reaches: the prompt and `--max-tokens`; with `-n -1` (until
    the context is full) the default context, or the prompt and one token where that is longer."""
    from k3stream.memlimit import DEFAULT_CTX

    if args.max_tokens is None:
        return max(DEFAULT_CTX, prompt_tokens + 1)
    return prompt_tokens + args.max_tokens


def thread_count(threads: int | None) -> int | None:
    """`--threads` as torch takes it: None (torch's default, every core) for None, 0 or a negative
    count, as llama.cpp's `-t` takes them (its default is -1)."""
    return threads if threads is not None and threads > 0 else None


def runtime_from_args(
    args: argparse.Namespace, opened: tuple[K3Checkpoint, Path | None] | None = None
) -> Runtime:
    """The runtime the model flags ask for; `opened`: what `open_model(args.model, ...)` returned, when
    the command read the GGUF already (its tokenizer first)."""
    args.threads = thread_count(args.threads)
    checkpoint, manifest = opened or open_model(args.model, not args.no_stream_experts)  # before torch
    if getattr(args, "ctx", None) == 0:  # llama.cpp's `-c 0`: the model's own context
        args.ctx = int(checkpoint.config.context_length)
    if manifest is None:
        _refuse_store_flags(args)
    from k3stream.memlimit import memory_limited

    checkpoint.uncached_reads = memory_limited(args.memory_limit)  # page cache would count against it
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device {device}: must be cpu, cuda, cuda:N or auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available to torch on this machine")
    options = load_options(args, _expert_ram_mib(args, checkpoint, manifest), device)
    store = store_options(args)
    return load_resolved(checkpoint, manifest, options, gpu_mib=args.gpu_mib, store_options=store)


def _refuse_store_flags(args: argparse.Namespace) -> None:
    """The expert store's flags that would do nothing where experts come from the GGUF: refused (the
    store's flags default to None, or False for `--no-prefetch`: not given)."""
    direct_io = "--direct-io" if args.direct_io else "--no-direct-io"
    flags = (
        ("--gpu-mib", args.gpu_mib),
        (direct_io, args.direct_io),
        ("--policy", args.policy),
        ("--io-threads", args.io_threads),
        ("--prefetch-hint", args.prefetch_hint),
        ("--no-prefetch", args.no_prefetch or None),
    )
    given = [flag for flag, value in flags if value is not None]
    if not given:
        return
    refusal = f"{given[0]} applies to routed experts streamed from an expert pack; "
    if args.no_stream_experts:  # the flags contradict each other, whatever the model
        raise UsageError(refusal + "--no-stream-experts reads them from the GGUF")
    raise ValueError(refusal + f"{args.model} has no expert pack beside it (`k3stream pack` makes one)")


def load_options(args: argparse.Namespace, expert_ram_mib: float, device: str = "cpu") -> LoadOptions:
    """`LoadOptions` from the model and store flags (a command with only the store flags, as `demo`,
    gets float32 weights through the kernels and ggml's arithmetic); `--match-ggml` where it cannot
    apply is refused."""
    from k3stream.model.options import LoadOptions

    dtype = getattr(args, "dtype", "float32")
    options = LoadOptions(
        device=device,
        dtype=dtype,
        kernels="auto" if dtype == "float32" else "reference",  # re-typed weights are dense matrices
        match_ggml=not getattr(args, "float_activations", False),
        expert_ram_mib=expert_ram_mib,
        prefetch=not args.no_prefetch,
        prefetch_hint=args.prefetch_hint or LoadOptions.prefetch_hint,
    )
    if getattr(args, "match_ggml", False) and not options.ggml_arithmetic:
        where = f"products on {device}" if options.device != "cpu" else f"weights re-typed to {dtype}"
        raise UsageError(
            f"--match-ggml is llama.cpp's CPU arithmetic on the GGUF's types: {where} take float32 "
            "activations (use --device cpu and --dtype float32, or drop --match-ggml)"
        )
    return options


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """`--tp`/`--ep` (1 or the number of ranks `torchrun` started) and the collective timeout."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: 1 or all (under torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: 1 or all (under torchrun)")
    parser.add_argument(
        "--dist-timeout",
        type=finite,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a rank waits for the others in one step before failing (default %(default)s)",
    )


def store_options(args: argparse.Namespace) -> StoreOptions:
    """`StoreOptions` from the store flags (the defaults' where a flag is not given)."""
    given = {
        "policy": args.policy,
        "io_threads": args.io_threads,
        "direct_io": args.direct_io,
        "expert_ranks": getattr(args, "ep", None),
    }
    return StoreOptions(**{name: value for name, value in given.items() if value is not None})


def prompt_ids(tokenizer: Any, args: argparse.Namespace, text: str) -> list[int]:
    """The prompt's ids; special-token text in a raw prompt is that token, as llama-cli and the server's
    completions take it (a chat template written out by hand)."""
    if not args.chat:
        return tokenizer.encode(text, allow_special=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    rendered = ChatTemplate.for_tokenizer(tokenizer).render(messages, thinking=args.thinking)
    return tokenizer.encode(rendered, allow_special=True)


CACHE_RAM_MIB = 1024.0  # --cache-ram's default


def add_cache_arguments(parser: argparse.ArgumentParser, ram_mib: float | None = CACHE_RAM_MIB) -> None:
    """The prompt cache's flags (`serve`, `chat`): reused conversation states in RAM and on disk.
    `ram_mib` None: reuse off unless `--cache-dir` asks for it (`cache_ram_mib`)."""
    from k3stream.engine.prompt_cache import DEFAULT_EVERY

    default = f"{ram_mib:g}" if ram_mib is not None else f"0; {CACHE_RAM_MIB:g} with --cache-dir"
    parser.add_argument(
        "--cache-ram",
        type=finite,
        default=ram_mib,
        metavar="MIB",
        help=f"RAM for reused prompt states, part of --memory-limit's plan; 0 turns reuse off "
        f"(default {default})",
    )
    parser.add_argument(
        "--cache-every",
        type=int,
        default=DEFAULT_EVERY,
        metavar="N",
        help="tokens between state snapshots inside a long prefill (default %(default)s)",
    )
    parser.add_argument("--cache-dir", default=None, help="keep prompt states on disk here, across restarts")
    parser.add_argument(
        "--cache-disk",
        type=finite,
        default=None,
        metavar="GIB",
        help="disk budget over all of --cache-dir's snapshot folders; those of other builds, flags or "
        f"models that no running process holds go first (GiB, default {DEFAULT_DISK_GIB})",
    )


def cache_ram_mib(args: argparse.Namespace) -> float:
    """`--cache-ram` (0 for a command without it); left out where its default is None (`generate`):
    reuse off unless `--cache-dir` asks for it."""
    ram = getattr(args, "cache_ram", 0.0)
    if ram is None:
        return CACHE_RAM_MIB if args.cache_dir is not None else 0.0
    return ram


def check_cache_flags(args: argparse.Namespace) -> None:
    """A one-line UsageError for cache flags that could not take effect (checked before the model
    loads): a disk budget without a directory, a directory with a budget of 0 (nothing is written), a
    directory with reuse off (`--cache-ram 0`: the RAM tier is where a snapshot is made and restored,
    so there is no disk-only cache); a ValueError for a directory that cannot be made (it is made here)
    or written to."""
    for flag, value, least in (
        ("--cache-ram", cache_ram_mib(args), 0),
        ("--cache-disk", args.cache_disk or 0, 0),
        ("--cache-every", args.cache_every, 1),
    ):
        if value < least:
            raise UsageError(f"{flag} must be at least {least}, got {value:g}")
    if args.cache_disk is not None and args.cache_dir is None:
        raise UsageError("--cache-disk needs --cache-dir (the directory it budgets)")
    if args.cache_dir is not None and args.cache_disk == 0:
        raise UsageError(
            f"--cache-disk 0 leaves --cache-dir {args.cache_dir} unused (no snapshot fits a budget of 0); "
            "give it GiB above 0, or leave out --cache-dir"
        )
    if args.cache_dir is not None and cache_ram_mib(args) == 0:
        raise UsageError(
            "--cache-dir needs --cache-ram above 0 (--cache-ram 0 turns prompt reuse off, on disk too)"
        )
    if args.cache_dir is not None:
        try:
            Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.cache_dir):  # snapshots are written there
                pass
        except OSError as exc:
            raise ValueError(f"--cache-dir {args.cache_dir}: {exc.strerror or exc}") from None


# commands whose answers must not depend on their cache flags: row-exact products with --cache-ram 0 too
ANSWERING_COMMANDS = ("serve", "chat")


def cache_from_args(args: argparse.Namespace, model: Any, layout: str = "") -> PromptCache | None:
    """The prompt cache the flags ask for on `model` (None: --cache-ram 0; for `serve` and `chat` the
    products row-exact all the same: `keep_row_exact`). Under torchrun every rank
    has one (`layout`: this rank's place, keyed into the fingerprint: a rank's snapshots hold its shard);
    rank 0's model is a `DriverModel`, whose followers snapshot and restore with it."""
    from k3stream.engine.fingerprints import model_fingerprint
    from k3stream.engine.loading import resolve_model
    from k3stream.engine.parallel.runner import DriverModel
    from k3stream.engine.prompt_cache import PromptCache, keep_row_exact
    from k3stream.gguf.shards import discover_shards

    check_cache_flags(args)
    if cache_ram_mib(args) == 0:
        if getattr(args, "command", None) in ANSWERING_COMMANDS:
            keep_row_exact()  # reuse off answers as reuse on does
        return None
    driver = isinstance(model, DriverModel)
    gguf_path, _ = resolve_model(args.model, False)
    cache = PromptCache(
        model,
        model_fingerprint(discover_shards(gguf_path)) + (model.layout if driver else layout),
        ram_bytes=int(cache_ram_mib(args) * (1 << 20)),
        disk_dir=args.cache_dir,
        disk_bytes=int((args.cache_disk if args.cache_disk is not None else DEFAULT_DISK_GIB) * (1 << 30)),
        every=args.cache_every,
        peers=model if driver else None,
    )
    line = cache.disk_line()  # what the directory holds, and what the start trimmed
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return cache
