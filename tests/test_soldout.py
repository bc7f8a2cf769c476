"""The sold-out near-cache answers losers from memory, never a buyer's replay."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gate.db import Database
from tests.support import (
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    reserve,
)


async def _storm(client: Client, deal_id: int, base: int, n: int) -> Counter[int]:
    rs = await asyncio.gather(
        *(reserve(client, deal_id, base + i, f"storm-{deal_id}-{base + i}") for i in range(n))
    )
    return Counter(r.status_code for r in rs)


@pytest.fixture
async def cached_client(env: dict[str, str], prepared: None) -> AsyncIterator[Client]:
    """Two worker processes with the production near-cache (100 ms)."""
    gate = GateProcess({**env, "GATE_SOLD_OUT_CACHE_MS": "100"}, workers=2)
    await asyncio.to_thread(gate.wait_ready)
    c = Client(gate.url)
    try:
        yield c
    finally:
        await c.close()
        gate.stop()


async def test_replays_survive_a_hot_sold_out_cache(
    cached_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    client = cached_client
    deal_id = await create_deal(client, stock=2, buckets=2)
    winners = [
        await reserve(client, deal_id, 61_000 + i, f"winner-{deal_id}-{i}") for i in range(2)
    ]
    assert [w.status_code for w in winners] == [201, 201]
    # Losers by the hundred: the processes' near-caches are hot from here on.
    assert await _storm(client, deal_id, 62_000, 300) == Counter({409: 300})
    # Replays of the winners, in the middle of another storm, still get their 200.
    replays = [reserve(client, deal_id, 61_000 + i, f"winner-{deal_id}-{i}") for i in range(2)]
    results = await asyncio.gather(*replays, _storm(client, deal_id, 63_000, 300))
    for i, replay in enumerate(results[:2]):
        assert replay.status_code == 200, replay.text
        assert replay.json() == winners[i].json()
    assert results[2] == Counter({409: 300})
    # A quantity the deal does not allow is a 400, as Redis answers it, not "sold
    # out" from the near-cache (max_per_order is 1 here).
    too_many = await asyncio.gather(
        *(
            client.post(
                f"/v1/deals/{deal_id}/reservations",
                json={"quantity": 2},
                headers={**buyer(66_000 + i), "Idempotency-Key": f"two-{deal_id}-{i}"},
            )
            for i in range(20)
        )
    )
    assert Counter(r.status_code for r in too_many) == Counter({400: 20})
    # A winner's new request is answered by Redis: sold out, as for anyone.
    fresh = await reserve(client, deal_id, 61_000, f"winner-{deal_id}-new")
    assert fresh.status_code == 409

    # After a flush the buyers are rebuilt from the database before any cache use.
    await rds.flushdb()
    assert await _storm(client, deal_id, 64_000, 100) == Counter({409: 100})
    again = await reserve(client, deal_id, 61_001, f"winner-{deal_id}-1")
    assert again.status_code == 200, again.text

    # A cancel makes the unit sellable again at once in the process that served it.
    order = winners[0].json()["order_id"]
    cancelled = await client.post(f"/v1/orders/{order}/cancel", headers=buyer(61_000))
    assert cancelled.status_code == 200
    sold = Counter()  # type: Counter[int]
    for attempt in range(40):
        r = await reserve(client, deal_id, 65_000 + attempt, f"resale-{deal_id}-{attempt}")
        sold[r.status_code] += 1
        if r.status_code == 201:
            break
        await asyncio.sleep(0.05)
    assert sold[201] == 1, sold
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 2, "available": 0, "held": 2, "sold": 0}
