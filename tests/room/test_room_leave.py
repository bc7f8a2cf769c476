"""Leaving the waiting room (DELETE /v1/deals/{id}/queue): the ticket and its place go,
everyone behind moves up, a later join is a new ticket at the back, an admitted
leaver's admission returns its slot. Real gate process, real Redis and MariaDB."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.room.fairness import draw_key
from gate.store.keys import deal_keys
from tests.support import ADMIN, Client, GateProcess, Resp, buyer, create_deal

ROOM = {"admit_per_second": 1000}


@pytest.fixture(scope="module")
def leave_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """A gate advising fast polls (tests read every ticket again after a tenth of a
    second) and advancing rooms every 50 ms."""
    with GateProcess(
        {
            **env,
            "GATE_ROOM_POLL_MIN_MS": "100",
            "GATE_ROOM_POLL_MAX_MS": "100",
            "GATE_ROOM_INTERVAL_MS": "50",
        },
        workers=1,
    ) as proc:
        yield proc


@pytest.fixture
async def lc(leave_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(leave_gate.url) as client:
        yield client


def _at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def join(client: Client, deal_id: int, user_id: int, body: Any = None) -> Resp:
    """A join, waiting out a 429 (a rejoin sooner than the left ticket's next poll)."""
    for _ in range(50):
        r = await client.post(f"/v1/deals/{deal_id}/queue", json=body, headers=buyer(user_id))
        if r.status_code != 429:
            return r
        await asyncio.sleep(0.05)
    raise AssertionError("join refused for 2.5 s")


async def leave(client: Client, deal_id: int, user_id: int) -> Resp:
    return await client.delete(f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))


async def read_ok(client: Client, deal_id: int, user_id: int) -> dict[str, Any]:
    for _ in range(50):
        r = await client.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body
        await asyncio.sleep(0.05)
    raise AssertionError("poll refused for 2.5 s")


async def wait_state(
    client: Client, deal_id: int, user_id: int, state: str, seconds: float = 10.0
) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    ticket: dict[str, Any] = {}
    while time.monotonic() < deadline:
        ticket = await read_ok(client, deal_id, user_id)
        if ticket["state"] == state:
            return ticket
        await asyncio.sleep(0.1)
    raise AssertionError(f"user {user_id} never reached {state}: {ticket}")


