"""The sold-out near-cache answers losers from memory, never a buyer's replay."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gate.reserve.soldout import SoldOutCache
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys, partition_keys
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


# --- the near-cache's renewal, driven directly (real Redis, the gate's script runner) ---

RENEW_DEAL = 9_000_017


async def _sold_out_deal(rds: aioredis.Redis, avail: int = 0) -> None:
    keys = deal_keys(RENEW_DEAL)
    await rds.delete(keys.meta, keys.buyers)
    await rds.hset(
        keys.meta,
        mapping={"avail": avail, "start_ms": 0, "end_ms": 0, "buyers_ok": 1, "max": 1, "nb": 1},
    )
    await rds.sadd(keys.buyers, "1")


@pytest.fixture
async def renewing(local_gate: Gate, rds: aioredis.Redis) -> AsyncIterator[SoldOutCache]:
    """A near-cache of 10 s entries holding RENEW_DEAL: one unit, sold to buyer 1."""
    await _sold_out_deal(rds)
    cache = SoldOutCache(local_gate.redis, local_gate.runner, 10.0)
    cache.observe(RENEW_DEAL, 1)
    await _fetched(cache)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)
    try:
        yield cache
    finally:
        await cache.aclose()
        await rds.delete(deal_keys(RENEW_DEAL).meta, deal_keys(RENEW_DEAL).buyers)


async def _fetched(cache: SoldOutCache) -> None:
    task = cache._fetching.get(RENEW_DEAL)
    assert task is not None, "no fetch started"
    await task


def _age(cache: SoldOutCache, seconds: float) -> None:
    """Make the entry `seconds` older than it is."""
    until, size, buyers, most, parts = cache._entries[RENEW_DEAL]
    cache._entries[RENEW_DEAL] = (until - seconds, size, buyers, most, parts)


async def _renewed(cache: SoldOutCache) -> None:
    task = cache._renewing.get(RENEW_DEAL)
    assert task is not None, "no renewal started"
    await task


async def _renewed_after_lapse(cache: SoldOutCache) -> None:
    """A renewal started at 70 % of the entry's life, answered after the lapse."""
    _age(cache, 7.0)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)  # starts the renewal
    _age(cache, 5.0)  # lapsed before the renewal ran
    assert not cache.sold_out_for(RENEW_DEAL, 2, 1)
    assert RENEW_DEAL not in cache._entries
    await _renewed(cache)


async def _observed(cache: SoldOutCache) -> None:
    cache.observe(RENEW_DEAL, 1)
    await _fetched(cache)


async def test_a_renewal_starts_after_forty_percent_of_the_entry_life(
    renewing: SoldOutCache,
) -> None:
    cache = renewing
    _age(cache, 3.5)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)
    assert RENEW_DEAL not in cache._renewing
    _age(cache, 1.0)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)
    before = cache._entries[RENEW_DEAL][0]
    await _renewed(cache)
    assert cache._entries[RENEW_DEAL][0] > before + 4.0


async def test_a_renewal_that_answers_after_the_lapse_puts_the_entry_back(
    renewing: SoldOutCache,
) -> None:
    """Under a sold-out flood the renewal's round trip waits behind the process's own
    requests; when it comes back after the entry lapsed, the entry is put back
    instead of every request in flight going to Redis until the next admission."""
    cache = renewing
    await _renewed_after_lapse(cache)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)
    assert not cache.sold_out_for(RENEW_DEAL, 1, 1), "a buyer goes to Redis"


async def test_a_renewal_puts_nothing_back_after_units_came_back(
    renewing: SoldOutCache, rds: aioredis.Redis
) -> None:
    cache = renewing
    # This process gave units back (a cancel) while its renewal was on its way.
    _age(cache, 7.0)
    assert cache.sold_out_for(RENEW_DEAL, 2, 1)
    cache.forget(RENEW_DEAL)
    await _renewed(cache)
    assert not cache.sold_out_for(RENEW_DEAL, 2, 1)
    # Another process gave them back: Redis shows them, the lapsed entry stays gone.
    await _observed(cache)
    await rds.hset(deal_keys(RENEW_DEAL).meta, "avail", 1)
    await _renewed_after_lapse(cache)
    assert not cache.sold_out_for(RENEW_DEAL, 2, 1)
    # A new buyer (the set grew) is not renewed either.
    await rds.hset(deal_keys(RENEW_DEAL).meta, "avail", 0)
    await _observed(cache)
    await rds.sadd(deal_keys(RENEW_DEAL).buyers, "3")
    await _renewed_after_lapse(cache)
    assert not cache.sold_out_for(RENEW_DEAL, 2, 1)


async def test_a_partitioned_deal_is_renewed_only_while_every_partition_is_sold_out(
    local_gate: Gate, rds: aioredis.Redis
) -> None:
    """A deal of two partitions (docs/scale-out.md): one renewal reads both, and a
    partition with a unit back, or a partition's buyer more, renews nothing."""
    parts = [partition_keys(RENEW_DEAL, k) for k in range(2)]
    for k, keys in enumerate(parts):
        await rds.delete(keys.meta, keys.buyers)
        await rds.hset(
            keys.meta,
            mapping={"avail": 0, "start_ms": 0, "end_ms": 0, "buyers_ok": 1, "max": 1, "nb": 1},
        )
        await rds.sadd(keys.buyers, str(10 + k))
    cache = SoldOutCache(local_gate.redis, local_gate.runner, 10.0)
    try:
        cache.observe(RENEW_DEAL, 2, 2)
        await _fetched(cache)
        assert cache.sold_out_for(RENEW_DEAL, 2, 1)
        assert not cache.sold_out_for(RENEW_DEAL, 11, 1), "partition 1's buyer"
        await _renewed_after_lapse(cache)
        assert cache.sold_out_for(RENEW_DEAL, 2, 1)
        await rds.hset(parts[1].meta, "avail", 1)
        await _renewed_after_lapse(cache)
        assert not cache.sold_out_for(RENEW_DEAL, 2, 1)
        await rds.hset(parts[1].meta, "avail", 0)
        cache.observe(RENEW_DEAL, 2, 2)
        await _fetched(cache)
        await rds.sadd(parts[1].buyers, "12")
        await _renewed_after_lapse(cache)
        assert not cache.sold_out_for(RENEW_DEAL, 2, 1)
    finally:
        await cache.aclose()
        for keys in parts:
            await rds.delete(keys.meta, keys.buyers)
