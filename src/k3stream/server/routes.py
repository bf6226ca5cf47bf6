"""Paths the server answers besides /v1, shared by the endpoints and the guard (no heavy imports)."""

from __future__ import annotations

# OpenAI's endpoints without `/v1`, as llama-server also answers them (a client whose base URL lacks it;
# `/completions` is llama-server's native completion, as there)
OPENAI_ALIASES = ("/models", "/chat/completions")
# llama-server's native completion and the answers for what this server does not serve (`native`)
NATIVE_ENDPOINTS = (
    "/completion",
    "/completions",
    "/infill",
    "/embedding",
    "/embeddings",
    "/rerank",
    "/reranking",
)
# llama-server's own endpoints (`endpoints_llama`, `native`) and the aliases
LLAMA_ENDPOINTS = frozenset(
    {"/tokenize", "/detokenize", "/apply-template", "/props", "/slots", *NATIVE_ENDPOINTS, *OPENAI_ALIASES}
)


def needs_api_key(path: str) -> bool:
    """Whether `path` is refused without the API key when one is set: /v1 and llama-server's endpoints,
    slot actions included (the chat page, /health and /metrics stay open)."""
    return path.startswith(("/v1", "/slots/")) or path in LLAMA_ENDPOINTS
