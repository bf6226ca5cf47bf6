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
    {
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/props",
        "/slots",
        "/lora-adapters",
        "/api/tags",
        *NATIVE_ENDPOINTS,
        *OPENAI_ALIASES,
    }
)


# Anthropic's Messages API, as llama-server serves it (`messages`)
ANTHROPIC_ENDPOINTS = ("/v1/messages", "/v1/messages/count_tokens")


# what llama-server leaves open when it has an API key: health, the model list (Ollama's `/api/tags`
# too) and the chat page
PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health", "/models", "/v1/models", "/api/tags"})


def needs_api_key(path: str) -> bool:
    """Whether `path` is refused without the API key when one is set: every path but `PUBLIC_PATHS`,
    as llama-server does (`/metrics`, `/slots`, a path the server does not have)."""
    return path not in PUBLIC_PATHS


def openai_path(path: str) -> bool:
    """Whether `path` is one of OpenAI's (under /v1, or an alias without it), whose errors are OpenAI's
    error object; the others answer llama-server's."""
    return path.startswith("/v1/") or path in OPENAI_ALIASES


def anthropic_path(path: str) -> bool:
    """Whether `path` is Anthropic's Messages API, whose errors are Anthropic's error object."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def native_path(path: str) -> bool:
    """Whether `path` is llama-server's native completion, an answer for what this server does not serve,
    or a slot action: their errors are llama-server's error object, whatever refuses the request (the
    guard's 413 included)."""
    return path in NATIVE_ENDPOINTS or path.startswith("/slots/")
