"""Request bodies of the OpenAI API subset k3stream serves, validated strictly (no type coercion).

Unknown fields are ignored (clients send many optional ones); null is the default of `n` and of the
switches (`stream`, `logprobs`, `echo`, `stream_options.include_usage`, ...), as in OpenAI's API; known
fields of the wrong type or out of range are refused with a 400 naming the field. OpenAI fields this
server does not implement (legacy functions, best_of, audio...) are refused with a 400 naming the field
unless they hold their neutral value (absent, null, empty, zero), so no request is silently answered
as if they had been honoured. Tool definitions and JSON schemas must be valid JSON Schema (draft 2020-12).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr

from k3stream.server.errors import invalid_request


def null_is(default: Any) -> BeforeValidator:
    """A field's validator taking null for `default` (clients that serialize unset fields send null)."""
    return BeforeValidator(lambda value: default if value is None else value)


def _integral(value: Any) -> Any:
    """A float without a fraction as the integer it is (`"max_tokens": 2.0`, as JavaScript and float
    variables write it; llama-server and vLLM take it); any other value as it is, for the strict check
    (`2.5` stays a 400)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# an integer field's validator that takes integral floats
Integral = BeforeValidator(_integral)

# Larger values would be cut to the context anyway; this bound keeps absurd numbers out early.
MAX_TOKENS_LIMIT = 1 << 20

# any finite temperature from 0 up, as llama-server and vLLM take it (OpenAI's API stops at 2; a script
# that sends 2.5 to a local server means it)
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]  # OpenAI's range; 0 keeps the likeliest token
TopK = Annotated[int, Field(ge=-1), Integral]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT), Integral]
Seed = Annotated[int, Field(ge=-(1 << 63), lt=1 << 64), Integral]
TopLogprobs = Annotated[int, Field(ge=0, le=20), Integral]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's and vLLM's range (llama-server's native: any)
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]
# a logit bias: a number, or false (llama-server's: the token is never chosen)
BiasValue = Annotated[float, Field(ge=-100.0, le=100.0)] | Literal[False]
# llama-server's max_tokens: -1 generates up to the context
NPredict = Annotated[int, Field(ge=-1, le=MAX_TOKENS_LIMIT), Integral]
# seeds meaning "draw a fresh seed" (llama-server's default, LLAMA_DEFAULT_SEED as JSON sends it)
RANDOM_SEEDS = (-1, 0xFFFFFFFF)


def fixed_seed(seed: int | None) -> int | None:
    """The seed to draw with: None (a fresh one) for no seed or llama.cpp's -1 (4294967295 as well)."""
    return None if seed in RANDOM_SEEDS else seed


# characters a request's logit_bias texts may hold in all: each is tokenized while the request is checked
MAX_BIAS_TEXT = 4096
# choices per request: each is one more sequence in the batch, sharing the prompt's prefill
MAX_CHOICES = 16
# prompts per completion request (OpenAI's and llama-server's batches): each is one more request queued
MAX_PROMPTS = 16
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES), Integral, null_is(1)]
Switch = Annotated[bool, null_is(False)]  # a boolean that is off unless true
# stop strings per request: OpenAI allows 4, llama-server and vLLM any number (each is matched apart)
MAX_STOPS = 16
# JSON values (keywords, subschemas, enum members) one schema holds: llguidance compiles a schema in time
# that grows with them (about 0.4 ms an `anyOf` branch: 20,000 took 8 s of one core), and OpenAI's
# structured outputs take at most 5,000 properties and 1,000 enum values; a request's tools, compiled as
# one grammar, may hold four times as many in all (agents declare hundreds of small tools)
MAX_SCHEMA_VALUES = 1 << 14
MAX_TOOLS_SCHEMA_VALUES = 4 * MAX_SCHEMA_VALUES


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