def problem(r: Resp, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code, r.text


async def room_counters(client: Client, deal_id: int) -> dict[str, Any]:
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["invariant"]["ok"], view["invariant"]
    room: dict[str, Any] = view["redis"]["room"]
    assert room["ok"], room
    return room


async def test_leave_and_rejoin_moves_everyone_up_and_queues_at_the_back(lc: Client) -> None:
    # One unit, taken by the first buyer's admission (the room's bound): the others
    # stay waiting, with positions.
    deal_id = await create_deal(lc, stock=1, waiting_room=ROOM)
    first = 61_000
    assert (await join(lc, deal_id, first)).status_code == 201
    await wait_state(lc, deal_id, first, "admitted")
    users = list(range(61_001, 61_006))
    tickets = {}
    for u in users:
        r = await join(lc, deal_id, u)
        assert r.status_code == 201, r.text
        tickets[u] = r.json()
    assert [tickets[u]["position"] for u in users] == [1, 2, 3, 4, 5]

    leaver = users[1]
    r = await leave(lc, deal_id, leaver)
    assert r.status_code == 204 and r.content == b"", r.text
    # The ticket and its place are gone.
    problem(await lc.get(f"/v1/deals/{deal_id}/queue", headers=buyer(leaver)), 404, "NO_TICKET")
    positions = [(await read_ok(lc, deal_id, u))["position"] for u in users if u != leaver]
    assert positions == [1, 2, 3, 4]
    # Idempotent: leaving again is answered the same, and changes nothing.
    assert (await leave(lc, deal_id, leaver)).status_code == 204
    assert [(await read_ok(lc, deal_id, u))["position"] for u in users if u != leaver] == positions

    # A later join is a new ticket, at the back.
    r = await join(lc, deal_id, leaver)
    assert r.status_code == 201, r.text
    again = r.json()
    assert again["state"] == "waiting" and again["position"] == 5
    assert again["ticket_id"] != tickets[leaver]["ticket_id"]
    assert again["joined_at"] > tickets[leaver]["joined_at"]
    late = 61_010
    assert (await join(lc, deal_id, late)).json()["position"] == 6
    room = await room_counters(lc, deal_id)
    assert room["waiting"] == 6 and room["tickets"] == 7 and room["lapsed"] == 0


async def test_leaving_without_a_ticket_is_a_404_and_writes_nothing(
    lc: Client, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(lc, stock=5, waiting_room=ROOM)
    plain = await create_deal(lc, stock=5)
    problem(await leave(lc, deal_id, 62_000), 404, "NOT_IN_QUEUE")
    assert not await rds.exists(deal_keys(deal_id).room_left)
    problem(await leave(lc, 999_999_999_999, 62_000), 404, "NOT_FOUND")
    problem(await leave(lc, plain, 62_000), 409, "NO_WAITING_ROOM")
    problem(await lc.delete(f"/v1/deals/{deal_id}/queue"), 401, "UNAUTHORIZED")


async def test_an_admitted_leaver_gives_the_slot_back(lc: Client) -> None:
    """One unit: the first buyer's admission takes the room's whole bound (unspent
    admissions <= units left), so the second waits. The first leaves: the admission
    is given back at once and the second is admitted, long before the first's would
    have lapsed (120 s)."""
    deal_id = await create_deal(lc, stock=1, waiting_room=ROOM)
    a, b = 63_001, 63_002
    assert (await join(lc, deal_id, a)).status_code == 201
    await wait_state(lc, deal_id, a, "admitted")
    assert (await join(lc, deal_id, b)).status_code == 201
    await asyncio.sleep(0.3)
    assert (await read_ok(lc, deal_id, b))["state"] == "waiting"

    assert (await leave(lc, deal_id, a)).status_code == 204
    ticket = await wait_state(lc, deal_id, b, "admitted", seconds=5.0)
    assert ticket["admission_token"]
    room = await room_counters(lc, deal_id)
    # admitted 2 = spent 0 + lapsed 1 (given back) + unspent 1 (b's).
    assert (room["admitted"], room["spent"], room["lapsed"], room["unspent"]) == (2, 0, 1, 1)
    assert room["within_stock_bound"]
    # The leaver's ticket is gone with its admission.
    problem(await lc.get(f"/v1/deals/{deal_id}/queue", headers=buyer(a)), 404, "NO_TICKET")


async def test_a_closed_ticket_cannot_be_left_to_queue_again(lc: Client) -> None:
    """A buyer whose admission was spent (they bought) is not in the line: leaving
    is NOT_IN_QUEUE and the closed ticket stays, so the buyer cannot queue again."""
    deal_id = await create_deal(lc, stock=2, waiting_room=ROOM)
    user = 64_001
    assert (await join(lc, deal_id, user)).status_code == 201
    token = (await wait_state(lc, deal_id, user, "admitted"))["admission_token"]
    headers = {**buyer(user), "Idempotency-Key": f"leave-key-{deal_id}", "Admission-Token": token}
    r = await lc.post(f"/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=headers)
    assert r.status_code == 201, r.text
    problem(await leave(lc, deal_id, user), 404, "NOT_IN_QUEUE")
    assert (await read_ok(lc, deal_id, user))["state"] == "closed"
    r = await join(lc, deal_id, user)
    assert r.status_code == 200 and r.json()["state"] == "closed", r.text


async def test_a_rejoin_sooner_than_the_left_tickets_poll_is_a_429(client: Client) -> None:
    """Join and leave cycles are bounded by the poll advice: a sold-out ticket is
    advised the slowest poll (GATE_ROOM_POLL_MAX_MS, 10 s by default) and its buyer,
    having left, may join again only then."""
    deal_id = await create_deal(client, stock=0, waiting_room=ROOM)
    user = 65_001
    r = await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
    assert r.status_code == 201 and r.json()["state"] == "sold_out", r.text
    assert (await leave(client, deal_id, user)).status_code == 204
    again = await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
    problem(again, 429, "RATE_LIMITED")
    assert again.json()["scope"] == "poll" and int(again.headers["retry-after"]) >= 1


@pytest.mark.parametrize("method", ["fifo", "random"])
async def test_a_rejoin_is_never_drawn_again(lc: Client, rds: aioredis.Redis, method: str) -> None:
    """During the prequeue (and in a random room at any time) joins are drawn: a
    leaver who joined again and drew again could leave until the draw suited them.
    So a rejoin is never drawn: it queues behind every drawn ticket, later ones too,
    and the draw list (the fairness document's participants) does not grow."""
    deal_id = await create_deal(
        lc,
        stock=5,
        starts_at=_at(3600),
        waiting_room={**ROOM, "prequeue_seconds": 7200, "method": method},
    )
    users = list(range(66_001, 66_006))
    for u in users:
        r = await join(lc, deal_id, u)
        assert r.status_code == 201 and r.json()["state"] == "waiting", r.text
    drawn = await rds.llen(draw_key(deal_id))
    assert drawn == len(users)

    leaver = users[0]
    assert (await leave(lc, deal_id, leaver)).status_code == 204
    r = await join(lc, deal_id, leaver)
    assert r.status_code == 201, r.text
    assert r.json()["position"] == len(users)
    # A later prequeue joiner is drawn, and lands ahead of the rejoin.
    assert (await join(lc, deal_id, 66_010)).status_code == 201
    assert (await read_ok(lc, deal_id, leaver))["position"] == len(users) + 1
    assert await rds.llen(draw_key(deal_id)) == drawn + 1


async def test_a_leaver_keeps_their_code_and_binds_no_other(
    lc: Client, rds: aioredis.Redis
) -> None:
    """Invite-only room: the code a leaver joined with stays bound to them (a leave
    frees nothing for a guesser), their rejoin needs no code, and a code it carries
    is neither judged nor bound (no account burns codes by join/leave cycles)."""
    deal_id = await create_deal(lc, stock=5, waiting_room={**ROOM, "access": "codes"})
    codes = ["LEAVE-code-0001", "LEAVE-code-0002"]
    r = await lc.post(
        f"/v1/admin/deals/{deal_id}/access-codes", json={"codes": codes}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    user, other = 67_001, 67_002
    assert (await join(lc, deal_id, user, {"access_code": codes[0]})).status_code == 201
    bound = await rds.hgetall(deal_keys(deal_id).room_codes)
    assert sorted(bound.values()) == ["", str(user)]

    assert (await leave(lc, deal_id, user)).status_code == 204
    # Still theirs: another buyer cannot use it.
    problem(await join(lc, deal_id, other, {"access_code": codes[0]}), 403, "ACCESS_CODE_USED")
    # The leaver joins again with the other, free code: nothing judged, nothing bound.
    r = await join(lc, deal_id, user, {"access_code": codes[1]})
    assert r.status_code == 201, r.text
    assert await rds.hgetall(deal_keys(deal_id).room_codes) == bound
    # ... and left for whoever it was sent to.
    assert (await join(lc, deal_id, other, {"access_code": codes[1]})).status_code == 201


async def test_who_left_is_deleted_with_the_rooms_tickets(lc: Client, rds: aioredis.Redis) -> None:
    """The record of who left (one entry per buyer) goes with a removed room's keys
    (lua/room_retire.lua, within the retire loop's 5 s)."""
    deal_id = await create_deal(lc, stock=5, waiting_room=ROOM)
    assert (await join(lc, deal_id, 68_001)).status_code == 201
    assert (await leave(lc, deal_id, 68_001)).status_code == 204
    left = deal_keys(deal_id).room_left
    assert await rds.hgetall(left)
    r = await lc.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        content=b"null",
        headers={**ADMIN, "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    for _ in range(100):
        if not await rds.exists(left):
            break
        await asyncio.sleep(0.2)
    assert not await rds.exists(left)
