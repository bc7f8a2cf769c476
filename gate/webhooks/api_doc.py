"""The webhook endpoints' admin API in the OpenAPI document (gate/web/openapi.py)."""

from __future__ import annotations

from typing import Any

from gate.base.validate import MAX_ID
from gate.web.openapi_kit import (
    ADMIN,
    ADMIN_BODY_PROBLEMS,
    NULLABLE_TIMESTAMP,
    TIMESTAMP,
    _json,
    _problems,
    _ref,
)
from gate.webhooks import events as ev
from gate.webhooks.service import (
    DELIVERIES_LIMIT_DEFAULT,
    DELIVERIES_LIMIT_MAX,
    DESCRIPTION_MAX_CHARS,
)
from gate.webhooks.ssrf import URL_MAX_CHARS

BASE = "/v1/admin/webhook-endpoints"
ONE = BASE + "/{endpoint_id}"
_ID = {
    "type": "string",
    "pattern": "^[0-9A-HJKMNP-TV-Z]{26}$",
    "example": "01JD3W9K2XG5W7Q8M4Z6V1R0TB",
}
_URL = {
    "type": "string",
    "maxLength": URL_MAX_CHARS,
    "description": (
        "https:// to a host name or public address (http:// and internal addresses only for"
        " hosts listed in GATE_WEBHOOK_ALLOWED_HOSTS); no credentials."
    ),
}
_EVENTS = {
    "type": "array",
    "minItems": 1,
    "maxItems": ev.EVENTS_MAX,
    "uniqueItems": True,
    "items": {"type": "string", "enum": [*ev.TYPES, ev.ALL]},
    "description": 'The event types delivered to the endpoint, or ["*"] for all.',
}
_DESCRIPTION = {
    "type": "string",
    "maxLength": DESCRIPTION_MAX_CHARS,
    "pattern": "^[^\\x00-\\x1f\\x7f]*$",
    "description": "A note for people; no control characters.",
}
_SECRET = {
    "type": "string",
    "pattern": "^whsec_[A-Za-z0-9+/]+=*$",
    "description": "The signing secret: shown in this answer only.",
}
_NOT_FOUND = "WEBHOOK_ENDPOINT_NOT_FOUND"

SCHEMAS: dict[str, dict[str, Any]] = {
    "WebhookEndpointCreate": {
        "type": "object",
        "additionalProperties": False,
        "required": ["url", "events"],
        "properties": {"url": _URL, "events": _EVENTS, "description": _DESCRIPTION},
    },
    "WebhookEndpointUpdate": {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "url": _URL,
            "events": _EVENTS,
            "description": _DESCRIPTION,
            "status": {"type": "string", "enum": ["enabled", "disabled"]},
        },
    },
    "WebhookEndpoint": {
        "type": "object",
        "required": ["id", "url", "events", "description", "status", "created_at"],
        "properties": {
            "id": _ID,
            "url": _URL,
            "events": _EVENTS,
            "description": _DESCRIPTION,
            "status": {"type": "string", "enum": ["enabled", "disabled"]},
            "disabled_reason": {
                "type": ["string", "null"],
                "enum": ["manual", "gone", "failing", None],
                "description": "manual; gone: it answered 410; failing: 5 days of failures.",
            },
            "failing_since": NULLABLE_TIMESTAMP,
            "last_success_at": NULLABLE_TIMESTAMP,
            "created_at": TIMESTAMP,
            "updated_at": TIMESTAMP,
            "stats": {
                "type": "object",
                "description": "In GET answers: attempts and delivered ones in the last 24 h,"
                " deliveries pending and failed.",
                "properties": {
                    k: {"type": "integer", "minimum": 0}
                    for k in ("attempts_24h", "delivered_24h", "pending", "failed")
                },
            },
        },
    },
    "WebhookEndpointCreated": {
        "allOf": [
            _ref("WebhookEndpoint"),
            {"type": "object", "required": ["secret"], "properties": {"secret": _SECRET}},
        ]
    },
    "WebhookEndpointList": {
        "type": "object",
        "required": ["endpoints"],
        "properties": {"endpoints": {"type": "array", "items": _ref("WebhookEndpoint")}},
    },
    "WebhookSecret": {
        "type": "object",
        "required": ["secret"],
        "properties": {"secret": _SECRET},
    },
    "WebhookAttempt": {
        "type": "object",
        "properties": {
            "attempt": {"type": "integer", "minimum": 0},
            "at": TIMESTAMP,
            "duration_ms": {"type": "integer", "minimum": 0},
            "http_status": {"type": ["integer", "null"]},
            "error": {"type": ["string", "null"], "description": "Timeout, refused, HTTP 5xx…"},
        },
    },
    "WebhookDelivery": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "event_id": {"type": "string", "description": "The webhook-id header."},
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["pending", "delivered", "failed"]},
            "attempts_in_round": {"type": "integer", "minimum": 0},
            "next_attempt_at": NULLABLE_TIMESTAMP,
            "last_status": {"type": ["integer", "null"]},
            "last_error": {"type": ["string", "null"]},
            "created_at": TIMESTAMP,
            "updated_at": TIMESTAMP,
            "delivered_at": NULLABLE_TIMESTAMP,
            "attempts": {
                "type": "array",
                "items": _ref("WebhookAttempt"),
                "description": "The latest 20 attempts, oldest first.",
            },
        },
    },
    "WebhookDeliveries": {
        "type": "object",
        "required": ["deliveries", "next_after"],
        "properties": {
            "deliveries": {"type": "array", "items": _ref("WebhookDelivery")},
            "next_after": {
                "type": ["integer", "null"],
                "description": "Pass as `after` for the next page; null on the last.",
            },
        },
    },
    "WebhookQueued": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "description": "The delivery (retry)."},
            "delivery_id": {"type": "integer", "description": "The delivery (test)."},
            "event_id": {"type": "string", "description": "The test event's webhook-id."},
            "status": {"type": "string", "enum": ["pending"]},
        },
    },
}

