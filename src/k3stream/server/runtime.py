"""What the server serves: the model, its tokenizer and chat template, the expert store, the context size."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3stream.engine.cmd_generate import chat_stop_token_ids
from k3stream.engine.generate import Sequence
from k3stream.engine.sampling import SamplingParams
from k3stream.server.errors import invalid_request
from k3stream.server.schemas import SamplingFields


@dataclass
class ServedModel:
    """A loaded model as the HTTP layer sees it."""

    name: str
    model: Any
    tokenizer: Any
    chat_template: Any
    ctx: int
    store: Any = None
    chat_stop_ids: tuple[int, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Render `(role, text)` messages with the chat template and tokenize (special tokens allowed)."""
        rendered = [{"role": "system" if role == "developer" else role, "content": text}
                    for role, text in messages]
        try:
            prompt = self.chat_template.render(rendered)
        except ValueError as exc:
            raise invalid_request(str(exc), param="messages") from None
        return self.tokenizer.encode(prompt, allow_special=True)

    def new_sequence(self, body: SamplingFields, prompt_tokens: list[int], max_tokens: int, *,
                     chat: bool) -> Sequence:
        """The engine's per-sequence logic (sampling, stops, detokenisation) for one request; a chat
        answer also stops where the template closes the assistant's response."""
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(body.stop_list()),
            ignore_eos=body.ignore_eos,
            stop_token_ids=self.chat_stop_ids if chat else (),
        )
        return Sequence(self.tokenizer, prompt_tokens, params)

    def batch_limit(self) -> int | None:
        """The most sequences one decode step may hold so that the union of their experts in a layer
        always fits the store's compute tier (each sequence picks top_k experts per layer)."""
        if self.store is None:
            return None
        return max(1, self.store.max_experts_per_fetch // self.store.top_k)

    def store_stats(self) -> dict[str, Any]:
        return self.store.stats() if self.store is not None else {}

    def end_tokens(self, n: int) -> None:
        if self.store is not None:
            self.store.end_token(n)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def default_name(gguf_path: Path) -> str:
    """`tiny-kimi-k3` for `tiny-kimi-k3.gguf` or any shard `tiny-kimi-k3-00001-of-00003.gguf`."""
    return re.sub(r"-\d{5}-of-\d{5}$", "", gguf_path.name.removesuffix(".gguf"))


DEFAULT_MAX_CTX = 4096


def served_from_runtime(runtime: Any, *, name: str | None = None, ctx: int | None = None) -> ServedModel:
    """Wrap the engine's loaded runtime (model, tokenizer, optional expert store) for serving.

    The name defaults to the GGUF's file name without shard suffix and extension; the context to the
    model's, at most DEFAULT_MAX_CTX.
    """
    from k3stream.engine.chat import ChatTemplate

    model_ctx = int(runtime.model.config.context_length)
    if ctx is not None and not 1 < ctx <= model_ctx:
        raise ValueError(f"--ctx {ctx} must be between 2 and the model's context length {model_ctx}")
    tokenizer = runtime.tokenizer
    return ServedModel(name=name or default_name(Path(tokenizer.source)), model=runtime.model,
                       tokenizer=tokenizer, chat_template=ChatTemplate.for_tokenizer(tokenizer),
                       ctx=ctx or min(model_ctx, DEFAULT_MAX_CTX), store=runtime.store,
                       chat_stop_ids=chat_stop_token_ids(tokenizer, thinking=False))
