"""Request and response helpers shared by every endpoint."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gate.errors import Problem, invalid


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(data), status_code=status, media_type="application/json", headers=headers
    )


def _too_large(max_bytes: int) -> Problem:
    return Problem("PAYLOAD_TOO_LARGE", f"The body must be at most {max_bytes} bytes.")


async def read_json(
    request: Request,
    max_bytes: int,
    content_type: str | None = None,
    content_length: str | None = None,
) -> Any:
    """The JSON body, bounded before anything is parsed. Callers that already hold
    the headers pass Content-Type and Content-Length to save the lookups."""
    if content_type is None:
        content_type = request.headers.get("content-type", "")
    if content_length is None:
        content_length = request.headers.get("content-length")
    if content_length is not None:
        if not content_length.isdigit():
            raise invalid("Invalid Content-Length header.")
        if int(content_length) > max_bytes:
            raise _too_large(max_bytes)
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise Problem("UNSUPPORTED_MEDIA_TYPE", "The body must be application/json.")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    if not body:
        raise invalid("The body is empty; a JSON object is required.")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise invalid("The body is not valid JSON.") from None
