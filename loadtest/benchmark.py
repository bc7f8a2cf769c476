"""The benchmark runner behind `loadtest/bench`: the gate and the peer baseline side by
side, in one run, on one machine, every target reported as a ratio of that run.

Phases (all by default; `--only` picks some):
  ratio     sold-out rejections/s against the same gate process's /healthz (≥ 0.9 in
            every round)
  limiter   rate-limited rejections/s against sold-out rejections/s of one gate
            started with a per-user limit (GATE_LIMIT_USER, default 1/m burst 1),
            a few buyers hammering (≥ 0.9)
  buckets   committed reservations/s on one hot deal, 1/4/16/64 buckets × several
            connection counts, against the baseline at the same counts (≥ 3×)
  sellout   10,000 units to 100,000 buyers making one attempt each: time to sell
            out, oversold 0, lost 0, DB reservation attempts ≤ 1.05 × units
  latency   p50/p99 at 50 % and 90 % of the peak found by `buckets`
  expiry    holds released/s as a user sees it: `--expiry-holds` (50,000) holds made
            through the API (distinct buyers, per-user limit 1, 8 buckets), every
            deadline moved to one instant, only the sweepers inside the run's
            `gate serve`, until the public deal view shows every unit (≥ 10,000/s)
  peer      committed reservations/s as users run it: a 16-bucket deal against the lean
            DB-only peer (loadtest/baseline/lean.py), both with --workers (2) at 64 and
            256 connections (≥ 3×), and both with 1 worker at 64 connections (≥ 1.5×)

It owns two databases (gate_bench and gate_bench_baseline, renamed with --db-prefix)
and one Redis logical database (--redis-url): it drops and flushes them first.
Writes docs/benchmarks.md, docs/img/bench-*.png and the curve in docs/buckets.md
(with --quick: everything under the results directory only). Exit status: 0 when
every target is met, 1 on a correctness breach, 2 when a performance target is not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest import procs, report, wrkrun
from loadtest.tokens import TokenMint, write_token_file

ROOT = Path(__file__).resolve().parent.parent
GATE_BIN = str(Path(sys.executable).with_name("gate"))
BIG_STOCK = 50_000_000
BUFFER_POOL_BYTES = 1 << 30
# Latency runs: short runs searching the pause that offers the wanted share of the peak.
CALIBRATION_STEPS_MAX = 6
CALIBRATION_TOLERANCE = 0.05
# Within what one gate process admits at once (GATE_RESERVATION_INFLIGHT_MAX's default)
# and what one wrk thread drives without becoming the bottleneck.
LATENCY_CONNECTIONS_MAX = 1024
TOKEN_TTL_SECONDS = 6 * 3600
USER_BASE_LOOP = 10**12
USER_BASE_ONCE = 2 * 10**12
USER_BASE_SETUP = 3 * 10**12
USER_BASE_FEW = 4 * 10**12
LIMIT_VARS = (
    "GATE_LIMIT_IP",
    "GATE_LIMIT_USER",
    "GATE_LIMIT_DEVICE",
    "GATE_LIMIT_DEAL",
    "GATE_LIMIT_GLOBAL",
)
PHASES = ("ratio", "limiter", "buckets", "sellout", "latency", "peer", "expiry")
EXPIRY_BUCKETS = 8
EXPIRY_TARGET_PER_S = 10_000
# Long enough for the UPDATE of 50,000 deadlines on a loaded 2-core machine (3 s was not).
EXPIRY_LEAD_SECONDS = 8.0
EXPIRY_TIMEOUT_SECONDS = 120.0
USER_BASE_EXPIRY = 5 * 10**12
# The peer phase: the settings users run, not the ones that flatter the gate.
PEER_BUCKETS = 16
PEER_CONNECTIONS = (64, 256)
PEER_ONE_WORKER_CONNECTIONS = 64
PEER_TARGET = 3.0
PEER_ONE_WORKER_TARGET = 1.5
NOISE_SAMPLE_SECONDS = 2.0
RATIO_WARMUP_MIN_SECONDS = 3.0


@dataclass
class Plan:
    quick: bool
    workers: int
    threads: int
    duration_s: float
    warmup_s: float
    rounds: int
    ratio_connections: int
    limiter_users: int
    limiter_spec: str
    connections: list[int]
    buckets: list[int]
    buyers: int
    units: int
    attempts: int
    sellout_connections: int
    sellout_buckets: int | None
    sellout_baseline: bool
    latency_s: float
    latency_loads: list[float]
    phases: list[str]
    argv: list[str] = field(default_factory=list)
    keep_buffer_pool: bool = False
    expiry_holds: int = 50_000


def plan_from(args: argparse.Namespace, argv: list[str]) -> Plan:
    quick = bool(args.quick)

    def pick(value: Any, full: Any, short: Any) -> Any:
        return value if value is not None else (short if quick else full)

    return Plan(
        quick=quick,
        workers=args.workers,
        threads=args.threads,
        duration_s=pick(args.duration, 8.0, 2.0),
        warmup_s=pick(args.warmup, 2.0, 1.0),
        rounds=pick(args.rounds, 2, 1),
        ratio_connections=args.ratio_connections,
        limiter_users=args.limiter_users,
        limiter_spec=args.limiter_spec,
        connections=pick(args.connections, [16, 64, 256], [32]),
        buckets=pick(args.buckets, [1, 4, 16, 64], [1, 16]),
        buyers=pick(args.buyers, 1_000, 500),
        units=pick(args.units, 10_000, 1_000),
        attempts=pick(args.attempts, 100_000, 10_000),
        sellout_connections=pick(args.sellout_connections, 512, 128),
        sellout_buckets=args.sellout_buckets,
        sellout_baseline=not args.no_sellout_baseline,
        latency_s=pick(args.latency_duration, 8.0, 2.0),
        latency_loads=[0.5, 0.9],
        # The latency runs are set relative to the peak the buckets phase finds.
        phases=sorted(
            set(args.only or PHASES) | ({"buckets"} if "latency" in (args.only or []) else set()),
            key=PHASES.index,
        ),
        argv=argv,
        keep_buffer_pool=bool(args.keep_buffer_pool),
        expiry_holds=pick(args.expiry_holds, 50_000, 5_000),
    )


# -- small helpers --------------------------------------------------------------------------


def say(text: str) -> None:
    print(f"==> {text}", flush=True)


def http_json(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = orjson.dumps(body) if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, orjson.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read() or b"null")


def _mean(values: Any) -> float:
    items = list(values)
    return round(sum(items) / len(items), 1) if items else 0.0


def _costs(rounds: list[dict[str, Any]], *runs: str) -> dict[str, float]:
    """Mean gate CPU per request of each named run of the rounds ("<run>_cpu_us")."""
    return {f"{run}_cpu_us": _mean(r[run]["cpu_us_per_request"] for r in rounds) for run in runs}


def _ratio(part: float, whole: float) -> float:
    """A target's ratio: of throughputs (requests per second), or of costs (the
    cheaper request's CPU per request over the other's, what the throughput ratio
    comes to when the gate's CPU is the bottleneck; unlike requests per second it
    does not depend on how the kernel spread wrk's connections over the workers: a
    run in which one worker got most of them is capped near one core)."""
    return round(part / whole, 3) if whole else 0.0


def server_url(mysql_url: str, database: str) -> str:
    base, _, query = mysql_url.partition("?")
    return base.rsplit("/", 1)[0] + "/" + database + (f"?{query}" if query else "")


class Bench:
    def __init__(self, plan: Plan, args: argparse.Namespace) -> None:
        self.plan = plan
        self.args = args
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.results_dir = Path(args.results or ROOT / "loadtest" / "results" / f"bench-{stamp}")
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.tag = "bench" + secrets.token_hex(4)
        mysql = args.mysql_url or os.environ.get(
            "GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate"
        )
        self.gate_mysql = server_url(mysql, f"{args.db_prefix}")
        self.baseline_mysql = server_url(mysql, f"{args.db_prefix}_baseline")
        self.redis_url = args.redis_url
        self.jwt_secret = "bench-jwt-" + secrets.token_hex(24)
        self.admin_token = "bench-admin-" + secrets.token_hex(16)
        webhook = "whsec_" + __import__("base64").b64encode(secrets.token_bytes(24)).decode()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
        self.env.update(
            {
                "GATE_ENV": "bench",
                "GATE_MYSQL_URL": self.gate_mysql,
                "GATE_REDIS_URL": self.redis_url,
                "GATE_JWT_SECRET": self.jwt_secret,
                "GATE_ADMIN_TOKEN": self.admin_token,
                "GATE_WEBHOOK_SECRET": webhook,
                "GATE_ADMISSION_SECRET": "bench-admission-" + secrets.token_hex(24),
                "GATE_PAYMENT_PROVIDER": "sandbox",
                "GATE_LOG_LEVEL": "WARNING",
                "BASELINE_MYSQL_URL": self.baseline_mysql,
                "PYTHONPATH": str(ROOT),
                **{name: "off" for name in LIMIT_VARS},
            }
        )
        # The operator's other settings (pool sizes, …) pass through; the ones above stay
        # the runner's (every limiter off, the run's own secrets and stores).
        for key, value in os.environ.items():
            if key.startswith("GATE_") and key not in (
                "GATE_MYSQL_URL",
                "GATE_REDIS_URL",
                "GATE_ENV",
            ):
                self.env.setdefault(key, value)
        self.admin = {"Authorization": f"Bearer {self.admin_token}"}
        self.gate: procs.Server | None = None
        self.baseline: procs.Server | None = None
        self.results: dict[str, Any] = {"plan": plan.__dict__, "phases": {}}
        self.commands: dict[str, str] = {}

    # -- set-up ---------------------------------------------------------------------------

    def reset_stores(self) -> None:
        import redis

        from gate.base.settings import MysqlTarget
        from loadtest.baseline.store import migrate

        async def drop() -> None:
            import aiomysql

            from gate.store.db import connect_kwargs, notes_off

            target = MysqlTarget.parse(self.gate_mysql)
            conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
            try:
                async with conn.cursor() as cur:
                    await notes_off(cur)
                    await cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
            finally:
                conn.close()
            await migrate(MysqlTarget.parse(self.baseline_mysql), drop=True)

        asyncio.run(drop())
        client = redis.Redis.from_url(self.redis_url)
        client.flushdb()
        client.close()

    def mint_tokens(self) -> None:
        say("minting buyer tokens")
        self.loop_tokens = self.results_dir / "tokens-loop.txt"
        self.once_tokens = self.results_dir / "tokens-once.txt"
        self.baseline_once_tokens = self.results_dir / "tokens-once-baseline.txt"
        write_token_file(
            self.loop_tokens,
            self.jwt_secret,
            range(USER_BASE_LOOP, USER_BASE_LOOP + self.plan.buyers),
            TOKEN_TTL_SECONDS,
        )
        if "limiter" in self.plan.phases:
            self.few_tokens = self.results_dir / "tokens-few.txt"
            write_token_file(
                self.few_tokens,
                self.jwt_secret,
                range(USER_BASE_FEW, USER_BASE_FEW + self.plan.limiter_users),
                TOKEN_TTL_SECONDS,
            )
        if "sellout" in self.plan.phases:
            first = USER_BASE_ONCE
            write_token_file(
                self.once_tokens,
                self.jwt_secret,
                range(first, first + self.plan.attempts),
                TOKEN_TTL_SECONDS,
            )
            if self.plan.sellout_baseline:
                first = USER_BASE_ONCE + self.plan.attempts
                write_token_file(
                    self.baseline_once_tokens,
                    self.jwt_secret,
                    range(first, first + self.plan.attempts),
                    TOKEN_TTL_SECONDS,
                )

    def check_connections(self) -> None:
        """Both servers' pools fill up during the run; MariaDB refuses past its limit."""
        pool = int(self.env.get("GATE_DB_POOL_MAX", "32"))
        # The limiter phase's own gate runs while the other two are idle and opens
        # few connections (its buyers reach the database once each): not counted.
        servers = 3 if "peer" in self.plan.phases else 2
        need = servers * self.plan.workers * pool + 10
        limit = int(self.sql(None, "SELECT @@max_connections")[0][0])
        used = int(self.sql(None, "SHOW GLOBAL STATUS LIKE 'Threads_connected'")[0][1])
        if limit - used < need:
            say(
                f"WARNING: MariaDB allows {limit} connections, {used} in use; this run may"
                f" open {need} ({servers} servers × {self.plan.workers} workers × GATE_DB_POOL_MAX"
                f" {pool}). Raise max_connections or lower GATE_DB_POOL_MAX."
            )

    def gate_args(self) -> list[str]:
        workers = str(self.plan.workers)
        return [GATE_BIN, "serve", "--port", str(procs.free_port()), "--workers", workers]

    def start_servers(self) -> None:
        self.check_connections()
        workers = str(self.plan.workers)
        gate_args = self.gate_args()
        base_args = [sys.executable, "-m", "loadtest.baseline", "serve"]
        base_args += ["--port", str(procs.free_port()), "--workers", workers]
        self.commands["gate"] = shlex.join(["gate", *gate_args[1:]])
        self.commands["baseline"] = shlex.join(["python", *base_args[1:]])
        say(f"starting the gate: {self.commands['gate']}")
        self.gate = procs.Server(
            "gate",
            gate_args,
            self.env,
            int(gate_args[3]),
            self.results_dir / "gate.log",
            ROOT,
        )
        say(f"starting the baseline: {self.commands['baseline']}")
        self.baseline = procs.Server(
            "baseline",
            base_args,
            self.env,
            int(base_args[5]),
            self.results_dir / "baseline.log",
            ROOT,
        )
        self.gate.wait_ready("/readyz")
        self.baseline.wait_ready("/healthz")

    def stop_servers(self) -> None:
        for server in (self.gate, self.baseline):
            if server is not None:
                server.stop()

    def meter(self, server: procs.Server) -> procs.CpuMeter:
        return procs.CpuMeter(
            {
                server.name: server.pids(),
                "mariadb": procs.pids_named("mariadbd", "mysqld"),
                "redis": procs.pids_named("redis-server"),
            }
        )

    def create_deal(self, server: procs.Server, stock: int, buckets: int) -> int:
        status, body = http_json(
            "POST",
            server.url + "/v1/admin/deals",
            {
                "title": f"bench {buckets} bucket(s)",
                "unit_price": 1000,
                "currency": "EUR",
                "stock": stock,
                "buckets": buckets,
                "hold_seconds": 3600,
                "max_per_order": 1,
            },
            self.admin,
        )
        if status != 201:
            raise RuntimeError(f"{server.name}: creating a deal answered {status}: {body}")
        return int(body["id"])

    def sold_out_deal(self, server: procs.Server, key: str) -> int:
        """A deal of one unit, sold before any measurement."""
        deal_id = self.create_deal(server, 1, 1)
        mint = TokenMint(self.jwt_secret)
        status, body = http_json(
            "POST",
            f"{server.url}/v1/deals/{deal_id}/reservations",
            {"quantity": 1},
            {"Authorization": mint.header(USER_BASE_SETUP), "Idempotency-Key": key},
        )
        if status != 201:
            raise RuntimeError(f"could not sell deal {deal_id} out: {status} {body}")
        return deal_id

    def orders_of(self, database_url: str, deal_id: int) -> dict[str, Any]:
        rows = self.sql(
            database_url,
            "SELECT COUNT(*), COALESCE(SUM(quantity), 0), MIN(created_at), MAX(created_at)"
            " FROM orders WHERE deal_id = %s",
            (deal_id,),
        )
        count, units, first, last = rows[0]
        return {"count": int(count), "units": int(units), "first": first, "last": last}

    def sql(self, database_url: str | None, query: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """One query on its own connection; `database_url` None: the server, no database."""
        import pymysql

        from gate.base.settings import MysqlTarget

        target = MysqlTarget.parse(database_url or self.gate_mysql)
        kwargs: dict[str, Any] = {
            "user": target.user,
            "password": target.password.reveal(),
            "autocommit": True,
        }
        if database_url is not None:
            kwargs["database"] = target.database
        if target.unix_socket:
            kwargs["unix_socket"] = target.unix_socket
        else:
            kwargs.update(host=target.host, port=target.port)
        conn = pymysql.connect(**kwargs)
        try:
            with conn.cursor() as cur:
                cur.execute("SET time_zone = '+00:00'")
                cur.execute(query, args)
                return list(cur.fetchall())
        finally:
            conn.close()

    def db_attempts(self, server: procs.Server) -> int:
        """Reservations the gate has sent to the database (its own count, every worker:
        each reservation of a group and every retry counts)."""
        from gate.base.metrics import sample_values, value_of

        with urllib.request.urlopen(server.metrics_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return int(value_of(sample_values(text), "gate_reservation_db_attempts_total"))

    def calls(self) -> int:
        """Stored-procedure calls the server has run, all clients together."""
        rows = self.sql(None, "SHOW GLOBAL STATUS LIKE 'Com_call_procedure'")
        return int(rows[0][1])

    def database_of(self, server: procs.Server) -> str:
        """The gates (every one this run starts is named "gate") write the gate's database;
        the article's baseline and the lean peer share the baseline's."""
        return self.gate_mysql if server.name == "gate" else self.baseline_mysql

    def measured(
        self, server: procs.Server, deal_id: int, connections: int, seconds: float, delay_ms: float
    ) -> dict[str, Any]:
        """One measured loop run: DB-side committed/s, latency, CPU per component."""
        db = self.database_of(server)
        before = self.orders_of(db, deal_id)["count"]
        result, cpu, cpu_s = self.timed(
            server,
            wrkrun.reserve_loop,
            server.url,
            deal_id,
            self.loop_tokens,
            self.tag,
            connections,
            seconds,
            self.plan.threads,
            delay_ms,
        )
        after = self.orders_of(db, deal_id)["count"]
        committed = (after - before) / result.duration_s
        out = result.to_json()
        out.update(
            {
                "cpu_us_per_commit": self.per_request_us(cpu_s, after - before),
                "committed_per_s": round(committed, 1),
                "answered_per_s": round(result.rps, 1),
                "cpu_cores": cpu,
                "connections": connections,
            }
        )
        return out

    def warm(
        self, server: procs.Server, deal_id: int, connections: int, seconds: float | None = None
    ) -> None:
        """Warm pools and caches on this deal. Each worker verifies a buyer's token once
        and caches it; the warm-up lets every worker see (nearly) every buyer, so the
        measured runs compare the paths, not first-time token verification."""
        seconds = self.plan.warmup_s if seconds is None else seconds
        if seconds > 0:
            wrkrun.reserve_loop(
                server.url,
                deal_id,
                self.loop_tokens,
                self.tag + "w",
                connections,
                seconds,
                self.plan.threads,
            )

    def timed(
        self, server: procs.Server, run: Any, *args: Any
    ) -> tuple[Any, dict[str, float], float]:
        """Run `run(*args)` (one wrk run) and measure the server's CPU during it: the cores
        of every component, and the server's own CPU seconds (all its processes)."""
        meter = self.meter(server)
        pids = server.pids()
        before = procs.cpu_seconds(pids)
        meter.start()
        result = run(*args)
        cores = meter.stop()
        return result, cores, procs.cpu_seconds(pids) - before

    @staticmethod
    def per_request_us(cpu_s: float, requests: int) -> float:
        """Server CPU per answered request, µs: far less noisy on a shared machine
        than requests per second."""
        return round(cpu_s / max(1, requests) * 1e6, 1)

    # -- phases ---------------------------------------------------------------------------

    def phase_ratio(self) -> dict[str, Any]:
        assert self.gate is not None
        say("ratio: sold-out rejections/s against /healthz of the same gate")
        c = self.plan.ratio_connections
        deal_id = self.sold_out_deal(self.gate, "bench-sellout-0")
        self.warm(self.gate, deal_id, c, max(self.plan.warmup_s, RATIO_WARMUP_MIN_SECONDS))
        rounds = []
        gate = self.gate
        for i in range(self.plan.rounds):
            health, health_cpu, health_s = self.timed(
                gate, wrkrun.get, gate.url, "/healthz", c, self.plan.duration_s, self.plan.threads
            )
            sold_out, sold_out_cpu, sold_out_s = self.timed(
                gate,
                wrkrun.reserve_loop,
                gate.url,
                deal_id,
                self.loop_tokens,
                f"{self.tag}r{i}",
                c,
                self.plan.duration_s,
                self.plan.threads,
            )
            rejected = sold_out.count(409)
            rounds.append(
                {
                    "healthz": {
                        **health.to_json(),
                        "cpu_cores": health_cpu,
                        "cpu_us_per_request": self.per_request_us(health_s, health.requests),
                    },
                    "sold_out": {
                        **sold_out.to_json(),
                        "cpu_cores": sold_out_cpu,
                        "cpu_us_per_request": self.per_request_us(sold_out_s, sold_out.requests),
                    },
                    "healthz_per_s": round(health.rps, 1),
                    "rejections_per_s": round(rejected / sold_out.duration_s, 1),
                    "rejected_share": round(rejected / max(1, sold_out.requests), 4),
                }
            )
        health_rps = sum(r["healthz_per_s"] for r in rounds) / len(rounds)
        reject_rps = sum(r["rejections_per_s"] for r in rounds) / len(rounds)
        out = {
            "connections": c,
            "rounds": rounds,
            "healthz_per_s": round(health_rps, 1),
            "rejections_per_s": round(reject_rps, 1),
            "ratio": _ratio(reject_rps, health_rps),
            **_costs(rounds, "healthz", "sold_out"),
            # Held in every round of the run, not on average.
            "target": 0.9,
        }
        out["ratio_by_cpu"] = _ratio(out["healthz_cpu_us"], out["sold_out_cpu_us"])
        return out

    def phase_limiter(self) -> dict[str, Any]:
        """A few buyers hammering one deal with stock, each over its per-user limit
        after its first click, against the same buyers on a sold-out deal: one gate
        process (started for this phase with GATE_LIMIT_USER), alternating runs."""
        c = self.plan.ratio_connections
        spec = self.plan.limiter_spec
        say(
            f"limiter: rate-limited rejections/s against sold-out rejections/s"
            f" (GATE_LIMIT_USER={spec!r}, {self.plan.limiter_users} buyers)"
        )
        args = self.gate_args()
        self.commands["limiter_gate"] = shlex.join([f"GATE_LIMIT_USER={spec}", "gate", *args[1:]])
        gate = procs.Server(
            "gate",
            args,
            {**self.env, "GATE_LIMIT_USER": spec},
            int(args[3]),
            self.results_dir / "gate-limiter.log",
            ROOT,
        )
        try:
            gate.wait_ready("/readyz")
            return self._limiter_rounds(gate, c)
        finally:
            gate.stop()

    def _limiter_rounds(self, gate: procs.Server, c: int) -> dict[str, Any]:
        sold_deal = self.sold_out_deal(gate, "bench-limit-0")
        open_deal = self.create_deal(gate, BIG_STOCK, 1)
        warm_s = max(self.plan.warmup_s, RATIO_WARMUP_MIN_SECONDS)
        # The warm-up verifies and caches every buyer's token in every worker and
        # spends each buyer's one admission on the open deal: from then on every
        # click there is refused by the per-user limiter.
        for deal_id in (sold_deal, open_deal):
            wrkrun.reserve_loop(
                gate.url, deal_id, self.few_tokens, self.tag + "lw", c, warm_s, self.plan.threads
            )
        rounds = []
        for i in range(self.plan.rounds):
            runs: dict[str, Any] = {}
            for name, deal_id, status in (
                ("sold_out", sold_deal, 409),
                ("limited", open_deal, 429),
            ):
                result, cores, cpu_s = self.timed(
                    gate,
                    wrkrun.reserve_loop,
                    gate.url,
                    deal_id,
                    self.few_tokens,
                    f"{self.tag}l{name[0]}{i}",
                    c,
                    self.plan.duration_s,
                    self.plan.threads,
                )
                runs[name] = {
                    **result.to_json(),
                    "cpu_cores": cores,
                    "cpu_us_per_request": self.per_request_us(cpu_s, result.requests),
                    "rejections_per_s": round(result.count(status) / result.duration_s, 1),
                    "rejected_share": round(result.count(status) / max(1, result.requests), 4),
                }
            rounds.append(runs)
        sold_rps = _mean(r["sold_out"]["rejections_per_s"] for r in rounds)
        limited_rps = _mean(r["limited"]["rejections_per_s"] for r in rounds)
        out: dict[str, Any] = {
            "connections": c,
            "buyers": self.plan.limiter_users,
            "limit_user": self.plan.limiter_spec,
            "rounds": rounds,
            "sold_out_per_s": sold_rps,
            "limited_per_s": limited_rps,
            "ratio": _ratio(limited_rps, sold_rps),
            **_costs(rounds, "sold_out", "limited"),
            "target": 0.9,
        }
        out["ratio_by_cpu"] = _ratio(out["sold_out_cpu_us"], out["limited_cpu_us"])
        return out

    def phase_buckets(self) -> dict[str, Any]:
        assert self.gate is not None and self.baseline is not None
        say("buckets: committed reservations/s on one hot deal")
        gate_runs: dict[str, dict[str, Any]] = {}
        for c in self.plan.connections:
            for n in self.plan.buckets:
                deal_id = self.create_deal(self.gate, BIG_STOCK, n)
                self.warm(self.gate, deal_id, c)
                run = self.measured(self.gate, deal_id, c, self.plan.duration_s, 0.0)
                gate_runs[f"{n}/{c}"] = {"buckets": n, **run}
                say(f"  gate {n:>3} bucket(s), {c:>4} connections: {run['committed_per_s']}/s")
        base_runs: dict[str, dict[str, Any]] = {}
        for c in self.plan.connections:
            deal_id = self.create_deal(self.baseline, BIG_STOCK, 1)
            self.warm(self.baseline, deal_id, c)
            run = self.measured(self.baseline, deal_id, c, self.plan.duration_s, 0.0)
            base_runs[str(c)] = run
            say(f"  baseline, {c:>4} connections: {run['committed_per_s']}/s")
        best_key = max(gate_runs, key=lambda k: gate_runs[k]["committed_per_s"])
        best_base = max(base_runs, key=lambda k: base_runs[k]["committed_per_s"])
        best = gate_runs[best_key]
        base = base_runs[best_base]
        return {
            "gate": gate_runs,
            "baseline": base_runs,
            "best": {"buckets": best["buckets"], "connections": best["connections"]},
            "best_per_s": best["committed_per_s"],
            "baseline_best": {"connections": base["connections"]},
            "baseline_best_per_s": base["committed_per_s"],
            "ratio": round(best["committed_per_s"] / base["committed_per_s"], 3)
            if base["committed_per_s"]
            else 0.0,
            "target": 3.0,
        }

    def sellout_run(self, server: procs.Server, buckets: int, tokens: Path) -> dict[str, Any]:
        db = self.gate_mysql if server is self.gate else self.baseline_mysql
        deal_id = self.create_deal(server, self.plan.units, buckets)
        # Com_call_procedure counts every client of the server: measure what the
        # others add while this run's servers are idle, to show how much of the
        # count is noise.
        noise_before = self.calls()
        time.sleep(NOISE_SAMPLE_SECONDS)
        noise_rate = (self.calls() - noise_before) / NOISE_SAMPLE_SECONDS
        db_start = self.sql(db, "SELECT NOW(6)")[0][0]
        calls_before = self.calls()
        attempts_before = self.db_attempts(server) if server is self.gate else 0
        meter = self.meter(server)
        meter.start()
        result = wrkrun.reserve_once(
            server.url,
            deal_id,
            tokens,
            self.tag + "s",
            self.plan.sellout_connections,
            self.plan.threads,
        )
        cpu = meter.stop()
        calls = self.calls() - calls_before
        orders = self.orders_of(db, deal_id)
        verdict = self.verify(server, deal_id)
        numbers = verdict.get("numbers", {})
        sold_out_at = (
            (orders["last"] - db_start).total_seconds() if orders["last"] is not None else None
        )
        out = {
            "deal_id": deal_id,
            "buckets": buckets,
            "units": self.plan.units,
            "attempts": self.plan.attempts,
            "connections": self.plan.sellout_connections,
            "wrk": result.to_json(),
            "cpu_cores": cpu,
            "all_answered_s": result.extra.get("wall_s"),
            "finished": result.extra.get("finished"),
            "time_to_sell_out_s": round(sold_out_at, 3) if sold_out_at is not None else None,
            "orders": orders["count"],
            "units_ordered": orders["units"],
            "client_201": result.count(201),
            "client_409": result.count(409),
            "client_other": result.requests - result.fillers - result.count(201, 409),
            "oversold": numbers.get("oversold"),
            "lost": numbers.get("lost"),
            "unsold": numbers.get("available"),
            # Units left over although every buyer got 201 or 409 were turned away
            # while they existed: ghost stock. Units left after some buyers were shed
            # (503/429, no retry in this run) are only unsold.
            "ghost": numbers.get("available")
            if result.requests - result.fillers - result.count(201, 409) == 0
            else 0,
            "invariant_ok": verdict.get("ok"),
            "breaches": verdict.get("breaches", []),
            "redis": verdict.get("redis"),
        }
        if server is self.gate:
            attempts = self.db_attempts(server) - attempts_before
            out["db_attempts"] = attempts
            out["db_attempts_per_unit"] = round(attempts / self.plan.units, 4)
            out["db_calls"] = calls
            out["db_calls_per_unit"] = round(calls / self.plan.units, 4)
            wall = float(result.extra.get("wall_s") or 0)
            out["db_calls_noise_per_s"] = round(noise_rate, 1)
            out["db_calls_less_noise"] = max(0, round(calls - noise_rate * wall))
        else:
            # Every attempt of the baseline is a database transaction.
            out["db_attempts"] = out["db_calls"] = result.requests - result.fillers
            out["db_attempts_per_unit"] = round(out["db_calls"] / self.plan.units, 4)
            out["db_calls_per_unit"] = out["db_attempts_per_unit"]
        return out

    def verify(self, server: procs.Server, deal_id: int) -> dict[str, Any]:
        from loadtest import verify

        async def run() -> dict[str, Any]:
            import redis.asyncio as aioredis

            from gate.base.settings import load_settings
            from gate.store.db import Database

            env = {**self.env}
            if server is self.baseline:
                env["GATE_MYSQL_URL"] = self.baseline_mysql
            settings = load_settings(env)
            db = Database(settings, pool_max=4)
            await db.start()
            try:
                if server is self.baseline:
                    return await verify.verify_baseline_deal(db, deal_id)
                rds = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
                try:
                    return await verify.verify_gate_deal(db, rds, deal_id, None, 20.0)
                finally:
                    await rds.aclose()
            finally:
                await db.close()

        return asyncio.run(run())

    def phase_sellout(self, best_buckets: int | None) -> dict[str, Any]:
        assert self.gate is not None and self.baseline is not None
        buckets = self.plan.sellout_buckets or best_buckets or 16
        say(
            f"sellout: {self.plan.units} units, {self.plan.attempts} buyers, one attempt each"
            f" ({buckets} buckets)"
        )
        out: dict[str, Any] = {"gate": self.sellout_run(self.gate, buckets, self.once_tokens)}
        g = out["gate"]
        say(
            f"  gate: sold out in {g['time_to_sell_out_s']} s, oversold {g['oversold']},"
            f" lost {g['lost']}, ghost {g['ghost']}, unsold {g['unsold']},"
            f" DB calls {g['db_calls']}"
        )
        if self.plan.sellout_baseline:
            out["baseline"] = self.sellout_run(self.baseline, 1, self.baseline_once_tokens)
            b = out["baseline"]
            say(f"  baseline: sold out in {b['time_to_sell_out_s']} s, DB calls {b['db_calls']}")
        out["target_calls_per_unit"] = 1.05
        return out

    def at_load(
        self, server: procs.Server, buckets: int, connections: int, peak: float, share: float
    ) -> dict[str, Any]:
        """Latency at `share` of `peak` committed/s: each connection pauses between
        requests (exponential, mean d) so the offered rate is the target. Paused
        connections offer less than the peak's closed loop did (Little's law: connections
        = rate x (answer time + pause)), so when the peak's connections cannot offer the
        target even with short pauses, the run doubles them, up to
        LATENCY_CONNECTIONS_MAX, and searches again: the fewest connections that offer
        the rate."""
        target = peak * share
        deal_id = self.create_deal(server, BIG_STOCK, buckets)
        best: tuple[float, int, float] | None = None
        while True:
            grow = connections < LATENCY_CONNECTIONS_MAX
            error, delay = self.calibrate(server, deal_id, connections, target, grow)
            if best is None or abs(error) < abs(best[0]):
                best = (error, connections, delay)
            if error >= -CALIBRATION_TOLERANCE or not grow:
                break
            connections = min(LATENCY_CONNECTIONS_MAX, connections * 2)
        _, connections, delay = best
        run = self.measured(server, deal_id, connections, self.plan.latency_s, delay)
        run.update(
            {
                "share": share,
                "target_per_s": round(target, 1),
                "achieved_share": round(run["committed_per_s"] / peak, 3) if peak else 0.0,
                "delay_ms": round(delay, 3),
            }
        )
        return run

    def calibrate(
        self, server: procs.Server, deal_id: int, connections: int, target: float, grow: bool
    ) -> tuple[float, float]:
        """The pause that comes closest to `target` with these connections, and its
        relative error. Found by bisection over short runs: the committed rate falls as
        the pause grows, but not in proportion (a server's time per request changes
        with its load, a grouping one's most of all), so a one-step estimate can land
        anywhere. With `grow`, a search that is still short when the pause is a tenth
        of its upper end gives up early: more connections are needed."""
        calibrate_s = max(1.0, self.plan.latency_s / 4)
        # With no time spent in the server this pause alone would give the target, so
        # the rate it gives is at most the target: the upper end of the search.
        upper = max(1.0, connections / target * 1000.0)
        delay, low, high = upper, 0.0, None
        best: tuple[float, float] | None = None
        for _ in range(CALIBRATION_STEPS_MAX):
            probe = self.measured(server, deal_id, connections, calibrate_s, delay)
            error = probe["committed_per_s"] / target - 1.0
            if best is None or abs(error) < abs(best[0]):
                best = (error, delay)
            if abs(error) <= CALIBRATION_TOLERANCE:
                break
            if error < 0 and grow and delay <= upper / 10:
                break
            if error > 0:
                low = delay
            else:
                high = delay
            delay = (low + high) / 2 if high is not None else delay * 2
        assert best is not None
        return best

    def phase_latency(self, buckets_result: dict[str, Any] | None) -> dict[str, Any]:
        assert self.gate is not None and self.baseline is not None
        if buckets_result is None:
            raise RuntimeError("the latency phase needs the buckets phase (the peak)")
        say("latency: p50/p99 at 50 % and 90 % of the peak")
        best = buckets_result["best"]
        base = buckets_result["baseline_best"]
        out: dict[str, Any] = {"gate": [], "baseline": []}
        for share in self.plan.latency_loads:
            run = self.at_load(
                self.gate,
                best["buckets"],
                best["connections"],
                buckets_result["best_per_s"],
                share,
            )
            out["gate"].append(run)
            say(
                f"  gate at {run['achieved_share']:.0%} of peak:"
                f" p50 {run['latency_us']['p50'] / 1000:.2f} ms,"
                f" p99 {run['latency_us']['p99'] / 1000:.2f} ms"
            )
            brun = self.at_load(
                self.baseline,
                1,
                base["connections"],
                buckets_result["baseline_best_per_s"],
                share,
            )
            out["baseline"].append(brun)
        return out

    def start_lean(self, workers: int) -> procs.Server:
        args = [sys.executable, "-m", "loadtest.baseline", "serve", "--lean"]
        args += ["--port", str(procs.free_port()), "--workers", str(workers)]
        self.commands[f"lean_{workers}"] = shlex.join(["python", *args[1:]])
        server = procs.Server(
            "lean", args, self.env, int(args[6]), self.results_dir / f"lean-{workers}.log", ROOT
        )
        server.wait_ready("/healthz")
        return server

    def peer_row(
        self, gate: procs.Server, lean: procs.Server, workers: int, c: int, target: float
    ) -> dict[str, Any]:
        runs: dict[str, Any] = {}
        for name, server, buckets in (("gate", gate, PEER_BUCKETS), ("lean", lean, 1)):
            deal_id = self.create_deal(server, BIG_STOCK, buckets)
            self.warm(server, deal_id, c)
            runs[name] = self.measured(server, deal_id, c, self.plan.duration_s, 0.0)
        g, p = runs["gate"]["committed_per_s"], runs["lean"]["committed_per_s"]
        row = {
            "workers": workers,
            "connections": c,
            "buckets": PEER_BUCKETS,
            **runs,
            "ratio": _ratio(g, p),
            "target": target,
        }
        say(
            f"  {workers} worker(s), {c:>4} connections: gate {g}/s"
            f" ({runs['gate']['cpu_us_per_commit']} µs CPU per commit), lean peer {p}/s"
            f" → {row['ratio']}×"
        )
        return row

    def phase_peer(self) -> dict[str, Any]:
        """Committed reservations at the settings users run, against the lean peer: the
        run's gate (--workers) at 64 and 256 connections, then a 1-worker gate and peer."""
        assert self.gate is not None
        say(f"peer: committed reservations/s, {PEER_BUCKETS}-bucket deal, against the lean peer")
        rows = []
        lean = self.start_lean(self.plan.workers)
        try:
            for c in PEER_CONNECTIONS:
                rows.append(self.peer_row(self.gate, lean, self.plan.workers, c, PEER_TARGET))
        finally:
            lean.stop()
        if self.plan.workers != 1:
            args = [*self.gate_args()[:-1], "1"]
            self.commands["gate_1"] = shlex.join(["gate", *args[1:]])
            gate = procs.Server(
                "gate", args, self.env, int(args[3]), self.results_dir / "gate-1.log", ROOT
            )
            lean = self.start_lean(1)
            try:
                gate.wait_ready("/readyz")
                c = PEER_ONE_WORKER_CONNECTIONS
                rows.append(self.peer_row(gate, lean, 1, c, PEER_ONE_WORKER_TARGET))
            finally:
                gate.stop()
                lean.stop()
        return {"rows": rows}

    def phase_expiry(self) -> dict[str, Any]:
        """Expiry as a user sees it: holds made through the API, every deadline moved to
        one instant T (database clock), then only the run's `gate serve` sweepers; the
        measurement is T → the public deal view showing every unit available."""
        assert self.gate is not None
        n = self.plan.expiry_holds
        say(f"expiry: {n:,} holds made through the API, released by gate serve's sweepers")
        tokens = self.results_dir / "tokens-expiry.txt"
        first = USER_BASE_EXPIRY
        write_token_file(tokens, self.jwt_secret, range(first, first + n), TOKEN_TTL_SECONDS)
        status, body = http_json(
            "POST",
            self.gate.url + "/v1/admin/deals",
            {
                "title": "bench expiry",
                "unit_price": 1000,
                "currency": "EUR",
                "stock": n,
                "buckets": EXPIRY_BUCKETS,
                "hold_seconds": 3600,
                "max_per_order": 1,
                "per_user_limit": 1,
            },
            self.admin,
        )
        if status != 201:
            raise RuntimeError(f"creating the expiry deal answered {status}: {body}")
        deal_id = int(body["id"])
        try:
            made = wrkrun.reserve_once(
                self.gate.url, deal_id, tokens, self.tag + "e", 256, self.plan.threads
            )
        finally:
            tokens.unlink(missing_ok=True)
        holds = self.orders_of(self.gate_mysql, deal_id)["count"]
        say(f"  {holds:,} holds made ({made.count(201):,} answered 201)")
        lead_us = int(EXPIRY_LEAD_SECONDS * 1e6)
        self.sql(
            self.gate_mysql,
            "UPDATE orders SET expires_at = NOW(6) + INTERVAL %s MICROSECOND"
            " WHERE deal_id = %s AND status = 'PENDING_PAYMENT'",
            (lead_us, deal_id),
        )
        left = self.sql(
            self.gate_mysql,
            "SELECT TIMESTAMPDIFF(MICROSECOND, NOW(6), MIN(expires_at)) FROM orders"
            " WHERE deal_id = %s",
            (deal_id,),
        )[0][0]
        due_at = time.monotonic() + int(left) / 1e6
        if due_at < time.monotonic() + 0.5:
            raise RuntimeError("the holds fell due before the measurement could start")
        time.sleep(max(0.0, due_at - time.monotonic()))
        meter = self.meter(self.gate)
        meter.start()
        cpu_before = procs.cpu_seconds(self.gate.pids())
        available = 0
        polls = 0
        while True:
            _, view = http_json("GET", f"{self.gate.url}/v1/deals/{deal_id}")
            polls += 1
            available = int((view or {}).get("remaining_hint", 0))
            now = time.monotonic()
            if available >= n or now - due_at > EXPIRY_TIMEOUT_SECONDS:
                break
            time.sleep(0.005)
        cores = meter.stop()
        cpu_s = procs.cpu_seconds(self.gate.pids()) - cpu_before
        elapsed = now - due_at
        verdict = self.verify(self.gate, deal_id)
        out = {
            "deal_id": deal_id,
            "holds": holds,
            "buckets": EXPIRY_BUCKETS,
            "released_all": available >= n,
            "elapsed_s": round(elapsed, 3),
            "holds_per_s": round(holds / elapsed, 1) if elapsed > 0 else 0.0,
            "cpu_cores": cores,
            "cpu_us_per_hold": self.per_request_us(cpu_s, holds),
            # The deal view's requests are part of the gate CPU above (one every 5 ms
            # plus its answer time, so more of them in a slower run).
            "view_polls": polls,
            "invariant_ok": verdict.get("ok"),
            "breaches": verdict.get("breaches", []),
            "target": EXPIRY_TARGET_PER_S,
        }
        say(
            f"  every unit back in {out['elapsed_s']} s: {out['holds_per_s']:,} holds/s"
            f" (gate CPU {out['cpu_us_per_hold']} µs per hold)"
        )
        return out

    # -- the whole run --------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        def run(cmd: list[str]) -> str:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
                return (done.stdout or done.stderr).strip()
            except OSError:
                return "?"

        cpu = "?"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        mem = "?"
        try:
            kb = int(Path("/proc/meminfo").read_text().split()[1])
            mem = f"{kb / 1024 / 1024:.1f} GiB"
        except (OSError, ValueError, IndexError):
            pass
        import redis

        client = redis.Redis.from_url(self.redis_url)
        redis_version = str(client.info("server").get("redis_version", "?"))
        client.close()
        return {
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "cpu": cpu,
            "memory": mem,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "mariadb": str(self.sql(None, "SELECT VERSION()")[0][0]),
            "redis": redis_version,
            "wrk": run(["wrk", "--version"]).splitlines()[0] if run(["wrk", "--version"]) else "?",
            "commit": run(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": bool(run(["git", "status", "--porcelain", "--untracked-files=no"])),
            "load_before": os.getloadavg()[0],
            "buffer_pool_mib": int(self.sql(None, "SELECT @@innodb_buffer_pool_size")[0][0]) >> 20,
        }

    def raise_buffer_pool(self) -> int | None:
        """MariaDB's buffer pool raised to hold what the run writes, for the run only;
        returns the size to restore (None: nothing changed). Debian's default of 128 MiB
        is smaller than the tables a whole run fills (about a million order and ledger
        rows, gate and baseline), and once they outgrow it every phase after the first
        few measures this machine's disk, not the servers."""
        size = int(self.sql(None, "SELECT @@innodb_buffer_pool_size")[0][0])
        if size >= BUFFER_POOL_BYTES or self.plan.keep_buffer_pool:
            return None
        try:
            self.sql(None, f"SET GLOBAL innodb_buffer_pool_size = {BUFFER_POOL_BYTES}")
        except Exception as exc:
            say(f"could not raise innodb_buffer_pool_size ({exc}); numbers may suffer")
            return None
        say(
            f"innodb_buffer_pool_size {size >> 20} MiB -> {BUFFER_POOL_BYTES >> 20} MiB for the run"
        )
        return size

    def run(self) -> dict[str, Any]:
        plan = self.plan
        say(f"results in {self.results_dir}")
        restore_pool = self.raise_buffer_pool()
        try:
            self.reset_stores()
            self.mint_tokens()
            self.start_servers()
            self.results["environment"] = self.environment()
            phases = self.results["phases"]
            buckets_result = None
            if "ratio" in plan.phases:
                phases["ratio"] = self.phase_ratio()
            if "limiter" in plan.phases:
                phases["limiter"] = self.phase_limiter()
            if "buckets" in plan.phases:
                buckets_result = phases["buckets"] = self.phase_buckets()
            if "sellout" in plan.phases:
                best = buckets_result["best"]["buckets"] if buckets_result else None
                phases["sellout"] = self.phase_sellout(best)
            if "latency" in plan.phases:
                phases["latency"] = self.phase_latency(buckets_result)
            if "peer" in plan.phases:
                phases["peer"] = self.phase_peer()
            if "expiry" in plan.phases:
                phases["expiry"] = self.phase_expiry()
        finally:
            self.stop_servers()
            if restore_pool is not None:
                self.sql(None, f"SET GLOBAL innodb_buffer_pool_size = {restore_pool}")
        self.results["environment"]["load_after"] = os.getloadavg()[0]
        self.results["commands"] = {
            **self.commands,
            "bench": shlex.join(["loadtest/bench", *plan.argv]),
        }
        (self.results_dir / "results.json").write_bytes(
            orjson.dumps(self.results, option=orjson.OPT_INDENT_2, default=str)
        )
        for path in (
            self.loop_tokens,
            self.once_tokens,
            self.baseline_once_tokens,
            getattr(self, "few_tokens", self.loop_tokens),
        ):
            path.unlink(missing_ok=True)
        return self.results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadtest/bench",
        description="Benchmark the gate against the DB-only baseline and write docs/benchmarks.md.",
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (not representative)")
    p.add_argument("--workers", type=int, default=2, help="gate and baseline worker processes")
    p.add_argument("--threads", type=int, default=1, help="wrk threads")
    p.add_argument("--duration", type=float, help="seconds per measured run (8; quick 2)")
    p.add_argument("--warmup", type=float, help="seconds of warm-up per deal (2; quick 1)")
    p.add_argument("--rounds", type=int, help="rounds of the healthz/sold-out pair (2; quick 1)")
    p.add_argument("--ratio-connections", type=int, default=64)
    p.add_argument(
        "--limiter-users", type=int, default=32, help="buyers hammering in the limiter phase"
    )
    p.add_argument(
        "--limiter-spec",
        default="1/m burst 1",
        help="GATE_LIMIT_USER of the limiter phase's gate ('1/m burst 1')",
    )
    p.add_argument("--connections", type=int, nargs="+", help="(16 64 256; quick 32)")
    p.add_argument("--buckets", type=int, nargs="+", help="(1 4 16 64; quick 1 16)")
    p.add_argument(
        "--buyers", type=int, help="distinct buyers clicking again and again in loop runs (1000)"
    )
    p.add_argument("--units", type=int, help="units of the sell-out deal (10000; quick 1000)")
    p.add_argument("--attempts", type=int, help="buyers in the sell-out (100000; quick 10000)")
    p.add_argument("--sellout-connections", type=int, help="(512; quick 128)")
    p.add_argument("--sellout-buckets", type=int, help="(default: the best of the buckets phase)")
    p.add_argument("--no-sellout-baseline", action="store_true")
    p.add_argument("--latency-duration", type=float, help="seconds per latency run (8; quick 2)")
    p.add_argument("--only", nargs="+", choices=PHASES)
    p.add_argument("--expiry-holds", type=int, help="holds of the expiry phase (50000; quick 5000)")
    p.add_argument("--mysql-url", help="server to use (default GATE_MYSQL_URL's server)")
    p.add_argument(
        "--db-prefix", default="gate_bench", help="database names (gate_bench[_baseline])"
    )
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/14", help="flushed first!")
    p.add_argument("--results", help="results directory (default loadtest/results/bench-TIME)")
    p.add_argument("--out", help="markdown report (default docs/benchmarks.md; quick: results dir)")
    p.add_argument("--no-docs", action="store_true", help="do not touch docs/ at all")
    p.add_argument(
        "--keep-buffer-pool",
        action="store_true",
        help="leave MariaDB's innodb_buffer_pool_size as it is (else raised to 1 GiB"
        " for the run when smaller, then restored)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    plan = plan_from(args, argv)
    bench = Bench(plan, args)
    started = time.monotonic()
    results = bench.run()
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    to_docs = not (plan.quick or args.no_docs) or bool(args.out)
    out = (
        Path(args.out)
        if args.out
        else (ROOT / "docs" / "benchmarks.md" if to_docs else bench.results_dir / "benchmarks.md")
    )
    img_dir = ROOT / "docs" / "img" if to_docs else bench.results_dir
    plots = report.plots(results, img_dir)
    report.write_markdown(results, out, plots, relative_to=out.parent)
    if to_docs and "buckets" in results["phases"]:
        report.update_buckets_guide(ROOT / "docs" / "buckets.md", results, plots)
    (bench.results_dir / "results.json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2, default=str)
    )
    print(report.summary(results))
    print(f"report: {out}")
    if not report.correctness_ok(results):
        print("bench: CORRECTNESS BREACH (oversold, lost or invariant)", file=sys.stderr)
        return 1
    if not report.all_met(results):
        print("bench: some performance targets are not met (see the report)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
