"""The DB-only peer baseline: article 000's transaction behind the gate's request shape.

It must be correct for the comparison to mean anything: never oversell, replay a key,
refuse bad input like the gate; and its checker must catch a seeded oversell."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gate.base.settings import MysqlTarget, Settings
from gate.store.db import Database
from loadtest import wrkrun
from loadtest.baseline.store import check_deal, migrate
from loadtest.procs import Server
from loadtest.tokens import write_token_file
from loadtest.verify import verify_baseline_deal
from tests.loadtest_support import baseline_env, codes, created, crowd, run_module, start_baseline
from tests.support import ADMIN, JWT_SECRET, Client, buyer, create_deal, reserve


@pytest.fixture(scope="module")
def benv(env: dict[str, str]) -> dict[str, str]:
    # Other suites share the database server: keep this one's connections few.
    return {**baseline_env(env), "GATE_DB_POOL_MAX": "8"}


@pytest.fixture(scope="module")
def baseline(benv: dict[str, str]) -> Iterator[Server]:
    asyncio.run(migrate(MysqlTarget.parse(benv["BASELINE_MYSQL_URL"]), drop=True))
    server = start_baseline(benv, workers=1)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bclient(baseline: Server) -> AsyncIterator[Client]:
    async with Client(baseline.url) as c:
        yield c


@pytest.fixture
async def bdb(
    settings: Settings, benv: dict[str, str], baseline: Server
) -> AsyncIterator[Database]:
    from dataclasses import replace

    target = MysqlTarget.parse(benv["BASELINE_MYSQL_URL"])
    database = Database(replace(settings, mysql=target), pool_max=4)
    await database.start()
    try:
        yield database
    finally:
        await database.close()


async def crowd_with_retries(
    client: Client, deal_id: int, users: range, prefix: str
) -> list[tuple[int, Any]]:
    """One attempt per buyer, all at once. Transactions queue on one row: some may wait
    past the lock-wait timeout or the pool's wait and be shed (503); their buyers retry
    with the same key."""
    answers = await crowd(client, deal_id, users, prefix)
    for _ in range(5):
        shed = [u for u, r in answers if r.status_code == 503]
        if not shed:
            break
        again = await asyncio.gather(
            *(reserve(client, deal_id, u, f"{prefix}-{u:08d}") for u in shed)
        )
        retried = dict(zip(shed, again, strict=True))
        answers = [(u, retried.get(u, r)) for u, r in answers]
    return answers


async def test_a_crowd_sells_exactly_the_stock(bclient: Client, bdb: Database) -> None:
    deal_id = await create_deal(bclient, stock=30)
    answers = await crowd_with_retries(bclient, deal_id, range(1, 201), f"bl{deal_id}")
    assert codes(answers) == {201: 30, "SOLD_OUT": 170}
    sold_out = next(r for _, r in answers if r.status_code == 409)
    assert sold_out.headers["content-type"] == "application/problem+json"
    first = next(r for _, r in answers if r.status_code == 201).json()
    assert first["status"] == "PENDING_PAYMENT" and first["deal_id"] == deal_id
    assert first["amount"] == 500 and first["currency"] == "EUR" and first["expires_at"]

    report = await check_deal(bdb, deal_id)
    assert report["invariant"]["ok"], report["invariant"]["breaches"]
    assert report["totals"] == {"total": 30, "available": 0, "ordered": 30}
    assert report["orders"] == {"PENDING_PAYMENT": {"count": 30, "units": 30}}


async def test_one_key_is_one_order(bclient: Client, bdb: Database) -> None:
    deal_id = await create_deal(bclient, stock=10)
    first = await reserve(bclient, deal_id, 501, "same-key-0001")
    again = await reserve(bclient, deal_id, 501, "same-key-0001")
    assert first.status_code == 201 and again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["order_id"] == first.json()["order_id"]
    # The same key on another deal is a different request.
    other = await create_deal(bclient, stock=10)
    mismatch = await reserve(bclient, other, 501, "same-key-0001")
    assert mismatch.status_code == 422 and mismatch.json()["code"] == "IDEMPOTENCY_MISMATCH"

    # Concurrent clicks with one key: one order, every answer names it.
    clicks = await asyncio.gather(
        *(reserve(bclient, deal_id, 502, "double-click-1") for _ in range(8))
    )
    assert sorted({r.status_code for r in clicks}) in ([200, 201], [201])
    assert len({r.json()["order_id"] for r in clicks}) == 1
    rows = await bdb.fetchall(
        "SELECT COUNT(*) FROM orders WHERE user_id = 502 AND idempotency_key = 'double-click-1'"
    )
    assert rows[0][0] == 1
    report = await check_deal(bdb, deal_id)
    assert report["invariant"]["ok"] and report["totals"]["available"] == 8


async def test_bad_input_is_refused_like_the_gate(bclient: Client) -> None:
    deal_id = await create_deal(bclient, stock=5)
    path = f"/v1/deals/{deal_id}/reservations"
    no_key = await bclient.post(path, json={"quantity": 1}, headers=buyer(7))
    assert no_key.status_code == 400 and no_key.json()["code"] == "INVALID_REQUEST"
    no_token = await bclient.post(path, json={"quantity": 1}, headers={"Idempotency-Key": "k" * 8})
    assert no_token.status_code == 401
    too_many = await bclient.post(
        path, json={"quantity": 2}, headers={**buyer(7), "Idempotency-Key": "k" * 9}
    )
    assert too_many.status_code == 400
    unknown = await reserve(bclient, 987_654, 7, "unknown-deal")
    assert unknown.status_code == 404
    not_admin = await bclient.post(
        "/v1/admin/deals", json={"unit_price": 1, "stock": 1}, headers=buyer(7)
    )
    assert not_admin.status_code == 401
    view = await bclient.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert view.status_code == 200 and view.json()["invariant"]["ok"] is True


async def test_the_checker_catches_a_seeded_oversell_and_lost_units(
    bclient: Client, bdb: Database, benv: dict[str, str]
) -> None:
    deal_id = await create_deal(bclient, stock=5)
    answers = await crowd(bclient, deal_id, range(601, 611), f"seed{deal_id}")
    assert len(created(answers)) == 5
    assert (await verify_baseline_deal(bdb, deal_id))["ok"]

    # An order past the stock, as a SELECT-then-UPDATE gate would write it.
    await bdb.execute(
        "INSERT INTO orders (id, user_id, deal_id, quantity, amount, currency, status,"
        " idempotency_key, expires_at, created_at, updated_at) VALUES"
        " ('01BASELINEOVERSELL00000000', 699, %s, 1, 500, 'EUR', 'PENDING_PAYMENT',"
        " 'seeded', NOW(), NOW(6), NOW(6))",
        (deal_id,),
    )
    verdict = await verify_baseline_deal(bdb, deal_id)
    assert not verdict["ok"] and verdict["numbers"]["oversold"] == 1
    assert "oversold: orders hold 6 units of a stock of 5" in verdict["breaches"]
    out = run_module(benv, "loadtest.verify", "--baseline", "--deal", str(deal_id))
    assert out.returncode == 1 and "oversold=1" in out.stdout, out.stdout + out.stderr
    out = run_module(benv, "loadtest.baseline", "check", "--deal", str(deal_id))
    assert out.returncode == 1 and "BREACH" in out.stdout

    # Stock that neither the row nor an order accounts for.
    other = await create_deal(bclient, stock=5)
    await bdb.execute("UPDATE deals SET stock_available = 3 WHERE id = %s", (other,))
    verdict = await verify_baseline_deal(bdb, other)
    assert not verdict["ok"] and verdict["numbers"]["lost"] == 2


@pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)"
)
async def test_wrk_once_mode_gives_every_buyer_one_attempt(
    baseline: Server, bclient: Client, bdb: Database, tmp_path: Path
) -> None:
    """The benchmark's sell-out driver: exactly one attempt per buyer, then it stops."""
    deal_id = await create_deal(bclient, stock=10)
    tokens = tmp_path / "tokens.txt"
    write_token_file(tokens, JWT_SECRET, range(700_000, 700_120), 3600)
    result = await asyncio.to_thread(
        wrkrun.reserve_once, baseline.url, deal_id, tokens, "wrktest", 16, 2
    )
    assert result.extra["finished"] is True
    assert result.status == {201: 10, 409: 110}
    assert result.sent == 120
    rows = await bdb.fetchall(
        "SELECT COUNT(*), COUNT(DISTINCT user_id) FROM orders WHERE deal_id = %s", (deal_id,)
    )
    assert rows[0] == (10, 10)
    assert (await verify_baseline_deal(bdb, deal_id))["ok"]


