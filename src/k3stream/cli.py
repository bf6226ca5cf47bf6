"""The `k3stream` command line.

Each subcommand is a module of `k3stream.commands` exposing `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their command runs
(or its help is shown), so `k3stream --help` stays fast and never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("k3stream.commands.demo", "make, pack and run a tiny Kimi-K3 with streamed experts"),
    "make-tiny": ("k3stream.commands.make_tiny", "write a random tiny Kimi-K3 GGUF"),
    "train-tiny": ("k3stream.commands.train", "train a small Kimi-K3 on the Python standard library"),
    "inspect": ("k3stream.commands.inspect", "describe a Kimi-K3 GGUF: config, layers, bytes, recipe"),
    "dequantize": ("k3stream.commands.dequantize", "rewrite a GGUF with every tensor dequantized to F32"),
    "pack": ("k3stream.commands.pack", "build the expert pack and its manifest from a GGUF"),
    "verify": ("k3stream.commands.verify", "check an expert pack against its manifest"),
    "generate": ("k3stream.commands.generate", "generate text from a prompt"),
    "chat": ("k3stream.commands.chat", "interactive chat"),
    "perplexity": ("k3stream.commands.perplexity", "perplexity and KL divergence, as llama-perplexity"),
    "bench": ("k3stream.commands.bench", "measure prefill/decode speed and the expert store"),
    "serve": ("k3stream.commands.serve", "OpenAI-compatible HTTP server"),
}


# the positional argument naming the model, in each command that reads one
SOURCE_ARGUMENTS: dict[str, str] = {
    "inspect": "path",
    "dequantize": "input",
    "pack": "gguf",
    "verify": "source",
    "generate": "model",
    "chat": "model",
    "perplexity": "model",
    "bench": "model",
    "serve": "model",
}
DEMO_SOURCE = "demo"


def _command_module(name: str):
    return importlib.import_module(COMMANDS[name][0])


class _Parser(argparse.ArgumentParser):
    """`k3stream`'s parser: a flag the command does not take is refused by that command's parser, with
    its usage and `k3stream COMMAND: error:`, as its other errors are."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # by name, filled by build_parser

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            refusing = self.commands.get(getattr(parsed, "command", None) or "", self)
            refusing.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="k3stream", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version",
        action="store_true",
        help="print k3stream's version and the CPU kernels this install runs",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (_module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _command_module(name).add_arguments(command_parser)
    parser.commands = sub.choices
    return parser


def resolve_demo_source(args: argparse.Namespace) -> None:
    """The model name `demo` (when no file of that name is there) stands for the shipped demo model,
    copied and packed in the cache on first use, as `k3stream demo` does."""
    name = SOURCE_ARGUMENTS.get(args.command)
    value = getattr(args, name, None) if name else None
    if value is not None and str(value) == DEMO_SOURCE and not Path(value).exists():
        setattr(args, name, type(value)(_command_module("demo").demo_gguf()))


OPENMP_SPIN_ROUNDS = 10_000  # libgomp's rounds before an idle worker sleeps


def calm_openmp() -> None:
    """Idle OpenMP threads spin a short while (10,000 rounds, a fraction of a millisecond), then sleep,
    unless the user chose (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`). A pass runs tens of parallel regions
    a layer: workers woken from sleep for each cost 40-90 us a region, and a 2-thread decode 20-25%;
    spinning without end (libgomp's default spin is long) starves the pack reader threads and, on a
    loaded machine, the other threads. torch and the C kernels share one OpenMP runtime, which reads
    these when it loads, so this runs before anything imports torch."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_ROUNDS))


class Terminated(BaseException):
    """SIGTERM, raised where the main thread runs: the `except BaseException` cleanups (temporary files)
    run as they do on Ctrl-C, and no `except Exception` takes it for a command's error."""


class UsageError(ValueError):
    """A flag's value, or flags together, that the command refuses whatever its files hold: status 2, as
    argparse's refusals; every other error is status 1."""


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated


def version_line() -> str:
    """k3stream's version and the CPU kernels this install runs (where there are none, the warning the
    kernels give on stderr says why)."""
    from k3stream import __version__
    from k3stream.quant.kernels import cpu

    return f"k3stream {__version__}, CPU kernels: {cpu.kernels_report()}"


def main(argv: list[str] | None = None) -> int:
    """The command's status. Run as the program (`argv` None), a Ctrl-C once the result is decided is
    ignored: the process ends with that status rather than killed by the signal."""
    calm_openmp()
    ending = argv is None
    argv = sys.argv[1:] if argv is None else argv
    output, sys.stdout = sys.stdout, _Output(sys.stdout)
    try:
        return _command_line(argv, ending)
    finally:
        sys.stdout = output


def _command_line(argv: list[str], ending: bool) -> int:
    try:
        parser = build_parser(argv)  # imports the command's module, torch with most: seconds
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return _interrupted("k3stream", ending)
    except SystemExit as ended:  # --help, or a flag refused: argparse's status once its text is out
        status = ended.code
        raise SystemExit(_run("k3stream", lambda: status, ending)) from None
    if args.version:
        return _run("k3stream", lambda: print(version_line()), ending)
    if args.command is None:
        parser.print_help()
        return _run("k3stream", lambda: 2, ending)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(f"k3stream {args.command}", lambda: _command(args), ending)
    finally:
        if signal.getsignal(signal.SIGTERM) is _terminate:  # left ignored after a SIGTERM, as Ctrl-C's
            signal.signal(signal.SIGTERM, previous)


def _command(args: argparse.Namespace) -> int | None:
    if SOURCE_ARGUMENTS.get(args.command) == "model" and args.model is None:  # nor `-m MODEL`
        raise UsageError(f"no model: give it as `k3stream {args.command} MODEL` or `-m MODEL`")
    resolve_demo_source(args)
    return _command_module(args.command).run(args)


class OutputError(OSError):
    """A write to stdout that failed (a full disk, a device error): its one-line error says it was the
    output, which an error naming no file leaves the user to guess."""


class _Output:
    """sys.stdout while `main` runs: a failed write or flush raises `OutputError`, and a failed write
    that its caller swallowed (argparse's help does) raises again at the next flush."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.failed: OutputError | None = None

    def write(self, text: str) -> int:
        with self._naming_output():
            return self.stream.write(text)

    def flush(self) -> None:
        if self.failed is not None:
            raise self.failed
        with self._naming_output():
            self.stream.flush()

    @contextlib.contextmanager
    def _naming_output(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError:  # the reader left: `_run` ends quietly, as `yes | head`
            raise
        except OSError as exc:
            self.failed = OutputError(f"writing the output: {exc.strerror or exc}")
            raise self.failed from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def say(line: str) -> None:
    """`line` on stderr in one write: under torchrun (unbuffered, `python -u`) every rank reports its
    error to the same stream, and print's separate newline let the ranks' lines run into each other."""
    sys.stderr.write(line + "\n")


def _settle(ending: bool) -> None:
    """The result is decided: a Ctrl-C from here on, while the process ends, is ignored (it would raise
    in the interpreter's shutdown and kill the process by the signal, status -2), where `ending`."""
    if ending:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except KeyboardInterrupt:  # one still pending, raised before the handler changes: the result stands
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupted(program: str, ending: bool) -> int:
    """Ctrl-C: one line and the shell's status, not a traceback."""
    _settle(ending)
    say(f"{program}: interrupted")
    return 130


def _run(program: str, work: Callable[[], int | None], ending: bool) -> int:
    """`work`'s status once its output is flushed, its error or interruption as one line after `program`
    and the shell's status."""
    try:
        status = int(work() or 0)
        sys.stdout.flush()  # what print left buffered fails here, as the command's error, not at exit
        _settle(ending)
        return status
    except BrokenPipeError:  # `k3stream generate ... | head`: the reader has what it wanted
        _settle(ending)
        _drop_output()
        return 128 + signal.SIGPIPE  # the shell's status of a process SIGPIPE ended, as `yes | head`
    except (ValueError, OSError, RuntimeError) as exc:  # OSError: missing files, permissions, a full disk
        from k3stream.gguf.header import printable  # a name read from a file may hold a newline

        _settle(ending)
        if isinstance(exc, OutputError):
            _drop_output()
        say(f"{program}: error: {printable(str(exc))}")
        return 2 if isinstance(exc, UsageError) else 1
    except KeyboardInterrupt:
        return _interrupted(program, ending)
    except Terminated:  # kill's SIGTERM: 128 + 15, as a shell reports a process the signal ended
        _settle(ending)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say(f"{program}: terminated")
        return 143


def _drop_output() -> None:
    """Nothing more reaches stdout, not even the interpreter's flush of it on the way out."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":  # `python -m k3stream.cli`: the module the commands import runs, so that
    # the classes they raise (UsageError, Terminated) are the ones `_run` catches
    from k3stream.cli import main as cli_main

    raise SystemExit(cli_main())
