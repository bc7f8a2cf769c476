"""Bulkheads: slow reservations exhaust only their share of the pool; the rest of the
gate (order reads, cancels, payment callbacks, readiness) keeps answering, and new
reservations are refused at once, not queued."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.payments.signing import decode_secret
from gate.store.db import Database
from tests.payments_support import event_body, post_webhook, signed
from tests.support import (
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    Resp,
    assert_invariants,
    buyer,
    create_deal,
    locked_buckets,
    reserve,
    wait_for_reserve_statement,
)

pytestmark = pytest.mark.slow


async def test_exhausted_reservation_pool_sheds_load_but_not_reads(
    env: dict[str, str], db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    gate = GateProcess(
        {
            **env,
            "GATE_DB_POOL_MAX": "6",
            "GATE_DB_RESERVATION_POOL_MAX": "2",
            "GATE_DB_RESERVATION_ACQUIRE_SECONDS": "0.3",
            "GATE_RESERVATION_INFLIGHT_MAX": "12",
            # Groups of at most 4: a second group leaves beside the first with a single
            # reservation queued (a quarter of the maximum, gate/reserve/groups.py), so each
            # slow reservation below takes a connection of its own.
            "GATE_RESERVATION_GROUP_MAX": "4",
        }
    )
    await asyncio.to_thread(gate.wait_ready)
    client = Client(gate.url)
    try:
        hot = await create_deal(client, stock=50)
        calm = await create_deal(client, stock=5)
        held = await reserve(client, calm, 51_000, "bulkhead-calm-001")
        other = await reserve(client, calm, 51_001, "bulkhead-calm-002")
        assert held.status_code == other.status_code == 201
        async with locked_buckets(settings, hot) as cur:
            # Two slow reservations take the reservations' whole share of the pool. One
            # after the other: sent together, they would share one connection as a
            # group (gate/reserve/groups.py).
            slow: list[asyncio.Future[Resp]] = []
            threads: list[int] = []
            for i in range(2):
                slow.append(
                    asyncio.ensure_future(reserve(client, hot, 51_100 + i, f"bulkhead-slow-{i}"))
                )
                threads.append(await wait_for_reserve_statement(cur, hot, exclude=threads))
            await asyncio.sleep(0.2)
            # New reservations are refused at once: 503, not queued behind the lock.
            shed = await asyncio.gather(
                *(reserve(client, hot, 51_200 + i, f"bulkhead-shed-{i:03d}") for i in range(20))
            )
            statuses = Counter(r.status_code for r in shed)
            assert statuses == Counter({503: 20}), statuses
            details = {r.json()["detail"] for r in shed}
            assert all(r.json()["code"] == "OVERLOADED" for r in shed)
            assert int(shed[0].headers["Retry-After"]) >= 1
            # Both refusals show up: the pool share, and the per-process in-flight cap.
            assert any(
                "share of the database pool" in d or "Database unavailable" in d for d in details
            ), details
            assert any("Too many reservations in progress" in d for d in details), details
            # Reads, cancels and readiness still have connections.
            order_id = held.json()["order_id"]
            read = await client.get(f"/v1/orders/{order_id}", headers=buyer(51_000))
            assert read.status_code == 200
            cancel = await client.post(
                f"/v1/orders/{other.json()['order_id']}/cancel", headers=buyer(51_001)
            )
            assert cancel.status_code == 200 and cancel.json()["status"] == "CANCELLED"
            # A payment callback is applied too: it uses the rest of the pool.
            row = await db.fetchone(
                "SELECT amount, currency FROM orders WHERE id = %s", (order_id,)
            )
            assert row is not None
            body = event_body(
                "payment.succeeded", order_id, "pi_bulkhead_1", int(row[0]), str(row[1])
            )
            paid = await post_webhook(client, body, signed(body, decode_secret(WEBHOOK_SECRET)))
            assert paid.status_code == 200 and paid.json()["outcome"] == "applied", paid.text
            status = await db.fetchone("SELECT status FROM orders WHERE id = %s", (order_id,))
            assert status is not None and status[0] == "PAID"
            ready = await client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "degraded"
            assert ready.json()["db_pool"]["reservation_in_use"] == 2
        done = await asyncio.gather(*slow)
        assert {r.status_code for r in done} <= {201, 503}
        # The refused admissions were given back: Redis equals the database.
        await assert_invariants(db, rds, hot, timeout_seconds=15)
        await assert_invariants(db, rds, calm)
    finally:
        await client.close()
        gate.stop()
