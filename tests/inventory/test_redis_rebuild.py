"""An empty or flushed Redis is rebuilt from the database: never "sold out", never "plenty"."""

from __future__ import annotations

import asyncio
from collections import Counter

import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import Client, assert_invariants, create_deal, db_available, reserve


async def test_flush_mid_sale_neither_oversells_nor_fakes_sold_out(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    stock, attempts = 100, 600
    deal_id = await create_deal(client, stock=stock, buckets=4)

    async def wave(first: int, count: int) -> list[int]:
        rs = await asyncio.gather(
            *(
                reserve(client, deal_id, 2_000_000 + i, f"flush-{deal_id}-{i:05d}")
                for i in range(first, first + count)
            )
        )
        return [r.status_code for r in rs]

    first = await wave(0, 40)
    assert first.count(201) == 40
    # Mid-sale Redis loses everything, while the next wave is already arriving.
    flush = asyncio.ensure_future(rds.flushdb())
    rest = await asyncio.gather(wave(40, 280), wave(320, attempts - 320))
    await flush
    statuses = Counter(first + rest[0] + rest[1])
    assert set(statuses) <= {201, 409, 503}, statuses
    assert statuses[201] <= stock
    # Whatever the flush cost in flight, the deal is still sellable to the last unit.
    left = sum((await db_available(db, deal_id)).values())
    extra = await asyncio.gather(
        *(reserve(client, deal_id, 3_000_000 + i, f"flush-extra-{i:05d}") for i in range(left + 20))
    )
    assert sum(r.status_code == 201 for r in extra) == left
    assert all(r.json()["code"] == "SOLD_OUT" for r in extra if r.status_code != 201)
    held = await db.fetchone(
        "SELECT SUM(quantity) FROM orders WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
        (deal_id,),
    )
    assert held is not None and int(held[0]) == stock
    await assert_invariants(db, rds, deal_id)


async def test_flushed_deal_view_reads_the_database(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=7, buckets=3)
    for i in range(3):
        assert (await reserve(client, deal_id, 4_000_000 + i, f"view-{i:06d}")).status_code == 201
    await rds.flushdb()
    view = await client.get(f"/v1/deals/{deal_id}")
    assert view.status_code == 200
    assert view.json()["remaining_hint"] == 4
    assert view.json()["sold_out"] is False
    await assert_invariants(db, rds, deal_id)
