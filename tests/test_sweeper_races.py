"""1,000 races of expiry against a late payment, with several sweepers running.

Every hold's deadline falls inside three seconds and its payment is fired at its own
deadline, a little before or after, while two `gate sweep` processes (besides the
shared gate's own sweepers) take due holds in small batches. Each order must end
with exactly one outcome, its stock released at most once, and every invariant
must hold.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from gate.db import Database
from tests.expiry_support import GateCommand, db_now, holding, make_holds, pay, wait_until
from tests.support import Client, assert_invariants, create_deal

pytestmark = pytest.mark.slow

RACES = 1000


async def test_each_order_has_exactly_one_outcome_when_expiry_races_payment(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=RACES, buckets=8, per_user_limit=1, hold_seconds=3600)
    orders = await make_holds(client, deal_id, RACES, user_base=900_000)
    sweeper_env = {
        **env,
        "GATE_SWEEP_INTERVAL_SECONDS": "0.01",
        "GATE_SWEEP_BATCH_MAX": "20",
        "GATE_SWEEP_TASKS": "2",
    }
    sweepers = [GateCommand(sweeper_env, "sweep") for _ in range(2)]
    rng = random.Random(5)
    try:
        # Deadlines spread over three seconds, starting a little ahead.
        await db.execute(
            "UPDATE orders SET expires_at = NOW(6) + INTERVAL 1500000 + CRC32(id) MOD 3000000"
            " MICROSECOND WHERE deal_id = %s",
            (deal_id,),
        )
        now = await db_now(db)
        local_now = time.monotonic()
        rows = await db.fetchall("SELECT id, expires_at FROM orders WHERE deal_id = %s", (deal_id,))
        deadline = {
            str(r[0]): local_now + (r[1] - now).total_seconds() for r in rows
        }  # on this process's monotonic clock
        paid: dict[str, bool] = {}
        in_flight = asyncio.Semaphore(20)  # payments in flight at once

        async def late_payment(order_id: str) -> None:
            # From 250 ms early to 100 ms late for its own deadline: on a quiet machine
            # most are paid, on a busy one more arrive too late.
            at = deadline[order_id] + rng.uniform(-0.25, 0.1)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            async with in_flight:
                paid[order_id] = await pay(db, order_id)

        await asyncio.gather(*(late_payment(o) for o in orders))

        async def settled() -> bool:
            return await holding(db, deal_id) == 0

        await wait_until(settled, 30, "every hold to be paid or expired")
        for s in sweepers:
            assert s.alive(), s.output()[-2000:]
    finally:
        # SIGTERM: each sweeper finishes its batch and exits cleanly.
        exits = [s.stop() for s in sweepers]
    assert exits == [0, 0], [s.output()[-2000:] for s in sweepers]

    outcome = {
        str(r[0]): str(r[1])
        for r in await db.fetchall("SELECT id, status FROM orders WHERE deal_id = %s", (deal_id,))
    }
    assert len(outcome) == RACES
    counts = Counter(outcome.values())
    assert set(counts) <= {"PAID", "EXPIRED"}, counts
    # Races really happened on both sides of the deadline.
    assert counts["PAID"] > 0 and counts["EXPIRED"] > 0, counts
    for order_id, status in outcome.items():
        # A payment succeeds exactly when the order ends paid.
        assert paid[order_id] == (status == "PAID"), (order_id, status)

    ledger: dict[str, Counter[str]] = {}
    released: Counter[str] = Counter()
    for order_id, reason, d_available, d_sold in await db.fetchall(
        "SELECT l.order_id, l.reason, l.d_available, l.d_sold FROM inventory_ledger l"
        " JOIN orders o ON o.id = l.order_id WHERE o.deal_id = %s",
        (deal_id,),
    ):
        ledger.setdefault(str(order_id), Counter())[str(reason)] += 1
        if reason == "expire":
            released[str(order_id)] += int(d_available)
        if reason == "pay":
            assert int(d_sold) == 1
    events = Counter(
        str(r[0])
        for r in await db.fetchall(
            "SELECT aggregate_id FROM outbox WHERE topic = 'order.expired' AND aggregate_id IN"
            " (SELECT id FROM orders WHERE deal_id = %s)",
            (deal_id,),
        )
    )
    for order_id, status in outcome.items():
        if status == "EXPIRED":
            # Released exactly once: one release, one unit back, one event.
            assert ledger[order_id] == Counter({"reserve": 1, "expire": 1}), ledger[order_id]
            assert released[order_id] == 1
            assert events[order_id] == 1
        else:
            assert ledger[order_id] == Counter({"reserve": 1, "pay": 1}), ledger[order_id]
            assert released[order_id] == 0 and events[order_id] == 0

    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {
        "total": RACES,
        "available": counts["EXPIRED"],
        "held": 0,
        "sold": counts["PAID"],
    }
    # Quota: the buyers who paid keep their unit, the others have theirs back.
    row = await db.fetchone(
        "SELECT COALESCE(SUM(units), 0) FROM user_quota WHERE deal_id = %s", (deal_id,)
    )
    assert row is not None and int(row[0]) == counts["PAID"]