# OpenAI request fields that are not implemented, and the values that ask for nothing
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "functions": _empty,
    "function_call": lambda value: value in (None, "none", "auto"),
    "best_of": lambda value: value in (None, 1),
    "suffix": _empty,
    "audio": _empty,
    "modalities": lambda value: value in (None, ["text"]),
    "prediction": _empty,
    "use_beam_search": lambda value: value in (None, False),
    "min_tokens": lambda value: value in (None, 0),
    # llama-server's samplers and fields beyond the ones served (repetition_penalty and min_p are)
    "repeat_penalty": lambda value: value in (None, 1, 1.0),
    "typical_p": lambda value: value in (None, 1, 1.0),
    "mirostat": lambda value: value in (None, 0),
    "dry_multiplier": lambda value: value in (None, 0, 0.0),
    "xtc_probability": lambda value: value in (None, 0, 0.0),
    "top_n_sigma": lambda value: value is None or (isinstance(value, int | float) and value <= 0),
    "n_probs": lambda value: value in (None, 0),
    "min_keep": lambda value: value in (None, 0),  # top-k, top-p and min-p keep what they keep
    "dynatemp_range": lambda value: value in (None, 0, 0.0),
    "n_cmpl": lambda value: value in (None, 1),
    "n_indent": lambda value: value in (None, 0),
    "t_max_predict_ms": lambda value: value in (None, 0),
    "lora": _empty,
    "grammar_lazy": lambda value: value in (None, False),  # the grammar only after a trigger
    "grammar_triggers": _empty,
    # vLLM's
    "bad_words": _empty,
    "allowed_token_ids": _empty,
    "add_generation_prompt": lambda value: value in (None, True),
    "prompt_logprobs": lambda value: value in (None, 0),
    "chat_template": _empty,  # a request's own template (`--chat-template-file` sets the server's)
    # vLLM's on chat, the last message's text first (a completion request's `echo` is its own field)
    "echo": lambda value: value in (None, False),
}


# vLLM's structured outputs: what `structured_outputs` may ask the answer to follow, and the fields that
# ask the same (vLLM's older `guided_json` ..., llama-server's `grammar` and `json_schema`); vLLM's options
# (`whitespace_pattern`, `disable_*`) tune how a backend writes JSON and are not read
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    # llama-server's own, which its OpenAI endpoints take too (`/completion` has them as its fields)
    "grammar": "grammar",
    "json_schema": "json",
}


@dataclass(frozen=True)
class StructuredOutput:
    """One request's vLLM structured output: its `kind` (`STRUCTURED_KINDS`), the value asking it, and
    the field that gave it."""

    kind: str
    value: Any
    param: str


