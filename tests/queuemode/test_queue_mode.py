"""Queue mode (docs/queue-mode.md) against real Redis, MariaDB and gate
processes: 202 QUEUED after the same admission, background group commits, exactly
once through kills, switching, dead letters, cancel."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.queuemode.cli import RETRY_CLAIM_SECONDS
from gate.store.db import Database
from gate.store.keys import deal_keys, queue_keys
from gate.store.redis_mode import detect_mode
from tests.cluster import flush_all_primaries
from tests.support import (
    ADMIN,
    Client,
    GateCommand,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    locked_buckets,
    redis_available,
    reserve,
)

BUYERS = 3000
STOCK = 500


async def _read_all_pending(
    client: Client, accepted: list[tuple[int, str]], timeout_seconds: float
) -> dict[str, Any]:
    """Poll every accepted order until none reads QUEUED; the last states."""
    deadline = time.monotonic() + timeout_seconds
    states: dict[str, Any] = {}
    left = list(accepted)
    while left and time.monotonic() < deadline:
        answers = await asyncio.gather(
            *(client.get(f"/v1/orders/{oid}", headers=buyer(uid)) for uid, oid in left)
        )
        still: list[tuple[int, str]] = []
        for (uid, oid), r in zip(left, answers, strict=True):
            assert r.status_code in (200, 503), r.text
            body = r.json() if r.status_code == 200 else {"status": "QUEUED"}
            states[oid] = body
            if body["status"] == "QUEUED":
                still.append((uid, oid))
        left = still
        if left:
            await asyncio.sleep(0.2)
    return states


LIMIT_ONE_AN_HOUR = "1/h burst 1"


def _command(env: dict[str, str], *args: str) -> tuple[int, str]:
    """A `gate …` command run to its end: (exit status, its output)."""
    cmd = GateCommand(env, *args)
    try:
        cmd.proc.wait(60)
    finally:
        code = cmd.stop()
    return code, cmd.output()


async def _queue_drained(rds: aioredis.Redis, deal_id: int, timeout_seconds: float = 20) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if await rds.xlen(queue_keys(deal_id).stream) == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"deal {deal_id}: queue not drained")


async def _held(db: Database, deal_id: int) -> int:
    row = await db.fetchone(
        "SELECT COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s"
        " AND status = 'PENDING_PAYMENT'",
        (deal_id,),
    )
    assert row is not None
    return int(row[0])


async def _crowd(
    client: Client, deal_id: int, base_user: int, n: int
) -> tuple[Counter[int], list[tuple[int, str]]]:
    responses = await asyncio.gather(
        *(reserve(client, deal_id, base_user + i, f"q-{deal_id}-{i:06d}") for i in range(n))
    )
    statuses: Counter[int] = Counter(r.status_code for r in responses)
    accepted: list[tuple[int, str]] = []
    for i, r in enumerate(responses):
        if r.status_code == 202:
            body = r.json()
            assert body["status"] == "QUEUED" and "expires_at" not in body, body
            assert r.headers["Location"] == f"/v1/orders/{body['order_id']}"
            accepted.append((base_user + i, body["order_id"]))
        elif r.status_code == 201:
            accepted.append((base_user + i, r.json()["order_id"]))
        else:
            # Refused at once, exactly as in sync mode.
            assert r.json()["code"] in ("SOLD_OUT", "OVERLOADED"), r.text
    return statuses, accepted


async def test_queue_mode_3000_buyers_500_units(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=STOCK, buckets=4, mode="queue")
    view = await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert view.json()["mode"] == "queue"
    assert (await client.get(f"/v1/deals/{deal_id}")).json()["mode"] == "queue"

    statuses, accepted = await _crowd(client, deal_id, 14_000_000, BUYERS)
    assert set(statuses) <= {202, 409, 503}, statuses
    assert statuses[202] <= STOCK
    assert statuses[202] == len(accepted)

    # Every 202 reads PENDING_PAYMENT within 10 s.
    states = await _read_all_pending(client, accepted, 10.0)
    assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": len(accepted)}
    assert all(s["expires_at"] for s in states.values())
    # A replay of a committed request answers 200 with the order.
    uid, oid = accepted[0]
    index = next(i for i in range(BUYERS) if 14_000_000 + i == uid)
    again = await reserve(client, deal_id, uid, f"q-{deal_id}-{index:06d}")
    for _ in range(50):  # a loaded machine may have opened the Redis breaker: 503
        if again.status_code != 503:
            break
        await asyncio.sleep(0.1)
        again = await reserve(client, deal_id, uid, f"q-{deal_id}-{index:06d}")
    assert again.status_code == 200 and again.json()["order_id"] == oid, again.text

    # Units shed with a 503 are sellable again: buy until sold out.
    i = 0
    extra: list[tuple[int, str]] = []
    while len(accepted) + len(extra) < STOCK and i < 5 * STOCK:
        r = await reserve(client, deal_id, 15_000_000 + i, f"qm-{deal_id}-{i}")
        assert r.status_code in (202, 503), r.text
        if r.status_code == 202:
            extra.append((15_000_000 + i, r.json()["order_id"]))
        i += 1
    states = await _read_all_pending(client, extra, 10.0)
    assert all(s["status"] == "PENDING_PAYMENT" for s in states.values())
    await _queue_drained(rds, deal_id)
    assert await _held(db, deal_id) == STOCK
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": STOCK, "available": 0, "held": STOCK, "sold": 0}
    assert await rds.hlen(deal_keys(deal_id).inflight) == 0


async def test_queued_replay_answers_202_then_the_order(
    env: dict[str, str], db: Database, rds: aioredis.Redis, client: Client, gate: GateProcess
) -> None:
    """Without consumers the request stays queued: its replay is 202 again; cancel
    gives the units back and it is never committed, even once consumers run."""
    idle = GateProcess({**env, "GATE_QUEUE_CONSUMERS": "0"}, background=True)
    try:
        idle.wait_ready()
        # The shared gate's consumers are frozen meanwhile (a real stall: its lease
        # lapses and it takes a new one when it wakes up).
        gate.signal_suite(signal.SIGSTOP)
        c = Client(idle.url)
        try:
            deal_id = await create_deal(c, stock=5)
            # Switched live: the process that switched follows at once.
            r = await c.put(
                f"/v1/admin/deals/{deal_id}/mode", json={"mode": "queue"}, headers=ADMIN
            )
            assert r.status_code == 200 and r.json()["mode"] == "queue", r.text
            bad = await c.put(f"/v1/admin/deals/{deal_id}/mode", json={"mode": "x"}, headers=ADMIN)
            assert bad.status_code == 400
            assert bad.headers["Content-Type"].startswith("application/problem+json")

            first = await reserve(c, deal_id, 16_000_001, "qr-000001")
            assert first.status_code == 202, first.text
            oid = first.json()["order_id"]
            replay = await reserve(c, deal_id, 16_000_001, "qr-000001")
            assert replay.status_code == 202 and replay.json()["order_id"] == oid
            view = await c.get(f"/v1/orders/{oid}", headers=buyer(16_000_001))
            assert view.status_code == 200 and view.json()["status"] == "QUEUED"
            other = await c.get(f"/v1/orders/{oid}", headers=buyer(16_000_002))
            assert other.status_code == 404
            # Polls of a waiting order are answered by Redis, never the database: they
            # answer with the orders table locked against every read.
            polls = await _polled_with_orders_locked(c, db, oid, 16_000_001)
            assert all(p == (200, "QUEUED") for p in polls), polls
            assert (await redis_available(rds, deal_id))[0] == 4

            cancelled = await c.post(f"/v1/orders/{oid}/cancel", headers=buyer(16_000_001))
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "REJECTED"
            assert cancelled.json()["reason"] == "CANCELLED"
            assert (await redis_available(rds, deal_id))[0] == 5
            view = await c.get(f"/v1/orders/{oid}", headers=buyer(16_000_001))
            assert view.json() == {
                "order_id": oid,
                "status": "REJECTED",
                "deal_id": deal_id,
                "reason": "CANCELLED",
            }
            again = await c.post(f"/v1/orders/{oid}/cancel", headers=buyer(16_000_001))
            assert again.status_code == 409
            polls = await _polled_with_orders_locked(c, db, oid, 16_000_001)
            assert all(p == (200, "REJECTED") for p in polls), polls
        finally:
            await c.close()
    finally:
        gate.signal_suite(signal.SIGCONT)
        idle.stop()
    # The shared gate's consumers meet the cancelled entry: acknowledged, never
    # committed, its units not given back twice.
    await _queue_drained(rds, deal_id)
    row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE id = %s", (oid,))
    assert row is not None and int(row[0]) == 0
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 5, "held": 0, "sold": 0}
    view = await client.get(f"/v1/orders/{oid}", headers=buyer(16_000_001))
    assert view.json()["reason"] == "CANCELLED"


async def _polled_with_orders_locked(
    c: Client, db: Database, order_id: str, user_id: int
) -> list[tuple[int, str]]:
    """Five polls of the order while this test's connection holds `orders` locked for
    writing (other sessions' reads of it wait): (status code, order status) each."""
    async with db.connection() as conn, conn.cursor() as cur:
        await cur.execute("LOCK TABLES orders WRITE")
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(c.get(f"/v1/orders/{order_id}", headers=buyer(user_id)) for _ in range(5))
                ),
                5.0,
            )
        finally:
            await cur.execute("UNLOCK TABLES")
    return [(a.status_code, str(a.json().get("status"))) for a in answers]


