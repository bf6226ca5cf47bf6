"""README.md stays a manual: at most 300 lines, every `k3stream ...` command it shows still parses with the
command line's argparse (parsed only, never run), every flag it or docs/ gives a benchmark script is one the
script takes, and every link to a file or a heading in it, or in docs/, finds it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from k3stream.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|\s)k3stream\s+(.+)$")  # `k3stream ...`, `$ k3stream ...`, `-m k3stream ...`
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)
BENCHMARKS = ROOT / "benchmarks"
BENCH_COMMAND = re.compile(r"\b(bench_\w+)\.py\b([^`]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def code_lines(markdown: str) -> list[str]:
    """The lines of fenced and indented code blocks and the inline code spans, continuations joined."""
    fenced = [line for block in FENCE.findall(markdown) for line in block.splitlines()[1:-1]]
    prose = FENCE.sub("", markdown).replace("\\\n", " ")
    indented = [line for line in prose.splitlines() if line.startswith("    ")]
    spans = [
        span for line in prose.splitlines() if not line.startswith("    ") for span in INLINE.findall(line)
    ]
    return fenced + indented + spans


def shown_commands(markdown: str) -> list[list[str]]:
    matches = (COMMAND.search(line) for line in code_lines(markdown))
    return [shlex.split(match.group(1), comments=True) for match in matches if match]


def test_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_command_the_readme_shows_parses():
    commands = shown_commands(README.read_text())
    assert len(commands) >= 10, commands  # the manual shows its commands: a broken extraction fails here
    for argv in commands:
        if len(argv) == 1 and not argv[0].startswith("-"):  # a command named in prose (`k3stream pack`)
            assert argv[0] in COMMANDS, f"README.md names `k3stream {argv[0]}`, which is not a command"
            continue
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, f"README.md shows `k3stream {shlex.join(argv)}`, which no longer parses"


def test_a_command_that_does_not_parse_is_caught():
    (argv,) = shown_commands("    k3stream generate demo --no-such-flag\n")
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)


def benchmark_flags(markdown: str) -> list[tuple[str, str]]:
    """(script, flag) for each flag shown after a `bench_*.py` in code, spans broken over lines joined;
    a quoted value (`--k3stream-args "--ram-mib N"`) is another program's and left out."""
    prose = INLINE.findall(re.sub(r"\s*\n\s*", " ", FENCE.sub("", markdown)))
    found = []
    for text in code_lines(markdown) + prose:
        for script, args in BENCH_COMMAND.findall(text):
            found += [(script, flag) for flag in FLAG.findall(re.sub(r"\"[^\"]*\"", "", args))]
    return found


def flags_taken(script: str) -> set[str]:
    """The option strings a benchmark script gives argparse, with those of the benchmark modules and
    command flag modules (`k3stream.commands.flags`) it imports."""
    return {"--help", *_option_literals(BENCHMARKS / f"{script}.py", set())}


def _option_literals(path: Path, seen: set[Path]) -> set[str]:
    seen.add(path)
    source = path.read_text()
    found = set(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", source))
    for module in re.findall(
        r"^\s*(?:import|from) (bench_\w+|k3stream\.commands\.\w+)", source, re.MULTILINE
    ):
        parts = module.split(".")
        imported = (
            BENCHMARKS / f"{module}.py"
            if len(parts) == 1
            else ROOT.joinpath("src", *parts[:-1], f"{parts[-1]}.py")
        )
        if imported not in seen:
            found |= _option_literals(imported, seen)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_benchmark_commands_shown_take_their_flags(page):
    for script, flag in benchmark_flags(page.read_text()):
        assert (BENCHMARKS / f"{script}.py").is_file(), f"{page.name} runs {script}.py, which does not exist"
        taken = flags_taken(script)
        assert flag in taken or flag.replace("--no-", "--", 1) in taken, (
            f"{page.name} gives {script}.py {flag}, which it does not take"
        )


def test_a_benchmark_flag_the_script_lacks_is_caught():
    shown = benchmark_flags("Run `python benchmarks/bench_forward.py --recipe\naudited --no-such-flag 3`.")
    assert shown == [("bench_forward", "--recipe"), ("bench_forward", "--no-such-flag")]
    assert "--recipe" in flags_taken("bench_forward") and "--no-such-flag" not in flags_taken("bench_forward")


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_links_to_files_point_at_files_that_exist(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (page.parent / path).exists(), f"{page.name} links to {target}, which does not exist"


def heading_ids(markdown: str) -> set[str]:
    """The ids GitHub gives a page's headings: link text kept, lower case, every character but letters,
    digits, `_`, `-` and spaces dropped, spaces to `-`, a repeated id numbered."""
    ids: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        repeat = 0
        while (numbered := f"{slug}-{repeat}" if repeat else slug) in ids:
            repeat += 1
        ids.add(numbered)
    return ids


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_links_to_headings_point_at_headings_that_exist(page):
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        if re.match(r"[a-z]+:", target) or not anchor or linked.suffix != ".md":
            continue
        assert anchor in heading_ids(linked.read_text()), f"{page.name} links to {target}: no such heading"


def test_a_link_to_a_heading_that_is_not_there_is_caught():
    ids = heading_ids("# Kernels\n## AVX-512 (`kquants_avx512.c`)\n```\n# not a heading\n```\n## Kernels\n")
    assert ids == {"kernels", "avx-512-kquants_avx512c", "kernels-1"}


def test_ci_runs_the_test_command_the_readme_gives():
    (command,) = [line.strip() for line in README.read_text().splitlines() if "-e '.[test]'" in line]
    assert command in (ROOT / ".ci" / "run").read_text(), f".ci/run does not run the README's `{command}`"
