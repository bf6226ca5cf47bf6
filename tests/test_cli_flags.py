"""llama.cpp's short flags (llama-cli, llama-server, llama-perplexity, llama-bench) name the same
settings in the commands that have them, so a script written for llama.cpp runs with its flags as they
are."""

from __future__ import annotations

import pytest

from k3stream.cli import COMMANDS, build_parser

# (command, llama.cpp's spelling, k3stream's long spelling): each pair parses to the same settings
SPELLINGS = [
    ("generate", ["-p", "hi", "-n", "7", "-t", "2", "-c", "300", "-s", "5", "--temp", "0.3"],
     ["--prompt", "hi", "--max-tokens", "7", "--threads", "2", "--ctx", "300", "--seed", "5",
      "--temperature", "0.3"]),
    ("generate", ["--prompt", "hi", "--n-predict", "9", "--ctx-size", "64", "-sys", "Be brief."],
     ["--prompt", "hi", "--max-tokens", "9", "--ctx", "64", "--system", "Be brief."]),
    ("generate", ["-f", "prompt.txt", "--system-prompt", "Be brief.", "--repeat-last-n", "-1"],
     ["--file", "prompt.txt", "--system", "Be brief.", "--repeat-last-n", "-1"]),
    ("chat", ["-n", "3", "-t", "1", "-c", "128", "-s", "1", "--temp", "0", "-sys", "Hi"],
     ["--max-tokens", "3", "--threads", "1", "--ctx", "128", "--seed", "1", "--temperature", "0",
      "--system", "Hi"]),
    ("serve", ["-c", "2048", "-np", "4", "-t", "2"], ["--ctx", "2048", "--max-batch", "4", "--threads", "2"]),
    ("serve", ["--parallel", "3", "--ctx-size", "512"], ["--max-batch", "3", "--ctx", "512"]),
    ("serve", ["--alias", "k3", "--sse-ping-interval", "30", "--predict", "9"],
     ["--served-model-name", "k3", "--sse-keepalive", "30", "--n-predict", "9"]),
    ("perplexity", ["-f", "text.txt", "-c", "256", "-t", "2"],
     ["--file", "text.txt", "--ctx", "256", "--threads", "2"]),
    ("bench", ["-c", "100", "-t", "1"], ["--ctx", "100", "--threads", "1"]),
    ("bench", ["-p", "16", "-n", "8"], ["--prompt-tokens", "16", "--decode-tokens", "8"]),
    ("bench", ["--n-prompt", "16", "--n-gen", "0"], ["--prompt-tokens", "16", "--decode-tokens", "0"]),
    ("demo", ["-p", "hello", "-n", "4", "-t", "2", "-s", "3"],
     ["--prompt", "hello", "--max-tokens", "4", "--threads", "2", "--seed", "3"]),
]  # fmt: skip


