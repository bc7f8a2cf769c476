"""Regular expressions over external input match the whole input.

Python's `$` also matches before a final newline, so `re.match(r"^[a-z]+$", "abc\\n")`
succeeds: every pattern over input from outside (idempotency keys, device ids,
request ids, order ids, webhook headers and event fields, route paths) is now used
with fullmatch. HTTP header values cannot carry a newline (the parser refuses them),
so those are checked at the function level; a path can (%0A), so over HTTP.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest
import redis.asyncio as aioredis

from gate.base import validate
from gate.base.errors import Problem
from gate.base.limits import device_id
from gate.base.logs import sane_request_id
from gate.inventory.orders import valid_order_id
from gate.payments.provider import EventInvalid, parse_event
from gate.payments.signing import WebhookRejected, sign_headers, verify
from gate.store.db import Database
from tests.support import (
    ADMIN_TOKEN,
    Client,
    GateProcess,
    create_deal,
    redis_available,
    token,
)

ULID = "01JD3W9K2XG5W7Q8M4Z6V1R0TB"


def test_an_idempotency_key_with_a_trailing_newline_is_refused() -> None:
    assert validate.idempotency_key("abcdefgh") == "abcdefgh"
    with pytest.raises(Problem) as refused:
        validate.idempotency_key("abcdefgh\n")
    assert refused.value.status == 400


def test_a_device_id_with_a_trailing_newline_is_refused() -> None:
    assert device_id("phone-1") == "phone-1"
    with pytest.raises(Problem):
        device_id("phone-1\n")


def test_a_request_id_with_a_trailing_newline_is_replaced() -> None:
    assert sane_request_id(b"req-1") == "req-1"
    assert sane_request_id(b"req-1\n") is None


def test_an_order_id_with_a_trailing_newline_is_not_an_order_id() -> None:
    assert valid_order_id(ULID)
    assert not valid_order_id(ULID + "\n")


def test_webhook_headers_and_event_fields_with_a_trailing_newline_are_refused() -> None:
    key = b"k" * 32
    body = b"{}"
    now = int(time.time())
    good = sign_headers([key], "msg_1", now, body)
    assert verify([key], good, body, now) == "msg_1"
    for name, value in (("webhook-id", "msg_1\n"), ("webhook-timestamp", f"{now}\n")):
        headers = {**good, name: value}
        if name == "webhook-id":
            headers["webhook-signature"] = sign_headers([key], value, now, body)[
                "webhook-signature"
            ]
        with pytest.raises(WebhookRejected):
            verify([key], headers, body, now)

    def event(event_id: str, payment_id: str) -> bytes:
        data = {"payment_id": payment_id, "order_id": ULID, "amount": 1, "currency": "EUR"}
        return orjson.dumps({"id": event_id, "type": "payment.succeeded", "data": data})

    assert parse_event(event("evt_1", "pay_1")).order_id == ULID
    with pytest.raises(EventInvalid):
        parse_event(event("evt_1\n", "pay_1"))
    with pytest.raises(EventInvalid):
        parse_event(event("evt_1", "pay_1\n"))
    # An order id or currency with a newline names no order: kept, never matched.
    doc = orjson.loads(event("evt_2", "pay_2"))
    doc["data"]["order_id"] = ULID + "\n"
    doc["data"]["currency"] = "EUR\n"
    parsed = parse_event(orjson.dumps(doc))
    assert parsed.order_id is None and parsed.currency is None


def raw_request(port: int, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, buf
            buf += chunk
    return int(buf.split(b" ", 2)[1]), buf


async def test_a_path_with_a_trailing_newline_matches_no_route(
    gate: GateProcess, client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=5)
    orders_before = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
    body = b'{"quantity": 1}'
    reserve = (
        f"POST /v1/deals/{deal_id}/reservations%0A HTTP/1.1\r\nHost: gate\r\n"
        f"Authorization: Bearer {token(5150)}\r\nIdempotency-Key: newline-path-01\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    status, answer = raw_request(gate.port, reserve)
    assert status == 404, answer  # was 201: the fast lane's regex took it
    view = f"GET /v1/deals/{deal_id}%0A HTTP/1.1\r\nHost: gate\r\nConnection: close\r\n\r\n"
    status, answer = raw_request(gate.port, view.encode())
    assert status == 404, answer
    admin = (
        f"GET /v1/admin/deals/{deal_id}%0A HTTP/1.1\r\nHost: gate\r\n"
        f"Authorization: Bearer {ADMIN_TOKEN}\r\nConnection: close\r\n\r\n"
    )
    status, answer = raw_request(gate.port, admin.encode())
    assert status == 404, answer
    assert (
        await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        == orders_before
    )
    assert (await redis_available(rds, deal_id))[0] in (None, 5)
