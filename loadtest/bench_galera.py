"""Gate on a 3-node MariaDB Galera cluster against Gate on one MariaDB, on this machine.

    python -m loadtest.bench_galera [--rounds 3] [--seconds 5] [--connections 64]

Starts a local Galera cluster (tests/galera.py: three mariadbd with galera-4 on
loopback, ports --galera-port, +10, +20) and one plain MariaDB started the same way
(--single-port; innodb_flush_log_at_trx_commit=1, as Gate asks of a single server;
the Galera nodes run with 2, see docs/high-availability.md), and two `gate serve
--workers 2`: one on the single server, one on GATE_MYSQL_URL naming the three
nodes, each on its own database of the standalone Redis (--redis-url, that database
and the next one; both flushed). Rounds alternate A/B on a fresh 16-bucket deal of
each (committed reservations/s, p99, gate CPU µs per commit: the same rounds as
loadtest/bench_cluster.py, driven by wrk). Then the Galera gate is driven by 32
buyers while its writer node (the first) is SIGKILLed: the unavailability is the
longest time between two 201s around the kill, and `resume_s` the time from the
kill to the first 201 of a request sent after it. Prints one JSON document
(docs/high-availability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtest import procs
from loadtest.bench_cluster import GATE_BIN, ROOT, _create_deal, _env, _migrate, _round
from loadtest.tokens import TokenMint, write_token_file
from tests.galera import LocalGalera

BUYERS = 20_000
FAILOVER_BUYERS = 32
NAMES = ("single", "galera")


async def _failover(
    server: procs.Server, cluster: LocalGalera, deal: int, jwt: str
) -> dict[str, Any]:
    """32 buyers on the Galera gate; its writer node SIGKILLed after 3 s."""
    mint = TokenMint(jwt, 3600)
    events: list[tuple[float, float, int]] = []  # (sent, answered, status)
    stop = asyncio.Event()

    async def buyer(session: aiohttp.ClientSession, worker: int) -> None:
        i = 0
        while not stop.is_set():
            headers = {
                "Authorization": mint.header(900_000 + worker * 10_000 + i),
                "Idempotency-Key": f"fo-{deal}-{worker}-{i:06d}",
                "Content-Type": "application/json",
            }
            sent, status = time.monotonic(), 0
            try:
                async with session.post(
                    f"{server.url}/v1/deals/{deal}/reservations",
                    data=b'{"quantity":1}',
                    headers=headers,
                ) as r:
                    await r.read()
                    status = r.status
            except aiohttp.ClientError:
                pass
            events.append((sent, time.monotonic(), status))
            if status == 201:
                i += 1  # a 503 or no answer: the same key again, as a buyer would
            else:
                await asyncio.sleep(0.01)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        tasks = [asyncio.create_task(buyer(session, w)) for w in range(FAILOVER_BUYERS)]
        await asyncio.sleep(3)
        await asyncio.to_thread(cluster.kill, 0)
        killed_at = time.monotonic()
        await asyncio.sleep(12)
        stop.set()
        await asyncio.gather(*tasks)
    ok = sorted(done for _, done, s in events if s == 201)
    before = [t for t in ok if t <= killed_at]
    after = [t for t in ok if t > killed_at]
    # The longest stretch without a 201 from the last one before the kill on.
    marks = [before[-1] if before else killed_at, *after]
    gap = max((b - a for a, b in itertools.pairwise(marks)), default=float("inf"))
    resumed = [done for sent, done, s in events if s == 201 and sent >= killed_at]
    statuses: dict[str, int] = {}
    for _, _, s in events:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    return {
        "killed_node": cluster.hosts[0],
        "unavailable_s": round(gap, 2),
        "resume_s": round(min(resumed) - killed_at, 2) if resumed else None,
        "status": statuses,
    }


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in NAMES:
        rows = [r for r in rounds if r["db"] == name]
        summary[name] = {
            k: statistics.median(r[k] for r in rows)
            for k in ("committed_per_s", "p99_ms", "cpu_us_per_commit")
        }
        summary[name]["committed_per_s_range"] = [
            min(r["committed_per_s"] for r in rows),
            max(r["committed_per_s"] for r in rows),
        ]
    ratios = [
        g["committed_per_s"] / s["committed_per_s"]
        for s, g in zip(
            [r for r in rounds if r["db"] == "single"],
            [r for r in rounds if r["db"] == "galera"],
            strict=True,
        )
    ]
    summary["galera_over_single_per_round"] = [round(x, 3) for x in ratios]
    summary["galera_over_single_median"] = round(statistics.median(ratios), 3)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--galera-port", type=int, default=18640)
    ap.add_argument("--single-port", type=int, default=18680)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/6")
    ap.add_argument("--no-failover", action="store_true")
    args = ap.parse_args()

    import redis

    jwt = "bench-jwt-" + secrets.token_hex(24)
    admin = "bench-admin-" + secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="gate-bench-galera-"))
    tokens = work / "tokens.txt"
    write_token_file(tokens, jwt, range(100_000, 100_000 + BUYERS), 3600)
    base, _, db = args.redis_url.rpartition("/")
    redis_urls = {"single": args.redis_url, "galera": f"{base}/{int(db) + 1}"}
    servers: dict[str, procs.Server] = {}
    out: dict[str, Any] = {"rounds": [], "plan": vars(args)}
    dbs = {
        "single": LocalGalera(args.single_port, nodes=1, wsrep=False, database="gate_bench"),
        "galera": LocalGalera(args.galera_port, database="gate_bench"),
    }
    try:
        for cluster in dbs.values():
            cluster.start()
        out["start_s"] = {k: round(c.start_seconds, 1) for k, c in dbs.items()}
        for url in redis_urls.values():
            with redis.Redis.from_url(url) as r:
                r.flushdb()
        for name in NAMES:
            _migrate(dbs[name].url)
            port = procs.free_port()
            servers[name] = procs.Server(
                name,
                [GATE_BIN, "serve", "--port", str(port), "--workers", "2"],
                _env(dbs[name].url, redis_urls[name], jwt, admin),
                port,
                work / f"{name}.log",
                ROOT,
            )
        for s in servers.values():
            s.wait_ready("/readyz")
        deals = {k: _create_deal(s.url, admin) for k, s in servers.items()}
        for name, s in servers.items():  # warm-up
            procs_round = _round(s, dbs[name].url, deals[name], tokens, args.connections, 2)
            print(name, "warm-up", procs_round, file=sys.stderr)
        for i in range(args.rounds):
            order = NAMES if i % 2 == 0 else NAMES[::-1]
            for name in order:
                res = _round(
                    servers[name],
                    dbs[name].url,
                    deals[name],
                    tokens,
                    args.connections,
                    args.seconds,
                )
                out["rounds"].append({"round": i, "db": name, **res})
                print(name, res, file=sys.stderr)
        out["summary"] = _summary(out["rounds"])
        if not args.no_failover:
            out["failover"] = asyncio.run(
                _failover(servers["galera"], dbs["galera"], deals["galera"], jwt)
            )
    finally:
        for s in servers.values():
            s.stop()
        for cluster in dbs.values():
            cluster.stop()
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
