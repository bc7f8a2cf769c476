"""The waiting room: inventory-aware admission, rate, fairness, tokens,
bad input, a Redis flush. Real gate processes, real Redis and MariaDB."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.clock import iso
from gate.base.errors import Problem
from gate.base.settings import Secret
from gate.room.service import Room, iso_ms
from gate.room.tokens import AdmissionTokens
from gate.room.wire import Wire
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.store.scripts import Script
from tests.support import (
    ADMIN,
    ADMISSION_SECRET,
    CLUSTER_RUN,
    GATE_BIN,
    JWT_SECRET,
    Client,
    GateProcess,
    Resp,
    assert_invariants,
    buyer,
    create_deal,
)

ROOM = {"admit_per_second": 1000}


def _at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


@pytest.fixture(scope="module")
def room_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    """Two gate processes (the room loop runs in both), advising fast polls so that
    tests may read every ticket again after a tenth of a second."""
    room_env = {
        **env,
        "GATE_ROOM_POLL_MIN_MS": "100",
        "GATE_ROOM_POLL_MAX_MS": "100",
        "GATE_ROOM_INTERVAL_MS": "50",
        # The fairness tests read the document often, from one address.
        "GATE_ROOM_FAIRNESS_LIMIT": "off",
    }
    procs = [GateProcess(room_env, workers=1), GateProcess(room_env, workers=1)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
async def rc(room_gates: list[GateProcess]) -> AsyncIterator[list[Client]]:
    clients = [Client(p.url) for p in room_gates]
    try:
        yield clients
    finally:
        for c in clients:
            await c.close()


async def join(client: Client, deal_id: int, user_id: int) -> Resp:
    return await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))


async def read(client: Client, deal_id: int, user_id: int) -> Resp:
    return await client.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))


async def read_ok(client: Client, deal_id: int, user_id: int) -> dict[str, Any]:
    """The buyer's ticket, waiting out a poll refused as too soon."""
    for _ in range(50):
        r = await read(client, deal_id, user_id)
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body
        await asyncio.sleep(0.05)
    raise AssertionError("poll refused for 2.5 s")


async def reserve_with(
    client: Client, deal_id: int, user_id: int, key: str, admission: str | None
) -> Resp:
    headers = {**buyer(user_id), "Idempotency-Key": key}
    if admission is not None:
        headers["Admission-Token"] = admission
    return await client.post(
        f"/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=headers
    )


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


