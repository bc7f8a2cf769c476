"""The events a shop can subscribe to, and the body each delivery carries.

    body = {"type": "order.paid", "timestamp": "2026-12-01T10:00:00.000000Z",
            "data": {"order_id", "deal_id", "user_id", "quantity", "amount",
                     "currency", "status", "sequence", …}}

Order events come from the outbox rows the state changes commit (their payload, and
the order's fixed facts: amount and currency); `sequence` counts the order's events
(1, 2, 3 …, in the order they committed). Deal events come from the deal watcher,
with a per-deal sequence. The body is made once and kept, so every attempt of a
delivery sends the same bytes under the same webhook-id.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson

from gate.base.clock import iso

ORDER_TYPES = (
    "order.authorized",
    "order.paid",
    "order.refund_pending",
    "order.refunded",
    "order.cancelled",
    "order.expired",
    "order.rejected",
)
PAYMENT_TYPES = ("payment.refund_scheduled", "payment.quarantined")
DEAL_SOLD_OUT = "deal.sold_out"
DEAL_AVAILABLE_AGAIN = "deal.available_again"
DEAL_TYPES = (DEAL_SOLD_OUT, DEAL_AVAILABLE_AGAIN)
TEST_TYPE = "webhook.test"
# What an endpoint may name in `events` (or "*" for all of them).
TYPES = (*ORDER_TYPES, *PAYMENT_TYPES, *DEAL_TYPES)
# The outbox topics that become webhook events (the others, such as
# payment.reconcile_flagged, are for the operator, not the shop).
OUTBOX_TYPES = frozenset((*ORDER_TYPES, *PAYMENT_TYPES))
ALL = "*"
EVENTS_MAX = len(TYPES) + 1

# Payload fields of an outbox row passed on as they are, when present.
_EXTRA_FIELDS = ("reason", "detail")


def subscribed(events: list[str], event_type: str, endpoint_id: str | None, target: str) -> bool:
    """Whether the endpoint `endpoint_id` (subscribed to `events`) gets an event of
    `event_type` addressed to `target` (a test event's endpoint, or None: everyone)."""
    if target is not None and target != endpoint_id:
        return False
    if event_type == TEST_TYPE:
        return target == endpoint_id
    return ALL in events or event_type in events


def body(event_type: str, timestamp: datetime | str, data: dict[str, Any]) -> bytes:
    when = timestamp if isinstance(timestamp, str) else iso(timestamp)
    return orjson.dumps({"type": event_type, "timestamp": when, "data": data})


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def order_data(
    payload: dict[str, Any],
    order: tuple[int, int, int, int, str] | None,
    sequence: int,
) -> dict[str, Any]:
    """An order or payment event's data: the outbox payload's facts, the order's
    (deal, user, quantity, amount, currency: fixed once the order exists) where the
    payload lacks them, and the per-order sequence."""
    deal_id, user_id, quantity, amount, currency = (
        order if order is not None else (None, None, None, None, None)
    )
    data: dict[str, Any] = {
        "order_id": payload.get("order_id"),
        "deal_id": deal_id if deal_id is not None else _int_or_none(payload.get("deal_id")),
        "user_id": user_id if user_id is not None else _int_or_none(payload.get("user_id")),
        "quantity": quantity if quantity is not None else _int_or_none(payload.get("quantity")),
        "amount": amount if amount is not None else _int_or_none(payload.get("order_amount")),
        "currency": currency if currency is not None else payload.get("order_currency"),
        "status": payload.get("status"),
        "sequence": sequence,
    }
    for name in _EXTRA_FIELDS:
        if payload.get(name) is not None:
            data[name] = payload[name]
    if payload.get("provider") is not None:
        # The payment the event is about (its amount may differ from the order's: a
        # partial refund, a payment for an order that had expired).
        data["payment"] = {
            "provider": payload.get("provider"),
            "payment_id": payload.get("payment_id"),
            "refund_id": payload.get("refund_id"),
            "amount": _int_or_none(payload.get("amount")),
            "currency": payload.get("currency"),
        }
    return data


def deal_data(deal_id: int, sequence: int, available: int, total: int) -> dict[str, Any]:
    return {"deal_id": deal_id, "sequence": sequence, "available": available, "total": total}


def test_data(endpoint_id: str) -> dict[str, Any]:
    return {
        "endpoint_id": endpoint_id,
        "message": "A test event sent from Gate: your endpoint received and verified it.",
    }