async def _dead_lettered(
    env: dict[str, str],
    db: Database,
    deal_id: int,
    user_id: int,
    send: Callable[[Client], Awaitable[Any]],
    worker_env: dict[str, str],
) -> tuple[str, dict[str, Any]]:
    """One queued request (`send`) through a gate of its own while every insert of
    this deal's orders fails (a trigger: a permanent failure of the commit), read
    until no longer QUEUED: (order id, its last state)."""
    trigger = f"gate_test_refuse_{deal_id}"
    await db.execute(
        f"CREATE TRIGGER {trigger} BEFORE INSERT ON orders FOR EACH ROW"
        f" IF NEW.deal_id = {deal_id} THEN"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'forced failure'; END IF"
    )
    worker = GateProcess({**env, **worker_env})
    try:
        worker.wait_ready()
        c = Client(worker.url)
        try:
            r = await send(c)
            assert r.status_code == 202, r.text
            oid = str(r.json()["order_id"])
            states = await _read_all_pending(c, [(user_id, oid)], 20.0)
        finally:
            await c.close()
    finally:
        await db.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        worker.stop()
    return oid, states[oid]


@pytest.mark.parametrize("attempts", [3])
async def test_permanent_failure_ends_in_a_dead_letter(
    env: dict[str, str], db: Database, rds: aioredis.Redis, client: Client, attempts: int
) -> None:
    deal_id = await create_deal(client, stock=10, mode="queue")
    oid, state = await _dead_lettered(
        env,
        db,
        deal_id,
        17_000_001,
        lambda c: reserve(c, deal_id, 17_000_001, "dl-000001"),
        {
            "GATE_QUEUE_ATTEMPTS_MAX": str(attempts),
            "GATE_QUEUE_RETRY_BASE_SECONDS": "0.05",
            # The buyer's one request spends the per-user limit: a retry made under the
            # same limit is refused RATE_LIMITED (below).
            "GATE_LIMIT_USER": LIMIT_ONE_AN_HOUR,
        },
    )
    assert state["status"] == "REJECTED" and state["reason"] == "DEAD_LETTER"
    rows = await db.fetchall(
        "SELECT order_id, attempts, last_error FROM queue_dead_letters WHERE deal_id = %s",
        (deal_id,),
    )
    assert len(rows) == 1 and rows[0][0] == oid
    # Its worker (3) or the shared gate (default 5) gave up on it.
    assert int(rows[0][1]) >= attempts and "forced failure" in str(rows[0][2])
    await _queue_drained(rds, deal_id)
    # Units back exactly once: Redis = DB, all 10 available.
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 10, "held": 0, "sold": 0}

    # The operator's view, then one retry: committed exactly once.
    status = _command(env, "queue", "status", "--deal", str(deal_id), "--json")
    assert status[0] == 0, status[1]
    (row,) = orjson.loads(status[1])
    assert row["deal_id"] == deal_id and row["dead_letters"] == 1 and row["depth"] == 0
    listed = _command(env, "queue", "dead-letters", "--deal", str(deal_id), "--json")
    assert listed[0] == 0, listed[1]
    (letter,) = orjson.loads(listed[1])
    assert letter["order_id"] == oid
    assert _command(env, "queue", "status", "--deal", str(deal_id + 10**6))[0] == 2
    assert _command(env, "queue", "status", "--deal", "0")[0] == 2
    # A retry refused for now (the buyer's limit spent) is no outcome: released again.
    limited = _command(
        {**env, "GATE_LIMIT_USER": LIMIT_ONE_AN_HOUR}, "queue", "retry", str(letter["entry_id"])
    )
    assert limited[0] == 1 and "RATE_LIMITED" in limited[1] and "again" in limited[1], limited
    row = await db.fetchone(
        "SELECT retried_at, retried_order_id FROM queue_dead_letters WHERE order_id = %s", (oid,)
    )
    assert row == (None, None)
    # A retry whose command died between its claim and its answer: the claim is
    # respected while it may still be running, taken over once it cannot be.
    await db.execute(
        "UPDATE queue_dead_letters SET retried_at = NOW(6) WHERE order_id = %s", (oid,)
    )
    running = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert running[0] == 1 and "being retried" in running[1], running
    await db.execute(
        "UPDATE queue_dead_letters SET retried_at = NOW(6) - INTERVAL %s SECOND"
        " WHERE order_id = %s",
        (RETRY_CLAIM_SECONDS + 1, oid),
    )
    retried = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert retried[0] == 0, retried[1]
    again = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert again[0] == 1 and "already retried" in again[1]
    row = await db.fetchone(
        "SELECT retried_order_id, retried_outcome FROM queue_dead_letters WHERE order_id = %s",
        (oid,),
    )
    assert row is not None and row[1] in ("QUEUED", "PENDING_PAYMENT"), row
    new_id = row[0]
    assert new_id and new_id != oid
    states = await _read_all_pending(client, [(17_000_001, str(new_id))], 20.0)
    assert states[str(new_id)]["status"] == "PENDING_PAYMENT"
    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 9, "held": 1, "sold": 0}