# chat fields a completion request must not carry (they would otherwise be ignored there)
CHAT_ONLY_FIELDS = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "separate_reasoning",
    "chat_template_kwargs",
    "reasoning_effort",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: Switch = False
    continuous_usage_stats: Switch = False  # vLLM's: with include_usage, every chunk carries usage so far


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="allow")
    # whether `n_predict: 0` is served: the prompt evaluated (and cached), no output (llama-server's
    # /completion); elsewhere it is a 400
    PROMPT_ONLY: ClassVar[bool] = False
    # the `logit_bias` that `logit_bias_ids` answered and its answer: the request's check and each of its
    # choices ask, and the texts in it are tokenized once
    _bias_ids: tuple[Any, tuple[tuple[int, float], ...]] | None = PrivateAttr(None)

    # optional as in vLLM and llama.cpp's server: absent means the served model
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    n: Choices = 1
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's, over the prompt and the output
    min_p: MinP | None = None
    # token id (as a string, OpenAI's JSON) -> value added to its logit; or llama-server's [[id, value]]
    logit_bias: dict[str, BiasValue] | list[tuple[int | str, BiasValue]] | None = None
    n_predict: NPredict | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: tokens that end the answer (not sent)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    stop: str | list[str] | None = None
    stream: Switch = False
    stream_options: StreamOptions | None = None
    ignore_eos: Switch = False  # vLLM's extension: generate max_tokens even past end-of-sequence
    # vLLM's: the stop string that ended the answer is sent as its end
    include_stop_str_in_output: Switch = False
    # vLLM's: special tokens' text (but the chat's markup, which the output parser reads) in the answer
    skip_special_tokens: Annotated[bool, null_is(True)] = True
    # vLLM's: spaces between special tokens and text when they are written out; its fast tokenizers
    # ignore it, and so does this one (a GGUF's tokenizer writes a token's text as it is)
    spaces_between_special_tokens: Annotated[bool, null_is(True)] = True
    # vLLM's: keep the prompt's last N tokens (-1: the context's worth)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), Integral] | None = None
    return_progress: Switch = False  # llama-server's: stream `prompt_progress` chunks during the prefill
    timings_per_token: Switch = False  # llama-server's: each streamed piece carries `timings` so far
    # llama-server's: seconds between keep-alive comments of this request's stream (-1: none), over
    # --sse-keepalive
    sse_ping_interval: Annotated[float, Field(gt=0)] | Literal[-1] | None = None
    cache_prompt: Annotated[bool, null_is(True)] = (
        True  # llama-server's: restore the prompt's longest cached prefix
    )
    id_slot: Annotated[
        int, Field(ge=-1), Integral, null_is(-1)
    ] = -1  # llama-server's: the slot the request runs under (-1: any)

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSUPPORTED_FIELDS.get(name)
            if neutral is not None and not neutral(value):
                raise invalid_request(
                    f"{name} is not supported by this server", param=name, code="unsupported_parameter"
                )
        check_stops(self.stop_list(), "stop")
        structured = self.structured_output()
        if structured is not None and self.ignore_eos:
            message = f"ignore_eos cannot be combined with {structured.param} (its grammar ends the answer)"
            raise invalid_request(message, param="ignore_eos", code="unsupported_value")
        if self.n_predict == 0 and not self.PROMPT_ONLY:
            message = "n_predict: must be -1 (up to the context) or at least 1"
            raise invalid_request(message, param="n_predict")

    def structured_output(self) -> StructuredOutput | None:
        """The structured output the answer follows: vLLM's (`structured_outputs`, a `guided_*` field) or
        llama-server's `grammar` or `json_schema` on the OpenAI endpoints; None where none is asked. Asking
        two is a 400 naming the second."""
        asked = [
            StructuredOutput(kind, value, f"structured_outputs.{kind}")
            for kind, value in (self.structured_outputs or {}).items()
            if kind in STRUCTURED_KINDS and value not in (None, False)
        ]
        extra = self.model_extra or {}
        asked += [
            StructuredOutput(kind, _llama_server_value(name, extra[name]), name)
            for name, kind in STRUCTURED_FIELDS.items()
            if extra.get(name) not in (None, "")
        ]
        if len(asked) > 1:
            first, second = asked[0].param, asked[1].param
            message = f"{second}: give one structured output, not {first} and {second}"
            raise invalid_request(message, param=asked[1].param)
        if asked and asked[0].kind == "structural_tag":
            message = f"{asked[0].param} is not supported by this server"
            raise invalid_request(message, param=asked[0].param, code="unsupported_parameter")
        return asked[0] if asked else None

    def keepalive_s(self, server_s: float) -> float | None:
        """Seconds between this request's keep-alive comments (None: none): `sse_ping_interval`, else the
        server's."""
        if self.sse_ping_interval is None:
            return server_s
        return None if self.sse_ping_interval == -1 else self.sse_ping_interval

    def sampling_overrides(self) -> dict[str, Any]:
        """`SamplingParams` fields an endpoint's own request fields set beyond the shared ones."""
        return {}

    def post_sampling(self) -> bool:
        """Whether token probabilities are the ones after the sampler chain (llama-server's
        `post_sampling_probs`) instead of the model's own log-probabilities."""
        return False

    def logit_bias_ids(
        self, vocab_size: int, encode: Callable[[str], list[int]]
    ) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, value) pairs, `false` as minus infinity. A key that is text, not a
        token id, biases each token `encode` makes of it, as llama-server's do (`[["Hello", -5]]`); a 400
        naming the first entry that is a token id outside the vocabulary, or where the texts pass
        MAX_BIAS_TEXT characters. Worked out once per `logit_bias` (a request meets one model)."""
        if self._bias_ids is None or self._bias_ids[0] is not self.logit_bias:
            self._bias_ids = (self.logit_bias, self._bias_pairs(vocab_size, encode))
        return self._bias_ids[1]

    def _bias_pairs(
        self, vocab_size: int, encode: Callable[[str], list[int]]
    ) -> tuple[tuple[int, float], ...]:
        entries = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or []
        pairs: list[tuple[int, float]] = []
        text = 0
        for index, (key, value) in enumerate(entries):
            bias, param = -math.inf if value is False else value, f"logit_bias.{index}"
            if isinstance(self.logit_bias, dict):
                param = "logit_bias"
            token = _token_id(key)
            if token is None:
                text += len(key)
                if text > MAX_BIAS_TEXT:
                    message = f"{param}: the texts of logit_bias hold more than {MAX_BIAS_TEXT} characters"
                    raise invalid_request(message, param=param)
                pairs += [(token, bias) for token in encode(key)]
            elif 0 <= token < vocab_size:
                pairs.append((token, bias))
            else:
                raise invalid_request(
                    f"logit_bias: {key!r} is not a token id of this model's vocabulary of {vocab_size}",
                    param=param,
                )
        return tuple(pairs)

    def stop_ids(self, vocab_size: int) -> tuple[int, ...]:
        """`stop_token_ids`; a 400 naming the first that is no token id of the vocabulary."""
        ids = tuple(self.stop_token_ids or ())
        bad = next((index for index, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise invalid_request(
                f"stop_token_ids.{bad}: {ids[bad]} is not a token id of the vocabulary of {vocab_size}",
                param=f"stop_token_ids.{bad}",
            )
        return ids

    def draw_seed(self) -> int | None:
        """The seed to draw with: None (a fresh one) when absent or llama-server's -1."""
        return fixed_seed(self.seed)

    def token_limit(self) -> int | None:
        """The most tokens to generate (None: up to the context): `max_tokens`, else llama-server's
        `n_predict`."""
        named = "max_tokens" in self.model_fields_set and self.max_tokens is not None
        if self.n_predict is not None and not named:
            return None if self.n_predict == -1 else self.n_predict
        return self.max_tokens

    def names_limit(self) -> bool:
        """Whether the request names how many tokens to generate (else the server's `-n` decides, where
        it has one)."""
        named = ("max_tokens", "max_completion_tokens", "n_predict")
        return any(getattr(self, name, None) is not None for name in named if name in self.model_fields_set)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Whether each streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`, which
        takes `include_usage` too)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def truncated(self, tokens: list[int], ctx: int) -> list[int]:
        """The prompt `tokens` as `truncate_prompt_tokens` keeps it (its last N; -1 the context's worth);
        a 400 for N of 0 or past the context, as vLLM's."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return tokens
        if keep == 0 or keep > ctx:
            message = f"truncate_prompt_tokens: -1, or 1 to the context of {ctx} tokens"
            raise invalid_request(message, param="truncate_prompt_tokens")
        return tokens[-(ctx if keep == -1 else keep) :]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = 16
    echo: Switch = False
    logprobs: TopLogprobs | None = None  # the number of most likely tokens listed with each token
    response_format: ResponseFormat | None = None  # vLLM's on completions: the text as JSON

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise invalid_request("echo is not supported", param="echo", code="unsupported_value")
        extra = self.model_extra or {}
        chat_only = next((name for name in CHAT_ONLY_FIELDS if extra.get(name) is not None), None)
        if chat_only is not None:
            raise invalid_request(
                f"{chat_only} is only supported by /v1/chat/completions",
                param=chat_only,
                code="unsupported_parameter",
            )

    def structured_output(self) -> StructuredOutput | None:
        """vLLM's structured outputs, `response_format` among them (a JSON format as on chat)."""
        asked = super().structured_output()
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return asked
        if asked is not None:
            message = f"{asked.param}: give one structured output, not response_format and {asked.param}"
            raise invalid_request(message, param=asked.param)
        response_format.check()
        return StructuredOutput("json", response_format.followed_schema(), "response_format")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or a list of them (OpenAI's batch)."""
        prompt = self.prompt
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        return checked_prompts(list(prompt) if several else [prompt], several, lambda one: len(one) == 0)


def _llama_server_value(field: str, value: Any) -> Any:
    """A structured output's value as asked: llama-server's `json_schema` `{}` is any JSON object."""
    return {"type": "object"} if field == "json_schema" and value == {} else value


def checked_prompts(prompts: list[Any], several: bool, empty: Callable[[Any], bool]) -> list[Any]:
    """`prompts`, refused (a 400 naming the field) beyond MAX_PROMPTS or where one is `empty`; `several`:
    the request gave a list of prompts (a failing one is named `prompt.N`)."""
    if not prompts:  # `"prompt": []`, a list of no prompts
        raise invalid_request("prompt: a prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise invalid_request(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
    index = next((index for index, one in enumerate(prompts) if empty(one)), None)
    if index is not None:
        param = f"prompt.{index}" if several else "prompt"
        raise invalid_request(f"{param}: a prompt must not be empty", param=param)
    return prompts


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served (`ChatMessage.check_content`)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def joined_text_parts(texts: list[str]) -> str:
    """A message's text parts as llama-server and vLLM give them to a chat template: one line break
    between two parts (llama-server writes none before a part while the text so far is empty)."""
    first = next((index for index, text in enumerate(texts) if text), len(texts))
    return "\n".join(texts[first:])


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # an assistant turn's reasoning as this server answered it, sent back by agents (Kimi-K2-Thinking's
    # template writes it into the turn's think block)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return joined_text_parts([part.text or "" for part in self.content])

    def check_content(self, index: int) -> None:
        """A 400 naming a missing content (required of every role but an assistant's turn calling tools,
        as OpenAI and llama-server require it) or the first content part that is not text (this server
        takes text only)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            where = f"messages.{index}.content"
            needs = "its content or tool_calls" if self.role == "assistant" else "its content"
            raise invalid_request(f"{where}: a message of role {self.role!r} needs {needs}", param=where)
        for number, part in enumerate(self.content if isinstance(self.content, list) else []):
            where = f"messages.{index}.content.{number}"
            if part.type != "text":
                message = f"{where}.type: {part.type!r} parts are not supported; this model takes text only"
                raise invalid_request(message, param=f"{where}.type", code="unsupported_value")
            if part.text is None:
                raise invalid_request(f"{where}.text: a text part needs its text", param=f"{where}.text")

    def template_fields(self) -> dict[str, Any]:
        """The message as the chat template sees it, except `content` (tokenized apart)."""
        role = "system" if self.role == "developer" else self.role
        fields: dict[str, Any] = {"role": role}
        if self.tool_calls is not None:
            fields["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        if self.reasoning_content is not None:
            fields["reasoning_content"] = self.reasoning_content
        return fields


def assistant_prefill(messages: list[ChatMessage]) -> str | None:
    """The text the answer continues (llama-server's assistant prefill): the content of a last message
    from the assistant without tool calls, which then is no turn of its own; else None."""
    last = messages[-1]
    return last.text() if last.role == "assistant" and not last.tool_calls else None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def schema_or_empty(self) -> dict[str, Any]:
        """The parameters schema; a function without one takes an empty object, as in OpenAI's API."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FreeformInput:
    """The input of a tool called with freeform text instead of a JSON object (the Responses API's custom
    tools): sentences of `lark`, a grammar in llguidance's Lark dialect (None: any text), given at the
    request's field `param`."""

    lark: str | None = None
    param: str = "tools"


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # llama-server's `{"type": "json_object", "schema": {...}}`
    object_schema: dict[str, Any] | None = Field(default=None, alias="schema")

    def check(self) -> None:
        """A 400 naming the field where the format's schema is missing or no valid JSON Schema."""
        if self.type == "json_object" and self.object_schema is not None:
            check_json_schema(self.object_schema, "response_format.schema")
        if self.type != "json_schema":
            return
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise invalid_request(
                "response_format.json_schema: a json_schema response format needs a schema",
                param="response_format.json_schema",
            )
        check_json_schema(self.json_schema.json_schema, "response_format.json_schema.schema")

    def followed_schema(self) -> dict[str, Any]:
        """The JSON Schema the answer follows: `json_schema`'s, llama-server's `schema` beside
        `json_object`, else any JSON object."""
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.json_schema:
            return self.json_schema.json_schema
        if self.type == "json_object" and self.object_schema is not None:
            return self.object_schema
        return {"type": "object"}


TemplateValue = str | bool | int | float | None
# template variables the server itself passes
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Switch = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # sglang's switch: False keeps thinking text in `content`
    separate_reasoning: Annotated[bool, null_is(True)] = True
    # llama-server's: `none` keeps thinking text in `content` too (`deepseek`, `auto`: split, the default)
    reasoning_format: Literal["none", "deepseek", "auto"] | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    # OpenAI's and llama-server's: `none` turns thinking off, another effort on (Kimi's has no levels)
    reasoning_effort: Annotated[str, Field(max_length=64)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for index, message in enumerate(self.messages):
            message.check_content(index)
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
        # every size first: validating a large schema against the metaschema takes seconds
        values = [schema_values(tool.function.schema_or_empty()) for tool in self.tools or []]
        for index, count in enumerate(values):
            param = f"tools.{index}.function.parameters"
            check_schema_values(count, MAX_SCHEMA_VALUES, "the schema's keywords and values", param)
        check_schema_values(sum(values), MAX_TOOLS_SCHEMA_VALUES, "the tools' parameter schemas", "tools")
        for index, tool in enumerate(self.tools or []):
            check_json_schema(tool.function.schema_or_empty(), f"tools.{index}.function.parameters")
        names = [tool.function.name for tool in self.tools or []]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise invalid_request(f"tools: the function {duplicate!r} is defined twice", param="tools")
        self._check_tool_choice(names)
        if self.response_format is not None:
            self.response_format.check()
        self._check_structured_output()
        reserved = next((k for k in self.chat_template_kwargs or {} if k in RESERVED_TEMPLATE_NAMES), None)
        if reserved is not None:
            raise invalid_request(
                f"chat_template_kwargs: {reserved!r} is set by the server",
                param=f"chat_template_kwargs.{reserved}",
            )
        if assistant_prefill(self.messages) and self.forced_output():
            where = f"messages.{len(self.messages) - 1}"
            raise invalid_request(
                f"{where}: an assistant message to continue cannot be combined with constrained output "
                "(tool_choice, response_format), whose grammar starts the answer afresh",
                param=where,
                code="unsupported_value",
            )
        if self.ignore_eos and self.forced_output():
            raise invalid_request(
                "ignore_eos cannot be combined with constrained output (tool_choice, response_format)",
                param="ignore_eos",
                code="unsupported_value",
            )

    def _check_tool_choice(self, names: list[str]) -> None:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid_request(
                f"tool_choice: the function {choice.function.name!r} is not in tools", param="tool_choice"
            )
        if choice == "required" and not names:
            raise invalid_request("tool_choice: 'required' needs at least one tool", param="tool_choice")

    def _check_structured_output(self) -> None:
        """A 400 where a structured output is asked beside another grammar of the whole answer."""
        structured = self.structured_output()
        if structured is None:
            return
        if self.forced_tools() or (self.response_format is not None and self.response_format.type != "text"):
            message = f"{structured.param}: give one of a structured output, response_format, tool_choice"
            raise invalid_request(message, param=structured.param)

    def template_kwargs(self) -> dict[str, TemplateValue] | None:
        """`chat_template_kwargs`, over `thinking` (Kimi's templates open the think block with it) and
        `reasoning_effort` (as llama-server hands it to the template) from `reasoning_effort`."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        effort = {"thinking": self.reasoning_effort != "none", "reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})}

    def freeform_tools(self) -> dict[str, FreeformInput]:
        """The tools called with freeform text instead of a JSON object, by name, and what that text
        follows (none here: `AgentChatRequest` carries the Responses API's custom tools)."""
        return {}

    def splits_reasoning(self) -> bool:
        """Whether thinking text goes to `reasoning_content` (sglang's `separate_reasoning`, llama-server's
        `reasoning_format`)."""
        return self.separate_reasoning and self.reasoning_format != "none"

    def forced_tools(self) -> list[Tool]:
        """The tools one of which the answer must call (empty: no call is forced)."""
        choice = self.tool_choice
        if choice == "required":
            return list(self.tools or [])
        if isinstance(choice, NamedToolChoice):
            return [tool for tool in self.tools or [] if tool.function.name == choice.function.name]
        return []

    def forced_output(self) -> bool:
        json_output = self.response_format is not None and self.response_format.type != "text"
        return bool(self.forced_tools()) or json_output or self.structured_output() is not None

    def token_limit(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().token_limit()


class AgentChatRequest(ChatCompletionRequest):
    """The chat request the Responses API's request converts into: a chat request that also carries the
    custom tools called with freeform text. Built by the conversion, never parsed from a body."""

    freeform: dict[str, FreeformInput] = Field(default_factory=dict)  # the Responses API's custom tools

    def freeform_tools(self) -> dict[str, FreeformInput]:
        return self.freeform


def object_tool(name: str, description: str | None, schema: dict[str, Any] | None, param: str) -> Tool:
    """A function tool of another API's flat definition: `schema` (at `param`) a valid JSON Schema of
    type object or naming no type (None: an empty object), else a 400 naming `param`."""
    schema = schema if schema is not None else {"type": "object", "properties": {}}
    check_json_schema(schema, param)
    if schema.get("type", "object") != "object":
        message = f"{param}: a tool's schema must be of type 'object', not {schema['type']!r}"
        raise invalid_request(message, param=param)
    function = FunctionDefinition(name=name, description=description, parameters=schema)
    return Tool(type="function", function=function)


def _token_id(key: str | int) -> int | None:
    """A logit_bias key as a token id: an int, or the digits of one (with a minus sign, an id outside
    any vocabulary); None for text."""
    if isinstance(key, int):
        return key
    return int(key) if re.fullmatch(r"-?[0-9]{1,12}", key) else None


def check_stops(stops: list[str], param: str) -> None:
    """A 400 naming `param` unless `stops` are at most MAX_STOPS sequences, none empty."""
    if len(stops) > MAX_STOPS:
        raise invalid_request(f"{param}: at most {MAX_STOPS} sequences", param=param)
    if any(stop == "" for stop in stops):
        raise invalid_request(f"{param}: sequences must not be empty", param=param)


def schema_values(schema: Any) -> int:
    """How many JSON values `schema` holds (objects, arrays and scalars, itself included), counted without
    recursion: a body may nest thousands deep."""
    count, pending = 0, [schema]
    while pending:
        value = pending.pop()
        count += 1
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return count


def check_schema_values(values: int, limit: int, what: str, param: str) -> None:
    """A 400 naming `param` where `what` holds more than `limit` JSON values."""
    if values > limit:
        raise invalid_request(f"{param}: {what} hold {values} JSON values, at most {limit}", param=param)


def check_json_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming `param` unless `schema` is a valid JSON Schema (draft 2020-12) of at most
    MAX_SCHEMA_VALUES values."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    check_schema_values(schema_values(schema), MAX_SCHEMA_VALUES, "the schema's keywords and values", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        detail = exc.message if not where else f"{exc.message} (at {where})"
        raise invalid_request(f"{param}: not a valid JSON Schema: {detail}", param=param) from None
