"""Outbound webhooks under a sale: events delivered per second to a local receiver,
and the sale's commits per second with and without an endpoint (docs/webhooks.md,
"Throughput").

    .venv/bin/python -m loadtest bench-webhooks [--orders 20000] [--workers 2]

It drops and migrates the database `--mysql-url` names (default `gate_wh_bench`),
flushes the Redis database `--redis-url` names (default DB 13), starts a receiver
(aiohttp, 127.0.0.1, answers 204 at once, listed in GATE_WEBHOOK_ALLOWED_HOSTS) and
`gate serve --workers N` with fresh secrets and the rate limits off. Then twice, first
without an endpoint, then with one subscribed to every event:

- Timed sale: a deal of `--orders` units; `--orders` buyers reserve one unit each
  (`--connections` at once), then cancel it. Reported: reservations and cancels
  committed per second. Each cancel is an `order.cancelled` event (plus the deal's
  sold-out edges).
- With the endpoint: from the sale's start until the receiver has every cancel's
  event, the events delivered per second (distinct webhook-ids answered 2xx over the
  time from the first delivery to the last), and how long after the sale's end the
  last one arrived. Checked: every cancelled order's event arrived, verified with the
  endpoint's secret (one in 100, to keep the receiver cheap), and nothing is left
  pending. During a sale the deliveries can go no faster than the sale makes events.
- Backlog: every delivery of that sale made due again at once (what a retry of each
  does), then the time until the receiver has them all again: the events per second
  the delivery loop sends when it has a backlog, its capacity.
- The endpoint deleted, a third sale without one: the sale without an endpoint is
  reported for the first and the last sale (the tables grow from sale to sale).

Prints one JSON object. The machine is shared with whatever else runs: measure on a
quiet one, several times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gate.base.settings import MysqlTarget, Secret  # noqa: E402
from gate.base.standard_webhooks import new_secret  # noqa: E402
from gate.web.auth import mint  # noqa: E402
from loadtest import procs  # noqa: E402
from loadtest.bench_callbacks import reset_stores  # noqa: E402

GATE_BIN = str(Path(sys.executable).with_name("gate"))
LIMIT_VARS = ("DEAL", "USER", "IP", "DEVICE", "GLOBAL")


def say(text: str) -> None:
    print(f"bench-webhooks: {text}", file=sys.stderr, flush=True)


class Sink:
    """The shop's receiver: counts each webhook-id answered, when."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.bodies: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.requests = 0
        self.last = 0.0
        self.port = procs.free_port()
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests += 1
        self.last = time.monotonic()
        msg_id = request.headers.get("webhook-id", "")
        if msg_id not in self.first:
            self.first[msg_id] = time.monotonic()
            if len(self.first) % 100 == 1:
                self.bodies[msg_id] = (body, dict(request.headers))
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hooks", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, backlog=1024).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def sale(
    session: aiohttp.ClientSession, base: str, admin: str, jwt: str, orders: int, conns: int
) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {admin}"}
    async with session.post(
        base + "/v1/admin/deals",
        json={
            "title": "bench: webhooks",
            "unit_price": 100,
            "currency": "EUR",
            "stock": orders,
            "buckets": 16,
        },
        headers=auth,
    ) as r:
        assert r.status == 201, await r.text()
        deal_id = (await r.json())["id"]
    users = [10_000_000 + deal_id * 1_000_000 + i for i in range(orders)]
    tokens = {u: mint(Secret(jwt), u, 3600) for u in users}
    made: list[tuple[int, str]] = []
    limit = asyncio.Semaphore(conns)

    async def reserve(user: int) -> None:
        async with (
            limit,
            session.post(
                f"{base}/v1/deals/{deal_id}/reservations",
                json={"quantity": 1},
                headers={
                    "Authorization": f"Bearer {tokens[user]}",
                    "Idempotency-Key": f"wh-{user}",
                },
            ) as r,
        ):
            if r.status == 201:
                made.append((user, (await r.json())["order_id"]))

    cancelled: list[str] = []

    async def cancel(user: int, order_id: str) -> None:
        async with (
            limit,
            session.post(
                f"{base}/v1/orders/{order_id}/cancel",
                headers={"Authorization": f"Bearer {tokens[user]}"},
            ) as r,
        ):
            if r.status == 200:
                cancelled.append(order_id)

    start = time.monotonic()
    await asyncio.gather(*(reserve(u) for u in users))
    reserved_at = time.monotonic()
    await asyncio.gather(*(cancel(u, o) for u, o in made))
    end = time.monotonic()
    return {
        "deal_id": deal_id,
        "reserved": len(made),
        "cancelled": cancelled,
        "reservations_per_second": round(len(made) / max(reserved_at - start, 1e-9), 1),
        "cancels_per_second": round(len(cancelled) / max(end - reserved_at, 1e-9), 1),
        "commits_per_second": round((len(made) + len(cancelled)) / max(end - start, 1e-9), 1),
        "start": start,
        "end": end,
    }


