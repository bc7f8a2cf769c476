"""Request and response helpers shared by every endpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Send

from gate.base import validate
from gate.base.errors import Encoded, Problem, RawResponse, encode_answer, invalid, raw_headers
from gate.base.validate import digits

JSON_CONTENT_TYPE = b"application/json"


def exact_paths(routes: Iterable[BaseRoute]) -> None:
    """Make each Route's path pattern match the whole path and nothing more.

    Starlette ends the pattern in `$`, which in Python also matches before a final
    newline: "/v1/deals/1%0A" (the path is percent-decoded) was the deal's route.
    `\\Z` is the very end. Used by the gate and the sandbox alike."""
    for route in routes:
        if isinstance(route, Route) and route.path_regex.pattern.endswith("$"):
            route.path_regex = re.compile(route.path_regex.pattern[:-1] + r"\Z")


def json_answer(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Encoded:
    extra = raw_headers(headers) if headers else None
    return encode_answer(status, JSON_CONTENT_TYPE, orjson.dumps(data), extra)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return RawResponse(*json_answer(data, status, headers))


async def send_answer(send: Send, answer: Encoded) -> None:
    """Send a made answer straight through ASGI (what Response.__call__ does)."""
    status, headers, body = answer
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(max_bytes: int) -> Problem:
    return Problem("PAYLOAD_TOO_LARGE", f"The body must be at most {max_bytes} bytes.")


def check_json_headers(max_bytes: int, content_type: str, content_length: str | None) -> None:
    """Refuse, before reading anything, a body that is not JSON or announced too long."""
    if content_length is not None:
        if len(content_length) <= 9 and content_length.isdigit() and content_length.isascii():
            # The usual short length: int() of at most 9 ASCII digits is safe and cheap.
            if int(content_length) > max_bytes:
                raise _too_large(max_bytes)
        # Digits past the bound, however many, without int() of them all.
        elif digits(content_length, max_bytes) is None:
            if not (content_length.isascii() and content_length.isdigit()):
                raise invalid("Invalid Content-Length header.")
            raise _too_large(max_bytes)
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise Problem("UNSUPPORTED_MEDIA_TYPE", "The body must be application/json.")


async def receive_json(
    receive: Receive, max_bytes: int, content_type: str, content_length: str | None
) -> Any:
    """The JSON body read straight from ASGI `receive`, bounded before anything is
    parsed. (Starlette's Request.stream costs an async generator and its bookkeeping
    per request, about a tenth of a rejection's whole cost.)"""
    check_json_headers(max_bytes, content_type, content_length)
    message = await receive()
    if message["type"] != "http.request":
        raise invalid("The client went away before sending the body.")
    body = message.get("body", b"")
    if len(body) > max_bytes:
        raise _too_large(max_bytes)
    if message.get("more_body", False):
        buf = bytearray(body)
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise invalid("The client went away before sending the body.")
            buf.extend(message.get("body", b""))
            if len(buf) > max_bytes:
                raise _too_large(max_bytes)
            if not message.get("more_body", False):
                break
        body = bytes(buf)
    return _parsed(body)


def json_body(body: bytes, max_bytes: int, content_type: str, content_length: str | None) -> Any:
    """The JSON body of a request that came whole (gate/web/edge.py): the same checks,
    in the same order, as `receive_json`."""
    check_json_headers(max_bytes, content_type, content_length)
    if len(body) > max_bytes:
        raise _too_large(max_bytes)
    return _parsed(body)


def _parsed(body: bytes) -> Any:
    if not body:
        raise invalid("The body is empty; a JSON object is required.")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise invalid("The body is not valid JSON.") from None


async def read_json(request: Request, max_bytes: int) -> Any:
    """The JSON body of a Starlette request (endpoints off the hot path)."""
    return await receive_json(
        request.receive,
        max_bytes,
        request.headers.get("content-type", ""),
        request.headers.get("content-length"),
    )


class IdConvertor(Convertor[int]):
    """A path id: digits, converted without int() ever seeing more than 19 of them
    (4,400 digits made Starlette's int convertor raise ValueError: a 500, or on the
    fast lane a reset connection). An id past MAX_ID converts to 0, which no row
    has: the endpoint answers 404 as for any unknown id."""

    regex = "[0-9]+"

    def convert(self, value: str) -> int:
        # The regex let only ASCII digits through; up to 18 of them are below MAX_ID.
        if len(value) <= 18:
            return int(value)
        return validate.digits(value, validate.MAX_ID) or 0

    def to_string(self, value: int) -> str:
        assert 0 <= value <= validate.MAX_ID
        return str(value)


register_url_convertor("id", IdConvertor())
