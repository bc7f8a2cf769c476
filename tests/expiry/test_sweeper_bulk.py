"""An operator ends 5,000 holds at once: all released, Redis restored, sellable again."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.expiry_support import holding, make_holds, wait_until
from tests.support import Client, assert_invariants, create_deal, redis_available, reserve

pytestmark = pytest.mark.slow

HOLDS = 5000


async def test_operator_moves_5000_deadlines_to_now(
    client: Client, db: Database, rds: aioredis.Redis
) -> None:
    deal_id = await create_deal(client, stock=HOLDS, buckets=16)
    orders = await make_holds(client, deal_id, HOLDS, user_base=1_000_000, concurrency=48)
    late = await reserve(client, deal_id, 1_999_999, f"bulk-{deal_id}-late")
    assert late.status_code == 409 and late.json()["code"] == "SOLD_OUT"
    assert (await redis_available(rds, deal_id))[0] == 0

    # What an operator runs by hand; the gate's own sweepers do the rest.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
        (deal_id,),
    )

    async def released() -> bool:
        return await holding(db, deal_id) == 0

    await wait_until(released, 60, "5,000 holds to be released")
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": HOLDS, "available": HOLDS, "held": 0, "sold": 0}
    assert (await redis_available(rds, deal_id))[0] == HOLDS
    assert await rds.hlen(f"{{d:{deal_id}}}:f") == 0

    rows = await db.fetchall(
        "SELECT COUNT(*), COUNT(DISTINCT l.order_id), COUNT(DISTINCT l.op_id),"
        " COALESCE(SUM(l.d_available), 0) FROM inventory_ledger l"
        " WHERE l.deal_id = %s AND l.reason = 'expire'",
        (deal_id,),
    )
    assert tuple(int(x) for x in rows[0]) == (HOLDS, HOLDS, HOLDS, HOLDS)
    row = await db.fetchone(
        "SELECT COUNT(*) FROM outbox o JOIN inventory_ledger l ON l.op_id = o.event_id"
        " WHERE l.deal_id = %s AND o.topic = 'order.expired' AND o.aggregate_id = l.order_id",
        (deal_id,),
    )
    assert row is not None and int(row[0]) == HOLDS
    assert len(set(orders)) == HOLDS

    view = (await client.get(f"/v1/deals/{deal_id}")).json()
    assert view["sold_out"] is False and view["remaining_hint"] == HOLDS
    again = await reserve(client, deal_id, 1_999_999, f"bulk-{deal_id}-again")
    assert again.status_code == 201, again.text
