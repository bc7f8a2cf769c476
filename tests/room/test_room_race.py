"""Admitted buyers never meet SOLD_OUT through the room's own doing: admissions cannot
outrun the units left. Real gate processes, real Redis and MariaDB.

Two ways it happened: a process's sold-out near-cache (gate/reserve/soldout.py)
answered an admitted buyer "sold out" after units had come back through another
process (a cancel there) and the room had admitted them for it; and the room's bound
counted admissions, not units, so a buyer of several units left another admitted
buyer with none."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.keys import deal_keys
from tests.support import Client, GateProcess, buyer, create_deal, locked_buckets

GATE_ENV = {
    "GATE_ROOM_POLL_MIN_MS": "100",
    "GATE_ROOM_POLL_MAX_MS": "100",
    "GATE_ROOM_INTERVAL_MS": "50",
    # The longest the near-cache may keep a "sold out": the widest window.
    "GATE_SOLD_OUT_CACHE_MS": "1000",
    # A locked row fails a reservation within seconds (each try waits this long).
    "GATE_DB_LOCK_WAIT_SECONDS": "1",
}
ROOM = {"admit_per_second": 1000}


@pytest.fixture(scope="module")
def two_gates(env: dict[str, str], prepared: None) -> Iterator[tuple[GateProcess, GateProcess]]:
    with (
        GateProcess({**env, **GATE_ENV}, workers=1) as a,
        GateProcess({**env, **GATE_ENV}, workers=1) as b,
    ):
        yield a, b


@pytest.fixture
async def clients(
    two_gates: tuple[GateProcess, GateProcess],
) -> AsyncIterator[tuple[Client, Client]]:
    a, b = two_gates
    async with Client(a.url) as ca, Client(b.url) as cb:
        yield ca, cb


async def ticket(client: Client, deal_id: int, user: int) -> dict[str, Any]:
    for _ in range(100):
        r = await client.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            return body
        assert r.status_code == 429, r.text
        await asyncio.sleep(0.03)
    raise AssertionError("ticket never read")


async def admitted(client: Client, deal_id: int, user: int, seconds: float = 5) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    found: dict[str, Any] = {}
    while time.monotonic() < deadline:
        found = await ticket(client, deal_id, user)
        if found["state"] == "admitted":
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"user {user} not admitted: {found}")


async def reserve(
    client: Client, deal_id: int, user: int, token: str | None, quantity: int = 1
) -> Any:
    headers = {**buyer(user), "Idempotency-Key": f"race-{deal_id}-{user}"}
    if token:
        headers["Admission-Token"] = token
    return await client.post(
        f"/v1/deals/{deal_id}/reservations", json={"quantity": quantity}, headers=headers
    )


async def test_units_back_through_another_gate_reach_the_admitted_buyer(
    clients: tuple[Client, Client],
) -> None:
    ca, cb = clients
    for round_ in range(3):
        deal_id = await create_deal(ca, stock=1, waiting_room=ROOM)
        first, loser, late = 90_000 + 10 * round_, 90_001 + 10 * round_, 90_002 + 10 * round_
        assert (
            await ca.post(f"/v1/deals/{deal_id}/queue", headers=buyer(first))
        ).status_code == 201
        held = await admitted(ca, deal_id, first)
        order = await reserve(ca, deal_id, first, held["admission_token"])
        assert order.status_code == 201, order.text
        # Gate A learns the deal is sold out (its near-cache keeps that a second).
        r = await reserve(ca, deal_id, loser, None)
        assert r.status_code == 409 and r.json()["code"] == "SOLD_OUT", r.text
        assert (await ca.post(f"/v1/deals/{deal_id}/queue", headers=buyer(late))).status_code == 201
        # The unit comes back through gate B: gate A is not told.
        cancel = await cb.post(
            f"/v1/orders/{order.json()['order_id']}/cancel", headers=buyer(first)
        )
        assert cancel.status_code == 200, cancel.text
        got = await admitted(ca, deal_id, late)
        r = await reserve(ca, deal_id, late, got["admission_token"])
        assert r.status_code == 201, r.text


async def test_an_admission_spent_on_a_failed_reservation_is_given_back(
    clients: tuple[Client, Client], rds: aioredis.Redis, settings: Settings
) -> None:
    """The database fails the reservation (its rows locked past the lock wait, every
    retry): 503, the units given back, and the admission too: the same token buys
    once the database is back. The admissions ring counted the admission once."""
    ca, _ = clients
    deal_id = await create_deal(ca, stock=2, waiting_room=ROOM)
    user = 92_000
    assert (await ca.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))).status_code == 201
    held = await admitted(ca, deal_id, user)
    async with locked_buckets(settings, deal_id):
        r = await reserve(ca, deal_id, user, held["admission_token"])
        assert r.status_code == 503 and r.json()["code"] == "OVERLOADED", r.text
    again = await admitted(ca, deal_id, user)
    assert again["admission_token"] is not None
    r = await reserve(ca, deal_id, user, held["admission_token"])
    assert r.status_code == 201, r.text
    ring = {str(f): int(v) for f, v in (await rds.hgetall(deal_keys(deal_id).room_ring)).items()}
    given = sum(v for f, v in ring.items() if f.startswith("n:"))
    assert given == 1, ring
