"""Payment callback throughput: signed `payment.succeeded` webhooks, 30 % redeliveries.

One command (sets up its own database and gate, measures, checks, prints JSON):

    .venv/bin/python -m loadtest.bench_callbacks

It drops and migrates the database `--mysql-url` names (default `gate_cb_bench`),
flushes the Redis database `--redis-url` names (default DB 12), starts
`gate serve --workers 2` with fresh secrets and the rate limits off, and then:

- Set-up (not timed): one deal with `--orders` units in 16 buckets, one held order per
  buyer through the real reservation endpoint.
- Timed: every order gets one `payment.succeeded` callback, and `--duplicates` of all
  callbacks are redeliveries of an event already in the mix (same webhook-id, same
  body, its own signature), shuffled so a copy may arrive before, with or after its
  original. The callbacks are signed with Standard Webhooks just before the run (the
  ±300 s window covers it) and sent by wrk (loadtest/wrk/callbacks.lua), so the
  load generator costs little of the two cores the gate and MariaDB share with it.
- Checked afterwards: every order PAID exactly once with its amount, one event row per
  distinct event, exactly one `order.paid` outbox row per order (one per transition),
  one payment row per order, `pay` ledger rows equal to the units sold, every
  callback answered 200 (duplicates too, without effect), and `gate check` passes.
- Measured: callbacks/s and latency percentiles (wrk), CPU seconds per callback of the
  gate's processes, of mariadbd, of redis-server and of wrk (from /proc), and the
  MariaDB status counters per callback (statements, commits, row operations).

`--gate URL` runs against a gate that is already running (its environment must match:
GATE_MYSQL_URL, GATE_JWT_SECRET, GATE_ADMIN_TOKEN, GATE_WEBHOOK_SECRET, or GATE_ENV=dev);
the gate's CPU is then not measured. The machine is shared with whatever else runs:
the "machine" and "other" CPU figures say how much of it the run did not explain.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import random
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gate.base.settings import MysqlTarget, Secret, load_settings
from gate.inventory.check import check_deal
from gate.payments.signing import decode_secret, sign
from gate.store.db import Database, notes_off_blocking
from gate.web.auth import mint
from loadtest import procs, wrkrun

ROOT = Path(__file__).resolve().parent.parent
GATE_BIN = str(Path(sys.executable).with_name("gate"))
SCRIPT = wrkrun.WRK_DIR / "callbacks.lua"
WEBHOOK_PATH = "/v1/payments/{provider}/webhook"
LIMIT_VARS = ("IP", "USER", "DEVICE", "DEAL", "GLOBAL")
# Counters of SHOW GLOBAL STATUS reported per callback (they count every client of
# the server: on a shared machine the other sessions add to them).
STATUS_VARS = (
    "Com_call_procedure",
    "Com_commit",
    "Com_rollback",
    "Com_select",
    "Com_insert",
    "Com_update",
    "Questions",
    "Queries",
    "Handler_write",
    "Handler_update",
    "Handler_read_key",
    "Handler_read_next",
    "Handler_commit",
    "Handler_rollback",
    "Innodb_log_writes",
    "Innodb_os_log_fsyncs",
    "Innodb_data_fsyncs",
    "Innodb_row_lock_waits",
)
RUN_MAX_SECONDS = 600


def say(text: str) -> None:
    sys.stderr.write(f"bench_callbacks: {text}\n")


def mysql_status(url: str) -> dict[str, int]:
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW GLOBAL STATUS")
            rows = cur.fetchall()
    finally:
        conn.close()
    return {str(k): int(v) for k, v in rows if k in STATUS_VARS}


def connect(url: str, *, with_db: bool = False) -> Any:
    import pymysql

    target = MysqlTarget.parse(url)
    kwargs: dict[str, Any] = {"user": target.user, "password": target.password.reveal()}
    if with_db:
        kwargs["database"] = target.database
    if target.unix_socket:
        kwargs["unix_socket"] = target.unix_socket
    else:
        kwargs.update(host=target.host, port=target.port)
    return pymysql.connect(**kwargs)


def thread_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds of every thread of these processes, by thread id."""
    out: dict[int, float] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / procs.CLOCK_TICKS
    return out


