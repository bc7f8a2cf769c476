"""Queue mode benchmark (docs/queue-mode.md "Benchmark").

    GATE_MYSQL_URL=mysql://root@127.0.0.1:3306/gate_bench \\
    GATE_REDIS_URL=redis://127.0.0.1:6379/14 GATE_ENV=dev \\
    .venv/bin/python loadtest/bench_queue.py --requests 20000 --concurrency 100 --rounds 2

Starts one `gate serve` (one worker, background loops on: its queue consumer runs in
the same process as the requests it answers), then, each with `--requests` fresh
buyers sent `--concurrency` at a time:
  1. sold out: a deal of 1 unit, sold; the rejections/s of the same process
  2. queue: a deal in queue mode with a unit per request; accepted (202)/s, and the
     drain rate: requests / (first request sent → queue empty and every order
     committed)
  3. sync: the same deal shape in sync mode; commits (201)/s
  4. commit lag (enqueue → committed) p50/p99 from the gate's histogram (upper
     bucket bounds), and the queue's retries and dead letters
The bursts are sent by wrk (`--client wrk`, the default: loadtest/wrk/reserve.lua,
each buyer once; a C client that costs ~30 µs per request, so each phase measures
the gate) or by this process (`--client aiohttp`: a Python client that needs a core
for ~1,500 requests/s and so bounds the sold-out phase itself).
Prints one JSON line per round with the ratios the issue targets (accepted/sold-out
≥ 0.8, drain/sync ≥ 1.0) and the CPU per answer in each phase of the gate (utime +
stime of the server's process group from /proc: what a busy machine disturbs
least), of Redis, of MariaDB and of the client, then one with the medians and
spreads over the rounds (`--rounds`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gate.base.settings import load_settings  # noqa: E402
from gate.store.keys import queue_keys  # noqa: E402
from gate.store.migrate import migrate  # noqa: E402
from loadtest import procs, wrkrun  # noqa: E402
from loadtest.procs import Server, free_port  # noqa: E402
from loadtest.tokens import TokenMint, write_token_file  # noqa: E402

DRAIN_POLLS_MAX = 60_000  # 5 ms apart: at most about 5 minutes


async def _admin(session: aiohttp.ClientSession, url: str, token: str, body: dict[str, Any]) -> int:
    async with session.post(
        url + "/v1/admin/deals", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        assert r.status == 201, await r.text()
        return int((await r.json())["id"])


async def _burst(
    session: aiohttp.ClientSession,
    url: str,
    deal_id: int,
    headers: list[dict[str, str]],
    concurrency: int,
) -> tuple[float, dict[int, int]]:
    """Every buyer once, `concurrency` at a time: (seconds, count per status)."""
    counts: dict[int, int] = {}
    it = iter(headers)

    async def worker() -> None:
        for h in it:
            async with session.post(
                f"{url}/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=h
            ) as r:
                await r.read()
                counts[r.status] = counts.get(r.status, 0) + 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, counts


async def _burst_wrk(
    url: str, deal_id: int, tokens: Path, connections: int
) -> tuple[float, dict[int, int]]:
    """Every buyer in `tokens` once through wrk (`connections` at a time): (seconds
    from start to the last answer, count per status)."""
    done = await asyncio.to_thread(wrkrun.reserve_once, url, deal_id, tokens, "bq", connections)
    if not done.extra.get("finished"):
        raise RuntimeError(f"wrk did not finish: {done.to_json()}")
    return float(done.extra["wall_s"]), dict(done.status)


def _cpu(groups: dict[str, list[int]], client: str) -> dict[str, float]:
    """User + system CPU seconds so far of each group of processes, and of the client
    (wrk: this process's finished children; aiohttp: this process)."""
    sample = {name: procs.cpu_seconds(pids) for name, pids in groups.items()}
    sample["client"] = procs.children_seconds() if client == "wrk" else time.process_time()
    return sample


def _per_answer(
    before: dict[str, float], after: dict[str, float], answers: int
) -> dict[str, float]:
    """CPU µs per answer of each process between two samples."""
    return {k: round((after[k] - before[k]) * 1e6 / max(1, answers), 1) for k in after}


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None


async def _lag(
    session: aiohttp.ClientSession, url: str
) -> tuple[float | None, float | None, dict[str, float]]:
    """Commit lag p50/p99 (upper bucket bounds) and the queue's retry and dead-letter
    counts, from the gate's /metrics."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    buckets: list[tuple[float, float]] = []
    counts = {"retries": 0.0, "dead_letters": 0.0}
    for line in text.splitlines():
        if line.startswith("gate_queue_commit_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
        for name in counts:
            if line.startswith(f"gate_queue_{name}_total{{"):
                counts[name] += float(line.split()[-1])
    buckets.sort()
    return _quantile(buckets, 0.5), _quantile(buckets, 0.99), counts


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings()
    await migrate(settings.mysql)
    env = dict(os.environ)
    env.setdefault("GATE_LOG_LEVEL", "WARNING")
    env.setdefault("GATE_LIMIT_DEAL", "off")
    env.setdefault("GATE_LIMIT_USER", "off")
    env.setdefault("GATE_LIMIT_IP", "off")
    env.setdefault("GATE_LIMIT_DEVICE", "off")
    env.setdefault("GATE_LIMIT_GLOBAL", "off")
    port = free_port()
    gate_bin = str(ROOT / ".venv" / "bin" / "gate")
    server = Server(
        "gate",
        [gate_bin, "serve", "--port", str(port), "--workers", "1"],
        env,
        port,
        ROOT / ".local" / f"bench-queue-{port}.log",
        ROOT,
    )
    rds = aioredis.Redis.from_url(settings.redis_url)
    work = Path(tempfile.mkdtemp(prefix="bench-queue-"))  # wrk's token files
    try:
        server.wait_ready("/readyz")
        secret = settings.jwt_secret.reveal()
        mint = TokenMint(secret, ttl_seconds=3600)
        base = int(time.time()) % 10**6 * 10**6
        n = args.requests

        def buyers(offset: int) -> list[dict[str, str]]:
            return [
                {
                    "Authorization": mint.header(base + offset + i),
                    "Idempotency-Key": f"bq-{base}-{offset + i}",
                }
                for i in range(n)
            ]

        prepared: dict[int, Any] = {}

        async def prepare(offset: int) -> None:
            """The buyers of one burst, made before its clock starts."""
            if args.client == "wrk":
                path = work / f"tokens-{offset}.txt"
                users = range(base + offset, base + offset + n)
                await asyncio.to_thread(write_token_file, path, secret, users, 3600)
                prepared[offset] = path
            else:
                prepared[offset] = buyers(offset)

        async def fire(
            s: aiohttp.ClientSession, deal_id: int, offset: int
        ) -> tuple[float, dict[int, int]]:
            made = prepared.pop(offset)
            if args.client == "wrk":
                return await _burst_wrk(server.url, deal_id, made, args.concurrency)
            return await _burst(s, server.url, deal_id, made, args.concurrency)

        connector = aiohttp.TCPConnector(limit=args.concurrency)
        groups = {
            "gate": server.pids(),
            "redis": procs.pids_named("redis-server"),
            "mariadb": procs.pids_named("mariadbd", "mysqld"),
        }
        rounds: list[dict[str, Any]] = []
        async with aiohttp.ClientSession(connector=connector) as s:
            deal = {
                "title": "bench queue",
                "unit_price": 100,
                "currency": "EUR",
                "buckets": args.buckets,
            }
            admin = settings.admin_token.reveal()
            for r in range(args.rounds):
                offset = 4 * n * r
                sold = await _admin(s, server.url, admin, {**deal, "stock": 1})
                await _burst(s, server.url, sold, buyers(offset)[:1], 1)
                await prepare(offset + n)
                cpu0 = _cpu(groups, args.client)
                t_sold, c_sold = await fire(s, sold, offset + n)
                cpu_sold = _cpu(groups, args.client)

                queued = await _admin(s, server.url, admin, {**deal, "stock": n, "mode": "queue"})
                await prepare(offset + 2 * n)
                cpu1 = _cpu(groups, args.client)
                start = time.perf_counter()
                t_queue, c_queue = await fire(s, queued, offset + 2 * n)
                cpu_burst = _cpu(groups, args.client)
                stream = queue_keys(queued).stream
                for _ in range(DRAIN_POLLS_MAX):  # polled: the queue lives in another process
                    if await rds.xlen(stream) == 0:
                        break
                    await asyncio.sleep(0.005)
                t_drain = time.perf_counter() - start
                cpu_queue = _cpu(groups, args.client)

                synced = await _admin(s, server.url, admin, {**deal, "stock": n})
                await prepare(offset + 3 * n)
                cpu2 = _cpu(groups, args.client)
                t_sync, c_sync = await fire(s, synced, offset + 3 * n)
                cpu_sync = _cpu(groups, args.client)
                sold_rps = c_sold.get(409, 0) / t_sold
                accepted_rps = c_queue.get(202, 0) / t_queue
                drain_rps = c_queue.get(202, 0) / t_drain
                sync_rps = c_sync.get(201, 0) / t_sync
                n409, n202, n201 = c_sold.get(409, 0), c_queue.get(202, 0), c_sync.get(201, 0)
                # CPU µs per answer of each process (gate, Redis, MariaDB, the client):
                # what the two cores were spent on in each phase.
                per = {
                    "409": _per_answer(cpu0, cpu_sold, n409),
                    # While the 202s were answered, the consumers draining meanwhile.
                    "202_burst": _per_answer(cpu1, cpu_burst, n202),
                    # Accepted and committed: the whole queue phase per order.
                    "queued_commit": _per_answer(cpu1, cpu_queue, n202),
                    "sync_commit": _per_answer(cpu2, cpu_sync, n201),
                }
                row = {
                    "sold_out_per_s": round(sold_rps),
                    "accepted_202_per_s": round(accepted_rps),
                    "accepted_vs_sold_out": round(accepted_rps / sold_rps, 2),
                    "drain_per_s": round(drain_rps),
                    "sync_commits_per_s": round(sync_rps),
                    "drain_vs_sync": round(drain_rps / sync_rps, 2),
                    # The gate's CPU per answer: what a busy machine disturbs least.
                    **{f"cpu_us_per_{k}": v["gate"] for k, v in per.items()},
                    "cpu_us_per_answer": per,
                    "statuses": {"sold_out": c_sold, "queue": c_queue, "sync": c_sync},
                }
                rounds.append(row)
                print(orjson.dumps(row, option=orjson.OPT_NON_STR_KEYS).decode(), flush=True)
            p50, p99, queue_counts = await _lag(s, server.metrics_url)
    finally:
        server.stop()
        await rds.aclose()
        shutil.rmtree(work, ignore_errors=True)

    def median(key: str) -> float:
        return round(statistics.median(float(row[key]) for row in rounds), 2)

    def spread(key: str) -> list[float]:
        return [min(float(row[key]) for row in rounds), max(float(row[key]) for row in rounds)]

    keys = (
        "accepted_vs_sold_out",
        "drain_vs_sync",
        "cpu_us_per_409",
        "cpu_us_per_202_burst",
        "cpu_us_per_queued_commit",
        "cpu_us_per_sync_commit",
    )
    return {
        "requests": n,
        "concurrency": args.concurrency,
        "rounds": len(rounds),
        "median": {k: median(k) for k in keys},
        "spread": {k: spread(k) for k in keys},
        "cpu_us_per_answer_median": {
            phase: {
                proc: round(
                    statistics.median(r["cpu_us_per_answer"][phase][proc] for r in rounds), 1
                )
                for proc in rounds[0]["cpu_us_per_answer"][phase]
            }
            for phase in rounds[0]["cpu_us_per_answer"]
        },
        "client": args.client,
        "commit_lag_p50_le_s": p50,
        "commit_lag_p99_le_s": p99,
        "queue_retries": queue_counts["retries"],
        "queue_dead_letters": queue_counts["dead_letters"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument(
        "--client",
        choices=("wrk", "aiohttp"),
        default="wrk",
        help="who sends the bursts: wrk (C: the gate's own rate) or aiohttp (Python)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="sold out, queue, sync again, each round fresh"
    )
    args = p.parse_args()
    print(orjson.dumps(asyncio.run(run(args)), option=orjson.OPT_NON_STR_KEYS).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
