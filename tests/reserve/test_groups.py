"""Group commit of reservations (gate/reserve/groups.py, db/006): reservations queued behind
a busy database leave together in one transaction, each with the order, ledger row
and quota a single reservation would have written; a group in which one reservation
would be answered differently runs one by one and answers each exactly; a group
whose connection dies leaves nothing behind."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gate.base.metrics import value_of
from gate.base.settings import Settings
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.ops_support import scrape
from tests.support import (
    GATE_BIN,
    Client,
    GateProcess,
    Resp,
    assert_invariants,
    create_deal,
    db_available,
    locked_buckets,
    redis_available,
    reserve,
    reserve_statements,
    wait_for_reserve_statement,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def grouping_gate(env: dict[str, str], prepared: None) -> AsyncIterator[GateProcess]:
    """One worker, at most one group of a deal in the database at a time: whatever
    arrives while it is there forms the next group, deterministically. Resync runs
    rarely, so that drift a test injects is still there when its requests arrive."""
    gate = GateProcess(
        {
            **env,
            "GATE_RESERVATION_GROUPS_IN_FLIGHT_MAX": "1",
            "GATE_RESYNC_INTERVAL_SECONDS": "60",
        },
        workers=1,
    )
    try:
        await asyncio.to_thread(gate.wait_ready)
        yield gate
    finally:
        gate.stop()


async def _inflight(rds: aioredis.Redis, deal_id: int) -> int:
    return int(await rds.hlen(deal_keys(deal_id).inflight))


async def _wait_inflight(rds: aioredis.Redis, deal_id: int, n: int) -> None:
    """Until n admissions of the deal are in flight (admitted in Redis, waiting for or
    in the database)."""
    for _ in range(250):
        if await _inflight(rds, deal_id) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {await _inflight(rds, deal_id)} of {n} admissions in flight")


async def _groups(client: Client) -> tuple[float, float, float]:
    """(groups, reservations in them, reservations run again alone because an item
    of their group would have been answered differently)."""
    samples = await scrape(client)
    return (
        value_of(samples, "gate_reservation_group_size_count"),
        value_of(samples, "gate_reservation_group_size_sum"),
        value_of(samples, "gate_reservation_group_reruns_total", reason="differs"),
    )


def _fire(
    client: Client, deal_id: int, buys: list[tuple[int, str, int]]
) -> list[asyncio.Future[Resp]]:
    return [asyncio.ensure_future(reserve(client, deal_id, u, k, q)) for u, k, q in buys]


async def test_reservations_queued_behind_a_busy_database_commit_as_one_group(
    grouping_gate: GateProcess, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    client = Client(grouping_gate.url)
    try:
        # 46 units asked of four buckets of 100: no bucket can run short, so no
        # allocation spans two buckets (such a reservation commits alone, outside any
        # group; with buckets of 20 a random start bucket did so now and then).
        deal_id = await create_deal(
            client, stock=400, buckets=4, per_user_limit=3, max_per_order=2, hold_seconds=300
        )
        before = await db_available(db, deal_id)
        groups0 = await _groups(client)
        base = 7_100_000 + deal_id * 100
        buys = [(base + i, f"group-{deal_id}-{i:03d}", 1 + i % 2) for i in range(31)]
        async with locked_buckets(settings, deal_id) as cur:
            first = _fire(client, deal_id, buys[:1])
            await wait_for_reserve_statement(cur, deal_id)
            rest = _fire(client, deal_id, buys[1:])
            await _wait_inflight(rds, deal_id, len(buys))
        responses = [await f for f in first + rest]
        assert [r.status_code for r in responses] == [201] * len(buys), [
            r.text for r in responses if r.status_code != 201
        ]
        groups1 = await _groups(client)
        # The first reservation alone, the 30 that queued behind it in one group.
        assert (groups1[0] - groups0[0], groups1[1] - groups0[1]) == (2, 31)

        rows = await db.fetchall(
            "SELECT id, user_id, quantity, amount, alloc, idempotency_key, status,"
            " TIMESTAMPDIFF(SECOND, created_at, expires_at), created_at"
            " FROM orders WHERE deal_id = %s",
            (deal_id,),
        )
        by_id = {str(r[0]): r for r in rows}
        assert len(rows) == len(buys)
        for (user, key, qty), resp in zip(buys, responses, strict=True):
            body = resp.json()
            row = by_id[body["order_id"]]
            assert (int(row[1]), int(row[2]), int(row[3]), str(row[5]), str(row[6])) == (
                user,
                qty,
                500 * qty,
                key,
                "PENDING_PAYMENT",
            )
            assert body["quantity"] == qty and body["amount"] == 500 * qty
            assert str(row[4]).split(":")[1] == str(qty) and int(row[7]) == 300
        # The group's orders share one commit time.
        assert len({r[8] for r in rows}) == 2

        # One ledger row per order; per bucket the rows chain (each starts where the
        # previous one ended), as under one-at-a-time commits.
        ledger = await db.fetchall(
            "SELECT bucket, order_id, op_id, d_available, d_held, available_before,"
            " available_after, reason, actor FROM inventory_ledger"
            " WHERE deal_id = %s AND reason = 'reserve' ORDER BY id",
            (deal_id,),
        )
        assert sorted(str(r[1]) for r in ledger) == sorted(by_id)
        level = dict(before)
        for bucket, order_id, op_id, d_avail, d_held, avail_before, avail_after, _, actor in ledger:
            qty = int(by_id[str(order_id)][2])
            assert str(op_id) == str(order_id)
            assert (int(d_avail), int(d_held)) == (-qty, qty)
            assert int(avail_before) == level[int(bucket)]
            assert int(avail_after) == int(avail_before) - qty
            assert actor == f"user:{by_id[str(order_id)][1]}"
            assert str(by_id[str(order_id)][4]) == f"{bucket}:{qty}"
            level[int(bucket)] = int(avail_after)
        assert level == await db_available(db, deal_id)

        quota = await db.fetchall(
            "SELECT user_id, units FROM user_quota WHERE deal_id = %s", (deal_id,)
        )
        assert {int(u): int(n) for u, n in quota} == {u: q for u, _, q in buys}
        report = await assert_invariants(db, rds, deal_id)
        assert report["totals"]["held"] == sum(q for _, _, q in buys)
    finally:
        await client.close()


async def test_a_second_group_leaves_beside_the_first_only_once_a_quarter_is_queued(
    env: dict[str, str], prepared: None, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """Two groups of a deal may be in the database at once, but the second leaves only
    with a quarter of GATE_RESERVATION_GROUP_MAX queued (here 4 of 16): three
    stragglers wait for the group in flight; a fourth makes them worth a group."""
    gate = GateProcess(
        {
            **env,
            "GATE_RESERVATION_GROUPS_IN_FLIGHT_MAX": "2",
            "GATE_RESERVATION_GROUP_MAX": "16",
            "GATE_RESYNC_INTERVAL_SECONDS": "60",
        },
        workers=1,
    )
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        deal_id = await create_deal(client, stock=400, buckets=4)
        groups0 = await _groups(client)
        base = 7_200_000 + deal_id * 100
        buys = [(base + i, f"follow-{deal_id}-{i}", 1) for i in range(5)]
        async with locked_buckets(settings, deal_id) as cur:
            first = _fire(client, deal_id, buys[:1])
            pilot = await wait_for_reserve_statement(cur, deal_id)
            stragglers = _fire(client, deal_id, buys[1:4])
            await _wait_inflight(rds, deal_id, 4)
            await asyncio.sleep(0.5)
            # Three queued: no second group went to the database beside the first.
            assert await reserve_statements(cur, deal_id) == [pilot]
            fourth = _fire(client, deal_id, buys[4:])
            second = await wait_for_reserve_statement(cur, deal_id, exclude=[pilot])
            assert second != pilot
        answers = [await f for f in first + stragglers + fourth]
        assert [r.status_code for r in answers] == [201] * len(buys), [r.text for r in answers]
        groups1 = await _groups(client)
        # The pilot alone, then the four together.
        assert (groups1[0] - groups0[0], groups1[1] - groups0[1]) == (2, 5)
        report = await assert_invariants(db, rds, deal_id)
        assert report["totals"]["held"] == len(buys)
    finally:
        await client.close()
        gate.stop()


async def test_a_group_with_odd_items_answers_each_as_alone(
    grouping_gate: GateProcess,
    db: Database,
    rds: aioredis.Redis,
    settings: Settings,
    local_gate: Gate,
) -> None:
    """Redis drifted three ways (a lost idempotency record, a lost quota count, three
    units too many): the database's answers win, item by item."""
    client = Client(grouping_gate.url)
    try:
        deal_id = await create_deal(client, stock=10, buckets=1, per_user_limit=1)
        keys = deal_keys(deal_id)
        base = 7_300_000 + deal_id * 100
        replayer, limited = base + 1, base + 2
        first = await reserve(client, deal_id, replayer, f"odd-items-{deal_id}-r")
        other = await reserve(client, deal_id, limited, f"odd-items-{deal_id}-l1")
        assert first.status_code == other.status_code == 201
        # Redis forgets the replayer's key and both buyers' quota counts, and believes
        # in three units the database does not have. The resync passes of every gate
        # skip the deal while its sync lock is taken; one already past the lock ends
        # well within half a second.
        await rds.set(keys.sync_lock, "test", px=60_000)
        await asyncio.sleep(0.5)
        await rds.delete(keys.idempotency(replayer, f"odd-items-{deal_id}-r"))
        await rds.hdel(keys.users, str(replayer), str(limited))
        await rds.hincrby(keys.buckets, "0", 3)
        await rds.hincrby(keys.meta, "avail", 3)
        groups0 = await _groups(client)

        normal = [(base + 10 + i, f"odd-items-{deal_id}-n{i}", 1) for i in range(9)]
        odd = [(replayer, f"odd-items-{deal_id}-r", 1), (limited, f"odd-items-{deal_id}-l2", 1)]
        async with locked_buckets(settings, deal_id) as cur:
            pilot = _fire(client, deal_id, normal[:1])
            await wait_for_reserve_statement(cur, deal_id)
            rest = _fire(client, deal_id, normal[1:] + odd)
            await _wait_inflight(rds, deal_id, 11)
        answers = [await f for f in pilot + rest]
        groups1 = await _groups(client)
        assert (groups1[0] - groups0[0], groups1[1] - groups0[1]) == (2, 11)
        assert groups1[2] - groups0[2] == 10

        # The database held 8 units: the pilot and 7 of the other 8 buyers get one.
        statuses = Counter(r.status_code for r in answers[:9])
        assert statuses == {201: 8, 409: 1}, [r.text for r in answers[:9]]
        assert all(r.json()["code"] == "SOLD_OUT" for r in answers[:9] if r.status_code == 409)
        replay, over = answers[9], answers[10]
        assert replay.status_code == 200, replay.text
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json()["order_id"] == first.json()["order_id"]
        # Over the limit on a deal the database has just sold out: gate_reserve checks
        # stock before the quota, so either refusal is the exact single answer.
        assert (over.status_code, over.json()["code"]) in (
            (422, "LIMIT_EXCEEDED"),
            (409, "SOLD_OUT"),
        ), over.text

        row = await db.fetchone(
            "SELECT COUNT(*), COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s",
            (deal_id,),
        )
        assert row is not None and (int(row[0]), int(row[1])) == (10, 10)
        assert await db_available(db, deal_id) == {0: 0}
        # The drift is the resync's to repair; afterwards Redis equals the database.
        await rds.delete(keys.sync_lock)
        await local_gate.mirror.resync(deal_id)
        report = await assert_invariants(db, rds, deal_id)
        assert report["totals"] == {"total": 10, "available": 0, "held": 10, "sold": 0}
    finally:
        await client.close()


