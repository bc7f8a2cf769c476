"""Admin: create, view with the invariant verdict, stock adjustment, rebucketing, ledger."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gate.inventory.check import check_deal
from gate.store.db import Database
from tests.support import (
    ADMIN,
    Client,
    Traffic,
    assert_invariants,
    create_deal,
    db_available,
    redis_available,
    reserve,
)


async def test_create_and_view(client: Client, db: Database, rds: aioredis.Redis) -> None:
    r = await client.post(
        "/v1/admin/deals",
        json={
            "title": "Lamp",
            "unit_price": 1250,
            "currency": "JPY",
            "stock": 10,
            "buckets": 3,
            "hold_seconds": 60,
            "per_user_limit": 2,
            "max_per_order": 2,
            "starts_at": "2026-01-01T00:00:00+09:00",
            "ends_at": "2099-01-01T00:00:00Z",
        },
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    deal = r.json()
    assert deal["buckets"] == 3 and deal["stock"] == 10
    assert deal["starts_at"] == "2025-12-31T15:00:00.000000Z"
    assert await db_available(db, deal["id"]) == {0: 4, 1: 3, 2: 3}
    view = await client.get(f"/v1/admin/deals/{deal['id']}", headers=ADMIN)
    assert view.status_code == 200
    body = view.json()
    assert body["invariant"] == {"ok": True, "breaches": []}
    assert body["totals"] == {"total": 10, "available": 10, "held": 0, "sold": 0}
    assert [b["redis_available"] for b in body["bucket_rows"]] == [4, 3, 3]
    public = (await client.get(f"/v1/deals/{deal['id']}")).json()
    assert public == {
        "id": deal["id"],
        "title": "Lamp",
        "unit_price": 1250,
        "currency": "JPY",
        "starts_at": "2025-12-31T15:00:00.000000Z",
        "ends_at": "2099-01-01T00:00:00.000000Z",
        "sold_out": False,
        "remaining_hint": 10,
        "mode": "sync",
    }


async def test_sale_window_is_enforced(client: Client, db: Database, rds: aioredis.Redis) -> None:
    early = await create_deal(client, stock=5, starts_at="2099-01-01T00:00:00Z")
    ended = await create_deal(
        client, stock=5, starts_at="2020-01-01T00:00:00Z", ends_at="2020-02-01T00:00:00Z"
    )
    for deal_id in (early, ended):
        r = await reserve(client, deal_id, 9100, f"window-{deal_id}-01")
        assert r.status_code == 409 and r.json()["code"] == "NOT_ACTIVE"
        await assert_invariants(db, rds, deal_id)


async def test_stock_adjustments_are_constrained_and_ledgered(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=4, buckets=2)
    for i in range(4):
        assert (
            await reserve(client, deal_id, 9200 + i, f"adj-{deal_id}-{i}-key")
        ).status_code == 201
    assert (await reserve(client, deal_id, 9300, f"adj-{deal_id}-x-key")).status_code == 409
    r = await client.post(
        f"/v1/admin/deals/{deal_id}/stock",
        json={"delta": 3, "reason": "supplier restock"},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    assert r.json()["totals"] == {"total": 7, "available": 3, "held": 4, "sold": 0}
    assert (await redis_available(rds, deal_id))[0] == 3
    # A reduction may only take what is available, never held stock.
    r = await client.post(
        f"/v1/admin/deals/{deal_id}/stock", json={"delta": -4, "reason": "too much"}, headers=ADMIN
    )
    assert r.status_code == 409 and r.json()["code"] == "CONFLICT"
    r = await client.post(
        f"/v1/admin/deals/{deal_id}/stock", json={"delta": -2, "reason": "damaged"}, headers=ADMIN
    )
    assert r.status_code == 200
    assert r.json()["totals"] == {"total": 5, "available": 1, "held": 4, "sold": 0}
    assert (await reserve(client, deal_id, 9301, f"adj-{deal_id}-y-key")).status_code == 201
    assert (await reserve(client, deal_id, 9302, f"adj-{deal_id}-z-key")).status_code == 409
    ledger = await client.get(f"/v1/admin/deals/{deal_id}/ledger?limit=1000", headers=ADMIN)
    assert ledger.status_code == 200
    reasons = [item["reason"] for item in ledger.json()["items"]]
    assert reasons.count("create") == 2 and reasons.count("reserve") == 5
    notes = [i["note"] for i in ledger.json()["items"] if i["reason"] == "adjust"]
    assert set(notes) == {"supplier restock", "damaged"}
    page = await client.get(f"/v1/admin/deals/{deal_id}/ledger?limit=3", headers=ADMIN)
    assert len(page.json()["items"]) == 3 and page.json()["next_after"] is not None
    after = page.json()["next_after"]
    rest = await client.get(
        f"/v1/admin/deals/{deal_id}/ledger?after={after}&limit=1000", headers=ADMIN
    )
    assert len(rest.json()["items"]) == len(reasons) - 3
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 5, "available": 0, "held": 5, "sold": 0}


async def test_rebucketing_under_concurrent_reservations_and_cancels(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    stock = 400
    deal_id = await create_deal(client, stock=stock, buckets=1, max_per_order=2)
    traffic = Traffic(client, deal_id, 600_000, seed=7)
    breaches: list[list[str]] = []

    async def watch() -> None:
        while not traffic.stop.is_set():
            report = await check_deal(db, None, deal_id)
            if not report["invariant"]["ok"]:
                breaches.append(report["invariant"]["breaches"])
            await asyncio.sleep(0.05)

    traffic.start(buyers=8)
    watcher = asyncio.ensure_future(watch())
    try:
        for count in (16, 4):
            await asyncio.sleep(0.7)
            r = await client.put(
                f"/v1/admin/deals/{deal_id}/buckets", json={"count": count}, headers=ADMIN
            )
            assert r.status_code == 200, r.text
            assert r.json()["buckets"] == count
            assert r.json()["invariant"]["ok"], r.json()["invariant"]
        await asyncio.sleep(0.7)
    finally:
        await traffic.finish()
        await watcher
    assert breaches == []
    report = await assert_invariants(db, rds, deal_id)
    assert report["bucket_count"] == 4
    assert report["totals"]["total"] == stock
    assert len(await db_available(db, deal_id)) == 4
    _r_total, r_buckets = await redis_available(rds, deal_id)
    assert sorted(r_buckets) == [0, 1, 2, 3]
    # Releases after the layout change still land in buckets that exist.
    for _ in range(20):
        assert await traffic.cancel_one()
    await assert_invariants(db, rds, deal_id)
