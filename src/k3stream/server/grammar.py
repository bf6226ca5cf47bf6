"""Constrained decoding with llguidance: before each token, the sampler drops the tokens the grammar forbids.

Grammars are llguidance's Lark dialect, where `<|tool_call_begin|>` names a special token and
`%json {schema}` embeds a JSON Schema; a forced output's JSON is compact (no free whitespace), so a
model cannot pad forever, and a call the model opens on its own keeps its layout within bounds
(`OPENED_JSON`). The vocabulary is the tokenizer's tiktoken ranks (byte strings) and its special tokens;
the grammar ends on the chat's stop tokens. Once a grammar is complete only those stop tokens remain.
`bench_grammar.py` holds the measurements behind the choice of library (README: Structured output).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from k3stream.server.errors import invalid_request
from k3stream.server.scheduler import RequestError
from k3stream.server.schemas import FreeformInput, StructuredOutput, check_json_schema

JSON_DEFAULTS = {"whitespace_flexible": False}
# the JSON of a call the model opens on its own (tool_choice auto): its own layout, each run of whitespace
# a few spaces or a line break and its indentation, so it cannot pad forever; keywords llguidance does not
# implement (`uniqueItems`, `not`, `if`) are left to the check of the finished call (`OutputParser`)
OPENED_JSON = {"whitespace_pattern": r"[ \t]{0,4}|\r?\n[ \t]{0,64}", "lenient": True}
MAX_PARALLEL_CALLS = 8  # calls one section may hold (forced, or opened under tool_choice auto)
# characters of a request's custom tool grammars in all: llguidance's check of a Lark grammar grows faster
# than its length (a 3.5 MB alternation takes minutes), and each is checked, then compiled with the
# vocabulary (22 and 70 ms for 32,768 characters); Codex's apply_patch grammar holds about 2,000
MAX_GRAMMAR_CHARS = 32 << 10
BITS = torch.arange(32, dtype=torch.int32)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """A grammar whose sentences are the JSON values `schema` accepts."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


def call_arguments_schema(parameters: dict[str, Any], param: str) -> dict[str, Any]:
    """The schema a forced call's arguments follow: `parameters` as a JSON object (Kimi's parser reads a
    call's arguments from an object alone), typed `object` where it names no type; a schema of another
    type is a 400 naming `param`."""
    kind = parameters.get("type")
    if kind is None:
        return {**parameters, "type": "object"}
    if kind != "object":
        raise invalid_request(
            f"{param}: a function's parameters must be a JSON Schema of type 'object', not {kind!r}",
            param=param,
        )
    return parameters


def gbnf_grammar(text: str, param: str) -> str:
    """llama.cpp's GBNF grammar `text` in llguidance's dialect; a grammar it cannot read is a 400 naming
    `param`."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    # GbnfToLarkError for the syntax; a rule used but not defined, or no root: a bare
    # Exception (the converter is pure text work, so anything it raises is the grammar's fault)
    except Exception as exc:
        raise invalid_request(
            f"{param}: not a GBNF grammar: {str(exc).splitlines()[0]}", param=param
        ) from None


def structured_output_grammar(structured: StructuredOutput) -> str:
    """The grammar of a structured output (vLLM's, or llama-server's on its OpenAI endpoints): a JSON
    Schema (a JSON object or its text), a regular expression (Rust's syntax, as vLLM's backends take
    it), a choice among strings, llama.cpp's GBNF grammar, or any JSON object; a value of the wrong
    shape is a 400 naming its field."""
    kind, value, param = structured.kind, structured.value, structured.param
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json":
        schema = _json_value(value, param)
        if not isinstance(schema, dict):
            raise invalid_request(f"{param}: a JSON Schema must be a JSON object", param=param)
        check_json_schema(schema, param)
        return json_schema_grammar(schema)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(item, str) for item in value)):
            raise invalid_request(f"{param}: must be a non-empty list of strings", param=param)
        return "start: " + " | ".join(json.dumps(choice) for choice in value)
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param}: must be a non-empty string", param=param)
    if kind == "regex":
        return f"start: /{_slashes_escaped(value)}/"
    return gbnf_grammar(value, param)


def _json_value(value: Any, param: str) -> Any:
    """`value`, or the JSON value its text holds (vLLM takes a schema as either); a 400 naming `param`
    for text that is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"{param}: not valid JSON: {exc.msg}", param=param) from None


