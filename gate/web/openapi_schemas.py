"""The OpenAPI document's schemas, under components (gate/web/openapi.py)."""

from __future__ import annotations

from typing import Any

from gate.web.openapi_kit import (
    CURRENCY,
    MINOR_UNITS,
    NULLABLE_TIMESTAMP,
    ORDER_ID,
    ORDER_STATUS,
    PROBLEM_CODES,
    TIMESTAMP,
    _object,
    _ref,
)


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
    # The sale paused (gate/inventory/pause.py), or null.
    paused = {
        "oneOf": [
            _object(
                {"since": TIMESTAMP, "reason": {"type": "string"}},
                ["since", "reason"],
            ),
            {"type": "null"},
        ]
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
            {**admin_deal, "paused": paused, "stock": {"type": "integer", "minimum": 0}},
            ["id", "title", "unit_price", "currency", "buckets", "stock"],
        ),
        "AdminDealView": _object(
            {
                **admin_deal,
                "paused": paused,
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
                "admit_per_second": {
                    "oneOf": [
                        {"type": "integer", "minimum": 1, "maximum": 100_000},
                        {"type": "string", "enum": ["auto"]},
                    ],
                    "description": "Admissions per second, or auto: the room sets its own"
                    " rate every second from what admitted buyers do and the database's"
                    " health, up to max_admit_per_second (docs/waiting-room.md).",
                },
                "max_admit_per_second": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 100_000,
                    "default": 1000,
                    "description": "The automatic rate's cap; only with admit_per_second auto.",
                },
                "unlikely_below": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 0.5,
                    "default": 0.02,
                    "description": "A waiting ticket reads unlikely while its chance.p is"
                    " below this (0: never).",
                },
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
                "method": {
                    "type": "string",
                    "enum": ["fifo", "random"],
                    "default": "fifo",
                    "description": "fifo: prequeue joiners in the draw's order"
                    " (hmac-sha256(seed, ticket_id) ascending), later joiners in join order;"
                    " random: every ticket in the draw's order (docs/waiting-room.md).",
                },
                "message": {
                    "oneOf": [_ref("RoomMessage"), {"type": "null"}],
                    "description": "Carried by every ticket read, through every gate process,"
                    " from the first read after a change (null: none).",
                },
                "access": {
                    "type": "string",
                    "enum": ["open", "codes"],
                    "default": "open",
                    "description": "codes: a join needs an access code (invite-only).",
                },
                "return_origins": {
                    "oneOf": [
                        {
                            "type": "array",
                            "maxItems": 16,
                            "items": {
                                "type": "string",
                                "maxLength": 100,
                                "pattern": "^https?://[^/?#]+$",
                            },
                        },
                        {"type": "null"},
                    ],
                    "description": "Where the buyer page (GET /room/{deal_id}) may send an"
                    " admitted buyer: origins such as https://shop.example (http only for"
                    " localhost, 127.0.0.1 and [::1]); absent, null or empty: nowhere.",
                },
                "challenge": {
                    "oneOf": [
                        _object(
                            {
                                "min_bits": {"type": "integer", "minimum": 0, "maximum": 24},
                                "max_bits": {
                                    "type": "integer",
                                    "minimum": 0,
                                    "maximum": 28,
                                    "description": "At least min_bits.",
                                },
                            },
                            ["min_bits", "max_bits"],
                            additionalProperties=False,
                        ),
                        {"type": "null"},
                    ],
                    "description": "A join's proof of work, priced by demand; null: none.",
                },
                "page": {
                    "oneOf": [_ref("RoomPage"), {"type": "null"}],
                    "description": "The shop's look on the buyer page; null: the gate's own"
                    " (shown only when set).",
                },
            },
            ["admit_per_second"],
            additionalProperties=False,
        ),
        "RoomPage": _object(
            {
                "shop_name": {
                    "type": ["string", "null"],
                    "minLength": 1,
                    "maxLength": 80,
                    "description": "Shown as text; no control characters, not only spaces.",
                },
                "accent_color": {
                    "type": ["string", "null"],
                    "pattern": "^#[0-9a-fA-F]{6}$",
                    "description": "Buttons, links, progress. Refused (400) unless its"
                    " contrast (WCAG 2.x) is at least 4.5:1 as text on the page's #ffffff"
                    " background and behind a button's text (#ffffff or #111111, the more"
                    " readable). Kept in lowercase.",
                },
                "logo": {
                    "oneOf": [
                        {
                            "type": "string",
                            "maxLength": 43_718,
                            "pattern": "^data:image/(png|webp|svg\\+xml);base64,",
                            "description": "In a request: the image, at most 32 KiB: PNG or"
                            " WebP (1..4096 pixels a side) or SVG of plain shapes, gradients"
                            " and text (no script, style, link, reference but url(#id)).",
                        },
                        _object(
                            {
                                "media_type": {
                                    "type": "string",
                                    "enum": ["image/png", "image/webp", "image/svg+xml"],
                                },
                                "bytes": {"type": "integer", "minimum": 1, "maximum": 32_768},
                                "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                            },
                            ["media_type", "bytes", "sha256"],
                            additionalProperties=False,
                            description="In an answer: the stored image's summary (a"
                            " request must send the image itself).",
                        ),
                        {"type": "null"},
                    ],
                },
                "help_url": {
                    "type": ["string", "null"],
                    "maxLength": 500,
                    "pattern": "^https://",
                    "description": "A help page the buyer page links to (https only).",
                },
            },
            additionalProperties=False,
        ),
        "Ticket": _object(
            {
                "deal_id": {"type": "integer", "minimum": 1},
                "state": {
                    "type": "string",
                    "enum": ["waiting", "unlikely", "admitted", "sold_out", "closed"],
                    "description": "unlikely: waiting (still in line, admitted in turn if"
                    " units come back) with chance.p below the room's unlikely_below.",
                },
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
                "ticket_id": {
                    "type": ["string", "null"],
                    "description": "Opaque, unique per deal, stable: the ticket's entry in"
                    " the fairness document's participants.",
                },
                "message": {
                    "oneOf": [_ref("RoomMessage"), {"type": "null"}],
                    "description": "The room's message to its waiters (null: none), as it is now.",
                },
                "chance": {
                    "oneOf": [_ref("Chance"), {"type": "null"}],
                    "description": "While waiting: the estimated probability of finding a unit"
                    " when admitted in turn; null while the room has too little to go on"
                    " (and in every other state).",
                },
                "paused": {
                    "type": "boolean",
                    "description": "The sale is paused (its books are being checked, or an"
                    " operator paused it): nobody is admitted meanwhile; the ticket keeps its"
                    " place.",
                },
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
                "ticket_id",
                "message",
                "chance",
                "paused",
            ],
        ),
        "Chance": _object(
            {
                "p": {"type": "number", "minimum": 0, "maximum": 1},
                "basis": _object(
                    {
                        "units_left": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Units available plus held units expected back.",
                        },
                        "ahead": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Buyers ahead: waiting, or admitted and not yet"
                            " holding.",
                        },
                        "conversion": {
                            "type": "number",
                            "minimum": 0,
                            "maximum": 1,
                            "description": "Share of admissions measured to end with a unit.",
                        },
                    },
                    ["units_left", "ahead", "conversion"],
                    additionalProperties=False,
                ),
            },
            ["p", "basis"],
            additionalProperties=False,
        ),
        "RoomMessage": _object(
            {
                "text": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 280,
                    "description": "Characters (any language); no control characters but"
                    " newline and tab.",
                },
                "level": {
                    "type": "string",
                    "enum": ["info", "warning"],
                    "default": "info",
                    "description": "How the buyer's page shows it.",
                },
            },
            ["text"],
            additionalProperties=False,
        ),
        "Fairness": _object(
            {
                "deal_id": {"type": "integer", "minimum": 1},
                "method": {"type": "string", "enum": ["fifo", "random"]},
                "commitment": {
                    "type": "string",
                    "description": "Hex SHA-256 of the seed: public from the room's creation.",
                },
                "seed": {
                    "type": ["string", "null"],
                    "description": "Hex, 32 bytes; null until revealed (fifo: at starts_at;"
                    " random: at ends_at).",
                },
                "rule": {
                    "type": "string",
                    "const": "hmac-sha256(seed, ticket_id) ascending",
                    "description": "The order: participants sorted by the hex HMAC-SHA256,"
                    " keyed with the seed, of each ticket id.",
                },
                "participants": {
                    "type": ["array", "null"],
                    "items": {"type": "string"},
                    "description": "The ticket ids drawn (fifo: the prequeue joiners;"
                    " random: every ticket), this page's (at most `limit`), in ticket id"
                    " order; null until revealed.",
                },
                "participants_total": {
                    "type": ["integer", "null"],
                    "minimum": 0,
                    "description": "The ticket ids drawn on all pages; null until revealed.",
                },
                "next": {
                    "type": ["string", "null"],
                    "description": "The next page's path (`…/queue/fairness?after=…&limit=…`);"
                    " null on the last page and until revealed.",
                },
            },
            [
                "deal_id",
                "method",
                "commitment",
                "seed",
                "rule",
                "participants",
                "participants_total",
                "next",
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
        "DealPause": _object(
            {"reason": {"type": "string", "minLength": 1, "maxLength": 255}},
            ["reason"],
            additionalProperties=False,
        ),
        "DealResume": _object(
            {"note": {"type": "string", "minLength": 1, "maxLength": 255}},
            [],
            additionalProperties=False,
        ),
        "DealPauseState": _object(
            {
                "deal_id": {"type": "integer"},
                "paused": {"type": "boolean"},
                "paused_at": {"type": ["string", "null"], "format": "date-time"},
                "reason": {"type": ["string", "null"]},
                "changed": {
                    "type": "boolean",
                    "description": "False: the deal was so already; nothing was ledgered.",
                },
            },
            ["deal_id", "paused", "paused_at", "reason", "changed"],
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
