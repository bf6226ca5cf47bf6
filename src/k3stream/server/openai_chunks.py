"""The OpenAI completions' and chat completions' response bodies of one choice: whole, or as the chunks
of its stream (`streaming.Stream` sends them)."""

from __future__ import annotations

import codecs
import time
import uuid
from typing import Any

from k3stream.server.errors import APIError
from k3stream.server.kimi_output import Piece, joined
from k3stream.server.request_logic import TokenLogprob
from k3stream.server.scheduler import Job, ProgressEvent, request_timings


class Chunks:
    """Response bodies of one endpoint; ids and timestamps are fixed per request."""

    object_whole: str
    object_chunk: str
    id_prefix: str
    done_line = "data: [DONE]\n\n"  # the stream's last line

    def __init__(self, model: str, job: Job, index: int = 0, ident: str = "", created: int = 0) -> None:
        self.model = model
        self.job = job  # the choice's
        self.index = index  # the choice
        self.id = ident or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = created or int(time.time())
        self.timings_per_token = False  # llama-server's: each streamed piece carries `timings` so far

    @classmethod
    def for_choices(cls, model: str, jobs: list[Job], timings_per_token: bool = False) -> list[Chunks]:
        """One maker per choice (job), all with the request's id and timestamp."""
        first = cls(model, jobs[0])
        rest = enumerate(jobs[1:], start=1)
        makers = [first, *(cls(model, job, index, first.id, first.created) for index, job in rest)]
        for maker in makers:
            maker.timings_per_token = timings_per_token
        return makers

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def progress(self, event: ProgressEvent) -> dict[str, Any]:
        """A chunk with no choices and llama-server's `prompt_progress`."""
        return {**self._envelope(self.object_chunk, []), "prompt_progress": event.as_json()}

    def usage_only(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk, []), "usage": usage}

    def whole(
        self, choices: list[dict[str, Any]], usage: dict[str, Any], timings: dict[str, float]
    ) -> dict[str, Any]:
        return {**self._envelope(self.object_whole, choices), "usage": usage, "timings": timings}

    def error(self, error: APIError) -> APIError:
        return error

    def whole_choice(self, pieces: list[Piece], reason: str) -> dict[str, Any]:
        return {"index": self.index, **self._whole_choice(joined(pieces), reason)}

    def first(self) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._delta_choice(self._opening(), None)])

    def piece(self, piece: Piece) -> dict[str, Any]:
        chunk = self._envelope(self.object_chunk, [self._delta_choice(self._text(piece), None)])
        if self.timings_per_token:
            chunk["timings"] = request_timings([self.job])
        return chunk

    def last(self, reason: str) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [self._delta_choice(self._text(Piece()), reason)])

    def _delta_choice(self, content: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"index": self.index, "logprobs": None, **content, "finish_reason": reason}

    def _opening(self) -> dict[str, Any]:
        raise NotImplementedError

    def _text(self, piece: Piece) -> dict[str, Any]:
        raise NotImplementedError

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionChunks(Chunks):
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, job: Job, index: int = 0, ident: str = "", created: int = 0) -> None:
        super().__init__(model, job, index, ident, created)
        self._offset = 0  # characters of the text before the next token, for `text_offset`
        # the text the tokens' bytes make so far: a token holding part of a character adds none
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _opening(self) -> dict[str, Any]:
        return {"text": ""}

    def _text(self, piece: Piece) -> dict[str, Any]:
        return {"text": piece.content, "logprobs": self._logprobs(piece.logprobs)}

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        logprobs = self._logprobs(total.logprobs)
        return {"text": total.content, "logprobs": logprobs, "finish_reason": reason, **self._timings()}

    def last(self, reason: str) -> dict[str, Any]:
        chunk = super().last(reason)
        chunk["choices"][0].update(self._timings())
        return chunk

    def _timings(self) -> dict[str, Any]:
        """The choice's own `timings` (its prompt's prefill, its decoding), as llama-server gives each
        prompt of a list its own result with them; the response's `timings` add up every prompt's."""
        return {"timings": request_timings([self.job])}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """The completions API's logprobs object (None without logprobs)."""
        if not entries:
            return None
        offsets = []
        for entry in entries:  # where each token starts in the text (within a character it completes)
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(bytes(entry.bytes)))
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [_top_dict(entry) for entry in entries],
            "text_offset": offsets,
        }


class ChatChunks(Chunks):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _opening(self) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}

    def last(self, reason: str) -> dict[str, Any]:
        """The choice's finish chunk, with its `timings`, as llama-server's last chunk carries them (a
        stream without `include_usage` has no usage chunk to carry them)."""
        return {**super().last(reason), "timings": request_timings([self.job])}

    def _text(self, piece: Piece) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.tool_calls:
            delta["tool_calls"] = [call.openai() for call in piece.tool_calls]
        return {"delta": delta, "logprobs": _chat_logprobs(piece.logprobs)}

    def _whole_choice(self, total: Piece, reason: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": total.content}
        if total.reasoning:
            message["reasoning_content"] = total.reasoning
        if total.tool_calls:
            message["content"] = total.content or None
            message["tool_calls"] = [_without_index(call.openai()) for call in total.tool_calls]
        logprobs = _chat_logprobs(total.logprobs)
        return {"message": message, "logprobs": logprobs, "finish_reason": reason}


def _top_dict(sampled: TokenLogprob) -> dict[str, float]:
    """OpenAI's `{token text: logprob}` of the likeliest tokens and the sampled one (up to N+1, as
    OpenAI's and vLLM's); of tokens with the same text, the most likely one."""
    listed: dict[str, float] = {}
    for entry in [*sampled.top, sampled]:
        listed.setdefault(entry.token, entry.logprob)
    return listed


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any] | None:
    return {"content": [entry.openai() for entry in entries]} if entries else None


def _without_index(call: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in call.items() if key != "index"}
