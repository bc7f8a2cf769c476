"""A rolling restart in the middle of a sale: SIGTERM to `gate serve --workers 2` (its
supervisor, as an orchestrator sends it) while a crowd is buying. Every request the
gate took is answered before it exits; none is half-done; buyers whose request was
refused at the door retry with the same key against the next gate, and every key ends
with at most one order, every 201 with its order, Redis = DB."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import aiohttp
import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import Client, GateProcess, assert_invariants, create_deal, reserve

pytestmark = pytest.mark.slow

BUYERS = 1_500
STOCK = 600
CONNECTIONS_MAX = 200
ORDERS_BEFORE_SIGTERM = 100


async def _orders(db: Database, deal_id: int) -> dict[str, str]:
    rows = await db.fetchall(
        "SELECT idempotency_key, id FROM orders WHERE deal_id = %s", (deal_id,)
    )
    return {str(k): str(i) for k, i in rows}


async def _attempt(client: Client, deal_id: int, user: int) -> tuple[int, int | str, str]:
    """(user, status or the connection error's name, order id or '')."""
    try:
        r = await reserve(client, deal_id, user, f"restart-{deal_id}-{user}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return user, type(exc).__name__, ""
    order_id = str(r.json().get("order_id", "")) if r.status_code in (200, 201) else ""
    return user, r.status_code, order_id


async def test_sigterm_mid_sale_answers_what_it_took_and_loses_nothing(
    env: dict[str, str], db: Database, rds: aioredis.Redis
) -> None:
    first = GateProcess(env, workers=2)
    await asyncio.to_thread(first.wait_ready)
    client = Client(first.url, limit=CONNECTIONS_MAX)
    try:
        deal_id = await create_deal(client, stock=STOCK, buckets=4)
        crowd = asyncio.gather(*(_attempt(client, deal_id, 9_100_000 + i) for i in range(BUYERS)))
        while len(await _orders(db, deal_id)) < ORDERS_BEFORE_SIGTERM:
            assert not crowd.done(), "the crowd finished before the restart could begin"
            await asyncio.sleep(0.01)
        os.kill(first.proc.pid, signal.SIGTERM)
        results = await asyncio.wait_for(crowd, 60)
        exit_status = await asyncio.to_thread(first.proc.wait, 30)
    finally:
        await client.close()
        first.stop()
    assert exit_status == 0, first.output()[-3000:]
    outcomes = Counter(status for _, status, _ in results)
    # The restart happened mid-sale: some were sold before, some were turned away.
    assert outcomes[201] >= ORDERS_BEFORE_SIGTERM, outcomes
    assert sum(n for s, n in outcomes.items() if not isinstance(s, int)) > 0, outcomes
    # Only answers a buyer can act on: a sale, sold out, or retry later.
    assert {s for s in outcomes if isinstance(s, int)} <= {201, 409, 503}, outcomes

    # Every order the database holds was answered 201 to its buyer, and the other way
    # round: nothing was committed behind a lost answer.
    held = await _orders(db, deal_id)
    answered = {f"restart-{deal_id}-{u}": o for u, s, o in results if s == 201}
    assert held == answered

    # The buyers that got no 201 retry with the same key against the next gate.
    second = GateProcess(env, workers=2)
    await asyncio.to_thread(second.wait_ready)
    client = Client(second.url, limit=CONNECTIONS_MAX)
    try:
        retries = await asyncio.gather(
            *(_attempt(client, deal_id, u) for u, s, _ in results if s != 201)
        )
        assert {s for _, s, _ in retries} <= {201, 409}, Counter(s for _, s, _ in retries)
        await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    finally:
        await client.close()
        second.stop()
    final = await _orders(db, deal_id)
    sold = sum(1 for _, s, _ in retries if s == 201) + len(answered)
    assert len(final) == sold <= STOCK
    assert sold == STOCK, "stock left over while buyers were told SOLD_OUT"
