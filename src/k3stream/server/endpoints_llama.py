"""llama-server's own endpoints, in its shapes: `/tokenize`, `/detokenize`, `/apply-template` and `/props`
(`GET`, and `POST` under llama-server's `--props`; see docs/server-endpoints.md; `GET /slots` is in
`slots`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

import k3stream
from k3stream.engine.chat import token_text
from k3stream.engine.sampling import SamplingParams
from k3stream.server.bodies import parse_body
from k3stream.server.errors import invalid_request, not_supported
from k3stream.server.runtime import ServedModel
from k3stream.server.scheduler import Scheduler
from k3stream.server.schemas import (
    RESERVED_TEMPLATE_NAMES,
    ChatMessage,
    Switch,
    TemplateValue,
    Tool,
    assistant_prefill,
    null_is,
)

if TYPE_CHECKING:
    from k3stream.server.app import ServerConfig

PROPS_OFF_MESSAGE = "This server does not support changing global properties. Start it with `--props`"
# text a /tokenize request may hold (the body limit bounds it too); tokenizing is linear in it
MAX_TOKENIZE_CHARS = 1 << 20


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # a text, or llama-server's mixed content: texts and token ids, in order
    content: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | list[int | str]
    # null is each switch's default, as llama-server reads a field
    add_special: Switch = False  # a BOS token first, where the file's tokenizer adds one
    parse_special: Annotated[bool, null_is(True)] = True  # special-token text becomes those tokens
    with_pieces: Switch = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    # llama-server's: False renders the conversation without the assistant's opening (a continued last
    # assistant message opens it whatever this says, as there)
    add_generation_prompt: Annotated[bool, null_is(True)] = True


class LlamaEndpoints:
    def __init__(
        self, served: ServedModel, scheduler: Scheduler, tokenizers: ThreadPoolExecutor, config: ServerConfig
    ) -> None:
        self.served = served
        self.scheduler = scheduler
        self.tokenizers = tokenizers
        self.config = config

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        tokenizer = self.served.tokenizer
        pieces = self._content_pieces(body.content)
        add_bos = None if body.add_special else False  # the file's add_bos_token decides, as in llama.cpp
        ids = await self._off_loop(
            lambda: self.served.encode_pieces(pieces, add_bos=add_bos, allow_special=body.parse_special)
        )
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": token, "piece": _piece(tokenizer.piece(token))} for token in ids]}

    def _content_pieces(self, content: str | list[int | str]) -> list[int | str]:
        """`/tokenize`'s content as pieces: a 400 naming `content.I` for a token id outside the
        vocabulary (llama-server passes it on), or `content` past MAX_TOKENIZE_CHARS of text."""
        pieces = [content] if isinstance(content, str) else content
        vocab = self.served.vocab_size
        bad = next((i for i, p in enumerate(pieces) if isinstance(p, int) and not 0 <= p < vocab), None)
        if bad is not None:
            message = f"content.{bad}: token id {pieces[bad]} is outside the vocabulary of {vocab}"
            raise invalid_request(message, param=f"content.{bad}")
        if sum(len(piece) for piece in pieces if isinstance(piece, str)) > MAX_TOKENIZE_CHARS:
            raise invalid_request(f"content: more than {MAX_TOKENIZE_CHARS} characters", param="content")
        return pieces

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        vocab = self.served.vocab_size
        bad = next((index for index, token in enumerate(body.tokens) if not 0 <= token < vocab), None)
        if bad is not None:
            raise invalid_request(
                f"tokens.{bad}: token id {body.tokens[bad]} is outside the vocabulary of {vocab}",
                param=f"tokens.{bad}",
            )
        return {"content": await self._off_loop(self.served.tokenizer.decode, body.tokens)}

    async def apply_template(self, request: Request) -> dict[str, Any]:
        body = await parse_body(request, ApplyTemplateRequest)
        reserved = next((k for k in body.chat_template_kwargs or {} if k in RESERVED_TEMPLATE_NAMES), None)
        if reserved is not None:
            param = f"chat_template_kwargs.{reserved}"
            raise invalid_request(f"{param}: set by the server", param=param)
        for index, message in enumerate(body.messages):
            message.check_content(index)
        messages = self.served.template_messages(body.messages)
        prefill = assistant_prefill(body.messages)
        if prefill is not None:
            messages.pop()
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        extras = {
            **self.served.template_variables(body.chat_template_kwargs),
            **({"tools": tools} if tools else {}),
        }
        extras["add_generation_prompt"] = body.add_generation_prompt or prefill is not None
        return {"prompt": await self._off_loop(self._render, messages, extras) + (prefill or "")}

    def _render(self, messages: list[dict[str, Any]], extras: dict[str, Any]) -> str:
        try:
            return self.served.chat_template.render(messages, **extras)
        except (TypeError, ValueError) as exc:
            raise invalid_request(f"messages: {exc}", param="messages") from None

    async def props(self) -> dict[str, Any]:
        served, config, tokenizer = self.served, self.config, self.served.tokenizer
        tool_use = served.chat_template.tool_use
        n_predict = served.default_n_predict or served.ctx
        return {
            "default_generation_settings": {
                "n_ctx": served.ctx,
                "params": llama_params(replace(served.defaults, max_tokens=n_predict)),
            },
            "total_slots": self.scheduler.max_batch,
            "model_path": Path(str(tokenizer.source)).name,  # the name alone: no paths leave
            "model_alias": served.name,
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": config.slots_endpoint,
            "endpoint_props": config.props_endpoint,
            "endpoint_metrics": True,
            "webui": config.webui,
            "chat_template": served.chat_template.template_text,
            **({"chat_template_tool_use": tool_use.template_text} if tool_use is not None else {}),
            "bos_token": token_text(tokenizer, tokenizer.bos_id),
            "eos_token": token_text(tokenizer, tokenizer.eos_id),
            "build_info": f"k3stream {k3stream.__version__}",
            "is_sleeping": False,
        }

    async def change_props(self) -> dict[str, Any]:
        """llama-server's `POST /props`: under `--props` it takes the request and changes nothing (no
        property is writable there either), else its 501."""
        if not self.config.props_endpoint:
            raise not_supported(PROPS_OFF_MESSAGE)
        return {"success": True}

    async def _off_loop(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizers, function, *args)


def llama_params(params: SamplingParams) -> dict[str, Any]:
    """Sampling settings under llama-server's names."""
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "seed": params.seed if params.seed is not None else -1,
        "n_predict": params.max_tokens,
        "max_tokens": params.max_tokens,
        "ignore_eos": params.ignore_eos,
        "stop": list(params.stop),
    }


def _piece(raw: bytes) -> str | list[int]:
    """llama-server's piece: the text where the bytes are valid UTF-8, else the bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def llama_router(
    served: ServedModel, scheduler: Scheduler, tokenizers: ThreadPoolExecutor, config: ServerConfig
) -> APIRouter:
    api = LlamaEndpoints(served, scheduler, tokenizers, config)
    router = APIRouter()
    router.post("/tokenize")(api.tokenize)
    router.post("/detokenize")(api.detokenize)
    router.post("/apply-template")(api.apply_template)
    router.get("/props")(api.props)
    router.post("/props")(api.change_props)
    return router
