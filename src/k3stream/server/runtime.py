"""What the server serves: the engine's runtime (model, tokenizer, expert store) with its chat template,
name and context size."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3stream.engine.chat import ChatTemplate, chat_stop_token_ids
from k3stream.engine.generate import Sequence
from k3stream.engine.loading import Runtime
from k3stream.engine.prompt_cache import PromptCache
from k3stream.engine.sampling import SamplingParams
from k3stream.gguf.shards import set_name
from k3stream.server.errors import APIError, invalid_request
from k3stream.server.generated_calls import GeneratedCalls
from k3stream.server.generated_runs import GeneratedRuns, PrefixDigest
from k3stream.server.grammar import (
    OPENED_JSON,
    AfterThinking,
    BannedTokens,
    Constraint,
    GrammarCompiler,
    LazySections,
    ToolArguments,
    call_arguments_schema,
    json_schema_grammar,
    structured_output_grammar,
    tool_calls_grammar,
)
from k3stream.server.kimi_output import KimiFormat, OutputParser
from k3stream.server.request_logic import RequestLogic, TokenConstraint
from k3stream.server.schemas import ChatCompletionRequest, ChatMessage, SamplingFields, assistant_prefill


@dataclass(kw_only=True)
class ServedModel(Runtime):
    """The engine's runtime as the HTTP layer sees it: with a name, a chat template and a context size."""

    name: str
    chat_template: ChatTemplate
    ctx: int
    chat_stop_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    # the files serving reads from, with their sizes at load: /health reports any that changed
    files: dict[Path, int] = field(default_factory=dict)
    kimi: KimiFormat = field(default_factory=KimiFormat)  # reasoning and tool-call delimiters
    grammars: GrammarCompiler | None = None
    prompt_cache: PromptCache | None = None  # reused prompt states (`engine.prompt_cache`)
    # the ids of each message's content and template text as tokenized before, and the tool lists found
    # free of special-token text: an agent's turn repeats its whole history (`encode_chat`)
    pieces: TextMemo = field(default_factory=lambda: TextMemo(PIECE_MEMO_CHARS))
    # the arguments of the tool calls it generated as the model wrote them: a history that sends a call
    # back re-serialised is written with them, so its prompt cache match goes on past the call
    generated_calls: GeneratedCalls = field(default_factory=GeneratedCalls)
    # the texts of its answers the model wrote in other ids than the tokenizer's, with those ids: a
    # history that sends such an answer back is tokenized with them, so its cache match goes on past it
    generated_runs: GeneratedRuns | None = None
    # what a request that names no sampling field gets (llama-server's `--temp`, `--top-k`, `--seed`, ...:
    # `serve`'s flags); `max_tokens` is unused: `default_n_predict` is llama-server's `-n`
    defaults: SamplingParams = field(default_factory=SamplingParams)
    default_n_predict: int | None = None  # tokens a request that names no limit may generate
    # template variables of every chat (llama-server's `--chat-template-kwargs`); a request's own win
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.grammars is None:
            stops = [*self.chat_stop_ids, *sorted(self.tokenizer.end_ids)]
            self.grammars = GrammarCompiler(self.tokenizer, stops)
        if self.generated_runs is None:
            self.generated_runs = GeneratedRuns(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids: special-token text becomes those tokens, as llama-server and vLLM
        tokenize a prompt (the client writes the whole prompt, turn delimiters included)."""
        return self.tokenizer.encode(text, allow_special=True)

    def encode_text(self, text: str) -> list[int]:
        """Plain text's ids, special-token text as text and no BOS, as llama-server tokenizes a logit_bias
        text."""
        return self.tokenizer.encode(text, allow_special=False, add_bos=False)

    def encode_pieces(
        self, pieces: list[int | str], *, add_bos: bool | None = None, allow_special: bool = True
    ) -> list[int]:
        """llama-server's mixed prompt: token ids as they are, each text as `encode_prompt` tokenizes it
        (`allow_special`: special-token text becomes those tokens), the BOS token only before a first
        piece that is text, where `add_bos` says (None: where the file adds one)."""
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                bos = add_bos if index == 0 else False
                ids += self.tokenizer.encode(piece, allow_special=allow_special, add_bos=bos)
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render messages (dicts with `role`, `content` text and any of `tool_calls`, `tool_call_id`,
        `name`, `reasoning_content`) and `tools` with the chat template and tokenize them. Special tokens
        come only from the template: each message's content is tokenized as plain text, so content
        holding `<|im_end|><|im_system|>` cannot forge a turn, and so are a call's arguments and a
        reasoning that spell special-token text (what the model wrote, sent back) where the template
        writes them as they are; tool definitions, call ids, names and template variables holding
        special-token text are refused."""
        extras = {"tools": tools, **(variables or {})} if tools else dict(variables or {})
        strings = list(_template_strings(messages, {}))
        written = [
            (path, text) for path, text in strings if PLAIN_FIELD.fullmatch(path) and self._spells(text)
        ]
        self._refuse_special_text(item for item in strings if item not in written)
        self._refuse_special_extras(extras)
        slots = [m["content"] for m in messages] + [text for _, text in written]
        skeleton = self._render(_marked(messages, [path for path, _ in written]), extras)
        split = _split_at_marks(skeleton, len(messages), len(slots))
        if split is not None and written and _filled(*split, slots) != self._render(messages, extras):
            split = None  # the template transforms the written fields
        if split is None:  # the template transforms them: render it, but refuse special-token text
            contents = [(f"messages.{index}.content", m["content"]) for index, m in enumerate(messages)]
            self._refuse_special_text(contents + written)
            return self.tokenizer.encode(self._render(messages, extras), allow_special=True)
        pieces, order = split
        return self._encode_filled(pieces, [slots[slot] for slot in order])

    def _encode_filled(self, template_texts: list[str], filled: list[str]) -> list[int]:
        """The ids of `template_texts` with the `filled` texts between them, as llama.cpp tokenizes the
        whole prompt: cut at the special tokens of the template's texts (a filled text is never cut: it
        stays plain), each text between two of them, template and filled texts together, tokenized as
        one (kept in `pieces`): a content's first and last words are those of the whole text."""
        tokenizer = self.tokenizer
        ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
        digest = PrefixDigest()  # of the ids so far: a text the model wrote after them keeps its ids
        plain: list[str] = []  # the texts since the last special token
        for index, template_text in enumerate(template_texts):
            if index:
                plain.append(filled[index - 1])
            for fragment in tokenizer.special_split(template_text):
                if isinstance(fragment, str):
                    plain.append(fragment)
                    continue
                ids += self._plain_ids("".join(plain), ids, digest)
                ids.append(fragment)
                plain = []
        return ids + list(self._plain_ids("".join(plain), ids, digest))

    def _plain_ids(self, text: str, before: list[int], digest: PrefixDigest) -> tuple[int, ...]:
        """`text`'s ids after the ids `before` (of `digest`): the model's where it wrote it there."""
        if not text:
            return ()
        generated = self.generated_runs.ids(digest.at(before), text)
        return (
            generated
            if generated is not None
            else self.pieces.get(("plain", text), self.tokenizer.encode_plain)
        )

    def _refuse_special_extras(self, extras: dict[str, Any]) -> None:
        """`_refuse_special_text` over the tools and template variables, once per distinct set."""
        if not extras:
            return
        key = ("extras", json.dumps(extras, sort_keys=True, default=repr))

        def check(_: str) -> tuple[int, ...]:
            self._refuse_special_text(_template_strings([], extras))
            return ()

        self.pieces.get(key, check)

    def _render(self, messages: list[dict[str, Any]], extras: dict[str, Any]) -> str:
        try:
            return self.chat_template.render(messages, **extras)
        except ValueError as exc:
            raise invalid_request(str(exc), param="messages") from None

    def _refuse_special_text(self, strings: Iterable[tuple[str, str]]) -> None:
        """A 400 naming the field of the first `(field, text)` whose text spells a special token."""
        for param, text in strings:
            special = self._spells(text)
            if special is not None:
                raise invalid_request(f"{param} contains the special token text {special!r}", param=param)

    def _spells(self, text: str) -> str | None:
        """The first special token whose text `text` holds, else None."""
        return next((s for s in self.tokenizer.special_tokens if s in text), None)

    def prepare_chat(self, body: ChatCompletionRequest) -> ChatPrompt:
        """Tokens, grammar and parser settings of one chat request (template rendering, schema
        compilation: run it off the event loop)."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        if tools and self.kimi.tools is None:
            raise invalid_request("tools: this model's vocabulary has no tool-call tokens", param="tools")
        messages = self.template_messages(body.messages)
        prefill = assistant_prefill(body.messages)
        if prefill is not None:
            messages.pop()
        tokens = self.encode_chat(messages, tools or None, self.template_variables(body.template_kwargs()))
        in_reasoning = self._opens_thinking(tokens)
        if prefill:
            tokens += self.pieces.get(("plain", prefill), self.tokenizer.encode_plain)
            in_reasoning = in_reasoning and self.kimi.spell(self.kimi.think[1]) not in prefill
        if not tokens:  # a template may render a conversation (or everything) to no text
            raise invalid_request("messages: the chat template renders them to no tokens", param="messages")
        return ChatPrompt(
            tokens=tokens,
            tool_names=tuple(tool.function.name for tool in body.tools or []),
            freeform=tuple(body.freeform_tools()),
            schemas={tool.function.name: tool.function.schema_or_empty() for tool in body.tools or []},
            constraints=tuple(self._constraint(body, in_reasoning) for _ in range(body.n)),
            reasoning=body.splits_reasoning(),
            in_reasoning=in_reasoning,
        )

    def template_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """`messages` as the chat template gets them, each tool call this server generated with its
        arguments as the model wrote them (the same JSON value; `generated_calls`)."""
        fields = [{**m.template_fields(), "content": m.text()} for m in messages]
        return [self._as_generated(message) for message in fields]

    def _as_generated(self, message: dict[str, Any]) -> dict[str, Any]:
        if not message.get("tool_calls"):
            return message
        calls = []
        for call in message["tool_calls"]:
            arguments = self.generated_calls.written(call["id"], call["function"]["arguments"])
            calls.append({**call, "function": {**call["function"], "arguments": arguments}})
        return {**message, "tool_calls": calls}

    def template_variables(self, asked: dict[str, Any] | None) -> dict[str, Any]:
        """A request's template variables over the server's (`--chat-template-kwargs`), each side's
        llama-server `enable_thinking` giving Kimi's `thinking` where that side does not name it."""
        return {**_with_thinking(self.template_kwargs), **_with_thinking(asked or {})}

    def _opens_thinking(self, tokens: list[int]) -> bool:
        """Whether the prompt ends with the think opening (the template opened the block)."""
        if self.kimi.think is None:
            return False
        opening = self.kimi.spell(self.kimi.think[0])
        tail = tokens[-len(opening.encode()) :]  # every token holds at least one byte
        return self.tokenizer.decode(tail).endswith(opening)

    def _constraint(self, body: ChatCompletionRequest, in_reasoning: bool) -> TokenConstraint | None:
        """One choice's constraint; a forced output's grammar follows the think block the prompt opened
        (`in_reasoning`)."""
        forced = self._forced_output(body)
        if forced is not None and in_reasoning:
            return AfterThinking(forced, self._think_close(), self.grammars.stop_ids, self.vocab_size)
        if forced is not None:
            return forced
        if body.tool_choice == "none" and self.kimi.tools is not None:
            section = self.tokenizer.token_id("<|tool_calls_section_begin|>")
            return BannedTokens([section], self.vocab_size)
        if not body.tools or self.kimi.tools is None:
            return None
        return self._lazy_sections(body)

    def _lazy_sections(self, body: ChatCompletionRequest) -> LazySections:
        """tool_choice auto: a section the model opens holds calls of the request's tools (one where
        parallel_tool_calls is false), their JSON in the model's own layout (`OPENED_JSON`); a tool the
        grammar library cannot compile is a 400 naming its field."""
        tools = self._opened_tools(body)
        parallel = body.parallel_tool_calls is not False
        called = [(name, arguments) for name, arguments, _ in tools]
        grammar = tool_calls_grammar(
            called, parallel=parallel, first_index=_earlier_calls(body), json_options=OPENED_JSON
        )
        try:
            section = self.grammars.constraint(grammar, "tools")
        except APIError:
            for name, arguments, param in tools:  # the first tool at fault, by name
                alone = tool_calls_grammar([(name, arguments)], parallel=False, json_options=OPENED_JSON)
                self.grammars.constraint(alone, param)
            raise
        return LazySections(section, self.tokenizer.token_id("<|tool_calls_section_begin|>"))

    def _opened_tools(self, body: ChatCompletionRequest) -> list[tuple[str, ToolArguments, str]]:
        """Each tool of the request: its name, what its arguments follow and the field that defines it; a
        function's parameters not of an object's type are a 400 naming them."""
        freeform = body.freeform_tools()
        tools = []
        for index, tool in enumerate(body.tools or []):
            name, param = tool.function.name, f"tools.{index}.function.parameters"
            if name in freeform:
                tools.append((name, freeform[name], freeform[name].param))
            else:
                tools.append((name, call_arguments_schema(tool.function.schema_or_empty(), param), param))
        return tools

    def _forced_output(self, body: ChatCompletionRequest) -> Constraint | None:
        """The grammar of a forced tool call (`tool_choice` required or named) or `response_format`."""
        forced = body.forced_tools()
        if forced:
            arguments = {**self._forced_call_schemas(body), **body.freeform_tools()}
            tools = [(tool.function.name, arguments[tool.function.name]) for tool in forced]
            parallel = body.parallel_tool_calls is not False and body.tool_choice == "required"
            grammar = tool_calls_grammar(tools, parallel=parallel, first_index=_earlier_calls(body))
            return self.grammars.constraint(grammar, "tool_choice")
        response_format = body.response_format
        if response_format is not None and response_format.type != "text":
            schema = response_format.followed_schema()
            return self.grammars.constraint(json_schema_grammar(schema), "response_format")
        return self.structured_constraint(body)

    def structured_constraint(self, body: SamplingFields) -> Constraint | None:
        """The grammar of the request's structured output (`SamplingFields.structured_output`), or None
        where it asks for none."""
        structured = body.structured_output()
        if structured is None:
            return None
        return self.grammars.constraint(structured_output_grammar(structured), structured.param)

    def _think_close(self) -> list[int]:
        """The tokens that close a think block (its special tokens and its text's tokens)."""
        return self.tokenizer.encode(self.kimi.spell(self.kimi.think[1]), allow_special=True)

    def _forced_call_schemas(self, body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
        """Each forced function's arguments schema by name (a freeform tool has none); a 400 naming the
        first forced function whose parameters are not an object's or that the grammar library cannot
        compile."""
        forced = {tool.function.name for tool in body.forced_tools()} - set(body.freeform_tools())
        schemas = {}
        for index, tool in enumerate(body.tools or []):
            if tool.function.name in forced:
                param = f"tools.{index}.function.parameters"
                schema = call_arguments_schema(tool.function.schema_or_empty(), param)
                self.grammars.constraint(json_schema_grammar(schema), param)
                schemas[tool.function.name] = schema
        return schemas

    def new_sequence(
        self,
        body: SamplingFields,
        prompt_tokens: list[int],
        max_tokens: int,
        *,
        chat: ChatPrompt | None,
        top_logprobs: int | None = None,
        choice: int = 0,
        constraint: TokenConstraint | None = None,
    ) -> RequestLogic:
        """The per-sequence logic (sampling, stops, detokenisation, grammar, output parsing, logprobs) of
        one choice of a request; a chat answer also stops where the template closes the assistant's
        response (its grammar is the chat's; `constraint` that of a completion). Choice `i` of a seeded
        request draws with seed + i, so the choices differ."""
        defaults = self.defaults
        seed = defaults.seed if body.seed is None else body.draw_seed()
        params = SamplingParams(
            temperature=_given(body.temperature, defaults.temperature),
            top_p=_given(body.top_p, defaults.top_p),
            top_k=defaults.top_k if body.top_k is None else max(body.top_k, 0),
            seed=None if seed is None else _choice_seed(seed, choice),
            min_p=_given(body.min_p, defaults.min_p),
            repetition_penalty=_given(body.repetition_penalty, defaults.repetition_penalty),
            frequency_penalty=_given(body.frequency_penalty, defaults.frequency_penalty),
            presence_penalty=_given(body.presence_penalty, defaults.presence_penalty),
            logit_bias=body.logit_bias_ids(self.vocab_size, self.encode_text),
            max_tokens=max_tokens,
            stop=tuple(body.stop_list()),
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str=body.include_stop_str_in_output,
            stop_token_ids=(
                *(self.chat_stop_ids if chat is not None else ()),
                *body.stop_ids(self.vocab_size),
            ),
        )
        params = replace(params, **body.sampling_overrides())
        if chat is None:
            sequence = Sequence(self.tokenizer, prompt_tokens, params)
            return RequestLogic(
                sequence,
                self.tokenizer,
                constraint=constraint,
                top_logprobs=top_logprobs,
                post_sampling=body.post_sampling(),
            )
        sequence = Sequence(self.tokenizer, prompt_tokens, params, marks=self.kimi.marks)
        parser = OutputParser(
            self.kimi,
            chat.tool_names,
            freeform=chat.freeform,
            schemas=chat.schemas,
            reasoning=chat.reasoning,
            in_reasoning=chat.in_reasoning,
            on_call=self.generated_calls.remember,
        )
        constraint = chat.constraints[choice]
        if isinstance(constraint, LazySections):
            constraint.follow(lambda: parser.in_reasoning)
        return RequestLogic(
            sequence,
            self.tokenizer,
            parser=parser,
            constraint=constraint,
            top_logprobs=top_logprobs,
            on_answer=self.generated_runs.remember,
        )

    def meta(self) -> dict[str, int]:
        """llama-server's `meta` of a model card: its vocabulary (2: byte-level BPE, llama.cpp's
        LLAMA_VOCAB_TYPE_BPE), served and training contexts, embedding width, parameters and tensor
        bytes."""
        config = self.model.config
        params, size = getattr(self.model, "file_weights", (0, 0))  # a parallel stand-in: unknown
        return {
            "vocab_type": 2,
            "n_vocab": self.vocab_size,
            "n_ctx": self.ctx,
            "n_ctx_train": int(config.context_length),
            "n_embd": int(config.hidden),
            "n_params": params,
            "size": size,
        }

    def file_problems(self) -> list[str]:
        """One line per model file that is gone or changed size since load (names only, no paths)."""
        problems = []
        for path, size in self.files.items():
            try:
                now = path.stat().st_size
            except OSError:
                problems.append(f"model file {path.name} is gone")
                continue
            if now != size:
                problems.append(f"model file {path.name} changed size since load ({now} bytes, was {size})")
        return problems


def _with_thinking(variables: dict[str, Any]) -> dict[str, Any]:
    """`variables` with `thinking` (Kimi's templates open the think block with it) from llama-server's
    `enable_thinking` (what its clients and `--reasoning-budget 0` set) where only that is named."""
    if "enable_thinking" not in variables or "thinking" in variables:
        return variables
    return {**variables, "thinking": bool(variables["enable_thinking"])}


def _earlier_calls(body: ChatCompletionRequest) -> int:
    """The tool calls earlier in the conversation: Kimi numbers a new call after them."""
    return sum(len(m.tool_calls or []) for m in body.messages)


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice`: the request's for the first, wrapped into the request's seed range."""
    return (seed + choice + (1 << 63)) % (1 << 64) - (1 << 63) if choice else seed


# private-use characters around a slot's index stand for its text while the template renders: a
# message's content, or a field of `PLAIN_FIELD` that spells special-token text
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
MARK_RE = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")
# the fields of a message that the model wrote: tokenized as plain text, as content is, when they spell
# special-token text
PLAIN_FIELD = re.compile(r"messages\.\d+\.(?:tool_calls\.\d+\.function\.arguments|reasoning_content)")


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request ready for the scheduler."""

    tokens: list[int]
    tool_names: tuple[str, ...]
    freeform: tuple[str, ...]  # the tools whose arguments are freeform text
    schemas: dict[str, dict[str, Any]]  # each function tool's parameters, by name
    constraints: tuple[TokenConstraint | None, ...]  # one per choice: a constraint follows its tokens
    reasoning: bool
    in_reasoning: bool  # the prompt opened a think block


PIECE_MEMO_CHARS = 64 << 20  # characters of text whose ids `TextMemo` keeps


class TextMemo:
    """Token ids by (kind, text), least recently used first out once the texts exceed `max_chars`
    characters: the ids of a text are those a tokenization of it gives, whatever surrounds it (each
    message's content and template text is tokenized apart, `ServedModel.encode_chat`)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # requests are prepared on several threads
        self.hits = 0

    def get(self, key: tuple[str, str], compute: Callable[[str], Iterable[int]]) -> tuple[int, ...]:
        with self._lock:
            found = self._ids.get(key)
            if found is not None:
                self._ids.move_to_end(key)
                self.hits += 1
                return found
        ids = tuple(compute(key[1]))  # raises for a text that is refused: nothing kept
        with self._lock:
            if key not in self._ids and len(key[1]) <= self.max_chars:
                self._ids[key] = ids
                self._chars += len(key[1])
                while self._chars > self.max_chars:
                    (_, text), _ = self._ids.popitem(last=False)
                    self._chars -= len(text)
        return ids


def _template_strings(messages: list[dict[str, Any]], extras: dict[str, Any]) -> Iterable[tuple[str, str]]:
    """`(field, text)` of every string the template receives besides message contents."""
    for index, message in enumerate(messages):
        for key, value in message.items():
            if key != "content":
                yield from _strings(value, f"messages.{index}.{key}")
    for key, value in extras.items():
        yield from _strings(value, key if key == "tools" else f"chat_template_kwargs.{key}")


def _strings(value: Any, path: str) -> Iterable[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, path)
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}.{index}")


def _mark(slot: int) -> str:
    return f"{MARK_OPEN}{slot}{MARK_CLOSE}"


def _marked(messages: list[dict[str, Any]], paths: list[str]) -> list[dict[str, Any]]:
    """`messages` with their contents (slots 0...), then the fields at `paths` (the next slots), replaced
    by their marks."""
    marked = [{**m, "content": _mark(index)} for index, m in enumerate(messages)]
    for slot, path in enumerate(paths, start=len(messages)):
        _, index, *keys = path.split(".")
        node = marked[int(index)] = copy.deepcopy(marked[int(index)])
        for key in keys[:-1]:
            node = node[int(key) if key.isdigit() else key]
        node[keys[-1]] = _mark(slot)
    return marked


def _split_at_marks(text: str, contents: int, slots: int) -> tuple[list[str], list[int]] | None:
    """`text` cut at its marks: the texts around them and the slots they stand for, in the order they
    come; None when a mark comes twice, or a content's (slots below `contents`) never: the template
    repeated, dropped or changed a message's content."""
    parts = MARK_RE.split(text)
    pieces, order = parts[0::2], [int(slot) for slot in parts[1::2]]
    found = set(order)
    if len(found) != len(order) or not set(range(contents)) <= found or not found <= set(range(slots)):
        return None
    return pieces, order


def _filled(pieces: list[str], order: list[int], slots: list[str]) -> str:
    """The text `_split_at_marks` cut, with each mark's slot text in its place."""
    return pieces[0] + "".join(slots[slot] + piece for slot, piece in zip(order, pieces[1:], strict=True))


DEFAULT_MAX_CTX = 4096


def served_from_runtime(
    runtime: Runtime,
    *,
    name: str | None = None,
    ctx: int | None = None,
    chat_template_file: Path | None = None,
) -> ServedModel:
    """Wrap the engine's loaded runtime (model, tokenizer, optional expert store) for serving.

    The name defaults to the GGUF's file name without shard suffix and extension; the context to the
    model's, at most DEFAULT_MAX_CTX; the chat template to the file's (`chat_template_file` replaces it,
    as llama-server's `--chat-template-file`).
    """
    model_ctx = int(runtime.model.config.context_length)
    if ctx is not None and not 1 < ctx <= model_ctx:
        raise ValueError(f"--ctx {ctx} must be between 2 and the model's context length {model_ctx}")
    tokenizer = runtime.tokenizer
    template = ChatTemplate.for_tokenizer(tokenizer, chat_template_file)
    return ServedModel(
        model=runtime.model,
        tokenizer=tokenizer,
        store=runtime.store,
        manifest=runtime.manifest,
        files={path: path.stat().st_size for path in runtime.model_files() if path.is_file()},
        name=name or set_name(Path(tokenizer.source)),
        chat_template=template,
        kimi=KimiFormat.for_tokenizer(tokenizer, template.template_text),
        ctx=ctx or min(model_ctx, DEFAULT_MAX_CTX),
        chat_stop_ids=chat_stop_token_ids(tokenizer, thinking=False),
    )
