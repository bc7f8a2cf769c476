"""A reservation whose transaction broke mid-call while the database could not be
reached for the look-up: the process resolves it itself once the database answers
(gate/reserve/giveback.py), rather than leaving its units to the janitor's age rule."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis.asyncio as aioredis

from gate.base.metrics import sample_values, value_of
from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import (
    Client,
    GateProcess,
    TcpProxy,
    assert_invariants,
    create_deal,
    locked_buckets,
    reserve,
    wait_for_reserve_statement,
)

pytestmark = pytest.mark.slow


def _mysql_via(env: dict[str, str], proxy: TcpProxy) -> str:
    url = urlsplit(env["GATE_MYSQL_URL"])
    user = url.netloc.rsplit("@", 1)[0]
    return urlunsplit(url._replace(netloc=f"{user}@127.0.0.1:{proxy.port}"))


async def test_an_unresolved_outcome_is_given_back_once_the_database_answers(
    env: dict[str, str], settings: Settings, db: Database, rds: aioredis.Redis
) -> None:
    # The first node of a cluster's URL (a Galera run) or the one server.
    proxy = TcpProxy(settings.mysql.host, settings.mysql.port)
    await proxy.start()
    # The janitor's age rule far away: only the process itself can give the unit back
    # within the test's seconds.
    gate = GateProcess(
        {**env, "GATE_MYSQL_URL": _mysql_via(env, proxy), "GATE_INFLIGHT_MAX_SECONDS": "60"}
    )
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        deal_id = await create_deal(client, stock=10)
        assert (await reserve(client, deal_id, 44_000, "unres-warm-0001")).status_code == 201
        keys = deal_keys(deal_id)
        async with locked_buckets(settings, deal_id) as cur:
            pending = asyncio.create_task(reserve(client, deal_id, 44_001, "unres-0001"))
            await wait_for_reserve_statement(cur, deal_id)  # waiting for the row lock
            proxy.cut()  # its connection breaks mid-call; the look-up cannot connect
            r = await pending
            assert r.status_code == 503, r.text
            assert await rds.hlen(keys.inflight) == 1  # its unit still taken
            proxy.restore()
            # Still under the lock: the process ends the server thread itself (it
            # waits for the lock), finds no order and gives the unit back.
            for _ in range(100):  # 10 s
                if await rds.hlen(keys.inflight) == 0:
                    break
                await asyncio.sleep(0.1)
            assert await rds.hlen(keys.inflight) == 0
        report = await assert_invariants(db, rds, deal_id, timeout_seconds=10)
        assert report["totals"] == {"total": 10, "available": 9, "held": 1, "sold": 0}
        row = await db.fetchone(
            "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND idempotency_key = %s",
            (deal_id, "unres-0001"),
        )
        assert row is not None and int(row[0]) == 0
        samples = sample_values(await client.metrics())
        assert value_of(samples, "gate_db_unknown_outcomes_total", resolution="deferred") == 1
        assert value_of(samples, "gate_givebacks_total", outcome="given_back") == 1
        # The key is free again: the buyer's retry is a new reservation.
        again = await reserve(client, deal_id, 44_001, "unres-0001")
        assert again.status_code == 201, again.text
    finally:
        await client.close()
        gate.stop()
        await proxy.close()
