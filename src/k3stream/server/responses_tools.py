"""The tools of a `/v1/responses` request as the chat request takes them: function tools as they are,
custom tools (freeform text input, optionally held to a Lark or regex grammar) as functions whose call
arguments are that text, the function and custom tools of a namespace as they are (the namespace named in
their descriptions and on their calls), and hosted tools, which this server cannot run, left out with a
warning in the log. docs/server-endpoints.md describes the choices."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from k3stream.server.errors import invalid_request
from k3stream.server.grammar import MAX_GRAMMAR_CHARS, freeform_input
from k3stream.server.schemas import (
    FreeformInput,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Tool,
    object_tool,
)

log = logging.getLogger(__name__)

# tools OpenAI runs on its side (and `local_shell`, whose call items need an action this server would have
# to invent a schema for): left out of what the model sees
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",
        "tool_search",
        "local_shell",
    }
)
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FREEFORM_NOTE = "This is a FREEFORM tool: the call's arguments are its input text as it is, not JSON."


class CustomFormat(BaseModel):
    """A custom tool's input format: any text, or text a grammar accepts."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class ToolDefinition(BaseModel):
    """One entry of `tools`: a `function`, a `custom` tool, or a hosted tool (by its type alone)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # function
    strict: bool | None = None  # function
    format: CustomFormat | None = None  # custom
    tools: list[ToolDefinition] | None = None  # namespace: its function and custom tools

    def echoed(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def members(self, where: str) -> list[tuple[str, ToolDefinition, str | None]]:
        """The tools this entry holds, each with its path and its namespace: itself, or a namespace's."""
        if self.type != "namespace":
            return [(where, self, None)]
        name = _checked_name(self.name, where)
        if self.tools is None:
            raise invalid_request(f"{where}.tools: a namespace needs its tools", param=f"{where}.tools")
        members = []
        for number, member in enumerate(self.tools):
            at = f"{where}.tools.{number}"
            if member.type not in ("function", "custom"):
                message = f"{at}.type: a namespace holds function and custom tools, not {member.type!r}"
                raise invalid_request(message, param=f"{at}.type", code="unsupported_value")
            note = f"(Namespace {name}: {self.description})" if self.description else f"(Namespace {name})"
            described = "\n\n".join(filter(None, [member.description, note]))
            members.append((at, member.model_copy(update={"description": described}), name))
        return members


class NamedChoice(BaseModel):
    """`tool_choice` naming a tool: `{"type": "function" | "custom", "name": N}`, or a hosted tool's type."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    name: str | None = None


@dataclass
class ChatTools:
    """A request's tools converted: those the template declares, the freeform ones by name, and the
    hosted ones left out (by type)."""

    tools: list[Tool] = field(default_factory=list)
    freeform: dict[str, FreeformInput] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # each of `tools`' path in the request (`tools.I`)
    namespaces: dict[str, str] = field(default_factory=dict)  # the namespace of each tool in one

    def kind_of(self, name: str) -> str | None:
        """`custom` or `function` for a tool the model sees, else None."""
        if name in self.freeform:
            return "custom"
        return "function" if any(tool.function.name == name for tool in self.tools) else None


def chat_tools(definitions: list[ToolDefinition]) -> ChatTools:
    """The chat request's tools for `definitions`; a bad one is a 400 naming its field."""
    converted = ChatTools()
    grammar_chars = 0
    for index, entry in enumerate(definitions):
        if entry.type in HOSTED_TOOLS:
            converted.dropped.append(entry.type)
            continue
        if entry.type not in ("function", "custom", "namespace"):
            taken = "function, custom and namespace tools (hosted ones are left out)"
            message = f"tools.{index}.type: {entry.type!r} tools are not supported; this server takes {taken}"
            raise invalid_request(message, param=f"tools.{index}.type", code="unsupported_value")
        for where, definition, namespace in entry.members(f"tools.{index}"):
            name = _checked_name(definition.name, where)
            if definition.type == "function":
                parameters = f"{where}.parameters"
                tool = object_tool(name, definition.description, definition.parameters, parameters)
            else:
                grammar = f"{where}.format.definition"
                grammar_chars += _grammar_chars(definition.format, grammar_chars, grammar)
                converted.freeform[name] = _freeform_input(definition.format, f"{where}.format")
                tool = _freeform_tool(name, definition.description, definition.format)
            converted.tools.append(tool)
            converted.sources.append(where)
            if namespace is not None:
                converted.namespaces[name] = namespace
    if converted.dropped:
        log.warning(
            "/v1/responses: hosted tools left out of the prompt (this server does not run them): %s",
            ", ".join(converted.dropped),
        )
    return converted


def _checked_name(name: str | None, where: str) -> str:
    if name is None:
        raise invalid_request(f"{where}.name: the tool needs a name", param=f"{where}.name")
    if not NAME_RE.fullmatch(name):
        message = f"{where}.name: 1 to 64 letters, digits, '_' or '-', not {name!r}"
        raise invalid_request(message, param=f"{where}.name", code="invalid_value")
    return name


def _grammar_chars(text_format: CustomFormat | None, before: int, param: str) -> int:
    """The characters of a custom tool's grammar; a 400 naming `param` where those of the request's
    grammars (`before` this one's) pass MAX_GRAMMAR_CHARS."""
    chars = len(text_format.definition or "") if text_format is not None else 0
    if before + chars > MAX_GRAMMAR_CHARS:
        message = (
            f"{param}: the custom tools' grammars of a request hold at most {MAX_GRAMMAR_CHARS} characters"
        )
        raise invalid_request(message, param=param)
    return chars


def _freeform_input(text_format: CustomFormat | None, where: str) -> FreeformInput:
    if text_format is None or text_format.type == "text":
        return FreeformInput()
    for name in ("syntax", "definition"):
        if getattr(text_format, name) is None:
            message = f"{where}.{name}: a grammar format needs it"
            raise invalid_request(message, param=f"{where}.{name}")
    return freeform_input(text_format.syntax, text_format.definition, f"{where}.definition")


def _freeform_tool(name: str, description: str | None, text_format: CustomFormat | None) -> Tool:
    """A custom tool as the template declares it: a function without parameters, its description saying
    that the input is freeform text (and the grammar it follows, unless the description holds it)."""
    notes = [description, FREEFORM_NOTE]
    definition = text_format.definition if text_format is not None else None
    if definition and definition not in (description or ""):
        notes.append(f"Its input follows this {text_format.syntax} grammar:\n{text_format.definition}")
    function = FunctionDefinition(name=name, description="\n\n".join(filter(None, notes)))
    return Tool(type="function", function=function)


def chat_tool_choice(choice: str | NamedChoice | None, tools: ChatTools) -> str | NamedToolChoice | None:
    """The chat request's `tool_choice`; naming a hosted tool, or a tool of another type than named, is
    a 400."""
    if not isinstance(choice, NamedChoice):
        return choice
    if choice.type in HOSTED_TOOLS:
        message = f"tool_choice: {choice.type!r} is a hosted tool, which this server does not run"
        raise invalid_request(message, param="tool_choice", code="unsupported_value")
    if choice.type not in ("function", "custom"):
        message = f"tool_choice: {choice.type!r} is not supported; name a function or custom tool"
        raise invalid_request(message, param="tool_choice", code="unsupported_value")
    if choice.name is None:
        raise invalid_request("tool_choice.name: the tool to call is needed", param="tool_choice.name")
    if tools.kind_of(choice.name) != choice.type:
        message = f"tool_choice: the {choice.type} tool {choice.name!r} is not in tools"
        raise invalid_request(message, param="tool_choice")
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
