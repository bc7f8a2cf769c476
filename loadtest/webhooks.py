"""Signed payment callbacks as the contract defines them (Standard Webhooks).

The load generator plays the provider's delivery side: it sends events to
`POST /v1/payments/{provider}/webhook` signed with GATE_WEBHOOK_SECRET, and can send
one event several times (duplicates) or several events in any order (reordering).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

PREFIX = "whsec_"


def secret_key(secret: str) -> bytes:
    """The HMAC key of the first `whsec_…` entry (GATE_WEBHOOK_SECRET may list several)."""
    first = secret.split()[0] if secret.split() else ""
    if not first.startswith(PREFIX):
        raise ValueError("the webhook secret must look like whsec_<base64>")
    return base64.b64decode(first[len(PREFIX) :])


@dataclass(frozen=True)
class Delivery:
    """One HTTP delivery of an event: the raw body and its headers."""

    event_id: str
    body: bytes
    headers: dict[str, str]


def event(
    event_type: str,
    order_id: str,
    payment_id: str,
    amount: int,
    currency: str,
    *,
    event_id: str | None = None,
    refund_id: str | None = None,
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "payment_id": payment_id,
        "order_id": order_id,
        "amount": amount,
        "currency": currency,
    }
    if refund_id is not None:
        data["refund_id"] = refund_id
    return {
        "id": event_id or "evt_" + secrets.token_hex(12),
        "type": event_type,
        "created": int(time.time()),
        "data": data,
    }


def sign(
    key: bytes,
    payload: dict[str, Any],
    *,
    msg_id: str | None = None,
    timestamp: int | None = None,
) -> Delivery:
    """A delivery of `payload`. A redelivery of the same message keeps its webhook-id
    (pass `msg_id`) and is signed again with a fresh timestamp."""
    body = orjson.dumps(payload)
    msg_id = msg_id or "msg_" + secrets.token_hex(12)
    ts = str(int(time.time()) if timestamp is None else timestamp)
    signed = msg_id.encode() + b"." + ts.encode() + b"." + body
    signature = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return Delivery(
        event_id=str(payload["id"]),
        body=body,
        headers={
            "webhook-id": msg_id,
            "webhook-timestamp": ts,
            "webhook-signature": f"v1,{signature}",
            "Content-Type": "application/json",
        },
    )
