"""GATE_LIMIT_IP counts an IPv6 client as its /GATE_LIMIT_IP_V6_PREFIX network: one
subscriber usually holds a whole /64 and may use any address in it, so per address
it would have as many IP limits as it liked.

A real gate listening on ::1, which it trusts as a proxy, so that X-Forwarded-For
carries the IPv6 clients' addresses.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gate.base.limits import client_ip, limit_address, parse_networks
from gate.store.db import Database
from tests.support import (
    ADMIN,
    Client,
    GateCommand,
    assert_invariants,
    base_env,
    buyer,
    free_port,
)


def test_limit_address_groups_ipv6_by_prefix() -> None:
    assert limit_address("2001:db8:1:2::a", 64) == "2001:db8:1:2::/64"
    assert limit_address("2001:db8:1:2:ffff::b", 64) == "2001:db8:1:2::/64"
    assert limit_address("2001:db8:1:3::a", 48) == "2001:db8:1::/48"
    assert limit_address("2001:db8:1:2::a", 128) == "2001:db8:1:2::a"
    assert limit_address("::ffff:198.51.100.7", 64) == "198.51.100.7"
    assert limit_address("198.51.100.7", 64) == "198.51.100.7"
    trusted = parse_networks("T", "::1")
    assert client_ip("::1", "2001:db8:9:9::1", trusted, 64) == "2001:db8:9:9::/64"
    assert client_ip("2001:db8:9:9ff::1", None, (), 56) == "2001:db8:9:900::/56"


class V6Gate:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://[::1]:{self.port}"
        env = base_env()
        env.update(
            {
                "GATE_LIMIT_IP": "1/h burst 1",
                "GATE_TRUSTED_PROXIES": "::1",
            }
        )
        self.proc = GateCommand(
            env,
            "serve",
            "--host",
            "::1",
            "--port",
            str(self.port),
            "--no-background",
            log_name=f"gate-v6-{self.port}",
        )

    def wait_ready(self, timeout_seconds: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            assert self.proc.alive(), self.proc.output()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"gate on ::1 not ready: {self.proc.output()[-3000:]}")


@pytest.fixture(scope="module")
def v6_gate(prepared: None) -> Iterator[V6Gate]:
    gate = V6Gate()
    try:
        gate.wait_ready()
        yield gate
    finally:
        gate.proc.stop()


@pytest.fixture
async def v6_client(v6_gate: V6Gate) -> AsyncIterator[Client]:
    async with Client(v6_gate.url) as client:
        yield client


async def test_two_ipv6_clients_in_one_64_share_the_ip_limit(
    v6_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    r = await v6_client.post(
        "/v1/admin/deals",
        json={"title": "v6", "unit_price": 100, "currency": "EUR", "stock": 10},
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    deal_id = int(r.json()["id"])

    async def reserve(user_id: int, address: str) -> int:
        r = await v6_client.post(
            f"/v1/deals/{deal_id}/reservations",
            json={"quantity": 1},
            headers={
                **buyer(user_id),
                "Idempotency-Key": f"v6-limit-{deal_id}-{user_id}",
                "X-Forwarded-For": address,
            },
        )
        assert r.status_code in (201, 429), r.text
        if r.status_code == 429:
            assert r.json()["scope"] == "ip", r.text
        return r.status_code

    assert await reserve(1, "2001:db8:1:2::a") == 201
    # Another address of the same /64: the same client for the IP limit.
    assert await reserve(2, "2001:db8:1:2:ffff:ffff:ffff:b") == 429
    # Another /64: another client.
    assert await reserve(3, "2001:db8:1:3::a") == 201
    report = await assert_invariants(db, rds, deal_id)
    assert report["invariant"]["ok"], report
    row = await db.fetchone(
        "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
        (deal_id,),
    )
    assert row is not None and int(row[0]) == 2
