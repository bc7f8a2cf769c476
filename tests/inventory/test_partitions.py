"""Deal partitions (docs/scale-out.md "Deal partitions"): one hot
deal spread over P Redis hash tags, each owning the buckets b MOD P.

What must hold, against the shared gate (real Redis, real MariaDB):
  * concurrent buyers on a P=3 deal sell exactly the stock, never more; the per-user
    quota holds exactly; an idempotent replay is answered with its first order;
  * a buyer whose partition is empty while others hold units still buys (the
    fall-over to the next partitions), and the deal says SOLD_OUT only when every
    partition is empty;
  * Redis = database per partition, and the checker behind `gate check` is clean;
  * a deal of one partition keeps exactly its keys of before;
  * `partitions` is validated and fixed: bad values are a problem+json 400 like the
    other fields, a partitioned deal refuses rebucketing and queue mode.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.codes import SyncCode
from gate.inventory.check import check_deal
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys, home_partition, partition_keys
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    Traffic,
    buyer,
    create_deal,
    db_available,
    reserve,
)

P = 3


def users_with_home(k: int, count: int, base: int) -> list[int]:
    """`count` user ids whose home partition on a P-partition deal is k."""
    found: list[int] = []
    user = base
    while len(found) < count:
        if home_partition(user, P) == k:
            found.append(user)
        user += 1
    return found


async def partitions_equal_database(
    db: Database, rds: aioredis.Redis, deal_id: int, timeout_seconds: float = 10.0
) -> dict[str, Any]:
    """Waits until nothing is in flight, then requires every partition's buckets and
    total to equal the database's (its own buckets; the others' fields 0), and the
    invariant checker (what `gate check` runs) to be clean and to have compared."""
    deadline = asyncio.get_running_loop().time() + timeout_seconds
    report: dict[str, Any] = {}
    while asyncio.get_running_loop().time() < deadline:
        report = await check_deal(db, rds, deal_id)
        if report["redis"].get("compared") and report["invariant"]["ok"]:
            break
        await asyncio.sleep(0.2)
    assert report["invariant"]["ok"], report["invariant"]["breaches"]
    assert report["redis"]["compared"], report["redis"]
    avail = await db_available(db, deal_id)
    for k in range(P):
        keys = partition_keys(deal_id, k)
        buckets = {int(b): int(v) for b, v in (await rds.hgetall(keys.buckets)).items()}
        mine = {b: a for b, a in avail.items() if b % P == k}
        assert {b: v for b, v in buckets.items() if b % P == k} == mine, (k, buckets, avail)
        assert all(v == 0 for b, v in buckets.items() if b % P != k), (k, buckets)
        assert int(await rds.hget(keys.meta, "avail") or -1) == sum(mine.values())
        assert await rds.hget(keys.meta, "pp") == str(P)
        assert await rds.hlen(keys.inflight) == 0
    return report


async def test_partitions_are_validated_shown_and_fixed(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    good = {"title": "Hot", "unit_price": 500, "currency": "EUR", "stock": 30, "buckets": 6}
    for bad in (0, 17, -1, "3", 2.5, True, [2]):
        r = await client.post("/v1/admin/deals", json={**good, "partitions": bad}, headers=ADMIN)
        assert r.status_code == 400, (bad, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "INVALID_REQUEST"
    for body in (
        {**good, "buckets": 2, "partitions": 3},
        {**good, "partitions": 2, "mode": "queue"},
    ):
        r = await client.post("/v1/admin/deals", json=body, headers=ADMIN)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/problem+json"

    one = await client.post("/v1/admin/deals", json=good, headers=ADMIN)
    assert one.status_code == 201 and one.json()["partitions"] == 1
    three = await client.post("/v1/admin/deals", json={**good, "partitions": 3}, headers=ADMIN)
    assert three.status_code == 201 and three.json()["partitions"] == 3
    deal_id = int(three.json()["id"])
    view = await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert view.json()["partitions"] == 3 and view.json()["invariant"]["ok"]

    # A deal of one partition has exactly the keys of before: no "pp", no {d:ID:k}.
    one_id = int(one.json()["id"])
    assert await rds.hget(deal_keys(one_id).meta, "pp") is None
    assert await rds.exists(partition_keys(one_id, 1).meta) == 0
    assert await rds.hget(deal_keys(one_id).meta, "avail") == "30"

    # Fixed: no rebucketing (its partitions own buckets by number).
    r = await client.put(f"/v1/admin/deals/{deal_id}/buckets", json={"count": 9}, headers=ADMIN)
    assert r.status_code == 409, r.text
    assert r.headers["content-type"] == "application/problem+json"
    row = await db.fetchone("SELECT bucket_count, partitions FROM deals WHERE id = %s", (deal_id,))
    assert row is not None and (int(row[0]), int(row[1])) == (6, 3)
    await partitions_equal_database(db, rds, deal_id)


async def test_concurrent_buyers_sell_exactly_the_stock(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    stock, limit = 120, 2
    deal_id = await create_deal(
        client, stock=stock, buckets=6, partitions=P, per_user_limit=limit, max_per_order=1
    )
    base = 71_000_000
    users = [base + i for i in range(150)]
    # Each user clicks three times with fresh keys (the quota allows two).
    attempts = [(u, f"p-{deal_id}-{u}-{n}") for n in range(3) for u in users]
    responses = await asyncio.gather(*(reserve(client, deal_id, u, key) for u, key in attempts))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {201, 409, 422, 503}, statuses
    assert statuses[201] <= stock
    codes = Counter((r.status_code, r.json()["code"]) for r in responses if r.status_code != 201)
    assert set(codes) <= {(409, "SOLD_OUT"), (422, "LIMIT_EXCEEDED"), (503, "OVERLOADED")}, codes

    won = {
        (u, key): r.json()
        for (u, key), r in zip(attempts, responses, strict=True)
        if r.status_code == 201
    }
    # Units shed with a 503 are sellable again: buy until the deal says sold out.
    extra = 0
    while len(won) < stock and extra < 10 * stock:
        u = base + 10_000 + extra
        key = f"p-{deal_id}-mop-{extra}"
        r = await reserve(client, deal_id, u, key)
        assert r.status_code in (201, 503), r.text
        if r.status_code == 201:
            won[(u, key)] = r.json()
        extra += 1
    assert len(won) == stock
    for k in range(P):
        late = users_with_home(k, 1, base + 50_000)[0]
        r = await reserve(client, deal_id, late, f"late-key-{deal_id}-{k}")
        assert r.status_code == 409 and r.json()["code"] == "SOLD_OUT", r.text

    rows = await db.fetchall(
        "SELECT user_id, SUM(quantity), COUNT(*) FROM orders WHERE deal_id = %s GROUP BY user_id",
        (deal_id,),
    )
    assert sum(int(r[1]) for r in rows) == stock
    assert max(int(r[1]) for r in rows) <= limit
    quota = await db.fetchall(
        "SELECT user_id, units FROM user_quota WHERE deal_id = %s AND units > 0", (deal_id,)
    )
    assert {int(u): int(n) for u, n in quota} == {int(r[0]): int(r[1]) for r in rows}

    # Every partition sold: the buyers were spread over the three.
    allocs = await db.fetchall("SELECT alloc FROM orders WHERE deal_id = %s", (deal_id,))
    per_partition = Counter(int(str(a[0]).split(":")[0]) % P for a in allocs)
    assert set(per_partition) == set(range(P))

    # Replays: each answered once, with the order of the first request.
    sample = list(won.items())[:30]
    replays = await asyncio.gather(*(reserve(client, deal_id, u, key) for (u, key), _ in sample))
    for ((_, _), first), again in zip(sample, replays, strict=True):
        assert again.status_code == 200, again.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.json()["order_id"] == first["order_id"]
    count = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
    assert count is not None and int(count[0]) == stock

    report = await partitions_equal_database(db, rds, deal_id)
    assert report["totals"] == {"total": stock, "available": 0, "held": stock, "sold": 0}


async def test_an_empty_home_partition_falls_over_until_all_are_empty(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    # One unit per partition (buckets 0, 1, 2 belong to partitions 0, 1, 2).
    deal_id = await create_deal(
        client, stock=3, buckets=3, partitions=P, per_user_limit=1, max_per_order=1
    )
    homes = users_with_home(0, 5, 72_000_000)

    first = await reserve(client, deal_id, homes[0], "key-home-0")
    assert first.status_code == 201, first.text
    # Partition 0 is now empty; partitions 1 and 2 still hold a unit each.
    second = await reserve(client, deal_id, homes[1], "key-home-1")
    assert second.status_code == 201, second.text
    # The same buyer again over their limit: refused (the database judges the quota
    # across partitions), and nothing taken.
    over = await reserve(client, deal_id, homes[1], "key-home-1-again")
    assert over.status_code == 422 and over.json()["code"] == "LIMIT_EXCEEDED", over.text
    # A replay of the request that fell over: its first answer, once.
    replay = await reserve(client, deal_id, homes[1], "key-home-1")
    assert replay.status_code == 200 and replay.json()["order_id"] == second.json()["order_id"]
    third = await reserve(client, deal_id, homes[2], "key-home-2")
    assert third.status_code == 201, third.text
    orders = {
        str(r[0]): str(r[1])
        for r in await db.fetchall("SELECT id, alloc FROM orders WHERE deal_id = %s", (deal_id,))
    }
    assert sorted(int(a.split(":")[0]) for a in orders.values()) == [0, 1, 2]
    assert orders[first.json()["order_id"]] == "0:1"

    # Every partition is empty: sold out, whichever partition the buyer starts in.
    for k in range(P):
        u = users_with_home(k, 1, 72_100_000 + 1000 * k)[0]
        r = await reserve(client, deal_id, u, f"key-late-{k}")
        assert r.status_code == 409 and r.json()["code"] == "SOLD_OUT", r.text
    public = (await client.get(f"/v1/deals/{deal_id}")).json()
    assert public["sold_out"] is True and public["remaining_hint"] == 0

    # A unit comes back in partition 2 (its order cancelled): a buyer whose home is
    # partition 0 gets it.
    cancel = await client.post(
        f"/v1/orders/{third.json()['order_id']}/cancel", headers=buyer(homes[2])
    )
    assert cancel.status_code == 200, cancel.text
    deadline = asyncio.get_running_loop().time() + 5
    again = await reserve(client, deal_id, homes[3], "key-home-3")
    while again.status_code == 409 and asyncio.get_running_loop().time() < deadline:
        # The sold-out near-cache may answer for up to its TTL after the cancel.
        await asyncio.sleep(0.2)
        again = await reserve(client, deal_id, homes[3], "key-home-3")
    assert again.status_code == 201, again.text
    alloc = await db.fetchone("SELECT alloc FROM orders WHERE id = %s", (again.json()["order_id"],))
    assert alloc is not None and str(alloc[0]) == "2:1"
    await partitions_equal_database(db, rds, deal_id)


async def test_a_lost_partition_is_rebuilt_exactly(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(
        client, stock=12, buckets=6, partitions=P, per_user_limit=2, max_per_order=1
    )
    homes = users_with_home(1, 4, 73_000_000)
    for i, u in enumerate(homes):
        r = await reserve(client, deal_id, u, f"lost-key-{i}")
        assert r.status_code == 201, r.text
    # Partition 1's state vanishes (an eviction, a flushed node): the next admission
    # there loads it from the database, quota included.
    keys = partition_keys(deal_id, 1)
    await rds.delete(*keys.state, keys.buyers)
    again = await reserve(client, deal_id, homes[0], "lost-key-0")
    assert again.status_code == 200, again.text  # a replay, from the database
    await partitions_equal_database(db, rds, deal_id)
    for u in homes:
        assert await rds.hget(keys.users, str(u)) == "1"


async def test_resync_is_exact_per_partition_under_live_traffic(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """Passes racing reservations, cancels and stock adjustments that span partitions
    (one intent per partition, one ledger op) never "repair" anything."""
    deal_id = await create_deal(client, stock=3000, buckets=6, partitions=P, max_per_order=2)
    traffic = Traffic(client, deal_id, 74_000_000, seed=5)
    traffic.start(buyers=6)
    outcomes: list[SyncCode] = []
    try:
        for i in range(60):
            if i % 20 == 10:
                r = await client.post(
                    f"/v1/admin/deals/{deal_id}/stock",
                    json={"delta": 7 if i < 30 else -4, "reason": "partitions test"},
                    headers=ADMIN,
                )
                assert r.status_code == 200, r.text
            result = await local_gate.mirror.resync(deal_id)
            assert result is not None
            outcomes.append(result[0])
            if result[0] == SyncCode.APPLIED:
                pytest.fail(f"a pass under live traffic changed Redis: {result[1]}")
            await asyncio.sleep(0.01)
    finally:
        await traffic.finish()
    assert outcomes.count(SyncCode.IN_SYNC) >= 55, outcomes
    report = await partitions_equal_database(db, rds, deal_id)
    assert report["totals"]["total"] == 3000 + 7 - 4 - 4


async def test_concurrent_duplicates_after_a_fall_over_make_one_order(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """Buyers whose home partition is empty send each key three times at once: one
    order per key, one 201 per key, the others its replay or "in progress"."""
    deal_id = await create_deal(client, stock=60, buckets=6, partitions=P, max_per_order=1)
    # Drain partition 0 (buckets 0 and 3, 10 units each) with buyers at home there.
    drainers = users_with_home(0, 20, 75_000_000)
    drained = await asyncio.gather(
        *(reserve(client, deal_id, u, f"drain-{deal_id}-{u}") for u in drainers)
    )
    assert all(r.status_code == 201 for r in drained), [r.text for r in drained]
    assert await rds.hget(partition_keys(deal_id, 0).meta, "avail") == "0"

    buyers = users_with_home(0, 30, 75_100_000)
    sent = [(u, f"dup-{deal_id}-{u}") for u in buyers for _ in range(3)]
    answers = await asyncio.gather(*(reserve(client, deal_id, u, key) for u, key in sent))
    by_key: dict[str, list[Any]] = {}
    for (_, key), r in zip(sent, answers, strict=True):
        by_key.setdefault(key, []).append(r)
    for key, rs in by_key.items():
        codes = Counter(r.status_code for r in rs)
        assert set(codes) <= {200, 201, 409, 503}, (key, [r.text for r in rs])
        assert codes[201] <= 1, (key, [r.text for r in rs])
        assert all(
            r.json()["code"] == "IDEMPOTENCY_IN_PROGRESS" for r in rs if r.status_code == 409
        )
        ids = {r.json()["order_id"] for r in rs if r.status_code in (200, 201)}
        assert len(ids) <= 1, (key, ids)
    rows = await db.fetchall(
        "SELECT idempotency_key, COUNT(*), MIN(alloc) FROM orders WHERE deal_id = %s"
        " AND user_id >= 75100000 GROUP BY idempotency_key",
        (deal_id,),
    )
    assert all(int(r[1]) == 1 for r in rows), rows
    # They all fell over: their orders are in partitions 1 and 2.
    assert all(int(str(r[2]).split(":")[0]) % P != 0 for r in rows), rows
    ordered = {str(r[0]) for r in rows}
    for key, rs in by_key.items():
        if any(r.status_code in (200, 201) for r in rs):
            assert key in ordered
    await partitions_equal_database(db, rds, deal_id)


async def test_expired_holds_go_back_to_their_partitions(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """The sweeper's releases (one intent per order) land in the partition that owns
    each order's buckets, units and per-user counts alike."""
    deal_id = await create_deal(
        client, stock=30, buckets=6, partitions=P, per_user_limit=1, hold_seconds=1
    )
    users = [u for k in range(P) for u in users_with_home(k, 4, 76_000_000 + 1000 * k)]
    answers = await asyncio.gather(
        *(reserve(client, deal_id, u, f"expire-{deal_id}-{u}") for u in users)
    )
    assert all(r.status_code == 201 for r in answers), [r.text for r in answers]
    deadline = asyncio.get_running_loop().time() + 20
    held = None
    while asyncio.get_running_loop().time() < deadline:
        row = await db.fetchone(
            "SELECT SUM(held), SUM(available) FROM deal_buckets WHERE deal_id = %s", (deal_id,)
        )
        held = row and (int(row[0]), int(row[1]))
        if held == (0, 30):
            break
        await asyncio.sleep(0.5)
    assert held == (0, 30), held
    report = await partitions_equal_database(db, rds, deal_id)
    assert report["totals"] == {"total": 30, "available": 30, "held": 0, "sold": 0}
    for k in range(P):
        assert await rds.hlen(partition_keys(deal_id, k).users) == 0
    # Every buyer may buy again (their quota came back in their partition).
    again = await asyncio.gather(
        *(reserve(client, deal_id, u, f"expire-again-{deal_id}-{u}") for u in users)
    )
    assert all(r.status_code == 201 for r in again), [r.text for r in again]
    await partitions_equal_database(db, rds, deal_id)


