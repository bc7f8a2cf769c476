"""Guessing the admin token (gate/web/admin_guard.py), against two real `gate serve`
processes sharing one Redis: at most 10 wrong tokens a minute per client address,
counted across both processes and shared with the console's sign-in; then 429
RATE_LIMITED with Retry-After, the right token included; another address is not
affected; failures are counted in gate_admin_auth_failures_total, not logged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from gate.base.metrics import sample_values, value_of
from tests.console_support import console_env, fresh_address, sign_in
from tests.support import ADMIN_TOKEN, Client, GateProcess, Resp, create_deal

WRONG = "Bearer wrong-admin-token-0123456789abcdef0123"


@pytest.fixture(scope="module")
def two_gates(env: dict[str, str], prepared: None) -> Iterator[list[GateProcess]]:
    """Two processes; 127.0.0.1 is a trusted proxy, so each request names its client
    address in X-Forwarded-For. The first serves the console too."""
    with (
        GateProcess(console_env(env), workers=1) as first,
        GateProcess({**env, "GATE_TRUSTED_PROXIES": "127.0.0.1"}, workers=1) as second,
    ):
        yield [first, second]


@pytest.fixture
async def clients(two_gates: list[GateProcess]) -> AsyncIterator[list[Client]]:
    async with Client(two_gates[0].url) as first, Client(two_gates[1].url) as second:
        yield [first, second]


async def admin_get(client: Client, deal_id: int, address: str, authorization: str) -> Resp:
    headers = {"X-Forwarded-For": address, "Authorization": authorization}
    return await client.get(f"/v1/admin/deals/{deal_id}", headers=headers)


async def failures(clients: list[Client], reason: str) -> float:
    total = 0.0
    for c in clients:
        total += value_of(
            sample_values(await c.metrics()), "gate_admin_auth_failures_total", reason=reason
        )
    return total


def assert_limited(r: Resp) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["Content-Type"] == "application/problem+json"
    assert r.json()["code"] == "RATE_LIMITED"
    assert 1 <= int(r.headers["Retry-After"]) <= 60


async def test_wrong_tokens_are_limited_per_address_across_processes(
    two_gates: list[GateProcess], clients: list[Client]
) -> None:
    deal_id = await create_deal(clients[0], stock=1)
    wrong_before = await failures(clients, "wrong_token")
    limited_before = await failures(clients, "rate_limited")
    log_before = [proc.output() for proc in two_gates]
    guesser = fresh_address()
    # Ten guesses, alternating between the two processes: each a 401.
    for i in range(10):
        r = await admin_get(clients[i % 2], deal_id, guesser, f"{WRONG}{i}")
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED", r.text
    # The eleventh, on either process, and the right token from that address: 429.
    for c in clients:
        assert_limited(await admin_get(c, deal_id, guesser, WRONG))
        assert_limited(await admin_get(c, deal_id, guesser, f"Bearer {ADMIN_TOKEN}"))
    # Other addresses are not affected, and a request without a token is no guess.
    other = fresh_address()
    ok = await admin_get(clients[1], deal_id, other, f"Bearer {ADMIN_TOKEN}")
    assert ok.status_code == 200 and ok.json()["id"] == deal_id, ok.text
    assert (await admin_get(clients[0], deal_id, other, WRONG)).status_code == 401
    for _ in range(12):
        r = await clients[0].get(f"/v1/admin/deals/{deal_id}", headers={"X-Forwarded-For": other})
        assert r.status_code == 401, r.text
    assert (await admin_get(clients[0], deal_id, other, f"Bearer {ADMIN_TOKEN}")).status_code == 200

    assert await failures(clients, "wrong_token") - wrong_before == 11
    assert await failures(clients, "rate_limited") - limited_before == 4
    for proc, before in zip(two_gates, log_before, strict=True):
        logged = proc.output()[len(before) :]
        assert "wrong-admin-token" not in logged and ADMIN_TOKEN not in logged, logged


async def test_concurrent_guesses_get_ten_answers_at_most(clients: list[Client]) -> None:
    """Thirty guesses at once over both processes: exactly ten are judged (401), every
    other one is refused before its token is looked at (429)."""
    guesser = fresh_address()
    answers = await asyncio.gather(
        *(admin_get(clients[i % 2], 1, guesser, f"{WRONG}{i}") for i in range(30))
    )
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [401] * 10 + [429] * 20, statuses


async def test_the_console_and_the_api_share_one_budget(clients: list[Client]) -> None:
    """Five wrong console sign-ins and five wrong admin API calls from one address
    use its ten attempts: both surfaces then answer 429."""
    guesser = fresh_address()
    for i in range(5):
        r, _ = await sign_in(clients[0], f"guess-{i:04d}-0123456789abcdef0123", address=guesser)
        assert r.status_code == 401, r.text
        assert (await admin_get(clients[1], 1, guesser, f"{WRONG}{i}")).status_code == 401
    r, session = await sign_in(clients[0], address=guesser)
    assert_limited(r)
    assert session is None
    assert_limited(await admin_get(clients[1], 1, guesser, WRONG))