# what a call's arguments follow: its parameters' JSON Schema, or a freeform tool's input
ToolArguments = dict[str, Any] | FreeformInput
ANY_TEXT = "/(?s:.*)/"


def freeform_input(syntax: str, definition: str, param: str) -> FreeformInput:
    """A custom tool's grammar format as a `FreeformInput`: a Lark grammar (llguidance's dialect) or a
    regular expression (Rust's syntax, as OpenAI's), which must compile: else a 400 naming `param`."""
    import llguidance

    lark = definition if syntax == "lark" else f"start: /{_slashes_escaped(definition)}/"
    problem = llguidance.LLMatcher.validate_grammar(json.dumps({"grammars": [{"lark_grammar": lark}]}))
    if problem:
        message = f"{param}: not a {syntax} grammar llguidance can follow: {problem.strip().splitlines()[0]}"
        raise invalid_request(message, param=param)
    return FreeformInput(lark, param)


def _slashes_escaped(regex: str) -> str:
    """`regex` with each `/` it does not escape escaped, to stand between Lark's slashes."""
    return re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", regex)


def tool_calls_grammar(
    tools: Sequence[tuple[str, ToolArguments]],
    *,
    parallel: bool,
    first_index: int = 0,
    json_options: dict[str, Any] = JSON_DEFAULTS,
) -> str:
    """A Kimi tool-call section calling `tools` (name, what its arguments follow): exactly one call, or
    up to MAX_PARALLEL_CALLS when `parallel`. Calls are numbered as Kimi numbers them, from `first_index`
    (the calls earlier in the conversation): `functions.NAME:IDX`; JSON arguments are laid out as
    `json_options` (llguidance's `x-guidance`) allows. A freeform tool's input grammar is a grammar of its
    own beside the section's (llguidance's grammar list), so its rules and names cannot clash with the
    section's."""
    count = MAX_PARALLEL_CALLS if parallel else 1
    calls = "".join(f" (call_{k}" for k in range(1, count)) + ")?" * (count - 1)
    rules = [f"start: <|tool_calls_section_begin|> call_0{calls} <|tool_calls_section_end|>"]
    for k in range(count):
        rules.append(f"call_{k}: " + " | ".join(f"tool_{t}_{k}" for t in range(len(tools))))
        for t, (name, _) in enumerate(tools):
            header = json.dumps(f"functions.{name}:{first_index + k}")
            rules.append(
                f"tool_{t}_{k}: <|tool_call_begin|> {header} <|tool_call_argument_begin|> arguments_{t} "
                "<|tool_call_end|>"
            )
    inputs = []
    for t, (_, arguments) in enumerate(tools):
        rules.append(f"arguments_{t}: {_arguments_rule(arguments, f'input_{t}', json_options)}")
        if isinstance(arguments, FreeformInput) and arguments.lark is not None:
            inputs.append({"name": f"input_{t}", "lark_grammar": arguments.lark})
    return json.dumps({"grammars": [{"lark_grammar": "\n".join(rules)}, *inputs]})


def _arguments_rule(arguments: ToolArguments, input_name: str, json_options: dict[str, Any]) -> str:
    """The right side of a call's arguments rule: JSON of its schema laid out as `json_options` allows,
    its freeform input's grammar (`input_name` in the grammar list), or any text."""
    if not isinstance(arguments, FreeformInput):
        return f"%json {json.dumps({**arguments, 'x-guidance': json_options})}"
    return ANY_TEXT if arguments.lark is None else f"@{input_name}"


