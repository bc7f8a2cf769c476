"""Expiry release throughput: holds per second from the moment they fall due until
the deal is sellable again (docs/expiry.md, "Benchmark").

    GATE_MYSQL_URL=mysql://root@127.0.0.1:3306/gate_bench \\
    GATE_REDIS_URL=redis://127.0.0.1:6379/14 GATE_ENV=dev \\
    .venv/bin/python loadtest/bench_expiry.py --holds 100000 --sweepers 2

What it does:
  1. Applies migrations, then creates one deal (`--buckets` buckets) and `--holds`
     holds of one unit each, one buyer each, written in bulk straight into the
     database (orders, bucket counters, reservation ledger rows, per-user quota rows
     when `--per-user-limit`), exactly as the reservation path leaves them; Redis is
     then rebuilt from the database and `gate check`'s checks must pass.
  2. Moves every hold's deadline to the same instant T a few seconds ahead (database
     clock), and starts `--sweepers` `gate sweep` processes, which find nothing due.
  3. From T on, polls Redis: the deal is sellable again when Redis shows every unit
     available (every release committed and applied to Redis). The elapsed time from
     T (converted from the database clock) to that moment is the measurement; the
     release rate is holds / elapsed.
  4. Verifies that no hold is left, and that every invariant holds (DB and Redis).
Prints one JSON line with the result and the CPU seconds MariaDB, Redis and the
sweepers used during the measured interval (when they run on this machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from ulid import ULID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gate.base.settings import load_settings  # noqa: E402
from gate.inventory.check import check_deal  # noqa: E402
from gate.runtime import Gate  # noqa: E402
from gate.store.keys import deal_keys  # noqa: E402
from gate.store.migrate import migrate  # noqa: E402
from loadtest import procs  # noqa: E402

GATE_BIN = str(Path(sys.executable).with_name("gate"))
INSERT_CHUNK = 2000


async def make_holds(gate: Gate, args: argparse.Namespace) -> int:
    deal = await gate.deals.create(
        {
            "title": "bench: expiry",
            "unit_price": 100,
            "currency": "EUR",
            "stock": args.holds,
            "buckets": args.buckets,
            "hold_seconds": 3600,
            "per_user_limit": 1 if args.per_user_limit else None,
        },
        actor="bench",
    )
    deal_id = int(deal["id"])
    nb = args.buckets
    user_base = int(time.time() * 1000) % 10**12 * 1000
    async with gate.db.connection() as conn, conn.cursor() as cur:
        for start in range(0, args.holds, INSERT_CHUNK):
            chunk = [
                (str(ULID()), user_base + i, i % nb)
                for i in range(start, min(args.holds, start + INSERT_CHUNK))
            ]
            await cur.execute("START TRANSACTION")
            await cur.executemany(
                "INSERT INTO orders (id, deal_id, user_id, quantity, unit_price, amount, currency,"
                " title, status, alloc, idempotency_key, request_fingerprint, expires_at)"
                " VALUES (%s, %s, %s, 1, 100, 100, 'EUR', 'bench: expiry', 'PENDING_PAYMENT',"
                " %s, %s, 'bench', NOW(6) + INTERVAL 1 HOUR)",
                [(o, deal_id, u, f"{b}:1", f"bench-{o}") for o, u, b in chunk],
            )
            await cur.executemany(
                "INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,"
                " d_available, d_held, d_sold, available_before, available_after, reason, actor)"
                " VALUES (%s, %s, %s, %s, 0, -1, 1, 0, 1, 0, 'reserve', 'bench')",
                [(deal_id, b, o, o) for o, _, b in chunk],
            )
            if args.per_user_limit:
                await cur.executemany(
                    "INSERT INTO user_quota (deal_id, user_id, units) VALUES (%s, %s, 1)",
                    [(deal_id, u) for _, u, _ in chunk],
                )
            await cur.execute("COMMIT")
        # The counters the reservations would have left (the ledger rows' before/after
        # are not replayed exactly here; `gate check` compares sums, which match).
        await cur.execute(
            "UPDATE deal_buckets b JOIN (SELECT CAST(SUBSTRING_INDEX(alloc, ':', 1) AS UNSIGNED)"
            " AS bucket, COUNT(*) AS n FROM orders WHERE deal_id = %s GROUP BY bucket) t"
            " ON t.bucket = b.bucket SET b.available = b.available - t.n, b.held = b.held + t.n"
            " WHERE b.deal_id = %s",
            (deal_id, deal_id),
        )
    await gate.mirror.forget(deal_id)
    assert await gate.mirror.load(deal_id)
    report = await check_deal(gate.db, gate.redis, deal_id)
    assert report["invariant"]["ok"], report["invariant"]
    assert report["totals"]["available"] == 0, report["totals"]
    return deal_id


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = load_settings()
    await migrate(settings.mysql, settings.db_connect_timeout_seconds)
    gate = Gate(settings)
    await gate.start(background=False)
    sweepers: list[asyncio.subprocess.Process] = []
    try:
        t_setup = time.monotonic()
        deal_id = await make_holds(gate, args)
        setup_seconds = time.monotonic() - t_setup
        keys = deal_keys(deal_id)

        # One instant T for every hold, on the database clock, and the same instant on
        # this process's monotonic clock.
        await gate.db.execute(
            "UPDATE orders SET expires_at = NOW(6) + INTERVAL %s MICROSECOND"
            " WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
            (int(args.lead_seconds * 1e6), deal_id),
        )
        row = await gate.db.fetchone(
            "SELECT TIMESTAMPDIFF(MICROSECOND, NOW(6), MIN(expires_at)),"
            " TIMESTAMPDIFF(MICROSECOND, NOW(6), MAX(expires_at)) FROM orders WHERE deal_id = %s",
            (deal_id,),
        )
        assert row is not None
        due_at = time.monotonic() + int(row[0]) / 1e6
        assert int(row[1]) - int(row[0]) < 1e5, "the deadlines did not land on one instant"
        if due_at < time.monotonic() + 0.5:
            raise SystemExit("--lead-seconds too short for this machine: the holds fell due early")

        env = {
            **os.environ,
            "GATE_SWEEP_BATCH_MAX": str(args.batch),
            "GATE_SWEEP_TASKS": str(args.tasks),
            "GATE_SWEEP_INTERVAL_SECONDS": str(args.interval),
            "GATE_LOG_LEVEL": os.environ.get("GATE_LOG_LEVEL", "WARNING"),
        }
        for _ in range(args.sweepers):
            sweepers.append(
                await asyncio.create_subprocess_exec(
                    GATE_BIN, "sweep", env=env, start_new_session=True
                )
            )
        watched = {
            "mariadb": procs.pids_named("mariadbd") or procs.pids_named("mysqld"),
            "redis": procs.pids_named("redis-server"),
            "sweepers": [p.pid for p in sweepers],
        }
        await asyncio.sleep(max(0.0, due_at - time.monotonic()))
        cpu0 = {k: procs.cpu_seconds(v) for k, v in watched.items()}
        t_first = None
        while True:
            avail = int(await gate.redis.hget(keys.meta, "avail") or 0)
            now = time.monotonic()
            if avail > 0 and t_first is None:
                t_first = now
            if avail >= args.holds:
                t_end = now
                break
            if now - due_at > args.timeout_seconds:
                raise SystemExit(f"timed out: {avail} of {args.holds} units sellable again")
            await asyncio.sleep(0.005)
        cpu = {k: round(procs.cpu_seconds(v) - cpu0[k], 2) for k, v in watched.items()}
    finally:
        for p in sweepers:
            p.terminate()
        for p in sweepers:
            await asyncio.wait_for(p.wait(), 30)

    row = await gate.db.fetchone(
        "SELECT COUNT(*) FROM orders WHERE deal_id = %s"
        " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED')",
        (deal_id,),
    )
    left = int(row[0]) if row else -1
    report = await check_deal(gate.db, gate.redis, deal_id)
    await gate.stop()
    elapsed = t_end - due_at
    assert t_first is not None
    return {
        "holds": args.holds,
        "buckets": args.buckets,
        "per_user_limit": args.per_user_limit,
        "sweepers": args.sweepers,
        "tasks": args.tasks,
        "batch": args.batch,
        "interval_seconds": args.interval,
        "setup_seconds": round(setup_seconds, 1),
        "first_release_after_seconds": round(t_first - due_at, 3),
        "sellable_again_after_seconds": round(elapsed, 3),
        "holds_per_second": round(args.holds / elapsed),
        "holds_per_second_after_first": round(args.holds / (t_end - t_first)),
        "cpu_seconds": cpu,
        "holds_left": left,
        "invariants_ok": report["invariant"]["ok"],
        "breaches": report["invariant"]["breaches"][:5],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--holds", type=int, default=50_000)
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--per-user-limit", action="store_true", help="deal with a per-user limit")
    p.add_argument("--sweepers", type=int, default=2, help="`gate sweep` processes")
    p.add_argument("--tasks", type=int, default=1, help="GATE_SWEEP_TASKS per process")
    p.add_argument("--batch", type=int, default=1000, help="GATE_SWEEP_BATCH_MAX")
    p.add_argument("--interval", type=float, default=0.5, help="GATE_SWEEP_INTERVAL_SECONDS")
    p.add_argument("--lead-seconds", type=float, default=3.0, help="from set-up to T")
    p.add_argument("--timeout-seconds", type=float, default=300.0)
    args = p.parse_args()
    result = asyncio.run(run(args))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    ok = result["invariants_ok"] and result["holds_left"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
