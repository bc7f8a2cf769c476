"""The invariant checker (gate/inventory/check.py) on a deal with holding, paid and cancelled
orders across buckets: the per-bucket held and sold it derives from the orders
(summed by the database) match the orders as read here, and seeded disagreements are
each reported."""

from __future__ import annotations

from collections import defaultdict

import redis.asyncio as aioredis

from gate.inventory.check import check_deal
from gate.payments.signing import decode_secret
from gate.store.db import Database
from tests.payments_support import event_body, post_webhook, signed
from tests.support import WEBHOOK_SECRET, Client, buyer, create_deal, reserve


async def _orders_by_bucket(
    db: Database, deal_id: int, nb: int
) -> tuple[dict[int, int], dict[int, int]]:
    held: dict[int, int] = defaultdict(int)
    sold: dict[int, int] = defaultdict(int)
    rows = await db.fetchall(
        "SELECT status, alloc FROM orders WHERE deal_id = %s"
        " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')",
        (deal_id,),
    )
    for status, alloc in rows:
        for part in str(alloc).split(","):
            b, q = (int(x) for x in part.split(":"))
            (sold if status == "PAID" else held)[b % nb] += q
    return dict(held), dict(sold)


async def test_held_and_sold_per_bucket_follow_the_orders(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=40, buckets=4, max_per_order=3)
    base = 8_100_000 + deal_id * 100
    made = []
    for i in range(12):
        r = await reserve(client, deal_id, base + i, f"check-{deal_id}-{i:03d}", 1 + i % 3)
        assert r.status_code == 201, r.text
        made.append((base + i, r.json()))
    # Four paid, two cancelled, the rest holding.
    for user, order in made[:4]:
        body = event_body(
            "payment.succeeded", order["order_id"], f"pi_check_{user}", order["amount"], "EUR"
        )
        paid = await post_webhook(client, body, signed(body, decode_secret(WEBHOOK_SECRET)))
        assert paid.status_code == 200 and paid.json()["outcome"] == "applied", paid.text
    for user, order in made[4:6]:
        r = await client.post(f"/v1/orders/{order['order_id']}/cancel", headers=buyer(user))
        assert r.status_code == 200, r.text

    report = await check_deal(db, rds, deal_id)
    assert report["invariant"]["ok"], report["invariant"]["breaches"]
    held, sold = await _orders_by_bucket(db, deal_id, 4)
    rows = {r["bucket"]: r for r in report["bucket_rows"]}
    assert {b: r["held"] for b, r in rows.items() if r["held"]} == held
    assert {b: r["sold"] for b, r in rows.items() if r["sold"]} == sold
    units = [o["quantity"] for _, o in made]
    assert report["orders"] == {"held": sum(units[6:]), "sold": sum(units[:4])}

    # An allocation that does not add up to its order's quantity, and a bucket row
    # whose held count the orders do not explain, are each reported.
    victim = made[7][1]["order_id"]
    (alloc,) = await db.fetchone("SELECT alloc FROM orders WHERE id = %s", (victim,)) or ("",)
    bucket = int(str(alloc).split(":")[0])
    await db.execute("UPDATE orders SET alloc = %s WHERE id = %s", (f"{bucket}:9", victim))
    try:
        breaches = (await check_deal(db, rds, deal_id))["invariant"]["breaches"]
    finally:
        await db.execute("UPDATE orders SET alloc = %s WHERE id = %s", (alloc, victim))
    quantity = made[7][1]["quantity"]
    expected = f"order allocation '{bucket}:9' does not add up to quantity {quantity}"
    assert expected in breaches, breaches
    assert any(b.startswith(f"bucket {bucket}: held ") for b in breaches), breaches
    assert (await check_deal(db, rds, deal_id))["invariant"]["ok"]


async def test_an_absent_empty_bucket_is_not_drift(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """The scripts read an absent bucket field as 0, and the resync loop writes only
    buckets that differ: a bucket hash lost at the end of a sale must not read as a
    breach forever."""
    from gate.store.keys import deal_keys

    deal_id = await create_deal(client, stock=2, buckets=2)
    for user in (9_310_001, 9_310_002):
        assert (await reserve(client, deal_id, user, f"absent-{user}")).status_code == 201
    await rds.hdel(deal_keys(deal_id).buckets, "0")
    report = await check_deal(db, rds, deal_id)
    assert report["redis"]["compared"], report["redis"]
    assert report["redis"]["mismatches"] == [] and report["invariant"]["ok"], report
