"""The command line's one-line endings (an error, Ctrl-C, kill) reach stderr in one write each, so the
lines of several ranks writing to one unbuffered stream (torchrun's `python -u`) never run together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from k3stream.cli import main


class Writes:
    """A stderr that records each write."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    ("argv", "status", "line"),
    [
        (
            ["make-tiny", "{tmp}/out", "--layers", "1"],
            2,
            "k3stream make-tiny: error: --layers: 1 must be >= 2",
        ),
        (["inspect", "{tmp}/missing.gguf"], 1, "k3stream inspect: error: "),
        (
            ["generate", "{tmp}/missing.gguf", "--prompt", "hi"],
            1,
            "k3stream generate: error: model not found",
        ),
        (["verify", "{tmp}/missing.manifest.json"], 1, "k3stream verify: error: "),
        (["pack", "{tmp}/missing.gguf", "--no-progress"], 1, "k3stream pack: error: "),
    ],
)
def test_an_error_is_one_write_of_one_line(tmp_path, monkeypatch, argv, status, line):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main([part.format(tmp=tmp_path) for part in argv]) == status
    assert len(stderr.writes) == 1, stderr.writes
    (written,) = stderr.writes
    assert written.startswith(line) and written.endswith("\n") and written.count("\n") == 1


@pytest.mark.parametrize("command", ["inspect", "pack", "generate"])
def test_a_pipe_or_device_given_as_the_model_is_named_as_such(tmp_path, monkeypatch, command):
    """`k3stream inspect <(curl ...)` or `/dev/null`: the path exists but is no file a memory map can
    read; the error says so rather than that there is no such file."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(fifo), *extra]) == 1
    said = f"{fifo}: not a regular file (a pipe, device or socket); give the GGUF file"
    assert stderr.writes == [f"k3stream {command}: error: {said}\n"]


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch_cpu" in maps.read()


def test_ctrl_c_while_the_command_line_loads_is_one_line(model_path):
    """A Ctrl-C while the parser imports the command's module (torch with it: seconds) ends as one at
    work does: one line and status 130, no traceback of the import."""
    argv = [sys.executable, "-m", "k3stream.cli", "generate", str(model_path), "--prompt", "hi"]
    with subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as child:
        deadline = time.monotonic() + 60
        while not _maps_torch(child.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        child.send_signal(signal.SIGINT)  # torch's libraries are mapped: its import is under way
        _, stderr = child.communicate(timeout=60)
    assert stderr == "k3stream: interrupted\n"
    # one landing in torch's C initialisation leaves CPython's unhandled-Ctrl-C mark set, and the
    # interpreter then ends itself by the signal: a shell shows 130 either way
    assert child.returncode in (130, -signal.SIGINT)


@pytest.mark.parametrize(("source", "status"), [("{model}", 0), ("{tmp}/missing.gguf", 1)])
def test_ctrl_c_once_the_result_is_decided_leaves_the_commands_status(model_path, tmp_path, source, status):
    """A Ctrl-C just after the command finished (or printed its error) ends the process with the
    command's status, not killed by the signal (-2) with a traceback: the signal is raised in the
    process the moment `main` has returned, as the program's entry point then exits with its status."""
    program = (
        "import signal, sys\n"
        "from k3stream.cli import main\n"
        "status = main()\n"
        "signal.raise_signal(signal.SIGINT)\n"
        "sys.exit(status)\n"
    )
    path = source.format(model=model_path, tmp=tmp_path)
    argv = [sys.executable, "-c", program, "inspect", path]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("argv", [["--version"], ["--help"], [], ["inspect", "--help"]])
def test_what_the_program_prints_itself_into_a_full_disk_says_the_output_failed(argv, unbuffered):
    """`k3stream --version > /dev/full` (and its help): one line naming the output, as a command's
    output that fails, and status 1; no traceback, and no status 0 for a help that went nowhere
    (argparse ignores the failed write; unbuffered, it fails at the write, buffered at the flush)."""
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    with open("/dev/full", "w") as full:
        argv = [sys.executable, "-m", "k3stream.cli", *argv]
        done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (
        1,
        "k3stream: error: writing the output: No space left on device\n",
    )


