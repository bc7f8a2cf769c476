"""Callbacks applied in groups (gate_payment_event_group, GroupCommitter): each event
is still its own conditional transition, duplicates apply once wherever they race."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import orjson
import pymysql
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.inventory.check import check_deal
from gate.payments.codes import EventCode
from gate.payments.machine import GroupCommitter, PaymentMachine
from gate.payments.provider import parse_event
from gate.runtime import Gate
from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import counts, event_body, new_order, order_row, post_webhook, signed
from tests.support import Client, assert_invariants, buyer, create_deal

pay_client = ps.pay_client
sandbox = ps.sandbox
pay_stack = ps.pay_stack
core = ps.core

ORDERS = 24
COPIES = 3


async def test_burst_with_racing_duplicates_pays_each_order_once(
    pay_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=ORDERS + 1, buckets=4, unit_price=150)
    order_ids = [await new_order(pay_client, deal, 5100 + i) for i in range(ORDERS)]
    wrong = await new_order(pay_client, deal, 5100 + ORDERS)
    bodies = [event_body("payment.succeeded", o, f"pi_grp_{o}", 150) for o in order_ids]
    # One wrong amount in the same burst: quarantined, and it does not undo the others.
    bodies.append(event_body("payment.succeeded", wrong, f"pi_grp_{wrong}", 149))
    sends = [b for b in bodies for _ in range(COPIES)]
    random.Random(7).shuffle(sends)
    results = await asyncio.gather(*(post_webhook(pay_client, b, signed(b)) for b in sends))
    assert [r.status_code for r in results] == [200] * len(sends)
    outcomes = [r.json()["outcome"] for r in results]
    assert outcomes.count("applied") == ORDERS
    assert outcomes.count("quarantined") == 1
    assert outcomes.count("duplicate") == len(sends) - ORDERS - 1
    for order_id in order_ids:
        row = await order_row(db, order_id)
        assert (row["status"], row["paid_amount"]) == ("PAID", 150)
        c = await counts(db, order_id)
        assert (c["events"], c["payments"]) == (1, 1)
        topics = await db.fetchall("SELECT topic FROM outbox WHERE aggregate_id = %s", (order_id,))
        assert [t[0] for t in topics] == ["order.paid"]
    assert (await order_row(db, wrong))["status"] == "PENDING_PAYMENT"
    await assert_invariants(db, rds, deal)


async def test_group_in_one_call_duplicates_inside_and_across(
    pay_client: Client, core: Gate, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=3, unit_price=110)
    first = await new_order(pay_client, deal, 5201)
    second = await new_order(pay_client, deal, 5202)
    machine = PaymentMachine(core.db, core.mirror, "test-groups")
    a = parse_event(event_body("payment.succeeded", first, "pi_grp_a", 110))
    b = parse_event(event_body("payment.succeeded", second, "pi_grp_b", 110))
    done = await machine.record("sandbox", a)
    assert done.code == EventCode.APPLIED
    # a again (committed before), b twice in the same group.
    results = await machine.record_group("sandbox", [a, b, b])
    assert [r.code for r in results] == [
        EventCode.DUPLICATE,
        EventCode.APPLIED,
        EventCode.DUPLICATE,
    ]
    assert results[1].status == "PAID" and results[1].deal_id == deal
    for order_id in (first, second):
        assert (await order_row(db, order_id))["status"] == "PAID"
        c = await counts(db, order_id)
        assert (c["events"], c["outbox"], c["payments"]) == (1, 1, 1)
    await assert_invariants(db, rds, deal)


async def test_committer_answers_each_caller_and_riders_as_duplicates(
    pay_client: Client, core: Gate, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=8, buckets=2, unit_price=90)
    order_ids = [await new_order(pay_client, deal, 5300 + i) for i in range(6)]
    committer = GroupCommitter(PaymentMachine(core.db, core.mirror, "test-groups"), "sandbox")
    events = [
        parse_event(event_body("payment.succeeded", o, f"pi_grp_c_{o}", 90)) for o in order_ids
    ]
    calls = [e for e in events for _ in range(4)]
    random.Random(3).shuffle(calls)
    results = await asyncio.gather(*(committer.submit(e) for e in calls))
    codes = [r.code for r in results]
    assert codes.count(EventCode.APPLIED) == len(order_ids)
    assert codes.count(EventCode.DUPLICATE) == len(calls) - len(order_ids)
    for order_id in order_ids:
        assert (await order_row(db, order_id))["status"] == "PAID"
        c = await counts(db, order_id)
        assert (c["events"], c["outbox"]) == (1, 1)
    await assert_invariants(db, rds, deal)


async def test_redis_flush_does_not_make_a_redelivery_apply_again(
    pay_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=2, unit_price=70)
    order_id = await new_order(pay_client, deal, 5401)
    body = event_body("payment.succeeded", order_id, "pi_grp_flush", 70)
    r = await post_webhook(pay_client, body, signed(body))
    assert (r.status_code, r.json()["outcome"]) == (200, "applied")
    before = await counts(db, order_id)
    await rds.flushdb()
    # Twice: whichever worker answers, the database's key decides.
    for _ in range(2):
        r = await post_webhook(pay_client, body, signed(body))
        assert (r.status_code, r.json()["outcome"]) == (200, "duplicate")
    assert await counts(db, order_id) == before
    assert (await order_row(db, order_id))["paid_amount"] == 70
    # Redis is empty until the next reservation loads the deal: the database's side.
    report = await check_deal(db, None, deal)
    assert report["invariant"]["ok"], report["invariant"]


async def _scenario(client: Client, deal: int, user_base: int) -> tuple[list[str], list[bytes]]:
    """Orders and the events of one group: three plain payments (one of two units),
    a wrong amount, a payment after a cancel (late), a failure, and a refund nobody
    asked for that follows its payment in the same group."""
    orders = [await new_order(client, deal, user_base + i) for i in range(6)]
    orders.append(await new_order(client, deal, user_base + 6, quantity=2))
    r = await client.post(f"/v1/orders/{orders[4]}/cancel", headers=buyer(user_base + 4))
    assert r.status_code == 200
    tag = f"{user_base}"
    bodies = [
        event_body("payment.succeeded", orders[0], f"pi_{tag}_0", 100),
        event_body("payment.succeeded", orders[1], f"pi_{tag}_1", 100),
        event_body("payment.succeeded", orders[6], f"pi_{tag}_6", 200),
        event_body("payment.succeeded", orders[3], f"pi_{tag}_3", 99),
        event_body("payment.succeeded", orders[4], f"pi_{tag}_4", 100),
        event_body("payment.failed", orders[5], f"pi_{tag}_5", 100),
        event_body("refund.succeeded", orders[0], f"pi_{tag}_0", 100, refund_id=f"re_{tag}"),
    ]
    return orders, bodies


async def _state(db: Database, order_ids: list[str]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for order_id in order_ids:
        row = await order_row(db, order_id)
        c = await counts(db, order_id)
        # Ledger rows are one per bucket part, and the two orders compared may have
        # been allocated across buckets differently (random start bucket): compare
        # the units each reason moved instead of the row count.
        del c["ledger"]
        moved = [
            tuple(int(x) if i else str(x) for i, x in enumerate(r))
            for r in await db.fetchall(
                "SELECT reason, SUM(d_available), SUM(d_held), SUM(d_sold) FROM inventory_ledger"
                " WHERE order_id = %s GROUP BY reason ORDER BY reason",
                (order_id,),
            )
        ]
        payloads = await db.fetchall(
            "SELECT topic, payload FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
        )
        shapes = [(t, sorted(orjson.loads(p))) for t, p in payloads]
        out.append((row["status"], row["paid_amount"], c, moved, shapes))
    return out


async def test_group_lanes_match_one_at_a_time(
    pay_client: Client, core: Gate, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=20, buckets=3, unit_price=100, max_per_order=2)
    grouped_orders, grouped = await _scenario(pay_client, deal, 5500)
    single_orders, single = await _scenario(pay_client, deal, 5600)
    machine = PaymentMachine(core.db, core.mirror, "test-groups")
    by_group = await machine.record_group("sandbox", [parse_event(b) for b in grouped])
    by_one = [await machine.record("sandbox", parse_event(b)) for b in single]
    assert [(a.code, a.outcome, a.detail, a.status) for a in by_group] == [
        (a.code, a.outcome, a.detail, a.status) for a in by_one
    ]
    assert [a.code for a in by_group] == [
        EventCode.APPLIED,
        EventCode.APPLIED,
        EventCode.APPLIED,
        EventCode.QUARANTINED,
        EventCode.LATE,
        EventCode.IGNORED,
        EventCode.QUARANTINED,
    ]
    assert await _state(db, grouped_orders) == await _state(db, single_orders)
    # The same event ids again, as one group: all duplicates, nothing changes.
    before = await _state(db, grouped_orders)
    again = await machine.record_group("sandbox", [parse_event(b) for b in grouped])
    assert {a.code for a in again} == {EventCode.DUPLICATE}
    assert await _state(db, grouped_orders) == before
    await assert_invariants(db, rds, deal)


async def test_a_group_that_fails_is_run_one_event_at_a_time(
    pay_client: Client, core: Gate, settings: Settings, db: Database, rds: aioredis.Redis
) -> None:
    """An order row locked from another connection makes its group time out: the
    group is run again one event at a time, so only that order's callbacks fail (the
    provider will redeliver them) and the others are applied."""
    deal = await create_deal(pay_client, stock=6, unit_price=80)
    locked, free_a, free_b = [await new_order(pay_client, deal, 5700 + i) for i in range(3)]
    # Short waits and no retry, so the timeouts come quickly.
    quick = Database(replace(settings, db_lock_wait_seconds=1, db_retry_max=1), pool_max=4)
    await quick.start()
    assert quick.pool is not None
    holder = await quick.pool.acquire()
    try:
        async with holder.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute("SELECT id FROM orders WHERE id = %s FOR UPDATE", (locked,))
        committer = GroupCommitter(PaymentMachine(quick, core.mirror, "test-groups"), "sandbox")
        first = parse_event(event_body("payment.succeeded", locked, "pi_grp_l1", 80))
        # While the first is in the database (alone: the committer was idle), these
        # three gather into the next group, which also needs the locked order.
        rest = [
            parse_event(event_body("payment.succeeded", free_a, "pi_grp_fa", 80)),
            parse_event(event_body("payment.failed", locked, "pi_grp_l2", 80)),
            parse_event(event_body("payment.succeeded", free_b, "pi_grp_fb", 80)),
        ]
        results = await asyncio.gather(
            *(committer.submit(e) for e in [first, *rest]), return_exceptions=True
        )
        assert isinstance(results[0], pymysql.err.OperationalError)
        assert isinstance(results[2], pymysql.err.OperationalError)
        assert [getattr(results[i], "code", None) for i in (1, 3)] == [EventCode.APPLIED] * 2
    finally:
        async with holder.cursor() as cur:
            await cur.execute("ROLLBACK")
        quick.pool.release(holder)
        await quick.close()
    for order_id in (free_a, free_b):
        assert (await order_row(db, order_id))["status"] == "PAID"
    assert (await counts(db, locked))["events"] == 0
    # The provider's redelivery, once the lock is gone, applies.
    again = await PaymentMachine(core.db, core.mirror, "test-groups").record("sandbox", first)
    assert again.code == EventCode.APPLIED
    await assert_invariants(db, rds, deal)


async def test_the_group_scratch_table_compares_provider_ids_in_binary(db: Database) -> None:
    """gate_cb_scratch's id columns take ascii_bin, as the tables' own do since
    007_binary_ids.sql: ids that differ only by case are two ids inside a group too."""
    async with db.connection() as conn, conn.cursor() as cur:
        await cur.execute("CALL gate_cb_scratch()")
        await cur.execute(
            "SELECT column_name, collation_name FROM information_schema.columns"
            " WHERE table_schema = DATABASE() AND table_name = 'gate_cb_events'"
            " AND column_name IN ('event_id', 'payment_id', 'refund_id')"
        )
        rows = await cur.fetchall()
        await cur.execute(
            "INSERT INTO gate_cb_events (n, event_id) VALUES (1, 'evt-Case'), (2, 'evt-case')"
        )
        await cur.execute("SELECT COUNT(*) FROM gate_cb_events WHERE event_id = 'evt-case'")
        same = await cur.fetchone()
        await cur.execute("DROP TEMPORARY TABLE gate_cb_events, gate_cb_parts")
    collations = {str(name).lower(): coll for name, coll in rows}
    # information_schema lists temporary tables' columns in MariaDB >= 11.2 only; the
    # comparison below holds everywhere.
    if collations:
        assert collations == dict.fromkeys(("event_id", "payment_id", "refund_id"), "ascii_bin")
    assert same == (1,)