async def test_a_retry_refused_for_good_is_its_outcome(
    env: dict[str, str], db: Database, rds: aioredis.Redis, client: Client
) -> None:
    """The units a dead letter gave back were sold meanwhile: its retry is refused
    SOLD_OUT, recorded as its outcome, and later retries answer that refusal without
    trying again."""
    deal_id = await create_deal(client, stock=1, mode="queue")
    user = 17_000_201
    oid, state = await _dead_lettered(
        env,
        db,
        deal_id,
        user,
        lambda c: reserve(c, deal_id, user, "dl-final-01"),
        {"GATE_QUEUE_ATTEMPTS_MAX": "2", "GATE_QUEUE_RETRY_BASE_SECONDS": "0.05"},
    )
    assert state["status"] == "REJECTED" and state["reason"] == "DEAD_LETTER"
    await _queue_drained(rds, deal_id)
    other = await reserve(client, deal_id, user + 1, "dl-final-02")
    assert other.status_code == 202, other.text
    other_id = str(other.json()["order_id"])
    states = await _read_all_pending(client, [(user + 1, other_id)], 20.0)
    assert states[other_id]["status"] == "PENDING_PAYMENT"

    listed = _command(env, "queue", "dead-letters", "--deal", str(deal_id), "--json")
    (letter,) = orjson.loads(listed[1])
    refused = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert refused[0] == 1 and "refused: SOLD_OUT" in refused[1], refused
    assert "again" not in refused[1], refused
    row = await db.fetchone(
        "SELECT retried_order_id, retried_outcome, retried_at IS NOT NULL"
        " FROM queue_dead_letters WHERE order_id = %s",
        (oid,),
    )
    assert row == (None, "SOLD_OUT", 1), row
    again = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert again[0] == 1 and "already retried" in again[1] and "refused SOLD_OUT" in again[1]
    listed = _command(env, "queue", "dead-letters", "--deal", str(deal_id), "--json")
    (letter,) = orjson.loads(listed[1])
    assert letter["retried_outcome"] == "SOLD_OUT" and letter["retried_order_id"] is None
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 1, "available": 0, "held": 1, "sold": 0}