async def test_the_lean_peer_sells_exactly_the_stock(
    benv: dict[str, str], bdb: Database, baseline: Server
) -> None:
    """The lean peer (no auth, no idempotency look-up) shares the schema and the checker:
    a crowd gets exactly the stock, a reused key is refused, bad input is a 4xx."""
    lean = start_baseline(benv, workers=1, lean=True)
    c = Client(lean.url)
    try:
        deal_id = await create_deal(c, stock=25)
        answers = await crowd_with_retries(c, deal_id, range(1, 121), f"lean{deal_id}")
        assert codes(answers) == {201: 25, "SOLD_OUT": 95}
        report = await check_deal(bdb, deal_id)
        assert report["invariant"]["ok"], report
        assert report["totals"]["available"] == 0
        # The buyer is the token's sub; the order carries it.
        order_id, user_id = created(answers)[0]
        row = await bdb.fetchone("SELECT user_id FROM orders WHERE id = %s", (order_id,))
        assert row is not None and int(row[0]) == user_id
        refill = await create_deal(c, stock=5)
        first = await reserve(c, refill, 7, "lean-same-key")
        again = await reserve(c, refill, 7, "lean-same-key")
        assert (first.status_code, again.status_code) == (201, 409)
        bad = await c.post(
            f"/v1/deals/{refill}/reservations",
            json={"quantity": "1"},
            headers={**buyer(7), "Idempotency-Key": "lean-bad"},
        )
        assert bad.status_code == 400
        assert bad.headers["content-type"].startswith("application/problem+json")
        assert (await check_deal(bdb, refill))["totals"]["available"] == 4
    finally:
        await c.close()
        lean.stop()