_ENDPOINT_ID = {"name": "endpoint_id", "in": "path", "required": True, "schema": _ID}


def _op(
    method_summary: str,
    operation_id: str,
    responses: dict[str, Any],
    *,
    parameters: list[dict[str, Any]] | None = None,
    body: str | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "tags": ["admin"],
        "summary": method_summary,
        "operationId": operation_id,
        "security": ADMIN,
        "parameters": parameters or [],
        "responses": responses,
    }
    if description:
        op["description"] = description
    if body:
        op["requestBody"] = {
            "required": True,
            "description": "At most 4 KiB, `Content-Type: application/json`.",
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return op


def operations() -> dict[tuple[str, str], dict[str, Any]]:
    endpoint = [_ENDPOINT_ID]
    return {
        (BASE, "post"): _op(
            "Register a webhook endpoint; the answer shows its signing secret, once.",
            "createWebhookEndpoint",
            {
                "201": _json(_ref("WebhookEndpointCreated"), "Created, with its secret."),
                **_problems(*ADMIN_BODY_PROBLEMS, "WEBHOOK_URL_REFUSED", "CONFLICT"),
            },
            body="WebhookEndpointCreate",
            description=(
                "CONFLICT: GATE_WEBHOOK_MAX_ENDPOINTS reached, or no"
                " GATE_WEBHOOK_ENCRYPTION_KEY. See docs/webhooks.md."
            ),
        ),
        (BASE, "get"): _op(
            "List the webhook endpoints (secrets are never shown).",
            "listWebhookEndpoints",
            {
                "200": _json(_ref("WebhookEndpointList"), "The endpoints, oldest first."),
                **_problems("UNAUTHORIZED"),
            },
        ),
        (ONE, "get"): _op(
            "One webhook endpoint, with its last 24 hours' stats.",
            "getWebhookEndpoint",
            {
                "200": _json(_ref("WebhookEndpoint"), "The endpoint."),
                **_problems("UNAUTHORIZED", _NOT_FOUND),
            },
            parameters=endpoint,
        ),
        (ONE, "patch"): _op(
            "Change a webhook endpoint's URL, events, description or status.",
            "updateWebhookEndpoint",
            {
                "200": _json(_ref("WebhookEndpoint"), "The endpoint as changed."),
                **_problems(*ADMIN_BODY_PROBLEMS, "WEBHOOK_URL_REFUSED", _NOT_FOUND),
            },
            parameters=endpoint,
            body="WebhookEndpointUpdate",
        ),
        (ONE, "delete"): _op(
            "Delete a webhook endpoint: nothing more is sent to it.",
            "deleteWebhookEndpoint",
            {"204": {"description": "Deleted."}, **_problems("UNAUTHORIZED", _NOT_FOUND)},
            parameters=endpoint,
        ),
        (ONE + "/rotate-secret", "post"): _op(
            "A new signing secret; the old one keeps signing beside it for the overlap.",
            "rotateWebhookSecret",
            {
                "200": _json(_ref("WebhookSecret"), "The new secret, shown once."),
                **_problems("UNAUTHORIZED", _NOT_FOUND, "CONFLICT"),
            },
            parameters=endpoint,
            description=(
                "For GATE_WEBHOOK_ROTATION_OVERLAP_SECONDS (24 h) every delivery carries two"
                " signatures, the new secret's first."
            ),
        ),
        (ONE + "/deliveries", "get"): _op(
            "The endpoint's deliveries, newest first, each with its latest attempts.",
            "listWebhookDeliveries",
            {
                "200": _json(_ref("WebhookDeliveries"), "A page of deliveries."),
                **_problems("INVALID_REQUEST", "UNAUTHORIZED", _NOT_FOUND),
            },
            parameters=[
                _ENDPOINT_ID,
                {
                    "name": "status",
                    "in": "query",
                    "schema": {"type": "string", "enum": ["pending", "delivered", "failed"]},
                },
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": DELIVERIES_LIMIT_MAX,
                        "default": DELIVERIES_LIMIT_DEFAULT,
                    },
                },
                {
                    "name": "after",
                    "in": "query",
                    "description": "The previous page's next_after: deliveries older than it.",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                },
            ],
        ),
        (ONE + "/deliveries/{delivery_id}/retry", "post"): _op(
            "Send a delivery again now (a new round of the retry schedule).",
            "retryWebhookDelivery",
            {
                "202": _json(_ref("WebhookQueued"), "Queued for an attempt."),
                **_problems("UNAUTHORIZED", "NOT_FOUND", _NOT_FOUND),
            },
            parameters=[
                _ENDPOINT_ID,
                {
                    "name": "delivery_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                },
            ],
        ),
        (ONE + "/test", "post"): _op(
            "Send a webhook.test event to this endpoint.",
            "testWebhookEndpoint",
            {
                "202": _json(_ref("WebhookQueued"), "Queued for an attempt."),
                **_problems("UNAUTHORIZED", _NOT_FOUND),
            },
            parameters=endpoint,
        ),
    }
