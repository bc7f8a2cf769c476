"""The expiry sweeper: due holds go back to their buckets, exactly once, by the DB clock."""

from __future__ import annotations

import asyncio

import orjson
import pymysql
import pytest
import redis.asyncio as aioredis

from gate.base.ids import new_id
from gate.base.metrics import METRICS, sample_values, value_of
from gate.base.settings import Settings, SettingsError, load_settings
from gate.expiry import ExpirySettings, make_sweeper
from gate.expiry.sweeper import NEXT_DUE_PAUSE_MIN_SECONDS, STATS, SweepConfig
from gate.runtime import Gate
from gate.store.db import Database, OutcomeUnknown
from gate.store.keys import deal_keys
from tests.expiry_support import holding, make_holds, run_gate, statuses, wait_until
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    assert_invariants,
    create_deal,
    db_available,
    locked_buckets,
    metrics_url_of,
    redis_available,
    reserve,
)


def _failures() -> float:
    return METRICS.registry.get_sample_value("gate_expiry_release_failures_total") or 0.0


async def _alloc_bucket(db: Database, order_id: str) -> int:
    row = await db.fetchone("SELECT alloc FROM orders WHERE id = %s", (order_id,))
    assert row is not None
    return int(str(row[0]).split(":")[0])


async def test_due_holds_go_back_to_their_buckets_and_sell_again(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=6, buckets=3, per_user_limit=1)
    orders = await make_holds(client, deal_id, 6, user_base=810_000, concurrency=6)
    sold_out = await reserve(client, deal_id, 810_100, f"exp-{deal_id}-late")
    assert sold_out.json()["code"] == "SOLD_OUT"
    users = {
        str(r[0]): int(r[1])
        for r in await db.fetchall("SELECT id, user_id FROM orders WHERE deal_id = %s", (deal_id,))
    }
    due, kept = orders[:4], orders[4:]
    buckets = {o: await _alloc_bucket(db, o) for o in due}

    # An operator ends four holds now; the gate's own sweepers release them.
    marks = ",".join(["%s"] * len(due))
    await db.execute(f"UPDATE orders SET expires_at = NOW(6) WHERE id IN ({marks})", tuple(due))

    async def released() -> bool:
        return set((await statuses(db, due)).values()) == {"EXPIRED"}

    await wait_until(released, 10, "the due holds to expire")
    assert set((await statuses(db, kept)).values()) == {"PENDING_PAYMENT"}

    expected = {b: 0 for b in range(3)}
    for b in buckets.values():
        expected[b] += 1
    assert await db_available(db, deal_id) == expected
    for order_id in due:
        ledger = await db.fetchall(
            "SELECT bucket, d_available, d_held, reason, op_id FROM inventory_ledger"
            " WHERE order_id = %s ORDER BY id",
            (order_id,),
        )
        assert [tuple(r[:4]) for r in ledger] == [
            (buckets[order_id], -1, 1, "reserve"),
            (buckets[order_id], 1, -1, "expire"),
        ]
        op_id = ledger[1][4]
        outbox = await db.fetchall(
            "SELECT event_id, topic, payload FROM outbox WHERE aggregate_id = %s", (order_id,)
        )
        assert len(outbox) == 1
        event_id, topic, payload = outbox[0]
        assert (event_id, topic) == (op_id, "order.expired")
        body = orjson.loads(payload)
        assert body["order_id"] == order_id and body["deal_id"] == deal_id
        assert body["status"] == "EXPIRED" and body["quantity"] == 1
        row = await db.fetchone("SELECT closed_at FROM orders WHERE id = %s", (order_id,))
        assert row is not None and row[0] is not None
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 6, "available": 4, "held": 2, "sold": 0}

    # The buyers' quota came back with the stock: the same buyer buys again.
    again = await reserve(client, deal_id, users[due[0]], f"exp-{deal_id}-again")
    assert again.status_code == 201, again.text
    view = (await client.get(f"/v1/deals/{deal_id}")).json()
    assert view["sold_out"] is False and view["remaining_hint"] == 3


