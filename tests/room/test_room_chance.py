"""A waiting buyer's chance on every ticket, "unlikely" below the room's threshold,
leaving and joining again at the back. Real gate process, real Redis and MariaDB:
the estimate loop writes each room's table once a second (gate/room/estimate.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.room.chance_support import evidence
from tests.support import ADMIN, Client, GateProcess, buyer, create_deal

# Not started: every ticket waits with a place (drawn in the prequeue).
ROOM = {"admit_per_second": 1000, "prequeue_seconds": 3600}


@pytest.fixture(scope="module")
def chance_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(
        {
            **env,
            "GATE_ROOM_POLL_MIN_MS": "100",
            "GATE_ROOM_POLL_MAX_MS": "100",
            "GATE_ROOM_INTERVAL_MS": "50",
        },
        workers=2,
    ) as proc:
        yield proc


@pytest.fixture
async def cc(chance_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(chance_gate.url) as client:
        yield client


def _at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def _call(client: Client, method: str, deal_id: int, user_id: int) -> Any:
    for _ in range(50):
        r = await client.request(method, f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))
        if r.status_code != 429:
            return r
        await asyncio.sleep(0.05)
    raise AssertionError("refused for 2.5 s")


async def until(client: Client, deal_id: int, user_id: int, ok: Any, seconds: float = 8.0) -> Any:
    deadline = time.monotonic() + seconds
    ticket: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = await _call(client, "GET", deal_id, user_id)
        assert r.status_code == 200, r.text
        ticket = r.json()
        if ok(ticket):
            return ticket
        await asyncio.sleep(0.1)
    raise AssertionError(f"never seen: {ticket}")


def _valid(found: Any) -> None:
    assert set(found) == {"p", "basis"}
    assert 0.0 <= found["p"] <= 1.0
    assert set(found["basis"]) == {"units_left", "ahead", "conversion"}
    assert found["basis"]["units_left"] >= 0 and found["basis"]["ahead"] >= 0
    assert 0.0 <= found["basis"]["conversion"] <= 1.0


async def test_chance_on_join_and_read(cc: Client) -> None:
    deal_id = await create_deal(cc, stock=10, starts_at=_at(600), waiting_room=ROOM)
    first = 71_000
    r = await _call(cc, "POST", deal_id, first)
    assert r.status_code == 201, r.text
    assert "chance" in r.json()
    # Within the units available whatever the others do: p 1 with no evidence needed.
    ticket = await until(cc, deal_id, first, lambda t: t["chance"] is not None)
    _valid(ticket["chance"])
    assert ticket["chance"]["p"] == 1.0
    assert ticket["state"] == "waiting"
    # A later join's answer carries it too (the table is held by then).
    joined = [(await _call(cc, "POST", deal_id, u)).json() for u in range(71_001, 71_006)]
    assert any(t["chance"] is not None for t in joined), joined
    for t in joined:
        if t["chance"] is not None:
            _valid(t["chance"])


async def test_unlikely_then_leave_and_join_again_at_the_back(
    cc: Client, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(cc, stock=1, starts_at=_at(600), waiting_room=ROOM)
    users = list(range(72_000, 72_040))
    for u in users:
        assert (await _call(cc, "POST", deal_id, u)).status_code == 201
    await evidence(rds, deal_id)
    # The last in line: 39 ahead for 1 unit, most of whom buy.
    positions = {u: (await _call(cc, "GET", deal_id, u)).json()["position"] for u in users}
    last = max(users, key=lambda u: positions[u])
    ticket = await until(cc, deal_id, last, lambda t: t["state"] == "unlikely")
    assert ticket["position"] == len(users)
    assert ticket["chance"]["p"] < 0.02
    assert ticket["chance"]["basis"]["units_left"] == 1
    assert ticket["chance"]["basis"]["ahead"] >= len(users) - 1
    # The first in line is sure of the one unit: waiting, p 1.
    head = min(users, key=lambda u: positions[u])
    assert (await until(cc, deal_id, head, lambda t: t["chance"] is not None))["chance"]["p"] == 1.0

    # Leaving: gone; a later join is a new ticket at the back.
    mid = sorted(users, key=lambda u: positions[u])[5]
    assert (await _call(cc, "DELETE", deal_id, mid)).status_code == 204
    assert (await _call(cc, "DELETE", deal_id, mid)).status_code == 204
    r = await _call(cc, "POST", deal_id, mid)
    assert r.status_code == 201, r.text
    assert r.json()["position"] == len(users)
    assert r.json()["ticket_id"] is not None

    # unlikely_below 0 turns it off: the same buyer reads "waiting".
    room = {**ROOM, "unlikely_below": 0}
    put = await cc.put(f"/v1/admin/deals/{deal_id}/waiting-room", json=room, headers=ADMIN)
    assert put.status_code == 200, put.text
    assert put.json()["waiting_room"]["unlikely_below"] == 0
    ticket = await until(cc, deal_id, last, lambda t: t["state"] == "waiting")
    assert ticket["chance"]["p"] < 0.02


@pytest.mark.parametrize("bad", [-0.1, 0.6, "0.1", True, None])
async def test_unlikely_below_is_validated(cc: Client, bad: Any) -> None:
    body = {"title": "t", "unit_price": 1, "currency": "EUR", "stock": 1}
    room = {**ROOM, "unlikely_below": bad}
    r = await cc.post("/v1/admin/deals", json={**body, "waiting_room": room}, headers=ADMIN)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
