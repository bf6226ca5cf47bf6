"""`k3stream chat MODEL`: an interactive conversation on stdin/stdout (`/exit` ends, `/reset` forgets,
`/save FILE` and `/load FILE` keep a conversation in a file, Ctrl-C stops an answer, a line ending in a
backslash goes on in the next; escapes such as `\\n` in a message are replaced, as llama-cli replaces
them, unless `--no-escape`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from k3stream.commands.flags import (
    add_cache_arguments,
    add_context_argument,
    add_escape_argument,
    add_model_arguments,
    add_parallel_arguments,
    add_sampling_arguments,
    add_system_arguments,
    cache_from_args,
    sampling_params,
    system_prompt,
    user_text,
    with_ends,
)
from k3stream.commands.report import report, statistics_lines, store_snapshot
from k3stream.engine.chat import ROLES, ChatTemplate, chat_stop_token_ids
from k3stream.engine.fingerprints import tokenizer_digest
from k3stream.engine.loading import Runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_context_argument(parser)
    add_parallel_arguments(parser)
    add_system_arguments(parser)
    parser.add_argument("--thinking", action="store_true", help="open the think channel (Kimi-K3 templates)")
    parser.add_argument("--quiet", action="store_true", help="no statistics after each answer")
    add_escape_argument(parser, "each message and --stop strings")
    add_cache_arguments(parser)
    add_sampling_arguments(parser, max_tokens=512)


def _lines(stream: TextIO) -> Iterator[str]:
    """User lines: `input()` with a prompt and line editing on a terminal, plain lines otherwise."""
    if stream.isatty():
        import readline  # noqa: F401 - importing it gives input() history and editing

        while True:
            try:
                yield input("> ")
            except EOFError:
                return
    else:
        yield from (line.rstrip("\r\n") for line in stream)  # a Windows file's lines end in CR LF


def _turns(lines: Iterable[str]) -> Iterator[str]:
    """User turns: a line ending in a backslash goes on in the next one (the backslash dropped, the
    line break kept), as llama-cli reads its input, so a pasted paragraph can be one turn."""
    held: list[str] = []
    for line in lines:
        if line.endswith("\\"):
            held.append(line[:-1])
            continue
        yield "\n".join([*held, line])
        held = []
    if held:
        yield "\n".join(held)


class CtrlC:
    """While active, Ctrl-C asks the answer to stop at its next text (between model steps, so the model,
    the expert store and the prompt cache stay whole); a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        self.pressed = False
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *_: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _press(self, *_: object) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True