async def test_expiry_follows_the_database_clock_when_an_operator_moves_deadlines(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=3, buckets=1, hold_seconds=1)
    orders = await make_holds(client, deal_id, 3, user_base=820_000, concurrency=3)
    # Extended by an operator before the one-second hold ran out: kept.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 1 HOUR WHERE deal_id = %s", (deal_id,)
    )
    await asyncio.sleep(1.2)
    out = run_gate(env, "sweep", "--once")
    assert out.startswith("sweep: released "), out
    assert set((await statuses(db, orders)).values()) == {"PENDING_PAYMENT"}
    # Deadlines the database clock has passed, however far back: released.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) - INTERVAL 2 DAY WHERE id = %s", (orders[0],)
    )
    run_gate(env, "sweep", "--once")

    async def first_released() -> bool:
        return (await statuses(db, orders[:1]))[orders[0]] == "EXPIRED"

    await wait_until(first_released, 5, "the moved hold to expire")
    assert [s for o, s in (await statuses(db, orders)).items() if o != orders[0]] == [
        "PENDING_PAYMENT",
        "PENDING_PAYMENT",
    ]
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 3, "available": 1, "held": 2, "sold": 0}


async def test_an_idle_sweeper_wakes_at_the_next_deadline(
    client: Client, db: Database, local_gate: Gate
) -> None:
    """After a short batch the pause is cut to the next hold's deadline (never longer
    than the interval, never shorter than the floor), so a crowd's holds falling due
    together are released right then, not up to an interval later."""
    deal_id = await create_deal(client, stock=1, buckets=1, hold_seconds=3600)
    (order_id,) = await make_holds(client, deal_id, 1, user_base=826_000)
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 1 SECOND WHERE id = %s", (order_id,)
    )
    sweeper = make_sweeper(local_gate, SweepConfig(interval_seconds=30.0))
    pause = await sweeper._until_next_due(30.0)
    # Another test's hold may fall due sooner; none of them may make it longer.
    assert NEXT_DUE_PAUSE_MIN_SECONDS <= pause <= 1.01, pause
    assert await sweeper._until_next_due(0.2) <= 0.2
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 1 HOUR WHERE id = %s", (order_id,)
    )


async def test_an_authorized_hold_expires_too(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=2, buckets=2)
    orders = await make_holds(client, deal_id, 2, user_base=830_000, concurrency=2)
    # What the payments area does on payment.authorized (stock still held).
    await db.execute(
        "UPDATE orders SET status = 'AUTHORIZED', authorized_at = NOW(6) WHERE id = %s",
        (orders[0],),
    )
    await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))

    async def done() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(done, 10, "both holds to expire")
    assert set((await statuses(db, orders)).values()) == {"EXPIRED"}
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 2, "available": 2, "held": 0, "sold": 0}


async def test_a_hold_passed_over_while_locked_is_released_after_the_scan_moved_on(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """While a backlog drains the scan continues after the last full batch; a hold it
    passed over (locked by a payment at the time) must still be released once free."""
    deal_id = await create_deal(client, stock=5, buckets=2)
    orders = sorted(await make_holds(client, deal_id, 5, user_base=836_000, concurrency=5))
    sweeper = make_sweeper(local_gate, SweepConfig(batch_max=2, interval_seconds=0.05))
    # Due in a second: time enough to lock the first (lowest id: first in the index)
    # before any sweeper (this one or the test gate's) can take it.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 1 SECOND WHERE deal_id = %s",
        (deal_id,),
    )
    async with db.connection() as conn, conn.cursor() as cur:
        await cur.execute("START TRANSACTION")
        await cur.execute("SELECT id FROM orders WHERE id = %s FOR UPDATE", (orders[0],))
        await asyncio.sleep(1.2)
        # Full batches (of these or other tests' due holds) move the scan past the
        # locked hold.
        for _ in range(3):
            await sweeper.run_once()
        assert (await statuses(db, orders[:1]))[orders[0]] == "PENDING_PAYMENT"
        await cur.execute("ROLLBACK")

    async def all_released() -> bool:
        for _ in range(5):
            await sweeper.run_once()
        return await holding(db, deal_id) == 0

    await wait_until(all_released, 20, "the passed-over hold to expire")
    assert set((await statuses(db, orders)).values()) == {"EXPIRED"}
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 5, "held": 0, "sold": 0}


