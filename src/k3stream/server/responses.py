"""OpenAI's Responses API: `POST /v1/responses`, for agents that speak it (Codex CLI, the `openai-agents`
SDK's `OpenAIResponsesModel`, the `openai` client's `client.responses`).

A request is converted into the chat request of `/v1/chat/completions` (`ResponsesRequest.chat_request`)
and answered on the same path (template, tools, grammar, scheduler, prompt cache); `ResponseShapes`
writes the result as a response object, or as its event stream: `response.created` and
`response.in_progress`, then per output item (`reasoning`, `message`, `function_call`, `custom_tool_call`)
`response.output_item.added`, its content part, its deltas and their `.done`, `response.output_item.done`,
then `response.completed` or `response.incomplete`. Tools are converted by `responses_tools` (custom
tools: freeform text). The server is stateless: nothing is stored, and the fields that name stored state
(`previous_response_id`, `conversation`, `prompt`) are refused. docs/server-endpoints.md describes the
fields.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from k3stream.server.bodies import parse_body
from k3stream.server.errors import APIError, invalid_request
from k3stream.server.kimi_output import Piece, ToolCall, in_order
from k3stream.server.messages import named_event
from k3stream.server.responses_tools import (
    ChatTools,
    NamedChoice,
    ToolDefinition,
    chat_tool_choice,
    chat_tools,
)
from k3stream.server.scheduler import Job
from k3stream.server.schemas import (
    AgentChatRequest,
    AssistantToolCall,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    MaxTokens,
    ResponseFormat,
    Switch,
    Temperature,
    TemplateValue,
    TopK,
    TopP,
    check_json_schema,
    joined_text_parts,
)

if TYPE_CHECKING:
    from k3stream.server.app import Endpoints

log = logging.getLogger(__name__)

# the content part types each input item takes
MESSAGE_PARTS = ("input_text", "output_text")
REASONING_PARTS = ("reasoning_text", "text")
# fields of each input item type, that it needs
ITEM_FIELDS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "custom_tool_call": ("call_id", "name", "input"),
    "custom_tool_call_output": ("call_id", "output"),
    "local_shell_call": ("call_id", "action"),
    "local_shell_call_output": ("id", "output"),
    "reasoning": (),
}
# the items an assistant turn's calls come as; a local shell call is a call of LOCAL_SHELL, its arguments
# the action it ran
CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
LOCAL_SHELL = "local_shell"
# items of the tools OpenAI runs on its side (`responses_tools.HOSTED_TOOLS`), which the model never sees
# here: left out of the prompt, with a warning in the log
HOSTED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "computer_call",
        "computer_call_output",
        "mcp_list_tools",
        "mcp_call",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
    }
)
# content parts of inputs this text-only model does not take: why
UNREAD_PARTS = {
    "input_image": "this model has no image input",
    "input_file": "this model reads no files",
    "input_audio": "this model has no audio input",
}
# fields asking for what a stateless server without hosted features does not have: (whether the value
# asks for nothing, why it is refused)
REFUSED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (
        lambda value: value is None,
        "this server stores no responses; send the whole conversation as `input`",
    ),
    "conversation": (
        lambda value: value is None,
        "this server stores no conversations; send the whole conversation as `input`",
    ),
    "prompt": (lambda value: value is None, "stored prompt templates are not served"),
    "background": (lambda value: not value, "background responses are not served"),
    "truncation": (
        lambda value: value in (None, "disabled"),
        "the input is never truncated (a prompt past the context is a 400)",
    ),
    "top_logprobs": (lambda value: not value, "logprobs are served by /v1/chat/completions only"),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# each call item's text field and the name of the events that stream it
CALL_TEXT = {
    "function_call": ("arguments", "function_call_arguments"),
    "custom_tool_call": ("input", "custom_tool_call_input"),
}


class InputPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None

    def checked_text(self, where: str, allowed: tuple[str, ...]) -> str:
        if self.type not in allowed:
            taken = ", ".join(allowed)
            why = UNREAD_PARTS.get(self.type, "they are not supported here")
            message = f"{where}.type: {self.type!r} parts are not taken: {why}; this server takes {taken}"
            raise invalid_request(message, param=f"{where}.type", code="unsupported_value")
        if self.text is None:
            raise invalid_request(f"{where}.text: a {self.type} part needs its text", param=f"{where}.text")
        return self.text


def parts_text(content: str | list[InputPart], where: str, allowed: tuple[str, ...] = MESSAGE_PARTS) -> str:
    """A content's text: a string, or its text parts joined (a 400 naming the first of another type)."""
    if isinstance(content, str):
        return content
    return "".join(parts_texts(content, where, allowed))


