"""The reservation procedures alone: reservations/s and MariaDB CPU per reservation of
`gate_reserve` (one per call) against `gate_reserve_group` (a group per call), with no
gate, no HTTP and no Redis in the way (docs/reservation-groups.md).

    python -m loadtest reserve-probe single --buckets 16 --connections 16
    python -m loadtest reserve-probe group --group 16 --connections 4

It migrates the database of GATE_MYSQL_URL (default a scratch `gate_probe`; use a
database of its own) and creates a deal of 50,000,000 units per run. MariaDB's CPU is
read from /proc, so the server must run on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import time
from typing import Any

import aiomysql
import orjson

from gate.base.settings import MysqlTarget
from gate.inventory import orders
from gate.reserve.request import fingerprint
from gate.store.db import connect_kwargs, session_init_sql
from gate.store.migrate import migrate

STOCK = 50_000_000


def mariadb_cpu_seconds() -> float:
    pid = subprocess.check_output(["pgrep", "-o", "mariadbd|mysqld"]).split()[0].decode()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Probe:
    def __init__(self, target: MysqlTarget, args: argparse.Namespace) -> None:
        self.target = target
        self.args = args
        self.user = random.randrange(10**12)
        self.done = 0
        self.deal_id = 0

    async def connect(self) -> Any:
        conn = await aiomysql.connect(**connect_kwargs(self.target, 5))
        version = str(conn.get_server_info())
        async with conn.cursor() as cur:
            await cur.execute(session_init_sql(version, 5))
        return conn

    async def create_deal(self) -> None:
        conn = await self.connect()
        nb = self.args.buckets
        try:
            async with conn.cursor() as cur:
                await cur.execute(
                    "INSERT INTO deals (title, unit_price, currency, bucket_count, hold_seconds,"
                    " max_per_order) VALUES ('probe', 100, 'EUR', %s, 600, 1)",
                    (nb,),
                )
                self.deal_id = int(cur.lastrowid)
                per = STOCK // nb
                await cur.execute(
                    "INSERT INTO deal_buckets (deal_id, bucket, epoch, total, available) VALUES "
                    + ",".join(f"({self.deal_id}, {b}, 0, {per}, {per})" for b in range(nb))
                )
        finally:
            conn.close()

    def item(self, lane: int = 0) -> list[Any]:
        self.user += 1
        bucket = random.randrange(self.args.buckets)
        lanes = self.args.lanes
        if lanes > 1:
            # Only the buckets of this connection's lane: groups of different lanes
            # lock disjoint bucket rows.
            bucket = bucket - bucket % lanes + lane % lanes
            if bucket >= self.args.buckets:
                bucket = lane % lanes
        return [orders.new_id(), self.user, 1, bucket, f"probe-{self.user}", fingerprint(1, 1)]

    async def worker(self, stop: asyncio.Event, lane: int) -> None:
        conn = await self.connect()
        try:
            async with conn.cursor() as cur:
                while not stop.is_set():
                    if self.args.mode == "single":
                        o, user, q, b, key, fp = self.item()
                        await cur.execute(
                            "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)",
                            (o, self.deal_id, user, q, f"{b}:{q}", key, fp, f"user:{user}"),
                        )
                        n = 1
                    else:
                        items = [self.item(lane) for _ in range(self.args.group)]
                        await cur.execute(
                            "CALL gate_reserve_group(%s, %s)",
                            (self.deal_id, orjson.dumps(items).decode()),
                        )
                        n = len(items)
                    row = await cur.fetchone()
                    while await cur.nextset():
                        pass
                    assert row is not None and int(row[0]) == 0, row
                    self.done += n
        finally:
            conn.close()

    async def run(self) -> str:
        await self.create_deal()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self.worker(stop, i)) for i in range(self.args.connections)]
        await asyncio.sleep(self.args.warmup)
        n0, c0, t0, p0 = self.done, mariadb_cpu_seconds(), time.monotonic(), time.process_time()
        await asyncio.sleep(self.args.seconds)
        n1, c1, t1, p1 = self.done, mariadb_cpu_seconds(), time.monotonic(), time.process_time()
        stop.set()
        await asyncio.gather(*tasks)
        n = max(1, n1 - n0)
        group = 1 if self.args.mode == "single" else self.args.group
        return (
            f"{self.args.mode:6} buckets={self.args.buckets} group={group}"
            f" connections={self.args.connections} lanes={self.args.lanes}:"
            f" {n / (t1 - t0):,.0f} reservations/s,"
            f" MariaDB {1e6 * (c1 - c0) / n:.1f} µs/reservation ({(c1 - c0) / (t1 - t0):.2f}"
            f" cores), client {1e6 * (p1 - p0) / n:.1f} µs/reservation"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("single", "group"))
    p.add_argument("--buckets", type=int, default=1)
    p.add_argument("--group", type=int, default=16, help="reservations per group call")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="connection i takes only the buckets b with b %% lanes == i %% lanes",
    )
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    args = p.parse_args()
    url = os.environ.get("GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate_probe")
    target = MysqlTarget.parse(url)

    async def go() -> None:
        await migrate(target)
        print(await Probe(target, args).run())

    asyncio.run(go())


if __name__ == "__main__":
    main()
