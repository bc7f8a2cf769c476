"""The waiting room's benchmark (docs/waiting-room.md).

    python -m loadtest.bench_room [--rounds 3] [--duration 6] [--connections 64] …

Two targets, on one gate process (one uvicorn worker unless --workers):
  ratio    joins/s and polls/s of the waiting room against the sold-out rejections/s
           of the same process (≥ 0.8 each): rounds alternate sold-out, join and poll
           runs (wrk, loadtest/wrk/room.lua and reserve.lua) so that a noisy
           neighbour hits all three alike; the spread over the rounds is reported,
           and each run's gate CPU (user + system) per answer, with the same ratios
           by CPU (sold-out CPU ÷ join or poll CPU), which a busy machine disturbs
           far less than answers per second
  sellout  UNITS units to BUYERS buyers who all join the room, poll as advised and
           reserve once admitted: database reservation attempts per unit sold
           (gate_reservation_db_attempts_total, ≤ 1.05) and stored-procedure calls per
           unit (Com_call_procedure, every client of the server), oversold 0, gate
           check clean

It owns the database and the Redis logical database it is given (default
gate_test_room and Redis db 7): it drops and flushes them first. Prints one JSON
report and writes it under --out. Exit status 0 when both targets are met, 2 when one
is not, 1 on a correctness breach.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from loadtest import procs, wrkrun
from loadtest.benchmark import GATE_BIN, LIMIT_VARS, http_json, say
from loadtest.tokens import TokenMint, write_token_file

ROOT = Path(__file__).resolve().parent.parent
USER_BASE = 5 * 10**12
SELLOUT_USER_BASE = 6 * 10**12


def _sql(url: str, query: str, args: tuple[Any, ...] = (), with_db: bool = True) -> list[Any]:
    import pymysql

    from gate.base.settings import MysqlTarget

    target = MysqlTarget.parse(url)
    kwargs: dict[str, Any] = {
        "host": target.host,
        "port": target.port,
        "user": target.user,
        "password": target.password.reveal(),
        "autocommit": True,
    }
    if with_db:
        kwargs["database"] = target.database
    conn = pymysql.connect(**kwargs)
    try:
        with conn.cursor() as cur:
            cur.execute(query, args)
            return list(cur.fetchall())
    finally:
        conn.close()


class RoomBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(
            args.out or ROOT / "loadtest" / "results" / f"room-{time.strftime('%H%M%S')}"
        )
        self.out.mkdir(parents=True, exist_ok=True)
        self.jwt = "bench-jwt-" + secrets.token_hex(24)
        self.admin = {"Authorization": "Bearer bench-admin-" + secrets.token_hex(16)}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
        self.env.update(
            {
                "GATE_ENV": "bench",
                "GATE_MYSQL_URL": args.mysql_url,
                "GATE_REDIS_URL": args.redis_url,
                "GATE_JWT_SECRET": self.jwt,
                "GATE_ADMIN_TOKEN": self.admin["Authorization"].split(" ", 1)[1],
                "GATE_WEBHOOK_SECRET": "whsec_" + base64.b64encode(os.urandom(24)).decode(),
                "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
                # Required outside dev; nothing here pays.
                "GATE_PAYMENT_PROVIDER": "sandbox",
                "GATE_LOG_LEVEL": "WARNING",
                # Buyers cycle faster than the production advice (1-10 s) would allow.
                "GATE_ROOM_POLL_MIN_MS": "100",
                "GATE_ROOM_POLL_MAX_MS": "100",
                "PYTHONPATH": str(ROOT),
                **{name: "off" for name in LIMIT_VARS},
            }
        )
        # --env NAME=VALUE: a setting under test (e.g. GATE_REDIS_FLUSH_EVERY=16).
        self.env.update(dict(item.split("=", 1) for item in args.env))
        self.gate: procs.Server | None = None

    def reset(self) -> None:
        import redis

        from gate.base.settings import MysqlTarget
        from gate.store.migrate import migrate

        target = MysqlTarget.parse(self.args.mysql_url)
        _sql(self.args.mysql_url, f"DROP DATABASE IF EXISTS `{target.database}`", with_db=False)
        asyncio.run(migrate(target))
        client = redis.Redis.from_url(self.args.redis_url)
        client.flushdb()
        client.close()

    def start(self) -> procs.Server:
        port = self.args.port or procs.free_port()
        args = [GATE_BIN, "serve", "--port", str(port), "--workers", str(self.args.workers)]
        say("starting the gate: " + " ".join(["gate", *args[1:]]))
        gate = procs.Server("gate", args, self.env, port, self.out / "gate.log", ROOT)
        gate.wait_ready("/readyz")
        self.gate = gate
        return gate

    def deal(self, stock: int, room: dict[str, int] | None) -> int:
        assert self.gate is not None
        body: dict[str, Any] = {
            "title": "bench room",
            "unit_price": 1000,
            "currency": "EUR",
            "stock": stock,
            "hold_seconds": 3600,
        }
        if room:
            body["waiting_room"] = room
        status, answer = http_json("POST", self.gate.url + "/v1/admin/deals", body, self.admin)
        if status != 201:
            raise RuntimeError(f"creating a deal answered {status}: {answer}")
        return int(answer["id"])

    def metric(self, name: str) -> float:
        from gate.base.metrics import sample_values, value_of

        assert self.gate is not None
        import urllib.request

        with urllib.request.urlopen(self.gate.metrics_url + "/metrics", timeout=10) as resp:
            return value_of(sample_values(resp.read().decode()), name)

    # -- ratio -------------------------------------------------------------------------

    def phase_ratio(self) -> dict[str, Any]:
        gate = self.gate
        assert gate is not None
        a = self.args
        tokens = self.out / "tokens.txt"
        write_token_file(tokens, self.jwt, range(USER_BASE, USER_BASE + a.buyers), 6 * 3600)
        sold = self.deal(1, None)
        mint = TokenMint(self.jwt)
        status, body = http_json(
            "POST",
            f"{gate.url}/v1/deals/{sold}/reservations",
            {"quantity": 1},
            {"Authorization": mint.header(USER_BASE - 1), "Idempotency-Key": "bench-room-0001"},
        )
        assert status == 201, body
        # Every buyer's token verified and cached once, as in the sold-out benchmark.
        say(f"warming: {a.buyers} buyers' tokens")
        wrkrun.room(gate.url, "GET", sold, tokens, a.connections, a.warmup, a.threads)
        poll_deal = self.deal(0, {"admit_per_second": 1000})
        say("joining every buyer to the poll deal")
        wrkrun.room(gate.url, "POST", poll_deal, tokens, a.connections, a.warmup, a.threads)
        rounds = []
        pids = gate.pids()

        def cpu_us(run: Any) -> tuple[Any, float]:
            """The run, and the gate's CPU (user + system) per answer, in µs: far less
            disturbed by a busy machine than answers per second."""
            before = procs.cpu_seconds(pids)
            result = run()
            spent = procs.cpu_seconds(pids) - before
            return result, round(spent / max(1, result.requests) * 1e6, 1)

        for i in range(a.rounds):
            sold_out, sold_cpu = cpu_us(
                lambda i=i: wrkrun.reserve_loop(
                    gate.url, sold, tokens, f"br{i}", a.connections, a.duration, a.threads
                )
            )
            join_deal = self.deal(0, {"admit_per_second": 1000})
            joins, join_cpu = cpu_us(
                lambda d=join_deal: wrkrun.room(
                    gate.url, "POST", d, tokens, a.connections, a.duration, a.threads
                )
            )
            polls, poll_cpu = cpu_us(
                lambda: wrkrun.room(
                    gate.url, "GET", poll_deal, tokens, a.connections, a.duration, a.threads
                )
            )
            row = {
                "gate_cpu_us_per_request": {
                    "sold_out": sold_cpu,
                    "join": join_cpu,
                    "poll": poll_cpu,
                },
                "sold_out_per_s": round(sold_out.count(409) / sold_out.duration_s, 1),
                "joins_per_s": round(joins.count(200, 201) / joins.duration_s, 1),
                "polls_per_s": round(polls.count(200) / polls.duration_s, 1),
                "join_status": joins.to_json()["status"],
                "poll_status": polls.to_json()["status"],
                "sold_out_status": sold_out.to_json()["status"],
                "latency_p99_us": {
                    "sold_out": sold_out.latency_us.get("p99"),
                    "join": joins.latency_us.get("p99"),
                    "poll": polls.latency_us.get("p99"),
                },
            }
            row["join_ratio"] = round(row["joins_per_s"] / max(1.0, row["sold_out_per_s"]), 3)
            row["poll_ratio"] = round(row["polls_per_s"] / max(1.0, row["sold_out_per_s"]), 3)
            # The same ratios by the gate's CPU per answer (sold-out CPU ÷ join CPU).
            row["join_ratio_by_cpu"] = round(sold_cpu / max(0.1, join_cpu), 3)
            row["poll_ratio_by_cpu"] = round(sold_cpu / max(0.1, poll_cpu), 3)
            say(
                f"round {i + 1}: sold-out {row['sold_out_per_s']}/s, joins"
                f" {row['joins_per_s']}/s ({row['join_ratio']}x), polls"
                f" {row['polls_per_s']}/s ({row['poll_ratio']}x); gate CPU per answer"
                f" {sold_cpu} / {join_cpu} / {poll_cpu} µs"
                f" ({row['join_ratio_by_cpu']}x, {row['poll_ratio_by_cpu']}x)"
            )
            rounds.append(row)
        joins_r = [r["join_ratio"] for r in rounds]
        polls_r = [r["poll_ratio"] for r in rounds]
        joins_c = [r["join_ratio_by_cpu"] for r in rounds]
        polls_c = [r["poll_ratio_by_cpu"] for r in rounds]
        return {
            "rounds": rounds,
            "join_ratio_by_cpu_median": statistics.median(joins_c),
            "poll_ratio_by_cpu_median": statistics.median(polls_c),
            "join_ratio_median": statistics.median(joins_r),
            "poll_ratio_median": statistics.median(polls_r),
            "join_ratio_spread": [min(joins_r), max(joins_r)],
            "poll_ratio_spread": [min(polls_r), max(polls_r)],
            "target": 0.8,
        }

    # -- sell-out with the room on -------------------------------------------------------

    async def _buyers(self, deal_id: int) -> dict[str, int]:
        import aiohttp

        gate = self.gate
        assert gate is not None
        a = self.args
        mint = TokenMint(self.jwt)
        outcomes: dict[str, int] = {}
        sem = asyncio.Semaphore(a.connections)

        def count(what: str) -> None:
            outcomes[what] = outcomes.get(what, 0) + 1

        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=a.connections),
            timeout=aiohttp.ClientTimeout(total=60),
        ) as http:

            async def call(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
                async with sem, http.request(method, gate.url + path, headers=headers) as r:
                    return r.status, orjson.loads(await r.read())

            async def buyer(user: int) -> None:
                auth = {"Authorization": mint.header(user)}
                path = f"/v1/deals/{deal_id}/queue"
                status, ticket = await call("POST", path, auth)
                deadline = time.monotonic() + a.sellout_seconds
                while time.monotonic() < deadline:
                    if status in (200, 201):
                        state = ticket["state"]
                        if state == "admitted":
                            headers = {
                                **auth,
                                "Idempotency-Key": f"bench-room-{user}",
                                "Admission-Token": ticket["admission_token"],
                                "Content-Type": "application/json",
                            }
                            async with (
                                sem,
                                http.post(
                                    gate.url + f"/v1/deals/{deal_id}/reservations",
                                    data=b'{"quantity": 1}',
                                    headers=headers,
                                ) as r,
                            ):
                                count(f"reserve {r.status}")
                            return
                        if state in ("closed", "sold_out"):
                            count(f"ticket {state}")
                            return
                        pause = int(ticket["poll_after_ms"]) / 1000
                    else:
                        pause = 0.5
                    await asyncio.sleep(pause)
                    status, ticket = await call("GET", path, auth)
                count("gave up")

            await asyncio.gather(*(buyer(SELLOUT_USER_BASE + i) for i in range(a.sellout_buyers)))
        return outcomes

    def phase_sellout(self) -> dict[str, Any]:
        a = self.args
        deal_id = self.deal(a.units, {"admit_per_second": a.room_rate})
        attempts_before = self.metric("gate_reservation_db_attempts_total")
        calls_before = int(_sql(a.mysql_url, "SHOW GLOBAL STATUS LIKE 'Com_call_procedure'")[0][1])
        started = time.monotonic()
        outcomes = asyncio.run(self._buyers(deal_id))
        wall = time.monotonic() - started
        attempts = self.metric("gate_reservation_db_attempts_total") - attempts_before
        calls = int(_sql(a.mysql_url, "SHOW GLOBAL STATUS LIKE 'Com_call_procedure'")[0][1])
        units = int(
            _sql(
                a.mysql_url,
                "SELECT COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s",
                (deal_id,),
            )[0][0]
        )
        assert self.gate is not None
        status, view = http_json(
            "GET", f"{self.gate.url}/v1/admin/deals/{deal_id}", None, self.admin
        )
        return {
            "units": a.units,
            "buyers": a.sellout_buyers,
            "admit_per_second": a.room_rate,
            "sold": units,
            "oversold": max(0, units - a.units),
            "wall_s": round(wall, 2),
            "db_attempts": attempts,
            "attempts_per_unit": round(attempts / max(1, units), 4),
            "procedure_calls_per_unit": round((calls - calls_before) / max(1, units), 4),
            "outcomes": outcomes,
            "gate_check_ok": status == 200 and bool(view["invariant"]["ok"]),
            "room": view.get("redis", {}).get("room"),
            "target": 1.05,
        }

    def run(self) -> dict[str, Any]:
        self.reset()
        self.start()
        try:
            report: dict[str, Any] = {
                "command": " ".join(["python -m loadtest.bench_room", *sys.argv[1:]]),
                "cpus": os.cpu_count(),
                "load_before": os.getloadavg(),
            }
            if "ratio" in self.args.only:
                report["ratio"] = self.phase_ratio()
            if "sellout" in self.args.only:
                report["sellout"] = self.phase_sellout()
            report["load_after"] = os.getloadavg()
            return report
        finally:
            if self.gate is not None:
                self.gate.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_room", description=__doc__)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    p.add_argument("--mysql-url", default="mysql://root@127.0.0.1:3306/gate_test_room")
    p.add_argument("--port", type=int, default=0, help="the gate's port (default: a free one)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--buyers", type=int, default=60_000)
    p.add_argument("--units", type=int, default=1000)
    p.add_argument("--sellout-buyers", type=int, default=5000)
    p.add_argument("--room-rate", type=int, default=2000)
    p.add_argument("--sellout-seconds", type=float, default=60.0)
    p.add_argument("--only", nargs="+", default=["ratio", "sellout"])
    p.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="gate setting to add"
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    bench = RoomBench(args)
    report = bench.run()
    text = orjson.dumps(report, option=orjson.OPT_INDENT_2).decode()
    (bench.out / "report.json").write_text(text)
    print(text)
    sell = report.get("sellout")
    if sell and (sell["oversold"] or not sell["gate_check_ok"]):
        return 1
    met = True
    if "ratio" in report:
        r = report["ratio"]
        met = met and r["join_ratio_median"] >= 0.8 and r["poll_ratio_median"] >= 0.8
    if sell:
        met = met and sell["attempts_per_unit"] <= 1.05
    return 0 if met else 2


if __name__ == "__main__":
    raise SystemExit(main())
