"""A rolling restart behind a load balancer loses nothing (gate/cli/draining.py).

Two gates (one with two workers under the supervisor, one single process) behind
HAProxy, which health-checks /readyz every 200 ms; buyers reserve through HAProxy
without pause while each gate in turn is stopped (SIGTERM to its main process, as an
orchestrator sends it), waited for (exit 0) and started again on the same port:

    buyers --> HAProxy :F --+--> gate A :a  (--workers 2)
                            +--> gate B :b  (--workers 1)

    SIGTERM A -> A's /readyz 503 -> HAProxy marks A DOWN (A still serving)
              -> A stops accepting, finishes, hands back its leases, exits 0
              -> A started again -> HAProxy marks A UP -> the same for B

Every answer counts: no connection error, no 502/503 from HAProxy, every 201 has its
order in the database (and every order its 201), the invariants hold, and the
stopped gates' process leases are gone (released, not lapsed: the test's lease lasts
longer than the restart).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import Client, GateProcess, assert_invariants, create_deal, free_port, reserve

pytestmark = pytest.mark.slow

HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None
)
# Long enough for HAProxy's checks (every 200 ms, DOWN after 2 failures) to take a
# draining gate out on a loaded machine; the grace is what a reservation may need.
SHUTDOWN_DELAY_SECONDS = "3"
SHUTDOWN_GRACE_SECONDS = "5"
CONCURRENT_BUYERS = 24
STOCK = 1_000_000
REQUESTS_MAX = 200_000  # a bound on the load, never reached in a passing run
STATE_WAIT_SECONDS = 60.0


def _haproxy_config(front: int, sock: Path, gates: dict[str, int]) -> str:
    servers = "\n".join(f"  server {name} 127.0.0.1:{port} check" for name, port in gates.items())
    return f"""global
  maxconn 4096
  stats socket {sock} level admin

defaults
  mode http
  timeout connect 2s
  timeout client 60s
  timeout server 60s

frontend buyers
  bind 127.0.0.1:{front}
  default_backend gates

backend gates
  balance roundrobin
  option httpchk GET /readyz
  http-check expect status 200
  default-server inter 200ms fastinter 200ms downinter 200ms fall 2 rise 2
{servers}
"""


@dataclass
class Haproxy:
    url: str
    sock: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def states(self) -> dict[str, str]:
        """Each gate server's state ("UP", "DOWN", "UP 1/2", ...) as HAProxy sees it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.sock))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        pxname, svname, status = (header.index(c) for c in ("pxname", "svname", "status"))
        found = {}
        for line in lines[1:]:
            cols = line.split(",")
            if len(cols) > status and cols[pxname] == "gates" and cols[svname] != "BACKEND":
                found[cols[svname]] = cols[status]
        return found

    async def wait_state(self, server: str, state: str, alive: GateProcess | None = None) -> None:
        """Until HAProxy reports `server` in `state` (bounded); with `alive`, that
        gate must still be running meanwhile."""
        deadline = time.monotonic() + STATE_WAIT_SECONDS
        while (seen := self.states().get(server)) != state:
            assert time.monotonic() < deadline, f"{server} is {seen}, not {state}"
            if alive is not None:
                assert alive.alive(), f"{server} exited before HAProxy saw it {state}"
            await asyncio.sleep(0.05)


@pytest.fixture
def haproxy_ports(tmp_path: Path) -> Iterator[tuple[Haproxy, dict[str, int]]]:
    if HAPROXY is None:
        pytest.skip("haproxy is not installed (scripts/test installs Debian's haproxy package)")
    gates = {"a": free_port(), "b": free_port()}
    front = free_port()
    sock = tmp_path / "haproxy.sock"
    config = tmp_path / "haproxy.cfg"
    config.write_text(_haproxy_config(front, sock, gates))
    log = tmp_path / "haproxy.log"
    with open(log, "wb") as out:
        # -db: in the foreground, not a daemon; its own process, ended below.
        proc = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=out, stderr=out)
    try:
        for _ in range(100):
            if sock.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None and sock.exists(), log.read_text()
        yield Haproxy(f"http://127.0.0.1:{front}", sock, proc, log), gates
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@dataclass
class Answer:
    key: str
    status: int | str  # the HTTP status, or the connection error's name
    order_id: str


async def _buyers(client: Client, deal_id: int, stop: asyncio.Event, answers: list[Answer]) -> None:
    """CONCURRENT_BUYERS loops, each reserving for a new buyer with a key of its own
    until `stop` (or REQUESTS_MAX requests in all), every answer into `answers`."""
    users = itertools.count(9_500_000)

    async def buyer_loop() -> None:
        while not stop.is_set() and len(answers) < REQUESTS_MAX:
            user = next(users)
            key = f"rolling-{deal_id}-{user}"
            try:
                r = await reserve(client, deal_id, user, key)
            except (TimeoutError, aiohttp.ClientError) as exc:
                answers.append(Answer(key, type(exc).__name__, ""))
                continue
            order = str(r.json().get("order_id", "")) if r.status_code == 201 else ""
            answers.append(Answer(key, r.status_code, order))

    await asyncio.gather(*(buyer_loop() for _ in range(CONCURRENT_BUYERS)))


