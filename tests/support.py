"""Test helpers: real gate processes, real Redis and MariaDB, no mocks."""

from __future__ import annotations

import asyncio
import json as stdjson
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import aiohttp
import aiomysql
import jwt
import orjson
import redis.asyncio as aioredis
from multidict import CIMultiDictProxy

from gate.base.settings import Settings
from gate.inventory.check import check_deal
from gate.store.db import Database, connect_kwargs
from gate.store.keys import deal_keys

ROOT = Path(__file__).resolve().parent.parent
GATE_BIN = str(Path(sys.executable).with_name("gate"))

JWT_SECRET = "test-jwt-secret-0123456789abcdef0123456789"
ADMIN_TOKEN = "test-admin-token-0123456789abcdef012345"
ADMISSION_SECRET = "test-admission-secret-0123456789abcdef012345"
WEBHOOK_SECRET = "whsec_dGVzdC13ZWJob29rLXNlY3JldC0wMTIzNDU2Nzg5"
# Seals the outbound webhook endpoints' signing secrets (gate/webhooks/vault.py).
WEBHOOK_ENCRYPTION_KEY = "test-webhook-encryption-key-0123456789abcdef"


# GATE_TEST_REDIS_CLUSTER=1: the suite runs against a local Redis Cluster started for
# the session (tests/conftest.py `env`) on ports CLUSTER_PORT .. +5.
CLUSTER_RUN = os.environ.get("GATE_TEST_REDIS_CLUSTER", "") in ("1", "true", "yes")
CLUSTER_PORT = int(os.environ.get("GATE_TEST_REDIS_CLUSTER_PORT", "18510"))

# GATE_TEST_GALERA=1: the suite runs against a local 3-node MariaDB Galera cluster
# started for the session (tests/galera.py, tests/conftest.py `env`), its nodes at
# GALERA_PORT, +10, +20 (each with 3 more ports: gcomm, SST, IST).
GALERA_RUN = os.environ.get("GATE_TEST_GALERA", "") in ("1", "true", "yes")
GALERA_PORT = int(os.environ.get("GATE_TEST_GALERA_PORT", "18610"))


# The standalone Redis the suite's environment names (it runs on a cluster run too).
STANDALONE_REDIS_URL = os.environ.get("GATE_REDIS_URL", "redis://127.0.0.1:6379/0")


