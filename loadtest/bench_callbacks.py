"""Payment callback throughput: signed `payment.succeeded` webhooks, 30 % redeliveries.

Against a running gate (same environment as the gate: GATE_MYSQL_URL,
GATE_JWT_SECRET, GATE_ADMIN_TOKEN, GATE_WEBHOOK_SECRET, or GATE_ENV=dev):

    .venv/bin/python loadtest/bench_callbacks.py --gate http://127.0.0.1:8000 \\
        --orders 20000 --duplicates 0.3 --concurrency 128

Set-up (not timed): one deal with `--orders` units in 16 buckets, one held order per
buyer through the real reservation endpoint. Timed: every order gets one
`payment.succeeded` callback, and `duplicates` of all callbacks are redeliveries of
an event already in the mix (same webhook-id, same body, signed afresh as a
provider's retry is), shuffled so a copy may arrive before, with or after its
original. Each callback is signed just before it is sent. Afterwards the database
must show every order PAID exactly once, one event row per distinct event and one
`order.paid` outbox row per order, and `gate check` must pass for the deal.
Prints one JSON line with the rate and latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from typing import Any

import aiohttp
import orjson

from gate.auth import mint
from gate.check import check_deal
from gate.db import Database
from gate.payments.signing import decode_secret, sign_headers
from gate.settings import load_settings

WEBHOOK_PATH = "/v1/payments/{provider}/webhook"


async def setup(
    session: aiohttp.ClientSession, base: str, admin: str, jwt_secret: Any, orders: int, conc: int
) -> tuple[int, list[tuple[str, int, str]]]:
    body = {
        "title": "bench: callbacks",
        "unit_price": 100,
        "currency": "EUR",
        "stock": orders,
        "buckets": 16,
        "hold_seconds": 3600,
        "max_per_order": 1,
    }
    headers = {"Authorization": f"Bearer {admin}"}
    async with session.post(f"{base}/v1/admin/deals", json=body, headers=headers) as r:
        assert r.status == 201, await r.text()
        deal_id = int((await r.json())["id"])
    user_base = random.randrange(10**9, 2 * 10**9)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(orders):
        queue.put_nowait(i)
    made: list[tuple[str, int, str]] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            user = user_base + i
            token = mint(jwt_secret, user, 7200)
            for _attempt in range(20):
                async with session.post(
                    f"{base}/v1/deals/{deal_id}/reservations",
                    json={"quantity": 1},
                    headers={
                        "Authorization": f"Bearer {token}",
                        "Idempotency-Key": f"bench-cb-{deal_id}-{i:08d}",
                    },
                ) as r:
                    if r.status in (200, 201):
                        doc = await r.json()
                        made.append((doc["order_id"], int(doc["amount"]), doc["currency"]))
                        break
                    if r.status in (409, 429, 503):
                        await asyncio.sleep(0.05)
                        continue
                    raise AssertionError(f"reservation failed: {r.status} {await r.text()}")

    await asyncio.gather(*(worker() for _ in range(conc)))
    assert len(made) == orders, f"only {len(made)} of {orders} orders were reserved"
    return deal_id, made


def build(
    made: list[tuple[str, int, str]], dup_share: float, rng: random.Random
) -> tuple[list[tuple[str, bytes]], int]:
    originals = []
    run = os.urandom(4).hex()
    for n, (order_id, amount, currency) in enumerate(made):
        event_id = f"evt_bench_{run}_{n:08d}"
        body = orjson.dumps(
            {
                "id": event_id,
                "type": "payment.succeeded",
                "created": int(time.time()),
                "data": {
                    "payment_id": f"pi_bench_{run}_{n:08d}",
                    "order_id": order_id,
                    "amount": amount,
                    "currency": currency,
                },
            }
        )
        originals.append((event_id, body))
    total = round(len(originals) / (1 - dup_share)) if dup_share < 1 else len(originals)
    copies = [rng.choice(originals) for _ in range(total - len(originals))]
    mix = originals + copies
    rng.shuffle(mix)
    return mix, len(copies)


async def fire(
    session: aiohttp.ClientSession,
    url: str,
    key: bytes,
    mix: list[tuple[str, bytes]],
    conc: int,
) -> tuple[float, list[float], dict[int, int]]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(mix):
            event_id, body = mix[position]
            position += 1
            headers = sign_headers([key], event_id, int(time.time()), body)
            headers["Content-Type"] = "application/json"
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - started, latencies, statuses


async def verify(db: Database, deal_id: int, orders: int, distinct: int) -> dict[str, Any]:
    paid = await db.fetchone(
        "SELECT COUNT(*), COALESCE(SUM(paid_amount = amount), 0) FROM orders"
        " WHERE deal_id = %s AND status = 'PAID'",
        (deal_id,),
    )
    events = await db.fetchone(
        "SELECT COUNT(*) FROM payment_events e JOIN orders o ON o.id = e.order_id"
        " WHERE o.deal_id = %s",
        (deal_id,),
    )
    outbox = await db.fetchone(
        "SELECT COUNT(*) FROM outbox x JOIN orders o ON o.id = x.aggregate_id"
        " WHERE o.deal_id = %s AND x.topic = 'order.paid'",
        (deal_id,),
    )
    report = await check_deal(db, None, deal_id)
    assert paid is not None and events is not None and outbox is not None
    result = {
        "paid_orders": int(paid[0]),
        "paid_exactly_once": int(paid[1]),
        "event_rows": int(events[0]),
        "outbox_paid_rows": int(outbox[0]),
        "invariant_ok": bool(report["invariant"]["ok"]),
    }
    result["ok"] = (
        result["paid_orders"] == orders
        and result["paid_exactly_once"] == orders
        and result["event_rows"] == distinct
        and result["outbox_paid_rows"] == orders
        and result["invariant_ok"]
    )
    return result


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gate", default="http://127.0.0.1:8000")
    p.add_argument("--provider", default="sandbox")
    p.add_argument("--orders", type=int, default=20_000)
    p.add_argument("--duplicates", type=float, default=0.3)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a short run (500 orders)")
    args = p.parse_args(argv)
    if args.smoke:
        args.orders = min(args.orders, 500)
    if not 0 <= args.duplicates < 1 or not 1 <= args.orders <= 1_000_000:
        p.error("--duplicates in [0, 1), --orders in 1..1,000,000")
    settings = load_settings()
    key = decode_secret(settings.webhook_secrets[0].reveal())
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        deal_id, made = await setup(
            session,
            args.gate,
            settings.admin_token.reveal(),
            settings.jwt_secret,
            args.orders,
            args.concurrency,
        )
        mix, dups = build(made, args.duplicates, rng)
        url = args.gate + WEBHOOK_PATH.format(provider=args.provider)
        seconds, latencies, statuses = await fire(session, url, key, mix, args.concurrency)
    db = Database(settings, pool_max=4)
    await db.start()
    try:
        checked = await verify(db, deal_id, len(made), len(made))
    finally:
        await db.close()
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    result = {
        "bench": "callbacks",
        "deal_id": deal_id,
        "callbacks": len(mix),
        "duplicates": dups,
        "duplicate_share": round(dups / len(mix), 3),
        "concurrency": args.concurrency,
        "seconds": round(seconds, 3),
        "callbacks_per_second": round(len(mix) / seconds, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "statuses": {str(k): v for k, v in statuses.items()},
        "verified": checked,
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0 if checked["ok"] and set(statuses) == {200} else 1


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        raise SystemExit(asyncio.run(main())) from None
    raise SystemExit(uvloop.run(main()))
