"""Request bodies of the OpenAI API subset k3stream serves, validated strictly (no type coercion).

Unknown fields are ignored (clients send many optional ones); known fields of the wrong type or out of
range are refused with a 400 naming the field. OpenAI fields this server does not implement (tools,
response_format, logit_bias, penalties...) are refused with a 400 naming the field unless they hold their
neutral value (absent, null, empty, zero, `{"type": "text"}`), so no request is silently answered as if
they had been honoured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from k3stream.server.errors import invalid_request

# Larger values are refused by the context check anyway; this bound keeps absurd numbers out early.
MAX_TOKENS_LIMIT = 1 << 20

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)]


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


# OpenAI request fields that are not implemented, and the values that ask for nothing
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "tools": _empty,
    "functions": _empty,
    "tool_choice": lambda value: value in (None, "none", "auto"),
    "function_call": lambda value: value in (None, "none", "auto"),
    "response_format": lambda value: value is None or value == {"type": "text"},
    "logit_bias": _empty,
    "top_logprobs": lambda value: value in (None, 0),
    "presence_penalty": lambda value: value in (None, 0),
    "frequency_penalty": lambda value: value in (None, 0),
    "best_of": lambda value: value in (None, 1),
    "suffix": _empty,
    "audio": _empty,
    "modalities": lambda value: value in (None, ["text"]),
    "prediction": _empty,
    "guided_json": _empty,
    "guided_regex": _empty,
    "guided_choice": _empty,
    "guided_grammar": _empty,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="allow")

    # optional as in vLLM and llama.cpp's server: absent means the served model
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSUPPORTED_FIELDS.get(name)
            if neutral is not None and not neutral(value):
                raise invalid_request(
                    f"{name} is not supported by this server", param=name, code="unsupported_parameter"
                )
        if self.n != 1:
            raise invalid_request("only n=1 is supported", param="n", code="unsupported_value")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise invalid_request("stop: at most 4 sequences", param="stop")
        if any(s == "" for s in self.stop_list()):
            raise invalid_request("stop: sequences must not be empty", param="stop")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise invalid_request("echo is not supported", param="echo", code="unsupported_value")
        if self.logprobs is not None:
            raise invalid_request("logprobs is not supported", param="logprobs", code="unsupported_value")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; a batch of several is refused like n>1."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise invalid_request(
                    "only one prompt per request is supported", param="prompt", code="unsupported_value"
                )
            prompt = prompt[0]
        if len(prompt) == 0:
            raise invalid_request("prompt must not be empty", param="prompt")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise invalid_request("logprobs is not supported", param="logprobs", code="unsupported_value")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