def parts_texts(content: list[InputPart], where: str, allowed: tuple[str, ...] = MESSAGE_PARTS) -> list[str]:
    return [part.checked_text(f"{where}.{number}", allowed) for number, part in enumerate(content)]


class InputItem(BaseModel):
    """One item of `input`; an item without `type` is a message (OpenAI's easy input message)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str = "message"
    id: str | None = None  # local_shell_call_output: its call's
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None  # message, reasoning
    call_id: str | None = None  # the calls and their outputs
    name: str | None = None  # function_call, custom_tool_call
    arguments: str | None = None  # function_call
    input: str | None = None  # custom_tool_call
    action: dict[str, Any] | None = None  # local_shell_call
    output: str | list[InputPart] | None = None  # the outputs

    def check(self, where: str) -> None:
        if self.type not in ITEM_FIELDS:
            taken = ", ".join(ITEM_FIELDS)
            message = (
                f"{where}.type: {self.type!r} items are not supported; this server takes {taken} "
                "(and leaves hosted tools' items out)"
            )
            raise invalid_request(message, param=f"{where}.type", code="unsupported_value")
        missing = next((name for name in ITEM_FIELDS[self.type] if getattr(self, name) is None), None)
        if missing is not None:
            raise invalid_request(
                f"{where}.{missing}: a {self.type} item needs it", param=f"{where}.{missing}"
            )

    def chat_paths(self, where: str, message: str, call: int) -> dict[str, str]:
        """The request's own path (under `where`) of each field of chat message `message` that this item,
        no reasoning item, gives; a call item's call is the message's `call`th (0: it may begin it)."""
        if self.type in CALL_ITEMS:
            called = f"{message}.tool_calls.{call}"
            text = {"function_call": "arguments", "custom_tool_call": "input"}.get(self.type, "action")
            fields = {"": "", ".id": ".call_id", ".function.name": ".name", ".function.arguments": f".{text}"}
            return {message: where} | {called + chat: where + own for chat, own in fields.items()}
        content = "output" if self.type in OUTPUT_ITEMS else "content"
        paths = {message: where, f"{message}.content": f"{where}.{content}"}
        called = "call_id" if self.call_id else "id" if self.type == "local_shell_call_output" else None
        return paths | ({f"{message}.tool_call_id": f"{where}.{called}"} if called else {})

    def chat_message(self, where: str, call_ids: dict[str, str]) -> ChatMessage:
        """The item as a chat message (a reasoning item has none: `reasoning_text`); a custom tool's call
        is a call whose arguments are its input text, a local shell call one of LOCAL_SHELL whose
        arguments are its action; a local shell call's output answers the call whose `id` or `call_id`
        its `id` is (`call_ids`)."""
        if self.type in CALL_ITEMS:
            function = CalledFunction(name=self.name or LOCAL_SHELL, arguments=self._call_text())
            call = AssistantToolCall(id=self.call_id, function=function)
            return ChatMessage(role="assistant", tool_calls=[call])
        if self.type in OUTPUT_ITEMS:
            text = parts_text(self.output, f"{where}.output")
            shell = self.type == "local_shell_call_output"
            called = call_ids.get(self.id, self.id) if shell else self.call_id
            return ChatMessage(role="tool", content=text, tool_call_id=called)
        if isinstance(self.content, str):
            return ChatMessage(role=self.role, content=self.content)
        # a message's text parts reach the template as llama-server gives them (chat's content parts)
        return ChatMessage(
            role=self.role, content=joined_text_parts(parts_texts(self.content, f"{where}.content"))
        )

    def _call_text(self) -> str:
        if self.type == "function_call":
            return self.arguments
        if self.type == "custom_tool_call":
            return self.input
        return json.dumps(self.action, ensure_ascii=False, separators=(",", ":"))

    def reasoning_text(self, where: str) -> str:
        return parts_text(self.content or [], f"{where}.content", REASONING_PARTS)


def chat_messages(items: list[InputItem], first: int = 0) -> tuple[list[ChatMessage], dict[str, str]]:
    """The chat messages of `items`, in their order: a call joins the assistant message before
    it (the Responses API splits one assistant turn into a message and its calls); a reasoning item's text
    is the next assistant turn's `reasoning_content`. With them, the request's own path of each of their
    fields (`messages.N...`, the messages numbered from `first`) that an item gives."""
    messages: list[ChatMessage] = []
    paths: dict[str, str] = {}
    reasoning, reasoning_item = "", ""  # the reasoning for the next assistant turn, its first item
    call_ids: dict[str, str] = {}  # each local shell call's `id` and `call_id`: its `call_id`
    hosted: list[str] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if item.type in HOSTED_ITEMS:
            hosted.append(f"{item.type} ({where})")
            continue
        item.check(where)
        if item.type == "reasoning":
            reasoning += item.reasoning_text(where)
            reasoning_item = reasoning_item or where
            continue
        if item.type == "local_shell_call":
            call_ids |= {item.call_id: item.call_id} | ({item.id: item.call_id} if item.id else {})
        message = item.chat_message(where, call_ids)
        last = messages[-1] if messages else None
        joins = item.type in CALL_ITEMS and last is not None and last.role == "assistant"
        number = first + len(messages) - joins
        if message.role == "assistant":
            message.reasoning_content, reasoning = reasoning or None, ""
            if reasoning_item:
                paths.setdefault(f"messages.{number}.reasoning_content", f"{reasoning_item}.content")
            reasoning_item = ""
        calls = len(last.tool_calls or []) if joins else 0
        paths = item.chat_paths(where, f"messages.{number}", calls) | paths  # the first item's path holds
        if joins:
            last.tool_calls = [*(last.tool_calls or []), *message.tool_calls]
            last.reasoning_content = last.reasoning_content or message.reasoning_content
        else:
            messages.append(message)
    if hosted:
        log.warning(
            "/v1/responses: hosted tools' items left out of the prompt (this server does not run them): %s",
            ", ".join(hosted),
        )
    return messages, paths


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> ResponseFormat:
        """The chat request's `response_format`; a json_schema format needs a valid schema."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        if self.json_schema is None:
            message = "text.format.schema: a json_schema format needs a schema"
            raise invalid_request(message, param="text.format.schema")
        check_json_schema(self.json_schema, "text.format.schema")
        fields = {"name": self.name, "description": self.description, "strict": self.strict}
        return ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(**fields, schema=self.json_schema)
        )


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(BaseModel):
    """`/v1/responses`' body."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None  # any name: the served model answers, as in llama-server
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # llama-server's and vLLM's
    ignore_eos: Switch = False  # vLLM's, as on chat: generate to the limit past end-of-sequence
    stream: Switch = False
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None  # an effort turns thinking on or off; no levels
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # taken; nothing is stored
    include: list[str] | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None  # llama-server's
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    # the request's own path of each chat request field that `chat_request` converted (`name_own_fields`)
    _chat_paths: dict[str, str] = PrivateAttr(default_factory=dict)
    _tools: ChatTools = PrivateAttr(default_factory=ChatTools)  # as `chat_request` converted them

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one asks for."""
        self._check_served()
        tools = self._tools = chat_tools(self.tools or [])
        self._chat_paths = _tool_paths(tools)
        text_format = self.text.format if self.text is not None else None
        return AgentChatRequest(
            messages=self._messages(),
            tools=tools.tools or None,
            freeform=tools.freeform,
            tool_choice=chat_tool_choice(self.tool_choice, tools),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=None if text_format is None else text_format.response_format(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            ignore_eos=self.ignore_eos,
            stream=self.stream,
            chat_template_kwargs=self._template_variables(),
        )

    def _check_served(self) -> None:
        for name, (neutral, why) in REFUSED_FIELDS.items():
            if not neutral(getattr(self, name)):
                raise invalid_request(f"{name}: {why}", param=name, code="unsupported_parameter")
        if LOGPROBS_INCLUDE in (self.include or []):
            message = f"include: {LOGPROBS_INCLUDE!r}: logprobs are served by /v1/chat/completions only"
            raise invalid_request(message, param="include", code="unsupported_value")

    def _messages(self) -> list[ChatMessage]:
        system = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        if system:
            self._chat_paths |= {"messages.0": "instructions", "messages.0.content": "instructions"}
        if isinstance(self.input, str):
            given = f"messages.{len(system)}"
            self._chat_paths |= {given: "input", f"{given}.content": "input"}
            return [*system, ChatMessage(role="user", content=self.input)]
        if not self.input:
            raise invalid_request("input: needs at least one item", param="input")
        messages, paths = chat_messages(self.input, len(system))
        if not messages:  # a reasoning item is the next assistant turn's, and there is none
            raise invalid_request("input: needs an item that is not reasoning", param="input")
        self._chat_paths |= paths
        return [*system, *messages]

    def name_own_fields(self, error: APIError) -> None:
        """`error` of the chat request (`chat_request`) naming this request's own field where the
        conversion gives one: `messages.3.content` as `input.2.content`, `tools.1.function.parameters` as
        `tools.2.parameters` (hosted tools are left out of the chat request's)."""
        if error.param == "messages":  # the chat request's whole prompt (past the context) is `input`
            error.param = "input"
        if error.param is None:
            return
        own = _own_path(error.param, self._chat_paths)
        if own is not None:
            error.message = error.message.replace(error.param, own, 1)
            error.param = own

    def _template_variables(self) -> dict[str, TemplateValue] | None:
        """`chat_template_kwargs`, with `thinking` (Kimi's templates open the think block with it) from
        `reasoning.effort` unless given there: on for any effort but `none` (Kimi's thinking has no
        levels)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return self.chat_template_kwargs
        return {"thinking": effort != "none", **(self.chat_template_kwargs or {})}

    def custom_tool_names(self) -> frozenset[str]:
        return frozenset(self._tools.freeform)

    def namespace_of(self, name: str) -> str | None:
        """The namespace of the tool `name` where one holds it."""
        return self._tools.namespaces.get(name)

    def echoed(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        text_format = (
            self.text.format if self.text is not None and self.text.format else TextFormat(type="text")
        )
        choice = self.tool_choice
        if isinstance(choice, NamedChoice):
            choice = choice.model_dump(exclude_none=True)
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None if self.reasoning is None else self.reasoning.model_dump(),
            "store": False,  # nothing is stored
            "temperature": self.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice or "auto",
            "tools": [tool.echoed() for tool in self.tools or []],
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }


class StreamedError(APIError):
    """An error of a response: OpenAI's error object, or, in a stream that started, an `error` event."""

    sequence_number = 0

    def sse(self) -> str:
        fields = {"code": self.code or self.type, "message": self.message, "param": self.param}
        return named_event({"type": "error", **fields, "sequence_number": self.sequence_number})


def _tool_paths(tools: ChatTools) -> dict[str, str]:
    """The request's own path of each chat tool's fields that its definition gives."""
    paths = {}
    for chat, (where, tool) in enumerate(zip(tools.sources, tools.tools, strict=True)):
        at = f"tools.{chat}"
        paths |= {at: where, f"{at}.function": where, f"{at}.function.name": f"{where}.name"}
        if tool.function.name not in tools.freeform:
            fields = ("description", "parameters")
            paths |= {f"{at}.function.{name}": f"{where}.{name}" for name in fields}
    return paths


def _own_path(param: str, paths: dict[str, str]) -> str | None:
    """`param`'s path in the request where `paths` names its longest known prefix, else None."""
    keys = param.split(".")
    for end in range(len(keys), 0, -1):
        own = paths.get(".".join(keys[:end]))
        if own is not None:
            return ".".join([own, *keys[end:]])
    return None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_item(kind: str) -> dict[str, Any]:
    """An open output item holding text: `reasoning` or an assistant `message`."""
    if kind == "reasoning":
        return {
            "id": _new_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
    return {
        "id": _new_id("msg"),
        "type": "message",
        "role": "assistant",
        "content": [],
        "status": "in_progress",
    }


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, custom: bool, namespace: str | None) -> dict[str, Any]:
    """An open call item: a `function_call`, or a `custom_tool_call` whose `input` is the call's text;
    a call of a namespace's tool names it."""
    fields = {"call_id": call.id, "name": call.name, "status": "in_progress"}
    if namespace is not None:
        fields["namespace"] = namespace
    if custom:
        return {"id": _new_id("ctc"), "type": "custom_tool_call", **fields, "input": ""}
    return {"id": _new_id("fc"), "type": "function_call", **fields, "arguments": ""}


class ResponseShapes:
    """The Responses API shapes of one answer (`streaming.Stream` sends them): its events as it streams,
    framed here (`event:` and `data:` lines), or the whole response object. Both build the output items
    the same way (the whole answer is taken run by run, in the order the stream sends them)."""

    done_line = ""  # the stream ends with `response.completed` or `response.incomplete`
    index = 0  # the one choice

    def __init__(self, job: Job, request: ResponsesRequest, model: str) -> None:
        self.job = job
        self.request = request
        self.model = model
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self._sequence = itertools.count()
        self._items: list[dict[str, Any]] = []  # output items; the last one is open while `_open` names it
        self._open: str | None = None  # "reasoning", "message" or "call:N"
        self._custom = request.custom_tool_names()  # the tools whose calls are `custom_tool_call` items

    def first(self) -> str:
        response = self._response("in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def piece(self, piece: Piece) -> str:
        events = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for call in piece.tool_calls:
            if call.id:
                item = _call_item(call, call.name in self._custom, self.request.namespace_of(call.name))
                events += self._into(f"call:{call.index}", item)
            if call.arguments:
                item = self._items[-1]
                text, delta = CALL_TEXT[item["type"]]
                item[text] += call.arguments
                events.append(self._event(f"response.{delta}.delta", **self._at(), delta=call.arguments))
        return "".join(events)

    def last(self, reason: str) -> str:
        status = self._status(reason)
        events = self._close(status)
        return "".join(events) + self._event(f"response.{status}", response=self._response(status))

    def whole_choice(self, pieces: list[Piece], reason: str) -> dict[str, Any]:
        for run in in_order(pieces):
            self.piece(run)  # builds the output items as the stream does; its events are not sent
        status = self._status(reason)
        self._close(status)
        return self._response(status)

    def whole(
        self, choices: list[dict[str, Any]], usage: dict[str, Any], timings: dict[str, float]
    ) -> dict[str, Any]:
        del usage, timings  # the response's usage is the job's (`_usage`); it has no timings
        return choices[0]

    def error(self, error: APIError) -> StreamedError:
        streamed = StreamedError(
            error.status, error.message, type=error.type, param=error.param, code=error.code
        )
        streamed.sequence_number = next(self._sequence)
        return streamed

    @staticmethod
    def _status(reason: str) -> str:
        return "incomplete" if reason == "length" else "completed"

    def _response(self, status: str) -> dict[str, Any]:
        finished = status != "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": self._items if finished else [],
            **self.request.echoed(),
            "usage": self._usage() if finished else None,
        }

    def _usage(self) -> dict[str, Any]:
        """The prompt's tokens (of which `cached_tokens` were restored from the prompt cache) and the
        answer's (of which `reasoning_tokens` the model generated inside its think block)."""
        prompt, output = len(self.job.prompt_tokens), self.job.logic.completion_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.job.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self.job.logic.reasoning_tokens},
            "total_tokens": prompt + output,
        }

    def _event(self, kind: str, **fields: Any) -> str:
        return named_event({"type": kind, "sequence_number": next(self._sequence), **fields})

    def _at(self) -> dict[str, Any]:
        """Where the open item is: its id and index."""
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _text(self, kind: str, text: str) -> list[str]:
        """Events adding `text` to the open `kind` item (opened here, with its content part, if need be)."""
        events = []
        if self._open != kind:
            events += self._into(kind, _text_item(kind))
            self._items[-1]["content"].append(_part(kind, ""))
            events.append(
                self._event(
                    "response.content_part.added", **self._at(), content_index=0, part=_part(kind, "")
                )
            )
        self._items[-1]["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        logprobs = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, **self._at(), content_index=0, delta=text, **logprobs))
        return events

    def _into(self, kind: str, item: dict[str, Any]) -> list[str]:
        """Events that make `item` (of `kind`) the open item: the open one's closing and the new one's
        `output_item.added`."""
        events = self._close("completed")
        self._items.append(item)
        self._open = kind
        events.append(self._event("response.output_item.added", output_index=len(self._items) - 1, item=item))
        return events

    def _close(self, status: str) -> list[str]:
        """Events that close the open item, which ends with `status` (an unfinished call, `incomplete`)."""
        if self._open is None:
            return []
        item, at, events = self._items[-1], self._at(), []
        if item["type"] in CALL_TEXT:
            text, delta = CALL_TEXT[item["type"]]
            events.append(self._event(f"response.{delta}.done", **at, **{text: item[text]}))
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            logprobs = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(
                self._event(f"response.{kind}.done", **at, content_index=0, text=part["text"], **logprobs)
            )
            events.append(self._event("response.content_part.done", **at, content_index=0, part=part))
        unfinished = self._open.startswith("call:") and self.job.logic.unfinished(int(self._open[5:]))
        item["status"] = "incomplete" if unfinished else status
        self._open = None
        events.append(self._event("response.output_item.done", output_index=at["output_index"], item=item))
        return events


class ResponsesEndpoints:
    def __init__(self, api: Endpoints) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        chat = await self.api.off_loop(body.chat_request)  # checks each grammar and schema: milliseconds each
        model = self.api.served.name

        def shapes(jobs: list[Job]) -> list[ResponseShapes]:
            return [ResponseShapes(jobs[0], body, model)]

        try:
            return await self.api.answer_chat(request, chat, shapes)
        except APIError as error:
            body.name_own_fields(error)
            raise

    async def input_tokens(self, request: Request) -> dict[str, Any]:
        """OpenAI's input token count (`client.responses.input_tokens.count`): the prompt tokens the same
        request to `/v1/responses` would prefill."""
        body = await parse_body(request, ResponsesRequest)
        chat = await self.api.off_loop(body.chat_request)
        try:
            return await self.api.input_tokens(chat)
        except APIError as error:
            body.name_own_fields(error)
            raise


def responses_router(api: Endpoints) -> APIRouter:
    router = APIRouter()
    endpoints = ResponsesEndpoints(api)
    router.post("/v1/responses")(endpoints.create)
    router.post("/v1/responses/input_tokens")(endpoints.input_tokens)
    return router
