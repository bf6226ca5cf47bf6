"""Error bodies: OpenAI's `{"error": {"message", "type", "param", "code"}}`, llama-server's
`{"error": {"code": STATUS, "message", "type"}}` on its native endpoints (`LlamaError`), and Anthropic's
`{"type": "error", "error": {"type", "message"}}` on its Messages API (`AnthropicError`)."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from k3stream.server.routes import anthropic_path, native_path


class APIError(Exception):
    """An error the API answers with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        figures: dict[str, int] | None = None,
    ) -> None:
        message = redact_paths(message)  # error bodies never reveal the server's file layout
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.figures = figures or {}  # numbers llama-server's body adds (`n_prompt_tokens`, `n_ctx`)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse(self) -> str:
        """The error as the last event of a stream that already started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


# llama-server's error types by status (its `format_error_response`)
LLAMA_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class LlamaError(APIError):
    """An error in llama-server's shape: the HTTP status as `code`, no `param` (the message names it)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.figures}}

    @classmethod
    def of(cls, error: APIError) -> LlamaError:
        """`error` in llama-server's shape: its type by status; a context overflow is its
        `exceed_context_size_error`, with the prompt's tokens and the context (`n_prompt_tokens`,
        `n_ctx`)."""
        kind = LLAMA_ERROR_TYPES.get(error.status, error.type)
        if error.code == "context_length_exceeded":
            kind = "exceed_context_size_error"
        return cls(
            error.status, error.message, type=kind, param=error.param, code=error.code, figures=error.figures
        )


# Anthropic's error types by status
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class AnthropicError(APIError):
    """An error in the shape of Anthropic's Messages API: its type by status, the message naming the
    field; in a stream, an `error` event."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def sse(self) -> str:
        return f"event: error\ndata: {json.dumps(self.body(), ensure_ascii=False)}\n\n"

    @classmethod
    def of(cls, error: APIError) -> AnthropicError:
        kind = ANTHROPIC_ERROR_TYPES.get(
            error.status, "invalid_request_error" if error.status < 500 else "api_error"
        )
        return cls(error.status, error.message, type=kind, param=error.param, code=error.code)


def shaped_for(path: str, error: APIError) -> APIError:
    """`error` in the shape of the API that `path` belongs to: Anthropic's under `/v1/messages`,
    llama-server's on its native paths (`routes.native_path`), else as it is."""
    if anthropic_path(path):
        return AnthropicError.of(error)
    if native_path(path) and not isinstance(error, LlamaError):
        return LlamaError.of(error)
    return error


def not_supported(message: str) -> LlamaError:
    """llama-server's 501 for a feature this server does not have."""
    return LlamaError(501, message, type=LLAMA_ERROR_TYPES[501])


def invalid_request(
    message: str, param: str | None = None, code: str | None = None, figures: dict[str, int] | None = None
) -> APIError:
    return APIError(400, message, param=param, code=code, figures=figures)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its dotted field path: of a field that may take several
    shapes, the deepest one (a bad item of a list says more than "not an object")."""
    errors = exc.errors(include_url=False)
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return invalid_request(f"request body is not valid JSON: {detail}", code="invalid_json")
    param = _field_path(first["loc"])
    if first["type"] == "model_type":
        if param:
            return invalid_request(f"{param}: must be a JSON object", param=param, code="invalid_type")
        return invalid_request("request body must be a JSON object", code="invalid_type")
    return invalid_request(f"{param}: {first['msg']}", param=param or None, code=first["type"])


def _field_path(loc: tuple) -> str:
    """`messages.0.content`, dropping the union-branch names pydantic adds (`str`, `list[int]`, a model's
    class name)."""
    parts = [str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p))]
    return ".".join(parts)


def _is_type_tag(part: str) -> bool:
    tags = ("list[", "dict[", "tuple[", "function-", "literal[", "constrained-")
    model_name = part[:1].isupper() and part.isalnum() and not part.isupper()  # `NamedToolChoice`
    return part in ("str", "int", "float", "bool") or part.startswith(tags) or model_name


# an absolute path of a file; the server's own endpoints (`/v1/chat/completions`, `/api/tags`), which
# messages name for the client to use, are not files
PATH_RE = re.compile(
    r"(?<![\w.~:/-])(?!/v1/|/api/tags\b)(?:/[^\s/:;,'\"()<>\[\]{}]+)+/([^\s/:;,'\"()<>\[\]{}]+)"
)


def redact_paths(message: str) -> str:
    """`message` with every absolute path of a file shortened to its file name (error bodies, /health);
    the endpoints it names stay whole."""
    return PATH_RE.sub(r"\1", message)