async def test_a_group_whose_connection_dies_leaves_nothing_behind(
    grouping_gate: GateProcess, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    client = Client(grouping_gate.url)
    try:
        deal_id = await create_deal(client, stock=20, buckets=2)
        before = await redis_available(rds, deal_id)
        groups0 = await _groups(client)
        base = 7_500_000 + deal_id * 100
        buys = [(base + i, f"dies-{deal_id}-{i}", 1) for i in range(9)]
        async with locked_buckets(settings, deal_id) as cur:
            pilot = _fire(client, deal_id, buys[:1])
            alone = await wait_for_reserve_statement(cur, deal_id)
            rest = _fire(client, deal_id, buys[1:])
            await _wait_inflight(rds, deal_id, len(buys))
            await cur.execute(f"KILL {alone}")
            # The queued eight leave as one group, which waits on the locked rows.
            grouped = await wait_for_reserve_statement(cur, deal_id, exclude=[alone])
            await cur.execute(f"KILL {grouped}")
            answers = [await f for f in pilot + rest]
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.json()["code"] == "OVERLOADED"
        groups1 = await _groups(client)
        assert (groups1[0] - groups0[0], groups1[1] - groups0[1]) == (2, 9)
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        assert row is not None and int(row[0]) == 0
        assert await redis_available(rds, deal_id) == before
        assert await _inflight(rds, deal_id) == 0
        # Every unit sells afterwards, the same keys included.
        again = await asyncio.gather(*_fire(client, deal_id, buys))
        assert [r.status_code for r in again] == [201] * len(buys)
        report = await assert_invariants(db, rds, deal_id)
        assert report["totals"]["held"] == len(buys)
    finally:
        await client.close()


async def test_a_group_that_commits_after_its_gate_died_is_confirmed_by_the_janitor(
    env: dict[str, str], db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """SIGKILL of the gate while its group waits on the bucket row: the server carries
    on and commits the group once the lock goes; nobody confirms its tokens but the
    janitor, which confirms every one of them (a group commits all or nothing)."""
    victim_env = {
        **env,
        "GATE_RESERVATION_GROUPS_IN_FLIGHT_MAX": "1",
        "GATE_INFLIGHT_MAX_SECONDS": "12",
        "GATE_JANITOR_COMMITTED_AFTER_SECONDS": "1",
        # Its tokens are counted after the kill: its lease must not lapse first.
        "GATE_LEASE_SECONDS": "30",
    }
    victim = GateProcess(victim_env, workers=1, background=False)
    await asyncio.to_thread(victim.wait_ready)
    client = Client(victim.url)
    pending: list[asyncio.Future[Resp]] = []
    try:
        deal_id = await create_deal(client, stock=10, buckets=1)
        before = await redis_available(rds, deal_id)
        base = 7_700_000 + deal_id * 100
        buys = [(base + i, f"orphan-{deal_id}-{i}", 1) for i in range(6)]
        async with locked_buckets(settings, deal_id) as cur:
            pending = _fire(client, deal_id, buys[:1])
            alone = await wait_for_reserve_statement(cur, deal_id)
            pending += _fire(client, deal_id, buys[1:])
            await _wait_inflight(rds, deal_id, len(buys))
            # The first one fails (its thread is killed); the five queued behind it
            # leave as one group, and the gate dies while that group waits.
            await cur.execute(f"KILL {alone}")
            await wait_for_reserve_statement(cur, deal_id, exclude=[alone])
            # The first one's request gives its unit back itself (its thread is gone,
            # no order) before the gate dies; on a loaded machine that can come later.
            for _ in range(200):
                if await _inflight(rds, deal_id) == len(buys) - 1:
                    break
                await asyncio.sleep(0.02)
            victim.kill()
    finally:
        for f in pending:
            f.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await client.close()
        victim.stop()
    rows: list[tuple[object, ...]] = []
    for _ in range(100):
        rows = await db.fetchall("SELECT id, user_id FROM orders WHERE deal_id = %s", (deal_id,))
        if len(rows) == 5:
            break
        await asyncio.sleep(0.05)
    assert sorted(int(str(r[1])) for r in rows) == [u for u, _, _ in buys[1:]]
    assert await _inflight(rds, deal_id) == 5
    await asyncio.sleep(1.2)
    done = await asyncio.create_subprocess_exec(
        GATE_BIN, "janitor", "--once", env=victim_env, stdout=asyncio.subprocess.DEVNULL
    )
    assert await asyncio.wait_for(done.wait(), 60) == 0
    assert await _inflight(rds, deal_id) == 0
    assert await redis_available(rds, deal_id) == (before[0] - 5, {0: before[1][0] - 5})
    # Every buyer of the group gets their order back on a retry; the first buys anew.
    shared = GateProcess(env, workers=1, background=False)
    await asyncio.to_thread(shared.wait_ready)
    client = Client(shared.url)
    try:
        orders_by_user = {int(str(r[1])): str(r[0]) for r in rows}
        retries = await asyncio.gather(*_fire(client, deal_id, buys))
        assert retries[0].status_code == 201
        for (user, _, _), r in zip(buys[1:], retries[1:], strict=True):
            assert r.status_code == 200 and r.json()["order_id"] == orders_by_user[user], r.text
        report = await assert_invariants(db, rds, deal_id)
        assert report["totals"]["held"] == 6
    finally:
        await client.close()
        shared.stop()
