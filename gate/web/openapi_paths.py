"""The OpenAPI document's paths: every operation of the HTTP API (gate/web/openapi.py)."""

from __future__ import annotations

from typing import Any

from gate.web.openapi_kit import (
    ADMIN,
    ADMIN_BODY_PROBLEMS,
    BUYER,
    JSON,
    _body,
    _json,
    _param,
    _problems,
    _ref,
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
                    " 127.0.0.1 at gate serve's --port + 10000, e.g. 127.0.0.1:18000);"
                    " on the public port with GATE_ENV=dev only, elsewhere 404 there."
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
                        "SALE_PAUSED",
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
                "requestBody": {
                    "required": True,
                    "description": "The deal. At most 64 KiB (its waiting room's page may"
                    " carry a logo), `Content-Type: application/json`.",
                    "content": {JSON: {"schema": _ref("DealCreate")}},
                },
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
        admin_deal + "/pause": {
            "post": {
                "tags": ["admin"],
                "summary": "Pause the deal's sale; ledgered with its reason.",
                "description": (
                    "Reservations answer 503 SALE_PAUSED with Retry-After, the waiting"
                    " room admits nobody (tickets keep their places), holds already made"
                    " may still be paid. The invariant monitor pauses a deal whose books"
                    " break (GATE_PAUSE_ON_BREACH). Pausing a paused deal changes nothing."
                ),
                "operationId": "pauseDeal",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("DealPause", "Why, written to the ledger."),
                "responses": {
                    "200": _json(_ref("DealPauseState"), "The deal's pause."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "OVERLOADED"),
                },
            }
        },
        admin_deal + "/resume": {
            "post": {
                "tags": ["admin"],
                "summary": "Resume a paused sale, only when `gate check` of the deal passes.",
                "description": (
                    "409 CONFLICT naming the breaches while the deal's books are broken"
                    " (repair first: gate deal repair); nothing changes then. Resuming a"
                    " deal that is not paused changes nothing."
                ),
                "operationId": "resumeDeal",
                "security": ADMIN,
                "parameters": [_param("DealId")],
                "requestBody": _body("DealResume", "An optional note for the ledger."),
                "responses": {
                    "200": _json(_ref("DealPauseState"), "The deal's pause, lifted."),
                    **_problems(*ADMIN_BODY_PROBLEMS, "NOT_FOUND", "CONFLICT", "OVERLOADED"),
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
