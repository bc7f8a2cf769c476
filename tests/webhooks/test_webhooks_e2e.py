"""A sale with a shop's receiver on loopback: every paid, cancelled and expired order
reaches it, signed as Standard Webhooks (verified with the standardwebhooks library),
through refused first attempts and a gate SIGKILLed mid-delivery; deal events; a
rotation verified with both secrets.

Real gate processes, MariaDB, Redis and sockets: the receiver is an aiohttp server
on 127.0.0.1, listed in GATE_WEBHOOK_ALLOWED_HOSTS.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.standard_webhooks import parse_secret
from gate.payments.signing import decode_secret, sign_headers
from gate.store.db import Database
from tests.payments_support import event_body
from tests.support import (
    ADMIN,
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    reserve,
)
from tests.webhooks_support import (
    Receiver,
    create_endpoint,
    no_endpoints_left,
    verify,
    wait_for,
    webhook_env,
)

REFUSED_FIRST = 2
PAID, CANCELLED, EXPIRING = 6, 4, 5
INBOUND_KEY = decode_secret(WEBHOOK_SECRET)
pytestmark = pytest.mark.usefixtures("no_endpoints_left")
__all__ = ["no_endpoints_left"]


async def pay(client: Client, order_id: str, amount: int) -> None:
    body = event_body("payment.succeeded", order_id, f"pi_wh_{order_id}", amount)
    headers = sign_headers([INBOUND_KEY], f"msg_{order_id}", int(time.time()), body)
    headers["Content-Type"] = "application/json"
    r = await client.post("/v1/payments/sandbox/webhook", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["outcome"] == "applied", r.text


async def order_ids(client: Client, deal_id: int, first_user: int, count: int) -> list[str]:
    ids = []
    for i in range(count):
        r = await reserve(client, deal_id, first_user + i, f"wh-{deal_id}-{first_user + i}")
        assert r.status_code == 201, r.text
        ids.append(str(r.json()["order_id"]))
    return ids


def started(env: dict[str, str]) -> GateProcess:
    proc = GateProcess(env, workers=1)
    proc.wait_ready()
    return proc


async def test_every_order_reaches_the_shop_through_refusals_and_a_killed_gate(
    prepared: None, db: Database, rds: aioredis.Redis
) -> None:
    hang_until = [0.0]

    async def policy(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        if time.monotonic() < hang_until[0]:
            return 200, {}, 30.0  # in flight until the gate is killed
        if attempt <= REFUSED_FIRST:
            return 503, {}, 0.0
        return 204, {}, 0.0

    receiver = Receiver(policy)
    paid_only = Receiver()
    await receiver.start()
    await paid_only.start()
    env = webhook_env(GATE_WEBHOOK_ALLOWED_HOSTS="127.0.0.1,localhost")
    proc = started(env)
    client = Client(proc.url)
    try:
        endpoint = await create_endpoint(client, receiver.url, ["*"], description="the shop")
        narrow = await create_endpoint(client, paid_only.url, ["order.paid"])
        sale = await create_deal(client, stock=PAID + CANCELLED, unit_price=700, buckets=2)
        short = await create_deal(client, stock=EXPIRING, unit_price=300, hold_seconds=8)
        orders = await order_ids(client, sale, 9100, PAID + CANCELLED)
        expiring = await order_ids(client, short, 9200, EXPIRING)
        paid, cancelled = orders[:PAID], orders[PAID:]
        # The deal watcher saw the short deal sell out (its holds last 8 s).
        await wait_for(lambda: _deal_events(receiver, short), 8, 0.1)
        for order_id in paid[:3]:
            await pay(client, order_id, 700)
        # The next deliveries hang at the receiver; the gate dies with them in flight.
        hang_until[0] = time.monotonic() + 4.0
        for order_id in paid[3:]:
            await pay(client, order_id, 700)
        for i, order_id in enumerate(cancelled):
            r = await client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(9100 + PAID + i))
            assert r.status_code == 200, r.text
        # Deliveries in flight (claimed, the receiver holding them): now the gate dies.
        await wait_for(_claimed(db), 10)
        proc.kill()
        proc.stop()
        hang_until[0] = 0.0
        # A new gate: the killed one's claims lapse (timeout + 5 s) and are sent again.
        proc = started(env)
        await client.close()
        client = Client(proc.url)
        expected = {o: "order.paid" for o in paid}
        expected.update({o: "order.cancelled" for o in cancelled})
        expected.update({o: "order.expired" for o in expiring})

        def arrived() -> bool:
            got = {r.event["data"].get("order_id") for r in receiver.delivered().values()}
            return set(expected) <= got

        await wait_for(arrived, 60, 0.2)
        await wait_for(lambda: len(_deal_events(receiver, short)) >= 2, 30, 0.2)
        # Everything that reached the shop verifies with its secret, and says what happened.
        secret = endpoint["secret"]
        by_order: dict[str, list[dict[str, Any]]] = {}
        bodies: dict[str, bytes] = {}
        for r in receiver.received:
            verified = verify(secret, r)
            # A webhook-id names one body, on every retry.
            assert bodies.setdefault(r.msg_id, r.body) == r.body
            if r.status < 300 and verified["type"].startswith("order."):
                by_order.setdefault(verified["data"]["order_id"], []).append(verified)
        for order_id, event_type in expected.items():
            kinds = {e["type"] for e in by_order[order_id]}
            assert kinds == {event_type}, (order_id, kinds)
            data = by_order[order_id][0]["data"]
            deal = short if order_id in expiring else sale
            assert data["deal_id"] == deal and data["quantity"] == 1
            assert data["amount"] == (300 if deal == short else 700)
            assert data["currency"] == "EUR" and data["sequence"] == 1
            assert data["status"] == event_type.split(".")[1].upper()
        # Refused first: each event's first two attempts were answered 503.
        for msg_id, count in receiver.attempts.items():
            if msg_id in receiver.delivered():
                assert count >= REFUSED_FIRST + 1, (msg_id, count)
        # Answered 2xx once per event: nothing was sent again once delivered.
        answered = [r.msg_id for r in receiver.received if r.status < 300]
        assert len(answered) == len(set(answered))
        # The narrow endpoint received the paid orders only.
        narrow_types = {r.event["type"] for r in paid_only.delivered().values()}
        assert narrow_types == {"order.paid"}
        assert {r.event["data"]["order_id"] for r in paid_only.delivered().values()} == set(paid)
        # The deal that sold out and got its units back.
        deal_events = _deal_events(receiver, short)
        assert [e["type"] for e in deal_events[:2]] == ["deal.sold_out", "deal.available_again"]
        assert [e["data"]["sequence"] for e in deal_events[:2]] == [1, 2]

        # The database recorded each attempt: refused ones, the interrupted ones, the 2xx.
        async def settled() -> bool:
            rows = await db.fetchall(
                "SELECT status, COUNT(*) FROM webhook_deliveries WHERE endpoint_id = %s"
                " GROUP BY status",
                (endpoint["id"],),
            )
            return {str(s) for s, _ in rows} == {"delivered"}

        await wait_for(settled, 30, 0.2)
        interrupted = await db.fetchone(
            "SELECT COUNT(*) FROM webhook_attempts a JOIN webhook_deliveries d"
            " ON d.id = a.delivery_id WHERE d.endpoint_id = %s AND a.error LIKE 'interrupted%%'",
            (endpoint["id"],),
        )
        assert interrupted is not None and int(interrupted[0]) >= 1
        page = await client.get(
            f"/v1/admin/webhook-endpoints/{endpoint['id']}/deliveries?status=delivered&limit=100",
            headers=ADMIN,
        )
        assert page.status_code == 200
        shown = page.json()["deliveries"]
        assert all(len(d["attempts"]) >= REFUSED_FIRST + 1 for d in shown)
        assert all(d["attempts"][0]["http_status"] in (503, None) for d in shown)
        await assert_invariants(db, rds, sale)
        await assert_invariants(db, rds, short)
        assert narrow["events"] == ["order.paid"]
    finally:
        await client.close()
        proc.stop()
        await receiver.stop()
        await paid_only.stop()


def _claimed(db: Database) -> Any:
    async def check() -> bool:
        row = await db.fetchone("SELECT COUNT(*) FROM webhook_deliveries WHERE claim IS NOT NULL")
        return row is not None and int(row[0]) > 0

    return check


def _deal_events(receiver: Receiver, deal_id: int) -> list[dict[str, Any]]:
    events = [
        r.event
        for r in receiver.delivered().values()
        if r.event["type"].startswith("deal.") and r.event["data"]["deal_id"] == deal_id
    ]
    return sorted(events, key=lambda e: e["data"]["sequence"])


async def test_a_rotation_signs_with_both_secrets_for_the_overlap(prepared: None) -> None:
    receiver = Receiver()
    await receiver.start()
    env = webhook_env(GATE_WEBHOOK_ROTATION_OVERLAP_SECONDS="3")
    proc = started(env)
    client = Client(proc.url)
    try:
        # A type no earlier test's background work makes: only the test events come.
        endpoint = await create_endpoint(client, receiver.url, ["payment.quarantined"])
        base = f"/v1/admin/webhook-endpoints/{endpoint['id']}"
        old = endpoint["secret"]
        rotated = await client.post(base + "/rotate-secret", headers=ADMIN)
        assert rotated.status_code == 200
        new = rotated.json()["secret"]
        assert new != old and set(rotated.json()) == {"secret"}
        assert 24 <= len(parse_secret(new)) <= 64
        assert (await client.post(base + "/test", headers=ADMIN)).status_code == 202
        await wait_for(lambda: len(receiver.delivered()) == 1, 15)
        during = receiver.received[-1]
        assert len(during.signature.split(" ")) == 2
        # The shop verifies with either secret, each alone.
        assert verify(new, during)["type"] == "webhook.test"
        assert verify(old, during)["type"] == "webhook.test"
        await asyncio.sleep(3.5)
        assert (await client.post(base + "/test", headers=ADMIN)).status_code == 202
        await wait_for(lambda: len(receiver.delivered()) == 2, 15)
        after = receiver.received[-1]
        assert len(after.signature.split(" ")) == 1
        verify(new, after)
        with pytest.raises(Exception, match="signature"):
            verify(old, after)
        # The secret is never shown again, and never logged.
        shown = await client.get(base, headers=ADMIN)
        assert "secret" not in shown.json() and new not in shown.text
    finally:
        await client.close()
        proc.stop()
        await receiver.stop()
    log = proc.output()
    assert new not in log and old not in log
