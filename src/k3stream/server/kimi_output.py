"""Kimi's output format: reasoning blocks and tool-call sections, split out of generated text as it streams.

    <think>reasoning</think>answer text<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> ...
    <|tool_calls_section_end|>

`KimiFormat.for_tokenizer` finds the delimiters in the model's own vocabulary and chat template (the think
pair is the one the template writes around an assistant turn's reasoning where it writes one). A special token
in a delimiter reaches the parser as a one-character *mark*, a lone surrogate code point (the engine's
`Sequence` decodes those token ids to their marks), which no decoded text holds: ordinary text that merely
spells `<|tool_call_begin|>`, or writes any character whatever, is never taken for one; a delimiter that is
plain text in the vocabulary or the template (`◁think▷`) is matched as text. `OutputParser.feed(text)` returns
what the text releases: reasoning, content and tool calls; a suffix that could begin a delimiter is held back
until the next piece, so the result does not depend on how the text was split. A call opens once its header
names one of the request's tools and its arguments begin with `{` (a JSON object): a `ToolCall` with its id
and name and no arguments, then the argument text as it comes, each piece a `ToolCall` with the index alone
(OpenAI's streamed deltas; `Piece.extend` joins them into the whole call), to `<|tool_call_end|>`; the
arguments are the text between, stripped, JSON or not (as OpenAI's may not be: a forced call's grammar
makes them its schema's JSON). A call of a `freeform` tool (the Responses API's custom tools) opens
whatever its arguments begin with, and they are the text between exactly as written. `on_call` hears
each call's id and its arguments as the model wrote them, whitespace around them included, once the
call ends. An answer that ends inside a section (`max_tokens`, the end-of-sequence token or a stop
string cut it) gives the call it cut as far as it came: a header naming a request tool is that call with
no arguments, a delimiter or a header that names no tool yet is nothing (markup is never content). A
call is *unfinished* (`OutputParser.unfinished`) where the answer ended before its end delimiter, or its
arguments ended but are not a JSON object its function's schema takes (jsonschema's check, as a client
would make it): such a call is sent as it came, and the answer's finish reason is not `tool_calls`.
Anything else inside a section (an unknown function, arguments that are not an object) comes back as
content, delimiters spelled as their token text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# think blocks as Kimi's templates write them: K2's tokens, K1.5's arrows, Kimi-K3's XTML think channel
# (its closing reopens the response channel, where the answer and its tool calls go)
THINK_PAIRS = (
    ("<think>", "</think>"),
    ("◁think▷", "◁/think▷"),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|><|open|>response<|sep|>"),
)
# an assistant turn written to find which pair the template puts around a message's reasoning
PROBE_REASONING, PROBE_CONTENT = "k3stream-probe-reasoning", "k3stream-probe-content"
TOOL_TOKENS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# the characters standing for special-token delimiters: surrogates, which UTF-8 decoding never yields (the
# private-use characters a model may write as text, icon fonts' glyphs, must stay those characters)
FIRST_MARK = 0xDC10
HEADER_RE = re.compile(r"\s*(?:functions\.)?([A-Za-z0-9_\-.]+?)(?::(\d+))?\s*")


@dataclass(frozen=True)
class ToolCall:
    """A tool call, or a piece of one: its opening (id and name) or more of its arguments (no id)."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        if not self.id:  # more argument text of the call at `index`
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class Piece:
    """What one step releases to the client."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the token ids accepted since the last piece sent

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)

    def extend(self, other: Piece) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            self.add_call(call)
        self.logprobs += other.logprobs
        self.tokens += other.tokens

    def add_call(self, call: ToolCall) -> None:
        """`call`, or more arguments of the last call (the same index)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == call.index:
            self.tool_calls[-1] = replace(last, arguments=last.arguments + call.arguments)
        else:
            self.tool_calls.append(call)


def joined(pieces: list[Piece]) -> Piece:
    """The pieces of one answer as one piece (each text joined once: appending piece by piece copies an
    answer's text once per token)."""
    chunks: dict[int, list[ToolCall]] = {}  # each call's pieces, by its index
    for piece in pieces:
        for call in piece.tool_calls:
            chunks.setdefault(call.index, []).append(call)
    calls = [replace(parts[0], arguments="".join(c.arguments for c in parts)) for parts in chunks.values()]
    return Piece(
        content="".join(piece.content for piece in pieces),
        reasoning="".join(piece.reasoning for piece in pieces),
        tool_calls=calls,
        logprobs=[entry for piece in pieces for entry in piece.logprobs],
        tokens=[token for piece in pieces for token in piece.tokens],
    )


