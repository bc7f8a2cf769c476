"""Invitations that cannot be guessed or burnt, and one guard for every room route.

    - With a challenge, the proof of work is judged before the code: without a solved
      challenge every join is answered alike, whatever its code; a code refused after
      a solved challenge spends it.
    - Failed code attempts are limited per buyer and per client address (per deal),
      counted in Redis (so across gate processes) and in a metric.
    - Codes added by the admin are at least 8 characters; codes the gate makes carry
      at least 64 bits of randomness.
    - A buyer who holds a ticket binds no further code.
    - Every room route that names a deal is registered through one place that puts it
      behind the unknown-deal guard.

Real gate processes, real Redis and MariaDB."""

from __future__ import annotations

import ast
import asyncio
import math
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.room.gates import solve
from gate.room.routes import DealRoute
from gate.runtime import Gate
from gate.store.keys import deal_keys
from tests.support import ADMIN, ROOT, Client, GateProcess, Resp, buyer, create_deal

ATTEMPTS = 3


@pytest.fixture(scope="module")
def guard_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    """Two gate processes (the attempts are counted across them), trusting 127.0.0.1
    as a proxy so that each request may name its client address (X-Forwarded-For)."""
    guard_env = {
        **env,
        "GATE_ROOM_POLL_MIN_MS": "100",
        "GATE_ROOM_POLL_MAX_MS": "100",
        "GATE_ROOM_CODE_ATTEMPTS_PER_MINUTE": str(ATTEMPTS),
        "GATE_TRUSTED_PROXIES": "127.0.0.1/32",
    }
    with GateProcess(guard_env, workers=1) as first, GateProcess(guard_env, workers=1) as second:
        yield [first, second]


@pytest.fixture
async def gc(guard_gates: list[GateProcess]) -> AsyncIterator[list[Client]]:
    async with Client(guard_gates[0].url) as first, Client(guard_gates[1].url) as second:
        yield [first, second]


def problem(r: Resp, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    assert body["code"] == code, r.text
    return body


async def add_codes(client: Client, deal_id: int, codes: list[str]) -> None:
    r = await client.post(
        f"/v1/admin/deals/{deal_id}/access-codes", json={"codes": codes}, headers=ADMIN
    )
    assert r.status_code == 200, r.text


async def join(
    client: Client, deal_id: int, user_id: int, body: Any = None, address: str = "10.9.9.9"
) -> Resp:
    headers = {**buyer(user_id), "X-Forwarded-For": address}
    return await client.post(f"/v1/deals/{deal_id}/queue", json=body, headers=headers)


async def rejoin(client: Client, deal_id: int, user_id: int, body: Any) -> Resp:
    """A join again, once the poll advice allows it (a join too soon is 429)."""
    while True:
        r = await join(client, deal_id, user_id, body)
        if r.status_code != 429:
            return r
        await asyncio.sleep(0.05)


async def solved(client: Client, deal_id: int, user_id: int) -> dict[str, str]:
    r = await client.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(user_id))
    assert r.status_code == 200, r.text
    c = r.json()
    return {"challenge": c["challenge"], "nonce": solve(c["challenge"], c["bits"])}


