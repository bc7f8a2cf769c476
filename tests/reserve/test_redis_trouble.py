"""Redis in trouble: fail closed without touching the database, recover by itself,
never re-run a script that may have run; optionally fall back to the database."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from gate.base.metrics import sample_values, value_of
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.store.resp import RespConnection
from tests.support import (
    Client,
    GateProcess,
    TcpProxy,
    assert_invariants,
    create_deal,
    redis_via,
    reserve,
)

pytestmark = pytest.mark.slow


async def _counts(db: Database, deal_id: int) -> tuple[int, int]:
    """The deal's orders and ledger rows (other deals' holds may expire meanwhile)."""
    row = await db.fetchone(
        "SELECT (SELECT COUNT(*) FROM orders WHERE deal_id = %s),"
        " (SELECT COUNT(*) FROM inventory_ledger WHERE deal_id = %s)",
        (deal_id, deal_id),
    )
    assert row is not None
    return int(row[0]), int(row[1])


async def _until_recovered(client: Client, deal_id: int, user: int, seconds: float) -> None:
    """Retry (with fresh keys) until a whole round of concurrent reservations, spread
    over every worker process (each has its own breaker), is created."""
    deadline = time.monotonic() + seconds
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        batch = await asyncio.gather(
            *(
                reserve(client, deal_id, user + i, f"recover-{deal_id}-{attempt:03d}-{i}")
                for i in range(8)
            )
        )
        statuses = {r.status_code for r in batch}
        assert statuses <= {201, 503}, [r.text for r in batch]
        if statuses == {201}:
            return
        await asyncio.sleep(0.3)
    raise AssertionError("the gate did not recover")


@pytest.fixture
async def proxy(env: dict[str, str]) -> AsyncIterator[TcpProxy]:
    target = urlsplit(env["GATE_REDIS_URL"])
    p = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await p.start()
    yield p
    await p.close()


async def _gate_via(env: dict[str, str], proxy: TcpProxy, **extra: str) -> GateProcess:
    gate = GateProcess({**env, "GATE_REDIS_URL": redis_via(env, proxy), **extra})
    await asyncio.to_thread(gate.wait_ready)
    return gate


async def test_paused_redis_fails_closed_and_recovers(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=500)
    assert (await reserve(client, deal_id, 41_000, "pause-warm-0001")).status_code == 201
    before = await _counts(db, deal_id)
    pauser = aioredis.Redis.from_url(env["GATE_REDIS_URL"])
    await pauser.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
    try:
        responses = await asyncio.wait_for(
            asyncio.gather(
                *(reserve(client, deal_id, 41_100 + i, f"paused-{i:05d}") for i in range(20))
            ),
            30,
        )
    finally:
        await pauser.execute_command("CLIENT", "UNPAUSE")
        await pauser.aclose()
    for r in responses:
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "OVERLOADED"
        assert int(r.headers["Retry-After"]) >= 1
    # Nothing reached the database.
    assert await _counts(db, deal_id) == before
    await _until_recovered(client, deal_id, 41_200, 20)
    await assert_invariants(db, rds, deal_id, timeout_seconds=20)


async def test_cut_connection_fails_closed_and_recovers(
    env: dict[str, str], db: Database, rds: aioredis.Redis, proxy: TcpProxy
) -> None:
    gate = await _gate_via(env, proxy)
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=500)
        assert (await reserve(client, deal_id, 42_000, "cut-warm-00001")).status_code == 201
        before = await _counts(db, deal_id)
        proxy.cut()
        responses = await asyncio.gather(
            *(reserve(client, deal_id, 42_100 + i, f"cut-{i:05d}") for i in range(20))
        )
        assert {r.status_code for r in responses} == {503}
        assert {r.json()["code"] for r in responses} == {"OVERLOADED"}
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["redis"] != "ok"
        assert await _counts(db, deal_id) == before
        proxy.restore()
        await _until_recovered(client, deal_id, 42_200, 20)
        await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    finally:
        await client.close()
        gate.stop()


async def test_a_timed_out_admission_is_never_re_run(
    env: dict[str, str], db: Database, rds: aioredis.Redis, proxy: TcpProxy
) -> None:
    """Redis runs the script but its answer arrives after the gate's timeout: the
    gate answers 503 without re-sending it, and gives the orphaned token's units back
    itself once Redis answers (gate/reserve/giveback.py), long before the janitor's age rule."""
    gate = await _gate_via(
        env, proxy, GATE_REDIS_TIMEOUT_SECONDS="1", GATE_INFLIGHT_MAX_SECONDS="60"
    )
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=10)
        keys = deal_keys(deal_id)
        proxy.delay(1.5)  # longer than the gate's 1 s Redis timeout
        r = await reserve(client, deal_id, 43_000, "slow-reply-0001")
        assert r.status_code == 503, r.text
        proxy.restore()
        # Back within seconds (the janitor alone would wait 60 s); nothing was ordered.
        report = await assert_invariants(db, rds, deal_id, timeout_seconds=10)
        assert report["totals"] == {"total": 10, "available": 10, "held": 0, "sold": 0}
        assert await rds.hlen(keys.inflight) == 0
        # The script ran exactly once: one token, one unit, given back once.
        samples = sample_values(await client.metrics())
        assert value_of(samples, "gate_givebacks_total", outcome="given_back") == 1
        assert value_of(samples, "gate_givebacks_total", outcome="nothing") == 0
        again = await reserve(client, deal_id, 43_000, "slow-reply-0001")
        assert again.status_code == 201, again.text  # the key is free again
    finally:
        await client.close()
        gate.stop()