class GrammarCompiler:
    """Builds constraints for one served model; the llguidance vocabulary is made once, on first use."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = [int(t) for t in stop_ids]
        self._vocabulary: Any = None
        self._lock = threading.Lock()

    def _llguidance_vocabulary(self) -> Any:
        with self._lock:
            if self._vocabulary is None:
                from llguidance.tiktoken import lltokenizer_from_encoding

                self._vocabulary = lltokenizer_from_encoding(
                    self.tokenizer.encoding, n_vocab=self.tokenizer.vocab_size, eos_token=self.stop_ids
                )
            return self._vocabulary

    def constraint(self, grammar: str, param: str) -> Constraint:
        """A fresh constraint for one request; a grammar llguidance refuses is a 400 naming `param`."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llguidance_vocabulary(), grammar, log_level=0)
        if matcher.is_error():
            message = matcher.get_error().splitlines()[0]
            raise invalid_request(f"{param}: cannot be compiled to a grammar: {message}", param=param)
        return Constraint(matcher, self.tokenizer.vocab_size, self.stop_ids, param)


class Constraint:
    """One request's grammar state: `allowed()` before a token, `advance(token)` after it. A grammar
    llguidance compiled but cannot follow (a schema too complex for its parser, a recursion without end)
    fails the request (`RequestError` naming `param`), never answers as if it were complete."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: Sequence[int], param: str) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.param = param
        self._stop_ids = stop_ids
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self._stops = torch.zeros(vocab_size, dtype=torch.bool)
        self._stops[list(stop_ids)] = True

    def copy(self) -> Constraint:
        """A constraint in this one's state that goes on apart from it."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self._stop_ids, self.param)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next (only the stop tokens once it is complete)."""
        if self.matcher.is_stopped():
            return self._stops
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        if self.matcher.is_error():
            raise self._error("has no next token")
        return ((words.unsqueeze(1) >> BITS) & 1).flatten()[: self.vocab_size].bool()

    def advance(self, token: int) -> None:
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            raise self._error(f"refused token {token}")

    def _error(self, what: str) -> RequestError:
        reason = self.matcher.get_error().splitlines()[0]
        return RequestError(f"{self.param}: the grammar {what}: {reason}", self.param)


class BannedTokens:
    """A constraint that only forbids some tokens (tool_choice "none": no tool-call section)."""

    def __init__(self, token_ids: Sequence[int], vocab_size: int) -> None:
        self._allowed = torch.ones(vocab_size, dtype=torch.bool)
        self._allowed[list(token_ids)] = False

    def allowed(self) -> torch.Tensor:
        return self._allowed

    def advance(self, token: int) -> None:
        del token


class AfterThinking:
    """A forced output's constraint for a prompt that opened a think block: the reasoning is free until
    the block's closing tokens (`close`, in order), then `inner` (the grammar) applies, as vLLM's
    structured output with a reasoning parser does; the answer cannot end inside the block (`stop_ids`
    are refused there)."""

    def __init__(
        self, inner: Constraint, close: Sequence[int], stop_ids: Sequence[int], vocab_size: int
    ) -> None:
        self._inner = inner
        self._close = list(close)
        self._thinking = BannedTokens(stop_ids, vocab_size)
        self._closed = False
        self._tail: list[int] = []  # the last tokens of the block, as many as `close` holds

    def allowed(self) -> torch.Tensor:
        return self._inner.allowed() if self._closed else self._thinking.allowed()

    def advance(self, token: int) -> None:
        if self._closed:
            self._inner.advance(token)
            return
        self._tail = [*self._tail, token][-len(self._close) :]
        self._closed = self._tail == self._close


class LazySections:
    """tool_choice auto's constraint, llama-server's lazy grammar: the text is free (no mask is computed)
    until the model opens a tool-call section outside the think block, then `section` (the grammar of a
    section calling the request's tools, the forced calls' grammar) holds it to the section's end, after
    which only the stop tokens remain, as after a forced call. `follow` tells it where the output parser
    stands: a section token inside the think block is reasoning text, never a call."""

    def __init__(self, section: Constraint, trigger: int) -> None:
        self._section = section
        self._trigger = trigger  # `<|tool_calls_section_begin|>`
        self._in_reasoning: Callable[[], bool] = lambda: False
        self._held = False

    def follow(self, in_reasoning: Callable[[], bool]) -> None:
        """Take `in_reasoning` (whether the output so far ends inside the think block) as the parser's."""
        self._in_reasoning = in_reasoning

    def allowed(self) -> torch.Tensor | None:
        return self._section.allowed() if self._held else None

    def advance(self, token: int) -> None:
        self._held = self._held or (token == self._trigger and not self._in_reasoning())
        if self._held:
            self._section.advance(token)
