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


async def parse_body(request: Request, model: type[RequestModel]) -> RequestModel:
    try:
        body = await request.body()
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(model.model_validate_json, body)
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
