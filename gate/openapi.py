"""The OpenAPI 3.1 document of the HTTP API, served at /openapi.json.

Written by hand: the document is the API contract in machine-readable form, not a
by-product of the code; docs/api.md is rendered from it (gate/apidoc.py). Every
integer a request carries (path, query, body) states its bounds (minimum and
maximum), and the gate answers a value past them with a 4xx problem:
tests/test_bounds.py sends each one past its bounds, from this document.
tests/test_openapi.py keeps it in step with the routes the app really serves.
Areas that add endpoints beyond the contract describe them with `add_operation`.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import orjson

from gate import __version__

JSON = "application/json"
PROBLEM_JSON = "application/problem+json"

# Every problem code the API answers with, by status. The contract's codes plus
# METHOD_NOT_ALLOWED and INTERNAL, which gate.errors also knows.
PROBLEM_CODES: dict[str, int] = {
    "INVALID_REQUEST": 400,
    "UNAUTHORIZED": 401,
    "ADMISSION_REQUIRED": 403,
    "ADMISSION_INVALID": 403,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "NO_TICKET": 404,
    "METHOD_NOT_ALLOWED": 405,
    "REQUEST_TIMEOUT": 408,
    "SOLD_OUT": 409,
    "NOT_ACTIVE": 409,
    "IDEMPOTENCY_IN_PROGRESS": 409,
    "CONFLICT": 409,
    "NO_WAITING_ROOM": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "UNSUPPORTED_MEDIA_TYPE": 415,
    "IDEMPOTENCY_MISMATCH": 422,
    "LIMIT_EXCEEDED": 422,
    "RATE_LIMITED": 429,
    "INTERNAL": 500,
    "OVERLOADED": 503,
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
    503: "Overloaded or a dependency is unavailable; retry after `Retry-After` seconds",
}

_extra_operations: dict[tuple[str, str], dict[str, Any]] = {}


def add_operation(path: str, method: str, operation: dict[str, Any]) -> None:
    """Describe an endpoint an area adds (path as the route's template without
    converters, e.g. "/v1/orders/{order_id}/refunds")."""
    _extra_operations[(path, method.lower())] = deepcopy(operation)


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


def _paths() -> dict[str, dict[str, Any]]:
    deal = "/v1/deals/{deal_id}"
    order = "/v1/orders/{order_id}"
    admin_deal = "/v1/admin/deals/{deal_id}"
    return {
        "/healthz": {
            "get": {
                "tags": ["operations"],
                "summary": "Liveness: the process answers (no I/O).",
                "operationId": "healthz",
                "responses": {"200": _json(_ref("Health"), "Alive.")},
            }
        },
        "/readyz": {
            "get": {
                "tags": ["operations"],
                "summary": "Readiness: Redis and the database answer.",
                "operationId": "readyz",
                "responses": {
                    "200": _json(_ref("Ready"), "Ready to serve (or serving, degraded)."),
                    **_problems("OVERLOADED"),
                },
            }
        },
        "/metrics": {
            "get": {
                "tags": ["operations"],
                "summary": "Prometheus metrics (text exposition, all workers merged).",
                "description": (
                    "Served on the metrics listener, GATE_METRICS_ADDR (default"
                    " 127.0.0.1:9100); on the public port with GATE_ENV=dev only,"
                    " elsewhere 404 there."
                ),
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format 0.0.4.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "tags": ["operations"],
                "summary": "This document.",
                "operationId": "openapi",
                "responses": {"200": _json({"type": "object"}, "The OpenAPI document.")},
            }
        },
        deal: {
            "get": {
                "tags": ["buyers"],
                "summary": "A deal, with a hint of the units left.",
                "operationId": "getDeal",
                "parameters": [_param("DealId")],
                "responses": {
                    "200": _json(_ref("Deal"), "The deal."),
                    **_problems("NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        deal + "/reservations": {
            "post": {
                "tags": ["buyers"],
                "summary": "Reserve units: holds stock while the buyer pays.",
                "description": (
                    "One Redis admission, then one short database transaction. The hold "
                    "lasts until `expires_at` (database time). Repeating a request with the "
                    "same `Idempotency-Key` and body answers the original order with 200 and "
                    "`Idempotent-Replayed: true`. On a deal with a waiting room "
                    "(docs/waiting-room.md) the request needs `Admission-Token`; the first "
                    "reservation that holds stock spends the admission."
                ),
                "operationId": "reserve",
                "security": BUYER,
                "parameters": [
                    _param("DealId"),
                    _param("IdempotencyKey"),
                    {
                        "name": "Admission-Token",
                        "in": "header",
                        "required": False,
                        "description": "The `admission_token` of the buyer's admitted ticket "
                        "(GET /v1/deals/{deal_id}/queue); needed on a deal with a waiting room.",
                        "schema": {"type": "string", "maxLength": 200},
                    },
                ],
                "requestBody": _body("ReservationRequest", "The quantity to reserve."),
                "responses": {
                    "201": _json(_ref("Reservation"), "A new order holds the stock."),
                    "202": _json(
                        _ref("QueuedReservation"),
                        "Queue mode: admitted and queued; poll `Location` (also a replay"
                        " while it waits).",
                        headers={
                            "Location": {
                                "description": "`/v1/orders/{order_id}`.",
                                "schema": {"type": "string"},
                            }
                        },
                    ),
                    "200": _json(
                        _ref("Reservation"),
                        "A repeat of an earlier request with this key and body.",
                        headers={
                            "Idempotent-Replayed": {
                                "description": "Always `true` on a replay.",
                                "schema": {"type": "string", "enum": ["true"]},
                            }
                        },
                    ),
                    **_problems(
                        "INVALID_REQUEST",
                        "UNAUTHORIZED",
                        "ADMISSION_REQUIRED",
                        "ADMISSION_INVALID",
                        "NOT_FOUND",
                        "SOLD_OUT",
                        "NOT_ACTIVE",
                        "IDEMPOTENCY_IN_PROGRESS",
                        "PAYLOAD_TOO_LARGE",
                        "UNSUPPORTED_MEDIA_TYPE",
                        "REQUEST_TIMEOUT",
                        "IDEMPOTENCY_MISMATCH",
                        "LIMIT_EXCEEDED",
                        "RATE_LIMITED",
                        "OVERLOADED",
                    ),
                },
            }
        },
        order: {
            "get": {
                "tags": ["buyers"],
                "summary": "One of the buyer's orders (another buyer's is 404).",
                "operationId": "getOrder",
                "security": BUYER,
                "parameters": [_param("OrderId")],
                "responses": {
                    "200": _json(
                        {"oneOf": [_ref("Order"), _ref("QueuedOrder")]},
                        "The order (QUEUED or REJECTED while, or after, it waited in a queue).",
                    ),
                    **_problems("UNAUTHORIZED", "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        order + "/cancel": {
            "post": {
                "tags": ["buyers"],
                "summary": "Cancel a PENDING_PAYMENT order; its stock goes back.",
                "operationId": "cancelOrder",
                "security": BUYER,
                "parameters": [_param("OrderId")],
                "responses": {
                    "200": _json(
                        {"oneOf": [_ref("Order"), _ref("QueuedOrder")]},
                        "The order, now CANCELLED (a queued one: REJECTED, reason CANCELLED).",
                    ),
                    **_problems("UNAUTHORIZED", "NOT_FOUND", "CONFLICT", "OVERLOADED"),
                },
            }
        },
        order + "/payment": {
            "post": {
                "tags": ["buyers", "payments"],
                "summary": "Create (or return the existing) payment session of an order.",
                "description": "Idempotent: the same order always gets the same session.",
                "operationId": "payOrder",
                "security": BUYER,
                "parameters": [_param("OrderId")],
                "responses": {
                    "201": _json(_ref("PaymentSession"), "A session was created."),
                    "200": _json(_ref("PaymentSession"), "The order's existing session."),
                    **_problems("UNAUTHORIZED", "NOT_FOUND", "CONFLICT", "OVERLOADED"),
                },
            }
        },
        "/v1/payments/{provider}/webhook": {
            "post": {
                "tags": ["payments"],
                "summary": "Signed payment provider callback (Standard Webhooks).",
                "description": (
                    "Signature: `webhook-signature` holds space-separated `v1,<base64 "
                    "HMAC-SHA256>` entries over `{webhook-id}.{webhook-timestamp}.{raw body}` "
                    "with the base64-decoded part of a `whsec_…` secret. Rejected with 401 "
                    "when no entry matches or the timestamp is more than 300 s from now. "
                    "Answered 2xx once the event is durably recorded: duplicates, events "
                    "out of order and quarantined events (wrong amount, currency or order; "
                    "never marking an order paid) included."
                ),
                "operationId": "paymentWebhook",
                "parameters": [
                    {
                        "name": "provider",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "pattern": "^[a-z0-9_-]{1,32}$"},
                        "example": "sandbox",
                    },
                    {
                        "name": "webhook-id",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                    {
                        "name": "webhook-timestamp",
                        "in": "header",
                        "required": True,
                        "description": "Unix seconds.",
                        "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"},
                    },
                    {
                        "name": "webhook-signature",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string"},
                        "example": "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4=",
                    },
                ],
                "requestBody": _body("PaymentEvent", "The provider's event."),
                "responses": {
                    "2XX": {"description": "The event is durably recorded."},
                    **_problems(
                        "INVALID_REQUEST",
                        "UNAUTHORIZED",
                        "NOT_FOUND",
                        "PAYLOAD_TOO_LARGE",
                        "UNSUPPORTED_MEDIA_TYPE",
                        "REQUEST_TIMEOUT",
                        "OVERLOADED",
                    ),
                },
            }
        },
        "/v1/admin/deals": {
            "post": {
                "tags": ["admin"],
                "summary": "Create a deal and its stock buckets.",
                "operationId": "createDeal",
                "security": ADMIN,
                "requestBody": _body("DealCreate", "The deal."),
                "responses": {
                    "201": _json(_ref("AdminDeal"), "The deal, created."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "OVERLOADED"),
                },
            }
        },
        admin_deal: {
            "get": {
                "tags": ["admin"],
                "summary": "A deal with per-bucket database and Redis counts and the "
                "invariant verdict.",
                "operationId": "adminGetDeal",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "responses": {
                    "200": _json(_ref("AdminDealView"), "The deal and its check report."),
                    **_problems("UNAUTHORIZED", "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/stock": {
            "post": {
                "tags": ["admin"],
                "summary": "Adjust stock through the same constraints; ledgered.",
                "operationId": "adjustStock",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("StockAdjustment", "The change."),
                "responses": {
                    "200": _json(_ref("AdminDealView"), "The deal after the adjustment."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "CONFLICT", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/buckets": {
            "put": {
                "tags": ["admin"],
                "summary": "Change the number of stock buckets, online.",
                "operationId": "rebucket",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("Rebucket", "The new bucket count."),
                "responses": {
                    "200": _json(_ref("AdminDealView"), "The deal in its new layout."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/window": {
            "put": {
                "tags": ["admin"],
                "summary": "Change the sale window (null: open-ended); logged with its actor.",
                "operationId": "setWindow",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("SaleWindow", "The new window."),
                "responses": {
                    "200": _json(_ref("AdminDealView"), "The deal with its new window."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/mode": {
            "put": {
                "tags": ["admin"],
                "summary": "Switch a deal between sync and queue mode, live (docs/queue-mode.md).",
                "description": (
                    "Every gate process follows within GATE_QUEUE_MODE_REFRESH_SECONDS (1 s). "
                    "Requests already queued are still committed after a switch back to sync."
                ),
                "operationId": "setDealMode",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("DealMode", "The new mode."),
                "responses": {
                    "200": _json(_ref("AdminDealView"), "The deal, in its new mode."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/ledger": {
            "get": {
                "tags": ["admin"],
                "summary": "The deal's inventory ledger (audit rows), oldest first.",
                "operationId": "ledger",
                "security": ADMIN,
                "parameters": [
                    _param("DealId"),
                    {
                        "name": "after",
                        "in": "query",
                        "description": "Return rows with an id above this (paging).",
                        "schema": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": 2**63 - 1,
                            "default": 0,
                        },
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 1000,
                            "default": 100,
                        },
                    },
                ],
                "responses": {
                    "200": _json(_ref("Ledger"), "A page of ledger rows."),
                    **_problems("INVALID_REQUEST", "UNAUTHORIZED", "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
    }


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


def _schemas() -> dict[str, Any]:
    deal_common = {
        "id": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "maxLength": 200},
        "unit_price": MINOR_UNITS,
        "currency": CURRENCY,
        "starts_at": NULLABLE_TIMESTAMP,
        "ends_at": NULLABLE_TIMESTAMP,
        # Queue mode (docs/queue-mode.md).
        "mode": {"type": "string", "enum": ["sync", "queue"]},
    }
    admin_deal = {
        **deal_common,
        "buckets": {"type": "integer", "minimum": 1, "maximum": 1024},
        # Deal partitions (docs/scale-out.md), fixed at creation.
        "partitions": {"type": "integer", "minimum": 1, "maximum": 16},
        "layout_epoch": {"type": "integer", "minimum": 0},
        "hold_seconds": {"type": "integer", "minimum": 1, "maximum": 86400},
        "per_user_limit": {"type": ["integer", "null"], "minimum": 1, "maximum": 1_000_000_000},
        "max_per_order": {"type": "integer", "minimum": 1, "maximum": 1000},
        "capture_mode": {"type": "string", "enum": ["automatic", "manual"]},
        "waiting_room": {"oneOf": [_ref("WaitingRoom"), {"type": "null"}]},
        "created_at": TIMESTAMP,
        "updated_at": TIMESTAMP,
    }
    counts = {
        "total": {"type": "integer"},
        "available": {"type": "integer"},
        "held": {"type": "integer"},
        "sold": {"type": "integer"},
    }
    return {
        "Problem": _object(
            {
                "type": {"type": "string", "format": "uri"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "code": {"type": "string", "enum": list(PROBLEM_CODES)},
                "instance": {"type": "string"},
                "remaining_hint": {
                    "type": "integer",
                    "description": "With SOLD_OUT: units left (fewer than asked for).",
                },
                "order_status": {
                    "type": "string",
                    "description": "With CONFLICT on an order (cancel, payment): its status.",
                },
            },
            ["type", "title", "status", "detail", "code"],
            description="RFC 9457 problem details with a machine-readable `code`.",
        ),
        "Health": _object({"status": {"type": "string", "enum": ["ok"]}}, ["status"]),
        "Ready": _object(
            {
                "status": {
                    "type": "string",
                    "enum": ["ready", "degraded"],
                    "description": "degraded: serving, but the Redis circuit is not closed"
                    " or the reservations' share of the database pool is in use.",
                },
                "checks": _object({"redis": {"type": "string"}, "database": {"type": "string"}}),
                "redis_circuit": {"type": "string", "enum": ["closed", "open", "half_open"]},
                "db_pool": _object(
                    {
                        name: {"type": "integer", "minimum": 0}
                        for name in (
                            "size",
                            "free",
                            "max",
                            "reservation_in_use",
                            "reservation_max",
                            "reservation_waiting",
                        )
                    }
                ),
                "db_writer": {
                    "type": ["string", "null"],
                    "description": "The database node (host:port) this process writes to.",
                },
                "db_nodes": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "Several hosts in GATE_MYSQL_URL: each node's verdict"
                    " (`ok`, or why it may not take the writes); empty for one host.",
                },
            },
            ["status", "checks", "redis_circuit", "db_pool"],
        ),
        "Deal": _object(
            {
                **deal_common,
                "sold_out": {"type": "boolean"},
                "remaining_hint": {"type": "integer", "minimum": 0},
            },
            [*deal_common, "sold_out", "remaining_hint"],
        ),
        "ReservationRequest": _object(
            {
                "quantity": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 1_000_000,
                    "description": "≤ max_per_order",
                }
            },
            ["quantity"],
            additionalProperties=False,
        ),
        "Reservation": _object(
            {
                "order_id": ORDER_ID,
                "status": {"type": "string", "enum": ["PENDING_PAYMENT"]},
                "deal_id": {"type": "integer"},
                "quantity": {"type": "integer", "minimum": 1},
                "unit_price": MINOR_UNITS,
                "amount": MINOR_UNITS,
                "currency": CURRENCY,
                "expires_at": TIMESTAMP,
            },
            [
                "order_id",
                "status",
                "deal_id",
                "quantity",
                "unit_price",
                "amount",
                "currency",
                "expires_at",
            ],
        ),
        "DealMode": _object(
            {"mode": {"type": "string", "enum": ["sync", "queue"]}},
            ["mode"],
            additionalProperties=False,
        ),
        "QueuedReservation": _object(
            {
                "order_id": ORDER_ID,
                "status": {"type": "string", "enum": ["QUEUED"]},
                "deal_id": {"type": "integer"},
                "quantity": {"type": "integer", "minimum": 1},
                "unit_price": MINOR_UNITS,
                "amount": MINOR_UNITS,
                "currency": CURRENCY,
            },
            ["order_id", "status", "deal_id", "quantity", "unit_price", "amount", "currency"],
        ),
        "QueuedOrder": _object(
            {
                "order_id": ORDER_ID,
                "status": {"type": "string", "enum": ["QUEUED", "REJECTED"]},
                "deal_id": {"type": "integer"},
                "quantity": {"type": "integer", "minimum": 1},
                "unit_price": MINOR_UNITS,
                "amount": MINOR_UNITS,
                "currency": CURRENCY,
                "reason": {
                    "type": "string",
                    "description": "REJECTED: a problem code (SOLD_OUT, LIMIT_EXCEEDED…),"
                    " CANCELLED, DEAD_LETTER, or DUPLICATE (a retry of a committed request"
                    " whose Redis record was lost; the first order stands).",
                },
            },
            ["order_id", "status", "deal_id"],
        ),
        "Order": _object(
            {
                "order_id": ORDER_ID,
                "status": ORDER_STATUS,
                "deal_id": {"type": "integer"},
                "title": {"type": "string"},
                "quantity": {"type": "integer", "minimum": 1},
                "unit_price": MINOR_UNITS,
                "amount": MINOR_UNITS,
                "currency": CURRENCY,
                "capture_mode": {"type": "string", "enum": ["automatic", "manual"]},
                "expires_at": TIMESTAMP,
                "created_at": TIMESTAMP,
                "updated_at": TIMESTAMP,
                "paid_at": NULLABLE_TIMESTAMP,
                "closed_at": NULLABLE_TIMESTAMP,
            },
            ["order_id", "status", "deal_id", "quantity", "amount", "currency", "expires_at"],
        ),
        "PaymentSession": _object(
            {
                "provider": {"type": "string", "example": "sandbox"},
                "session_id": {"type": "string"},
                "redirect_url": {"type": "string", "format": "uri"},
                "expires_at": TIMESTAMP,
            },
            ["provider", "session_id", "redirect_url", "expires_at"],
        ),
        "PaymentEvent": _object(
            {
                "id": {"type": "string", "pattern": "^evt_", "example": "evt_01JD3W9K2X"},
                "type": {
                    "type": "string",
                    "enum": [
                        "payment.authorized",
                        "payment.succeeded",
                        "payment.failed",
                        "authorization.voided",
                        "refund.succeeded",
                        "refund.failed",
                    ],
                },
                "created": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 253_402_300_799,
                    "description": "Unix seconds (before the year 10000).",
                },
                "data": _object(
                    {
                        "payment_id": {"type": "string"},
                        "order_id": ORDER_ID,
                        "amount": {**MINOR_UNITS, "maximum": 2**63 - 1},
                        "currency": CURRENCY,
                        "refund_id": {"type": "string"},
                    },
                    ["payment_id", "order_id", "amount", "currency"],
                ),
            },
            ["id", "type", "created", "data"],
        ),
        "DealCreate": _object(
            {
                "title": {"type": "string", "minLength": 1, "maxLength": 200},
                "unit_price": {**MINOR_UNITS, "maximum": 10**15},
                "currency": CURRENCY,
                "stock": {"type": "integer", "minimum": 0, "maximum": 1_000_000_000},
                "buckets": {"type": "integer", "minimum": 1, "maximum": 1024, "default": 1},
                "hold_seconds": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 86400,
                    "default": 600,
                },
                "per_user_limit": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "maximum": 1_000_000_000,
                },
                "max_per_order": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1},
                "capture_mode": {
                    "type": "string",
                    "enum": ["automatic", "manual"],
                    "default": "automatic",
                },
                "mode": {"type": "string", "enum": ["sync", "queue"], "default": "sync"},
                "partitions": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 16,
                    "default": 1,
                    "description": "Redis partitions of one hot deal (docs/scale-out.md,"
                    ' "Deal partitions"): at most `buckets`, fixed for the deal\'s life;'
                    " above 1 not with a waiting room or queue mode.",
                },
                "starts_at": NULLABLE_TIMESTAMP,
                "ends_at": NULLABLE_TIMESTAMP,
                "waiting_room": {
                    "oneOf": [_ref("WaitingRoom"), {"type": "null"}],
                    "description": "A waiting room in front of the deal (docs/waiting-room.md);"
                    " absent or null: none.",
                },
            },
            ["title", "unit_price", "currency", "stock"],
            additionalProperties=False,
        ),
        "AdminDeal": _object(
            {**admin_deal, "stock": {"type": "integer", "minimum": 0}},
            ["id", "title", "unit_price", "currency", "buckets", "stock"],
        ),
        "AdminDealView": _object(
            {
                **admin_deal,
                "deal_id": {"type": "integer"},
                "bucket_count": {"type": "integer"},
                "totals": _object(counts),
                "orders": _object({"held": {"type": "integer"}, "sold": {"type": "integer"}}),
                "bucket_rows": {
                    "type": "array",
                    "items": _object(
                        {
                            "bucket": {"type": "integer"},
                            **counts,
                            "redis_available": {"type": ["integer", "null"]},
                        }
                    ),
                },
                "redis": _object(
                    {
                        "loaded": {"type": "boolean"},
                        "compared": {"type": "boolean"},
                        "available": {"type": "integer"},
                        "in_flight": {"type": "integer"},
                    }
                ),
                "invariant": _object(
                    {
                        "ok": {"type": "boolean"},
                        "breaches": {"type": "array", "items": {"type": "string"}},
                    },
                    ["ok", "breaches"],
                ),
            },
            ["id", "invariant"],
        ),
        "WaitingRoom": _object(
            {
                "admit_per_second": {"type": "integer", "minimum": 1, "maximum": 100_000},
                "admission_ttl_seconds": {
                    "type": "integer",
                    "minimum": 10,
                    "maximum": 3600,
                    "default": 120,
                },
                "prequeue_seconds": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 86_400,
                    "default": 0,
                },
            },
            ["admit_per_second"],
            additionalProperties=False,
        ),
        "Ticket": _object(
            {
                "deal_id": {"type": "integer", "minimum": 1},
                "state": {"type": "string", "enum": ["waiting", "admitted", "sold_out", "closed"]},
                "position": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "description": "1 = next to be admitted; null unless waiting.",
                },
                "joined_at": TIMESTAMP,
                "eta_seconds": {"type": ["integer", "null"], "minimum": 0},
                "poll_after_ms": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Poll no sooner: a faster poll is answered 429.",
                },
                "available_hint": {"type": "integer", "minimum": 0},
                "admission_token": {
                    "type": ["string", "null"],
                    "description": "Present only while admitted: send it as Admission-Token.",
                },
                "admission_expires_at": NULLABLE_TIMESTAMP,
            },
            [
                "deal_id",
                "state",
                "position",
                "joined_at",
                "eta_seconds",
                "poll_after_ms",
                "available_hint",
                "admission_token",
                "admission_expires_at",
            ],
        ),
        "StockAdjustment": _object(
            {
                "delta": {
                    "type": "integer",
                    "minimum": -1_000_000_000,
                    "maximum": 1_000_000_000,
                    "not": {"const": 0},
                    "description": "Units to add (positive) or remove from available.",
                },
                "reason": {"type": "string", "minLength": 1, "maxLength": 255},
            },
            ["delta", "reason"],
            additionalProperties=False,
        ),
        "Rebucket": _object(
            {"count": {"type": "integer", "minimum": 1, "maximum": 1024}},
            ["count"],
            additionalProperties=False,
        ),
        "SaleWindow": _object(
            {"starts_at": NULLABLE_TIMESTAMP, "ends_at": NULLABLE_TIMESTAMP},
            ["starts_at", "ends_at"],
            additionalProperties=False,
        ),
        "Ledger": _object(
            {
                "deal_id": {"type": "integer"},
                "items": {
                    "type": "array",
                    "items": _object(
                        {
                            "id": {"type": "integer"},
                            "bucket": {"type": "integer"},
                            "order_id": {"type": ["string", "null"]},
                            "delta": _object(counts),
                            "available_before": {"type": "integer"},
                            "available_after": {"type": "integer"},
                            "reason": {"type": "string"},
                            "actor": {"type": "string"},
                            "note": {"type": ["string", "null"]},
                            "created_at": TIMESTAMP,
                        }
                    ),
                },
                "next_after": {"type": ["integer", "null"]},
            },
            ["deal_id", "items", "next_after"],
        ),
    }


def document() -> dict[str, Any]:
    paths = _paths()
    for (path, method), operation in _extra_operations.items():
        paths.setdefault(path, {})[method] = deepcopy(operation)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Gate",
            "version": __version__,
            "description": (
                "Redis-fronted admission gate for flash sales of limited stock. Every "
                "non-2xx answer is `application/problem+json` with a `code`; 429 and 503 "
                "carry `Retry-After`. Every answer carries `X-Request-Id` (the client's, "
                "when it sent a sane one: 1–128 characters of `[A-Za-z0-9._:-]`). "
                "Integer fields take JSON integers only: `1.0` is refused (400), though "
                "JSON Schema counts it as an integer."
            ),
        },
        "tags": [
            {"name": "buyers"},
            {"name": "payments"},
            {"name": "admin"},
            {"name": "operations"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "buyer": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "HS256 JWT with `sub` = user id (digits) and `exp`.",
                },
                "admin": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "GATE_ADMIN_TOKEN.",
                },
            },
            "parameters": {
                "DealId": {
                    "name": "deal_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                },
                "OrderId": {
                    "name": "order_id",
                    "in": "path",
                    "required": True,
                    "schema": ORDER_ID,
                },
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": True,
                    "description": "Scoped per buyer, kept at least 24 h.",
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{8,255}$"},
                },
            },
            "headers": {
                "RetryAfter": {
                    "description": "Seconds to wait before retrying.",
                    "schema": {"type": "integer", "minimum": 1},
                }
            },
            "schemas": _schemas(),
        },
    }


def render(*, indent: bool = False) -> bytes:
    option = orjson.OPT_INDENT_2 if indent else 0
    return orjson.dumps(document(), option=option | orjson.OPT_SORT_KEYS)