async def _fallback_gate(env: dict[str, str], proxy: TcpProxy, **extra: str) -> GateProcess:
    """A gate with the database fallback whose breaker opens at the first Redis failure
    and stays open for the test."""
    return await _gate_via(
        env,
        proxy,
        GATE_REDIS_DOWN_POLICY="database",
        GATE_REDIS_BREAKER_FAILURES="1",
        GATE_REDIS_BREAKER_OPEN_SECONDS="30",
        **extra,
    )


async def test_database_fallback_policy_sells_without_redis(
    env: dict[str, str], db: Database, rds: aioredis.Redis, proxy: TcpProxy
) -> None:
    gate = await _fallback_gate(env, proxy)
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=5)
        proxy.cut()
        # The first call fails and opens the breaker; later ones go to the database.
        first = await reserve(client, deal_id, 44_000, "fallback-00000")
        assert first.status_code == 503
        answers = [
            await reserve(client, deal_id, 44_001 + i, f"fallback-{i:05d}") for i in range(8)
        ]
        assert {r.status_code for r in answers} <= {201, 409, 503}, [r.text for r in answers]
        created = sum(r.status_code == 201 for r in answers)
        # Never more than the stock, even without Redis in front.
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        assert row is not None and int(row[0]) == created <= 5
        assert created >= 1
        # Replays work from the database's unique key, also now that the deal is sold
        # out (gate_reserve refuses on stock before it meets the key).
        assert (await reserve(client, deal_id, 44_100, "fallback-late")).status_code == 409
        i = next(i for i, r in enumerate(answers) if r.status_code == 201)
        again = await reserve(client, deal_id, 44_001 + i, f"fallback-{i:05d}")
        assert again.status_code == 200, again.text
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == answers[i].json()
        changed = await reserve(client, deal_id, 44_001 + i, f"fallback-{i:05d}", quantity=2)
        assert changed.status_code == 422, changed.text
        assert changed.json()["code"] == "IDEMPOTENCY_MISMATCH"
        proxy.restore()
        # Redis learns what was sold while it was away.
        await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    finally:
        await client.close()
        gate.stop()


async def test_database_fallback_keeps_keys_differing_only_by_case_apart(
    env: dict[str, str], db: Database, rds: aioredis.Redis, proxy: TcpProxy
) -> None:
    """On the database fallback: without Redis the database alone tells keys apart,
    byte for byte (db/007), so a second key is never answered with the first key's
    order."""
    gate = await _fallback_gate(env, proxy)
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=5)
        proxy.cut()
        # The first call fails and opens the breaker; later ones go to the database.
        assert (await reserve(client, deal_id, 45_000, "fb-case-opener")).status_code == 503
        keys = ("Fallback-Case-Key", "fallback-case-key")
        answers = [await reserve(client, deal_id, 45_001, k) for k in keys]
        assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
        orders = [r.json()["order_id"] for r in answers]
        assert orders[0] != orders[1]
        for key, order_id in zip(keys, orders, strict=True):
            again = await reserve(client, deal_id, 45_001, key)
            assert again.status_code == 200, again.text
            assert again.json()["order_id"] == order_id
        row = await db.fetchone(
            "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND user_id = 45001", (deal_id,)
        )
        assert row is not None and int(row[0]) == 2
        proxy.restore()
        await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    finally:
        await client.close()
        gate.stop()


@pytest.mark.parametrize("on_error", ["closed", "open"])
async def test_limiters_fail_closed_or_open_by_configuration(
    env: dict[str, str], db: Database, rds: aioredis.Redis, proxy: TcpProxy, on_error: str
) -> None:
    """With the database fallback and a limiter on, Redis down: by default (closed) no
    reservation passes unlimited, so none reaches the database; `open` sells from the
    database without the limits."""
    gate = await _fallback_gate(
        env, proxy, GATE_LIMIT_USER="100/m burst 100", GATE_LIMITS_ON_REDIS_ERROR=on_error
    )
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=50)
        proxy.cut()
        first = await reserve(client, deal_id, 45_000, f"limits-{on_error}-first")
        assert first.status_code == 503, first.text
        answers = [
            await reserve(client, deal_id, 45_001 + i, f"limits-{on_error}-{i:03d}")
            for i in range(6)
        ]
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        assert row is not None
        if on_error == "closed":
            for r in answers:
                assert r.status_code == 503, r.text
                assert r.json()["code"] == "OVERLOADED"
                assert "Rate limits unavailable" in r.json()["detail"]
                assert int(r.headers["Retry-After"]) >= 1
            assert int(row[0]) == 0
        else:
            assert [r.status_code for r in answers] == [201] * 6, [r.text for r in answers]
            assert int(row[0]) == 6
        proxy.restore()
        await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    finally:
        await client.close()
        gate.stop()


async def test_hot_path_connection_times_out_only_a_late_batch(
    env: dict[str, str], proxy: TcpProxy
) -> None:
    """The hot path's Redis connection (gate/store/resp.py) keeps one deadline timer for its
    oldest unanswered batch: batches answered in time never close it, however long it
    lives; a batch whose reply is late fails with a timeout and closes it, failing what
    is still pending on it; the next connect works again."""
    conn = RespConnection(redis_via(env, proxy), 0.3)
    await conn.connect()
    try:
        for _ in range(3):
            (pong,) = conn.send([("PING",)])
            assert await pong == "PONG"
            # Past the timeout with nothing pending: the connection stays open.
            await asyncio.sleep(0.4)
            assert conn.connected
        proxy.delay(1.0)
        late = conn.send([("PING",), ("PING",)])
        later = conn.send([("PING",)])
        results = await asyncio.gather(*late, *later, return_exceptions=True)
        assert all(isinstance(r, RedisTimeoutError) for r in results), results
        assert not conn.connected
        proxy.restore()
        await conn.connect()
        (pong,) = conn.send([("PING",)])
        assert await pong == "PONG"
    finally:
        conn.close()