async def codes_of(rds: aioredis.Redis, deal_id: int) -> dict[str, str]:
    return dict(await rds.hgetall(deal_keys(deal_id).room_codes))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` that carry these labels (0 when none)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if want <= set(head[len(name) :].strip("{}").split(",")):
                total += float(value)
    return total


# -- the proof of work before the code ------------------------------------------------------


async def test_without_a_solved_challenge_every_code_is_answered_alike(
    gc: list[Client], rds: aioredis.Redis
) -> None:
    a, b = gc
    room = {
        "admit_per_second": 1000,
        "access": "codes",
        "challenge": {"min_bits": 2, "max_bits": 2},
    }
    deal_id = await create_deal(a, stock=10, waiting_room=room)
    await add_codes(a, deal_id, ["guard-code-0001", "guard-code-0002"])
    first = await join(
        a, deal_id, 101, {"access_code": "guard-code-0001", **await solved(a, deal_id, 101)}
    )
    assert first.status_code == 201, first.text

    # A valid unbound code, a code bound to another buyer, an unknown one, a malformed
    # one, none: without a challenge, one answer. Nothing is written or counted.
    before = await codes_of(rds, deal_id)
    answers = []
    for code in ("guard-code-0002", "guard-code-0001", "guard-code-9999", "no", None):
        body = {} if code is None else {"access_code": code}
        for client in (a, b):
            answers.append(
                problem(await join(client, deal_id, 102, body), 403, "CHALLENGE_REQUIRED")
            )
    assert len({(x["code"], x["detail"]) for x in answers}) == 1
    assert await codes_of(rds, deal_id) == before

    # With a solved challenge the code is judged; a refused code spends the challenge,
    # so every guess costs a proof of work.
    proof = await solved(b, deal_id, 102)
    problem(
        await join(b, deal_id, 102, {"access_code": "guard-code-0001", **proof}),
        403,
        "ACCESS_CODE_USED",
    )
    problem(
        await join(a, deal_id, 102, {"access_code": "guard-code-0002", **proof}),
        403,
        "CHALLENGE_INVALID",
    )
    proof = await solved(a, deal_id, 102)
    problem(
        await join(a, deal_id, 102, {"access_code": "guard-code-9999", **proof}),
        403,
        "ACCESS_CODE_INVALID",
    )
    problem(
        await join(b, deal_id, 102, {"access_code": "guard-code-0002", **proof}),
        403,
        "CHALLENGE_INVALID",
    )
    # A solved challenge without a code is not a guess: not spent.
    proof = await solved(a, deal_id, 102)
    problem(await join(a, deal_id, 102, proof), 403, "ACCESS_CODE_REQUIRED")
    r = await join(b, deal_id, 102, {"access_code": "guard-code-0002", **proof})
    assert r.status_code == 201, r.text
    assert await codes_of(rds, deal_id) == {
        k: "101" if v == "101" else "102" for k, v in before.items()
    }


# -- failed attempts, limited -------------------------------------------------------------


async def test_failed_code_attempts_are_limited_per_buyer_and_address_across_processes(
    gc: list[Client], rds: aioredis.Redis
) -> None:
    a, b = gc
    deal_id = await create_deal(
        a, stock=10, waiting_room={"admit_per_second": 1000, "access": "codes"}
    )
    await add_codes(a, deal_id, ["limit-code-0001", "limit-code-0002", "limit-code-0003"])
    before = [await c.metrics() for c in gc]

    # Buyer 201 from 10.0.0.1 guesses through both processes: ATTEMPTS refusals, then
    # 429, even for a valid code (which stays free).
    for i in range(ATTEMPTS):
        client = gc[i % 2]
        guess = {"access_code": f"guess-code-{i:04d}"}
        problem(await join(client, deal_id, 201, guess, "10.0.0.1"), 403, "ACCESS_CODE_INVALID")
    limited = await join(a, deal_id, 201, {"access_code": "limit-code-0001"}, "10.0.0.1")
    body = problem(limited, 429, "RATE_LIMITED")
    assert body["scope"] == "access_code", body
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    # Per buyer: from another address too.
    problem(
        await join(b, deal_id, 201, {"access_code": "limit-code-0001"}, "10.0.0.2"),
        429,
        "RATE_LIMITED",
    )
    # Per address: another buyer from the same address.
    problem(
        await join(b, deal_id, 202, {"access_code": "limit-code-0001"}, "10.0.0.1"),
        429,
        "RATE_LIMITED",
    )
    assert set((await codes_of(rds, deal_id)).values()) == {""}
    assert not await rds.hlen(deal_keys(deal_id).room_tickets)

    # Anyone else is not held back.
    r = await join(b, deal_id, 203, {"access_code": "limit-code-0001"}, "10.0.0.3")
    assert r.status_code == 201, r.text
    problem(
        await join(a, deal_id, 204, {"access_code": "limit-code-0001"}, "10.0.0.4"),
        403,
        "ACCESS_CODE_USED",
    )
    # A join without a code is no guess: it is answered as before, not limited.
    problem(await join(a, deal_id, 201, {}, "10.0.0.1"), 403, "ACCESS_CODE_REQUIRED")

    after = [await c.metrics() for c in gc]

    def counted(reason: str) -> float:
        name = "gate_room_code_failures_total"
        return sum(metric(t, name, reason=reason) for t in after) - sum(
            metric(t, name, reason=reason) for t in before
        )

    assert counted("invalid") == ATTEMPTS
    assert counted("used") == 1
    assert counted("rate_limited") == 3


# -- the codes' length and the gate's own codes -----------------------------------------------


async def test_admin_codes_are_at_least_8_characters_and_generated_ones_carry_64_bits(
    gc: list[Client], rds: aioredis.Redis
) -> None:
    a, _ = gc
    deal_id = await create_deal(
        a, stock=10, waiting_room={"admit_per_second": 1000, "access": "codes"}
    )
    url = f"/v1/admin/deals/{deal_id}/access-codes"
    for short in (["seven77"], ["abcdef"], ["eight888", "x7"]):
        problem(await a.post(url, json={"codes": short}, headers=ADMIN), 400, "INVALID_REQUEST")
    assert not await rds.hlen(deal_keys(deal_id).room_codes)
    r = await a.post(url, json={"codes": ["eight888"]}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"added": 1, "total": 1}, r.text

    for bad in (0, 10_001, -1, "5", 1.5, True, None):
        r = await a.post(url, json={"generate": bad}, headers=ADMIN)
        problem(r, 400, "INVALID_REQUEST")
    problem(
        await a.post(url, json={"generate": 2, "codes": ["eight888"]}, headers=ADMIN),
        400,
        "INVALID_REQUEST",
    )
    r = await a.post(url, json={"generate": 200}, headers=ADMIN)
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["added"] == 200 and made["total"] == 201 and len(made["codes"]) == 200
    assert len(set(made["codes"])) == 200
    for code in made["codes"]:
        # Crockford base32 in groups of four: 5 random bits a character.
        assert re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{4}(-[0-9A-HJKMNP-TV-Z]{4})+", code), code
        symbols = code.replace("-", "")
        assert len(symbols) * math.log2(32) >= 64
    # Stored hashed like any code; one of them lets a buyer in.
    assert await rds.hlen(deal_keys(deal_id).room_codes) == 201
    assert not set(made["codes"]) & set(await rds.hkeys(deal_keys(deal_id).room_codes))
    r = await join(a, deal_id, 401, {"access_code": made["codes"][7]})
    assert r.status_code == 201, r.text


# -- a code binds once ------------------------------------------------------------------------


async def test_a_ticket_holder_joining_again_binds_no_further_code(
    gc: list[Client], rds: aioredis.Redis
) -> None:
    a, b = gc
    deal_id = await create_deal(
        a, stock=10, waiting_room={"admit_per_second": 1000, "access": "codes"}
    )
    await add_codes(a, deal_id, ["once-code-0001", "once-code-0002", "once-code-0003"])
    first = await join(a, deal_id, 301, {"access_code": "once-code-0001"})
    assert first.status_code == 201, first.text

    for client, code in ((a, "once-code-0002"), (b, "once-code-0003"), (a, "nope-nope-01")):
        r = await rejoin(client, deal_id, 301, {"access_code": code})
        assert r.status_code == 200, r.text
        assert r.json()["ticket_id"] == first.json()["ticket_id"]
    r = await rejoin(b, deal_id, 301, {})
    assert r.status_code == 200 and r.json()["ticket_id"] == first.json()["ticket_id"], r.text
    codes = await codes_of(rds, deal_id)
    assert sorted(codes.values()) == ["", "", "301"]
    # The codes the ticket holder named are still free for others.
    assert (await join(b, deal_id, 302, {"access_code": "once-code-0002"})).status_code == 201
    assert (await join(a, deal_id, 303, {"access_code": "once-code-0003"})).status_code == 201


async def test_a_ticket_holder_rejoins_a_challenge_room_without_a_new_challenge(
    gc: list[Client], rds: aioredis.Redis
) -> None:
    a, _ = gc
    room = {
        "admit_per_second": 1000,
        "access": "codes",
        "challenge": {"min_bits": 1, "max_bits": 1},
    }
    deal_id = await create_deal(a, stock=10, waiting_room=room)
    await add_codes(a, deal_id, ["pow-code-0001", "pow-code-0002"])
    first = await join(
        a, deal_id, 311, {"access_code": "pow-code-0001", **await solved(a, deal_id, 311)}
    )
    assert first.status_code == 201, first.text
    spent = [k async for k in rds.scan_iter(match=f"{deal_keys(deal_id).room}:pow:*")]
    proof = await solved(a, deal_id, 311)
    for body in ({}, {"access_code": "pow-code-0002", **proof}):
        r = await rejoin(a, deal_id, 311, body)
        assert r.status_code == 200 and r.json()["ticket_id"] == first.json()["ticket_id"], r.text
    # Nothing judged, nothing bound or spent.
    assert sorted((await codes_of(rds, deal_id)).values()) == ["", "311"]
    assert [k async for k in rds.scan_iter(match=f"{deal_keys(deal_id).room}:pow:*")] == spent


# -- one guard for every room route -------------------------------------------------------


async def test_every_room_route_naming_a_deal_is_registered_behind_the_guard(
    settings: Settings,
) -> None:
    gate = Gate(settings)
    room = next(e for e in gate.extensions if e.name == "room")
    named = [r for r in room.routes if "{deal_id" in getattr(r, "path", "")]
    assert len(named) >= 8, [getattr(r, "path", "") for r in room.routes]
    for route in named:
        assert isinstance(route, DealRoute), f"{route.path} is not behind the deal guard"
    # Nothing in the room loads a deal but the guard: a script that finds no state
    # raises NotLoaded, and only gate/room/routes.py turns that into a load.
    loaders = []
    for path in sorted((ROOT / "gate" / "room").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # `….mirror.load`, called or handed over.
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "load"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "mirror"
            ):
                loaders.append(f"{Path(path).relative_to(ROOT)}:{node.lineno}")
    assert loaders and all(p.startswith("gate/room/routes.py:") for p in loaders), loaders