def serving_threads(url: str) -> set[int]:
    """The mariadbd threads serving connections to the bench's database: on a shared
    server their CPU is this run's foreground work, whatever the others do."""
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT TID FROM information_schema.PROCESSLIST WHERE DB = %s",
                (MysqlTarget.parse(url).database,),
            )
            return {int(r[0]) for r in cur.fetchall()}
    finally:
        conn.close()


def reset_stores(mysql_url: str, redis_url: str) -> None:
    import redis

    target = MysqlTarget.parse(mysql_url)
    conn = connect(mysql_url)
    try:
        with conn.cursor() as cur:
            notes_off_blocking(cur)
            cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
            cur.execute(f"CREATE DATABASE `{target.database}`")
    finally:
        conn.close()
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = Path("/proc/loadavg").read_text().split()[:3]
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_before": [float(x) for x in load],
    }


async def setup(
    session: aiohttp.ClientSession,
    base: str,
    admin: str,
    jwt_secret: Secret,
    orders: int,
    conc: int,
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
            token = mint(jwt_secret, user_base + i, 7200)
            for _attempt in range(50):
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


async def reserve_all(
    base: str, admin: str, jwt_secret: Secret, orders: int
) -> tuple[int, list[tuple[str, int, str]]]:
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        return await setup(session, base, admin, jwt_secret, orders, 64)


def build(
    made: list[tuple[str, int, str]], dup_share: float, rng: random.Random
) -> tuple[list[tuple[str, bytes]], int]:
    """The shuffled mix: one event per order plus `dup_share` of redeliveries."""
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


def write_requests(path: Path, key: bytes, mix: list[tuple[str, bytes]]) -> None:
    """Sign every callback now (each its own signature, as a provider's retry is)."""
    now = int(time.time())
    with path.open("wb") as f:
        for event_id, body in mix:
            signature = sign(key, event_id, now, body)
            f.write(b"%s\t%d\t%s\t%s\n" % (event_id.encode(), now, signature.encode(), body))


def fire(url: str, path: str, requests: Path, connections: int, threads: int) -> wrkrun.WrkResult:
    """Send every line of `requests` once; ends when every answer is in."""
    args = [str(requests), path, str(threads)]
    return wrkrun.run_until_done(url, SCRIPT, args, connections, RUN_MAX_SECONDS, threads)


async def verify(settings: Any, deal_id: int, orders: int, distinct: int) -> dict[str, Any]:
    db = Database(settings, pool_max=2)
    await db.start()
    try:
        return await verify_with(db, deal_id, orders, distinct)
    finally:
        await db.close()


async def verify_with(db: Database, deal_id: int, orders: int, distinct: int) -> dict[str, Any]:
    async def one(sql: str) -> int:
        row = await db.fetchone(sql, (deal_id,))
        assert row is not None
        return int(row[0] or 0)

    result: dict[str, Any] = {
        "paid_orders": await one(
            "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND status = 'PAID'"
        ),
        "paid_exactly_once": await one(
            "SELECT COUNT(*) FROM orders WHERE deal_id = %s AND status = 'PAID'"
            " AND paid_amount = amount"
        ),
        "event_rows": await one(
            "SELECT COUNT(*) FROM payment_events e JOIN orders o ON o.id = e.order_id"
            " WHERE o.deal_id = %s"
        ),
        "events_applied": await one(
            "SELECT COUNT(*) FROM payment_events e JOIN orders o ON o.id = e.order_id"
            " WHERE o.deal_id = %s AND e.outcome = 'applied'"
        ),
        "payment_rows": await one(
            "SELECT COUNT(*) FROM payments p JOIN orders o ON o.id = p.order_id"
            " WHERE o.deal_id = %s AND p.status = 'succeeded'"
        ),
        "outbox_paid_rows": await one(
            "SELECT COUNT(*) FROM outbox x JOIN orders o ON o.id = x.aggregate_id"
            " WHERE o.deal_id = %s AND x.topic = 'order.paid'"
        ),
        "orders_with_one_outbox_row": await one(
            "SELECT COUNT(*) FROM (SELECT x.aggregate_id FROM outbox x"
            " JOIN orders o ON o.id = x.aggregate_id WHERE o.deal_id = %s"
            " GROUP BY x.aggregate_id HAVING COUNT(*) = 1) t"
        ),
        "ledger_pay_units": await one(
            "SELECT COALESCE(SUM(d_sold), 0) FROM inventory_ledger"
            " WHERE deal_id = %s AND reason = 'pay'"
        ),
    }
    report = await check_deal(db, None, deal_id)
    result["invariant_ok"] = bool(report["invariant"]["ok"])
    result["ok"] = (
        result["paid_orders"] == orders
        and result["paid_exactly_once"] == orders
        and result["event_rows"] == distinct
        and result["events_applied"] == orders
        and result["payment_rows"] == orders
        and result["outbox_paid_rows"] == orders
        and result["orders_with_one_outbox_row"] == orders
        and result["ledger_pay_units"] == orders
        and result["invariant_ok"]
    )
    return result


def per_callback(a: Mapping[str, float], b: Mapping[str, float], n: int) -> dict[str, float]:
    return {k: round((b[k] - a[k]) / n, 3) for k in b if k in a}


def run(args: argparse.Namespace) -> int:
    command = shlex.join(
        [Path(sys.executable).name, "-m", "loadtest.bench_callbacks", *sys.argv[1:]]
    )
    gate: procs.Server | None = None
    env = dict(os.environ)
    if args.gate is None:
        jwt = "bench-jwt-" + secrets.token_hex(24)
        admin = "bench-admin-" + secrets.token_hex(16)
        webhook = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
        env.update(
            {
                "GATE_ENV": "bench",
                "GATE_MYSQL_URL": args.mysql_url,
                "GATE_REDIS_URL": args.redis_url,
                "GATE_JWT_SECRET": jwt,
                "GATE_ADMIN_TOKEN": admin,
                "GATE_WEBHOOK_SECRET": webhook,
                "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
                "GATE_PAYMENT_PROVIDER": "sandbox",
                "GATE_LOG_LEVEL": "WARNING",
                "GATE_DB_POOL_MAX": str(args.pool_max),
                "PYTHONPATH": str(args.source or ROOT),
                **{f"GATE_LIMIT_{s}": "off" for s in LIMIT_VARS},
            }
        )
        # Settings the operator passes through win over ours (not the stores').
        for key, value in os.environ.items():
            if key.startswith("GATE_") and key not in ("GATE_MYSQL_URL", "GATE_REDIS_URL"):
                env.setdefault(key, value)
        say(f"resetting {MysqlTarget.parse(args.mysql_url).database} and {args.redis_url}")
        reset_stores(args.mysql_url, args.redis_url)
        subprocess.run([GATE_BIN, "migrate"], env=env, check=True, capture_output=True)
        log_dir = Path(tempfile.mkdtemp(prefix="bench-cb-"))
        port = args.port or procs.free_port()
        serve = [GATE_BIN, "serve", "--port", str(port), "--workers", str(args.workers)]
        say("starting " + shlex.join(["gate", *serve[1:]]) + f" (log: {log_dir}/gate.log)")
        gate = procs.Server("gate", serve, env, port, log_dir / "gate.log", ROOT)
        gate.wait_ready("/readyz")
        base = gate.url
    else:
        base = args.gate.rstrip("/")
    saved = {k: os.environ.get(k) for k in env if k.startswith("GATE_")}
    os.environ.update({k: v for k, v in env.items() if k.startswith("GATE_")})
    try:
        settings = load_settings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    webhook_key = decode_secret(settings.webhook_secrets[0].reveal())
    rng = random.Random(args.seed)
    info = machine()
    try:
        say(f"set-up: {args.orders} held orders")
        deal_id, made = asyncio.run(
            reserve_all(base, settings.admin_token.reveal(), settings.jwt_secret, args.orders)
        )
        mix, dups = build(made, args.duplicates, rng)
        with tempfile.TemporaryDirectory(prefix="bench-cb-") as tmp:
            requests = Path(tmp) / "callbacks.tsv"
            write_requests(requests, webhook_key, mix)
            groups = {"mariadbd": procs.pids_named("mariadbd", "mysqld")}
            groups["redis"] = procs.pids_named("redis-server")
            if gate is not None:
                groups["gate"] = gate.pids()
            cpu0 = {k: procs.cpu_seconds(v) for k, v in groups.items()}
            cpu0["wrk"] = procs.children_seconds()
            cpu0["machine"] = procs.machine_busy_seconds()
            threads0 = thread_cpu(groups["mariadbd"])
            status_url = env.get("GATE_MYSQL_URL", args.mysql_url)
            status0 = mysql_status(status_url)
            say(f"firing {len(mix)} callbacks ({dups} duplicates), {args.connections} connections")
            fired = fire(
                base,
                WEBHOOK_PATH.format(provider=args.provider),
                requests,
                args.connections,
                args.threads,
            )
            status1 = mysql_status(status_url)
            cpu1 = {k: procs.cpu_seconds(v) for k, v in groups.items()}
            cpu1["wrk"] = procs.children_seconds()
            cpu1["machine"] = procs.machine_busy_seconds()
            threads1 = thread_cpu(groups["mariadbd"])
            ours = serving_threads(status_url)
            cpu0["mariadbd_ours"] = sum(threads0.get(t, 0.0) for t in ours)
            cpu1["mariadbd_ours"] = sum(threads1.get(t, 0.0) for t in ours)
        checked = asyncio.run(verify(settings, deal_id, len(made), len(made)))
    finally:
        if gate is not None:
            gate.stop()
    n = len(mix)
    cpu_ms = {k: round((cpu1[k] - cpu0[k]) * 1000 / n, 4) for k in cpu1}
    cpu_ms["explained"] = round(
        sum(v for k, v in cpu_ms.items() if k not in ("machine", "mariadbd_ours")), 4
    )
    seconds = fired.extra["wall_s"]
    cores = {k: round((cpu1[k] - cpu0[k]) / seconds, 2) for k in cpu1}
    statuses = {str(k): v for k, v in sorted(fired.status.items())}
    result = {
        "bench": "callbacks",
        "command": command,
        "gate": f"started: gate serve --workers {args.workers}" if gate else base,
        "machine": info,
        "deal_id": deal_id,
        "callbacks": n,
        "duplicates": dups,
        "duplicate_share": round(dups / n, 3),
        "connections": args.connections,
        "seconds": seconds,
        "callbacks_per_second": round(n / seconds, 1),
        "p50_ms": round(fired.latency_us["p50"] / 1000, 2),
        "p90_ms": round(fired.latency_us["p90"] / 1000, 2),
        "p99_ms": round(fired.latency_us["p99"] / 1000, 2),
        "cpu_ms_per_callback": cpu_ms,
        "cpu_cores": cores,
        "mariadb_per_callback": per_callback(status0, status1, n),
        "statuses": statuses,
        "wrk_errors": fired.errors,
        "verified": checked,
        "wrk": fired.command,
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    answered_ok = set(fired.status) == {200} and fired.count(200) == n
    return 0 if checked["ok"] and answered_ok and fired.extra["finished"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gate", help="a running gate's URL (default: start one)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--port", type=int, default=0, help="the started gate's port (default: free)")
    p.add_argument(
        "--mysql-url",
        default="mysql://root@127.0.0.1:3306/gate_cb_bench",
        help="database the started gate uses (DROPPED and re-created)",
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/12", help="Redis DB (FLUSHED)")
    p.add_argument("--pool-max", type=int, default=16, help="GATE_DB_POOL_MAX per worker")
    p.add_argument(
        "--source",
        type=Path,
        help="run the started gate from this checkout (to compare commits; default: this one)",
    )
    p.add_argument("--provider", default="sandbox")
    p.add_argument("--orders", type=int, default=20_000)
    p.add_argument("--duplicates", type=float, default=0.3)
    p.add_argument("--connections", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a short run (500 orders)")
    args = p.parse_args(argv)
    if args.smoke:
        args.orders = min(args.orders, 500)
    if not 0 <= args.duplicates < 1 or not 1 <= args.orders <= 1_000_000:
        p.error("--duplicates in [0, 1), --orders in 1..1,000,000")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
