"""The post-run verifier: passes a clean sale, catches a seeded oversell, a seeded
Redis/DB drift, a lost order and ghost stock."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from gate.store.db import Database
from gate.store.keys import deal_keys
from loadtest.record import ClientRecord
from loadtest.verify import verify_gate_deal
from tests.loadtest_support import created, crowd, run_module, write_record
from tests.support import ADMIN, Client, create_deal, free_port, settled_report


async def sold_out_deal(client: Client, stock: int, buckets: int, base: int) -> tuple[int, list]:
    deal_id = await create_deal(client, stock=stock, buckets=buckets)
    answers = await crowd(client, deal_id, range(base, base + 3 * stock), f"vfy{deal_id}")
    orders = [(o, u, deal_id) for o, u in created(answers)]
    assert len(orders) == stock
    return deal_id, orders


async def test_a_clean_sale_passes_with_its_record(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], tmp_path: Path
) -> None:
    deal_id, orders = await sold_out_deal(client, 20, 4, 910_000)
    record = ClientRecord(deals={"flash": deal_id}, created=orders)
    record.outcomes[deal_id].update({"201": 20, "SOLD_OUT": 40})

    verdict = await verify_gate_deal(db, rds, deal_id, record, settle_seconds=10)
    assert verdict["ok"], verdict["breaches"]
    assert verdict["numbers"] == {
        "total": 20,
        "available": 0,
        "ordered": 20,
        "oversold": 0,
        "lost": 0,
        "phantom": 0,
    }
    assert verdict["states"] == {"PENDING_PAYMENT": {"count": 20, "units": 20}}
    assert verdict["redis"] == "equal"
    assert verdict["client"]["client_201"] == 20 and verdict["client"]["client_missing"] == 0

    path = write_record(tmp_path / "client.json", {"flash": deal_id}, orders)
    out = run_module(env, "loadtest.verify", "--record", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"deal {deal_id} [flash]: OK" in out.stdout
    assert "oversold=0 lost=0  redis: equal" in out.stdout
    assert "verifier: all checks hold" in out.stdout


async def test_a_seeded_oversell_is_caught(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id, _ = await sold_out_deal(client, 10, 2, 920_000)
    # An order that took a unit the deal did not have: written behind the gate's back,
    # exactly what an oversell looks like in the tables.
    await db.execute(
        "INSERT INTO orders (id, deal_id, user_id, quantity, unit_price, amount, currency,"
        " title, status, alloc, idempotency_key, request_fingerprint, expires_at)"
        " VALUES ('01SEEDEDOVERSELL0000000000', %s, 929999, 1, 500, 500, 'EUR', 'x',"
        " 'PENDING_PAYMENT', '0:1', 'seeded-oversell', %s, NOW(6) + INTERVAL 1 HOUR)",
        (deal_id, "0" * 32),
    )
    try:
        verdict = await verify_gate_deal(db, rds, deal_id, None, settle_seconds=1)
        assert not verdict["ok"]
        assert verdict["numbers"]["oversold"] == 1
        assert any(
            b.startswith("oversold: orders keep 11 units of 10") for b in verdict["breaches"]
        )

        out = run_module(env, "loadtest.verify", "--deal", str(deal_id), "--settle-seconds", "1")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "BREACH" in out.stdout and "oversold=1" in out.stdout
    finally:
        await db.execute("DELETE FROM orders WHERE id = '01SEEDEDOVERSELL0000000000'")
    assert (await verify_gate_deal(db, rds, deal_id, None, settle_seconds=5))["ok"]


async def test_a_seeded_redis_drift_is_caught(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=30, buckets=3)
    answers = await crowd(client, deal_id, range(930_000, 930_010), f"drift{deal_id}")
    assert len(created(answers)) == 10
    await settled_report(db, rds, deal_id)
    # The resync loop repairs drift within a second; keep it away from this deal. Every
    # gate's passes skip a deal whose sync lock is taken; one already past the lock
    # ends well within half a second.
    keys = deal_keys(deal_id)
    await rds.set(keys.sync_lock, "test", px=60_000)
    await asyncio.sleep(0.5)
    await rds.hincrby(keys.buckets, "1", 3)
    await rds.hincrby(keys.meta, "avail", 3)
    try:
        verdict = await verify_gate_deal(db, rds, deal_id, None, settle_seconds=1)
        assert not verdict["ok"]
        assert verdict["redis"] == "DRIFT"
        assert any(b.startswith("redis: bucket 1 has") for b in verdict["breaches"])
        assert any(b.startswith("redis: total 23, database 20") for b in verdict["breaches"])

        out = run_module(env, "loadtest.verify", "--deal", str(deal_id), "--settle-seconds", "1")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "redis: DRIFT" in out.stdout
    finally:
        await rds.delete(keys.sync_lock)
    report = await settled_report(db, rds, deal_id)
    assert report["invariant"]["ok"], report["invariant"]["breaches"]


async def test_the_record_catches_lost_orders_and_ghost_stock(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=5, buckets=1)
    answers = await crowd(client, deal_id, range(940_000, 940_003), f"ghost{deal_id}")
    orders = [(o, u, deal_id) for o, u in created(answers)]
    assert len(orders) == 3

    # A client was told 201 for an order the database does not have.
    lost: Any = ClientRecord(created=[*orders, ("01LOSTORDER000000000000000", 940_099, deal_id)])
    verdict = await verify_gate_deal(db, rds, deal_id, lost, settle_seconds=1)
    assert not verdict["ok"]
    assert any(b.startswith("lost order: a client got 201 for 01LOST") for b in verdict["breaches"])

    # Clients were told SOLD_OUT while 2 units were never sold nor released.
    ghost = ClientRecord(created=orders)
    ghost.outcomes[deal_id].update({"201": 3, "SOLD_OUT": 7})
    verdict = await verify_gate_deal(db, rds, deal_id, ghost, settle_seconds=1)
    assert not verdict["ok"]
    assert any(b.startswith("ghost stock: clients were told SOLD_OUT") for b in verdict["breaches"])
    # One shed buyer (503) explains one unit coming back late, not two.
    shed = ClientRecord(created=orders)
    shed.outcomes[deal_id].update({"201": 3, "SOLD_OUT": 7, "OVERLOADED": 1})
    verdict = await verify_gate_deal(db, rds, deal_id, shed, settle_seconds=1)
    assert any(b.startswith("ghost stock: clients were told SOLD_OUT") for b in verdict["breaches"])
    shed.outcomes[deal_id]["OVERLOADED"] = 2
    verdict = await verify_gate_deal(db, rds, deal_id, shed, settle_seconds=1)
    assert verdict["ok"], verdict["breaches"]

    # An unreachable Redis is a failed check, not "nothing to compare".
    nowhere = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True)
    try:
        verdict = await verify_gate_deal(db, nowhere, deal_id, None, settle_seconds=0.5)
    finally:
        await nowhere.aclose()
    assert any(b.startswith("redis: unreachable") for b in verdict["breaches"])

    # Units raised with their ledger rows (as a bug in an adjustment path would):
    # every counter agrees, only the stock the run created the deal with tells.
    raised = await client.post(
        f"/v1/admin/deals/{deal_id}/stock", json={"delta": 2, "reason": "test"}, headers=ADMIN
    )
    assert raised.status_code == 200, raised.text
    inflated = ClientRecord(created=orders, stocks={deal_id: 5})
    verdict = await verify_gate_deal(db, rds, deal_id, inflated, settle_seconds=1)
    changed = "stock changed: the deal was created with 5"
    assert any(b.startswith(changed) for b in verdict["breaches"]), verdict["breaches"]

    # A violation a client saw (two orders for one key) fails the run as a whole.
    out_record = ClientRecord(created=orders, violations=["key k: 2 answers 201"])
    verdict = await verify_gate_deal(db, rds, deal_id, out_record, settle_seconds=1)
    assert verdict["ok"]
    from loadtest.verify import finish

    assert finish([verdict], out_record)["ok"] is False


async def test_callback_answers_tell_a_lost_payment_from_an_undelivered_one(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """The record keeps each callback delivery's answer: a 2xx for an event the gate
    has no payment_events row for is a lost payment (a breach); a payment no delivery
    got a 2xx for is only reported (the gate never took it)."""
    deal_id = await create_deal(client, stock=5, buckets=1)
    answers = await crowd(client, deal_id, range(941_000, 941_002), f"lost{deal_id}")
    orders = [(o, u, deal_id) for o, u in created(answers)]
    assert len(orders) == 2
    (acked_order, _, _), (unanswered_order, _, _) = orders

    lost = ClientRecord(
        created=orders,
        deliveries=[(acked_order, deal_id, f"evt_lost_{deal_id}", "payment.succeeded", 200)],
    )
    verdict = await verify_gate_deal(db, rds, deal_id, lost, settle_seconds=1)
    assert not verdict["ok"]
    assert any(
        b.startswith(f"payment lost: the gate answered 200 to event evt_lost_{deal_id}")
        for b in verdict["breaches"]
    ), verdict["breaches"]

    undelivered = ClientRecord(
        created=orders,
        deliveries=[
            (unanswered_order, deal_id, f"evt_none_{deal_id}", "payment.succeeded", 0),
            (unanswered_order, deal_id, f"evt_none_{deal_id}", "payment.succeeded", 503),
        ],
        unpaid=[orders[1]],
    )
    verdict = await verify_gate_deal(db, rds, deal_id, undelivered, settle_seconds=1)
    assert verdict["ok"], verdict["breaches"]
    assert verdict["client"]["deliveries"] == {"none": 1, "503": 1}
    assert verdict["client"]["unpaid"] == 1
    assert any("got no 2xx on any delivery" in w for w in verdict["client"]["warnings"])
