"""1,000 races of expiry against a payment callback, with several sweepers running.

Every hold's deadline falls inside three seconds and its `payment.succeeded` callback
(signed, through the real webhook endpoint) is fired at its own deadline, a little
before or after, while two `gate sweep` processes (besides the shared gate's own
sweeper) take due holds in small batches. A callback that wins pays from the held
units; one that loses finds the order EXPIRED and re-takes a unit (the late-payment
path; stock is always there, since the hold's own unit went back). Each order must
end with exactly one outcome, its stock released at most once, and every invariant
must hold.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from gate.payments.signing import decode_secret
from gate.store.db import Database
from tests.expiry_support import db_now, holding, make_holds, wait_until
from tests.payments_support import event_body, post_webhook, signed
from tests.support import WEBHOOK_SECRET, Client, GateCommand, assert_invariants, create_deal

pytestmark = pytest.mark.slow

RACES = 1000
KEY = decode_secret(WEBHOOK_SECRET)


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
        rows = await db.fetchall(
            "SELECT id, expires_at, amount, currency FROM orders WHERE deal_id = %s", (deal_id,)
        )
        deadline = {
            str(r[0]): local_now + (r[1] - now).total_seconds() for r in rows
        }  # on this process's monotonic clock
        price = {str(r[0]): (int(r[2]), str(r[3])) for r in rows}
        answered: dict[str, int] = {}
        in_flight = asyncio.Semaphore(20)  # callbacks in flight at once

        async def callback(order_id: str) -> None:
            # From 250 ms early to 100 ms late for its own deadline: on a quiet machine
            # most win the race, on a busy one more arrive too late.
            at = deadline[order_id] + rng.uniform(-0.25, 0.1)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            amount, currency = price[order_id]
            body = event_body(
                "payment.succeeded", order_id, f"pay_race_{order_id}", amount, currency
            )
            async with in_flight:
                response = await post_webhook(client, body, signed(body, KEY))
                answered[order_id] = response.status_code

        await asyncio.gather(*(callback(o) for o in orders))
        assert set(answered.values()) <= {200, 202, 204}, Counter(answered.values())

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
    # Every buyer paid, so every order ends paid: in time from its held unit, or late
    # from a re-taken unit after its hold was released.
    assert Counter(outcome.values()) == Counter({"PAID": RACES}), Counter(outcome.values())

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
        if reason in ("pay", "late_pay"):
            assert int(d_sold) == 1
    outbox = Counter(
        (str(r[0]), str(r[1]))
        for r in await db.fetchall(
            "SELECT topic, aggregate_id FROM outbox WHERE aggregate_id IN"
            " (SELECT id FROM orders WHERE deal_id = %s)",
            (deal_id,),
        )
    )
    events = Counter({o: n for (topic, o), n in outbox.items() if topic == "order.expired"})
    paid_events = Counter({o: n for (topic, o), n in outbox.items() if topic == "order.paid"})
    in_time = late = 0
    for order_id in outcome:
        assert paid_events[order_id] == 1, (order_id, paid_events[order_id])
        if ledger[order_id]["expire"]:
            # Lost the race: released exactly once (one unit back, one event), then
            # one unit re-taken for the late payment.
            late += 1
            assert ledger[order_id] == Counter({"reserve": 1, "expire": 1, "late_pay": 1}), (
                order_id,
                ledger[order_id],
            )
            assert released[order_id] == 1
            assert events[order_id] == 1
        else:
            in_time += 1
            assert ledger[order_id] == Counter({"reserve": 1, "pay": 1}), ledger[order_id]
            assert events[order_id] == 0
    # Races really happened on both sides of the deadline.
    assert in_time > 0 and late > 0, (in_time, late)

    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": RACES, "available": 0, "held": 0, "sold": RACES}
    # Quota: every buyer paid and keeps one unit; a late payment took its unit again.
    row = await db.fetchone(
        "SELECT COALESCE(SUM(units), 0) FROM user_quota WHERE deal_id = %s", (deal_id,)
    )
    assert row is not None and int(row[0]) == RACES