def in_order(pieces: list[Piece]) -> list[Piece]:
    """The runs of one answer in the order its stream sends them: each run a piece of one kind (its
    reasoning, its content or one tool call), adjacent parts of one kind joined; within a piece its
    reasoning comes first, then its content, then its calls."""
    runs: list[tuple[object, list[Piece]]] = []  # (kind, its parts)
    for piece in pieces:
        parts: list[tuple[object, Piece]] = []
        if piece.reasoning:
            parts.append(("reasoning", Piece(reasoning=piece.reasoning)))
        if piece.content:
            parts.append(("content", Piece(content=piece.content)))
        parts += [(("call", call.index), Piece(tool_calls=[call])) for call in piece.tool_calls]
        for kind, part in parts:
            if runs and kind == runs[-1][0]:
                runs[-1][1].append(part)
            else:
                runs.append((kind, [part]))
    return [joined(run) for _, run in runs]


@dataclass(frozen=True)
class KimiFormat:
    """The delimiters as they appear in decoded text, and the token marks the engine must emit."""

    think: tuple[str, str] | None = None
    tools: dict[str, str] | None = None  # TOOL_TOKENS -> their text (a mark)
    marks: dict[int, str] = field(default_factory=dict)  # token id -> mark
    spelled: dict[str, str] = field(default_factory=dict)  # mark -> the token's text

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, template_text: str = "") -> KimiFormat:
        specials = tokenizer.special_tokens
        marks: dict[int, str] = {}

        def as_text(delimiter: str) -> str:
            """The delimiter's text with each special token in it written as its mark."""
            return "".join(
                marks.setdefault(specials[p], chr(FIRST_MARK + len(marks))) if p in specials else p
                for p in _special_split(delimiter, specials)
            )

        think = _think_pair(tokenizer, template_text)
        tools = None
        if all(t in specials for t in TOOL_TOKENS):
            tools = {t: as_text(t) for t in TOOL_TOKENS}
        think_text = (as_text(think[0]), as_text(think[1])) if think else None
        spelled = {mark: tokenizer.decode([token]) for token, mark in marks.items()}
        return cls(think=think_text, tools=tools, marks=marks, spelled=spelled)

    def spell(self, text: str) -> str:
        """`text` with every mark written as its token's text."""
        for mark, token in self.spelled.items():
            text = text.replace(mark, token)
        return text


def _think_pair(tokenizer: Any, template_text: str) -> tuple[str, str] | None:
    """The pair the template writes around an assistant turn's reasoning, else one the vocabulary holds
    as special tokens, else one of single vocabulary tokens or template text."""
    rendered = _probe_rendering(template_text)
    found = (
        lambda pair: f"{pair[0]}{PROBE_REASONING}{pair[1]}" in rendered,
        lambda pair: all(token in tokenizer.special_tokens for token in pair),
        lambda pair: _known_text(tokenizer, template_text, pair),
    )
    return next((pair for test in found for pair in THINK_PAIRS if test(pair)), None)


def _special_split(text: str, specials: Iterable[str]) -> list[str]:
    """`text` cut into the special tokens it holds and the text between them."""
    held = sorted((token for token in specials if token in text), key=len, reverse=True)
    if not held:
        return [text]
    return [part for part in re.split("(" + "|".join(map(re.escape, held)) + ")", text) if part]


def _probe_rendering(template_text: str) -> str:
    """The template's rendering of an assistant turn with reasoning (empty where it cannot render one)."""
    from k3stream.engine.chat import ChatTemplate

    answer = {"role": "assistant", "content": PROBE_CONTENT, "reasoning_content": PROBE_REASONING}
    try:
        template = ChatTemplate(template_text)
        return template.render([{"role": "user", "content": "?"}, answer], add_generation_prompt=False)
    except ValueError:
        return ""


def _known_text(tokenizer: Any, template_text: str, pair: tuple[str, str]) -> bool:
    """Whether both delimiters are single ordinary tokens of the vocabulary or appear in the template."""
    single = all(len(tokenizer.encode_plain(t)) == 1 for t in pair)
    return single or all(t in template_text for t in pair)