def base_env() -> dict[str, str]:
    redis_url = STANDALONE_REDIS_URL
    mysql_url = os.environ.get("GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate")
    # The suite owns a database and a Redis logical database of its own.
    test_redis = os.environ.get("GATE_TEST_REDIS_URL") or redis_url.rsplit("/", 1)[0] + "/15"
    if CLUSTER_RUN:
        # The session's cluster (tests/conftest.py `env`): gates a test starts from this
        # environment use it too, as the checking client does.
        test_redis = f"redis://127.0.0.1:{CLUSTER_PORT}/0"
    test_mysql = os.environ.get("GATE_TEST_MYSQL_URL") or mysql_url.rsplit("/", 1)[0] + "/gate_test"
    if GALERA_RUN:
        # The session's Galera cluster (tests/conftest.py `env`), every node named.
        from tests.galera import LocalGalera

        test_mysql = LocalGalera.url_for(GALERA_PORT, test_mysql.rsplit("/", 1)[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
    env.update(
        {
            "GATE_ENV": "test",
            "GATE_REDIS_URL": test_redis,
            "GATE_MYSQL_URL": test_mysql,
            "GATE_JWT_SECRET": JWT_SECRET,
            "GATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "GATE_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "GATE_WEBHOOK_ENCRYPTION_KEY": WEBHOOK_ENCRYPTION_KEY,
            # The suite's gates send no webhooks (they would take deliveries meant for
            # a webhook test's own gate): tests/webhooks_support.py turns them on.
            "GATE_WEBHOOK_WORKERS": "0",
            "GATE_ADMISSION_SECRET": ADMISSION_SECRET,
            # Required outside GATE_ENV=dev; the suite's gates take the sandbox's calls.
            "GATE_PAYMENT_PROVIDER": "sandbox",
            "GATE_DB_LOCK_WAIT_SECONDS": "2",
            # Many gate processes share one MariaDB (max_connections 151 by default).
            "GATE_DB_POOL_MAX": "10",
            "GATE_RESERVATION_DB_TIMEOUT_SECONDS": "5",
            "GATE_REDIS_TIMEOUT_SECONDS": "2",
            "GATE_INFLIGHT_MAX_SECONDS": "15",
            "GATE_JANITOR_INTERVAL_SECONDS": "0.2",
            "GATE_RESYNC_INTERVAL_SECONDS": "0.3",
            "GATE_LOG_LEVEL": "WARNING",
            # No gate of the suite takes its default metrics port (--port + 10000, which
            # for a free port may be another's): GateProcess gives each a free one.
            "GATE_METRICS_ADDR": "off",
            # Limits are off unless a test turns them on: many tests fire hundreds
            # of requests from one address and a few buyers.
            "GATE_LIMIT_DEAL": "off",
            "GATE_LIMIT_USER": "off",
            "GATE_LIMIT_IP": "off",
            "GATE_LIMIT_DEVICE": "off",
            "GATE_LIMIT_GLOBAL": "off",
            # Correctness suites on a shared 2-core machine: admitted buyers may
            # queue for the pool longer than production's 1 s before shedding.
            "GATE_DB_RESERVATION_ACQUIRE_SECONDS": "5",
            # Tests read their own writes at once; the sold-out near-cache (up to
            # 100 ms stale by design) has its own test with it turned on.
            "GATE_SOLD_OUT_CACHE_MS": "0",
            # A stopped gate stops at once: no balancer watches the suite's gates
            # (tests/cli/test_rolling_restart.py sets its own delay).
            "GATE_SHUTDOWN_DELAY_SECONDS": "0",
            # Many tests break a deal's books on purpose and sell on afterwards; the
            # pause on a breach has its own tests (tests/expiry/test_pause.py).
            "GATE_PAUSE_ON_BREACH": "0",
        }
    )
    return env


# Each GateProcess's metrics listener by the gate's public URL: `metrics_url_of`.
METRICS_URLS: dict[str, str] = {}


def metrics_url_of(url: str) -> str:
    """The metrics listener of the gate serving `url` (a GateProcess of this run)."""
    try:
        return METRICS_URLS[url]
    except KeyError:
        raise AssertionError(f"no metrics listener known for {url}") from None


def redis_client(url: str, decode_responses: bool = True) -> aioredis.Redis:
    """A redis-py client for `url`: a cluster client when it names a cluster node."""
    from typing import cast

    from gate.store.redis_mode import detect_mode

    if detect_mode(url, "auto", 2.0) == "cluster":
        return cast(
            aioredis.Redis,
            aioredis.RedisCluster.from_url(url, decode_responses=decode_responses),
        )
    return aioredis.Redis.from_url(url, decode_responses=decode_responses)


# Ports for the suite's servers come from below the kernel's ephemeral range
# (32768-60999 on Linux), so that no outgoing connection of the suite can take a port
# between the moment it is chosen and the moment a gate binds it, and clear of the
# fixed ports of the test clusters (Redis Cluster 18510+ and its bus 28510+, Galera
# 18610+ and 13400+). The recent ones are not handed out again, so that two servers
# started together (a gate's public port and its metrics listener) never share one.
PORT_RANGE = (29000, 32700)
_RECENT_PORTS: deque[int] = deque(maxlen=1024)


async def reset_stores(settings: Settings) -> None:
    """The settings' MariaDB database dropped and migrated anew, their Redis emptied
    (every primary of a cluster)."""
    from gate.store.db import notes_off
    from gate.store.migrate import migrate
    from gate.store.redis_mode import detect_mode
    from tests.cluster import flush_all_primaries

    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            await notes_off(cur)
            await cur.execute(f"DROP DATABASE IF EXISTS `{settings.mysql.database}`")
    finally:
        conn.close()
    await migrate(settings.mysql)
    flush_all_primaries(
        settings.redis_url, detect_mode(settings.redis_url, settings.redis_mode, 2.0)
    )


def free_port() -> int:
    for _ in range(1000):
        port = random.randrange(*PORT_RANGE)
        if port in _RECENT_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _RECENT_PORTS.append(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def token(user_id: int, ttl_seconds: int = 3600, **extra: Any) -> str:
    now = int(time.time())
    claims = {"sub": str(user_id), "iat": now, "exp": now + ttl_seconds, **extra}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


def buyer(user_id: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(user_id)}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class LoggedProcess:
    """A real process in its own process group, with its own environment and its
    output in .local/test-<log_name>.log. `with LoggedProcess(…) as p:` waits until it
    is ready (`wait_ready`: at once here, a server's answer in the classes below) and
    stops it on the way out, also when it never got ready."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_name: str,
        cwd: Path | None = None,
    ) -> None:
        self.log_path = ROOT / ".local" / f"test-{log_name}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Nothing to wait for: a command is ready once started."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group: it dies wherever it is (mid-request),
        nothing runs on the way out."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 15 s; the exit status."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return int(self.proc.returncode)


class GateCommand(LoggedProcess):
    """A real `gate <command>` process (e.g. `gate sweep`)."""

    def __init__(self, env: Mapping[str, str], *args: str, log_name: str | None = None) -> None:
        name = log_name or "-".join(args)
        super().__init__([GATE_BIN, *args], env, f"{name}-{os.getpid()}-{time.monotonic_ns()}")


class GateProcess(GateCommand):
    """A real `gate serve` process on its own port, with its metrics listener
    (GATE_METRICS_ADDR) on another free port of its own (`metrics_url`), so that
    gates started side by side never collide on a metrics port. `metrics=False`: no
    listener (GATE_METRICS_ADDR=off); `metrics=None`: GATE_METRICS_ADDR unset, the
    default address for `port`."""

    def __init__(
        self,
        env: Mapping[str, str],
        workers: int = 1,
        background: bool = True,
        port: int | None = None,
        metrics: bool | None = True,
    ):
        self.port = port or free_port()
        self.workers = workers
        self.url = f"http://127.0.0.1:{self.port}"
        if metrics is None:
            # GATE_METRICS_ADDR unset: the default address for this port.
            from gate.base.settings import metrics_port_for

            self.metrics_port: int | None = metrics_port_for(self.port)
            env = {k: v for k, v in env.items() if k != "GATE_METRICS_ADDR"}
        else:
            self.metrics_port = free_port() if metrics else None
            address = f"127.0.0.1:{self.metrics_port}" if metrics else "off"
            env = {**env, "GATE_METRICS_ADDR": address}
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}" if self.metrics_port else None
        if self.metrics_url is not None:
            METRICS_URLS[self.url] = self.metrics_url
        # Every gate serving the suite (a cluster run starts two): see Client.
        self.peers: list[str] = [self.url]
        # The suite's other gate processes (tests/conftest.py `gate`): `signal_suite`.
        self.partners: list[GateProcess] = []
        args = ["serve", "--port", str(self.port), "--workers", str(workers)]
        if not background:
            args.append("--no-background")
        super().__init__(env, *args, log_name=f"gate-{self.port}")

    def signal_suite(self, sig: int) -> None:
        """A signal to this gate's process group and its partners': SIGSTOP freezes
        every consumer of the suite's gates (a cluster run has two), SIGCONT thaws."""
        for proc in (self, *self.partners):
            os.killpg(proc.proc.pid, sig)

    def wait_ready(self, timeout_seconds: float = 30.0) -> None:
        """Ready when /readyz answers 200 on enough fresh connections in a row that
        every worker has answered one: each worker listens before its start-up is
        done, so a connection the kernel hands a starting worker times out here.
        (One answer was not enough: a test could pause Redis while the second worker
        was still taking its lease, and that worker's start-up then failed.)"""
        deadline = time.monotonic() + timeout_seconds
        needed = 1 if self.workers <= 1 else 6 * self.workers
        streak = 0
        # Each worker binds its socket only once it has started: until then the
        # others take every connection, so a streak alone can be one worker's. Every
        # worker must also have answered (its request ids' prefix is its own).
        answered: set[str] = set()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gate exited early: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1.0) as resp:
                    if resp.status == 200:
                        streak += 1
                        answered.add(resp.headers.get("X-Request-Id", "").rsplit("-", 1)[0])
                        if streak >= needed and len(answered) >= self.workers:
                            return
                        continue
            except (urllib.error.URLError, OSError):
                pass
            streak = 0
            time.sleep(0.1)
        raise RuntimeError(f"gate not ready: {self.log_path.read_text()[-3000:]}")


class ServerProcess(LoggedProcess):
    """A test server as a real process on 127.0.0.1 (a provider's fake, `python -m
    tests.fake_…`; the sandbox, `gate sandbox`), its output in
    .local/test-<name>-<port>.log, ready once GET /healthz answers 200."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(args, env, f"{name}-{port}", cwd=ROOT)

    def wait_ready(self, timeout_seconds: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready: {self.log_path.read_text()[-3000:]}")


def serve_once(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`gate serve --port 1 ARGS…` run to its end, its output captured: for a
    configuration that must stop start-up (were it accepted, binding port 1 would
    fail loudly instead)."""
    return subprocess.run(
        [GATE_BIN, "serve", "--port", "1", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def running_gate(env: Mapping[str, str], workers: int = 2, background: bool = True) -> GateProcess:
    """`with running_gate(env) as gate:` a GateProcess that answers on every worker,
    stopped on the way out."""
    return GateProcess(env, workers=workers, background=background)


@dataclass
class Resp:
    status_code: int
    headers: CIMultiDictProxy[str]
    content: bytes

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class Client:
    """A small HTTP client over aiohttp with the surface the tests need."""

    # Requests alternate between these gates when there are several (a cluster run):
    # class defaults, for subclasses with their own __init__.
    _peers: list[str] = []  # noqa: RUF012
    _turn = 0

    def __init__(self, base_url: str, limit: int = 400, peers: Sequence[str] = ()) -> None:
        self.base_url = base_url
        self._peers = list(peers) or [base_url]
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit),
            timeout=aiohttp.ClientTimeout(total=60),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Resp:
        kwargs: dict[str, Any] = {"headers": dict(headers or {})}
        if json is not None:
            # The standard library encodes what orjson refuses (integers past 64 bits),
            # which the bad-input tests need to send.
            kwargs["data"] = stdjson.dumps(json).encode()
            kwargs["headers"].setdefault("Content-Type", "application/json")
        elif content is not None:
            kwargs["data"] = content
        if "Content-Type" not in kwargs["headers"]:
            kwargs["skip_auto_headers"] = ["Content-Type"]
        base = self.base_url
        if len(self._peers) > 1:
            self._turn += 1
            base = self._peers[self._turn % len(self._peers)]
        async with self.session.request(method, base + path, **kwargs) as r:
            return Resp(r.status, r.headers, await r.read())

    async def get(self, path: str, **kw: Any) -> Resp:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, **kw: Any) -> Resp:
        return await self.request("POST", path, **kw)

    async def put(self, path: str, **kw: Any) -> Resp:
        return await self.request("PUT", path, **kw)

    async def delete(self, path: str, **kw: Any) -> Resp:
        return await self.request("DELETE", path, **kw)

    async def metrics(self) -> str:
        """The text exposition of this client's gate, from its metrics listener
        (outside GATE_ENV=dev /metrics is not served on the public port)."""
        async with self.session.get(metrics_url_of(self.base_url) + "/metrics") as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/plain")
            return await r.text()

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> Self:
        """`async with Client(url) as client:` closed on the way out."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def create_deal(client: Client, **fields: Any) -> int:
    body = {"title": "Test deal", "unit_price": 500, "currency": "EUR", "stock": 100, **fields}
    resp = await client.post("/v1/admin/deals", json=body, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


async def reserve(
    client: Client,
    deal_id: int,
    user_id: int,
    key: str,
    quantity: int = 1,
) -> Resp:
    return await client.post(
        f"/v1/deals/{deal_id}/reservations",
        json={"quantity": quantity},
        headers={**buyer(user_id), "Idempotency-Key": key},
    )


async def db_available(db: Database, deal_id: int) -> dict[int, int]:
    rows = await db.fetchall(
        "SELECT bucket, available FROM deal_buckets WHERE deal_id = %s ORDER BY bucket", (deal_id,)
    )
    return {int(b): int(a) for b, a in rows}


async def redis_available(rds: aioredis.Redis, deal_id: int) -> tuple[int | None, dict[int, int]]:
    keys = deal_keys(deal_id)
    avail = await rds.hget(keys.meta, "avail")
    buckets = await rds.hgetall(keys.buckets)
    return (None if avail is None else int(avail)), {int(b): int(v) for b, v in buckets.items()}


async def settled_report(
    db: Database, rds: aioredis.Redis, deal_id: int, timeout_seconds: float = 10.0
) -> dict[str, Any]:
    """The check report once nothing is in flight and Redis could be compared."""
    deadline = time.monotonic() + timeout_seconds
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        report = await check_deal(db, rds, deal_id)
        if report["redis"].get("compared") and report["invariant"]["ok"]:
            return report
        await asyncio.sleep(0.2)
    return report


async def assert_invariants(
    db: Database, rds: aioredis.Redis, deal_id: int, timeout_seconds: float = 10.0
) -> dict[str, Any]:
    """total = available + held + sold everywhere, ledger agrees, Redis = DB."""
    report = await settled_report(db, rds, deal_id, timeout_seconds)
    assert report["invariant"]["ok"], report["invariant"]["breaches"]
    assert report["redis"]["compared"], report["redis"]
    db_avail = await db_available(db, deal_id)
    r_total, r_buckets = await redis_available(rds, deal_id)
    assert r_buckets == db_avail
    assert r_total == sum(db_avail.values())
    return report


class Traffic:
    """Buyers reserving and cancelling one deal concurrently until stopped."""

    def __init__(self, client: Client, deal_id: int, user_base: int, seed: int) -> None:
        self.client = client
        self.deal_id = deal_id
        self.user_base = user_base
        self.rng = random.Random(seed)
        self.stop = asyncio.Event()
        self.held: list[tuple[int, str]] = []
        self._tasks: list[asyncio.Future[None]] = []

    async def _buyer(self, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            user = self.user_base + worker * 10_000 + i
            key = f"traffic-{self.deal_id}-{worker}-{i:05d}"
            r = await reserve(self.client, self.deal_id, user, key, self.rng.choice((1, 2)))
            if r.status_code == 201:
                self.held.append((user, r.json()["order_id"]))
            i += 1

    async def cancel_one(self) -> bool:
        if not self.held:
            return False
        user, order_id = self.held.pop(self.rng.randrange(len(self.held)))
        r = await self.client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
        assert r.status_code == 200, r.text
        return True

    async def _canceller(self) -> None:
        while not self.stop.is_set():
            await self.cancel_one()
            await asyncio.sleep(0.004)

    def start(self, buyers: int) -> None:
        self._tasks = [asyncio.ensure_future(self._buyer(w)) for w in range(buyers)]
        self._tasks.append(asyncio.ensure_future(self._canceller()))

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks)


@asynccontextmanager
async def locked_buckets(settings: Settings, deal_id: int) -> AsyncIterator[Any]:
    """A test connection holding every bucket row of a deal locked; yields its cursor.
    Leaving the block rolls the lock back."""
    locker = await aiomysql.connect(**connect_kwargs(settings.mysql, 5))
    try:
        async with locker.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT * FROM deal_buckets WHERE deal_id = %s FOR UPDATE", (deal_id,)
            )
            try:
                yield cur
            finally:
                await cur.execute("ROLLBACK")
    finally:
        locker.close()


async def reserve_statements(cur: Any, deal_id: int) -> list[int]:
    """The server threads of reservations (or reservation groups) of this deal working
    on a bucket row now. (Inside the procedure the processlist shows the inner
    statement, not the CALL.)"""
    await cur.execute(
        "SELECT ID FROM information_schema.PROCESSLIST"
        " WHERE ID <> CONNECTION_ID() AND INFO LIKE %s AND INFO LIKE %s",
        ("%deal_buckets%", f"%NAME_CONST('p_deal_id',{deal_id})%"),
    )
    return [int(r[0]) for r in await cur.fetchall()]


async def wait_for_reserve_statement(cur: Any, deal_id: int, exclude: Sequence[int] = ()) -> int:
    """The server thread of a reservation (or a reservation group) for this deal, once
    it works on a bucket row, other than the threads in `exclude`."""
    for _ in range(200):
        found = [t for t in await reserve_statements(cur, deal_id) if t not in exclude]
        if found:
            return found[0]
        await asyncio.sleep(0.02)
    raise AssertionError("the reservation never reached the database")


class TcpProxy:
    """A real TCP proxy between a gate and a server, to cut or delay its traffic.

    Modes: "pass" forwards bytes; "cut" closes every connection and refuses new
    ones; "delay" forwards server-to-client bytes only after `delay_seconds`.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.mode = "pass"
        self.delay_seconds = 0.0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if delayed and self.mode == "delay":
                    await asyncio.sleep(self.delay_seconds)
                if self.mode == "cut":
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(
            self._pipe(reader, up_writer, delayed=False),
            self._pipe(up_reader, writer, delayed=True),
        )
        self._writers.difference_update((writer, up_writer))

    def cut(self) -> None:
        self.mode = "cut"
        for w in list(self._writers):
            w.close()
        self._writers.clear()

    def restore(self) -> None:
        self.mode = "pass"

    def delay(self, seconds: float) -> None:
        self.delay_seconds = seconds
        self.mode = "delay"

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def redis_via(env: Mapping[str, str], proxy: TcpProxy) -> str:
    """The test Redis URL, rerouted through a proxy."""
    db = env["GATE_REDIS_URL"].rsplit("/", 1)[1]
    return f"redis://127.0.0.1:{proxy.port}/{db}"