def _group_pids(gate: GateProcess) -> set[str]:
    """The gate's processes (its own session: the supervisor and its workers)."""
    out = subprocess.run(
        ["pgrep", "-g", str(gate.proc.pid)], capture_output=True, text=True, check=False
    )
    return set(out.stdout.split())


async def _leases_of(rds: aioredis.Redis, pids: set[str]) -> list[str]:
    """The process-lease keys (gate/store/process_lease.py) held by these processes."""
    found = []
    async for conns in rds.scan_iter(match="{gate:o:*}:conns", count=1000):
        info = await rds.hget(conns, "_")
        if info is not None and str(info).split()[-1] in pids:
            lease = str(conns).removesuffix(":conns") + ":lease"
            if await rds.exists(lease):
                found.append(lease)
    return found


async def _restart(
    haproxy: Haproxy,
    name: str,
    gate: GateProcess,
    env: dict[str, str],
    rds: aioredis.Redis,
    answers_during: list[int],
    answers: list[Answer],
) -> GateProcess:
    """Stop `gate` as an orchestrator does, check how it went, start it again."""
    await haproxy.wait_state(name, "UP")
    leases = await _leases_of(rds, _group_pids(gate))
    assert len(leases) == gate.workers, leases
    before = len(answers)
    gate.proc.send_signal(signal.SIGTERM)
    # Out of rotation while still serving: the drain's whole point.
    await haproxy.wait_state(name, "DOWN", alive=gate)
    await asyncio.to_thread(gate.proc.wait, 60)
    assert gate.stop() == 0, gate.output()[-3000:]
    assert "draining" in gate.output()
    # Handed back, not left to lapse (GATE_LEASE_SECONDS is longer than this).
    assert [k for k in leases if await rds.exists(k)] == []
    again = GateProcess(env, workers=gate.workers, port=gate.port)
    await asyncio.to_thread(again.wait_ready)
    await haproxy.wait_state(name, "UP")
    answers_during.append(len(answers) - before)
    return again


async def test_rolling_restart_behind_haproxy_loses_no_request(
    env: dict[str, str],
    db: Database,
    rds: aioredis.Redis,
    haproxy_ports: tuple[Haproxy, dict[str, int]],
) -> None:
    haproxy, ports = haproxy_ports
    env = {
        **env,
        "GATE_SHUTDOWN_DELAY_SECONDS": SHUTDOWN_DELAY_SECONDS,
        "GATE_SHUTDOWN_GRACE_SECONDS": SHUTDOWN_GRACE_SECONDS,
        # Longer than a restart: a lease gone after the exit was released.
        "GATE_LEASE_SECONDS": "60",
    }
    gates = {
        "a": GateProcess(env, workers=2, port=ports["a"]),
        "b": GateProcess(env, workers=1, port=ports["b"]),
    }
    client = Client(haproxy.url, limit=CONCURRENT_BUYERS * 2)
    stop = asyncio.Event()
    answers: list[Answer] = []
    # How many answers came while each gate was restarting.
    answers_during: list[int] = []
    try:
        for gate in gates.values():
            await asyncio.to_thread(gate.wait_ready)
        await haproxy.wait_state("a", "UP")
        await haproxy.wait_state("b", "UP")
        deal_id = await create_deal(client, stock=STOCK, buckets=8)
        load = asyncio.ensure_future(_buyers(client, deal_id, stop, answers))
        await asyncio.sleep(1.0)
        for name in ("a", "b"):
            gates[name] = await _restart(
                haproxy, name, gates[name], env, rds, answers_during, answers
            )
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(load, 120)
    finally:
        stop.set()
        await client.close()
        codes = [gate.stop() for gate in gates.values()]
    assert codes == [0, 0], [g.output()[-2000:] for g in gates.values()]

    outcomes = Counter(a.status for a in answers)
    # Every answer a sale: no connection error, no 502/503 from HAProxy or the gates.
    assert set(outcomes) == {201}, outcomes
    assert all(n > 0 for n in answers_during), answers_during
    print(f"{len(answers)} answers, {answers_during} while a gate restarted")

    rows = await db.fetchall(
        "SELECT idempotency_key, id FROM orders WHERE deal_id = %s", (deal_id,)
    )
    held = {str(k): str(i) for k, i in rows}
    assert held == {a.key: a.order_id for a in answers}
    await assert_invariants(db, rds, deal_id, timeout_seconds=20)
