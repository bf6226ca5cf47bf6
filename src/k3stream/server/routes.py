"""Paths the server answers besides /v1, shared by the endpoints and the guard (no heavy imports)."""

from __future__ import annotations

# OpenAI's endpoints without `/v1`, as llama-server also answers them (a client whose base URL lacks it)
OPENAI_ALIASES = ("/models", "/completions", "/chat/completions")
# llama-server's own endpoints (`endpoints_llama`) and those aliases
LLAMA_ENDPOINTS = frozenset(
    {"/tokenize", "/detokenize", "/apply-template", "/props", "/slots", *OPENAI_ALIASES}
)


def needs_api_key(path: str) -> bool:
    """Whether `path` is refused without the API key when one is set: /v1 and llama-server's endpoints
    (the chat page, /health and /metrics stay open)."""
    return path.startswith("/v1") or path in LLAMA_ENDPOINTS
