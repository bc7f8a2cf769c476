"""A sweeper killed between a release's commit and its Redis update.

The victim `gate sweep` talks to Redis through a proxy that holds back, for ever,
its first command updating Redis counters for the deal (apply.lua names the deal's
resolved log `{d:ID}:done`; intend.lua does not). The test holds the deal's bucket
rows locked while the holds fall due, so the victim takes holds, records its intents
and waits inside its transaction; then it lets the transaction commit, sees the
release in the ledger while Redis still lacks it, and SIGKILLs the victim. The
janitor must then apply the victim's intents, exactly once: Redis equals the
database afterwards.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.expiry_support import (
    TcpProxy,
    holding,
    make_holds,
    redis_target,
    run_gate,
    wait_until,
)
from tests.support import (
    Client,
    GateCommand,
    assert_invariants,
    create_deal,
    db_available,
    locked_buckets,
    redis_available,
)

pytestmark = pytest.mark.slow

HOLDS = 40


async def _ledgered(db: Database, ids: set[str]) -> set[str]:
    if not ids:
        return set()
    marks = ",".join(["%s"] * len(ids))
    rows = await db.fetchall(
        f"SELECT DISTINCT op_id FROM inventory_ledger WHERE op_id IN ({marks})", tuple(ids)
    )
    return {str(r[0]) for r in rows}


async def test_janitor_applies_the_releases_of_a_sweeper_killed_after_its_commit(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=HOLDS, buckets=4)
    await make_holds(client, deal_id, HOLDS, user_base=1_100_000)
    keys = deal_keys(deal_id)
    host, port, db_path = redis_target(env["GATE_REDIS_URL"])
    proxy = TcpProxy(host, port, hold=keys.resolved.encode())
    proxy_port = await proxy.start()
    victim_env = {
        **env,
        "GATE_REDIS_URL": f"redis://127.0.0.1:{proxy_port}{db_path}",
        # Long bounds: the victim must still be waiting when it is killed, not
        # giving up on its own.
        "GATE_DB_LOCK_WAIT_SECONDS": "60",
        "GATE_REDIS_TIMEOUT_SECONDS": "60",
        "GATE_INFLIGHT_MAX_SECONDS": "300",
        "GATE_SWEEP_BATCH_TIMEOUT_SECONDS": "120",
        "GATE_SWEEP_INTERVAL_SECONDS": "0.02",
    }
    victim = GateCommand(victim_env, "sweep")
    try:
        async with locked_buckets(settings, deal_id):
            await db.execute("UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s", (deal_id,))

            # The victim holds some of the due holds (the shared gate's sweepers may
            # hold others; they give up at their own, shorter lock-wait timeout).
            async def victim_waits() -> bool:
                assert victim.alive(), victim.output()[-2000:]
                pending = {str(k) for k in await rds.hkeys(keys.inflight)}
                return bool(proxy.intent_ids() & pending)

            await wait_until(victim_waits, 60, "the victim to record its intents")
        # The lock is gone: the victim's transaction commits, its Redis update is held.
        mine = proxy.intent_ids() & {str(k) for k in await rds.hkeys(keys.inflight)}
        assert mine

        async def victim_committed() -> bool:
            return await _ledgered(db, mine) == mine

        await wait_until(victim_committed, 30, "the victim's release to commit")

        async def update_held() -> bool:
            return proxy.held > 0

        await wait_until(update_held, 30, "the victim's Redis update to be held")
        victim.kill()
    finally:
        victim.stop()
        await proxy.close()

    # Committed in the database, not applied in Redis: the intents are still there.
    pending = {str(k) for k in await rds.hkeys(keys.inflight)}
    assert mine <= pending
    released_units = len(mine)  # one unit per hold
    db_avail = sum((await db_available(db, deal_id)).values())
    redis_avail = (await redis_available(rds, deal_id))[0]
    assert redis_avail is not None and redis_avail <= db_avail - released_units

    # The shared gate's sweepers release whatever the victim did not hold.
    async def all_released() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(all_released, 30, "every hold to be released")

    # The janitor (the shared gate's, or this one with a short orphan age) applies
    # the dead sweeper's intents exactly once.
    janitor_env = {
        **env,
        "GATE_DB_LOCK_WAIT_SECONDS": "1",
        "GATE_RESERVATION_DB_TIMEOUT_SECONDS": "1",
        "GATE_REDIS_TIMEOUT_SECONDS": "0.5",
        "GATE_INFLIGHT_MAX_SECONDS": "3.5",
    }
    deadline = time.monotonic() + 30
    while await rds.hlen(keys.inflight) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        run_gate(janitor_env, "janitor", "--once")
    assert await rds.hlen(keys.inflight) == 0
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": HOLDS, "available": HOLDS, "held": 0, "sold": 0}
    assert (await redis_available(rds, deal_id))[0] == HOLDS