class OutputParser:
    """Splits one response's text into reasoning, content and tool calls, as it streams."""

    def __init__(
        self,
        fmt: KimiFormat,
        tool_names: Iterable[str] = (),
        *,
        freeform: Iterable[str] = (),
        schemas: Mapping[str, dict[str, Any]] | None = None,
        reasoning: bool = True,
        in_reasoning: bool = False,
        on_call: Callable[[str, str], None] | None = None,
    ) -> None:
        self.fmt = fmt
        self.tool_names = frozenset(tool_names)
        self.freeform = frozenset(freeform)  # the tools whose arguments are freeform text, not JSON
        self.schemas = dict(schemas or {})  # the JSON Schema of a function's arguments, by its name
        self.think = fmt.think if reasoning else None
        self.tools = fmt.tools
        self._mode = "reasoning" if in_reasoning and self.think else "start"
        self._pending = ""
        self._calls = 0
        self._section_calls = 0
        self._open: ToolCall | None = None  # the call whose arguments stream
        self._space = ""  # whitespace after its arguments so far: sent only if more text follows
        self._written = ""  # its arguments as the model wrote them so far
        self._on_call = on_call
        self.unfinished: set[int] = set()  # the indexes of the calls that are not to be run

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    @property
    def calls_complete(self) -> bool:
        """Whether the answer made calls and every one ended with arguments its tool takes."""
        return self.made_calls and not self.unfinished

    def feed(self, text: str) -> Piece:
        self._pending += text
        piece = Piece()
        while self._pending and self._step(piece):
            pass
        return self._spelled(piece)

    def finish(self) -> Piece:
        """Whatever is still held back at the answer's end: text as it is, the call of a cut section as far
        as it came (`_cut_section`), nothing of a cut think delimiter (`_held_markup`)."""
        piece = self.feed("")
        rest, self._pending = self._pending, ""
        if self._open is not None:  # the answer ended inside the call's arguments
            self.unfinished.add(self._open.index)
        if self._mode == "section":
            self._cut_section(rest, piece)
        elif not self._held_markup(rest):
            kind = "reasoning" if self._mode == "reasoning" else "content"
            setattr(piece, kind, getattr(piece, kind) + self.fmt.spell(rest))
        return piece

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the think block."""
        return self._mode == "reasoning"

    def _held_markup(self, rest: str) -> bool:
        """Whether `rest`, held back at the end, is the start of a think delimiter that holds a special
        token: markup the answer ended inside, not text."""
        delimiters = self.think or ()
        held = any(d.startswith(rest) for d in delimiters)
        return bool(rest) and held and any(mark in self.fmt.spelled for mark in rest)

    def _cut_section(self, rest: str, piece: Piece) -> None:
        """What the section the answer ended inside gives for `rest`, its text not taken yet (a call cut
        inside its arguments streamed them already): the call whose header names a request tool, with no
        arguments; nothing for a cut delimiter or header; text that is no call, content."""
        begin, argument = self.tools["<|tool_call_begin|>"], self.tools["<|tool_call_argument_begin|>"]
        stripped = rest.strip()
        if not stripped or begin.startswith(stripped):
            return
        header, found, arguments = stripped.removeprefix(begin).partition(argument)
        if not stripped.startswith(begin) or arguments.strip():  # no call, or arguments that are no object
            piece.content += self.fmt.spell(self._unparsed(rest))
            return
        named = self._cut_call_name(header, found)
        if named is not None:
            name, index = named
            piece.add_call(ToolCall(self._calls, f"functions.{name}:{index}", name, ""))
            self.unfinished.add(self._calls)
            self._calls += 1

    def _cut_call_name(self, header: str, ended: bool) -> tuple[str, str] | None:
        """The request tool a cut call header names and the call's index, if it names one whole: its
        header `ended`, or its name followed by `:`, or a name no other request tool's begins with."""
        match = HEADER_RE.fullmatch(header.rstrip(":"))
        if match is None or match.group(1) not in self.tool_names:
            return None
        name = match.group(1)
        whole = ended or ":" in header or not any(o != name and o.startswith(name) for o in self.tool_names)
        return (name, match.group(2) or str(self._calls)) if whole else None

    def _spelled(self, piece: Piece) -> Piece:
        piece.content = self.fmt.spell(piece.content)
        piece.reasoning = self.fmt.spell(piece.reasoning)
        return piece

    def _step(self, piece: Piece) -> bool:
        """Consume what the pending text decides; False when the rest must wait for more text."""
        return getattr(self, f"_{self._mode}")(piece)

    def _start(self, piece: Piece) -> bool:
        opening = self.think[0] if self.think else None
        if opening and self._pending.startswith(opening):
            self._pending = self._pending[len(opening) :]
            self._mode = "reasoning"
            return True
        if opening and opening.startswith(self._pending):
            return False
        self._mode = "content"
        return True

    def _reasoning(self, piece: Piece) -> bool:
        text, found = self._until(self.think[1])
        piece.reasoning += text
        if found:
            self._mode = "content"
        return found

    def _content(self, piece: Piece) -> bool:
        if self.tools is None:
            piece.content += self._pending
            self._pending = ""
            return False
        text, found = self._until(self.tools["<|tool_calls_section_begin|>"])
        piece.content += text
        if found:
            self._mode = "section"
            self._section_calls = 0
        return found

    def _section(self, piece: Piece) -> bool:
        """Inside a section: one call's opening, its arguments, or the section's end at a time."""
        if self._open is not None:
            return self._arguments(piece)
        end = self.tools["<|tool_calls_section_end|>"]
        stripped = self._pending.lstrip()
        if stripped.startswith(end):
            self._pending = stripped[len(end) :]
            self._mode = "content"
            return True
        if self._opens_call(piece):
            return True
        taken = self._take_to_end()
        if taken is None:
            return False
        piece.content += self._unparsed("".join(taken))  # malformed: this call and the rest are text
        self._mode = "content"
        return True

    def _take_to_end(self) -> tuple[str, str] | None:
        """The pending text before the first `<|tool_call_end|>` or section end and that delimiter,
        consumed; None while neither has come."""
        end, call_end = self.tools["<|tool_calls_section_end|>"], self.tools["<|tool_call_end|>"]
        stop = min((i for i in (self._pending.find(call_end), self._pending.find(end)) if i >= 0), default=-1)
        if stop < 0:
            return None
        delimiter = call_end if self._pending.startswith(call_end, stop) else end
        raw, self._pending = self._pending[:stop], self._pending[stop + len(delimiter) :]
        return raw, delimiter

    def _opens_call(self, piece: Piece) -> bool:
        """Open the call the pending text begins with, once its header names a request tool and its
        arguments' first character is `{` (a freeform tool's: at once); False while that is not (yet)
        so."""
        begin, argument = self.tools["<|tool_call_begin|>"], self.tools["<|tool_call_argument_begin|>"]
        stripped = self._pending.lstrip()
        if not stripped.startswith(begin):
            return False
        header, found, arguments = stripped[len(begin) :].partition(argument)
        match = HEADER_RE.fullmatch(header)
        if not found or match is None or match.group(1) not in self.tool_names:
            return False
        name, index = match.group(1), match.group(2) or str(self._calls)
        freeform = name in self.freeform
        if not freeform and not arguments.lstrip().startswith("{"):
            return False
        self._open = ToolCall(self._calls, f"functions.{name}:{index}", name, "")
        piece.add_call(self._open)
        self._calls += 1
        self._section_calls += 1
        self._pending = arguments if freeform else arguments.lstrip()
        self._written = arguments[: len(arguments) - len(self._pending)]
        return True

    def _arguments(self, piece: Piece) -> bool:
        """The open call's argument text up to `<|tool_call_end|>` (or the section's end, which closes
        the section too), whitespace at its end held back until more text follows (a freeform input's
        is its own: sent as it comes)."""
        taken = self._take_to_end()
        if taken is None:
            taken, self._pending = (self._pending, ""), ""
        text = self._space + taken[0]
        self._written += taken[0]
        sent = text if self._open.name in self.freeform else text.rstrip()
        if sent:
            piece.add_call(ToolCall(self._open.index, "", "", sent))
        if not taken[1]:
            self._space = text[len(sent) :]
            return False
        if self._open.name not in self.freeform and not self._takes(self._open.name, self._written):
            self.unfinished.add(self._open.index)
        if self._on_call is not None:
            self._on_call(self._open.id, self._written)
        self._space, self._open = "", None
        if taken[1] == self.tools["<|tool_calls_section_end|>"]:
            self._mode = "content"
        return True

    def _takes(self, name: str, written: str) -> bool:
        """Whether `written` is a JSON object that the schema of the function `name` takes (a schema the
        check cannot read, a Python-incompatible pattern or a `$ref` out of the schema, is left to the
        grammar that held the call)."""
        value = _object(written)
        schema = self.schemas.get(name)
        if value is None or schema is None:
            return value is not None
        from jsonschema import Draft202012Validator
        from referencing.exceptions import Unresolvable

        try:
            return Draft202012Validator(schema).is_valid(value)
        except (re.error, Unresolvable):
            return True

    def _unparsed(self, text: str) -> str:
        """Section text given back as content: with the section's opening unless a call was returned."""
        opening = self.tools["<|tool_calls_section_begin|>"] if self._section_calls == 0 else ""
        return opening + text

    def _until(self, delimiter: str) -> tuple[str, bool]:
        """Text of the pending buffer before `delimiter` (consumed with it) and whether it was found; when
        not found, everything except a suffix that could begin the delimiter."""
        before, found, after = self._pending.partition(delimiter)
        if found:
            self._pending = after
            return before, True
        keep = _prefix_overlap(self._pending, delimiter)
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, False


def _prefix_overlap(text: str, delimiter: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `delimiter`."""
    for size in range(min(len(text), len(delimiter) - 1), 0, -1):
        if delimiter.startswith(text[-size:]):
            return size
    return 0


def _object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object; None where it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