# every command, with flags it takes: a usage error (a flag's value, or flags together, refused whatever
# the files hold: status 2, after parsing where the command checks any there, else argparse's), and an
# input it refuses (a missing model, file or folder: status 1)
USAGE_ERRORS = {
    "demo": ["--temp", "-1"],
    "make-tiny": ["{tmp}/out", "--layers", "1"],
    "train-tiny": ["{tmp}/out", "--steps", "0"],
    "inspect": ["{model}", "--no-such-flag"],
    "dequantize": ["{model}", "{tmp}/f32.gguf", "--all-f32=yes"],
    "pack": ["{model}", "--sync-mib", "0"],
    "verify": ["{model}", "--profile", "none"],
    "generate": ["{model}", "-p", "hi", "--temp", "-1"],
    "chat": ["{model}", "--top-p", "2"],
    "perplexity": ["{model}", "-f", "{model}", "--batch", "0"],
    "bench": ["{model}", "--prompt-tokens", "0"],
    "serve": ["{model}", "--port", "99999"],
}
BAD_INPUTS = {
    "demo": ["--cache-dir", "{file}/cache", "-n", "1"],
    "make-tiny": ["{file}/out"],
    "train-tiny": ["{file}/out"],
    "inspect": ["{tmp}/missing.gguf"],
    "dequantize": ["{tmp}/missing.gguf", "{tmp}/f32.gguf"],
    "pack": ["{tmp}/missing.gguf"],
    "verify": ["{tmp}/missing.gguf"],
    "generate": ["{tmp}/missing.gguf", "-p", "hi"],
    "chat": ["{tmp}/missing.gguf"],
    "perplexity": ["{model}", "-f", "{tmp}/missing.txt"],
    "bench": ["{tmp}/missing.gguf"],
    "serve": ["{tmp}/missing.gguf", "--port", "0"],
}
# flags each command runs with, for a Ctrl-C as it starts
RUNS = {**BAD_INPUTS, "inspect": ["{model}"], "make-tiny": ["{tmp}/out"], "train-tiny": ["{tmp}/out"]}


def _status(argv: list[str], tmp_path, model_path) -> int:
    """`main`'s status, argparse's too (it exits)."""
    (tmp_path / "file").write_text("a file, not a folder")
    argv = [part.format(tmp=tmp_path, model=model_path, file=tmp_path / "file") for part in argv]
    try:
        return main(argv)
    except SystemExit as ended:
        return ended.code


def test_every_command_is_covered():
    from k3stream.cli import COMMANDS

    assert set(USAGE_ERRORS) == set(BAD_INPUTS) == set(RUNS) == set(COMMANDS)


@pytest.mark.parametrize("command", USAGE_ERRORS)
def test_a_usage_error_is_status_2_in_every_command(command, tmp_path, model_path, capsys):
    assert _status([command, *USAGE_ERRORS[command]], tmp_path, model_path) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"k3stream {command}: error: ")
    assert not (tmp_path / "out").exists() and not (tmp_path / "f32.gguf").exists()


@pytest.mark.parametrize("command", BAD_INPUTS)
def test_an_input_refused_is_status_1_in_every_command(command, tmp_path, model_path, capsys):
    assert _status([command, *BAD_INPUTS[command]], tmp_path, model_path) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"k3stream {command}: error: ")


@pytest.mark.parametrize("command", RUNS)
def test_ctrl_c_is_status_130_in_every_command(command, tmp_path, model_path, capsys):
    """A real SIGINT as the command's `run` starts: one line, status 130."""
    import importlib

    from k3stream.cli import COMMANDS

    started = importlib.import_module(COMMANDS[command][0]).run.__code__

    def ctrl_c_as_it_starts(frame, event, _arg) -> None:
        if event == "call" and frame.f_code is started:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C

    sys.setprofile(ctrl_c_as_it_starts)
    try:
        status = _status([command, *RUNS[command]], tmp_path, model_path)
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert status == 130 and capsys.readouterr().err.splitlines()[-1] == f"k3stream {command}: interrupted"
