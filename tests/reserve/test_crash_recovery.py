"""A gate SIGKILLed mid-storm leaves no ghost stock.

2,000 buyers storm one deal of 700 units through a victim gate; once it has sold some,
the whole process group is SIGKILLed (supervisor and both workers, wherever they are),
in one variant while another session holds the orders table locked for 2 s, so that
the kill lands with many transactions waiting in the database. The units the dead
requests had taken in Redis must be committed or buyable again within seconds, long
before GATE_INFLIGHT_MAX_SECONDS (30 s here, as in production): a surviving gate's
janitor sees the victim's liveness lease lapse, makes sure the victim's database
threads are gone, and resolves each marker the way the database decided. Then the deal
is drained through the survivor: every unit is sold, every key has at most one order,
nothing was given back twice (the resync loop never had to repair Redis), Redis = DB
and `gate check` is clean.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import aiohttp
import aiomysql
import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.db import Database, connect_kwargs
from gate.store.keys import deal_keys, owner_keys
from tests.support import (
    GATE_BIN,
    Client,
    GateCommand,
    GateProcess,
    assert_invariants,
    create_deal,
    db_available,
    locked_buckets,
    redis_available,
    reserve,
    wait_for_reserve_statement,
)

pytestmark = pytest.mark.slow

BUYERS = 2_000
STOCK = 700
CONNECTIONS_MAX = 200
ORDERS_BEFORE_KILL = 100
LOCK_SECONDS = 2.0
# The target is 5 s after the kill; measured 3-4 s. One second of margin
# for a loaded 2-core machine, and no more: a bound far above the target would pass a
# gate that missed it (the 30 s age rule would hide a failure only much later).
RECOVERY_BOUND_SECONDS = 6.0


def _env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "GATE_INFLIGHT_MAX_SECONDS": "30"}


async def _attempt(client: Client, deal_id: int, user: int) -> tuple[int, int | str, str]:
    """(user, status or the connection error's name, order id or '')."""
    try:
        r = await reserve(client, deal_id, user, f"crash-{deal_id}-{user}")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return user, type(exc).__name__, ""
    order_id = str(r.json().get("order_id", "")) if r.status_code in (200, 201) else ""
    return user, r.status_code, order_id


async def _order_count(db: Database, deal_id: int) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
    return int(row[0]) if row else 0


async def _ghost_units(db: Database, rds: aioredis.Redis, deal_id: int) -> tuple[int, int]:
    """(units the database has available but Redis does not offer, markers in flight)."""
    markers = int(await rds.hlen(deal_keys(deal_id).inflight))
    db_avail = sum((await db_available(db, deal_id)).values())
    r_avail, _ = await redis_available(rds, deal_id)
    return db_avail - (r_avail or 0), markers


async def _recovered_after(
    db: Database, rds: aioredis.Redis, deal_id: int, killed_at: float
) -> float:
    """Seconds from the kill until nothing is in flight and Redis offers exactly what
    the database has available (every unit committed or buyable again)."""
    while time.monotonic() - killed_at < 40:
        ghost, markers = await _ghost_units(db, rds, deal_id)
        _, r_buckets = await redis_available(rds, deal_id)
        if markers == 0 and ghost == 0 and r_buckets == await db_available(db, deal_id):
            return time.monotonic() - killed_at
        await asyncio.sleep(0.05)
    raise AssertionError("ghost stock still there 40 s after the kill")


@pytest.mark.parametrize("orders_locked", [False, True], ids=["idle-db", "orders-locked"])
async def test_a_killed_gate_leaves_no_ghost_stock(
    env: dict[str, str],
    db: Database,
    rds: aioredis.Redis,
    settings: Settings,
    orders_locked: bool,
) -> None:
    gate_env = _env(env)
    # Three janitors race for the dead gate's tokens: the survivor's two workers and
    # a `gate janitor` of its own.
    survivor = GateProcess(gate_env, workers=2)
    janitor = GateCommand(gate_env, "janitor")
    victim = GateProcess(gate_env, workers=2, background=False)
    await asyncio.gather(
        asyncio.to_thread(survivor.wait_ready), asyncio.to_thread(victim.wait_ready)
    )
    locker = await aiomysql.connect(**connect_kwargs(settings.mysql, 5))
    victim_client = Client(victim.url, limit=CONNECTIONS_MAX)
    client = Client(survivor.url, limit=CONNECTIONS_MAX)
    try:
        deal_id = await create_deal(client, stock=STOCK, buckets=4)
        user_base = 12_000_000 + deal_id * 10_000
        crowd = asyncio.gather(
            *(_attempt(victim_client, deal_id, user_base + i) for i in range(BUYERS))
        )
        # The kill lands once some orders are in and reservations are in flight. The
        # victim is frozen (SIGSTOP) when they are seen, looked at again, and killed
        # where it stands: on an idle database the ones seen in flight a moment before
        # could all have committed by the kill, leaving nothing to recover.
        inflight = deal_keys(deal_id).inflight
        locked_at = time.monotonic()
        while True:
            assert not crowd.done(), "the crowd finished before the kill"
            if await _order_count(db, deal_id) >= ORDERS_BEFORE_KILL and await rds.hlen(inflight):
                if orders_locked:
                    locked_at = time.monotonic()
                    async with locker.cursor() as cur:
                        await cur.execute("LOCK TABLES orders WRITE")
                    # Let the storm pile up on the busy database before the kill lands.
                    await asyncio.sleep(0.5)
                os.killpg(victim.proc.pid, signal.SIGSTOP)
                if await rds.hlen(inflight):
                    break
                os.killpg(victim.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.01)
        victim.kill()
        killed_at = time.monotonic()
        ghost_at_kill, markers_at_kill = await _ghost_units(db, rds, deal_id)
        if orders_locked:
            await asyncio.sleep(max(0.0, locked_at + LOCK_SECONDS - time.monotonic()))
            async with locker.cursor() as cur:
                await cur.execute("UNLOCK TABLES")
        results = await asyncio.wait_for(crowd, 60)

        recovered = await _recovered_after(db, rds, deal_id, killed_at)
        print(
            f"orders_locked={orders_locked}: {markers_at_kill} markers and {ghost_at_kill}"
            f" units missing at the kill; all back {recovered:.2f} s after it"
        )
        # The kill landed with reservations in flight: there was something to recover.
        # (On the idle database the ones in flight may all have committed at that
        # instant: markers to confirm, no unit missing yet. With the orders locked,
        # none can have.)
        assert markers_at_kill > 0, (markers_at_kill, ghost_at_kill)
        if orders_locked:
            assert ghost_at_kill > 0, (markers_at_kill, ghost_at_kill)
        assert recovered < RECOVERY_BOUND_SECONDS, recovered

        # Drain the deal through the survivor: the buyers whose request died retry with
        # the same key, then new buyers come until it is sold out.
        # (A fresh client: the first one's keep-alive connections idled past the
        # server's keep-alive timeout meanwhile.) A buyer whose connection broke
        # retries again, as one would.
        answered = {u: o for u, s, o in results if s == 201}
        drain = Client(survivor.url, limit=CONNECTIONS_MAX)
        try:
            retries: list[tuple[int, int | str, str]] = []
            waiting = [u for u, s, _ in results if s != 201]
            for _ in range(3):
                got = await asyncio.gather(*(_attempt(drain, deal_id, u) for u in waiting))
                retries += [r for r in got if isinstance(r[1], int)]
                waiting = [u for u, s, _ in got if not isinstance(s, int)]
                if not waiting:
                    break
            assert not waiting, waiting
            statuses = Counter(s for _, s, _ in retries)
            assert set(statuses) <= {200, 201, 409}, statuses
            next_user = user_base + BUYERS
            while sum((await db_available(db, deal_id)).values()) > 0:
                more = await asyncio.gather(
                    *(_attempt(drain, deal_id, next_user + i) for i in range(50))
                )
                next_user += 50
                answers = Counter(s for _, s, _ in more if isinstance(s, int))
                assert set(answers) <= {201, 409}, answers
                assert next_user < user_base + 4 * BUYERS, "the deal never sells out"
        finally:
            await drain.close()
    finally:
        await victim_client.close()
        await client.close()
        locker.close()
        victim.stop()
        survivor_log = survivor.output()
        survivor.stop()
        janitor.stop()

    # A replay (200) names the order its key already had; every key has at most one.
    rows = await db.fetchall(
        "SELECT idempotency_key, id, quantity FROM orders WHERE deal_id = %s", (deal_id,)
    )
    by_key = {str(k): str(i) for k, i, _ in rows}
    assert len(by_key) == len(rows)
    for user, status, order_id in retries:
        if status == 200:
            assert by_key[f"crash-{deal_id}-{user}"] == order_id
    for user, order_id in answered.items():
        assert by_key[f"crash-{deal_id}-{user}"] == order_id
    # No oversell, nothing left over: every unit sold exactly once.
    assert sum(int(q) for _, _, q in rows) == STOCK
    report = await assert_invariants(db, rds, deal_id, timeout_seconds=20)
    assert report["totals"] == {"total": STOCK, "available": 0, "held": STOCK, "sold": 0}
    # Nothing was given back twice: Redis never needed a repair by the resync loop.
    assert f"deal {deal_id}: repaired Redis drift" not in survivor_log, survivor_log[-3000:]
    check = await asyncio.create_subprocess_exec(
        GATE_BIN,
        "check",
        "--deal",
        str(deal_id),
        env=gate_env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(check.communicate(), 60)
    assert check.returncode == 0, out.decode(errors="replace")


async def _wait(predicate: Callable[[], Awaitable[bool]], timeout_seconds: float) -> float:
    """Seconds until `predicate` holds (AssertionError after `timeout_seconds`)."""
    started = time.monotonic()
    while not await predicate():
        assert time.monotonic() - started < timeout_seconds, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.parametrize("commits", [False, True], ids=["rolled-back", "committed"])
async def test_a_stalled_gate_loses_its_lease_but_not_its_outcome(
    env: dict[str, str],
    db: Database,
    rds: aioredis.Redis,
    settings: Settings,
    commits: bool,
) -> None:
    """A gate that stops answering (SIGSTOP: a stalled event loop, a paused VM) while its
    transaction waits on a bucket lock misses its lease renewals. The janitor must not
    give the units back on that alone: it ends the gate's server threads first, and
    only then asks the database. A transaction that committed meanwhile is confirmed;
    one the kill rolled back is given back once. The gate, resumed, answers its buyer
    accordingly, takes a new lease, and sells again; nothing was applied twice."""
    gate_env = _env(env)
    # The victim's statement would otherwise give up on the lock by itself.
    victim = GateProcess({**gate_env, "GATE_DB_LOCK_WAIT_SECONDS": "10"}, background=False)
    # Its janitor must not confirm a committed order on its age alone here: the
    # committed variant is to be resolved through the lapsed lease too.
    survivor = GateProcess({**gate_env, "GATE_JANITOR_COMMITTED_AFTER_SECONDS": "25"}, workers=1)
    await asyncio.gather(
        asyncio.to_thread(survivor.wait_ready), asyncio.to_thread(victim.wait_ready)
    )
    victim_client = Client(victim.url)
    client = Client(survivor.url)
    pending: asyncio.Future[tuple[int, int | str, str]] | None = None
    stopped = False
    try:
        deal_id = await create_deal(client, stock=5, buckets=1)
        user = 13_000_000 + deal_id * 100
        keys = deal_keys(deal_id)

        async def resolved() -> bool:
            return int(await rds.hlen(keys.inflight)) == 0

        async with locked_buckets(settings, deal_id) as cur:
            pending = asyncio.ensure_future(_attempt(victim_client, deal_id, user))
            thread_id = await wait_for_reserve_statement(cur, deal_id)
            (token,) = await rds.hkeys(keys.inflight)
            owner = str(await rds.hget(keys.inflight, token)).rsplit("|", 1)[1]
            os.killpg(victim.proc.pid, signal.SIGSTOP)
            stopped = True
            stopped_at = time.monotonic()
            if not commits:
                # The lock stays: only the janitor's kill can end the transaction.
                await _wait(resolved, RECOVERY_BOUND_SECONDS)
        if commits:
            # The lock is gone: the transaction commits now, its gate stopped.
            await _wait(lambda: _order_exists(db, token), 5)
            await _wait(resolved, RECOVERY_BOUND_SECONDS)
        # Resolved on the lease, long before the 30 s age rule.
        waited = time.monotonic() - stopped_at
        print(f"commits={commits}: resolved {waited:.2f} s after the gate stopped")
        if not commits:
            # Only the janitor's kill could end it. (A committed one may also have been
            # confirmed on its age by a janitor running GATE_JANITOR_COMMITTED_AFTER_-
            # SECONDS of 2 s: the suite's shared gate, when it runs beside this test.)
            assert not await _thread_alive(db, thread_id)
        assert await _order_exists(db, token) == commits
        avail, _ = await redis_available(rds, deal_id)
        assert avail == (4 if commits else 5)

        async def lapsed() -> bool:
            return int(await rds.exists(owner_keys(owner).lease)) == 0

        await _wait(lapsed, 10)
        os.killpg(victim.proc.pid, signal.SIGCONT)
        stopped = False
        _, status, order_id = await asyncio.wait_for(pending, 30)
        if commits:
            assert (status, order_id) == (201, token)
        else:
            assert status == 503
        # The resumed gate takes a new lease and sells again.
        assert (await _attempt(victim_client, deal_id, user + 1))[1] == 201
    finally:
        if stopped:
            os.killpg(victim.proc.pid, signal.SIGCONT)
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await victim_client.close()
        await client.close()
        victim.stop()
        survivor_log = survivor.output()
        survivor.stop()
    assert "lapsed; now" in victim.output()
    report = await assert_invariants(db, rds, deal_id)
    held = 2 if commits else 1
    assert report["totals"] == {"total": 5, "available": 5 - held, "held": held, "sold": 0}
    assert f"deal {deal_id}: repaired Redis drift" not in survivor_log, survivor_log[-3000:]


async def _order_exists(db: Database, order_id: str) -> bool:
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE id = %s", (order_id,))
    return bool(row and int(row[0]) == 1)


async def _thread_alive(db: Database, thread_id: int) -> bool:
    row = await db.fetchone(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (thread_id,)
    )
    return bool(row and int(row[0]) == 1)


async def test_a_lapsed_lease_alone_gives_nothing_back(
    env: dict[str, str], db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """The janitor cannot show the stalled gate's threads gone (its connection record
    was lost): it must leave the token alone, units taken, however long the lease has
    been gone; the transaction commits once the lock goes and the resumed gate confirms
    it itself."""
    gate_env = _env(env)
    victim = GateProcess({**gate_env, "GATE_DB_LOCK_WAIT_SECONDS": "10"}, background=False)
    survivor = GateProcess(gate_env, workers=1)
    await asyncio.gather(
        asyncio.to_thread(survivor.wait_ready), asyncio.to_thread(victim.wait_ready)
    )
    victim_client = Client(victim.url)
    client = Client(survivor.url)
    pending: asyncio.Future[tuple[int, int | str, str]] | None = None
    stopped = False
    try:
        deal_id = await create_deal(client, stock=5, buckets=1)
        user = 14_000_000 + deal_id * 100
        keys = deal_keys(deal_id)
        async with locked_buckets(settings, deal_id) as cur:
            pending = asyncio.ensure_future(_attempt(victim_client, deal_id, user))
            thread_id = await wait_for_reserve_statement(cur, deal_id)
            (token,) = await rds.hkeys(keys.inflight)
            owner = str(await rds.hget(keys.inflight, token)).rsplit("|", 1)[1]
            os.killpg(victim.proc.pid, signal.SIGSTOP)
            stopped = True
            assert await rds.delete(owner_keys(owner).conns) == 1

            async def lapsed() -> bool:
                return int(await rds.exists(owner_keys(owner).lease)) == 0

            await _wait(lapsed, 10)
            # Several janitor passes after the lapse (0.2 s apart): nothing happens.
            await asyncio.sleep(3)
            assert await rds.hexists(keys.inflight, token)
            assert await _thread_alive(db, thread_id)
            avail, _ = await redis_available(rds, deal_id)
            assert avail == 4
        await _wait(lambda: _order_exists(db, token), 5)
        os.killpg(victim.proc.pid, signal.SIGCONT)
        stopped = False
        _, status, order_id = await asyncio.wait_for(pending, 30)
        assert (status, order_id) == (201, token)
    finally:
        if stopped:
            os.killpg(victim.proc.pid, signal.SIGCONT)
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await victim_client.close()
        await client.close()
        victim.stop()
        survivor_log = survivor.output()
        survivor.stop()
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 4, "held": 1, "sold": 0}
    assert f"deal {deal_id}: repaired Redis drift" not in survivor_log, survivor_log[-3000:]
