"""Rate limits: exact across gate processes, 429 with Retry-After and RateLimit fields."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
)

pytestmark = pytest.mark.slow

LIMIT = "5/m burst 5"


def pair(env: dict[str, str], **limits: str) -> list[GateProcess]:
    """Two separate gate processes sharing one Redis: limits must be exact across them."""
    overrides = {f"GATE_LIMIT_{k.upper()}": v for k, v in limits.items()}
    # Requests carry X-Forwarded-For through a trusted 127.0.0.1, so each test picks
    # the client address it needs.
    overrides["GATE_TRUSTED_PROXIES"] = "127.0.0.1/32"
    gates = [GateProcess({**env, **overrides}) for _ in range(2)]
    for g in gates:
        g.wait_ready()
    return gates


@pytest.fixture(scope="module")
def scoped_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    gates = pair(env, user=LIMIT, ip=LIMIT, device=LIMIT)
    yield gates
    for g in gates:
        g.stop()


@pytest.fixture(scope="module")
def deal_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    gates = pair(env, deal=LIMIT)
    yield gates
    for g in gates:
        g.stop()


@pytest.fixture(scope="module")
def global_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    gates = pair(env, **{"global": LIMIT})
    yield gates
    for g in gates:
        g.stop()


@pytest.fixture
async def clients(request: pytest.FixtureRequest) -> AsyncIterator[list[Client]]:
    gates: list[GateProcess] = request.getfixturevalue(request.param)
    cs = [Client(g.url) for g in gates]
    yield cs
    for c in cs:
        await c.close()


async def burst(
    clients: list[Client], deal_id: int, n: int, *, user, ip, device
) -> list[tuple[int, dict[str, str], dict]]:  # type: ignore[no-untyped-def]
    async def one(i: int) -> tuple[int, dict[str, str], dict]:  # type: ignore[type-arg]
        headers = {
            **buyer(user(i)),
            "Idempotency-Key": f"limit-{deal_id}-{i:04d}",
            "X-Forwarded-For": ip(i),
        }
        if device(i) is not None:
            headers["X-Device-Id"] = device(i)
        r = await clients[i % 2].post(
            f"/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=headers
        )
        return r.status_code, r.headers, r.json()

    return await asyncio.gather(*(one(i) for i in range(n)))


def check_refusals(results: list, scope: str) -> Counter[int]:  # type: ignore[type-arg]
    statuses = Counter(status for status, _, _ in results)
    assert 5 <= statuses[201] <= 6, statuses
    assert set(statuses) == {201, 429}, statuses
    for status, headers, body in results:
        if status != 429:
            continue
        assert body["code"] == "RATE_LIMITED" and body["scope"] == scope
        assert headers["Content-Type"] == "application/problem+json"
        retry = int(headers["Retry-After"])
        # 5 per minute: the next slot opens 12 s after the burst was spent, so a
        # refusal during the burst waits 12 s less the time since then (the bound
        # leaves the burst 4 s; it is not a speed check).
        assert 8 <= retry <= 12, retry
        assert headers["RateLimit-Policy"] == f'"{scope}";q=5;w=60'
        assert re.fullmatch(rf'"{scope}";r=0;t={retry}', headers["RateLimit"])
    return statuses


@pytest.mark.parametrize("clients", ["scoped_gates"], indirect=True)
async def test_user_ip_and_device_limits_are_exact_across_processes(
    clients: list[Client], db: Database, rds: aioredis.Redis
) -> None:
    c = clients[0]
    deal_id = await create_deal(c, stock=1000)
    # One buyer from 40 addresses and devices: only the user limit applies.
    check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 31_000,
            ip=lambda i: f"10.1.0.{i}",
            device=lambda i: f"dev-u-{i}",
        ),
        "user",
    )
    # 40 buyers behind one address, each with their own device.
    check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 32_000 + i,
            ip=lambda i: "10.2.0.1",
            device=lambda i: f"dev-i-{i}",
        ),
        "ip",
    )
    # 40 buyers on one device, each from their own address.
    check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 33_000 + i,
            ip=lambda i: f"10.3.0.{i}",
            device=lambda i: "dev-shared",
        ),
        "device",
    )
    # Others are unaffected: a new buyer, address and device is admitted.
    fresh = await burst(
        clients,
        deal_id,
        1,
        user=lambda i: 34_000,
        ip=lambda i: "10.4.0.1",
        device=lambda i: "dev-fresh",
    )
    assert fresh[0][0] == 201
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == 16


@pytest.mark.parametrize("clients", ["deal_gates"], indirect=True)
async def test_deal_limit(clients: list[Client], db: Database, rds: aioredis.Redis) -> None:
    deal_id = await create_deal(clients[0], stock=1000)
    other = await create_deal(clients[0], stock=1000)
    check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 35_000 + i,
            ip=lambda i: f"10.5.0.{i}",
            device=lambda i: f"d-{i}",
        ),
        "deal",
    )
    assert (
        await burst(
            clients,
            other,
            1,
            user=lambda i: 35_999,
            ip=lambda i: "10.5.1.1",
            device=lambda i: "d-x",
        )
    )[0][0] == 201
    await assert_invariants(db, rds, deal_id)


@pytest.mark.parametrize("clients", ["global_gates"], indirect=True)
async def test_global_limit_gives_back_what_it_refuses(
    clients: list[Client], db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(clients[0], stock=1000)
    statuses = check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 36_000 + i,
            ip=lambda i: f"10.6.0.{i}",
            device=lambda i: f"g-{i}",
        ),
        "global",
    )
    # The admissions the global limiter refused were compensated: Redis equals the
    # database, and only the admitted units are held.
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"]["held"] == statuses[201]


@pytest.mark.parametrize("clients", ["scoped_gates"], indirect=True)
async def test_buyers_without_a_device_id_are_not_device_limited(
    clients: list[Client], db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(clients[0], stock=1000)
    # 40 buyers, each from their own address, none sending X-Device-Id: no shared
    # "no device" bucket limits them together.
    results = await burst(
        clients,
        deal_id,
        40,
        user=lambda i: 38_000 + i,
        ip=lambda i: f"10.8.0.{i}",
        device=lambda i: None,
    )
    assert Counter(s for s, _, _ in results) == {201: 40}
    # A device id is still limited, whoever sends it.
    check_refusals(
        await burst(
            clients,
            deal_id,
            40,
            user=lambda i: 38_100 + i,
            ip=lambda i: f"10.8.1.{i}",
            device=lambda i: "-",
        ),
        "device",
    )
    await assert_invariants(db, rds, deal_id)


def db_attempts(gates: list[GateProcess]) -> float:
    """Reservations the gate processes sent to the database, by their own metric."""
    total = 0.0
    for g in gates:
        with urllib.request.urlopen(f"{g.metrics_url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = re.search(r"^gate_reservation_db_attempts_total ([0-9.e+]+)$", text, re.M)
        total += float(found.group(1)) if found else 0.0
    return total


@pytest.mark.parametrize("clients", ["scoped_gates"], indirect=True)
async def test_sold_out_and_closed_sales_are_answered_before_the_limiters(
    clients: list[Client], scoped_gates: list[GateProcess], db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(clients[0], stock=1)
    before = db_attempts(scoped_gates)
    results = await burst(
        clients, deal_id, 30, user=lambda i: 37_000, ip=lambda i: "10.7.0.1", device=lambda i: "d-s"
    )
    statuses = Counter(s for s, _, _ in results)
    # One unit: one buyer gets it; everybody else learns it is sold out, not 429.
    assert statuses[201] == 1
    assert statuses[409] == 29, statuses
    assert {b["code"] for s, _, b in results if s == 409} == {"SOLD_OUT"}
    # Only the sale reached the database.
    assert db_attempts(scoped_gates) - before == 1
    await assert_invariants(db, rds, deal_id)

    # A sale that has not started: every click is told so, none is rate-limited, none
    # reaches the database.
    later = await create_deal(clients[0], stock=10, starts_at="2099-01-01T00:00:00Z")
    before = db_attempts(scoped_gates)
    results = await burst(
        clients, later, 30, user=lambda i: 37_100, ip=lambda i: "10.7.1.1", device=lambda i: "d-c"
    )
    assert Counter((s, b["code"]) for s, _, b in results) == {(409, "NOT_ACTIVE"): 30}
    assert db_attempts(scoped_gates) == before


async def test_admin_and_reads_are_not_rate_limited(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=3)
    views = await asyncio.gather(*(client.get(f"/v1/deals/{deal_id}") for _ in range(30)))
    assert {v.status_code for v in views} == {200}
    admin = await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert admin.status_code == 200


async def test_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy(
    env: dict[str, str], db: Database, rds: aioredis.Redis
) -> None:
    """No GATE_TRUSTED_PROXIES: the address is the socket peer, whatever the request
    says it came from (neither the gate nor its HTTP server may believe the header)."""
    gate = GateProcess({**env, "GATE_LIMIT_IP": LIMIT})
    await asyncio.to_thread(gate.wait_ready)
    client = Client(gate.url)
    try:
        deal_id = await create_deal(client, stock=1000)
        results = await burst(
            [client, client],
            deal_id,
            20,
            user=lambda i: 38_000 + i,
            ip=lambda i: f"10.8.0.{i}",
            device=lambda i: f"d-f-{i}",
        )
        check_refusals(results, "ip")
        await assert_invariants(db, rds, deal_id)
    finally:
        await client.close()
        gate.stop()
