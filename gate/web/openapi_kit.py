"""The OpenAPI document's building blocks: problem answers, references, parameters
and the schemas several operations share (gate/web/openapi.py).
"""

from __future__ import annotations

from typing import Any

JSON = "application/json"


PROBLEM_JSON = "application/problem+json"


# Every problem code the API answers with, by status. The contract's codes plus
# METHOD_NOT_ALLOWED and INTERNAL, which gate.base.errors also knows.
PROBLEM_CODES: dict[str, int] = {
    "INVALID_REQUEST": 400,
    "UNAUTHORIZED": 401,
    "ADMISSION_REQUIRED": 403,
    "ADMISSION_INVALID": 403,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "WEBHOOK_URL_REFUSED": 400,
    "WEBHOOK_ENDPOINT_NOT_FOUND": 404,
    "ACCESS_CODE_REQUIRED": 403,
    "ACCESS_CODE_INVALID": 403,
    "ACCESS_CODE_USED": 403,
    "CHALLENGE_REQUIRED": 403,
    "CHALLENGE_INVALID": 403,
    "NO_TICKET": 404,
    "NOT_IN_QUEUE": 404,
    "METHOD_NOT_ALLOWED": 405,
    "REQUEST_TIMEOUT": 408,
    "SOLD_OUT": 409,
    "NOT_ACTIVE": 409,
    "IDEMPOTENCY_IN_PROGRESS": 409,
    "CONFLICT": 409,
    "NO_WAITING_ROOM": 409,
    "NO_CHALLENGE": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "UNSUPPORTED_MEDIA_TYPE": 415,
    "IDEMPOTENCY_MISMATCH": 422,
    "LIMIT_EXCEEDED": 422,
    "RATE_LIMITED": 429,
    "INTERNAL": 500,
    "OVERLOADED": 503,
    "SALE_PAUSED": 503,
}


_REASONS = {
    400: "Invalid request",
    401: "Missing or invalid credentials",
    403: (
        "Forbidden: the waiting room's admission missing or invalid, or a console call"
        " without its CSRF token"
    ),
    404: "Not found",
    405: "Method not allowed",
    408: "The body did not arrive within GATE_BODY_TIMEOUT_SECONDS; the connection is closed",
    409: "Conflict with the current state",
    413: "Body over 4 KiB",
    415: "Body is not JSON",
    422: "Unprocessable",
    429: "Rate limited; retry after `Retry-After` seconds",
    500: "Internal error",
    503: (
        "Overloaded, a dependency is unavailable, or the deal's sale is paused"
        " (SALE_PAUSED); retry after `Retry-After` seconds"
    ),
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}, **extra}


def _problems(*codes: str) -> dict[str, Any]:
    """Problem responses for these codes, grouped by status."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(PROBLEM_CODES[code], []).append(code)
    out: dict[str, Any] = {}
    for status, group in sorted(by_status.items()):
        response: dict[str, Any] = {
            "description": f"{_REASONS[status]}: " + ", ".join(group) + ".",
            "content": {
                PROBLEM_JSON: {
                    "schema": {
                        "allOf": [
                            _ref("Problem"),
                            {"properties": {"code": {"enum": group}}},
                        ]
                    }
                }
            },
        }
        if status in (429, 503):
            response["headers"] = {"Retry-After": {"$ref": "#/components/headers/RetryAfter"}}
        out[str(status)] = response
    out["default"] = {
        "description": "Any other error, as a problem (INTERNAL for a bug).",
        "content": {PROBLEM_JSON: {"schema": _ref("Problem")}},
    }
    return out


def _body(schema_name: str, description: str) -> dict[str, Any]:
    return {
        "required": True,
        "description": description + " At most 4 KiB, `Content-Type: application/json`.",
        "content": {JSON: {"schema": _ref(schema_name)}},
    }


def _param(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/parameters/{name}"}


BUYER: list[dict[str, list[str]]] = [{"buyer": []}]


ADMIN: list[dict[str, list[str]]] = [{"admin": []}]


ADMIN_BODY_PROBLEMS = (
    "INVALID_REQUEST",
    "UNAUTHORIZED",
    "PAYLOAD_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "REQUEST_TIMEOUT",
)


TIMESTAMP = {"type": "string", "format": "date-time", "example": "2026-01-01T00:00:00.000000Z"}


NULLABLE_TIMESTAMP = {"type": ["string", "null"], "format": "date-time"}


MINOR_UNITS = {"type": "integer", "minimum": 0, "description": "Amount in minor units."}


CURRENCY = {"type": "string", "pattern": "^[A-Z]{3}$", "example": "EUR"}


ORDER_ID = {"type": "string", "description": "ULID.", "example": "01JD3W9K2XG5W7Q8M4Z6V1R0TB"}


ORDER_STATUS = {
    "type": "string",
    "enum": [
        "PENDING_PAYMENT",
        "AUTHORIZED",
        "PAID",
        "EXPIRED",
        "CANCELLED",
        "REFUND_PENDING",
        "REFUNDED",
    ],
}


def _object(
    props: dict[str, Any], required: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required is not None:
        out["required"] = required
    out.update(extra)
    return out
