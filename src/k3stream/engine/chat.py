"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered with sandboxed jinja2.

When a file carries no template we use a built-in one in Kimi-K3's XTML style
(`<|open|>message role="user"<|sep|>...<|close|>message<|sep|><|end_of_msg|>`), answering in the
response channel; pass `thinking=True` to open the think channel instead (an assistant message's
`reasoning_content` goes in its think channel, `<|open|>think<|sep|>...<|close|>think<|sep|>`, before its
response). With `tools=[...]` it declares
them in a system message (`<|open|>tools<|sep|>JSON<|close|>tools<|sep|>`), writes an assistant's
`tool_calls` as Kimi's tool-call section inside its response, and a `tool` message as
`## Return of ID` then its content (Kimi-K2's shape; a file's own template always wins). A file with a
named template `tool_use` (`tokenizer.chat_template.tool_use`) renders requests with tools with it, as
llama-server does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k3stream.engine.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# a rendered prompt past this many characters is refused (a full 256K-token context is a few MB of text):
# a file's template may repeat a string or loop without end, and must not take the memory with it
MAX_RENDERED_CHARS = 1 << 24
# a render stops after this many steps of its loops, all together (about a second): a file's template may
# nest loops over ranges or over the request's text without end; a chat template steps a few times a
# message, tool and content part
MAX_LOOP_STEPS = 1 << 20
LOOP_STEPS = "__k3stream_loop_steps"  # the render's variable every `for` loop's iterable goes through

BUILTIN_KIMI_K3_TEMPLATE = (
    '{%- macro open(tag, role=none) -%}<|open|>{{ tag }}{% if role %} role="{{ role }}"{% endif %}'
    "<|sep|>{%- endmacro -%}"
    "{%- macro close(tag) -%}<|close|>{{ tag }}<|sep|>{%- endmacro -%}"
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ open('message', 'system') }}{{ open('tools') }}{{ tools | tojson }}{{ close('tools') }}"
    "{{ close('message') }}<|end_of_msg|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ open('message', message.role) }}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if message.reasoning_content -%}"
    "{{ open('think') }}{{ message.reasoning_content }}{{ close('think') }}"
    "{%- endif -%}"
    "{{ open('response') }}{{ text(message.content) }}"
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
    "{{ call.function.arguments }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{{ close('response') }}"
    "{%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}\n{{ text(message.content) }}"
    "{%- else -%}{{ text(message.content) }}{%- endif -%}"
    "{{ close('message') }}<|end_of_msg|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ open('message', 'assistant') }}{{ open('think' if thinking else 'response') }}"
    "{%- endif -%}"
)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _repeated_length(left: Any, right: Any) -> int:
    """The length `left * right` would have where it repeats a string or a list, else 0."""
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, str | list | tuple) and isinstance(count, int):
            return len(sequence) * count
    return 0


class _LoopSteps:
    """One render's budget of loop steps: each `for` loop's iterable, counted as it is stepped."""

    def __init__(self) -> None:
        self.left = MAX_LOOP_STEPS

    def __call__(self, iterable: Any) -> Any:
        from jinja2.exceptions import SecurityError

        for item in iterable:
            self.left -= 1
            if self.left < 0:
                raise SecurityError(f"its loops pass {MAX_LOOP_STEPS} steps")
            yield item


