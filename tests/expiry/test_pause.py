"""A sale that stops itself: a deal whose books break mid-sale is paused on every gate
within the invariant monitor's interval plus 5 s, sells nothing more, and resumes
only once `gate check` passes; an operator pauses and resumes by hand the same way.

Two real `gate serve` processes share the suite's MariaDB and Redis: gate A runs the
invariant monitor (a 1 s interval, every deal each pass, no work lease, so that the
suite's shared gate, whose pause on a breach is off, cannot hold the checks), gate B
runs none: B refuses the paused deal through the flag the pause wrote to Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.cli import deals as deal_cli
from gate.inventory.pause import pause, resume
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.console_support import console_env, sign_in
from tests.panels_support import read_ticket
from tests.support import (
    ADMIN,
    GATE_BIN,
    Client,
    GateProcess,
    buyer,
    create_deal,
    reserve,
)

INTERVAL_SECONDS = 1.0
# The bound: the monitor's interval plus 5 s.
PAUSED_WITHIN_SECONDS = INTERVAL_SECONDS + 5.0
_users = itertools.count(4_800_000)
_keys = itertools.count()


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, *args], env=env, capture_output=True, text=True, timeout=90, check=False
    )


async def arun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, env, *args)


async def buy(client: Client, deal_id: int) -> Any:
    """One reservation of a new buyer with a new key."""
    return await reserve(client, deal_id, next(_users), f"pause-key-{next(_keys):06d}")


async def sold(db: Database, deal_id: int) -> tuple[int, int]:
    """(orders of the deal, units held or sold by them)."""
    row = await db.fetchone(
        "SELECT COUNT(*), COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s"
        " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')",
        (deal_id,),
    )
    assert row is not None
    return int(row[0]), int(row[1])


async def ledger_notes(db: Database, deal_id: int) -> list[tuple[str, str, str]]:
    rows = await db.fetchall(
        "SELECT reason, actor, note FROM inventory_ledger WHERE deal_id = %s"
        " AND reason IN ('pause', 'resume') ORDER BY id",
        (deal_id,),
    )
    return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]


@pytest.fixture(scope="module")
def gates(env: dict[str, str], prepared: None) -> Iterator[tuple[GateProcess, GateProcess]]:
    # The room's polls and loop fast, so that a ticket may be read again at once.
    room = {
        "GATE_ROOM_POLL_MIN_MS": "100",
        "GATE_ROOM_POLL_MAX_MS": "100",
        "GATE_ROOM_INTERVAL_MS": "50",
    }
    # GATE_PAUSE_ON_BREACH unset: its default, on.
    monitoring = {k: v for k, v in env.items() if k != "GATE_PAUSE_ON_BREACH"}
    monitoring.update(
        {
            **room,
            "GATE_INVARIANT_INTERVAL_SECONDS": str(INTERVAL_SECONDS),
            "GATE_INVARIANT_DEALS_PER_PASS": "10000",
            "GATE_INVARIANT_DUTY_MAX": "1",
            "GATE_BACKGROUND_LEASE_SECONDS": "0",
        }
    )
    # Gate B also serves the console (tests/console_support.py).
    quiet = console_env({**env, **room, "GATE_INVARIANT_CHECKS": "0"})
    with GateProcess(monitoring, workers=1) as a, GateProcess(quiet, workers=1) as b:
        yield a, b


@contextlib.asynccontextmanager
async def clients(gates: tuple[GateProcess, GateProcess]) -> AsyncIterator[tuple[Client, Client]]:
    async with Client(gates[0].url) as a, Client(gates[1].url) as b:
        yield a, b


def assert_paused(resp: Any) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["Content-Type"] == "application/problem+json"
    assert resp.json()["code"] == "SALE_PAUSED", resp.text
    assert int(resp.headers["Retry-After"]) >= 1


async def test_a_counter_broken_mid_sale_pauses_the_deal_on_every_gate(
    gates: tuple[GateProcess, GateProcess], env: dict[str, str], db: Database
) -> None:
    async with clients(gates) as (a, b):
        deal_id = await create_deal(a, stock=1000, buckets=2)
        for client in (a, b, a, b):
            resp = await buy(client, deal_id)
            assert resp.status_code == 201, resp.text

        # The sale goes on on both gates while the books break under it.
        stop = asyncio.Event()
        answers: list[tuple[float, int, str]] = []

        async def traffic() -> None:
            for client in itertools.cycle((a, b)):
                if stop.is_set():
                    return
                resp = await buy(client, deal_id)
                code = resp.json().get("code", "") if resp.status_code >= 400 else ""
                answers.append((time.monotonic(), resp.status_code, code))
                await asyncio.sleep(0.05)

        buyers = asyncio.create_task(traffic())
        await asyncio.sleep(0.3)
        # 3 units moved from available to held with no order: what `gate check` sees
        # as "held 3 but orders hold 0" (and a ledger that does not sum).
        await db.execute(
            "UPDATE deal_buckets SET available = available - 3, held = held + 3"
            " WHERE deal_id = %s AND bucket = 0",
            (deal_id,),
        )
        broken_at = time.monotonic()
        paused_on: dict[str, float] = {}
        while len(paused_on) < 2 and time.monotonic() - broken_at < PAUSED_WITHIN_SECONDS + 5:
            for name, client in (("a", a), ("b", b)):
                if name not in paused_on:
                    resp = await buy(client, deal_id)
                    if resp.status_code == 503:
                        assert_paused(resp)
                        paused_on[name] = time.monotonic() - broken_at
            await asyncio.sleep(0.1)
        stop.set()
        await buyers
        assert set(paused_on) == {"a", "b"}, (paused_on, answers[-5:])
        assert max(paused_on.values()) <= PAUSED_WITHIN_SECONDS, paused_on
        # Every answer after both gates refused was a refusal: nothing sold after.
        refused_since = broken_at + max(paused_on.values())
        late = [x for x in answers if x[0] > refused_since + 0.2]
        assert all(status == 503 and code == "SALE_PAUSED" for _, status, code in late), late

        before = await sold(db, deal_id)
        for client in (a, b, a, b, a, b):
            assert_paused(await buy(client, deal_id))
        assert await sold(db, deal_id) == before

        # The ledger says why; the metric is up on the gate that paused it.
        notes = await ledger_notes(db, deal_id)
        assert len(notes) == 1, notes
        reason, actor, note = notes[0]
        assert (reason, actor) == ("pause", "invariant-monitor")
        assert note.startswith("books broken:") and "held" in note, note
        assert f'gate_deal_paused{{deal="{deal_id}"}} 1.0' in await a.metrics()

        # Resume is refused while `gate check` fails: by the CLI, by the admin API.
        check = await arun(env, "check", "--deal", str(deal_id))
        assert check.returncode != 0, check.stdout
        refused = await arun(env, "deal", "resume", str(deal_id), "--operator", "tester")
        assert refused.returncode == deal_cli.EXIT_REFUSED, refused.stderr
        assert "stays paused" in refused.stderr and "gate deal repair" in refused.stderr
        assert "held" in refused.stderr, refused.stderr
        resp = await b.post(f"/v1/admin/deals/{deal_id}/resume", json={}, headers=ADMIN)
        assert resp.status_code == 409, resp.text
        assert resp.headers["Content-Type"] == "application/problem+json"
        assert resp.json()["code"] == "CONFLICT" and resp.json()["breaches"], resp.text
        assert_paused(await buy(b, deal_id))
        assert len(await ledger_notes(db, deal_id)) == 1

        # Repaired, it passes `gate check`, and resumes.
        repaired = await arun(env, "deal", "repair", str(deal_id), "--wait", "10")
        assert repaired.returncode == 0, repaired.stderr
        check = await arun(env, "check", "--deal", str(deal_id))
        assert check.returncode == 0, check.stdout + check.stderr
        resumed = await arun(env, "deal", "resume", str(deal_id), "--operator", "tester")
        assert resumed.returncode == 0, resumed.stderr
        assert f"deal {deal_id}: resumed" in resumed.stdout
        for client in (a, b):
            resp = await buy(client, deal_id)
            assert resp.status_code == 201, resp.text
        assert [n[:2] for n in await ledger_notes(db, deal_id)] == [
            ("pause", "invariant-monitor"),
            ("resume", "tester"),
        ]
        # The monitor's next passes find the books sound: the deal stays open.
        await asyncio.sleep(INTERVAL_SECONDS * 2.5)
        resp = await buy(a, deal_id)
        assert resp.status_code == 201, resp.text
        assert f'gate_deal_paused{{deal="{deal_id}"}} 0.0' in await a.metrics()


async def test_an_operator_pauses_and_resumes_by_hand(
    gates: tuple[GateProcess, GateProcess], env: dict[str, str], db: Database, rds: aioredis.Redis
) -> None:
    async with clients(gates) as (a, b):
        deal_id = await create_deal(a, stock=10)
        paused = await arun(
            env, "deal", "pause", str(deal_id), "--reason", "supplier recall", "--operator", "ops"
        )
        assert paused.returncode == 0, paused.stderr
        assert f"deal {deal_id}: paused (supplier recall)" in paused.stdout
        assert f"gate deal resume {deal_id}" in paused.stdout
        for client in (a, b):
            assert_paused(await buy(client, deal_id))
        assert await sold(db, deal_id) == (0, 0)
        # Redis loses the deal: loaded again from the database, it is still paused.
        assert await rds.delete(deal_keys(deal_id).meta) == 1
        assert_paused(await buy(b, deal_id))
        assert await rds.hget(deal_keys(deal_id).meta, "paused") == "1"
        # A second pause changes and ledgers nothing.
        again = await arun(env, "deal", "pause", str(deal_id), "--json")
        assert again.returncode == 0, again.stderr
        assert '"changed": false' in again.stdout and '"paused": true' in again.stdout
        assert await ledger_notes(db, deal_id) == [("pause", "ops", "supplier recall")]

        # The admin API: resume (the books hold), pause again, resume.
        resp = await a.post(f"/v1/admin/deals/{deal_id}/resume", json={}, headers=ADMIN)
        assert resp.status_code == 200, resp.text
        assert resp.json()["paused"] is False and resp.json()["changed"] is True
        assert (await buy(b, deal_id)).status_code == 201
        resp = await b.post(
            f"/v1/admin/deals/{deal_id}/pause", json={"reason": "price error"}, headers=ADMIN
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["reason"] == "price error" and resp.json()["paused"] is True
        view = await a.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
        assert view.json()["paused"]["reason"] == "price error", view.text
        shown = await arun(env, "deal", "show", str(deal_id))
        assert "PAUSED since" in shown.stdout and "price error" in shown.stdout, shown.stdout
        assert_paused(await buy(a, deal_id))
        bad = await a.post(f"/v1/admin/deals/{deal_id}/pause", json={}, headers=ADMIN)
        assert bad.status_code == 400 and "'reason' is required" in bad.text, bad.text

        resumed = await arun(env, "deal", "resume", str(deal_id), "--operator", "ops")
        assert resumed.returncode == 0, resumed.stderr
        assert (await buy(a, deal_id)).status_code == 201
        not_paused = await arun(env, "deal", "resume", str(deal_id))
        assert not_paused.returncode == 0, not_paused.stderr
        assert f"deal {deal_id}: not paused; nothing changed" in not_paused.stdout
        assert [n[:2] for n in await ledger_notes(db, deal_id)] == [
            ("pause", "ops"),
            ("resume", "admin"),
            ("pause", "admin"),
            ("resume", "ops"),
        ]


async def test_the_console_shows_the_pause_and_resumes_only_sound_books(
    gates: tuple[GateProcess, GateProcess], env: dict[str, str], db: Database
) -> None:
    async with clients(gates) as (a, b):
        deal_id = await create_deal(a, stock=10)
        _, op = await sign_in(b)
        assert op is not None
        base = f"/console/api/deals/{deal_id}"
        resp = await b.post(base + "/pause", json={"reason": "checking"}, headers=op.write())
        assert resp.status_code == 200 and resp.json()["paused"] is True, resp.text
        assert_paused(await buy(a, deal_id))
        snap = await b.get("/console/api/snapshot", headers=op.read())
        deal = next(d for d in snap.json()["deals"] if d["id"] == deal_id)
        assert deal["status"] == "paused" and deal["paused"]["reason"] == "checking", deal

        # Books broken while paused: the console's resume is refused, naming them.
        await db.execute(
            "UPDATE deal_buckets SET available = available - 1, held = held + 1"
            " WHERE deal_id = %s AND bucket = 0",
            (deal_id,),
        )
        resp = await b.post(base + "/resume", json={}, headers=op.write())
        assert resp.status_code == 409, resp.text
        assert "stays paused" in resp.json()["detail"] and resp.json()["breaches"], resp.text
        repaired = await arun(env, "deal", "repair", str(deal_id), "--wait", "10")
        assert repaired.returncode == 0, repaired.stderr
        resp = await b.post(base + "/resume", json={"note": "repaired"}, headers=op.write())
        assert resp.status_code == 200 and resp.json()["paused"] is False, resp.text
        assert (await buy(a, deal_id)).status_code == 201
        notes = await ledger_notes(db, deal_id)
        assert [(r, n) for r, _, n in notes] == [("pause", "checking"), ("resume", "repaired")]
        assert all(actor.startswith("console:") for _, actor, _ in notes), notes


async def test_a_check_older_than_the_last_resume_does_not_pause_again(
    local_gate: Gate, db: Database
) -> None:
    """The monitor's check that began before an operator's repair and resume finds
    the old, broken books: its pause must not undo the resume."""
    deal = await local_gate.deals.create(
        {"title": "stale check", "unit_price": 100, "currency": "EUR", "stock": 5}
    )
    deal_id = int(deal["id"])
    row = await db.fetchone("SELECT NOW(6)")
    assert row is not None
    seen_at = row[0]
    mirror = local_gate.mirror
    await pause(db, mirror, deal_id, reason="by hand", actor="ops")
    resumed = await resume(db, mirror, deal_id, actor="ops")
    assert resumed["changed"] and not resumed["paused"]
    stale = await pause(
        db, mirror, deal_id, reason="books broken: old", actor="invariant-monitor", seen_at=seen_at
    )
    assert stale["changed"] is False and stale["paused"] is False, stale
    row = await db.fetchone("SELECT NOW(6)")
    assert row is not None
    fresh = await pause(
        db, mirror, deal_id, reason="books broken: new", actor="invariant-monitor", seen_at=row[0]
    )
    assert fresh["changed"] is True and fresh["paused"] is True, fresh
    assert [n[0] for n in await ledger_notes(db, deal_id)] == ["pause", "resume", "pause"]


async def test_a_paused_room_admits_nobody_and_tickets_keep_their_places(
    gates: tuple[GateProcess, GateProcess], env: dict[str, str]
) -> None:
    async with clients(gates) as (a, b):
        deal_id = await create_deal(a, stock=10, waiting_room={"admit_per_second": 1000})
        paused = await arun(env, "deal", "pause", str(deal_id), "--reason", "room test")
        assert paused.returncode == 0, paused.stderr
        users = [next(_users) for _ in range(3)]
        for user in users:
            resp = await a.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
            assert resp.status_code in (200, 201), resp.text
        places = [(await read_ticket(b, deal_id, user)).get("position") for user in users]
        # Both gates' room loops run every 50 ms: nobody is admitted while paused.
        await asyncio.sleep(1.5)
        for user, place in zip(users, places, strict=True):
            body = await read_ticket(a, deal_id, user)
            assert body["state"] == "waiting" and body["paused"] is True, body
            assert body.get("position") == place, (body, place)
        resumed = await arun(env, "deal", "resume", str(deal_id))
        assert resumed.returncode == 0, resumed.stderr
        deadline = time.monotonic() + 10
        states: list[str] = []
        while time.monotonic() < deadline:
            states = [(await read_ticket(b, deal_id, user))["state"] for user in users]
            if states == ["admitted"] * 3:
                break
            await asyncio.sleep(0.2)
        assert states == ["admitted"] * 3, states
        assert (await read_ticket(a, deal_id, users[0]))["paused"] is False


# -- the CLI's words, without a gate -------------------------------------------------


def _view(**kw: Any) -> dict[str, Any]:
    base = {
        "deal_id": 7,
        "paused": True,
        "paused_at": "2026-12-07T10:00:00.000000Z",
        "reason": "books broken: bucket 0: held 3 but orders hold 0",
        "changed": True,
    }
    return {**base, **kw}


def test_the_pause_commands_say_what_they_did() -> None:
    text = deal_cli._pause_text(_view())
    assert text.startswith("deal 7: paused (books broken: bucket 0: held 3 but orders hold 0)")
    assert "503 SALE_PAUSED" in text and "`gate deal resume 7`" in text
    again = deal_cli._pause_text(_view(changed=False))
    assert again.startswith("deal 7: already paused since 2026-12-07T10:00:00.000000Z")
    resumed = deal_cli._pause_text(_view(paused=False, paused_at=None, reason=None))
    assert resumed == "deal 7: resumed; gate check passes and the sale goes on"
    idle = deal_cli._pause_text(_view(paused=False, paused_at=None, reason=None, changed=False))
    assert idle == "deal 7: not paused; nothing changed"


@pytest.mark.parametrize("raw", ["", "   ", "x" * 256, "tab\there"])
def test_a_pause_reason_must_be_printable_and_short(raw: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="printable characters"):
        deal_cli._reason(raw)
    assert deal_cli._reason("supplier recall") == "supplier recall"


def test_bad_pause_input_exits_2_and_changes_nothing(env: dict[str, str], prepared: None) -> None:
    out = run(env, "deal", "pause", "0")
    assert out.returncode == 2 and "deal_id" in out.stderr, out.stderr
    out = run(env, "deal", "pause", "1", "--reason", "x" * 300)
    assert out.returncode == 2 and "printable characters" in out.stderr, out.stderr
    out = run(env, "deal", "resume", str(2**62))
    assert out.returncode == 2 and "No such deal" in out.stderr, out.stderr