class ChatSession:
    """The conversation so far and what one turn needs to answer it."""

    def __init__(self, runtime: Runtime, args: argparse.Namespace, params: Any):
        from k3stream.memlimit import served_tokens

        self.runtime = runtime
        self.context = served_tokens(runtime.model.config, args.ctx)  # what the memory plan holds
        self.args = args
        self.template = ChatTemplate.for_tokenizer(runtime.tokenizer)
        self.params = with_ends(
            params, runtime.tokenizer, chat_stop_token_ids(runtime.tokenizer, args.thinking)
        )
        self.messages: list[dict[str, str]] = []
        # the conversation's text so far (through the last answer) and the ids the model saw for it
        self.said: tuple[str, list[int]] | None = None
        # the conversation's states between turns: each turn restores the last one's instead of
        # prefilling the whole history again
        self.cache = cache_from_args(args, runtime.model)
        self._tokenizer_digest: str | None = None
        self.reset()

    def tokenizer_digest(self) -> str:
        """`tokenizer_digest` of the model's tokenizer, computed once."""
        if self._tokenizer_digest is None:
            self._tokenizer_digest = tokenizer_digest(self.runtime.tokenizer)
        return self._tokenizer_digest

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []
        self.said = None

    def prompt_ids(self, rendered: str) -> list[int]:
        """The ids of a turn's prompt, as llama-cli makes them: the ids the model already saw (the last
        prompt's and the tokens it answered with) and the new text tokenized after them. Tokenizing the
        whole history again would give an answer's text other ids where the model's tokens are not the
        ones the tokenizer picks, so the model would read another history and the prompt cache would
        prefill that answer again."""
        tokenizer = self.runtime.tokenizer
        if self.said is None or not rendered.startswith(self.said[0]):
            return tokenizer.encode(rendered, allow_special=True)
        said, known = self.said
        return known + tokenizer.encode(rendered[len(said) :], allow_special=True, add_bos=False)

    def _remember(self, rendered: str, ids: list[int], reply: str, answered: list[int]) -> None:
        """Keep the turn's text and ids when the answer's tokens (less the end marks it stopped at) print
        its text; otherwise (a stop string cut the text) the next turn tokenizes the history again."""
        tokenizer = self.runtime.tokenizer
        ends = {*self.params.stop_token_ids, *tokenizer.end_ids}  # what `generate` stops at
        while answered and answered[-1] in ends:
            answered = answered[:-1]
        fits = tokenizer.decode(answered, skip_special=self.params.skip_special_tokens) == reply
        self.said = (rendered + reply, ids + answered) if fits else None

    def answer(self, text: str, out: TextIO, ctrl_c: CtrlC | None = None) -> str:
        """Generate the assistant's reply to `text`, streaming it to `out`; both join the conversation.
        With `ctrl_c`, a Ctrl-C ends the reply where it is (the text so far joins the conversation, and
        the state at its end the prompt cache)."""
        from k3stream.engine.generate import StopGeneration, generate

        messages = [*self.messages, {"role": "user", "content": text}]
        rendered = self.template.render(messages, thinking=self.args.thinking)
        ids = self.prompt_ids(rendered)
        sent: list[str] = []

        def write(piece: str) -> None:
            out.write(piece)
            out.flush()
            sent.append(piece)
            if ctrl_c is not None and ctrl_c.pressed:
                raise StopGeneration

        start = store_snapshot(self.runtime.store)
        with ctrl_c or contextlib.nullcontext():
            result = generate(
                self.runtime.model,
                self.runtime.tokenizer,
                ids,
                self.params,
                on_text=write,
                cache=self.cache,
                context=self.context,
            )
        out.write("\n")
        out.flush()
        self._report(result, start)
        reply = "".join(sent) if ctrl_c is not None and ctrl_c.pressed else result.text
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        self._remember(rendered, ids, reply, result.token_ids)
        return reply

    def _report(self, result: Any, start: dict[str, Any] | None) -> None:
        tokens = self.runtime.end_generation(result)
        if not self.args.quiet:
            reused = [f"cache   {result.cached_tokens} of {result.prompt_tokens} prompt tokens reused"]
            report(statistics_lines(result, self.runtime.store, start, tokens) + reused * bool(self.cache))


CHAT_FORMAT = "k3stream-chat-v1"  # a `/save` file's `format`
MAX_CHAT_FILE_BYTES = 256 << 20  # far beyond any context's messages and ids


def save_conversation(session: ChatSession, path: Path) -> None:
    """`/save FILE`: the messages, and the ids the model saw for them (with the tokenizer's digest), so
    a `/load` in this run or another continues from the same ids: its next prompt then matches the
    states the prompt cache holds (in RAM, or in `--cache-dir` across runs) and prefills only the new
    turn. Written atomically."""
    from k3stream.pack.fileio import write_bytes_atomic

    said = session.said
    record = {
        "format": CHAT_FORMAT,
        "messages": session.messages,
        "said": None if said is None else {"text": said[0], "ids": said[1]},
        "tokenizer_sha256": session.tokenizer_digest(),
    }
    write_bytes_atomic(path, (json.dumps(record, ensure_ascii=False, indent=1) + "\n").encode("utf-8"))