@cache
def _environment():
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with `*` unable to repeat a string or list past MAX_RENDERED_CHARS and loops
        held to MAX_LOOP_STEPS a render."""

        intercepted_binops = frozenset({"*"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*" and _repeated_length(left, right) > MAX_RENDERED_CHARS:
                raise SecurityError(f"a repetition longer than {MAX_RENDERED_CHARS} items")
            return super().call_binop(context, operator, left, right)

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            """The template's syntax tree with every `for` loop's iterable passed through LOOP_STEPS."""
            from jinja2 import nodes

            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(nodes.For)):
                steps = nodes.Name(LOOP_STEPS, "load", lineno=loop.lineno)
                loop.iter = nodes.Call(steps, [loop.iter], [], None, None, lineno=loop.lineno)
            return tree

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    checked = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise ValueError(f"chat message {index}: role must be one of {', '.join(ROLES)}, got {role!r}")
        checked.append(dict(message))
    return checked


class ChatTemplate:
    """A compiled chat template; `source` names where it came from in error messages. `tool_use`: the
    template a render with tools uses instead (the file's named template `tool_use`). `bos_added`: the
    tokenizer puts BOS before the prompt, so a render that begins with `bos_token` loses it, as
    llama.cpp's chat templates drop it (one BOS, not two)."""

    def __init__(
        self,
        template: str,
        *,
        source: str = "chat template",
        bos_token: str = "",
        eos_token: str = "",
        tool_use: ChatTemplate | None = None,
        bos_added: bool = False,
    ):
        from jinja2 import TemplateError

        self.template_text = template
        self.source = source
        self.tool_use = tool_use
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        self._dropped_prefix = bos_token if bos_added else ""
        try:
            self._template = _environment().from_string(template)
        except TemplateError as exc:
            raise ValueError(f"{source}: cannot compile the chat template: {exc}") from None

    @classmethod
    def for_tokenizer(cls, tokenizer, override: Path | None = None) -> ChatTemplate:
        """The file's templates as llama-server chooses them: `tokenizer.chat_template`, with
        `tokenizer.chat_template.tool_use` for requests with tools (for every request when the file has
        no default one); the built-in Kimi-K3 template when the file has neither. `override` (llama-server's
        `--chat-template-file`): that file's template for every request instead."""
        from k3stream.engine.tokenizer import TOOL_USE_TEMPLATE_KEY

        specials = {
            "bos_token": token_text(tokenizer, tokenizer.bos_id),
            "eos_token": token_text(tokenizer, tokenizer.eos_id),
            "bos_added": tokenizer.add_bos and tokenizer.bos_id is not None,
        }
        if override is not None:
            return cls(_template_file_text(override), source=str(override), **specials)
        tool_use = None
        if tokenizer.chat_template_tool_use:
            tool_source = f"{tokenizer.source}: {TOOL_USE_TEMPLATE_KEY}"
            tool_use = cls(tokenizer.chat_template_tool_use, source=tool_source, **specials)
        if tokenizer.chat_template:
            source = f"{tokenizer.source}: tokenizer.chat_template"
            return cls(tokenizer.chat_template, source=source, tool_use=tool_use, **specials)
        if tool_use is not None:
            return tool_use
        return cls(BUILTIN_KIMI_K3_TEMPLATE, source="built-in Kimi-K3 chat template", **specials)

    @property
    def is_builtin(self) -> bool:
        return self.template_text == BUILTIN_KIMI_K3_TEMPLATE

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for `messages` (dicts with `role` and `content`). Whatever the template does
        wrong (an error of any kind, a text past MAX_RENDERED_CHARS, loops past MAX_LOOP_STEPS) is a
        one-line ValueError. Where `tools` is a non-empty list and there is a `tool_use` template, that
        one renders them, as llama-server chooses."""
        if self.tool_use is not None and variables.get("tools"):
            return self.tool_use.render(messages, add_generation_prompt=add_generation_prompt, **variables)
        from io import StringIO

        from jinja2 import TemplateError

        text, size = StringIO(), 0
        try:
            for piece in self._template.generate(
                messages=_check_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **{**self._specials, **variables, LOOP_STEPS: _LoopSteps()},
            ):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise ValueError(f"{self.source}: cannot render: the prompt passes {size} characters")
                text.write(piece)
        except TemplateError as exc:
            raise ValueError(f"{self.source}: cannot render: {exc}") from None
        except (ArithmeticError, LookupError, TypeError, RecursionError, MemoryError) as exc:
            raise ValueError(f"{self.source}: cannot render: {type(exc).__name__}: {exc}") from None
        return text.getvalue().removeprefix(self._dropped_prefix)


def chat_stop_token_ids(tokenizer: Tokenizer, thinking: bool) -> tuple[int, ...]:
    """Kimi-K3 closes the response channel with `<|close|>` before `<|end_of_msg|>`: stop there."""
    if thinking or "<|close|>" not in tokenizer.special_tokens:
        return ()
    return (tokenizer.token_id("<|close|>"),)


def token_text(tokenizer, token_id: int | None) -> str:
    """A special token's text (empty where the file has none), as templates and llama-server's `/props`
    read `bos_token` and `eos_token`."""
    return "" if token_id is None else tokenizer.decode([token_id])


# a chat template file larger than this is no template (the largest real ones are tens of KiB)
MAX_TEMPLATE_FILE_BYTES = 1 << 20


def _template_file_text(path: Path) -> str:
    """The text of a chat template file, or a one-line error naming it."""
    size = path.stat().st_size  # a missing file: OSError naming it
    if size > MAX_TEMPLATE_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes is too large for a chat template (at most 1 MiB)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: a chat template must be UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
