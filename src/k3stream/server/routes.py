"""Paths the server answers besides /v1, shared by the endpoints and the guard (no heavy imports)."""

from __future__ import annotations

# llama-server's own endpoints (`endpoints_llama`)
LLAMA_ENDPOINTS = frozenset({"/tokenize", "/detokenize", "/apply-template", "/props", "/slots"})


def needs_api_key(path: str) -> bool:
    """Whether `path` is refused without the API key when one is set: /v1 and llama-server's endpoints
    (the chat page, /health and /metrics stay open)."""
    return path.startswith("/v1") or path in LLAMA_ENDPOINTS
