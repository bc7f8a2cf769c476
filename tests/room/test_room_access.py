"""Invite-only waiting rooms: access codes added by the admin (stored hashed, in the
database and in Redis), required at the join, bound to the first buyer who joins
with one. Real gate process, real Redis and MariaDB."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.room.fairness import draw_key
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import ADMIN, Client, GateProcess, Resp, buyer, create_deal

ROOM = {"admit_per_second": 1000, "access": "codes"}


@pytest.fixture(scope="module")
def access_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(
        {
            **env,
            "GATE_ROOM_POLL_MIN_MS": "100",
            "GATE_ROOM_POLL_MAX_MS": "100",
            # Joins may name their client address (failed codes count per address).
            "GATE_TRUSTED_PROXIES": "127.0.0.1/32",
        },
        workers=1,
    ) as proc:
        yield proc


@pytest.fixture
async def ac(access_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(access_gate.url) as client:
        yield client


async def add_codes(client: Client, deal_id: int, codes: Any) -> Resp:
    return await client.post(
        f"/v1/admin/deals/{deal_id}/access-codes", json={"codes": codes}, headers=ADMIN
    )


async def join(
    client: Client, deal_id: int, user_id: int, body: Any = None, address: str | None = None
) -> Resp:
    headers = buyer(user_id)
    if address is not None:
        headers["X-Forwarded-For"] = address
    return await client.post(f"/v1/deals/{deal_id}/queue", json=body, headers=headers)


def problem(r: Resp, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code, r.text


async def room_keys(rds: aioredis.Redis, deal_id: int) -> dict[str, Any]:
    """What a join could have written: tickets, queue, codes."""
    k = deal_keys(deal_id)
    return {
        "tickets": await rds.hgetall(k.room_tickets),
        "queue": await rds.zrange(k.room_queue, 0, -1),
        "codes": await rds.hgetall(k.room_codes),
        "seq": await rds.hget(k.room, "seq"),
    }


async def test_admin_adds_codes_hashed_and_counts_them(
    ac: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(ac, waiting_room=ROOM)
    r = await add_codes(ac, deal_id, ["alpha-001", "alpha-002", "alpha-002"])
    assert r.status_code == 200, r.text
    assert r.json() == {"added": 2, "total": 2}
    r = await add_codes(ac, deal_id, ["alpha-002", "beta_0003"])
    assert r.json() == {"added": 1, "total": 3}
    rows = await db.fetchall(
        "SELECT code_hash FROM room_access_codes WHERE deal_id = %s", (deal_id,)
    )
    stored = {str(row[0]) for row in rows}
    assert len(stored) == 3
    # Hashed: no code appears, in the database or in Redis.
    assert not {"alpha-001", "alpha-002", "beta_0003"} & stored
    in_redis = await rds.hgetall(deal_keys(deal_id).room_codes)
    assert set(in_redis) == stored and set(in_redis.values()) == {""}
    view = (await ac.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["access"] == "codes"


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"codes": []},
        {"codes": "abcdef"},
        {"codes": ["short"]},
        {"codes": ["seven-7"]},
        {"codes": ["x" * 65]},
        {"codes": ["has space"]},
        {"codes": ["caf\u00e9-0001"]},
        {"codes": [123456]},
        {"codes": ["ok-code-1"], "more": 1},
        {"codes": [f"code-{i:06d}" for i in range(10_001)]},
    ],
)
async def test_bad_code_bodies_are_400_and_change_nothing(
    ac: Client, db: Database, body: Any
) -> None:
    deal_id = await create_deal(ac, waiting_room=ROOM)
    url = f"/v1/admin/deals/{deal_id}/access-codes"
    if body is None:
        headers = {**ADMIN, "Content-Type": "application/json"}
        r = await ac.post(url, content=b"null", headers=headers)
    else:
        r = await ac.post(url, json=body, headers=ADMIN)
    problem(r, 400, "INVALID_REQUEST")
    row = await db.fetchone("SELECT COUNT(*) FROM room_access_codes WHERE deal_id = %s", (deal_id,))
    assert row is not None and int(row[0]) == 0


async def test_codes_need_admin_auth_and_a_deal(ac: Client) -> None:
    deal_id = await create_deal(ac, waiting_room=ROOM)
    url = f"/v1/admin/deals/{deal_id}/access-codes"
    r = await ac.post(url, json={"codes": ["abcdefgh"]}, headers=buyer(1))
    problem(r, 401, "UNAUTHORIZED")
    r = await ac.post(url, json={"codes": ["abcdefgh"]})
    problem(r, 401, "UNAUTHORIZED")
    problem(await add_codes(ac, 9_000_000_000_123, ["abcdefgh"]), 404, "NOT_FOUND")
    # 10,000 codes in one call are accepted.
    r = await add_codes(ac, deal_id, [f"bulk-{i:06d}" for i in range(10_000)])
    assert r.status_code == 200 and r.json() == {"added": 10_000, "total": 10_000}


async def test_access_field_is_validated(ac: Client) -> None:
    for bad in ("closed", 1, None, ["codes"]):
        r = await ac.post(
            "/v1/admin/deals",
            json={
                "title": "t",
                "unit_price": 1,
                "currency": "EUR",
                "stock": 1,
                "waiting_room": {"admit_per_second": 1, "access": bad},
            },
            headers=ADMIN,
        )
        problem(r, 400, "INVALID_REQUEST")
    deal_id = await create_deal(ac, waiting_room={"admit_per_second": 5})
    view = (await ac.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert "access" not in view["waiting_room"]


async def test_join_needs_a_known_unbound_code(ac: Client, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room=ROOM)
    assert (await add_codes(ac, deal_id, ["invite-aaa", "invite-bbb"])).status_code == 200
    before = await room_keys(rds, deal_id)

    problem(await join(ac, deal_id, 501), 403, "ACCESS_CODE_REQUIRED")
    problem(await join(ac, deal_id, 501, {}), 403, "ACCESS_CODE_REQUIRED")
    problem(await join(ac, deal_id, 501, {"access_code": "invite-zzz"}), 403, "ACCESS_CODE_INVALID")
    problem(await join(ac, deal_id, 501, {"access_code": "bad code"}), 403, "ACCESS_CODE_INVALID")
    problem(await join(ac, deal_id, 501, {"access_code": 5}), 400, "INVALID_REQUEST")
    problem(await join(ac, deal_id, 501, {"code": "invite-aaa"}), 400, "INVALID_REQUEST")
    problem(await join(ac, deal_id, 501, ["invite-aaa"]), 400, "INVALID_REQUEST")
    r = await ac.post(f"/v1/deals/{deal_id}/queue", content=b"{not json", headers=buyer(501))
    problem(r, 400, "INVALID_REQUEST")
    # Refused joins wrote nothing: no ticket, no queue entry, no binding.
    assert await room_keys(rds, deal_id) == before

    first = await join(ac, deal_id, 501, {"access_code": "invite-aaa"})
    assert first.status_code == 201, first.text
    assert first.json()["state"] == "waiting"
    problem(await join(ac, deal_id, 502, {"access_code": "invite-aaa"}), 403, "ACCESS_CODE_USED")
    assert not await rds.hexists(deal_keys(deal_id).room_tickets, "502")
    # The code's owner joins again with it: the same ticket, 200.
    again = await join(ac, deal_id, 501, {"access_code": "invite-aaa"})
    while again.status_code == 429:
        await asyncio.sleep(0.05)
        again = await join(ac, deal_id, 501, {"access_code": "invite-aaa"})
    assert again.status_code == 200, again.text
    assert again.json()["joined_at"] == first.json()["joined_at"]
    # Another buyer, another code.
    assert (await join(ac, deal_id, 502, {"access_code": "invite-bbb"})).status_code == 201
    codes = await rds.hgetall(deal_keys(deal_id).room_codes)
    assert sorted(codes.values()) == ["501", "502"]


async def test_open_room_ignores_codes(ac: Client) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room={"admit_per_second": 10})
    assert (await join(ac, deal_id, 601)).status_code == 201
    assert (await join(ac, deal_id, 602, {"access_code": "whatever-1"})).status_code == 201


async def test_codes_survive_a_redis_loss(ac: Client, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room=ROOM)
    assert (await add_codes(ac, deal_id, ["flush-code-1", "flush-code-2"])).status_code == 200
    tag = deal_keys(deal_id).tag
    lost = [key async for key in rds.scan_iter(match=f"{tag}*", count=1000)]
    assert lost
    await rds.delete(*lost)
    # The join finds the deal gone from Redis, loads it: the room and its codes return.
    r = await join(ac, deal_id, 701, {"access_code": "flush-code-1"})
    assert r.status_code == 201, r.text
    problem(await join(ac, deal_id, 702, {"access_code": "nope-nope"}), 403, "ACCESS_CODE_INVALID")
    problem(await join(ac, deal_id, 702), 403, "ACCESS_CODE_REQUIRED")


async def test_a_room_changed_to_codes_loads_them(ac: Client, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room={"admit_per_second": 10})
    assert (await add_codes(ac, deal_id, ["later-code-1"])).status_code == 200
    await rds.delete(deal_keys(deal_id).room_codes)
    r = await ac.put(f"/v1/admin/deals/{deal_id}/waiting-room", json=ROOM, headers=ADMIN)
    assert r.status_code == 200 and r.json()["waiting_room"]["access"] == "codes"
    problem(await join(ac, deal_id, 801), 403, "ACCESS_CODE_REQUIRED")
    assert (await join(ac, deal_id, 801, {"access_code": "later-code-1"})).status_code == 201


async def test_a_code_raced_by_many_buyers_binds_to_one(ac: Client, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room=ROOM)
    assert (await add_codes(ac, deal_id, ["raced-code-1"])).status_code == 200
    users = list(range(900, 930))
    # Each from an address of its own: 29 refusals from one would pass its limit.
    answers = await asyncio.gather(
        *(join(ac, deal_id, u, {"access_code": "raced-code-1"}, f"10.3.0.{u - 899}") for u in users)
    )
    won = [u for u, r in zip(users, answers, strict=True) if r.status_code == 201]
    assert len(won) == 1, [r.status_code for r in answers]
    for r in answers:
        if r.status_code != 201:
            problem(r, 403, "ACCESS_CODE_USED")
    assert set(await rds.hkeys(deal_keys(deal_id).room_tickets)) == {str(won[0])}
    assert list((await rds.hgetall(deal_keys(deal_id).room_codes)).values()) == [str(won[0])]


async def test_a_removed_room_sheds_its_codes_and_gets_them_back(
    ac: Client, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(ac, stock=10, waiting_room=ROOM)
    assert (await add_codes(ac, deal_id, ["shed-code-1"])).status_code == 200
    codes_key = deal_keys(deal_id).room_codes
    assert await rds.exists(codes_key)
    url = f"/v1/admin/deals/{deal_id}/waiting-room"
    json_null = {**ADMIN, "Content-Type": "application/json"}
    assert (await ac.put(url, content=b"null", headers=json_null)).status_code == 200
    # The retire loop (every 5 s) deletes a removed room's keys, its codes' copy too.
    for _ in range(150):
        if not await rds.exists(codes_key):
            break
        await asyncio.sleep(0.1)
    assert not await rds.exists(codes_key)
    assert (await ac.put(url, json=ROOM, headers=ADMIN)).status_code == 200
    assert (
        await rds.hgetall(codes_key) == {k: "" for k in await rds.hkeys(codes_key)}
        and await rds.hlen(codes_key) == 1
    )
    assert (await join(ac, deal_id, 1001, {"access_code": "shed-code-1"})).status_code == 201


async def test_a_random_room_with_codes_draws_only_admitted_joiners(
    ac: Client, rds: aioredis.Redis
) -> None:
    message = {"text": "Invitation holders only.", "level": "info"}
    room = {**ROOM, "method": "random", "message": message}
    deal_id = await create_deal(ac, stock=10, waiting_room=room)
    r = await ac.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert r.json()["waiting_room"]["method"] == "random", r.text
    assert r.json()["waiting_room"]["access"] == "codes", r.text
    assert (await add_codes(ac, deal_id, ["draw-code-1", "draw-code-2"])).status_code == 200
    draw = draw_key(deal_id)

    # A refused join is neither drawn nor ticketed.
    problem(await join(ac, deal_id, 1001), 403, "ACCESS_CODE_REQUIRED")
    problem(
        await join(ac, deal_id, 1001, {"access_code": "nope-nope-1"}), 403, "ACCESS_CODE_INVALID"
    )
    assert await rds.llen(draw) == 0
    assert await rds.hlen(deal_keys(deal_id).room_tickets) == 0

    tickets: dict[int, str] = {}
    for user, code in ((1001, "draw-code-1"), (1002, "draw-code-2")):
        r = await join(ac, deal_id, user, {"access_code": code})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["state"] == "waiting" and body["message"] == message, body
        tickets[user] = body["ticket_id"]
    problem(await join(ac, deal_id, 1003, {"access_code": "draw-code-1"}), 403, "ACCESS_CODE_USED")
    # Both joiners are in the draw, each code bound to its joiner.
    assert sorted(await rds.lrange(draw, 0, -1)) == sorted(tickets.values())
    codes = await rds.hgetall(deal_keys(deal_id).room_codes)
    assert sorted(codes.values()) == ["1001", "1002"]
