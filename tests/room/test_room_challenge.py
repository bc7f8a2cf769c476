"""Proof of work priced by demand: GET .../queue/challenge, a join that must carry a
solved, signed, unexpired, unspent challenge of its own buyer and deal, refused
before anything is written otherwise. Real gate process, real Redis and MariaDB."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Secret
from gate.room.gates import JoinPasses, challenge_bits, leading_zero_bits, solve, solves
from gate.store.keys import deal_keys
from tests.support import ADMIN, ADMISSION_SECRET, Client, GateProcess, Resp, buyer, create_deal

PASSES = JoinPasses(Secret(ADMISSION_SECRET))


def _at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def room(low: int, high: int, **more: Any) -> dict[str, Any]:
    return {"admit_per_second": 1000, "challenge": {"min_bits": low, "max_bits": high}, **more}


# A room that admits nobody yet (the sale starts in an hour; joins are prequeue
# joins), so every joiner stays waiting and the demand is what the test made.
def quiet_room(low: int, high: int, **more: Any) -> dict[str, Any]:
    return room(low, high, prequeue_seconds=7200, **more)


@pytest.fixture(scope="module")
def pow_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(
        {**env, "GATE_ROOM_POLL_MIN_MS": "100", "GATE_ROOM_POLL_MAX_MS": "100"}, workers=1
    ) as proc:
        yield proc


@pytest.fixture
async def pc(pow_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(pow_gate.url) as client:
        yield client


def problem(r: Resp, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code, r.text


async def get_challenge(client: Client, deal_id: int, user_id: int) -> dict[str, Any]:
    r = await client.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(user_id))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def join(client: Client, deal_id: int, user_id: int, body: Any = None) -> Resp:
    return await client.post(f"/v1/deals/{deal_id}/queue", json=body, headers=buyer(user_id))


async def solved(client: Client, deal_id: int, user_id: int) -> dict[str, str]:
    c = await get_challenge(client, deal_id, user_id)
    return {"challenge": c["challenge"], "nonce": solve(c["challenge"], c["bits"])}


def unsolved(c: dict[str, Any]) -> str:
    """A nonce that does not solve the challenge (a guess solves 1 in 2^bits)."""
    return next(str(n) for n in range(100_000) if not solves(c["challenge"], str(n), c["bits"]))


async def written(rds: aioredis.Redis, deal_id: int) -> dict[str, Any]:
    """Everything a join could write: tickets, queue, sequence, codes, spent challenges."""
    k = deal_keys(deal_id)
    return {
        "tickets": await rds.hgetall(k.room_tickets),
        "queue": await rds.zrange(k.room_queue, 0, -1),
        "seq": await rds.hget(k.room, "seq"),
        "codes": await rds.hgetall(k.room_codes),
        "spent": sorted([key async for key in rds.scan_iter(match=f"{k.room}:pow:*")]),
    }


def test_bits_follow_the_formula() -> None:
    assert challenge_bits(0, 28, 0, 0) == 0
    assert challenge_bits(4, 20, 1, 1) == 5  # 4 + floor(log2(2))
    assert challenge_bits(4, 20, 100, 1) == 10  # 4 + floor(log2(101))
    assert challenge_bits(4, 20, 99, 0) == 10  # max(1, available)
    assert challenge_bits(4, 6, 10**6, 1) == 6  # clamped
    assert challenge_bits(3, 3, 0, 50) == 3
    for waiting in range(0, 2000, 37):
        for available in (0, 1, 7, 100):
            expect = 4 + math.floor(math.log2(1 + waiting / max(1, available)))
            assert challenge_bits(4, 24, waiting, available) == min(24, expect)


def test_solutions_are_checked_bit_by_bit() -> None:
    challenge, _ = PASSES.mint(1, 2, 8)
    nonce = solve(challenge, 8)
    digest = hashlib.sha256(f"{challenge}:{nonce}".encode()).digest()
    assert leading_zero_bits(digest) >= 8 and solves(challenge, nonce, 8)
    # A nonce that solves 8 bits solves fewer; the first that fails 8 is found.
    assert solves(challenge, nonce, 3)
    bad = next(str(n) for n in range(10_000) if not solves(challenge, str(n), 8))
    assert not solves(challenge, bad, 8)


async def test_challenge_endpoint_prices_demand(pc: Client) -> None:
    deal_id = await create_deal(pc, stock=2, starts_at=_at(3600), waiting_room=quiet_room(1, 3))
    first = await get_challenge(pc, deal_id, 11)
    assert first["bits"] == 1  # 1 + floor(log2(1 + 0/2))
    assert first["challenge"].startswith(f"{deal_id}.11.1.")
    expires = datetime.fromisoformat(first["expires_at"].replace("Z", "+00:00"))
    assert 100 < (expires - datetime.now(UTC)).total_seconds() <= 121
    for user in (12, 13):
        assert (await join(pc, deal_id, user, await solved(pc, deal_id, user))).status_code == 201
    assert (await get_challenge(pc, deal_id, 11))["bits"] == 2  # 1 + log2(1 + 2/2)
    for user in range(14, 18):
        assert (await join(pc, deal_id, user, await solved(pc, deal_id, user))).status_code == 201
    assert (await get_challenge(pc, deal_id, 11))["bits"] == 3  # 1 + log2(1 + 6/2)
    for user in range(18, 30):
        assert (await join(pc, deal_id, user, await solved(pc, deal_id, user))).status_code == 201
    assert (await get_challenge(pc, deal_id, 11))["bits"] == 3  # clamped at max_bits


async def test_challenge_endpoint_refusals(pc: Client) -> None:
    open_room = await create_deal(pc, waiting_room={"admit_per_second": 5})
    no_room = await create_deal(pc)
    with_room = await create_deal(pc, waiting_room=room(0, 0))
    url = "/v1/deals/{}/queue/challenge"
    problem(await pc.get(url.format(with_room)), 401, "UNAUTHORIZED")
    problem(await pc.get(url.format(open_room), headers=buyer(1)), 409, "NO_CHALLENGE")
    problem(await pc.get(url.format(no_room), headers=buyer(1)), 409, "NO_WAITING_ROOM")
    problem(await pc.get(url.format(9_000_000_000_777), headers=buyer(1)), 404, "NOT_FOUND")


async def test_challenge_field_is_validated(pc: Client) -> None:
    for bad in (
        {"min_bits": 25, "max_bits": 25},
        {"min_bits": 5, "max_bits": 4},
        {"min_bits": 0, "max_bits": 29},
        {"min_bits": -1, "max_bits": 3},
        {"min_bits": 1},
        {"min_bits": 1, "max_bits": 2, "x": 1},
        [1, 2],
        "hard",
    ):
        r = await pc.post(
            "/v1/admin/deals",
            json={
                "title": "t",
                "unit_price": 1,
                "currency": "EUR",
                "stock": 1,
                "waiting_room": {"admit_per_second": 1, "challenge": bad},
            },
            headers=ADMIN,
        )
        problem(r, 400, "INVALID_REQUEST")
    deal_id = await create_deal(pc, waiting_room=room(24, 28))
    view = (await pc.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["challenge"] == {"min_bits": 24, "max_bits": 28}
    r = await pc.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        json={"admit_per_second": 3, "challenge": None},
        headers=ADMIN,
    )
    assert r.status_code == 200 and "challenge" not in r.json()["waiting_room"]
    # The change is live: the room asks no challenge any more.
    problem(
        await pc.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(3)), 409, "NO_CHALLENGE"
    )
    assert (await join(pc, deal_id, 3)).status_code == 201


async def test_join_refusals_write_nothing(pc: Client, rds: aioredis.Redis) -> None:
    # Nobody is admitted (the sale opens in an hour): the queue is the joins' alone.
    deal_id = await create_deal(pc, stock=5, starts_at=_at(3600), waiting_room=quiet_room(4, 8))
    other = await create_deal(pc, stock=5, waiting_room=room(4, 8))
    before = await written(rds, deal_id)
    mine = await get_challenge(pc, deal_id, 21)
    good = solve(mine["challenge"], mine["bits"])
    wrong = unsolved(mine)
    theirs = await get_challenge(pc, deal_id, 22)
    elsewhere = await get_challenge(pc, other, 21)
    expired, _ = PASSES.mint(deal_id, 21, 4, now=time.time() - 121)
    forged = mine["challenge"].replace(f".21.{mine['bits']}.", ".21.0.")
    head, _, sig = mine["challenge"].rpartition(".")
    resigned = f"{head}.{'0' * len(sig)}"

    problem(await join(pc, deal_id, 21), 403, "CHALLENGE_REQUIRED")
    problem(await join(pc, deal_id, 21, {}), 403, "CHALLENGE_REQUIRED")
    cases: list[dict[str, Any]] = [
        {"challenge": mine["challenge"], "nonce": wrong},
        {"challenge": mine["challenge"]},
        {"nonce": good},
        {"challenge": theirs["challenge"], "nonce": solve(theirs["challenge"], theirs["bits"])},
        {
            "challenge": elsewhere["challenge"],
            "nonce": solve(elsewhere["challenge"], elsewhere["bits"]),
        },
        {"challenge": expired, "nonce": solve(expired, 4)},
        {"challenge": forged, "nonce": solve(forged, 0)},
        {"challenge": resigned, "nonce": good},
        {"challenge": "garbage", "nonce": "1"},
        {"challenge": "1.2.3.4.5.6", "nonce": "1"},
        {"challenge": mine["challenge"], "nonce": good + "x" * 64},
        {"challenge": "\u00e9" * 10, "nonce": good},
    ]
    for body in cases:
        problem(await join(pc, deal_id, 21, body), 403, "CHALLENGE_INVALID")
    problem(await join(pc, deal_id, 21, {"challenge": 5, "nonce": "1"}), 400, "INVALID_REQUEST")
    # A scripted joiner without solutions got nothing: no ticket, no Redis write.
    assert await written(rds, deal_id) == before

    first = await join(pc, deal_id, 21, {"challenge": mine["challenge"], "nonce": good})
    assert first.status_code == 201, first.text
    after = await written(rds, deal_id)
    assert set(after["tickets"]) == {"21"} and len(after["spent"]) == 1
    ttl_ms = await rds.pttl(after["spent"][0])
    assert 120_000 < ttl_ms <= 181_000
    # The ticket holder joins again (once the poll advice allows it: a join too soon
    # is 429 first): the same ticket, 200, whatever the body; nothing is judged or
    # spent (a fresh challenge stays unspent).
    fresh = await solved(pc, deal_id, 21)
    for body in ({"challenge": mine["challenge"], "nonce": good}, {}, fresh):
        rejoin = await join(pc, deal_id, 21, body)
        while rejoin.status_code == 429:
            await asyncio.sleep(0.05)
            rejoin = await join(pc, deal_id, 21, body)
        assert rejoin.status_code == 200, rejoin.text
        assert rejoin.json()["joined_at"] == first.json()["joined_at"]
    assert (await written(rds, deal_id))["spent"] == after["spent"]


async def test_scripted_joiners_get_nothing(pc: Client, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(pc, stock=5, starts_at=_at(3600), waiting_room=quiet_room(8, 12))
    before = await written(rds, deal_id)
    for user in range(300, 340):
        r = await join(
            pc,
            deal_id,
            user,
            {"challenge": f"{deal_id}.{user}.0.9999999999999.ab.cd", "nonce": "0"},
        )
        problem(r, 403, "CHALLENGE_INVALID")
        problem(await join(pc, deal_id, user), 403, "CHALLENGE_REQUIRED")
        c = await get_challenge(pc, deal_id, user)
        problem(
            await join(pc, deal_id, user, {"challenge": c["challenge"], "nonce": unsolved(c)}),
            403,
            "CHALLENGE_INVALID",
        )
    assert await written(rds, deal_id) == before
    for user in range(300, 340):
        r = await pc.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        problem(r, 404, "NO_TICKET")


async def test_code_and_challenge_together(pc: Client, rds: aioredis.Redis) -> None:
    """The challenge is judged first (tests/room/test_room_guard.py has the rest)."""
    deal_id = await create_deal(pc, stock=5, waiting_room=room(2, 4, access="codes"))
    r = await pc.post(
        f"/v1/admin/deals/{deal_id}/access-codes", json={"codes": ["both-0001"]}, headers=ADMIN
    )
    assert r.status_code == 200
    proof = await solved(pc, deal_id, 41)
    problem(await join(pc, deal_id, 41, proof), 403, "ACCESS_CODE_REQUIRED")
    problem(await join(pc, deal_id, 41, {"access_code": "both-0001"}), 403, "CHALLENGE_REQUIRED")
    # Neither refusal bound the code nor spent the challenge.
    codes = await rds.hgetall(deal_keys(deal_id).room_codes)
    assert list(codes.values()) == [""]
    r = await join(pc, deal_id, 41, {"access_code": "both-0001", **proof})
    assert r.status_code == 201, r.text
    assert list((await rds.hgetall(deal_keys(deal_id).room_codes)).values()) == ["41"]
    other = await solved(pc, deal_id, 42)
    problem(
        await join(pc, deal_id, 42, {"access_code": "both-0001", **other}), 403, "ACCESS_CODE_USED"
    )
