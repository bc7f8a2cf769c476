"""The Redis mirror: exact under live traffic, repaired after lost writes and failovers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.codes import SyncCode
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import ACTIVE_DEALS, deal_keys
from tests.support import (
    Client,
    Traffic,
    assert_invariants,
    create_deal,
    db_available,
    reserve,
)


async def test_resync_is_exact_under_live_traffic(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """Passes racing reservations, confirmations and cancels never "repair" anything."""
    deal_id = await create_deal(client, stock=300, buckets=4, max_per_order=2)
    traffic = Traffic(client, deal_id, 700_000, seed=3)
    traffic.start(buyers=6)
    outcomes: list[SyncCode] = []
    try:
        for _ in range(60):
            result = await local_gate.mirror.resync(deal_id)
            assert result is not None
            outcomes.append(result[0])
            if result[0] == SyncCode.APPLIED:
                pytest.fail(f"a pass under live traffic changed Redis: {result[1]}")
            await asyncio.sleep(0.01)
    finally:
        await traffic.finish()
    assert outcomes.count(SyncCode.IN_SYNC) >= 55, outcomes
    await assert_invariants(db, rds, deal_id)


@pytest.mark.parametrize("delta", [-3, 5])
async def test_lost_write_is_repaired_by_the_resync_loop(
    client: Client, db: Database, rds: aioredis.Redis, delta: int
) -> None:
    deal_id = await create_deal(client, stock=20, buckets=2)
    for i in range(4):
        assert (
            await reserve(client, deal_id, 710_000 + i, f"lost-{deal_id}-{i}")
        ).status_code == 201
    keys = deal_keys(deal_id)
    # A write Redis lost (or one it never should have had): bucket and total drift.
    await rds.hincrby(keys.buckets, "1", delta)
    await rds.hincrby(keys.meta, "avail", delta)
    await assert_invariants(db, rds, deal_id, timeout_seconds=5)


async def test_a_stale_bucket_layout_is_rebuilt_and_counted_as_a_repair(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """Redis holds another bucket count (a rebucketing whose Redis refresh failed):
    the resync rebuilds the layout and says it repaired something."""
    deal_id = await create_deal(client, stock=12, buckets=4)
    assert (await reserve(client, deal_id, 715_000, f"layout-{deal_id}")).status_code == 201
    keys = deal_keys(deal_id)
    results = []
    # The shared gate's own resync loop may get there first: then try again.
    for _ in range(5):
        await rds.hset(keys.meta, "nb", "3")
        await rds.hdel(keys.buckets, "3")
        results.append(await local_gate.mirror.resync(deal_id))
        if results[-1] == (SyncCode.APPLIED, "layout"):
            break
    assert results[-1] == (SyncCode.APPLIED, "layout"), results
    assert await rds.hget(keys.meta, "nb") == "4"
    await assert_invariants(db, rds, deal_id)


async def test_failover_to_a_stale_replica_converges(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=30, buckets=3)
    keys = deal_keys(deal_id)
    names = [keys.meta, keys.buckets, keys.users, keys.inflight, keys.inflight_times, keys.resolved]
    for i in range(5):
        assert (
            await reserve(client, deal_id, 720_000 + i, f"stale-{deal_id}-{i}")
        ).status_code == 201
    # What a replica lagging behind would hold...
    dumps = {n: await rds.dump(n) for n in names}
    sold = await asyncio.gather(
        *(reserve(client, deal_id, 721_000 + i, f"stale2-{deal_id}-{i}") for i in range(10))
    )
    assert sum(r.status_code == 201 for r in sold) == 10
    # ...is what the gate finds after a failover: 10 sales forgotten.
    for n, blob in dumps.items():
        await rds.delete(n)
        if blob is not None:
            await rds.restore(n, 0, blob)
    # (Redis now says 25 left while the database has 15, until the resync loop runs.)
    await assert_invariants(db, rds, deal_id, timeout_seconds=5)
    assert sum((await db_available(db, deal_id)).values()) == 15
    rest = await asyncio.gather(
        *(reserve(client, deal_id, 722_000 + i, f"stale3-{deal_id}-{i}") for i in range(40))
    )
    assert sum(r.status_code == 201 for r in rest) == 15
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 30, "available": 0, "held": 30, "sold": 0}


async def test_confirmations_asked_together_answer_each_as_one_at_a_time(
    rds: aioredis.Redis, local_gate: Gate
) -> None:
    """Confirmations of one deal asked in the same loop turn go to Redis as one
    confirm_many call; each caller gets what confirm.lua alone would have answered, and
    Redis ends exactly where confirming them one at a time leaves it."""
    mirror = local_gate.mirror
    # Deal ids of no real deal: the scripts touch only these keys.
    together, alone = 990_000_001, 990_000_002
    tokens = [("tok-a", "0:1", "0:1"), ("tok-b", "1:2", "3:2"), ("tok-gone", "2:1", "2:1")]

    async def prepare(deal_id: int) -> None:
        keys = deal_keys(deal_id)
        await rds.hset(keys.meta, mapping={"nb": 4})
        await rds.hset(keys.buckets, mapping={"0": 10, "1": 10, "2": 10, "3": 10})
        for i, (token, redis_alloc, _) in enumerate(tokens):
            if token == "tok-gone":
                continue  # the janitor resolved it first
            qty = redis_alloc.split(":")[1]
            record = f"T|{800_000 + i}|{qty}|{redis_alloc}|1|key-{i}|fp-{i}|owner"
            await rds.hset(keys.inflight, token, record)
            await rds.zadd(keys.inflight_times, {token: 1})

    def confirm(deal_id: int, i: int) -> Any:
        token, _, committed = tokens[i]
        return mirror.confirm(
            deal_keys(deal_id), 800_000 + i, f"key-{i}", token, f"fp-{i}", committed
        )

    async def state(deal_id: int) -> dict[str, Any]:
        keys = deal_keys(deal_id)
        resolved = await rds.zrange(keys.resolved, 0, -1)
        return {
            "buckets": await rds.hgetall(keys.buckets),
            "inflight": await rds.hgetall(keys.inflight),
            "times": await rds.zrange(keys.inflight_times, 0, -1),
            "resolved": sorted(resolved),
            "keys": [await rds.get(keys.idempotency(800_000 + i, f"key-{i}")) for i in range(3)],
            "ttls": [
                await rds.ttl(keys.idempotency(800_000 + i, f"key-{i}")) > 0 for i in range(3)
            ],
        }

    try:
        for deal_id in (together, alone):
            await prepare(deal_id)
        answers_together = await asyncio.gather(*(confirm(together, i) for i in range(3)))
        answers_alone = [await confirm(alone, i) for i in range(3)]
        assert answers_together == answers_alone == [True, True, False]
        got, want = await state(together), await state(alone)
        assert got == want
        # What confirming means: the tokens are retired, the done records point at the
        # orders, and the units the database took from bucket 3 instead of 1 moved.
        assert got["inflight"] == {} and got["times"] == []
        assert got["keys"] == ["D|fp-0|tok-a", "D|fp-1|tok-b", "D|fp-2|tok-gone"]
        assert got["buckets"] == {"0": "10", "1": "12", "2": "10", "3": "8"}
        assert got["resolved"] == ["tok-a|C|800000|1|0:1", "tok-b|C|800001|2|3:2"]
    finally:
        for deal_id in (together, alone):
            keys = deal_keys(deal_id)
            await rds.delete(
                keys.meta,
                keys.buckets,
                keys.inflight,
                keys.inflight_times,
                keys.resolved,
                *(keys.idempotency(800_000 + i, f"key-{i}") for i in range(3)),
            )


async def test_the_resync_loop_rests_quiet_deals_and_wakes_them_on_any_move(
    client: Client, db: Database, rds: aioredis.Redis, local_gate: Gate
) -> None:
    """Every deal ever loaded stays active; the loop's passes skip a deal whose Redis
    state has not moved for a minute, but sync it every GATE_RESYNC_QUIET_SECONDS
    (15), at once when its state moves (a lost write), and all deals again on
    another Redis server (gate/inventory/resync.py). A clock of the test's own."""
    from gate.inventory.resync import RESYNC_QUIET_AFTER_SECONDS

    deal_id = await create_deal(client, stock=10, buckets=2)
    assert (await reserve(client, deal_id, 730_000, f"quiet-deal-{deal_id}")).status_code == 201
    resync = local_gate.resync
    if local_gate.mirror.runner.cluster:
        # On a cluster every deal is synced every pass: the loop's pass skips none.
        before = _quiet_skips()
        await resync.run_once(rest_quiet=True)
        await resync.run_once(rest_quiet=True)
        assert _quiet_skips() == before
        return
    now = [1_000.0]
    resync.clock = lambda: now[0]
    quiet_every = local_gate.settings.resync_quiet_seconds
    assert quiet_every == 15

    async def quiet() -> bool:
        return resync._quiet(deal_id, (await resync._looks([deal_id]))[deal_id])

    async def passes_it() -> bool:
        """One loop decision for the deal (the loop syncs it when False)."""
        if await quiet():
            return True
        resync._synced(deal_id)
        return False

    assert not await passes_it()  # first seen
    now[0] += RESYNC_QUIET_AFTER_SECONDS / 2
    assert not await passes_it()  # unmoved, but not for a minute yet
    now[0] += RESYNC_QUIET_AFTER_SECONDS / 2 + 1
    assert not await passes_it()  # quiet now, last synced 31 s ago: due
    now[0] += 1
    assert await passes_it()  # quiet, synced a second ago: skipped
    now[0] += quiet_every - 2
    assert await passes_it()
    now[0] += 2
    assert not await passes_it()  # GATE_RESYNC_QUIET_SECONDS since the last sync

    # A write Redis lost: the state moved, so the next pass syncs and repairs it.
    # (Out of the active set meanwhile, so that the shared gate's loop, which has the
    # same repair to make, does not make it first.)
    now[0] += 1
    assert await passes_it()
    await rds.srem(ACTIVE_DEALS, deal_id)
    await asyncio.sleep(0.3)  # a pass that listed the deal before is over
    await rds.hincrby(deal_keys(deal_id).meta, "avail", 3)
    await rds.hincrby(deal_keys(deal_id).buckets, "0", 3)
    assert not await quiet()
    result = await local_gate.mirror.resync(deal_id)
    assert result is not None and result[0] == SyncCode.APPLIED, result
    resync._synced(deal_id)
    await assert_invariants(db, rds, deal_id, timeout_seconds=5)

    # Quiet again, then another Redis server (a failover, a restart): due at once.
    assert not await passes_it()  # the repair moved the look: synced once more
    now[0] += RESYNC_QUIET_AFTER_SECONDS + 1
    assert not await passes_it()
    now[0] += 1
    assert await passes_it()
    resync._server = "another-server"
    await resync._same_server()
    assert not await quiet()

    # The loop's own pass counts what it skipped; `run_once` alone skips nothing.
    resync._synced(deal_id)
    now[0] += RESYNC_QUIET_AFTER_SECONDS + 1
    resync._synced(deal_id)
    now[0] += 1
    before = _quiet_skips()
    await resync.run_once()
    assert _quiet_skips() == before
    await resync.run_once(rest_quiet=True)
    assert _quiet_skips() >= before + 1


