"""The console's waiting-room and queue-mode panels over real HTTP against a real
gate process (real Redis and MariaDB): the snapshot's numbers after real joins,
admissions, lapses and dead letters; the room message edited from the console
(validated as the admin API does, carried by ticket reads, ledgered with the
operator's session, CSRF-protected); dead letters retried from the console through
`gate queue retry`'s own code."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.room.gates import challenge_bits
from gate.store.db import Database
from gate.store.keys import queue_keys
from tests.console_support import ConsoleSession, console_env, sign_in
from tests.panels_support import (
    PANEL_ENV,
    challenge_bits_now,
    dead_letters,
    join_with_proof,
    message_read_within,
    orders_refused,
    problem,
    queued,
    quiet_room_deal,
    read_ticket,
    until_true,
)
from tests.support import ADMIN, Client, GateProcess, assert_invariants, buyer, create_deal

# A failed commit of a queued request is tried again this long after: its request
# stays in the queue (depth, oldest age) that long before it is dead-lettered.
RETRY_BASE_SECONDS = "3"


@pytest.fixture(scope="module")
def panel_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """One worker, so that every snapshot of a test is computed by the same process
    (admitted/s is a difference against that process's previous snapshot)."""
    with GateProcess(
        console_env(env, **PANEL_ENV, GATE_QUEUE_RETRY_BASE_SECONDS=RETRY_BASE_SECONDS),
        workers=1,
    ) as proc:
        yield proc


@pytest.fixture
async def pc(panel_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(panel_gate.url) as c:
        yield c


@pytest.fixture
async def op(pc: Client) -> ConsoleSession:
    r, session = await sign_in(pc)
    assert r.status_code == 200 and session is not None, r.text
    return session


async def deal_entry(pc: Client, op: ConsoleSession, deal_id: int) -> dict[str, Any]:
    """The deal's entry of the process's snapshot; {} while the kept snapshot is older
    than the deal (it is computed at most once a second)."""
    r = await pc.get("/console/api/snapshot", headers=op.read())
    assert r.status_code == 200, r.text
    found: dict[str, Any] = next((d for d in r.json()["deals"] if d["id"] == deal_id), {})
    return found


async def ledger_notes(db: Database, deal_id: int, reason: str) -> list[tuple[Any, ...]]:
    return await db.fetchall(
        "SELECT actor, note, d_total, d_available, d_held, d_sold FROM inventory_ledger"
        " WHERE deal_id = %s AND reason = %s ORDER BY id",
        (deal_id, reason),
    )


async def test_room_panel_counts_the_waiting_and_prices_the_challenge(
    pc: Client, op: ConsoleSession
) -> None:
    deal_id = await quiet_room_deal(pc, stock=2, low=1, high=20)
    plain = await create_deal(pc, stock=3)

    async def room() -> Any:
        return (await deal_entry(pc, op, deal_id)).get("waiting_room")

    empty = await until_true(room, "the room's panel")
    assert empty["waiting"] == 0 and empty["lapses"] == 0 and empty["admitted"] == 0
    assert empty["challenge_bits"] == 1 == await challenge_bits_now(pc, deal_id, 150_000)
    assert empty["admit_per_second"] == 5 and empty["message"] is None

    # Six joins, each through its proof of work: six waiting (the sale has not begun).
    for user in range(150_001, 150_007):
        await join_with_proof(pc, deal_id, user)
    shown = await until_true(
        lambda: _when(room, lambda r: r["waiting"] == 6), "six waiting on the panel"
    )
    # 1 + floor(log2(1 + 6 / 2)) = 3: the bits a joiner is asked now, as the panel says.
    assert shown["challenge_bits"] == challenge_bits(1, 20, 6, 2) == 3
    assert shown["challenge_bits"] == await challenge_bits_now(pc, deal_id, 150_100)
    assert shown["admitted"] == 0 and shown["unspent"] == 0

    # A deal without a room has no room fields (and a sync deal no queue fields).
    other = await until_true(lambda: deal_entry(pc, op, plain), "the plain deal")
    assert "waiting_room" not in other and "queue" not in other


async def _when(read: Any, ok: Any) -> Any:
    value = await read()
    return value if value and ok(value) else None


async def test_room_panel_shows_admissions_per_second_and_lapses(
    pc: Client, op: ConsoleSession
) -> None:
    room = {"admit_per_second": 100, "admission_ttl_seconds": 10}
    deal_id = await create_deal(pc, stock=5, waiting_room=room)

    async def panel() -> Any:
        return (await deal_entry(pc, op, deal_id)).get("waiting_room")

    before = await until_true(panel, "the room's panel")
    assert before["admitted"] == 0
    users = (151_001, 151_002, 151_003)
    for user in users:
        r = await pc.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        assert r.status_code == 201, r.text
    # Each snapshot of the process against its previous one: the one that first sees
    # the three admissions shows a rate above zero.
    rates: list[float] = []

    async def admitted() -> Any:
        shown = await panel()
        if shown and shown["admitted_per_second"] is not None:
            rates.append(shown["admitted_per_second"])
        return shown if shown and shown["admitted"] == 3 else None

    shown = await until_true(admitted, "three admissions on the panel")
    assert max(rates) > 0 and shown["waiting"] == 0 and shown["unspent"] == 3
    for user in users:
        assert (await read_ticket(pc, deal_id, user))["state"] == "admitted"

    # Nobody spends an admission: after its 10 s each lapses and is counted.
    lapsed = await until_true(
        lambda: _when(panel, lambda r: r["lapses"] == 3), "three lapses on the panel", 40
    )
    assert lapsed["unspent"] == 0 and lapsed["admitted"] == 3


async def test_room_message_from_the_console(
    pc: Client, op: ConsoleSession, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await quiet_room_deal(pc, stock=4, low=0, high=4)
    user = 152_001
    await join_with_proof(pc, deal_id, user)
    assert (await read_ticket(pc, deal_id, user))["message"] is None
    action = f"/console/api/deals/{deal_id}/room_message"
    message = {"text": "Doors open at noon — stay in line", "level": "warning"}

    # Without the CSRF token: 403, nothing changes.
    problem(await pc.post(action, json={"message": message}, headers=op.read()), 403, "FORBIDDEN")
    assert await ledger_notes(db, deal_id, "room_message") == []

    r = await pc.post(action, json={"message": message}, headers=op.write())
    assert r.status_code == 200, r.text
    assert r.json()["waiting_room"]["message"] == message
    # The waiters' ticket reads carry it (within 2 s; the room's Redis hash is written
    # before the answer).
    assert await message_read_within(pc, deal_id, user, message) == message
    view = (await pc.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["message"] == message
    # The rest of the room's configuration is as it was.
    assert view["waiting_room"]["challenge"] == {"min_bits": 0, "max_bits": 4}
    assert view["waiting_room"]["prequeue_seconds"] == 7200
    ((actor, note, *deltas),) = await ledger_notes(db, deal_id, "room_message")
    assert str(actor).startswith("console:") and message["text"] in str(note)
    assert deltas == [0, 0, 0, 0]
    shown = await until_true(
        lambda: _room_message(pc, op, deal_id, message), "the message on the panel"
    )
    assert shown == message

    # Bad input: the admin API's rule, 400 problem+json, nothing changed.
    for body in (
        {"message": {"text": "x" * 281, "level": "info"}},
        {"message": {"text": "", "level": "info"}},
        {"message": {"text": "hello", "level": "loud"}},
        {"message": {"text": "bell \x07"}},
        {"message": {"text": "hi", "colour": "red"}},
        {"message": "hello"},
        {"text": "hello"},
        {},
        [],
    ):
        problem(await pc.post(action, json=body, headers=op.write()), 400)
    assert len(await ledger_notes(db, deal_id, "room_message")) == 1
    assert (await read_ticket(pc, deal_id, user))["message"] == message
    view = (await pc.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["message"] == message

    # Removed: the reads carry none.
    r = await pc.post(action, json={"message": None}, headers=op.write())
    assert r.status_code == 200, r.text
    assert await message_read_within(pc, deal_id, user, None) is None
    notes = await ledger_notes(db, deal_id, "room_message")
    assert len(notes) == 2 and notes[1][1] == "message removed"

    # No room, no such deal.
    plain = await create_deal(pc, stock=2)
    problem(
        await pc.post(
            f"/console/api/deals/{plain}/room_message", json={"message": None}, headers=op.write()
        ),
        409,
        "CONFLICT",
    )
    problem(
        await pc.post(
            "/console/api/deals/999999999/room_message",
            json={"message": None},
            headers=op.write(),
        ),
        404,
    )
    # The ledger's notes move no units: the deal's counters and its ledger still agree.
    await assert_invariants(db, rds, deal_id)


async def _room_message(pc: Client, op: ConsoleSession, deal_id: int, wanted: Any) -> Any:
    room = (await deal_entry(pc, op, deal_id)).get("waiting_room")
    return room["message"] if room and room["message"] == wanted else None


async def test_queue_panel_and_dead_letters_retried_from_the_console(
    pc: Client, op: ConsoleSession, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(pc, stock=10, mode="queue")

    async def panel() -> Any:
        return (await deal_entry(pc, op, deal_id)).get("queue")

    empty = await until_true(panel, "the queue's panel")
    assert empty == {
        "mode": "queue",
        "depth": 0,
        "oldest_age_seconds": 0.0,
        "dead_letters": 0,
        "dead_letters_waiting": 0,
    }
    users = (153_001, 153_002)
    async with orders_refused(db, deal_id):
        for user in users:
            await queued(pc, deal_id, user, f"panel-dl-{deal_id}-{user}")
        # Both wait in the queue between their failed attempts.
        waiting = await until_true(
            lambda: _when(panel, lambda q: q["depth"] == 2 and q["oldest_age_seconds"] >= 0.5),
            "two requests in the queue, the oldest half a second old",
        )
        assert waiting["dead_letters"] == 0
        dead = await until_true(
            lambda: _when(panel, lambda q: q["dead_letters"] == 2 and q["depth"] == 0),
            "two dead letters on the panel",
        )
    assert dead["dead_letters_waiting"] == 2 and dead["oldest_age_seconds"] == 0.0
    assert await rds.xlen(queue_keys(deal_id).stream) == 0
    letters = await dead_letters(db, deal_id)
    assert len(letters) == 2 and all(row[2] is None for row in letters)

    action = f"/console/api/deals/{deal_id}/retry_dead_letters"
    # Without the CSRF token, or with a body that is not {}: refused, nothing retried.
    problem(await pc.post(action, json={}, headers=op.read()), 403, "FORBIDDEN")
    problem(await pc.post(action, json={"all": True}, headers=op.write()), 400)
    problem(await pc.post(action, json=[], headers=op.write()), 400)
    assert await dead_letters(db, deal_id) == letters
    assert await ledger_notes(db, deal_id, "dead_letter_retry") == []

    r = await pc.post(action, json={}, headers=op.write())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["retried"] == 2 and body["resubmitted"] == 2, body
    assert sorted(x["entry_id"] for x in body["results"]) == sorted(int(x[0]) for x in letters)
    retried = await dead_letters(db, deal_id)
    assert all(row[2] and row[3] in ("QUEUED", "PENDING_PAYMENT") for row in retried), retried
    # The retries went back through the queue and are committed: two units held.
    await until_true(lambda: _held(db, deal_id, 2), "the retried requests committed as orders", 30)
    ((actor, note, *deltas),) = await ledger_notes(db, deal_id, "dead_letter_retry")
    assert str(actor).startswith("console:") and "2 re-submitted" in str(note)
    assert deltas == [0, 0, 0, 0]
    after = await until_true(
        lambda: _when(panel, lambda q: q["dead_letters_waiting"] == 0), "none left to retry"
    )
    assert after["dead_letters"] == 2
    # A second retry has nothing to do: 409, no second order.
    problem(await pc.post(action, json={}, headers=op.write()), 409, "CONFLICT")
    problem(
        await pc.post(
            "/console/api/deals/999999999/retry_dead_letters", json={}, headers=op.write()
        ),
        404,
    )
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 8, "held": 2, "sold": 0}


async def _held(db: Database, deal_id: int, wanted: int) -> bool:
    row = await db.fetchone(
        "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
        (deal_id,),
    )
    return row is not None and int(row[0]) == wanted


async def test_panel_actions_need_a_session(pc: Client) -> None:
    deal_id = await create_deal(pc, stock=2, mode="queue")
    for action, body in (("room_message", {"message": None}), ("retry_dead_letters", {})):
        r = await pc.post(f"/console/api/deals/{deal_id}/{action}", json=body)
        problem(r, 401, "UNAUTHORIZED")