async def test_a_failed_release_changes_nothing_and_is_counted(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """A batch whose transaction fails half-way (here: its outbox insert) rolls back
    whole: orders, buckets, ledger and Redis stay as they were; the failure counts."""
    deal_id = await create_deal(client, stock=3, buckets=1)
    orders = await make_holds(client, deal_id, 3, user_base=840_000, concurrency=3)
    before_db = await db_available(db, deal_id)
    before_redis = await redis_available(rds, deal_id)
    await db.execute(
        f"CREATE TRIGGER test_fail_expiry_{deal_id} BEFORE INSERT ON outbox FOR EACH ROW"
        f" IF NEW.topic = 'order.expired' AND JSON_VALUE(NEW.payload, '$.deal_id') = {deal_id} THEN"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'test: outbox refused'; END IF"
    )
    sweeper = make_sweeper(local_gate, SweepConfig(batch_max=100, interval_seconds=0.05))
    failed_before = STATS.failed
    metric_before = _failures()
    try:
        await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))
        # The gate's own sweepers fail on these holds too; keep trying until this one
        # has had its turn.
        for _ in range(200):
            try:
                await sweeper.run_once()
            except Exception as exc:
                assert "outbox refused" in str(exc), repr(exc)
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the sweeper never took the due holds")
        assert STATS.failed >= failed_before + 1
        assert _failures() >= metric_before + 1
        assert set((await statuses(db, orders)).values()) == {"PENDING_PAYMENT"}
        assert await db_available(db, deal_id) == before_db
        assert await redis_available(rds, deal_id) == before_redis

        async def intents_dropped() -> bool:
            # (The gate's own sweepers may be in the middle of a failing attempt.)
            return await rds.hlen(deal_keys(deal_id).inflight) == 0

        await wait_until(intents_dropped, 10, "the failed batches' intents to be dropped")
        row = await db.fetchone(
            "SELECT COUNT(*) FROM inventory_ledger WHERE deal_id = %s AND reason = 'expire'",
            (deal_id,),
        )
        assert row is not None and int(row[0]) == 0
    finally:
        await db.execute(f"DROP TRIGGER IF EXISTS test_fail_expiry_{deal_id}")
    # (Not `sweep_due() <= 3`: the fault also blocked other tests' due holds that
    # shared a batch with these, and this sweeper may release them too.)
    await sweeper.sweep_due()

    async def done() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(done, 10, "the holds to expire once the fault is gone")
    # Each hold given back exactly once, whichever sweeper did it.
    row = await db.fetchone(
        "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM inventory_ledger"
        " WHERE deal_id = %s AND reason = 'expire'",
        (deal_id,),
    )
    assert row is not None and (int(row[0]), int(row[1])) == (3, 3), row
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 3, "available": 3, "held": 0, "sold": 0}


async def test_a_batch_stuck_behind_a_long_transaction_counts_as_failed(
    client: Client, db: Database, rds: aioredis.Redis, gate: GateProcess, settings: Settings
) -> None:
    """A batch whose lock wait times out counts as failed (and is retried at once), so
    the release-failure alert sees a long transaction holding the bucket rows. The
    shared gate's own sweepers meet the lock. It counts whichever sweeper takes the
    batch: each rollback frees the orders and another sweeper (worker, host) often
    takes them before the first one retries, so counting only a third attempt in a
    row of one sweeper counted nothing for 30 s with four sweepers. The metric is
    summed over every gate serving the suite (two on a cluster run, each with its
    own /metrics)."""
    deal_id = await create_deal(client, stock=2, buckets=1)
    orders = await make_holds(client, deal_id, 2, user_base=841_000, concurrency=2)

    async def failures() -> float:
        total = 0.0
        for url in gate.peers:
            async with client.session.get(metrics_url_of(url) + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
            total += value_of(sample_values(text), "gate_expiry_release_failures_total")
        return total

    before = await failures()
    async with locked_buckets(settings, deal_id):
        await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))

        async def counted() -> bool:
            return await failures() >= before + 2

        # One lock wait of GATE_DB_LOCK_WAIT_SECONDS (2 s in the tests) counts.
        await wait_until(counted, 30, "the stuck batch to count as failed")
        assert set((await statuses(db, orders)).values()) == {"PENDING_PAYMENT"}

    async def done() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(done, 20, "the holds to expire once the lock is gone")
    await assert_invariants(db, rds, deal_id)


