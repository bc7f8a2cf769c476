"""Idempotency-Key semantics: one order per key and user, replays, mismatches."""

from __future__ import annotations

import asyncio
from collections import Counter

import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import Client, assert_invariants, buyer, create_deal, reserve


async def test_fifty_concurrent_requests_with_one_key_make_one_order(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=10)
    user, key = 501, "same-key-0000001"
    responses = await asyncio.gather(*(reserve(client, deal_id, user, key) for _ in range(50)))
    statuses = Counter(r.status_code for r in responses)
    assert statuses[201] == 1, statuses
    assert set(statuses) <= {200, 201, 409}, statuses
    for r in responses:
        if r.status_code == 409:
            assert r.json()["code"] == "IDEMPOTENCY_IN_PROGRESS"
        if r.status_code == 200:
            assert r.headers["Idempotent-Replayed"] == "true"
    bodies = [r.json() for r in responses if r.status_code in (200, 201)]
    assert len({b["order_id"] for b in bodies}) == 1
    assert all(b == bodies[0] for b in bodies)
    rows = await db.fetchone(
        "SELECT COUNT(*) FROM orders WHERE user_id = %s AND idempotency_key = %s", (user, key)
    )
    assert rows is not None and int(rows[0]) == 1

    # A replay after the fact returns the same body with the replay header.
    again = await reserve(client, deal_id, user, key)
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == bodies[0]

    # The same key from another buyer is another key.
    other = await reserve(client, deal_id, user + 1, key)
    assert other.status_code == 201
    assert other.json()["order_id"] != bodies[0]["order_id"]
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 2


async def test_same_key_with_another_body_is_a_mismatch(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=10, max_per_order=3)
    other_deal = await create_deal(client, stock=10, max_per_order=3)
    first = await reserve(client, deal_id, 601, "mismatch-key-01", quantity=1)
    assert first.status_code == 201
    changed = await reserve(client, deal_id, 601, "mismatch-key-01", quantity=2)
    assert changed.status_code == 422
    assert changed.headers["content-type"] == "application/problem+json"
    assert changed.json()["code"] == "IDEMPOTENCY_MISMATCH"
    # Keys are scoped per buyer, not per deal: reusing it on another deal is a mismatch.
    elsewhere = await reserve(client, other_deal, 601, "mismatch-key-01", quantity=1)
    assert elsewhere.status_code == 422
    assert elsewhere.json()["code"] == "IDEMPOTENCY_MISMATCH"
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 1
    report = await assert_invariants(db, rds, other_deal)
    assert report["totals"]["held"] == 0

    # Also when that deal is sold out to a buyer it knows: the refusal of a known buyer
    # asks the database, which finds the key on the first deal.
    sold = await create_deal(client, stock=1)
    assert (await reserve(client, sold, 601, "mismatch-key-02")).status_code == 201
    reused = await reserve(client, sold, 601, "mismatch-key-01", quantity=1)
    assert reused.status_code == 422, reused.text
    assert reused.json()["code"] == "IDEMPOTENCY_MISMATCH"
    report = await assert_invariants(db, rds, sold)
    assert report["totals"]["held"] == 1


async def test_replay_survives_a_redis_flush(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """With Redis's record gone, the database's unique key still answers the replay."""
    deal_id = await create_deal(client, stock=5)
    first = await reserve(client, deal_id, 701, "flush-replay-01")
    assert first.status_code == 201
    await rds.flushdb()
    again = await reserve(client, deal_id, 701, "flush-replay-01")
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    order = await client.get(f"/v1/orders/{first.json()['order_id']}", headers=buyer(701))
    assert order.status_code == 200
    assert order.json()["status"] == "PENDING_PAYMENT"
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 1


async def test_keys_differing_only_by_case_are_two_keys(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """Redis compares keys byte for byte, and so does the database (db/007): a key
    that differs from the first only in case passes Redis and is not answered with the
    first buyer click's order by a case-insensitive unique key."""
    deal_id = await create_deal(client, stock=5)
    user, keys = 801, ("Case-Key-AbC-01", "case-key-abc-01", "CASE-KEY-ABC-01")
    answers = [await reserve(client, deal_id, user, k) for k in keys]
    assert [r.status_code for r in answers] == [201, 201, 201], [r.text for r in answers]
    orders = [r.json()["order_id"] for r in answers]
    assert len(set(orders)) == 3
    rows = await db.fetchall(
        "SELECT idempotency_key, id FROM orders WHERE user_id = %s AND deal_id = %s",
        (user, deal_id),
    )
    assert dict((str(k), str(o)) for k, o in rows) == dict(zip(keys, orders, strict=True))

    # Replays answer each key with its own order, from Redis and, with Redis's record
    # gone, from the database's unique key.
    for flush_first in (False, True):
        if flush_first:
            await rds.flushdb()
        for key, order_id in zip(keys, orders, strict=True):
            again = await reserve(client, deal_id, user, key)
            assert again.status_code == 200, again.text
            assert again.json()["order_id"] == order_id
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 3
