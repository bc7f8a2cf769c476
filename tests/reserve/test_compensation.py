"""A database failure after the Redis decrement: Redis restored exactly once, no order."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import (
    Client,
    assert_invariants,
    create_deal,
    db_available,
    locked_buckets,
    redis_available,
    reserve,
    wait_for_reserve_statement,
)


async def _orders(db: Database, deal_id: int) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
    assert row is not None
    return int(row[0])


async def test_failing_statement_restores_redis_once(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=20, buckets=2, per_user_limit=5, max_per_order=2)
    assert (await reserve(client, deal_id, 801, "fail-warmup-001")).status_code == 201
    before_total, before_buckets = await redis_available(rds, deal_id)
    users = [802 + i for i in range(5)]
    # A real failing statement: every order insert for this deal is refused.
    await db.execute(
        f"CREATE TRIGGER fail_orders_{deal_id} BEFORE INSERT ON orders FOR EACH ROW"
        f" BEGIN IF NEW.deal_id = {deal_id} THEN"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected failure'; END IF; END"
    )
    try:
        responses = await asyncio.gather(
            *(reserve(client, deal_id, u, f"fail-key-{u:04d}", 2) for u in users)
        )
    finally:
        await db.execute(f"DROP TRIGGER fail_orders_{deal_id}")
    for r in responses:
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "OVERLOADED"
        assert int(r.headers["Retry-After"]) >= 1
    assert await _orders(db, deal_id) == 1
    after_total, after_buckets = await redis_available(rds, deal_id)
    assert (after_total, after_buckets) == (before_total, before_buckets)
    # Per-user quota given back too: nobody is left holding phantom units.
    assert await rds.hmget(deal_keys(deal_id).users, [str(u) for u in users]) == [None] * 5
    assert await rds.hlen(deal_keys(deal_id).inflight) == 0
    # The buyer's keys are free again: the same key now succeeds.
    again = await reserve(client, deal_id, 802, "fail-key-0802", 2)
    assert again.status_code == 201, again.text
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 3


async def test_killed_connection_restores_redis_once(
    client: Client, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=10, buckets=1)
    before = await redis_available(rds, deal_id)
    async with locked_buckets(settings, deal_id) as cur:
        pending = asyncio.ensure_future(reserve(client, deal_id, 901, "killed-conn-0001"))
        thread = await wait_for_reserve_statement(cur, deal_id)
        # Mid-transaction, the database connection dies.
        await cur.execute(f"KILL {thread}")
    response = await pending
    assert response.status_code == 503, response.text
    assert response.json()["code"] == "OVERLOADED"
    assert await _orders(db, deal_id) == 0
    assert await redis_available(rds, deal_id) == before
    assert await rds.hlen(deal_keys(deal_id).inflight) == 0
    assert (await db_available(db, deal_id)) == {0: 10}
    # The unit sells normally afterwards.
    assert (await reserve(client, deal_id, 901, "killed-conn-0002")).status_code == 201
    await assert_invariants(db, rds, deal_id)


async def test_lock_wait_timeout_is_retried(
    client: Client, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """A bucket row locked past one lock-wait timeout: the transaction is retried and
    succeeds once the lock goes, within the request's deadline."""
    deal_id = await create_deal(client, stock=3, buckets=1)
    async with locked_buckets(settings, deal_id):
        pending = asyncio.ensure_future(reserve(client, deal_id, 951, "retry-lock-0001"))
        # Longer than the gate's 2 s lock wait, shorter than its 5 s deadline.
        await asyncio.sleep(2.6)
    response = await pending
    assert response.status_code == 201, response.text
    assert await _orders(db, deal_id) == 1
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 1
