"""Cancel gives the stock back to the buckets it came from; it then sells again."""

from __future__ import annotations

import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import (
    Client,
    assert_invariants,
    buyer,
    create_deal,
    db_available,
    redis_available,
    reserve,
)


async def test_cancelled_stock_returns_to_its_own_bucket_and_sells_again(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=8, buckets=8)
    orders = []
    for i in range(8):
        r = await reserve(client, deal_id, 5000 + i, f"cancel-{deal_id}-{i:04d}")
        assert r.status_code == 201
        orders.append(r.json()["order_id"])
    sold_out = await reserve(client, deal_id, 5100, f"cancel-{deal_id}-late")
    assert sold_out.status_code == 409
    assert sold_out.json()["code"] == "SOLD_OUT"
    view = (await client.get(f"/v1/deals/{deal_id}")).json()
    assert view["sold_out"] is True and view["remaining_hint"] == 0

    victim = orders[3]
    row = await db.fetchone("SELECT alloc FROM orders WHERE id = %s", (victim,))
    assert row is not None
    bucket = int(str(row[0]).split(":")[0])

    # Another buyer cannot see, let alone cancel, this order.
    assert (
        await client.post(f"/v1/orders/{victim}/cancel", headers=buyer(5001))
    ).status_code == 404
    assert (await client.get(f"/v1/orders/{victim}", headers=buyer(5001))).status_code == 404

    cancelled = await client.post(f"/v1/orders/{victim}/cancel", headers=buyer(5003))
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "CANCELLED"
    assert await db_available(db, deal_id) == {b: int(b == bucket) for b in range(8)}
    total, buckets = await redis_available(rds, deal_id)
    assert total == 1 and buckets == {b: int(b == bucket) for b in range(8)}
    ledger = await db.fetchall(
        "SELECT bucket, d_available, d_held, reason FROM inventory_ledger WHERE order_id = %s"
        " ORDER BY id",
        (victim,),
    )
    assert [tuple(r) for r in ledger] == [(bucket, -1, 1, "reserve"), (bucket, 1, -1, "cancel")]
    outbox = await db.fetchone("SELECT topic FROM outbox WHERE aggregate_id = %s", (victim,))
    assert outbox is not None and outbox[0] == "order.cancelled"

    # Cancelling twice is a conflict, and changes nothing.
    again = await client.post(f"/v1/orders/{victim}/cancel", headers=buyer(5003))
    assert again.status_code == 409
    assert again.json()["code"] == "CONFLICT"
    assert (await redis_available(rds, deal_id))[0] == 1

    # The sold-out flag is gone: the unit sells again, from the same bucket.
    resold = await reserve(client, deal_id, 5200, f"cancel-{deal_id}-resold")
    assert resold.status_code == 201, resold.text
    row = await db.fetchone("SELECT alloc FROM orders WHERE id = %s", (resold.json()["order_id"],))
    assert row is not None and row[0] == f"{bucket}:1"
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 8, "available": 0, "held": 8, "sold": 0}

    order = await client.get(f"/v1/orders/{victim}", headers=buyer(5003))
    assert order.status_code == 200
    assert order.json()["status"] == "CANCELLED"
    assert order.json()["closed_at"] is not None
