"""Gate on Redis Cluster against Gate on standalone Redis, on this machine.

    python -m loadtest.bench_cluster [--rounds 3] [--seconds 5] [--connections 64]

Starts a local Redis Cluster (3 primaries, 3 replicas; tests/cluster.py, ports
--cluster-port..+5), and two `gate serve --workers 2` on one MariaDB schema each:
one on the standalone Redis database --redis-url (flushed), one on the cluster.
Rounds alternate A/B on a fresh 16-bucket deal of each (committed reservations/s,
p99, gate CPU µs per commit), then the cluster gate is driven by 32 buyers while the
primary of its deal's slot is SIGKILLed: the unavailability is the longest time
between two 201s around the kill. Prints one JSON document (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gate.store.keys import deal_keys
from loadtest import procs, wrkrun
from loadtest.tokens import TokenMint, write_token_file
from tests.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
GATE_BIN = str(Path(sys.executable).with_name("gate"))
BIG_STOCK = 50_000_000
BUYERS = 20_000
FAILOVER_BUYERS = 32


def _env(mysql: str, redis_url: str, jwt: str, admin: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
    env.update(
        {
            "GATE_ENV": "bench",
            "GATE_MYSQL_URL": mysql,
            "GATE_REDIS_URL": redis_url,
            "GATE_JWT_SECRET": jwt,
            "GATE_ADMIN_TOKEN": admin,
            "GATE_WEBHOOK_SECRET": "whsec_"
            + __import__("base64").b64encode(secrets.token_bytes(24)).decode(),
            "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
            "GATE_PAYMENT_PROVIDER": "sandbox",
            "GATE_LOG_LEVEL": "WARNING",
            "GATE_DB_POOL_MAX": "16",
            "PYTHONPATH": str(ROOT),
            **{f"GATE_LIMIT_{n}": "off" for n in ("DEAL", "USER", "IP", "DEVICE", "GLOBAL")},
        }
    )
    return env


def _migrate(mysql: str) -> None:
    from gate.base.settings import MysqlTarget
    from gate.store.migrate import migrate

    async def go() -> None:
        import aiomysql

        from gate.store.db import connect_kwargs, notes_off

        target = MysqlTarget.parse(mysql)
        conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
        try:
            async with conn.cursor() as cur:
                await notes_off(cur)
                await cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
        finally:
            conn.close()
        await migrate(target)

    asyncio.run(go())


def _create_deal(url: str, admin: str) -> int:
    import urllib.request

    body = orjson.dumps(
        {
            "title": "bench",
            "unit_price": 100,
            "currency": "EUR",
            "stock": BIG_STOCK,
            "buckets": 16,
            "per_user_limit": None,
            "max_per_order": 1,
        }
    )
    req = urllib.request.Request(
        url + "/v1/admin/deals",
        data=body,
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(orjson.loads(resp.read())["id"])


def _orders(mysql: str, deal_id: int) -> int:
    import pymysql

    from gate.base.settings import MysqlTarget

    t = MysqlTarget.parse(mysql)
    conn = pymysql.connect(
        host=t.host, port=t.port, user=t.user, password=t.password.reveal(), database=t.database
    )
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def _round(
    server: procs.Server, mysql: str, deal: int, tokens: Path, conns: int, seconds: float
) -> dict[str, Any]:
    pids = server.pids()
    before_orders = _orders(mysql, deal)
    before_cpu = procs.cpu_seconds(pids)
    result = wrkrun.reserve_loop(server.url, deal, tokens, "cb", conns, seconds)
    cpu = procs.cpu_seconds(pids) - before_cpu
    committed = _orders(mysql, deal) - before_orders
    return {
        "committed_per_s": round(committed / result.duration_s, 1),
        "p99_ms": round(result.latency_us.get("p99", 0.0) / 1000, 2),
        "cpu_us_per_commit": round(cpu * 1e6 / max(1, committed), 1),
        "status": {str(k): v for k, v in sorted(result.status.items())},
    }


async def _failover(
    server: procs.Server, cluster: LocalCluster, deal: int, jwt: str
) -> dict[str, Any]:
    mint = TokenMint(jwt, 3600)
    events: list[tuple[float, int]] = []
    stop = asyncio.Event()
    port = cluster.primary_port_of(deal_keys(deal).meta)

    async def buyer(session: aiohttp.ClientSession, worker: int) -> None:
        i = 0
        while not stop.is_set():
            user = 900_000 + worker * 10_000 + i
            headers = {
                "Authorization": mint.header(user),
                "Idempotency-Key": f"fo-{deal}-{worker}-{i:06d}",
                "Content-Type": "application/json",
            }
            try:
                async with session.post(
                    f"{server.url}/v1/deals/{deal}/reservations",
                    data=b'{"quantity":1}',
                    headers=headers,
                ) as r:
                    await r.read()
                    events.append((time.monotonic(), r.status))
            except aiohttp.ClientError:
                events.append((time.monotonic(), 0))
            i += 1
            if events and events[-1][1] != 201:
                await asyncio.sleep(0.01)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        tasks = [asyncio.create_task(buyer(session, w)) for w in range(FAILOVER_BUYERS)]
        await asyncio.sleep(3)
        killed_at = time.monotonic()
        cluster.kill(port)
        await asyncio.to_thread(cluster.wait_promoted, port)
        promoted_at = time.monotonic()
        await asyncio.sleep(5)
        stop.set()
        await asyncio.gather(*tasks)
    ok = sorted(t for t, s in events if s == 201)
    before = [t for t in ok if t <= killed_at]
    after = [t for t in ok if t > killed_at]
    # The longest stretch without a 201 from the last one before the kill on.
    marks = [before[-1] if before else killed_at, *after]
    gap = max((b - a for a, b in itertools.pairwise(marks)), default=float("inf"))
    statuses: dict[str, int] = {}
    for _, s in events:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    return {
        "killed_primary_port": port,
        "unavailable_s": round(gap, 2),
        "cluster_ok_after_s": round(promoted_at - killed_at, 2),
        "status": statuses,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--cluster-port", type=int, default=18540)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/6")
    ap.add_argument("--mysql-server", default="mysql://root@127.0.0.1:3306")
    ap.add_argument("--db-prefix", default="gate_test_cluster_bench")
    ap.add_argument("--no-failover", action="store_true")
    args = ap.parse_args()

    import redis

    jwt = "bench-jwt-" + secrets.token_hex(24)
    admin = "bench-admin-" + secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="gate-bench-cluster-"))
    tokens = work / "tokens.txt"
    write_token_file(tokens, jwt, range(100_000, 100_000 + BUYERS), 3600)
    cluster = LocalCluster(args.cluster_port).start()
    servers: dict[str, procs.Server] = {}
    out: dict[str, Any] = {"rounds": [], "plan": vars(args)}
    try:
        with redis.Redis.from_url(args.redis_url) as r:
            r.flushdb()
        urls = {"standalone": args.redis_url, "cluster": cluster.url}
        mysql = {k: f"{args.mysql_server}/{args.db_prefix}_{k[0]}" for k in urls}
        for name, redis_url in urls.items():
            _migrate(mysql[name])
            port = procs.free_port()
            servers[name] = procs.Server(
                name,
                [GATE_BIN, "serve", "--port", str(port), "--workers", "2"],
                _env(mysql[name], redis_url, jwt, admin),
                port,
                work / f"{name}.log",
                ROOT,
            )
        for s in servers.values():
            s.wait_ready("/readyz")
        deals = {k: _create_deal(s.url, admin) for k, s in servers.items()}
        for name, s in servers.items():  # warm-up
            wrkrun.reserve_loop(s.url, deals[name], tokens, "w", args.connections, 2)
        for i in range(args.rounds):
            order = ["standalone", "cluster"] if i % 2 == 0 else ["cluster", "standalone"]
            for name in order:
                res = _round(
                    servers[name], mysql[name], deals[name], tokens, args.connections, args.seconds
                )
                out["rounds"].append({"round": i, "redis": name, **res})
                print(name, res, file=sys.stderr)
        summary: dict[str, Any] = {}
        for name in urls:
            rows = [r for r in out["rounds"] if r["redis"] == name]
            summary[name] = {
                k: statistics.median(r[k] for r in rows)
                for k in ("committed_per_s", "p99_ms", "cpu_us_per_commit")
            }
        ratios = [
            c["committed_per_s"] / s["committed_per_s"]
            for s, c in zip(
                [r for r in out["rounds"] if r["redis"] == "standalone"],
                [r for r in out["rounds"] if r["redis"] == "cluster"],
                strict=True,
            )
        ]
        summary["cluster_over_standalone_per_round"] = [round(x, 3) for x in ratios]
        summary["cluster_over_standalone_median"] = round(statistics.median(ratios), 3)
        out["summary"] = summary
        if not args.no_failover:
            out["failover"] = asyncio.run(
                _failover(servers["cluster"], cluster, deals["cluster"], jwt)
            )
    finally:
        for s in servers.values():
            s.stop()
        cluster.stop()
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