async def measure(args: argparse.Namespace, base: str, env: dict[str, str]) -> dict[str, Any]:
    from standardwebhooks.webhooks import Webhook

    admin, jwt = env["GATE_ADMIN_TOKEN"], env["GATE_JWT_SECRET"]
    sink = Sink()
    await sink.start()
    connector = aiohttp.TCPConnector(limit=args.connections)
    result: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            say(f"sale without an endpoint ({args.orders} orders)")
            plain = await sale(session, base, admin, jwt, args.orders, args.connections)
            async with session.post(
                base + "/v1/admin/webhook-endpoints",
                json={"url": f"http://127.0.0.1:{sink.port}/hooks", "events": ["*"]},
                headers={"Authorization": f"Bearer {admin}"},
            ) as r:
                assert r.status == 201, await r.text()
                secret = (await r.json())["secret"]
            say("sale with an endpoint subscribed to every event")
            hooked = await sale(session, base, admin, jwt, args.orders, args.connections)
            deadline = time.monotonic() + args.drain_seconds
            while time.monotonic() < deadline:
                if await asyncio.to_thread(_all_delivered, args.mysql_url):
                    break
                await asyncio.sleep(0.2)
            times = sorted(sink.first.values())
            delivered = len(times)
            span = (times[-1] - times[0]) if delivered > 1 else 0.0
            hook: Any = Webhook(secret)
            for body, headers in sink.bodies.values():
                hook.verify(body, headers)
            result["with_endpoint"] = {
                k: hooked[k]
                for k in ("reservations_per_second", "cancels_per_second", "commits_per_second")
            }
            result["events_delivered"] = delivered
            result["events_delivered_per_second"] = round(delivered / span, 1) if span else None
            result["last_event_after_sale_seconds"] = (
                round(times[-1] - hooked["end"], 2) if times else None
            )
            result["requests"] = sink.requests
            result["signatures_checked"] = len(sink.bodies)
            say("backlog: every delivery of that sale due again at once")
            before = sink.requests
            again = await asyncio.to_thread(_all_due_again, args.mysql_url)
            started = time.monotonic()
            deadline = started + args.drain_seconds
            while time.monotonic() < deadline:
                if sink.requests - before >= again:
                    break
                await asyncio.sleep(0.05)
            drained = sink.requests - before
            took = sink.last - started
            while time.monotonic() < deadline:
                if await asyncio.to_thread(_all_delivered, args.mysql_url):
                    break
                await asyncio.sleep(0.2)
            result["backlog"] = {
                "deliveries": again,
                "delivered": drained,
                "seconds": round(took, 2),
                "events_delivered_per_second": round(drained / took, 1) if took > 0 else None,
            }
            result["every_cancel_delivered"] = await asyncio.to_thread(
                _all_delivered, args.mysql_url
            )
            async with session.get(
                base + "/v1/admin/webhook-endpoints", headers={"Authorization": f"Bearer {admin}"}
            ) as r:
                listed = (await r.json())["endpoints"]
            for endpoint in listed:
                async with session.delete(
                    f"{base}/v1/admin/webhook-endpoints/{endpoint['id']}",
                    headers={"Authorization": f"Bearer {admin}"},
                ) as r:
                    assert r.status == 204, await r.text()
            say("the endpoint deleted: a last sale without one")
            last = await sale(session, base, admin, jwt, args.orders, args.connections)
            result["without_endpoint"] = [
                {
                    k: one[k]
                    for k in ("reservations_per_second", "cancels_per_second", "commits_per_second")
                }
                for one in (plain, last)
            ]
        finally:
            await sink.stop()
    return result


