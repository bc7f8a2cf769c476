"""Does the live console slow the sale? (≥ 0.97×)

    python -m loadtest bench-console [--consoles 20] [--rounds 3] [--seconds 10]

Starts its own `gate serve` (GATE_CONSOLE=1, --workers 2) on the database named by
GATE_MYSQL_URL (default mysql://root@127.0.0.1:3306/gate_console_bench, dropped
and made afresh) and the Redis of GATE_REDIS_URL (default db 12, flushed), sells
out a one-unit deal, then alternates rounds of the same wrk sold-out flood
(loadtest/wrk/reserve.lua, --connections) without consoles and with `--consoles`
signed-in consoles polling as the page does (the snapshot every second, the deal's
ledger every five). First it measures what the consoles cost the gate alone: its
CPU per second with no flood, without and with them (--idle-seconds each). The
verdict compares the mean sold-out rejections/s of the two modes (and the gate's
CPU per request); rounds alternate so that a noisy neighbour hurts both. One JSON
line goes to stdout with every round.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import procs, wrkrun
from loadtest.benchmark import http_json
from loadtest.tokens import TokenMint, write_token_file

ROOT = Path(__file__).resolve().parents[2]
TARGET_RATIO = 0.97
CONSOLES_MAX = 200
LEDGER_EVERY_SECONDS = 5.0


def say(text: str) -> None:
    print(f"==> {text}", file=sys.stderr, flush=True)


class Consoles:
    """`count` open console pages in a thread of their own: each signs in, then polls
    the snapshot once a second and the deal's ledger every five seconds."""

    def __init__(self, url: str, admin_token: str, deal_id: int, count: int) -> None:
        self.url = url
        self.admin_token = admin_token
        self.deal_id = deal_id
        self.count = count
        self.polls = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Consoles:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _page(self, session: aiohttp.ClientSession) -> None:
        async with session.post(
            self.url + "/console/api/session", json={"token": self.admin_token}
        ) as r:
            if r.status != 200:
                self.failures += 1
                return
            cookie = r.headers["Set-Cookie"].split(";", 1)[0]
        headers = {"Cookie": cookie}
        next_ledger = 0.0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                async with session.get(self.url + "/console/api/snapshot", headers=headers) as r:
                    await r.read()
                    self.polls += r.status == 200
                    self.failures += r.status != 200
                if started >= next_ledger:
                    path = f"/console/api/deals/{self.deal_id}/ledger"
                    async with session.get(self.url + path, headers=headers) as r:
                        await r.read()
                    next_ledger = started + LEDGER_EVERY_SECONDS
            except aiohttp.ClientError:
                self.failures += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    async def _main(self) -> None:
        # A session per page, as browsers' tabs would each hold their own cookie.
        sessions = [aiohttp.ClientSession() for _ in range(self.count)]
        try:
            await asyncio.gather(*(self._page(s) for s in sessions))
        finally:
            for s in sessions:
                await s.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--consoles", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument(
        "--idle-seconds", type=float, default=15.0, help="length of each no-flood cost measurement"
    )
    args = p.parse_args(argv)
    if not 1 <= args.consoles <= CONSOLES_MAX:
        p.error(f"--consoles must be within 1..{CONSOLES_MAX}")
    if not 1 <= args.rounds <= 20 or not 2 <= args.seconds <= 300:
        p.error("--rounds must be 1..20 and --seconds 2..300")
    if not 2 <= args.idle_seconds <= 300:
        p.error("--idle-seconds must be 2..300")

    mysql = os.environ.get("GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate_console_bench")
    redis_url = os.environ.get("GATE_REDIS_URL", "redis://127.0.0.1:6379/12")
    jwt_secret = "console-bench-jwt-" + secrets.token_hex(24)
    admin_token = "console-bench-admin-" + secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
    env.update(
        {
            "GATE_ENV": "bench",
            "GATE_CONSOLE": "1",
            "GATE_MYSQL_URL": mysql,
            "GATE_REDIS_URL": redis_url,
            "GATE_JWT_SECRET": jwt_secret,
            "GATE_ADMIN_TOKEN": admin_token,
            "GATE_WEBHOOK_SECRET": "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode(),
            "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
            # Required outside dev; nothing here pays.
            "GATE_PAYMENT_PROVIDER": "sandbox",
            "GATE_LOG_LEVEL": "WARNING",
            **{f"GATE_LIMIT_{s}": "off" for s in ("DEAL", "USER", "IP", "DEVICE", "GLOBAL")},
        }
    )
    _reset(mysql, redis_url)
    port = procs.free_port()
    gate_bin = str(Path(sys.executable).with_name("gate"))
    log_path = Path(tempfile.mkdtemp(prefix="console-bench-")) / "gate.log"
    gate = procs.Server(
        "gate",
        [gate_bin, "serve", "--port", str(port), "--workers", str(args.workers)],
        env,
        port,
        log_path,
        ROOT,
    )
    admin = {"Authorization": f"Bearer {admin_token}"}
    out: dict[str, Any] = {"args": vars(args), "rounds": [], "gate_log": str(log_path)}
    try:
        gate.wait_ready("/readyz")
        status, body = http_json(
            "POST",
            gate.url + "/v1/admin/deals",
            {"title": "console bench", "unit_price": 100, "currency": "EUR", "stock": 1},
            admin,
        )
        assert status == 201, body
        deal_id = int(body["id"])
        mint = TokenMint(jwt_secret)
        status, body = http_json(
            "POST",
            f"{gate.url}/v1/deals/{deal_id}/reservations",
            {"quantity": 1},
            {"Authorization": mint.header(1), "Idempotency-Key": "console-bench-sellout"},
        )
        assert status == 201, body
        tokens = log_path.with_name("tokens.txt")
        write_token_file(tokens, jwt_secret, range(1000, 11_000), 7200)
        # What the consoles cost the gate by themselves: its CPU per second with no
        # flood, without and with the consoles (the idle gate's own loops included).
        idle: dict[str, float] = {}
        for mode in ("none", "consoles"):
            pids = gate.pids()
            cpu_before, started = procs.cpu_seconds(pids), time.monotonic()
            if mode == "none":
                time.sleep(args.idle_seconds)
            else:
                with Consoles(gate.url, admin_token, deal_id, args.consoles):
                    time.sleep(args.idle_seconds)
            spent = procs.cpu_seconds(pids) - cpu_before
            idle[mode] = round(spent / (time.monotonic() - started) * 1000, 1)
            say(f"no flood, {mode:8s}: gate CPU {idle[mode]} ms per second")
        out["idle_gate_cpu_ms_per_s"] = idle
        say("warming up")
        wrkrun.reserve_loop(gate.url, deal_id, tokens, "w", args.connections, 3, args.threads)
        for i in range(args.rounds):
            for mode in ("none", "consoles"):
                polls = failures = 0
                pids = gate.pids()
                cpu_before = procs.cpu_seconds(pids)
                if mode == "none":
                    result = wrkrun.reserve_loop(
                        gate.url,
                        deal_id,
                        tokens,
                        f"r{i}n",
                        args.connections,
                        args.seconds,
                        args.threads,
                    )
                else:
                    with Consoles(gate.url, admin_token, deal_id, args.consoles) as pages:
                        time.sleep(1.5)  # signed in and polling before the flood starts
                        result = wrkrun.reserve_loop(
                            gate.url,
                            deal_id,
                            tokens,
                            f"r{i}c",
                            args.connections,
                            args.seconds,
                            args.threads,
                        )
                        polls, failures = pages.polls, pages.failures
                cpu_s = procs.cpu_seconds(pids) - cpu_before
                rate = result.count(409) / result.duration_s
                row = {
                    "round": i,
                    "mode": mode,
                    "sold_out_per_s": round(rate, 1),
                    # Gate CPU per answered request: far less noisy than a rate on a
                    # shared machine. The CPU includes serving the consoles; the count is
                    # the flood's requests only.
                    "gate_cpu_us_per_request": round(cpu_s / max(1, result.requests) * 1e6, 1),
                    "status": {str(k): v for k, v in sorted(result.status.items())},
                    "console_polls": polls,
                    "console_failures": failures,
                }
                out["rounds"].append(row)
                say(
                    f"round {i} {mode:8s} sold-out rejections/s {rate:,.0f},"
                    f" gate CPU/request {row['gate_cpu_us_per_request']} µs"
                    + (f" (console polls {polls}, failures {failures})" if mode != "none" else "")
                )
    finally:
        gate.stop()
    none = [r["sold_out_per_s"] for r in out["rounds"] if r["mode"] == "none"]
    with_consoles = [r["sold_out_per_s"] for r in out["rounds"] if r["mode"] == "consoles"]
    out["none_mean"] = round(sum(none) / len(none), 1)
    out["consoles_mean"] = round(sum(with_consoles) / len(with_consoles), 1)
    out["ratio"] = round(out["consoles_mean"] / max(out["none_mean"], 1e-9), 3)
    cpu_none = [r["gate_cpu_us_per_request"] for r in out["rounds"] if r["mode"] == "none"]
    cpu_with = [r["gate_cpu_us_per_request"] for r in out["rounds"] if r["mode"] == "consoles"]
    # The same verdict by cost: the cheaper run's CPU per request over the other's.
    out["ratio_by_cpu"] = round(
        (sum(cpu_none) / len(cpu_none)) / max(sum(cpu_with) / len(cpu_with), 1e-9), 3
    )
    out["target"] = TARGET_RATIO
    out["meets_target"] = out["ratio"] >= TARGET_RATIO
    say(
        f"mean sold-out rejections/s: none {out['none_mean']:,.0f}, with {args.consoles}"
        f" consoles {out['consoles_mean']:,.0f}: ratio {out['ratio']} (target ≥ {TARGET_RATIO});"
        f" by gate CPU per request {out['ratio_by_cpu']}"
    )
    print(json.dumps(out))
    return 0


def _reset(mysql_url: str, redis_url: str) -> None:
    import redis

    from gate.base.settings import MysqlTarget
    from gate.store.migrate import migrate

    target = MysqlTarget.parse(mysql_url)
    import pymysql

    conn = pymysql.connect(
        host=target.host, port=target.port, user=target.user, password=target.password.reveal()
    )
    try:
        with conn.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
    finally:
        conn.close()
    asyncio.run(migrate(target))
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()


if __name__ == "__main__":
    raise SystemExit(main())
