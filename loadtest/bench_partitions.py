"""One hot deal in P=1 against P=3 partitions (docs/scale-out.md, "Deal partitions").

    python -m loadtest.bench_partitions [--redis cluster|standalone] [--rounds 3]
        [--seconds 5] [--connections 64] [--cluster-port 18700]

Starts one `gate serve --workers 2` on a fresh MariaDB schema and either a local
Redis Cluster (3 primaries, 3 replicas; tests/cluster.py, ports --cluster-port..+5)
or the standalone Redis database --redis-url (flushed). Creates two deals of 15
buckets and a large stock, one of one partition and one of three, and drives them
in alternating rounds with wrk (64 connections, a fresh key per request, 20,000
buyers): committed reservations/s, p99, the gate's CPU per commit, and the Redis
CPU per commit of each primary (INFO cpu; on a cluster the deal's partitions are
on the primaries listed under "placement", and the hottest primary is the one a
single deal can saturate). Prints one JSON document; medians per deal and the
spread of the rounds are in "summary".
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from gate.store.keys import partition_keys
from loadtest import procs, wrkrun
from loadtest.bench_cluster import _env, _migrate, _orders
from loadtest.tokens import write_token_file
from tests.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
GATE_BIN = str(Path(sys.executable).with_name("gate"))
BIG_STOCK = 50_000_000
BUYERS = 20_000
BUCKETS = 15
KEYS = (
    "committed_per_s",
    "p99_ms",
    "gate_cpu_us_per_commit",
    "redis_cpu_us_per_commit",
    "hottest_primary_cpu_us_per_commit",
    "redis_all_nodes_cpu_us_per_commit",
    "script_calls_per_commit",
    "script_us_per_commit",
)


def _create_deal(url: str, admin: str, partitions: int) -> int:
    import urllib.request

    body = orjson.dumps(
        {
            "title": f"bench P={partitions}",
            "unit_price": 100,
            "currency": "EUR",
            "stock": BIG_STOCK,
            "buckets": BUCKETS,
            "partitions": partitions,
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


def _redis_cpu(ports: list[int]) -> dict[int, float]:
    """CPU seconds (user + sys) each Redis server has used, by port (INFO cpu)."""
    out: dict[int, float] = {}
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as r:
            info = r.info("cpu")
        out[port] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return out


def _scripts(ports: list[int]) -> tuple[int, int]:
    """Script calls (EVALSHA) and their server time in µs, summed over these nodes
    (INFO commandstats)."""
    calls = usec = 0
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as r:
            stat = r.info("commandstats").get("cmdstat_evalsha")
        if stat:
            calls += int(stat["calls"])
            usec += int(stat["usec"])
    return calls, usec


def _round(
    server: procs.Server,
    mysql: str,
    deal: int,
    tokens: Path,
    conns: int,
    seconds: float,
    primaries: list[int],
    all_nodes: list[int],
) -> dict[str, Any]:
    pids = server.pids()
    before_orders = _orders(mysql, deal)
    before_cpu = procs.cpu_seconds(pids)
    before_redis = _redis_cpu(primaries)
    before_scripts = _scripts(primaries)
    before_all = sum(_redis_cpu(all_nodes).values())
    before_busy = procs.machine_busy_seconds()
    started = time.monotonic()
    result = wrkrun.reserve_loop(server.url, deal, tokens, "pb", conns, seconds)
    elapsed = time.monotonic() - started
    cpu = procs.cpu_seconds(pids) - before_cpu
    after_redis = _redis_cpu(primaries)
    after_scripts = _scripts(primaries)
    all_cpu = sum(_redis_cpu(all_nodes).values()) - before_all
    busy = procs.machine_busy_seconds() - before_busy
    committed = _orders(mysql, deal) - before_orders
    per_node = {
        str(p): round((after_redis[p] - before_redis[p]) * 1e6 / max(1, committed), 1)
        for p in primaries
    }
    return {
        "committed_per_s": round(committed / result.duration_s, 1),
        "p99_ms": round(result.latency_us.get("p99", 0.0) / 1000, 2),
        "gate_cpu_us_per_commit": round(cpu * 1e6 / max(1, committed), 1),
        "redis_cpu_us_per_commit": round(sum(per_node.values()), 1),
        "hottest_primary_cpu_us_per_commit": max(per_node.values()),
        # Script calls per commit and the servers' own time in them (commandstats).
        "script_calls_per_commit": round(
            (after_scripts[0] - before_scripts[0]) / max(1, committed), 2
        ),
        "script_us_per_commit": round(
            (after_scripts[1] - before_scripts[1]) / max(1, committed), 1
        ),
        # Replicas included (replication is part of a cluster's cost).
        "redis_all_nodes_cpu_us_per_commit": round(all_cpu * 1e6 / max(1, committed), 1),
        "redis_cpu_us_per_commit_by_primary": per_node,
        # Cores busy on the whole machine during the round (2 cores, shared).
        "machine_busy_cores": round(busy / max(elapsed, 1e-9), 2),
        "status": {str(k): v for k, v in sorted(result.status.items())},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--redis", choices=("cluster", "standalone"), default="cluster")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--cluster-port", type=int, default=18700)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    ap.add_argument("--mysql-server", default="mysql://root@127.0.0.1:3306")
    ap.add_argument("--db", default="gate_partitions_bench")
    args = ap.parse_args()

    jwt = "bench-jwt-" + secrets.token_hex(24)
    admin = "bench-admin-" + secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="gate-bench-partitions-"))
    tokens = work / "tokens.txt"
    write_token_file(tokens, jwt, range(100_000, 100_000 + BUYERS), 3600)
    cluster = LocalCluster(args.cluster_port).start() if args.redis == "cluster" else None
    server: procs.Server | None = None
    out: dict[str, Any] = {"plan": vars(args), "machine": _machine(), "rounds": []}
    try:
        if cluster is not None:
            redis_url = cluster.url
            primaries = []  # read once the cluster has settled (below)
        else:
            redis_url = args.redis_url
            with redis.Redis.from_url(redis_url) as r:
                r.flushdb()
            primaries = [int(redis_url.split(":")[2].split("/")[0])]
        mysql = f"{args.mysql_server}/{args.db}"
        _migrate(mysql)
        port = procs.free_port()
        server = procs.Server(
            "gate",
            [GATE_BIN, "serve", "--port", str(port), "--workers", "2"],
            _env(mysql, redis_url, jwt, admin),
            port,
            work / "gate.log",
            ROOT,
        )
        server.wait_ready("/readyz")
        deals = {p: _create_deal(server.url, admin, p) for p in (1, 3)}
        if cluster is not None:
            # The primaries that serve slots (a node just made a replica may still be
            # listed as a primary without slots by a peer's view).
            primaries = sorted(p for p, (_, ranges) in cluster.primaries().items() if ranges)
            out["primaries"] = primaries
            out["all_nodes"] = cluster.ports
            out["placement"] = {
                f"P={p}": [cluster.primary_port_of(partition_keys(d, k).meta) for k in range(p)]
                for p, d in deals.items()
            }
        for d in deals.values():  # warm-up
            wrkrun.reserve_loop(server.url, d, tokens, "w", args.connections, 2)
        for i in range(args.rounds):
            order = [1, 3] if i % 2 == 0 else [3, 1]
            for p in order:
                res = _round(
                    server,
                    mysql,
                    deals[p],
                    tokens,
                    args.connections,
                    args.seconds,
                    primaries,
                    cluster.ports if cluster is not None else primaries,
                )
                out["rounds"].append({"round": i, "partitions": p, **res})
                print(f"P={p}", res, file=sys.stderr)
        summary: dict[str, Any] = {}
        for p in (1, 3):
            rows = [r for r in out["rounds"] if r["partitions"] == p]
            summary[f"P={p}"] = {
                k: {
                    "median": statistics.median(r[k] for r in rows),
                    "min": min(r[k] for r in rows),
                    "max": max(r[k] for r in rows),
                }
                for k in KEYS
            }
        ones = [r for r in out["rounds"] if r["partitions"] == 1]
        threes = [r for r in out["rounds"] if r["partitions"] == 3]
        ratios = [
            b["committed_per_s"] / a["committed_per_s"]
            for a, b in zip(ones, threes, strict=True)
            if a["committed_per_s"]
        ]
        summary["p3_over_p1_committed_per_round"] = [round(x, 3) for x in ratios]
        summary["p3_over_p1_committed_median"] = round(statistics.median(ratios), 3)
        out["summary"] = summary
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


def _machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in load]}


if __name__ == "__main__":
    sys.exit(main())