def run(args: argparse.Namespace) -> int:
    command = shlex.join(
        [Path(sys.executable).name, "-m", "loadtest", "bench-webhooks", *sys.argv[1:]]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
    env.update(
        {
            "GATE_ENV": "bench",
            "GATE_MYSQL_URL": args.mysql_url,
            "GATE_REDIS_URL": args.redis_url,
            "GATE_JWT_SECRET": "bench-jwt-" + secrets.token_hex(24),
            "GATE_ADMIN_TOKEN": "bench-admin-" + secrets.token_hex(16),
            "GATE_WEBHOOK_SECRET": new_secret(24),
            "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
            "GATE_WEBHOOK_ENCRYPTION_KEY": "bench-webhooks-" + secrets.token_hex(24),
            "GATE_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
            "GATE_PAYMENT_PROVIDER": "sandbox",
            "GATE_LOG_LEVEL": "WARNING",
            "GATE_DB_POOL_MAX": str(args.pool_max),
            **{f"GATE_LIMIT_{s}": "off" for s in LIMIT_VARS},
        }
    )
    for key, value in os.environ.items():
        if key.startswith("GATE_") and key not in ("GATE_MYSQL_URL", "GATE_REDIS_URL"):
            env.setdefault(key, value)
    say(f"resetting {MysqlTarget.parse(args.mysql_url).database} and {args.redis_url}")
    reset_stores(args.mysql_url, args.redis_url)
    subprocess.run([GATE_BIN, "migrate"], env=env, check=True, capture_output=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-wh-"))
    port = procs.free_port()
    serve = [GATE_BIN, "serve", "--port", str(port), "--workers", str(args.workers)]
    say("starting " + shlex.join(["gate", *serve[1:]]) + f" (log: {log_dir}/gate.log)")
    gate = procs.Server("gate", serve, env, port, log_dir / "gate.log", ROOT)
    try:
        gate.wait_ready("/readyz")
        result = asyncio.run(measure(args, gate.url, env))
    finally:
        gate.stop()
    result.update(
        {
            "command": command,
            "orders": args.orders,
            "workers": args.workers,
            "connections": args.connections,
            "goal": ">= 1000 events/s delivered; the sale's commits/s within noise",
        }
    )
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0 if result["every_cancel_delivered"] else 1


def _all_due_again(mysql_url: str) -> int:
    """Every delivered delivery pending and due now; how many."""
    from loadtest.bench_callbacks import connect

    conn = connect(mysql_url, with_db=True)
    try:
        with conn.cursor() as cur:
            count = cur.execute(
                "UPDATE webhook_deliveries SET status = 'pending', attempts = 0,"
                " next_attempt_at = NOW(6) WHERE status = 'delivered'"
            )
        conn.commit()
    finally:
        conn.close()
    return int(count)


def _all_delivered(mysql_url: str) -> bool:
    """Every cancel's outbox row was fanned out and its delivery delivered."""
    from loadtest.bench_callbacks import connect

    conn = connect(mysql_url, with_db=True)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT COUNT(*), COALESCE(SUM(d.status = 'delivered'), 0) FROM webhook_events e"
                " JOIN webhook_deliveries d ON d.event_row = e.id WHERE e.type = 'order.cancelled'"
            )
            events, delivered = cur.fetchone()
            cur.execute(
                "SELECT COUNT(*) FROM outbox o JOIN webhook_cursor c ON c.name = 'outbox'"
                " WHERE o.topic = 'order.cancelled' AND o.id > c.outbox_floor"
            )
            fanned = cur.fetchone()[0]
    finally:
        conn.close()
    return int(events) > 0 and int(events) == int(delivered) == int(fanned)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--orders", type=int, default=20_000, help="orders per sale (1..1,000,000)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--pool-max", type=int, default=16, help="GATE_DB_POOL_MAX per worker")
    p.add_argument("--drain-seconds", type=float, default=300, help="wait for deliveries at most")
    p.add_argument(
        "--mysql-url",
        default="mysql://root@127.0.0.1:3306/gate_wh_bench",
        help="database the gate uses (DROPPED and re-created)",
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/13", help="Redis DB (FLUSHED)")
    p.add_argument("--smoke", action="store_true", help="a short run (200 orders)")
    args = p.parse_args(argv)
    if args.smoke:
        args.orders = min(args.orders, 200)
    if not 1 <= args.orders <= 1_000_000:
        p.error("--orders in 1..1,000,000")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
