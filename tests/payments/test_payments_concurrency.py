"""The same event delivered many times at once: one transition, one outbox row."""

from __future__ import annotations

import asyncio

import orjson
import redis.asyncio as aioredis

from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import (
    SandboxClient,
    counts,
    new_order,
    order_row,
    post_webhook,
    signed,
    start_payment,
    wait_status,
)
from tests.support import Client, assert_invariants, buyer, create_deal

COPIES = 50

# Fixtures shared by the payment modules (the shared conftest is the core's).
pay_client = ps.pay_client
sandbox = ps.sandbox
pay_stack = ps.pay_stack


async def _paid_but_held(
    client: Client, sb: SandboxClient, deal: int, user: int
) -> tuple[str, str]:
    order_id = await new_order(client, deal, user)
    session = await start_payment(client, order_id, user)
    await sb.configure(mode="hold")
    await sb.pay(session["session_id"], "succeed")
    [event] = await sb.events(order_id, "payment.succeeded")
    return order_id, str(event["id"])


async def test_same_event_fifty_times_concurrently(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=3, buckets=2, unit_price=120)
    order_id, event_id = await _paid_but_held(pay_client, sandbox, deal, 4701)
    [statuses] = await sandbox.deliver([event_id], copies=COPIES, concurrent=True)
    assert statuses == [200] * COPIES
    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 120
    c = await counts(db, order_id)
    assert c["events"] == 1
    assert c["outbox"] == 1
    pay_rows = await db.fetchall(
        "SELECT COUNT(*) FROM inventory_ledger WHERE order_id = %s AND reason = 'pay'",
        (order_id,),
    )
    assert int(pay_rows[0][0]) == 1
    await assert_invariants(db, rds, deal)


async def test_same_late_event_fifty_times_concurrently(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=3, unit_price=130)
    order_id, event_id = await _paid_but_held(pay_client, sandbox, deal, 4711)
    r = await pay_client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(4711))
    assert r.status_code == 200
    [event] = [e for e in await sandbox.events(order_id) if e["id"] == event_id]
    body = orjson.dumps(event["body"])
    headers = signed(body)
    results = await asyncio.gather(
        *(post_webhook(pay_client, body, headers) for _ in range(COPIES))
    )
    assert [x.status_code for x in results] == [200] * COPIES
    await wait_status(db, order_id, "PAID")
    retakes = await db.fetchall(
        "SELECT COUNT(DISTINCT op_id), SUM(d_sold) FROM inventory_ledger"
        " WHERE order_id = %s AND reason = 'late_pay'",
        (order_id,),
    )
    assert (int(retakes[0][0]), int(retakes[0][1])) == (1, 1)
    topics = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
    )
    assert [t[0] for t in topics] == ["order.cancelled", "order.paid"]
    assert (await order_row(db, order_id))["paid_amount"] == 130
    await assert_invariants(db, rds, deal)