async def test_a_dead_letter_of_a_deal_with_a_waiting_room_can_be_retried(
    env: dict[str, str], db: Database, rds: aioredis.Redis, client: Client
) -> None:
    """The request that died spent the buyer's admission: the operator's retry needs
    none (and spends none), where a buyer's own request without one is refused."""
    room = {"admit_per_second": 50, "admission_ttl_seconds": 60, "prequeue_seconds": 0}
    deal_id = await create_deal(client, stock=10, mode="queue", waiting_room=room)
    user = 17_000_101
    joined = await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
    assert joined.status_code in (200, 201), joined.text
    token = None
    for _ in range(100):
        ticket = await client.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        if ticket.status_code == 200 and ticket.json()["admission_token"]:
            token = ticket.json()["admission_token"]
            break
        await asyncio.sleep(0.1)
    assert token, "never admitted"
    oid, state = await _dead_lettered(
        env,
        db,
        deal_id,
        user,
        lambda c: c.post(
            f"/v1/deals/{deal_id}/reservations",
            json={"quantity": 1},
            headers={**buyer(user), "Idempotency-Key": "dl-room-01", "Admission-Token": token},
        ),
        {"GATE_QUEUE_ATTEMPTS_MAX": "2", "GATE_QUEUE_RETRY_BASE_SECONDS": "0.05"},
    )
    assert state["status"] == "REJECTED" and state["reason"] == "DEAD_LETTER"
    await _queue_drained(rds, deal_id)
    # The buyer's admission is spent: their own request without one is refused.
    again = await reserve(client, deal_id, user, "dl-room-02")
    assert again.status_code == 403 and again.json()["code"] == "ADMISSION_REQUIRED", again.text
    spent_before = await rds.hget(deal_keys(deal_id).room, "spent")
    listed = _command(env, "queue", "dead-letters", "--deal", str(deal_id), "--json")
    (letter,) = orjson.loads(listed[1])
    retried = _command(env, "queue", "retry", str(letter["entry_id"]))
    assert retried[0] == 0, retried[1]
    row = await db.fetchone(
        "SELECT retried_order_id FROM queue_dead_letters WHERE order_id = %s", (oid,)
    )
    assert row is not None and row[0]
    states = await _read_all_pending(client, [(user, str(row[0]))], 20.0)
    assert states[str(row[0])]["status"] == "PENDING_PAYMENT"
    assert await rds.hget(deal_keys(deal_id).room, "spent") == spent_before
    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 9, "held": 1, "sold": 0}