def _parsed(command: str, flags: list[str]) -> dict:
    argv = [command, "model.gguf", *flags] if command != "demo" else [command, *flags]
    return vars(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("command, short, long", SPELLINGS)
def test_llama_cpp_flags_parse_as_the_long_ones(command, short, long):
    short_settings, long_settings = _parsed(command, short), _parsed(command, long)
    assert short_settings == long_settings
    assert short_settings != _parsed(command, long[:2])  # the flags set something: not all defaults


def test_n_minus_one_is_until_the_context_is_full():
    """llama-cli's `-n -1` (and `-2`): no count, the context bounds the answer; without `-c` the run
    reaches the default context (or the prompt and a token where longer)."""
    from k3stream.commands.flags import reached_tokens, sampling_params
    from k3stream.memlimit import DEFAULT_CTX

    for flag in ("-1", "-2"):
        args = build_parser(["chat", "m.gguf", "-n", flag]).parse_args(["chat", "m.gguf", "-n", flag])
        assert args.max_tokens is None and sampling_params(args).max_tokens > 1 << 40
        assert (
            reached_tokens(args, 10) == DEFAULT_CTX and reached_tokens(args, DEFAULT_CTX) == DEFAULT_CTX + 1
        )
    args = build_parser(["chat", "m.gguf", "-n", "7"]).parse_args(["chat", "m.gguf", "-n", "7"])
    assert reached_tokens(args, 10) == 17


@pytest.mark.parametrize("top_k", ["-1", "0", "-3"])
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_top_k_below_one_keeps_every_token_as_llama_cpp_and_vllm(command, top_k):
    """llama.cpp (llama-cli and llama-server) disables top-k at 0 or less, vLLM and sglang at -1, and a
    request's `top_k: -1` does so here: `--top-k -1` means the same, not an error; for `serve` it is
    the default of a request naming no top_k."""
    from k3stream.commands.flags import sampling_params
    from k3stream.commands.serve import request_defaults

    argv = [command, "m.gguf", "-p", "x"][: 4 if command == "generate" else 2] + ["--top-k", top_k]
    args = build_parser(argv).parse_args(argv)
    params = request_defaults(args)[0] if command == "serve" else sampling_params(args)
    assert params.top_k == 0


def test_seed_minus_one_draws_a_fresh_seed_as_llama_cli_does():
    """llama-cli's `--seed -1` (its default, LLAMA_DEFAULT_SEED, also as 4294967295) is a fresh seed
    each run, not the fixed seed -1: two runs sample differently; any other seed is kept."""
    from k3stream.commands.flags import sampling_params
    from k3stream.engine.sampling import Sampler

    for flag in ("-1", "4294967295"):
        args = build_parser(["chat", "m.gguf", "-s", flag]).parse_args(["chat", "m.gguf", "-s", flag])
        assert sampling_params(args).seed is None
        assert Sampler(sampling_params(args)).seed != Sampler(sampling_params(args)).seed
    args = build_parser(["chat", "m.gguf", "-s", "7"]).parse_args(["chat", "m.gguf", "-s", "7"])
    assert sampling_params(args).seed == Sampler(sampling_params(args)).seed == 7


# sizes and times: inf or nan would reach an int() (a traceback) or a budget no check can compare
NUMBER_FLAGS = [
    ("generate", "--ram-mib"),
    ("generate", "--gpu-mib"),
    ("generate", "--dist-timeout"),
    ("chat", "--cache-ram"),
    ("chat", "--cache-disk"),
    ("pack", "--safety-margin-gib"),
    ("pack", "--sync-mib"),
    ("bench", "--seq-read-mib"),
    ("demo", "--ram-mib"),
    ("serve", "--max-body-mib"),
]


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("command, flag", NUMBER_FLAGS)
def test_sizes_and_times_must_be_finite_numbers(command, flag, value, capsys):
    from k3stream.cli import main

    with pytest.raises(SystemExit) as exit_status:
        main([command, *(["model.gguf"] if command != "demo" else []), f"{flag}={value}"])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"k3stream {command}: error: argument {flag}: {value!r} is not a finite number"


@pytest.mark.parametrize(
    ("command", "flag", "value", "why"),
    [
        ("generate", "--ram-mib", "-1", "is below 0"),
        ("serve", "--gpu-mib", "-2", "is below 0"),
        ("demo", "--ram-mib", "-0.5", "is below 0"),
        ("chat", "--io-threads", "0", "is not a count of 1 or more"),
        ("perplexity", "--io-threads", "-3", "is not a count of 1 or more"),
        ("generate", "--threads", "99999", "is above 512 threads (llama.cpp's cap)"),
        ("serve", "-t", "513", "is above 512 threads (llama.cpp's cap)"),
        ("demo", "--threads", "100000", "is above 512 threads (llama.cpp's cap)"),
        ("chat", "--io-threads", "100000", "is above 512 threads (llama.cpp's cap)"),
        ("train-tiny", "--threads", "99999", "is above 512 threads (llama.cpp's cap)"),
    ],
)
def test_budgets_and_counts_below_their_range_name_the_flag(command, flag, value, why, capsys):
    """A negative budget, no read thread or more threads than llama.cpp takes is the flag's error, before
    the model loads (not an error naming the Python API's field, or the thread library's failure)."""
    from k3stream.cli import main

    with pytest.raises(SystemExit) as exit_status:
        main([command, *(["model.gguf"] if command not in ("demo", "train-tiny") else []), f"{flag}={value}"])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    named, said = error.removeprefix(f"k3stream {command}: error: argument ").split(": ", 1)
    assert flag in named.split("/") and said == f"{value!r} {why}"


def test_a_device_torch_does_not_name_is_the_flags_error(model_path, capsys):
    from k3stream.cli import main

    assert main(["generate", str(model_path), "--prompt", "hi", "--device", "tpu"]) == 2  # a usage error
    error = capsys.readouterr().err
    assert error == "k3stream generate: error: --device tpu: must be cpu, cuda, cuda:N or auto\n"


@pytest.mark.parametrize("command", ["serve", "chat", "generate"])
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--cache-disk", "2"], "--cache-disk needs --cache-dir"),
        (["--cache-dir", "DIR", "--cache-ram", "0"], "--cache-dir needs --cache-ram above 0"),
        (["--cache-dir", "DIR", "--cache-disk", "0"], "--cache-disk 0 leaves --cache-dir"),  # wrote nothing
        (["--cache-ram", "-5"], "--cache-ram must be at least 0, got -5"),
        (["--cache-dir", "DIR", "--cache-disk", "-1"], "--cache-disk must be at least 0, got -1"),
        (["--cache-every", "0"], "--cache-every must be at least 1, got 0"),
    ],
)
def test_cache_flags_that_would_do_nothing_are_a_one_line_error(
    model_path, tmp_path, capsys, command, flags, named
):
    """A disk budget without a directory, or a directory with reuse off, is refused at the start (before
    the model loads), naming the flags, rather than served as if the cache were on."""
    from k3stream.cli import main

    flags = [str(tmp_path) if flag == "DIR" else flag for flag in flags]
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert main([command, str(model_path), *prompt, *flags]) == 2  # a usage error
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"k3stream {command}: error: {named}") and "\n" not in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["serve", "chat", "generate"])
def test_a_cache_dir_that_cannot_be_a_folder_is_the_flags_error(model_path, tmp_path, capsys, command):
    """--cache-dir naming a file (or a path under one) is refused before the model loads, naming the
    flag (it failed after the load, naming a snapshot folder inside it: `Not a directory: FILE/a858...`)."""
    from k3stream.cli import main

    taken = tmp_path / "file"
    taken.write_text("x")
    prompt = ["--prompt", "hi"] if command == "generate" else []
    for folder in (taken, taken / "below"):
        assert main([command, str(model_path), *prompt, "--cache-ram", "8", "--cache-dir", str(folder)]) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"k3stream {command}: error: --cache-dir {folder}: ")
        assert error.count("\n") == 1
    assert list(tmp_path.iterdir()) == [taken]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_read_only_cache_dir_is_the_flags_error_before_the_model_loads(model_path, tmp_path, command):
    """--cache-dir on a read-only file system (a tmpfs mounted read-only in a mount namespace of the
    command's own) is refused at the start in one line naming the flag; it failed after the model
    loaded (minutes for a real one), naming a snapshot folder inside it."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "read-only"
    folder.mkdir()
    prompt = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    run = [sys.executable, "-m", "k3stream", command, str(model_path), *prompt, "--cache-ram", "8"]
    run += ["--cache-dir", str(folder)]
    mounted = f'mount -t tmpfs -o ro tmpfs {folder} && exec "$@"'
    command_line = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mounted, "sh", *run]
    try:
        done = subprocess.run(command_line, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    except FileNotFoundError:
        pytest.skip("no `unshare` (util-linux) to mount a read-only file system")
    if "unshare:" in done.stderr or "mount:" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "k3stream serve: loading" not in line]
    assert lines == [f"k3stream {command}: error: --cache-dir {folder}: Read-only file system"], lines


def test_serve_takes_llama_servers_model_flag_and_request_defaults():
    """`llama-server -m MODEL -a NAME --temp T -n N -s S` runs as `k3stream serve` with those flags;
    `--jinja` and `--metrics` are taken (always so here)."""
    flags = ["-a", "kimi", "--temp", "0.2", "-n", "5", "-s", "3", "--jinja", "--metrics"]
    by_flag = _parsed_argv(["serve", "-m", "model.gguf", *flags])
    assert by_flag == _parsed_argv(["serve", "model.gguf", *flags])
    assert (by_flag["model"], by_flag["served_model_name"], by_flag["n_predict"]) == ("model.gguf", "kimi", 5)
    assert _parsed_argv(["serve", "--port", "1"])["model"] is None


@pytest.mark.parametrize(
    "flags, words",
    [(["-n", "0"], "--n-predict must be -1"), (["--temp", "-1"], "--temperature must be >= 0, got -1.0"),
     (["--top-p", "2"], "--top-p must be in [0, 1], got 2.0")],
)  # fmt: skip
def test_serve_request_defaults_refuse_bad_values_in_one_line(flags, words):
    from k3stream.commands.serve import request_defaults

    with pytest.raises(ValueError) as caught:
        request_defaults(build_parser(["serve"]).parse_args(["serve", "m.gguf", *flags]))
    assert str(caught.value).startswith(words)


@pytest.mark.parametrize(
    "flags, words",
    [(["--temp", "-1"], "--temperature must be >= 0, got -1.0"),
     (["--min-p", "-0.1"], "--min-p must be in [0, 1], got -0.1"),
     (["--repeat-penalty", "0"], "--repeat-penalty must be > 0, got 0.0"),
     (["--repeat-last-n", "-2"], "--repeat-last-n must be >= -1, got -2"),
     (["--seed", str(1 << 64)], f"--seed must be in [-2^63, 2^64), got {1 << 64}"),
     (["-s", str(-(1 << 63) - 1)], f"--seed must be in [-2^63, 2^64), got {-(1 << 63) - 1}")],
)  # fmt: skip
def test_a_bad_sampling_flag_is_refused_naming_the_flag(flags, words):
    """`generate`, `chat` and `demo` refuse a sampling value in the words of the flag the user typed."""
    from k3stream.commands.flags import sampling_params

    with pytest.raises(ValueError) as caught:
        sampling_params(build_parser(["generate"]).parse_args(["generate", "m.gguf", "-p", "x", *flags]))
    assert str(caught.value) == words


def test_a_seed_beyond_what_torch_takes_is_refused_naming_the_flag(tmp_path):
    """A seed past torch's generator's 64 bits is the flag's error in `serve` and `train-tiny` too, before
    the model loads or the corpus is read (not torch's "Overflow when unpacking long long")."""
    import torch

    from k3stream.commands.flags import sampling_params
    from k3stream.commands.serve import request_defaults
    from k3stream.commands.train import check_training_flags
    from k3stream.engine.sampling import Sampler

    with pytest.raises(ValueError, match=r"^--seed must be in \[-2\^63, 2\^64\), got 18446744073709551616$"):
        request_defaults(build_parser(["serve"]).parse_args(["serve", "m.gguf", "-s", str(1 << 64)]))
    argv = ["train-tiny", str(tmp_path), "--seed", str(1 << 64)]
    with pytest.raises(ValueError, match=r"^--seed must be in \[0, 2\^64\), got 18446744073709551616$"):
        check_training_flags(build_parser(argv).parse_args(argv))
    for seed in ((1 << 64) - 1, -(1 << 63)):  # the ends of the range sample
        argv = ["generate", "m.gguf", "-p", "x", "-s", str(seed)]
        assert 0 <= Sampler(sampling_params(build_parser(argv).parse_args(argv))).sample(torch.zeros(8)) < 8


@pytest.mark.parametrize("limit", ["-2", "-1", "1", "7"])
@pytest.mark.parametrize("seed", ["-1", "4294967295", "0", "5"])
def test_serve_and_generate_read_n_and_the_seed_alike(limit, seed):
    """llama.cpp's `-n` (-1 and -2: until the context is full) and `-s` (-1 and 4294967295: a fresh
    seed) mean the same to `serve` (a request's defaults) as to `generate`."""
    from k3stream.commands.flags import sampling_params
    from k3stream.commands.serve import request_defaults

    served = build_parser(["serve"]).parse_args(["serve", "m.gguf", "-n", limit, "-s", seed])
    generated = build_parser(["generate"]).parse_args(
        ["generate", "m.gguf", "-p", "x", "-n", limit, "-s", seed]
    )
    defaults, n_predict = request_defaults(served)
    assert (n_predict, defaults.seed) == (generated.max_tokens, sampling_params(generated).seed)


def test_serve_takes_whole_flag_names_only(capsys):
    """llama-server's `--timeout 600` (its read/write timeout) is refused, not read as an abbreviation of
    --timeout-keep-alive."""
    assert _parsed_argv(["serve", "m.gguf", "--timeout-keep-alive", "30"])["timeout_keep_alive"] == 30
    for flags in (["--timeout", "600"], ["--timeout-keep", "600"]):
        with pytest.raises(SystemExit):
            _parsed_argv(["serve", "m.gguf", *flags])
        assert f"unrecognized arguments: {' '.join(flags)}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "chat", "pack"])
def test_a_flag_the_command_does_not_take_is_refused_by_that_command(command, capsys):
    """`k3stream chat m.gguf --quiet-please` names the command and shows its usage, as its other flag
    errors do, not the top-level `k3stream: error:` with `COMMAND ...`."""
    with pytest.raises(SystemExit) as ended:
        build_parser([command]).parse_args([command, "m.gguf", "--quiet-please"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and f"usage: k3stream {command} " in err
    assert err.splitlines()[-1] == f"k3stream {command}: error: unrecognized arguments: --quiet-please"


# every command that runs a model, with the flags it needs besides
MODEL_COMMANDS = {
    "generate": ["-p", "x"],
    "chat": [],
    "perplexity": ["-f", "t.txt"],
    "bench": [],
    "serve": [],
}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_llama_cpps_model_flag_and_says_how_to_name_one(command, capsys):
    """`llama-cli -m MODEL`, `llama-perplexity -m`, `llama-bench -m`, `llama-server -m`: the same as the
    positional; neither given is a usage error saying both ways."""
    from k3stream.cli import main

    needed = MODEL_COMMANDS[command]
    assert _parsed_argv([command, "-m", "model.gguf", *needed]) == _parsed_argv(
        [command, "model.gguf", *needed]
    )
    assert main([command, *needed]) == 2
    said = capsys.readouterr().err.splitlines()[-1]
    assert said == f"k3stream {command}: error: no model: give it as `k3stream {command} MODEL` or `-m MODEL`"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_llama_clis_reverse_prompt_and_predict_are_stop_and_max_tokens(command):
    prompt = ["-p", "x"] if command == "generate" else []
    llama = _parsed_argv(
        [command, "m.gguf", *prompt, "-r", "User:", "--reverse-prompt", "###", "--predict", "9"]
    )
    ours = _parsed_argv([command, "m.gguf", *prompt, "--stop", "User:", "--stop", "###", "--max-tokens", "9"])
    assert llama == ours and ours["stop"] == ["User:", "###"]


def _parsed_argv(argv: list[str]) -> dict:
    return vars(build_parser(argv).parse_args(argv))


@pytest.mark.parametrize("command, flags", [("serve", []), ("generate", ["-p", "hi"])])
def test_ctx_zero_is_the_models_context_as_in_llama_cpp(command, flags, model_path, one_torch_thread):
    """llama.cpp's `-c 0`: the context the model file gives."""
    from k3stream.commands.flags import runtime_from_args
    from k3stream.gguf.reader import K3Checkpoint

    argv = [command, str(model_path), "-c", "0", *flags]
    args = build_parser(argv).parse_args(argv)
    runtime_from_args(args).close()
    assert args.ctx == K3Checkpoint.open(model_path).config.context_length > 0


@pytest.mark.parametrize(
    "command, flags, stated",
    [("generate", ["-p", "x", "-n", "7"], "the prompt plus --max-tokens"),
     ("bench", ["--prompt-tokens", "7"], "--prompt-tokens plus --decode-tokens")],
)  # fmt: skip
def test_the_help_states_the_context_a_run_without_ctx_gets(command, flags, stated, model_path):
    """`--ctx`'s help names the default these commands take (`size_context`: what the run reaches),
    not the served commands' model context of at most 4096."""
    from k3stream.commands.flags import size_context
    from k3stream.gguf.reader import K3Checkpoint

    argv = [command, str(model_path), *flags]
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    size_context(args, K3Checkpoint.open(model_path).config, 3 + 7)
    assert args.ctx == 10
    ctx_help = next(a.help for a in parser.commands[command]._actions if "--ctx" in a.option_strings)
    assert f"(default: {stated};" in ctx_help


@pytest.mark.parametrize(
    "value, words",
    [("{bad", "not JSON"), ("[1]", "must be a JSON object"), ('{"tools": 1}', "'tools' is set by the server"),
     ('{"x": [1]}', "'x': a variable must be")],
)  # fmt: skip
def test_serve_chat_template_kwargs_must_be_plain_variables(value, words, capsys):
    argv = ["serve", "m.gguf", "--chat-template-kwargs", value]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_says_what_it_does_in_help(command):
    """`k3stream COMMAND --help` is the manual of its flags: none is listed bare."""
    (sub,) = build_parser([command])._subparsers._group_actions
    bare = [action.option_strings[0] for action in sub.choices[command]._actions if not action.help]
    assert not bare, f"`k3stream {command} --help` lists {bare} without saying what they do"
