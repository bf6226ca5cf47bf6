"""Anthropic's Messages API as llama-server serves it: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, for agents that speak it (Claude Code, the `anthropic` client).

A request is converted into the chat request of `/v1/chat/completions` (`MessagesRequest.chat_request`)
and answered on the same path (template, tools, grammar, scheduler, prompt cache); `MessageShapes`
writes the result as Anthropic's message, or as its event stream: `message_start`, then per content
block (`thinking`, `text`, `tool_use`) `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason, usage)
and `message_stop`. Errors are Anthropic's error object (`errors.AnthropicError`).
docs/server-endpoints.md describes the fields.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from k3stream.server.bodies import parse_body
from k3stream.server.errors import AnthropicError, APIError, invalid_request
from k3stream.server.kimi_output import Piece, ToolCall, in_order
from k3stream.server.scheduler import Job
from k3stream.server.schemas import (
    AssistantToolCall,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    MaxTokens,
    NamedFunction,
    NamedToolChoice,
    Switch,
    Temperature,
    TemplateValue,
    Tool,
    TopK,
    TopP,
    check_stops,
    joined_text_parts,
    object_tool,
)

if TYPE_CHECKING:
    from k3stream.server.app import Endpoints

# the start of the system block Claude Code sends, whose `cch=` stamp changes with every request
BILLING_HEADER = "x-anthropic-billing-header:"
STAMP_LENGTH = 5
# the fields each content block needs
BLOCK_FIELDS = {
    "text": ("text",),
    "tool_use": ("id", "name", "input"),
    "tool_result": ("tool_use_id",),
    "thinking": ("thinking",),
}


class ContentBlock(BaseModel):
    """One block of a message's content; which types a role may send is checked by `check`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    thinking: str | None = None  # thinking

    def check(self, where: str, allowed: tuple[str, ...]) -> None:
        """A 400 naming `where` unless the block is of an `allowed` type with the fields it needs."""
        if self.type not in allowed:
            kind = "text only" if self.type in ("image", "document") else f"{', '.join(allowed)} blocks here"
            message = f"{where}.type: {self.type!r} blocks are not supported; this server takes {kind}"
            raise invalid_request(message, param=f"{where}.type", code="unsupported_value")
        missing = next((name for name in BLOCK_FIELDS[self.type] if getattr(self, name) is None), None)
        if missing is not None:
            raise invalid_request(
                f"{where}.{missing}: a {self.type} block needs it", param=f"{where}.{missing}"
            )
        if self.type == "tool_result" and isinstance(self.content, list):
            for number, part in enumerate(self.content):
                part.check(f"{where}.content.{number}", ("text",))

    def result_text(self) -> str:
        """A tool result's content as text (its text blocks joined)."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self, index: int) -> list[ChatMessage]:
        """The message as chat messages, in its blocks' order: a user's text blocks as one message, each
        tool result as a tool message; an assistant's text, thinking and tool calls as one message."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        where = f"messages.{index}.content"
        if not self.content:
            raise invalid_request(f"{where}: a message needs at least one content block", param=where)
        allowed = ("text", "tool_result") if self.role == "user" else ("text", "tool_use", "thinking")
        for number, block in enumerate(self.content):
            block.check(f"{where}.{number}", allowed)
        return self._user_messages() if self.role == "user" else [self._assistant_message()]

    def _user_messages(self) -> list[ChatMessage]:
        """Each run of text blocks is one user message, its texts joined as llama-server joins a
        message's text blocks (`joined_text_parts`); each tool result is a tool message."""
        messages: list[ChatMessage] = []
        texts: list[str] = []
        for block in self.content:
            if block.type == "text":
                texts.append(block.text)
                continue
            if texts:
                messages.append(ChatMessage(role="user", content=joined_text_parts(texts)))
                texts = []
            messages.append(
                ChatMessage(role="tool", content=block.result_text(), tool_call_id=block.tool_use_id)
            )
        if texts:
            messages.append(ChatMessage(role="user", content=joined_text_parts(texts)))
        return messages

    def _assistant_message(self) -> ChatMessage:
        calls = [
            AssistantToolCall(id=b.id, function=CalledFunction(name=b.name, arguments=_compact(b.input)))
            for b in self.content
            if b.type == "tool_use"
        ]
        text = joined_text_parts([block.text for block in self.content if block.type == "text"])
        reasoning = "".join(block.thinking for block in self.content if block.type == "thinking")
        return ChatMessage(
            role="assistant",
            content=text if text or not calls else None,
            tool_calls=calls or None,
            reasoning_content=reasoning or None,
        )


class AnthropicTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash...) are not run


class ToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def openai(self, tools: list[Tool]) -> str | NamedToolChoice:
        """The chat request's `tool_choice`: `any` is `required`, `tool` names its function."""
        if self.type in ("any", "tool") and not tools:
            message = f'tool_choice: {{"type": "{self.type}"}} needs at least one tool'
            raise invalid_request(message, param="tool_choice")
        if self.type == "tool":
            if self.name is None:
                raise invalid_request(
                    "tool_choice.name: a tool choice of type 'tool' needs it", param="tool_choice.name"
                )
            return NamedToolChoice(type="function", function=NamedFunction(name=self.name))
        return {"any": "required"}.get(self.type, self.type)


class Thinking(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`'s body: what the prompt is made of."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None  # any name: the served model answers, as in llama-server
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None  # llama-server's

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat completion request this one asks for (with the `sampling` fields of a message)."""
        tools = [
            object_tool(tool.name, tool.description, tool.input_schema, f"tools.{index}.input_schema")
            for index, tool in enumerate(self.tools or [])
        ]
        choice = self.tool_choice
        return ChatCompletionRequest(
            messages=self._system()
            + [m for i, msg in enumerate(self.messages) for m in msg.chat_messages(i)],
            tools=tools or None,
            tool_choice=None if choice is None else choice.openai(tools),
            parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
            chat_template_kwargs=self._template_variables(),
            **sampling,
        )

    def _system(self) -> list[ChatMessage]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [ChatMessage(role="system", content=steady_billing_header(self.system))]
        for number, block in enumerate(self.system):
            block.check(f"system.{number}", ("text",))
        text = "".join(steady_billing_header(block.text) for block in self.system)
        return [ChatMessage(role="system", content=text)]

    def _template_variables(self) -> dict[str, TemplateValue] | None:
        """`chat_template_kwargs`, with `thinking` (Kimi's templates open the think channel with it) from
        Anthropic's `thinking` unless given there."""
        if self.thinking is None:
            return self.chat_template_kwargs
        return {"thinking": self.thinking.type != "disabled", **(self.chat_template_kwargs or {})}


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`' body: the prompt, `max_tokens` (required, as in Anthropic's API) and sampling."""

    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: Switch = False

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        fields = ("max_tokens", "temperature", "top_p", "top_k", "stream")
        check_stops(self.stop_sequences or [], "stop_sequences")
        return super().chat_request(
            stop=self.stop_sequences, **{name: getattr(self, name) for name in fields}, **sampling
        )


def steady_billing_header(text: str) -> str:
    """`text` with the stamp of Claude Code's billing header (`cch=a5145;`) written `fffff`, as
    llama-server writes it: the stamp changes with every request, and left as it is, no request could
    reuse the cached state of the prompt that follows it."""
    if not text.startswith(BILLING_HEADER):
        return text
    start = text.find("cch=", len(BILLING_HEADER)) + len("cch=")
    end = start + STAMP_LENGTH
    if start < len("cch=") or text[end : end + 1] != ";":
        return text
    return text[:start] + "f" * STAMP_LENGTH + text[end:]


def stop_reason(reason: str, stop_word: str, context_full: bool) -> str:
    """Anthropic's stop reason of a chat finish reason (`stop_word`: the stop sequence that ended it;
    `context_full`: the context ended it before `max_tokens` did)."""
    if reason == "length":
        return "model_context_window_exceeded" if context_full else "max_tokens"
    if reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_word else "end_turn"


class MessageShapes:
    """The Anthropic shapes of one answer (`streaming.Stream` sends them): its events as it streams, framed
    here (`event:` and `data:` lines), or the whole message."""

    done_line = ""  # the stream ends with `message_stop`
    index = 0  # the one choice (`n` is 1)

    def __init__(self, job: Job, model: str, max_tokens: int) -> None:
        self.job = job
        self.model = model
        self.max_tokens = max_tokens  # as asked; the context may cut the answer before it
        self.id = f"msg_{uuid.uuid4().hex}"
        self._started = False
        self._open: str | None = None  # the open block: "thinking", "text" or "tool_use:N"
        self._blocks = 0  # blocks started

    def first(self) -> None:
        return None  # `message_start` waits for the prefill: it carries the cached prompt tokens

    def piece(self, piece: Piece) -> str:
        events = self._start()
        if piece.reasoning:
            events += self._into("thinking", {"type": "thinking", "thinking": ""})
            events += self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content:
            events += self._into("text", {"type": "text", "text": ""})
            events += self._delta({"type": "text_delta", "text": piece.content})
        for call in piece.tool_calls:
            if call.id:
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                events += self._into(f"tool_use:{call.index}", block)
            if call.arguments:
                events += self._delta({"type": "input_json_delta", "partial_json": call.arguments})
        return "".join(events)

    def last(self, reason: str) -> str:
        events = [*self._start(), *self._close()]
        delta = {
            "stop_reason": self._stop_reason(reason),
            "stop_sequence": self._stop_word() or None,
        }
        usage = {**self._prompt_usage(), "output_tokens": self.job.logic.completion_tokens}
        events.append(named_event({"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(named_event({"type": "message_stop"}))
        return "".join(events)

    def whole_choice(self, pieces: list[Piece], reason: str) -> dict[str, Any]:
        runs = in_order(pieces)  # the blocks in the order the stream sends them
        blocks = [_block(run, self.job.logic.unfinished) for run in runs]
        word = self._stop_word()
        return {"content": blocks, "stop_reason": self._stop_reason(reason), "stop_sequence": word or None}

    def whole(
        self, choices: list[dict[str, Any]], usage: dict[str, Any], timings: dict[str, float]
    ) -> dict[str, Any]:
        del usage, timings  # Anthropic's usage is the job's (`_prompt_usage`); it has no timings
        usage = {**self._prompt_usage(), "output_tokens": self.job.logic.completion_tokens}
        return {**self._message(), **choices[0], "usage": usage}

    def error(self, error: APIError) -> AnthropicError:
        return AnthropicError.of(error)

    def _message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _prompt_usage(self) -> dict[str, int]:
        """Anthropic's prompt usage: `input_tokens` computed, `cache_read_input_tokens` restored from the
        prompt cache (together the prompt)."""
        cached = self.job.cached_tokens
        return {"input_tokens": len(self.job.prompt_tokens) - cached, "cache_read_input_tokens": cached}

    def _stop_word(self) -> str:
        return self.job.logic.sequence.stop_word

    def _stop_reason(self, reason: str) -> str:
        context_full = self.job.logic.completion_tokens < self.max_tokens
        return stop_reason(reason, self._stop_word(), context_full)

    def _start(self) -> list[str]:
        if self._started:
            return []
        self._started = True
        message = {**self._message(), "content": [], "stop_reason": None, "stop_sequence": None}
        message["usage"] = {**self._prompt_usage(), "output_tokens": 0}
        return [named_event({"type": "message_start", "message": message})]

    def _into(self, kind: str, block: dict[str, Any]) -> list[str]:
        """Events that make `kind` the open block: the open one's stop and the new one's start."""
        if self._open == kind:
            return []
        events = self._close()
        self._open = kind
        start = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        events.append(named_event(start))
        self._blocks += 1
        return events

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        return [named_event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":  # a thinking block ends with its signature (none here)
            events += self._delta({"type": "signature_delta", "signature": ""})
        self._open = None
        return [*events, named_event({"type": "content_block_stop", "index": self._blocks - 1})]


def _block(run: Piece, unfinished: Callable[[int], bool]) -> dict[str, Any]:
    """The content block of one run of the answer (`kimi_output.in_order`); `unfinished`: whether the
    call at an index is not to be run."""
    if run.reasoning:
        return {"type": "thinking", "thinking": run.reasoning, "signature": ""}
    if run.content:
        return {"type": "text", "text": run.content}
    call = run.tool_calls[0]
    return _call_block(call, unfinished(call.index))


def _call_block(call: ToolCall, unfinished: bool) -> dict[str, Any]:
    """A tool call as the `tool_use` block it streamed as; an unfinished one (cut by the answer's end, or
    arguments that are no JSON object), as Anthropic's API answers a call `max_tokens` cuts, with the
    members its arguments hold whole as `input` (`_object_so_far`), what the `anthropic` client reads
    from its deltas: the answer's `stop_reason` is then not `tool_use`."""
    arguments = _object_so_far(call.arguments) if unfinished else json.loads(call.arguments)
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def _object_so_far(text: str) -> dict[str, Any]:
    """The JSON object `text` begins, cut off where it ends: its members and items written whole, the one
    cut off left out (`{"city": "Paris", "da` is `{"city": "Paris"}`), as the `anthropic` client reads a
    streamed `tool_use` block's deltas (jiter's partial mode); {} where `text` begins no JSON object."""
    closers: list[str] = []  # the brackets open at the end, innermost last
    last_end = (0, "")  # where a value or a bracket last ended outside a string, and the closers there
    in_string = escaped = False
    read = len(text)  # the text read: up to a bracket that closes none open, where JSON cannot go on
    for index, char in enumerate(text):
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
            continue
        if char == '"':
            in_string = True
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]":
            if not closers or closers[-1] != char:
                read = index
                break
            closers.pop()
        elif char != ",":
            continue
        last_end = (index + (char != ","), "".join(reversed(closers)))
    for end, closing in ((read, "".join(reversed(closers))), last_end):
        try:
            value = json.loads(text[:end] + closing)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return {}