async def test_a_crowd_meets_a_process_that_has_not_seen_the_deals(
    client: Client, env: dict[str, str]
) -> None:
    """Every request for a deal a process has not routed yet reads the deal's partition
    count first. A crowd's first requests did that through redis-py's pool, one
    connection each: with the pool exhausted they were answered 500 (found by
    tests/reserve/test_crash_recovery.py, a survivor gate taking over a dead gate's crowd).
    Now it is a script call in the hot path's pipeline: a fresh gate with a pool of
    one connection sells both deals out to 600 concurrent first requests."""
    one = await create_deal(client, stock=150, buckets=4)
    three = await create_deal(client, stock=150, buckets=6, partitions=P)
    # No background loops: the resync would learn the deals' partitions first.
    fresh = GateProcess({**env, "GATE_REDIS_POOL_MAX": "1"}, workers=1, background=False)
    crowd = Client(fresh.url, limit=300)
    try:
        await asyncio.to_thread(fresh.wait_ready)
        # Connections open first, so that the crowd's requests arrive together.
        await asyncio.gather(*(crowd.get("/healthz") for _ in range(300)))
        base = 72_000_000
        responses = await asyncio.gather(
            *(
                reserve(crowd, deal_id, base + i, f"fresh-{deal_id}-{i}")
                for i in range(300)
                for deal_id in (one, three)
            )
        )
    finally:
        await crowd.close()
        fresh.stop()
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {201, 409, 503}, statuses
    # Both deals sell out (the pool-bound reads answered 593 of 600 with 503). A
    # shed request or two on a loaded machine is allowed, not a crowd of them.
    assert statuses[503] <= 12, statuses
    assert statuses[201] == 300 - statuses[503] or statuses[201] == 300, statuses
