"""Webhook authenticity: Standard Webhooks signatures checked on the raw bytes, ±300 s,
several secrets for rotation; every rejection is a 401 (400 for an unreadable but
genuine body) and changes nothing."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from datetime import UTC, datetime

import orjson
import pytest
from standardwebhooks.webhooks import Webhook

from gate.payments.signing import WebhookRejected, sign, sign_headers, verify
from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import (
    NEW_KEY,
    NEW_SECRET,
    OLD_KEY,
    OTHER_KEY,
    counts,
    event_body,
    new_order,
    order_row,
    post_webhook,
    signed,
)
from tests.support import Client, create_deal

KEYS = (OLD_KEY, NEW_KEY)

# Fixtures shared by the payment modules (the shared conftest is the core's).
pay_client = ps.pay_client
pay_stack = ps.pay_stack


def test_library_signatures_verify_here_and_ours_there() -> None:
    body = b'{"id":"evt_1","type":"payment.succeeded","data":{}}'
    now = int(time.time())
    lib = Webhook(NEW_SECRET)
    header = lib.sign("msg_1", datetime.fromtimestamp(now, UTC), body.decode())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(now), "webhook-signature": header}
    assert verify(KEYS, headers, body, now) == "msg_1"
    ours = sign_headers([NEW_KEY], "msg_1", now, body)
    lib.verify(body, ours)


@pytest.mark.parametrize(
    "change",
    ["forged", "wrong_secret", "tampered", "swapped_id", "old_301", "ahead_301", "bad_ts"],
)
def test_verify_rejects(change: str) -> None:
    body = b'{"id":"evt_2"}'
    now = 1_800_000_000
    ts, mid, key, sent = now, "msg_2", NEW_KEY, body
    if change == "wrong_secret":
        key = OTHER_KEY
    headers = sign_headers([key], mid, ts, body)
    if change == "forged":
        headers["webhook-signature"] = "v1," + base64.b64encode(b"\0" * 32).decode()
    elif change == "tampered":
        sent = body.replace(b"2", b"3")
    elif change == "swapped_id":
        headers["webhook-id"] = "msg_3"
    elif change == "old_301":
        headers = sign_headers([key], mid, now - 301, body)
    elif change == "ahead_301":
        headers = sign_headers([key], mid, now + 301, body)
    elif change == "bad_ts":
        headers = sign_headers([key], mid, now, body)
        headers["webhook-timestamp"] = f"{now}.0"
    with pytest.raises(WebhookRejected):
        verify(KEYS, headers, sent, now)


def test_verify_accepts_the_window_edges_and_rotation() -> None:
    body = b"{}"
    now = 1_800_000_000
    for ts in (now - 300, now + 300):
        assert verify(KEYS, sign_headers([OLD_KEY], "m", ts, body), body, now) == "m"
    pair = " ".join(["v1,bm90LWEtc2lnbmF0dXJl", sign(OLD_KEY, "m", now, body)])
    headers = {"webhook-id": "m", "webhook-timestamp": str(now), "webhook-signature": pair}
    assert verify(KEYS, headers, body, now) == "m"
    headers["webhook-signature"] = "v2," + sign(NEW_KEY, "m", now, body)[3:]
    with pytest.raises(WebhookRejected):
        verify(KEYS, headers, body, now)
    # A dot in the id could move bytes between id and timestamp under one signature.
    with pytest.raises(WebhookRejected):
        verify(KEYS, sign_headers([NEW_KEY], "m.1", now, body), body, now)


async def test_rejected_callbacks_change_nothing(pay_client: Client, db: Database) -> None:
    deal = await create_deal(pay_client, stock=2, unit_price=500)
    order_id = await new_order(pay_client, deal, 4101)
    body = event_body("payment.succeeded", order_id, "pi_sig_1", 500)
    good = signed(body)
    before = await counts(db, order_id)
    now = int(time.time())
    # Each case is signed just before it is sent: a timestamp computed once would
    # drift inside the ±300 s window on a slow machine.
    cases: dict[str, Callable[[], dict[str, str]]] = {
        "forged": lambda: {
            **good,
            "webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode(),
        },
        "wrong secret": lambda: signed(body, OTHER_KEY),
        "swapped webhook-id": lambda: {**good, "webhook-id": "evt_someone_else"},
        "301 s old": lambda: signed(body, timestamp=int(time.time()) - 301),
        "301 s ahead": lambda: signed(body, timestamp=int(time.time()) + 301),
        "no signature": lambda: {k: v for k, v in good.items() if k != "webhook-signature"},
    }
    for name, make_headers in cases.items():
        r = await post_webhook(pay_client, body, make_headers())
        assert r.status_code == 401, (name, r.text)
        assert r.headers["content-type"] == "application/problem+json"
    tampered = body.replace(b'"amount":500', b'"amount":5')
    r = await post_webhook(pay_client, tampered, good)
    assert r.status_code == 401
    assert await counts(db, order_id) == before
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"

    # A rotated pair: one entry from a retired key, one valid: accepted, applied once.
    pair = dict(good)
    pair["webhook-signature"] = " ".join(
        [
            sign(OTHER_KEY, good["webhook-id"], now, body),
            sign(OLD_KEY, good["webhook-id"], now, body),
        ]
    )
    pair["webhook-timestamp"] = str(now)
    r = await post_webhook(pay_client, body, pair)
    assert r.status_code == 200, r.text
    assert (await order_row(db, order_id))["status"] == "PAID"


async def test_genuine_but_unreadable_bodies_are_400(pay_client: Client, db: Database) -> None:
    before = await db.fetchone("SELECT COUNT(*) FROM payment_events")
    for body in (
        b"not json",
        b"\xff\xfe\x00",
        b"[1, 2]",
        b'{"id": 7, "type": "payment.succeeded", "data": {}}',
        orjson.dumps(
            {
                "id": "evt_bad_amount",
                "type": "payment.succeeded",
                "data": {"payment_id": "pi_x", "amount": "500"},
            }
        ),
        orjson.dumps({"id": "evt_no_payment", "type": "payment.succeeded", "data": {}}),
        # Signed and well formed, but from after the year 9999 (was a 500).
        orjson.dumps(
            {
                "id": "evt_far_future",
                "type": "payment.succeeded",
                "created": 2**39,
                "data": {"payment_id": "pi_x", "amount": 500},
            }
        ),
    ):
        r = await post_webhook(pay_client, body, signed(body, msg_id="evt_unreadable"))
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == "INVALID_REQUEST"
    assert await db.fetchone("SELECT COUNT(*) FROM payment_events") == before
    big = b" " * 70_000
    r = await post_webhook(pay_client, big, signed(big, msg_id="evt_big"))
    assert r.status_code == 413