def load_conversation(session: ChatSession, path: Path) -> None:
    """`/load FILE`: the conversation a `/save` wrote replaces this one; a file that is not one is a
    ValueError naming it, and the conversation stays. Ids saved with another tokenizer are dropped (the
    messages are tokenized again)."""
    record = _chat_record(path)
    said = record["said"] if record["tokenizer_sha256"] == session.tokenizer_digest() else None
    if said is not None and max(said["ids"], default=0) >= session.runtime.tokenizer.vocab_size:
        raise ValueError(f"{path}: field said.ids holds an id past the vocabulary")
    session.messages = record["messages"]
    session.said = None if said is None else (said["text"], said["ids"])


def _chat_record(path: Path) -> dict[str, Any]:
    """A `/save` file's record, its fields checked; a one-line ValueError naming the file otherwise."""
    try:
        if path.stat().st_size > MAX_CHAT_FILE_BYTES:
            raise ValueError(f"larger than {MAX_CHAT_FILE_BYTES >> 20} MiB")
        record = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"{path}: not a k3stream chat file ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != CHAT_FORMAT:
        raise ValueError(f"{path}: not a k3stream chat file (format {CHAT_FORMAT}, as /save writes)")
    messages, said = record.get("messages"), record.get("said")
    if not isinstance(messages, list) or not all(_is_message(message) for message in messages):
        raise ValueError(
            f"{path}: field messages must be a list of {{role, content}} (roles {', '.join(ROLES)})"
        )
    ids = said.get("ids") if isinstance(said, dict) else None
    if said is not None and not (isinstance(said.get("text"), str) and _are_ids(ids)):
        raise ValueError(f"{path}: field said must be null or {{text, ids}} (a string, token ids)")
    if not isinstance(record.get("tokenizer_sha256"), str):
        raise ValueError(f"{path}: field tokenizer_sha256 must be a string")
    return record


def _is_message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and set(message) == {"role", "content"}
        and message["role"] in ROLES
        and isinstance(message["content"], str)
    )


def _are_ids(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(token, int) and token >= 0 for token in ids)


def _file_command(session: ChatSession, command: str) -> None:
    """`/save FILE` or `/load FILE`; a failure is one line on stderr, and the conversation goes on."""
    name, _, argument = command.partition(" ")
    if not argument.strip():
        print(f"k3stream chat: {name} needs a file: {name} FILE", file=sys.stderr)
        return
    path = Path(argument.strip()).expanduser()
    try:
        if name == "/save":
            save_conversation(session, path)
        else:
            load_conversation(session, path)
    except OSError as exc:
        print(f"k3stream chat: {name} {path}: {exc.strerror or exc}", file=sys.stderr)
    except ValueError as exc:
        print(f"k3stream chat: {name} {exc}", file=sys.stderr)


def converse(session: ChatSession) -> None:
    """Answer each line; a turn the context cannot hold is refused in one line and the conversation
    goes on (`/reset` makes room)."""
    from k3stream.engine.generate import ContextFull

    for line in _turns(_lines(sys.stdin)):
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
        elif command.split(" ", 1)[0] in ("/save", "/load"):
            _file_command(session, command)
        elif command:
            try:
                text = user_text(line, "this message", session.args.escape)
            except ValueError as bad:  # a message that is no UTF-8 text: the conversation goes on
                print(f"k3stream chat: {bad}", file=sys.stderr)
                continue
            try:
                session.answer(text, sys.stdout, CtrlC())
            except ContextFull as full:
                print(f"k3stream chat: {full} (--ctx); /reset starts over", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from k3stream.commands.launch import parallel_runtime

    args.system = system_prompt(args)
    args.stop = [user_text(stop, "--stop", args.escape) for stop in args.stop]
    params = sampling_params(args)  # bad flags fail before the model loads
    with parallel_runtime(args) as runtime:  # under torchrun: rank 0 converses, the others follow it
        if runtime is None:
            return 0
        session = ChatSession(runtime, args, params)
        try:
            converse(session)
        finally:
            if session.cache is not None:
                session.cache.close()  # its queued snapshot files, for the next chat
    return 0