def named_event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessagesEndpoints:
    def __init__(self, api: Endpoints) -> None:
        self.api = api

    async def messages(self, request: Request) -> Response:
        try:
            body = await parse_body(request, MessagesRequest)
            model = self.api.served.name
            chat = await self.api.off_loop(body.chat_request)  # each tool's schema checked: milliseconds

            def shapes(jobs: list[Job]) -> list[MessageShapes]:
                return [MessageShapes(jobs[0], model, body.max_tokens)]

            return await self.api.answer_chat(request, chat, shapes)
        except APIError as error:
            raise AnthropicError.of(error) from None

    async def count_tokens(self, request: Request) -> dict[str, int]:
        """The prompt's tokens as `/v1/messages` would prefill them."""
        try:
            chat = await self.api.off_loop((await parse_body(request, CountTokensRequest)).chat_request)
            await self.api.check_request(chat)
            prompt = await self.api.off_loop(self.api.served.prepare_chat, chat)
        except APIError as error:
            raise AnthropicError.of(error) from None
        return {"input_tokens": len(prompt.tokens)}


def messages_router(api: Endpoints) -> APIRouter:
    endpoints = MessagesEndpoints(api)
    router = APIRouter()
    router.post("/v1/messages")(endpoints.messages)
    router.post("/v1/messages/count_tokens")(endpoints.count_tokens)
    return router


def _compact(arguments: dict[str, Any]) -> str:
    """A tool call's input as the arguments text of the chat template (compact JSON, as llama-server
    writes it)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
