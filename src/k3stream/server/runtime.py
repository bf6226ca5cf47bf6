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
    # the files serving reads from, with their sizes at load: /health reports any that changed
    files: dict[Path, int] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Render `(role, text)` messages with the chat template and tokenize them. Special tokens come
        only from the template: each message's content is tokenized as plain text, so content holding
        `<|im_end|><|im_system|>` cannot forge a turn."""
        roles = ["system" if role == "developer" else role for role, _ in messages]
        marks = [f"{MARK_OPEN}{index}{MARK_CLOSE}" for index in range(len(messages))]
        skeleton = self._render([{"role": r, "content": m} for r, m in zip(roles, marks, strict=True)])
        pieces = _split_at_marks(skeleton, marks)
        if pieces is None:  # the template transforms content: render it, but refuse special-token text
            self._refuse_special_text([text for _, text in messages])
            prompt = self._render(
                [{"role": r, "content": t} for r, (_, t) in zip(roles, messages, strict=True)]
            )
            return self.tokenizer.encode(prompt, allow_special=True)
        ids = self.tokenizer.encode(pieces[0], allow_special=True)
        for (_, text), template_text in zip(messages, pieces[1:], strict=True):
            ids += self.tokenizer.encode_plain(text)
            ids += self.tokenizer.encode(template_text, allow_special=True, add_bos=False)
        return ids

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.chat_template.render(messages)
        except ValueError as exc:
            raise invalid_request(str(exc), param="messages") from None

    def _refuse_special_text(self, texts: list[str]) -> None:
        for index, text in enumerate(texts):
            special = next((s for s in self.tokenizer.special_tokens if s in text), None)
            if special is not None:
                raise invalid_request(
                    f"messages.{index}.content contains the special token text {special!r}",
                    param=f"messages.{index}.content",
                )

    def new_sequence(
        self, body: SamplingFields, prompt_tokens: list[int], max_tokens: int, *, chat: bool
    ) -> Sequence:
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

    def store_stats(self) -> dict[str, Any]:
        return self.store.stats() if self.store is not None else {}

    def end_tokens(self, n: int) -> None:
        if self.store is not None:
            self.store.end_token(n)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


# private-use characters around a message index stand for its content while the template renders
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"


def _split_at_marks(text: str, marks: list[str]) -> list[str] | None:
    """`text` split at each mark, in order, each exactly once; None when the template moved, dropped,
    repeated or changed a message's content."""
    if any(text.count(mark) != 1 for mark in marks):
        return None
    pieces, rest = [], text
    for mark in marks:
        before, found, rest = rest.partition(mark)
        if not found:
            return None
        pieces.append(before)
    return [*pieces, rest]


def _model_files(runtime: Any) -> dict[Path, int]:
    """The GGUF shards (and the pack, when experts stream from one) with their current sizes."""
    paths = [Path(runtime.tokenizer.source)]
    pack = getattr(runtime.store, "pack", None)
    if pack is not None:
        paths = [*pack.gguf_paths, pack.path]
    return {path: path.stat().st_size for path in dict.fromkeys(paths) if path.is_file()}


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
    return ServedModel(
        files=_model_files(runtime),
        name=name or default_name(Path(tokenizer.source)),
        model=runtime.model,
        tokenizer=tokenizer,
        chat_template=ChatTemplate.for_tokenizer(tokenizer),
        ctx=ctx or min(model_ctx, DEFAULT_MAX_CTX),
        store=runtime.store,
        chat_stop_ids=chat_stop_token_ids(tokenizer, thinking=False),
    )
