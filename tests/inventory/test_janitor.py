"""Tokens left behind by a gate killed between the Redis decrement and the commit."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import (
    GATE_BIN,
    Client,
    GateProcess,
    assert_invariants,
    create_deal,
    locked_buckets,
    redis_available,
    redis_client,
    reserve,
    wait_for_reserve_statement,
)

pytestmark = pytest.mark.slow


def _victim_env(env: dict[str, str]) -> dict[str, str]:
    return {
        **env,
        "GATE_DB_LOCK_WAIT_SECONDS": "1",
        "GATE_RESERVATION_DB_TIMEOUT_SECONDS": "1",
        "GATE_REDIS_TIMEOUT_SECONDS": "0.5",
        "GATE_INFLIGHT_MAX_SECONDS": "3.5",
        # These tests are about the age rule: the victim's liveness lease must not
        # lapse first (a running janitor would then resolve its token at once,
        # tests/reserve/test_crash_recovery.py).
        "GATE_LEASE_SECONDS": "30",
    }


async def _kill_mid_reservation(
    env: dict[str, str], settings: Settings, deal_id: int, user_id: int, *, commit: bool
) -> str:
    """Start a reservation on a victim gate, kill the gate while the transaction waits
    on a bucket lock, then let the transaction commit or make it fail."""
    victim = GateProcess(_victim_env(env), background=False)
    victim.wait_ready()
    victim_client = Client(victim.url)
    pending: asyncio.Future[object] | None = None
    try:
        async with locked_buckets(settings, deal_id) as cur:
            pending = asyncio.ensure_future(
                reserve(victim_client, deal_id, user_id, f"victim-{user_id}-0001")
            )
            await wait_for_reserve_statement(cur, deal_id)
            victim.kill()
            if not commit:
                # Keep the lock past the lock-wait timeout: the orphaned statement
                # fails and its transaction rolls back. Otherwise the server thread
                # carries on once the lock goes, and the order commits although its
                # gate is gone and never confirms.
                await asyncio.sleep(2.0)
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await victim_client.close()
        victim.stop()
    keys = deal_keys(deal_id)
    tokens = await asyncio.wait_for(_inflight(keys.inflight, settings), 5)
    assert len(tokens) == 1, tokens
    return tokens[0]


async def _inflight(key: str, settings: Settings) -> list[str]:
    client = redis_client(settings.redis_url)
    try:
        return [str(t) for t in await client.hkeys(key)]
    finally:
        await client.aclose()


def _run_janitor(env: dict[str, str]) -> str:
    done = subprocess.run(
        [GATE_BIN, "janitor", "--once"],
        env=_victim_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


async def _wait_order(db: Database, order_id: str, present: bool) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE id = %s", (order_id,))
        if row and (int(row[0]) == 1) == present:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"order {order_id} present={not present}")


async def test_janitor_restores_units_of_a_gate_that_died_before_commit(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=5, buckets=1)
    before = await redis_available(rds, deal_id)
    token = await _kill_mid_reservation(env, settings, deal_id, 1101, commit=False)
    await _wait_order(db, token, present=False)
    taken = await redis_available(rds, deal_id)
    assert taken[0] == before[0] - 1  # Redis still counts the dead request's unit
    await asyncio.sleep(3.6)  # older than the victim's inflight bound
    out = _run_janitor(env)
    assert await rds.hlen(deal_keys(deal_id).inflight) == 0, out
    assert await redis_available(rds, deal_id) == before
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 5, "held": 0, "sold": 0}
    # The buyer's key is free: retrying it makes the reservation.
    assert (await reserve(client, deal_id, 1101, "victim-1101-0001")).status_code == 201


async def test_janitor_confirms_a_reservation_that_committed_after_its_gate_died(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=5, buckets=1)
    before = await redis_available(rds, deal_id)
    token = await _kill_mid_reservation(env, settings, deal_id, 1201, commit=True)
    await _wait_order(db, token, present=True)
    await asyncio.sleep(3.6)
    _run_janitor(env)
    keys = deal_keys(deal_id)
    assert await rds.hlen(keys.inflight) == 0
    assert await redis_available(rds, deal_id) == (before[0] - 1, {0: before[1][0] - 1})
    # The idempotency record now points at the committed order: a retry replays it.
    replay = await reserve(client, deal_id, 1201, "victim-1201-0001")
    assert replay.status_code == 200
    assert replay.json()["order_id"] == token
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 4, "held": 1, "sold": 0}