async def _fire(
    client: Client, deal_id: int, base_user: int, n: int, tag: str
) -> list[tuple[int, Any]]:
    """n buyers at once; (user, response or the exception a killed gate caused)."""
    results = await asyncio.gather(
        *(reserve(client, deal_id, base_user + i, f"{tag}-{deal_id}-{i:06d}") for i in range(n)),
        return_exceptions=True,
    )
    return [(base_user + i, r) for i, r in enumerate(results)]


def _accepted(results: list[tuple[int, Any]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for uid, r in results:
        if isinstance(r, BaseException):
            continue
        assert r.status_code in (201, 202, 409, 503), r.text
        if r.status_code in (201, 202):
            out.append((uid, r.json()["order_id"]))
        else:
            assert r.json()["code"] in ("SOLD_OUT", "OVERLOADED"), r.text
    return out


async def test_sigkill_mid_drain_a_new_gate_finishes(
    env: dict[str, str],
    db: Database,
    rds: aioredis.Redis,
    client: Client,
    gate: GateProcess,
    settings: Settings,
) -> None:
    stock = 300
    deal_id = await create_deal(client, stock=stock, buckets=2, mode="queue")
    # A claim idle far beyond the 10 s bound: the dead gate's entries can only be taken
    # over in time because its lease is gone (named consumers), not by their age.
    slow = {**env, "GATE_QUEUE_BATCH_MAX": "4", "GATE_QUEUE_CLAIM_IDLE_SECONDS": "60"}
    first = GateProcess(slow)
    first.wait_ready()
    gate.signal_suite(signal.SIGSTOP)
    try:
        c = Client(first.url)
        try:
            # Killed with some committed and some still waiting in the queue, made
            # so rather than waited for (a drain that keeps pace with the admissions,
            # as two gates on a Redis Cluster can, leaves no backlog): a first wave
            # is committed, then the bucket rows are held so that the drain waits
            # while the crowd queues, and the kill lands with the drain blocked in
            # the database.
            wave = await _fire(c, deal_id, 18_000_000, 40, "k")
            first_wave = _accepted(wave)
            assert first_wave
            deadline = time.monotonic() + 30
            while await _held(db, deal_id) < len(first_wave):
                assert time.monotonic() < deadline, "the first wave was not committed"
                await asyncio.sleep(0.01)
            async with locked_buckets(settings, deal_id):
                crowd = asyncio.ensure_future(_fire(c, deal_id, 18_000_100, 1200, "k"))
                while await rds.xlen(queue_keys(deal_id).stream) <= 20:
                    assert time.monotonic() < deadline, "no queue formed"
                    await asyncio.sleep(0.01)
                held_at_kill = await _held(db, deal_id)
                first.kill()
            results = wave + await crowd
        finally:
            await c.close()
        assert 0 < held_at_kill < stock
        accepted = _accepted(results)
        second = GateProcess(slow)
        try:
            second.wait_ready()
            c2 = Client(second.url)
            try:
                # Every 202 reads PENDING_PAYMENT within 10 s.
                states = await _read_all_pending(c2, accepted, 10.0)
            finally:
                await c2.close()
            assert Counter(s["status"] for s in states.values()) == {
                "PENDING_PAYMENT": len(accepted)
            }
            await _queue_drained(rds, deal_id)
        finally:
            second.stop()
    finally:
        gate.signal_suite(signal.SIGCONT)
        first.stop()
    # Admitted but never answered (the kill): committed or given back, exactly once.
    report = await assert_invariants(db, rds, deal_id, timeout_seconds=30)
    held = await _held(db, deal_id)
    assert held >= len(accepted)
    assert report["totals"]["held"] == held
    assert report["totals"]["available"] == stock - held


async def test_db_connections_killed_mid_drain(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    stock = 400
    killed = 0

    async def killer(stop: asyncio.Event) -> None:
        """Kills for one second from the first kill: a burst mid-drain that
        retries outlast (a database failing for longer ends in dead letters, by
        design: test_permanent_failure_ends_in_a_dead_letter)."""
        nonlocal killed
        until = float("inf")
        while not stop.is_set() and time.monotonic() < until:
            rows = await db.fetchall(
                # Whatever a gate connection is running (a group commit, its
                # COMMIT, a look-up): killed mid-statement.
                "SELECT ID FROM information_schema.PROCESSLIST WHERE COMMAND = 'Query'"
                " AND DB = DATABASE() AND ID <> CONNECTION_ID()"
            )
            for (thread_id,) in rows:
                try:
                    await db.execute(f"KILL {int(thread_id)}")
                    killed += 1
                    until = min(until, time.monotonic() + 1.0)
                except Exception:
                    pass
            await asyncio.sleep(0.005)

    # A drain quicker than the killer's look at the process list catches nothing:
    # another sale then, on a deal of its own (at most three).
    for attempt in range(3):
        deal_id = await create_deal(client, stock=stock, buckets=4, mode="queue")
        stop = asyncio.Event()
        task = asyncio.ensure_future(killer(stop))
        try:
            results = await _fire(
                client, deal_id, 19_000_000 + attempt * 10_000, 1500, f"dbk{attempt}"
            )
            accepted = _accepted(results)
            # Every 202 reads PENDING_PAYMENT within 10 s.
            states = await _read_all_pending(client, accepted, 10.0)
        finally:
            stop.set()
            await task
        reasons = Counter(s.get("reason") for s in states.values())
        statuses = Counter(s["status"] for s in states.values())
        assert statuses == {"PENDING_PAYMENT": len(accepted)}, reasons
        await _queue_drained(rds, deal_id)
        report = await assert_invariants(db, rds, deal_id, timeout_seconds=20)
        held = await _held(db, deal_id)
        assert held == len(accepted)
        assert report["totals"]["held"] == held
        assert report["totals"]["available"] == stock - held
        if killed:
            break
    assert killed > 0, "no commit was caught mid-flight in three sales"


async def test_switch_sync_queue_sync_under_load(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    stock = 2000
    deal_id = await create_deal(client, stock=stock, buckets=4)
    stop = asyncio.Event()
    results: list[tuple[int, Any]] = []

    async def load() -> None:
        wave = 0
        while not stop.is_set():
            results.extend(await _fire(client, deal_id, 20_000_000 + wave * 1000, 40, f"sw{wave}"))
            wave += 1
            await asyncio.sleep(0.05)

    loader = asyncio.ensure_future(load())
    try:
        # Every process follows a switch within GATE_QUEUE_MODE_REFRESH_SECONDS (1 s).
        for mode in ("queue", "sync"):
            await asyncio.sleep(1.5)
            r = await client.put(
                f"/v1/admin/deals/{deal_id}/mode", json={"mode": mode}, headers=ADMIN
            )
            assert r.status_code == 200 and r.json()["mode"] == mode, r.text
        await asyncio.sleep(1.5)
    finally:
        stop.set()
        await loader
    statuses = Counter(r.status_code for _, r in results if not isinstance(r, BaseException))
    assert not any(isinstance(r, BaseException) for _, r in results)
    # Both modes answered during the sale.
    assert statuses[201] > 0 and statuses[202] > 0, statuses
    accepted = _accepted(results)
    # Answered once each: no order id twice.
    assert len({oid for _, oid in accepted}) == len(accepted)
    states = await _read_all_pending(client, accepted, 20.0)
    assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": len(accepted)}
    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id)
    held = await _held(db, deal_id)
    assert held == len(accepted), statuses
    assert report["totals"]["available"] == stock - held
    view = await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert view.json()["mode"] == "sync"


async def test_queue_cap_answers_503_and_gives_the_units_back(
    env: dict[str, str], rds: aioredis.Redis, db: Database, client: Client, gate: GateProcess
) -> None:
    """GATE_QUEUE_DEPTH_MAX: an admitted request beyond it is given back, 503."""
    capped = GateProcess({**env, "GATE_QUEUE_CONSUMERS": "0", "GATE_QUEUE_DEPTH_MAX": "2"})
    try:
        capped.wait_ready()
        gate.signal_suite(signal.SIGSTOP)  # no consumer drains meanwhile
        c = Client(capped.url)
        try:
            deal_id = await create_deal(c, stock=10, mode="queue")
            answers = [
                await reserve(c, deal_id, 21_000_000 + i, f"cap-{deal_id}-{i:06d}")
                for i in range(3)
            ]
            assert [a.status_code for a in answers] == [202, 202, 503], [a.text for a in answers]
            assert answers[2].json()["code"] == "OVERLOADED"
            assert await rds.xlen(queue_keys(deal_id).stream) == 2
            assert (await redis_available(rds, deal_id))[0] == 8
            assert await rds.hlen(deal_keys(deal_id).inflight) == 2
        finally:
            await c.close()
    finally:
        gate.signal_suite(signal.SIGCONT)
        capped.stop()
    await _queue_drained(rds, deal_id)
    assert await _held(db, deal_id) == 2
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 8, "held": 2, "sold": 0}


async def _flushed_then_queued(
    client: Client, settings: Settings, deal_id: int, base_user: int, n: int
) -> list[tuple[int, str]]:
    """FLUSHDB on every primary, then n buyers queued through `client` (503s while a
    gate reloads the deal are retried with other buyers): their (user, order id)."""
    mode = detect_mode(settings.redis_url, settings.redis_mode, 2.0)
    await asyncio.to_thread(flush_all_primaries, settings.redis_url, mode)
    accepted: list[tuple[int, str]] = []
    deadline = time.monotonic() + 10
    attempt = 0
    while len(accepted) < n:
        assert time.monotonic() < deadline, "no admissions after the flush"
        attempt += 1
        base = base_user + 1_000 * attempt
        statuses, more = await _crowd(client, deal_id, base, n - len(accepted))
        assert set(statuses) <= {202, 503}, statuses
        accepted += more
    return accepted


async def test_redis_flushed_mid_sale_later_requests_are_committed(
    client: Client, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """Redis loses everything mid-sale (FLUSHDB on every primary): the gates go on
    queueing, and their consumers find the deal's new queue and make their group on
    it again, without a restart. (What was queued in the lost Redis was never
    committed: the resync gives its units back; docs/queue-mode.md, Known limits.)"""
    stock = 200
    deal_id = await create_deal(client, stock=stock, buckets=2, mode="queue")
    _, first = await _crowd(client, deal_id, 19_000_000, 40)
    assert len(first) == 40
    states = await _read_all_pending(client, first, 10.0)
    assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": 40}

    accepted = await _flushed_then_queued(client, settings, deal_id, 19_100_000, 60)
    # Every 202 after the flush reads PENDING_PAYMENT within 10 s, as before it.
    states = await _read_all_pending(client, accepted, 10.0)
    assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": 60}
    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id, timeout_seconds=30)
    assert report["totals"] == {"total": stock, "available": stock - 100, "held": 100, "sold": 0}
    assert await _held(db, deal_id) == 100


async def test_redis_flushed_then_the_gate_that_queued_killed_another_drains(
    env: dict[str, str],
    client: Client,
    db: Database,
    rds: aioredis.Redis,
    settings: Settings,
) -> None:
    """Redis loses everything, a gate queues requests of a deal, and is SIGKILLed
    before it announces the deal again (at its next refresh of the modes): the
    suite's gates, which never queued to that deal, find its queue all the same,
    because a consumer walks every deal in queue mode, not only those the lost set
    named: those requests never wait, QUEUED, for a restart of a gate that had
    queued to the deal."""
    stock = 100
    deal_id = await create_deal(client, stock=stock, buckets=2, mode="queue")
    # No consumer of its own, and the longest refresh of the modes: its requests
    # are drained by the suite's gates, and it announces the deal again at most
    # every 2 s.
    first = GateProcess(
        {**env, "GATE_QUEUE_CONSUMERS": "0", "GATE_QUEUE_MODE_REFRESH_SECONDS": "2"}
    )
    first.wait_ready()
    c = Client(first.url)
    try:
        _, before = await _crowd(c, deal_id, 19_200_000, 10)
        assert len(before) == 10
        states = await _read_all_pending(client, before, 10.0)
        assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": 10}

        accepted = await _flushed_then_queued(c, settings, deal_id, 19_300_000, 20)
        first.kill()
    finally:
        await c.close()
        first.stop()
    states = await _read_all_pending(client, accepted, 10.0)
    assert Counter(s["status"] for s in states.values()) == {"PENDING_PAYMENT": 20}
    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id, timeout_seconds=30)
    # The ten committed before the flush are in the database; Redis rebuilt them.
    assert report["totals"] == {"total": stock, "available": stock - 30, "held": 30, "sold": 0}


async def test_a_replay_whose_record_redis_lost_is_answered_with_its_order(
    client: Client, db: Database, rds: aioredis.Redis, settings: Settings
) -> None:
    """A buyer's request is queued and committed; Redis then loses everything, and
    the buyer retries with the same Idempotency-Key. As in sync mode, the answer is
    the order (200, replayed), not a 202 with a second order id whose commit can
    only fail (it read REJECTED/DUPLICATE while the units of the first were held
    for a buyer who had been told of neither). The same key with another quantity
    is a 422; a new key of the same buyer is queued as usual."""
    deal_id = await create_deal(
        client, stock=20, buckets=2, mode="queue", per_user_limit=5, max_per_order=3
    )
    user = 19_400_001
    first = await reserve(client, deal_id, user, "lost-replay-0001")
    assert first.status_code == 202, first.text
    order_id = first.json()["order_id"]
    states = await _read_all_pending(client, [(user, order_id)], 10.0)
    assert states[order_id]["status"] == "PENDING_PAYMENT"

    mode = detect_mode(settings.redis_url, settings.redis_mode, 2.0)
    await asyncio.to_thread(flush_all_primaries, settings.redis_url, mode)

    deadline = time.monotonic() + 10
    while True:  # 503 while the gate reloads the deal
        again = await reserve(client, deal_id, user, "lost-replay-0001")
        if again.status_code != 503 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert again.status_code == 200, again.text
    assert again.json()["order_id"] == order_id
    assert again.headers["Idempotent-Replayed"] == "true"
    mismatch = await reserve(client, deal_id, user, "lost-replay-0001", quantity=2)
    assert mismatch.status_code == 422, mismatch.text
    assert mismatch.json()["code"] == "IDEMPOTENCY_MISMATCH"
    other = await reserve(client, deal_id, user, "lost-replay-0002")
    assert other.status_code == 202, other.text
    other_id = other.json()["order_id"]
    states = await _read_all_pending(client, [(user, other_id)], 10.0)
    assert states[other_id]["status"] == "PENDING_PAYMENT"

    await _queue_drained(rds, deal_id)
    report = await assert_invariants(db, rds, deal_id, timeout_seconds=30)
    assert report["totals"] == {"total": 20, "available": 18, "held": 2, "sold": 0}
    assert await _held(db, deal_id) == 2