async def test_the_resync_loop_paces_a_deal_with_many_in_flight_markers(
    client: Client, local_gate: Gate
) -> None:
    """A sync walks every in-flight marker inside one script, so the loop syncs a deal
    with N > RESYNC_MARKERS_PER_SECOND markers (a deep queue) at most every
    N / RESYNC_MARKERS_PER_SECOND seconds, at least every RESYNC_PACE_MAX_SECONDS;
    fewer markers never pace it (gate/inventory/resync.py), on one Redis and on a cluster. The
    deal's real look, with the marker count set in it; a clock of the test's own."""
    from gate.inventory.resync import RESYNC_MARKERS_PER_SECOND, RESYNC_PACE_MAX_SECONDS

    deal_id = await create_deal(client, stock=10, buckets=2)
    assert (await reserve(client, deal_id, 731_000, f"paced-deal-{deal_id}")).status_code == 201
    resync = local_gate.resync
    now = [5_000.0]
    resync.clock = lambda: now[0]
    look = (await resync._looks([deal_id]))[deal_id]

    def with_markers(n: int) -> tuple[Any, ...]:
        return (*look[:3], n, look[4])

    deep = 5 * RESYNC_MARKERS_PER_SECOND  # every 5 s
    assert not resync._paced(deal_id, with_markers(deep))  # never seen: synced
    assert not resync._quiet(deal_id, with_markers(deep))
    resync._synced(deal_id)
    now[0] += 1
    assert resync._paced(deal_id, with_markers(deep))
    assert not resync._paced(deal_id, with_markers(RESYNC_MARKERS_PER_SECOND))  # not many
    now[0] += 3.9
    assert resync._paced(deal_id, with_markers(deep))
    now[0] += 0.2
    assert not resync._paced(deal_id, with_markers(deep))  # 5 s since its last sync
    # The pause is bounded whatever the count.
    assert resync._paced(deal_id, with_markers(10**9))
    now[0] += RESYNC_PACE_MAX_SECONDS
    assert not resync._paced(deal_id, with_markers(10**9))


def _quiet_skips() -> float:
    from gate.base.metrics import METRICS, sample_values, value_of

    return value_of(sample_values(METRICS.render().decode()), "gate_resync_quiet_skips_total")