async def gather_bounded(coros: list[Any], limit: int = 200) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def problem(r: Resp, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    assert body["code"] == code, r.text
    return body


# -- admin ------------------------------------------------------------------------------


async def test_room_is_configured_viewed_changed_and_removed(client: Client) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room={"admit_per_second": 7})
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"] == {
        "admit_per_second": 7,
        "admission_ttl_seconds": 120,
        "prequeue_seconds": 0,
        "method": "fifo",
        "message": None,
        "unlikely_below": 0.02,
    }
    plain = await create_deal(client, stock=5)
    assert (await client.get(f"/v1/admin/deals/{plain}", headers=ADMIN)).json()[
        "waiting_room"
    ] is None

    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    new = {"admit_per_second": 50, "admission_ttl_seconds": 30, "prequeue_seconds": 60}
    r = await client.put(path, json=new, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["waiting_room"] == {
        **new,
        "method": "fifo",
        "message": None,
        "unlikely_below": 0.02,
    }
    assert r.json()["id"] == deal_id
    r = await client.put(
        path, content=b"null", headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert r.status_code == 200 and r.json()["waiting_room"] is None
    # Without a room the deal is an ordinary deal again: no token needed.
    r = await reserve_with(client, deal_id, 31_001, f"room-plain-{deal_id}", None)
    assert r.status_code == 201, r.text
    problem(await join(client, deal_id, 31_002), 409, "NO_WAITING_ROOM")


@pytest.mark.parametrize(
    "room",
    [
        {"admit_per_second": 0},
        {"admit_per_second": 100_001},
        {"admit_per_second": "5"},
        {"admit_per_second": 5, "admission_ttl_seconds": 9},
        {"admit_per_second": 5, "admission_ttl_seconds": 3601},
        {"admit_per_second": 5, "prequeue_seconds": -1},
        {"admit_per_second": 5, "prequeue_seconds": 86_401},
        {"admit_per_second": 5, "colour": "red"},
        {},
        [],
        7,
    ],
)
async def test_bad_room_configuration_is_a_400_and_changes_nothing(
    client: Client, db: Database, room: Any
) -> None:
    before = await db.fetchone("SELECT COUNT(*) FROM deals")
    body = {"title": "x", "unit_price": 1, "currency": "EUR", "stock": 1, "waiting_room": room}
    problem(await client.post("/v1/admin/deals", json=body, headers=ADMIN), 400, "INVALID_REQUEST")
    assert await db.fetchone("SELECT COUNT(*) FROM deals") == before
    deal_id = await create_deal(client, stock=1, waiting_room={"admit_per_second": 3})
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    problem(await client.put(path, json=room, headers=ADMIN), 400, "INVALID_REQUEST")
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["admit_per_second"] == 3


async def test_room_admin_refusals(client: Client) -> None:
    problem(
        await client.put("/v1/admin/deals/999999999/waiting-room", json=ROOM, headers=ADMIN),
        404,
        "NOT_FOUND",
    )
    deal_id = await create_deal(client, stock=1)
    problem(
        await client.put(f"/v1/admin/deals/{deal_id}/waiting-room", json=ROOM),
        401,
        "UNAUTHORIZED",
    )


# -- buyers' bad input ---------------------------------------------------------------------


async def test_every_bad_buyer_input_gets_its_problem(client: Client) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room=ROOM)
    other = await create_deal(client, stock=5, waiting_room=ROOM)
    plain = await create_deal(client, stock=5)
    ended = await create_deal(
        client,
        stock=5,
        waiting_room=ROOM,
        starts_at="2020-01-01T00:00:00Z",
        ends_at="2020-02-01T00:00:00Z",
    )
    problem(await join(client, 999_999_999, 1), 404, "NOT_FOUND")
    # The lane reads the id without the route's regex when it can; never past MAX_ID.
    problem(await join(client, 0, 1), 404, "NOT_FOUND")
    problem(await client.post(f"/v1/deals/{'9' * 4400}/queue", headers=buyer(1)), 404, "NOT_FOUND")
    problem(await client.get(f"/v1/deals/{'9' * 19}/queue", headers=buyer(1)), 404, "NOT_FOUND")
    problem(await join(client, plain, 1), 409, "NO_WAITING_ROOM")
    problem(await join(client, ended, 1), 409, "NOT_ACTIVE")
    problem(await read(client, deal_id, 32_000), 404, "NO_TICKET")
    problem(await client.post(f"/v1/deals/{deal_id}/queue"), 401, "UNAUTHORIZED")

    user = 32_001
    r = await join(client, deal_id, user)
    assert r.status_code == 201, r.text
    ticket = await wait_state(client, deal_id, user, "admitted")
    token = ticket["admission_token"]
    assert token and ticket["admission_expires_at"] and ticket["position"] is None
    r2 = await join(client, other, user)
    assert r2.status_code == 201
    other_token = (await wait_state(client, other, user, "admitted"))["admission_token"]

    key = f"room-bad-{deal_id}"
    problem(await reserve_with(client, deal_id, user, key, None), 403, "ADMISSION_REQUIRED")
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    problem(await reserve_with(client, deal_id, user, key, forged), 403, "ADMISSION_INVALID")
    problem(await reserve_with(client, deal_id, user, key, "junk"), 403, "ADMISSION_INVALID")
    problem(await reserve_with(client, deal_id, user, key, other_token), 403, "ADMISSION_INVALID")
    # Another buyer presenting this buyer's token.
    problem(await reserve_with(client, deal_id, user + 1, key, token), 403, "ADMISSION_INVALID")
    # A correctly signed token whose expiry has passed.
    tokens = AdmissionTokens(Secret(ADMISSION_SECRET))
    seq = int(token.split(".")[2])
    expired = tokens.mint(deal_id, user, seq, int(time.time() * 1000) - 1)
    problem(await reserve_with(client, deal_id, user, key, expired), 403, "ADMISSION_INVALID")
    # A signed token naming an admission this buyer does not hold.
    wrong_seq = tokens.mint(deal_id, user, seq + 1000, int(time.time() * 1000) + 60_000)
    problem(await reserve_with(client, deal_id, user, key, wrong_seq), 403, "ADMISSION_INVALID")

    # Nothing above took stock; the real token does, once.
    first = await reserve_with(client, deal_id, user, key, token)
    assert first.status_code == 201, first.text
    replay = await reserve_with(client, deal_id, user, key, token)
    assert replay.status_code == 200 and replay.json() == first.json()
    problem(
        await reserve_with(client, deal_id, user, f"{key}-again", token), 403, "ADMISSION_INVALID"
    )
    spent = await read_ok(client, deal_id, user)
    assert spent["state"] == "closed" and spent["admission_token"] is None
    assert (await join(client, deal_id, user)).status_code in (200, 429)
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["totals"]["held"] == 1 and view["invariant"]["ok"], view


async def test_polling_sooner_than_advised_is_a_429(client: Client) -> None:
    deal_id = await create_deal(client, stock=0, waiting_room=ROOM)
    r = await join(client, deal_id, 33_001)
    assert r.status_code == 201 and r.json()["poll_after_ms"] >= 1000
    again = await read(client, deal_id, 33_001)
    problem(again, 429, "RATE_LIMITED")
    assert int(again.headers["retry-after"]) >= 1
    problem(await join(client, deal_id, 33_001), 429, "RATE_LIMITED")


async def test_first_joins_queue_in_join_order_with_exact_positions(client: Client) -> None:
    """A first join after the opening is last in line (room_ticket.lua counts the
    queue rather than ranking the new ticket): its position is exact, as a read's."""
    deal_id = await create_deal(client, stock=1, waiting_room=ROOM)
    assert (await join(client, deal_id, 34_000)).status_code == 201
    # The one unit's admission: the bound (unspent <= available) stops there.
    await wait_state(client, deal_id, 34_000, "admitted")
    users = list(range(34_001, 34_011))
    tickets = []
    for u in users:
        r = await join(client, deal_id, u)
        assert r.status_code == 201, r.text
        tickets.append(r.json())
    assert [t["state"] for t in tickets] == ["waiting"] * len(users)
    assert [t["position"] for t in tickets] == list(range(1, len(users) + 1))
    assert [t["eta_seconds"] for t in tickets] == [1] * len(users)
    assert all(t["admission_token"] is None and t["joined_at"].endswith("Z") for t in tickets)
    again = await read_ok(client, deal_id, users[-1])
    assert again["position"] == len(users) and again["joined_at"] == tickets[-1]["joined_at"]


def _room_of(gate: Gate) -> Room:
    ext = next(e for e in gate.extensions if e.name == "room")
    room = getattr(ext.workers[0], "__self__", None)
    assert isinstance(room, Room)
    return room


async def test_a_script_lost_by_redis_is_loaded_again(client: Client, local_gate: Gate) -> None:
    """NOSCRIPT (Redis restarted and lost its scripts): the room's own connection
    (gate/room/wire.py) loads them again and calls once more; the buyer never sees it."""
    deal_id = await create_deal(client, stock=0, waiting_room=ROOM)
    room = _room_of(local_gate)
    # A version of room_ticket.lua Redis has never seen, as after a restart.
    script = room.runner.scripts["room_ticket"]
    source = f"{script.source}\n-- {time.monotonic_ns()}\n"
    fresh = Script("room_ticket", source, hashlib.sha1(source.encode()).hexdigest())
    room.runner.scripts["room_ticket"] = fresh
    room._prefixes.clear()
    created, body = await room.ticket(deal_id, 35_001, "join")
    assert created and body["state"] == "sold_out" and body["deal_id"] == deal_id


@pytest.mark.skipif(
    CLUSTER_RUN, reason="the standalone wire; on Redis Cluster tickets go through the runner"
)
async def test_buyers_of_one_loop_turn_share_a_call_answered_as_separate_ones(
    client: Client, local_gate: Gate
) -> None:
    """Joins and reads made in one event-loop turn go out as one room_ticket.lua call
    per deal and mode, at most batch_max buyers each (gate/room/wire.py): each buyer's
    answer is what a call of its own would give, in the order asked: exact positions,
    a buyer named twice joins once (the second is too soon), another deal's buyers and
    the reads apart, a batch failure only for its own buyers."""
    first = await create_deal(client, stock=1, waiting_room=ROOM)
    other = await create_deal(client, stock=0, waiting_room=ROOM)
    # The one unit's admission: the bound (unspent <= available) stops there, so every
    # later joiner waits and keeps its position.
    assert (await join(client, first, 36_000)).status_code == 201
    await wait_state(client, first, 36_000, "admitted")
    room = _room_of(local_gate)
    wire = room.wire
    room.wire = Wire(local_gate.settings.redis_url, 2.0, 7)
    calls: list[int] = []
    send_packed = room.wire.conn.send_packed

    def counted(data: bytes, waiters: Any) -> None:
        calls.append(len(waiters))
        send_packed(data, waiters)

    room.wire.conn.send_packed = counted  # type: ignore[method-assign]
    try:
        users = list(range(36_001, 36_021))  # 20 buyers: three calls of at most 7
        asked = [room.ticket(first, u, "join") for u in users]
        asked.append(room.ticket(first, users[3], "join"))  # the same buyer again
        asked += [room.ticket(other, u, "join") for u in users[:4]]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        assert sum(calls) == 4  # 21 buyers of one deal in calls of 7, 4 of the other
        joined = answers[: len(users)]
        assert all(created for created, _ in joined)  # type: ignore[misc]
        bodies = [body for _, body in joined]  # type: ignore[misc]
        assert [b["position"] for b in bodies] == list(range(1, len(users) + 1))
        assert {b["state"] for b in bodies} == {"waiting"}
        twice = answers[len(users)]
        assert isinstance(twice, Problem) and twice.code == "RATE_LIMITED"
        others = answers[len(users) + 1 :]
        assert [b["state"] for _, b in others] == ["sold_out"] * 4  # type: ignore[misc]
        assert all(created for created, _ in others)  # type: ignore[misc]
        # Reads once the advised wait has passed (a waiting ticket's: the floor).
        await asyncio.sleep(room.settings.poll_min_ms / 1000 + 0.05)
        reads = await asyncio.gather(*(room.ticket(first, u, "read") for u in users[::-1]))
        assert [b["position"] for _, b in reads] == list(range(len(users), 0, -1))
        assert not any(created for created, _ in reads)
        # A sold-out ticket is advised the ceiling: read again at once, too soon.
        missing = await asyncio.gather(
            room.ticket(other, 36_999, "read"),
            room.ticket(other, 36_001, "read"),
            return_exceptions=True,
        )
        assert isinstance(missing[0], Problem) and missing[0].code == "NO_TICKET"
        assert isinstance(missing[1], Problem) and missing[1].code == "RATE_LIMITED"
    finally:
        await room.wire.aclose()
        room.wire = wire


@pytest.mark.skipif(
    CLUSTER_RUN, reason="the standalone wire; on Redis Cluster tickets go through the runner"
)
async def test_redis_unreachable_is_a_503_for_the_buyer(client: Client, local_gate: Gate) -> None:
    deal_id = await create_deal(client, stock=0, waiting_room=ROOM)
    room = _room_of(local_gate)
    room.wire = Wire("redis://127.0.0.1:1/0", 0.5, 16)
    try:
        with pytest.raises(Problem) as caught:
            await room.ticket(deal_id, 35_002, "join")
        assert caught.value.code == "OVERLOADED" and caught.value.status == 503
    finally:
        await room.wire.aclose()


def test_ticket_timestamps() -> None:
    # The per-second cache formats as gate.base.clock.iso does.
    for ms in (
        1,
        999,
        1_000,
        1_764_615_933_953,
        4_102_444_799_999,
        *range(1_700_000_000_000, 1_700_000_005_000, 7),
    ):
        assert iso_ms(ms) == iso(datetime.fromtimestamp(ms / 1000, UTC).replace(tzinfo=None))
    assert iso_ms(0) is None


# -- the sale -------------------------------------------------------------------------------


async def test_five_thousand_buyers_two_hundred_units(
    rc: list[Client], db: Database, rds: aioredis.Redis
) -> None:
    """5,000 buyers queue for 200 units: the first 200 in line are admitted and buy,
    the admissions never pass the stock, the rest read sold_out at once, a cancel
    admits the next in line, and the deal's invariants hold."""
    a, b = rc
    # No stock yet: everyone queues (and reads sold_out), in a known order.
    deal_id = await create_deal(a, stock=0, waiting_room={"admit_per_second": 2000})
    users = list(range(100_000, 105_000))
    joined = await gather_bounded(
        [join((a, b)[i % 2], deal_id, u) for i, u in enumerate(users)], 100
    )
    assert [r.status_code for r in joined] == [201] * len(users)
    assert {r.json()["state"] for r in joined} == {"sold_out"}
    keys = deal_keys(deal_id)
    order = [int(u) for u in await rds.zrange(keys.room_queue, 0, -1)]
    assert sorted(order) == users
    # A second join is the same ticket.
    again = await join(a, deal_id, users[0])
    assert again.status_code in (200, 429)

    r = await a.post(
        f"/v1/admin/deals/{deal_id}/stock", json={"delta": 200, "reason": "open"}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    first = order[:200]
    tickets = await gather_bounded([wait_state(b, deal_id, u, "admitted") for u in first], 100)
    # Admitted: exactly the first 200 in line; everyone after them waits, in order.
    assert await rds.hlen(keys.room_admitted) == 200
    rest = await gather_bounded([read_ok(a, deal_id, u) for u in order[200:]], 100)
    assert [t["state"] for t in rest] == ["waiting"] * 4800
    assert [t["position"] for t in rest] == list(range(1, 4801))

    # The admitted buy, while the bound is sampled.
    bound_ok = True

    async def sample() -> None:
        nonlocal bound_ok
        while True:
            pipe = rds.pipeline(transaction=True)
            pipe.hlen(keys.room_admitted)
            pipe.hget(keys.meta, "avail")
            unspent, avail = await pipe.execute()
            if int(unspent) > max(0, int(avail)):
                bound_ok = False
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    bought = await gather_bounded(
        [
            reserve_with((a, b)[i % 2], deal_id, u, f"room-big-{deal_id}-{u}", t["admission_token"])
            for i, (u, t) in enumerate(zip(first, tickets, strict=True))
        ],
        100,
    )
    assert [r.status_code for r in bought] == [201] * 200
    # Every remaining ticket reads sold_out on its first read after the last unit:
    # one deal-level fact, nothing to propagate ticket by ticket.
    rest = await gather_bounded([read_ok(a, deal_id, u) for u in order[200:]], 200)
    assert {t["state"] for t in rest} == {"sold_out"}
    assert {t["position"] for t in rest} == {None} and {t["available_hint"] for t in rest} == {0}
    sampler.cancel()
    assert bound_ok

    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 200 and report["totals"]["available"] == 0
    assert report["redis"]["room"]["ok"], report["redis"]["room"]

    # A cancelled hold re-admits the next buyer in line, and only them.
    victim = bought[0].json()["order_id"]
    r = await a.post(f"/v1/orders/{victim}/cancel", headers=buyer(first[0]))
    assert r.status_code == 200, r.text
    nxt = await wait_state(b, deal_id, order[200], "admitted")
    after = await read_ok(a, deal_id, order[201])
    assert after["state"] == "waiting" and after["position"] == 1
    r = await reserve_with(
        b, deal_id, order[200], f"room-big-{deal_id}-next", nxt["admission_token"]
    )
    assert r.status_code == 201, r.text
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 200 and report["invariant"]["ok"]


async def test_rate_bound_holds_across_two_gates_and_follows_a_live_change(
    rc: list[Client], rds: aioredis.Redis
) -> None:
    a, b = rc
    deal_id = await create_deal(a, stock=1000, waiting_room={"admit_per_second": 20})
    users = list(range(110_000, 110_400))
    joined = await gather_bounded([join((a, b)[i % 2], deal_id, u) for i, u in enumerate(users)])
    assert all(r.status_code == 201 for r in joined)
    await asyncio.sleep(3.0)
    changed = await rds.time()  # Redis time just before the change
    changed_ms = int(changed[0]) * 1000 + int(changed[1]) // 1000
    r = await a.put(
        f"/v1/admin/deals/{deal_id}/waiting-room", json={"admit_per_second": 60}, headers=ADMIN
    )
    assert r.status_code == 200
    await asyncio.sleep(3.0)
    keys = deal_keys(deal_id)
    times = sorted(int(v.split("|")[1]) for v in (await rds.hgetall(keys.room_admitted)).values())
    assert times, "nothing was admitted"

    def most_in_a_second(ts: list[int]) -> int:
        best, j = 0, 0
        for i, t in enumerate(ts):
            while ts[j] <= t - 1000:
                j += 1
            best = max(best, i - j + 1)
        return best

    before = [t for t in times if t < changed_ms]
    later = [t for t in times if t >= changed_ms + 2000]
    # Judged by Redis time, over every one-second window.
    assert most_in_a_second(before) <= 20
    assert most_in_a_second(times) <= 60
    # Both rates were used, not merely respected: 3 s at 20/s, then 60/s.
    assert len(before) >= 40
    assert most_in_a_second(later) > 20

    # Per-deal metrics: both processes together admitted what Redis holds.
    admitted = waited = 0.0
    waiting_seen = False
    for c in rc:
        text = await c.metrics()
        label = f'deal="{deal_id}"'
        for line in text.splitlines():
            if label not in line or line.startswith("#"):
                continue
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("gate_room_admitted_total"):
                admitted += value
            elif line.startswith("gate_room_wait_seconds_count"):
                waited += value
            elif line.startswith("gate_room_waiting{"):
                waiting_seen = True
    # Every process that admits counts its own admissions (the suite's shared gate
    # may run a room loop too): together never more than Redis holds.
    total = int(await rds.hget(keys.room, "admitted") or 0)
    assert admitted == waited and 0 < admitted <= total
    assert waiting_seen


async def test_prequeue_joiners_are_admitted_in_a_random_order(
    rc: list[Client], rds: aioredis.Redis
) -> None:
    a, b = rc
    not_yet = await create_deal(
        a, stock=5, starts_at=_at(3600), waiting_room={**ROOM, "prequeue_seconds": 60}
    )
    problem(await join(a, not_yet, 1), 409, "NOT_ACTIVE")

    n = 300
    deal_id = await create_deal(
        a,
        stock=n,
        starts_at=_at(8),
        waiting_room={"admit_per_second": 10_000, "prequeue_seconds": 600},
    )
    users = list(range(120_000, 120_000 + n))
    for u in users:  # one at a time: the join order is known
        r = await join(a, deal_id, u)
        assert r.status_code == 201, r.text
    ticket = await read_ok(b, deal_id, users[0])
    assert ticket["state"] == "waiting" and ticket["eta_seconds"] >= 1
    # Before the opening nothing is admitted, whatever the rate.
    assert await rds.hlen(deal_keys(deal_id).room_admitted) == 0
    deadline = time.monotonic() + 20
    while await rds.hlen(deal_keys(deal_id).room_admitted) < n:
        assert time.monotonic() < deadline, "admission never completed"
        await asyncio.sleep(0.2)
    records = await rds.hgetall(deal_keys(deal_id).room_admitted)
    seqs = [int(records[str(u)].split("|")[0]) for u in users]
    ranks = sorted(range(n), key=lambda i: seqs[i])
    admitted_rank = [0] * n
    for r_, i in enumerate(ranks):
        admitted_rank[i] = r_
    # Spearman's rho between join order and admission order: ~N(0, 1/sqrt(n-1)).
    mean = (n - 1) / 2
    cov = sum((i - mean) * (admitted_rank[i] - mean) for i in range(n))
    var = sum((i - mean) ** 2 for i in range(n))
    rho = cov / var
    assert abs(rho) < 0.25, rho
    # Later joiners queue behind every prequeue joiner, FIFO.
    late = await join(a, deal_id, 130_000)
    assert late.status_code == 201


async def test_unused_admission_lapses_and_returns_its_slot(rc: list[Client]) -> None:
    a, _ = rc
    deal_id = await create_deal(
        a, stock=1, waiting_room={"admit_per_second": 100, "admission_ttl_seconds": 10}
    )
    assert (await join(a, deal_id, 140_001)).status_code == 201
    await asyncio.sleep(0.2)
    assert (await join(a, deal_id, 140_002)).status_code == 201
    first = await wait_state(a, deal_id, 140_001, "admitted")
    second = await read_ok(a, deal_id, 140_002)
    # One unit: one unspent admission at most; the second buyer is next in line.
    assert second["state"] == "waiting" and second["position"] == 1
    nxt = await wait_state(a, deal_id, 140_002, "admitted", seconds=20)
    assert (await read_ok(a, deal_id, 140_001))["state"] == "closed"
    problem(
        await reserve_with(
            a, deal_id, 140_001, f"room-lapse-{deal_id}-1", first["admission_token"]
        ),
        403,
        "ADMISSION_INVALID",
    )
    r = await reserve_with(a, deal_id, 140_002, f"room-lapse-{deal_id}-2", nxt["admission_token"])
    assert r.status_code == 201, r.text


async def test_room_survives_a_redis_flush(rc: list[Client], rds: aioredis.Redis) -> None:
    a, _ = rc
    deal_id = await create_deal(a, stock=3, waiting_room=ROOM)
    assert (await join(a, deal_id, 150_001)).status_code == 201
    await wait_state(a, deal_id, 150_001, "admitted")
    await rds.flushdb()
    # The room is enforced the moment the deal is back in Redis...
    problem(
        await reserve_with(a, deal_id, 150_002, f"room-flush-{deal_id}-0", None),
        403,
        "ADMISSION_REQUIRED",
    )
    # ... tickets and admissions are lost (docs/waiting-room.md): buyers join again.
    problem(await read(a, deal_id, 150_001), 404, "NO_TICKET")
    assert (await join(a, deal_id, 150_001)).status_code == 201
    t = await wait_state(a, deal_id, 150_001, "admitted")
    r = await reserve_with(a, deal_id, 150_001, f"room-flush-{deal_id}-1", t["admission_token"])
    assert r.status_code == 201, r.text


async def test_gate_check_balances_the_room_counters(
    rc: list[Client], db: Database, rds: aioredis.Redis
) -> None:
    a, _ = rc
    deal_id = await create_deal(a, stock=2, waiting_room=ROOM)
    assert (await join(a, deal_id, 160_001)).status_code == 201
    await wait_state(a, deal_id, 160_001, "admitted")
    report = await assert_invariants(db, rds, deal_id)
    room = report["redis"]["room"]
    assert room["ok"] and room["admitted"] == 1 and room["unspent"] == 1, room
    # An admission counted but neither spent, lapsed nor held: gate check says so.
    await rds.hincrby(deal_keys(deal_id).room, "admitted", 1)
    view = (await a.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert not view["invariant"]["ok"]
    assert any(b.startswith("room: admitted 2") for b in view["invariant"]["breaches"]), view
    await rds.hincrby(deal_keys(deal_id).room, "admitted", -1)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("GATE_ADMISSION_SECRET", "", "GATE_ADMISSION_SECRET is required"),
        ("GATE_ADMISSION_SECRET", "short", "GATE_ADMISSION_SECRET must be at least 32"),
        ("GATE_ADMISSION_SECRET", JWT_SECRET, "must differ from GATE_JWT_SECRET"),
        ("GATE_ROOM_ADMISSION_RATIO", "0", "GATE_ROOM_ADMISSION_RATIO must be within"),
        ("GATE_ROOM_ADMISSION_RATIO", "lots", "GATE_ROOM_ADMISSION_RATIO must be a number"),
        ("GATE_ROOM_INTERVAL_MS", "1", "GATE_ROOM_INTERVAL_MS must be within"),
        ("GATE_ROOM_POLL_MIN_MS", "20000", "GATE_ROOM_POLL_MAX_MS must be at least"),
        ("GATE_ROOM_POLL_MAX_MS", "x", "GATE_ROOM_POLL_MAX_MS must be an integer"),
    ],
)
def test_bad_room_settings_stop_start_up_naming_the_variable(
    env: dict[str, str], name: str, value: str, message: str
) -> None:
    bad = {**env, "GATE_ENV": "production", name: value}
    out = subprocess.run(
        [GATE_BIN, "serve", "--port", "1", "--workers", "2"],
        env=bad,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert ADMISSION_SECRET not in out.stdout + out.stderr


def test_the_dev_admission_secret_works_only_in_dev(env: dict[str, str]) -> None:
    from gate.base.settings import DEV_ADMISSION_SECRET, load_settings

    dev = {k: v for k, v in env.items() if k != "GATE_ADMISSION_SECRET"}
    settings = load_settings({**dev, "GATE_ENV": "dev"})
    assert settings.admission_secret.reveal() == DEV_ADMISSION_SECRET
    assert "GATE_ADMISSION_SECRET" in settings.dev_secrets_used
    with pytest.raises(ValueError, match="GATE_ADMISSION_SECRET is required"):
        load_settings({**dev, "GATE_ENV": "production"})
    # A token signed with the dev key is worthless to a gate with its own secret.
    dev_tokens = AdmissionTokens(Secret(DEV_ADMISSION_SECRET))
    ours = AdmissionTokens(Secret(ADMISSION_SECRET))
    forged = dev_tokens.mint(5, 7, 1, int(time.time() * 1000) + 60_000)
    assert ours.admission_arg(5, 7, forged) == "-"
    assert dev_tokens.admission_arg(5, 7, forged) == "1"
