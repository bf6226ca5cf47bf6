"""Request bodies parsed into pydantic models, with a 400 naming the first bad field."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from k3stream.server.errors import from_validation_error

RequestModel = TypeVar("RequestModel", bound=BaseModel)

# parsing a few MiB takes milliseconds: bodies larger than this are parsed off the event loop
OFF_LOOP_BYTES = 64 * 1024


# what Windows tools (Notepad, PowerShell's UTF-8) put first in a file; llama-server's JSON parser skips
# it, so a body sent from such a file (`curl --data-binary @body.json`) is read there and here alike
UTF8_BOM = b"\xef\xbb\xbf"


async def parse_body(request: Request, model: type[RequestModel]) -> RequestModel:
    try:
        body = (await request.body()).removeprefix(UTF8_BOM)
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