async def test_a_batch_past_its_deadline_is_resolved_by_ending_its_thread(
    client: Client,
    db: Database,
    rds: aioredis.Redis,
    local_gate: Gate,
    settings: Settings,
) -> None:
    """A batch whose CALL outlives batch_timeout_seconds has an unknown outcome: the
    sweeper ends its server thread (Database.end_thread_of) and asks the ledger, so
    the batch is decided (rolled back) here instead of being left to the janitor."""
    deal_id = await create_deal(client, stock=2, buckets=1)
    orders = await make_holds(client, deal_id, 2, user_base=842_000, concurrency=2)
    sweeper = make_sweeper(
        local_gate, SweepConfig(batch_max=100, interval_seconds=0.05, batch_timeout_seconds=0.5)
    )
    unresolved_before = STATS.unresolved
    async with locked_buckets(settings, deal_id):
        await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))
        # The shared gate's sweepers meet the lock too; keep trying until this one
        # has taken the holds and timed out on the bucket row.
        for _ in range(200):
            try:
                await sweeper.run_once()
            except OutcomeUnknown as exc:
                assert isinstance(exc.cause, TimeoutError), repr(exc)
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the sweeper's batch never timed out behind the lock")
        # Decided here (rolled back): nothing left unresolved for the janitor.
        assert STATS.unresolved == unresolved_before
        assert set((await statuses(db, orders)).values()) == {"PENDING_PAYMENT"}

    async def done() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(done, 20, "the holds to expire once the lock is gone")
    row = await db.fetchone(
        "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM inventory_ledger"
        " WHERE deal_id = %s AND reason = 'expire'",
        (deal_id,),
    )
    assert row is not None and (int(row[0]), int(row[1])) == (2, 2), row
    await assert_invariants(db, rds, deal_id)


async def test_rebucketing_while_holds_expire_keeps_every_invariant(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=600, buckets=4, max_per_order=2)
    await make_holds(client, deal_id, 300, user_base=850_000, quantity=2)
    await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))
    for count in (16, 3, 7):
        r = await client.put(
            f"/v1/admin/deals/{deal_id}/buckets", json={"count": count}, headers=ADMIN
        )
        assert r.status_code == 200, r.text

    async def done() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(done, 20, "every hold to expire")
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 600, "available": 600, "held": 0, "sold": 0}
    assert report["bucket_count"] == 7


async def test_the_batch_procedure_refuses_a_hold_that_is_not_due(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=2, buckets=1)
    orders = await make_holds(client, deal_id, 2, user_base=860_000, concurrency=2)
    async with db.connection() as conn, conn.cursor() as cur:
        # Twice on one connection: the scratch table exists the second time, and
        # neither call leaves a warning (pytest would fail on one).
        for _ in range(2):
            await cur.execute("CALL gate_expire_batch('[]', 'test')")
            row = await cur.fetchone()
            while await cur.nextset():
                pass
            assert row is not None and tuple(row[:2]) == (0, 0)
        # Not locked by the caller and not due: the whole batch is refused.
        await cur.execute("START TRANSACTION")
        pairs = orjson.dumps([[o, new_id()] for o in orders]).decode()
        with pytest.raises(pymysql.err.MySQLError, match="not holding and due"):
            await cur.execute("CALL gate_expire_batch(%s, 'test')", (pairs,))
    assert set((await statuses(db, orders)).values()) == {"PENDING_PAYMENT"}
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 2, "available": 0, "held": 2, "sold": 0}


def test_the_workers_can_be_turned_off(env: dict[str, str]) -> None:
    on = Gate(load_settings(env))
    off = Gate(load_settings({**env, "GATE_SWEEPER": "0", "GATE_INVARIANT_CHECKS": "off"}))
    workers = {g: next(e for e in g.extensions if e.name == "expiry").workers for g in (on, off)}
    assert len(workers[on]) == 2 and workers[off] == []


def test_sweeper_settings_are_bounded(env: dict[str, str]) -> None:
    settings = load_settings(env)
    assert ExpirySettings.from_env(settings.environ, settings).sweep.batch_max == 1000
    for name, value in (
        ("GATE_SWEEP_BATCH_MAX", "0"),
        ("GATE_SWEEP_BATCH_MAX", "many"),
        ("GATE_SWEEP_INTERVAL_SECONDS", "-1"),
        ("GATE_SWEEP_TASKS", "99"),
        ("GATE_SWEEP_BATCH_TIMEOUT_SECONDS", "600"),
        ("GATE_SWEEPER", "perhaps"),
        ("GATE_INVARIANT_DEALS_PER_PASS", "0"),
        ("GATE_ALERT_INCONSISTENCY_RATIO", "2"),
    ):
        bad = load_settings({**env, name: value})
        with pytest.raises(SettingsError, match=name):
            ExpirySettings.from_env(bad.environ, bad)


async def test_metrics_are_exported(client: Client) -> None:
    text = await client.metrics()
    for name in (
        "gate_expiry_released_total",
        "gate_expiry_release_failures_total",
        "gate_expiry_release_lag_seconds_bucket",
        "gate_expiry_oldest_due_seconds",
        "gate_inconsistency_ratio",
        "gate_release_failure_ratio",
    ):
        assert name in text, name
