"""/metrics off the public port (gate/web/metrics_listener.py), against real `gate serve`
processes: outside GATE_ENV=dev the public port answers 404 and the listener
(GATE_METRICS_ADDR) serves the whole gate; with several workers the supervising
parent serves it, merging every worker's files, and keeps serving while a worker
is killed and replaced; GATE_ENV=dev keeps /metrics on the public port too; `off`
serves none; an address in use or malformed stops start-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gate.base.metrics import sample_values, value_of
from gate.base.settings import metrics_port_for
from tests.ops_support import FreshConnectionClient
from tests.support import Client, GateCommand, GateProcess, create_deal, free_port, reserve

ROUTE = "/v1/deals/{deal_id}/reservations"


def fetch(url: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def assert_not_found(url: str) -> None:
    status, content_type, body = fetch(url)
    assert status == 404, (url, status, body[:200])
    assert content_type == "application/problem+json", content_type
    assert b'"code":"NOT_FOUND"' in body


def scrape(proc: GateProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, content_type, body = fetch(f"{proc.metrics_url}/metrics")
    assert status == 200, body[:300]
    assert content_type.startswith("text/plain; version=0.0.4")
    return sample_values(body.decode())


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its sockets in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def group_pids(proc: GateProcess) -> list[int]:
    """Every process of the gate's process group (the parent and its workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[2]) == proc.proc.pid:
                out.append(int(entry))
    return out


@pytest.fixture(scope="module")
def one_worker(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(env, workers=1) as proc:
        yield proc


@pytest.fixture(scope="module")
def two_workers(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(env, workers=2) as proc:
        yield proc


@pytest.fixture
async def fresh(two_workers: GateProcess) -> AsyncIterator[FreshConnectionClient]:
    async with FreshConnectionClient(two_workers.url) as c:
        yield c


async def test_one_worker_serves_metrics_on_its_listener_only(one_worker: GateProcess) -> None:
    """The public port answers 404 problem+json, as for any unknown path; the
    listener answers the scrape, with what the worker counted a moment ago (its
    loop adds its tallies before the render), and 404 for any other path."""
    assert_not_found(f"{one_worker.url}/metrics")
    assert_not_found(f"{one_worker.metrics_url}/v1/deals/1")
    assert listening_ports(one_worker.proc.pid) == {one_worker.port, one_worker.metrics_port}
    client = Client(one_worker.url)
    try:
        before = value_of(scrape(one_worker), "gate_reservations_total", outcome="created")
        deal_id = await create_deal(client, stock=3)
        r = await reserve(client, deal_id, 9_100_001, "listener-one-0001")
        assert r.status_code == 201, r.text
    finally:
        await client.close()
    samples = scrape(one_worker)
    assert value_of(samples, "gate_reservations_total", outcome="created") == before + 1
    assert value_of(samples, "gate_http_requests_total", route=ROUTE, status="201") >= 1


def raw_scrape(port: int) -> bytes:
    """The whole answer to one GET /metrics over a raw socket (b"": closed unanswered)."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: gate\r\n\r\n")
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def closed_unanswered(sock: socket.socket, timeout_seconds: float = 10.0) -> bool:
    """The listener closed `sock` without a byte of answer."""
    sock.settimeout(timeout_seconds)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_slow_clients_cannot_stop_scrapes(one_worker: GateProcess) -> None:
    """Eight connections sending a request head a byte at a time, far slower than
    the head's deadline: scrapes are answered while they hang on, and each of them
    is closed unanswered long before its head could be complete (a byte every
    second for a 25-byte head), so they do not hold the listener either."""
    port = one_worker.metrics_port
    assert port is not None
    head = b"GET /metrics HTTP/1.0\r\n\r\n"
    slow = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(8)]
    try:
        for sock in slow:
            sock.sendall(head[:1])
        for _ in range(3):
            answer = raw_scrape(port)
            assert answer.startswith(b"HTTP/1.0 200 OK\r\n"), answer[:200]
            assert b"gate_http_requests_total" in answer
        # Keep trickling: the head's deadline runs from the accept, not per byte.
        closed = [False] * len(slow)
        for i in range(1, len(head)):
            for n, sock in enumerate(slow):
                if not closed[n]:
                    try:
                        sock.sendall(head[i : i + 1])
                    except (BrokenPipeError, ConnectionResetError):
                        closed[n] = True
            if all(closed):
                break
            time.sleep(1)
        assert all(closed_unanswered(sock) for sock in slow)
        assert raw_scrape(port).startswith(b"HTTP/1.0 200 OK\r\n")
    finally:
        for sock in slow:
            sock.close()


def test_the_listener_holds_at_most_its_bound_of_connections(one_worker: GateProcess) -> None:
    """CONNECTIONS_MAX + 8 connections that send nothing: the listener keeps at most
    CONNECTIONS_MAX of them (each one over the bound closes the oldest that is still
    sending its head), and a scrape is answered all the same, making room for itself."""
    from gate.web.metrics_listener import CONNECTIONS_MAX

    port = one_worker.metrics_port
    assert port is not None
    idle = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(CONNECTIONS_MAX + 8)]
    try:
        answer = raw_scrape(port)
        assert answer.startswith(b"HTTP/1.0 200 OK\r\n"), answer[:200]
        # The first nine were closed for the eight after them and for the scrape.
        assert all(closed_unanswered(sock) for sock in idle[:9])
        # And every other one once the head's deadline has passed.
        assert all(closed_unanswered(sock) for sock in idle[9:])
    finally:
        for sock in idle:
            sock.close()


def test_the_listener_answers_only_get_metrics(one_worker: GateProcess) -> None:
    port = one_worker.metrics_port
    assert port is not None
    for request, status in (
        (b"POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
        (b"HEAD /metrics HTTP/1.0\r\n\r\n", b"200"),
        (b"nonsense\r\n\r\n", b"400"),
    ):
        with socket.create_connection(("127.0.0.1", port), 5) as sock:
            sock.settimeout(10)
            sock.sendall(request)
            answer = sock.recv(65536)
        assert answer.split(b" ", 2)[1] == status, (request, answer[:200])
    # A head larger than the bound is not read on.
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        try:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 20_000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert closed_unanswered(sock)


async def test_the_parent_merges_every_worker_and_outlives_a_killed_one(
    two_workers: GateProcess, fresh: FreshConnectionClient
) -> None:
    """Two workers: one scrape of the listener counts every worker's answers, and
    the listener belongs to the supervising process: it answers while a worker is
    killed and replaced, and the dead worker's counts stay in the totals."""
    assert_not_found(f"{two_workers.url}/metrics")
    # The parent listens on the metrics port; no worker does.
    assert two_workers.metrics_port in listening_ports(two_workers.proc.pid)
    for pid in group_pids(two_workers):
        if pid != two_workers.proc.pid:
            assert two_workers.metrics_port not in listening_ports(pid), pid
    before = value_of(scrape(two_workers), "gate_http_requests_total", route="/healthz")
    sent = 0
    pids: set[str] = set()
    for _ in range(10):
        answers = await asyncio.gather(*(fresh.get("/healthz") for _ in range(20)))
        assert all(a.status_code == 200 for a in answers)
        sent += len(answers)
        pids = _worker_pids(two_workers)
        if len(pids) >= 2:
            break
    assert len(pids) == 2, pids
    # Every worker adds its tallies to its file every 0.25 s.
    for _ in range(50):
        counted = value_of(scrape(two_workers), "gate_http_requests_total", route="/healthz")
        if counted - before == sent:
            break
        await asyncio.sleep(0.1)
    assert counted - before == sent

    victim = int(sorted(pids)[0])
    os.kill(victim, signal.SIGKILL)
    # The listener is the parent's: it answers at once, the dead worker's counts
    # included (its file stays).
    after_kill = value_of(scrape(two_workers), "gate_http_requests_total", route="/healthz")
    assert after_kill >= counted
    two_workers.wait_ready()
    assert value_of(scrape(two_workers), "gate_http_requests_total", route="/healthz") >= counted


def _worker_pids(proc: GateProcess) -> set[str]:
    """The worker processes of a gate (children of its supervising process)."""
    children = Path(f"/proc/{proc.proc.pid}/task/{proc.proc.pid}/children").read_text()
    pids = set(children.split())
    # The spawn start method adds a resource tracker: keep the workers only.
    return {p for p in pids if b"spawn_main" in _cmdline(p)}


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_dev_keeps_metrics_on_the_public_port_too(
    env: dict[str, str], prepared: None
) -> None:
    proc = GateProcess({**env, "GATE_ENV": "dev", "GATE_PAYMENT_PROVIDER": "sandbox"})
    try:
        proc.wait_ready()
        status, content_type, body = fetch(f"{proc.url}/metrics")
        assert status == 200 and content_type.startswith("text/plain"), body[:200]
        assert b"gate_http_requests_total" in body
        assert value_of(scrape(proc), "gate_http_requests_total", route="/metrics") >= 1
    finally:
        proc.stop()


async def test_off_serves_no_metrics_anywhere(env: dict[str, str], prepared: None) -> None:
    proc = GateProcess(env, workers=2, metrics=False)
    try:
        proc.wait_ready()
        assert_not_found(f"{proc.url}/metrics")
        # The gate's processes listen on its public port alone.
        for pid in group_pids(proc):
            assert listening_ports(pid) <= {proc.port}, pid
    finally:
        proc.stop()


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_with_free_default() -> int:
    """A free port whose default metrics port is free too."""
    for _ in range(100):
        port = free_port()
        if bindable(metrics_port_for(port)):
            return port
    raise RuntimeError("no free port with a free default metrics port")


def test_the_default_metrics_port_is_derived_and_no_exporter_s() -> None:
    assert metrics_port_for(8000) == 18000
    defaults = [metrics_port_for(p) for p in range(1, 65_536)]
    assert all(1 <= d <= 65_535 for d in defaults)
    # Never a port of the Prometheus exporters' range, never the public port itself,
    # and two public ports never share a default unless one is above 55535.
    assert not any(9100 <= d <= 9999 for d in defaults)
    assert all(d != p for p, d in enumerate(defaults, 1))
    assert len(set(defaults[:55_535])) == 55_535


async def test_two_gates_with_default_settings_start_side_by_side(
    env: dict[str, str], prepared: None
) -> None:
    """Two `gate serve` on one host, GATE_METRICS_ADDR unset, one and two workers,
    while something else holds node_exporter's 9100: both start, each serves its
    scrape on its own default address (127.0.0.1 at --port + 10000) and nothing on
    the public port."""
    node_exporter = socket.socket()
    node_exporter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with contextlib.suppress(OSError):  # already taken: all the better
        node_exporter.bind(("127.0.0.1", 9100))
        node_exporter.listen(1)
    gates = []
    try:
        for workers in (1, 2):
            proc = GateProcess(env, workers=workers, port=port_with_free_default(), metrics=None)
            gates.append(proc)
        for proc in gates:
            proc.wait_ready()
        for proc in gates:
            assert proc.metrics_port == metrics_port_for(proc.port)
            assert_not_found(f"{proc.url}/metrics")
            samples = scrape(proc)
            assert any(name == "gate_http_requests_total" for name, _ in samples)
            assert proc.metrics_port in listening_ports(proc.proc.pid)
            assert 9100 not in listening_ports(proc.proc.pid)
    finally:
        for proc in gates:
            proc.stop()
        node_exporter.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_default_address_in_use_stops_start_up_naming_it(
    env: dict[str, str], prepared: None, workers: int
) -> None:
    port = port_with_free_default()
    default = metrics_port_for(port)
    unset = {k: v for k, v in env.items() if k != "GATE_METRICS_ADDR"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", default))
        taken.listen(1)
        serve = GateCommand(unset, "serve", "--port", str(port), "--workers", str(workers))
        try:
            serve.proc.wait(60)
        finally:
            code = serve.stop()
    out = serve.output()
    assert code == 2, out[-2000:]
    assert f"GATE_METRICS_ADDR 127.0.0.1:{default}" in out, out[-2000:]
    assert "unset: the default for this --port" in out and "Traceback" not in out


@pytest.mark.parametrize("workers", [1, 2])
def test_an_address_in_use_stops_start_up(
    env: dict[str, str], prepared: None, workers: int
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        serve = GateCommand(
            {**env, "GATE_METRICS_ADDR": f"127.0.0.1:{port}"},
            "serve",
            "--port",
            str(free_port()),
            "--workers",
            str(workers),
        )
        try:
            serve.proc.wait(60)
        finally:
            code = serve.stop()
    assert code == 2, serve.output()[-2000:]
    assert f"GATE_METRICS_ADDR 127.0.0.1:{port}" in serve.output(), serve.output()[-2000:]
    assert "unset" not in serve.output()


@pytest.mark.parametrize("value", ["9100", "localhost", "127.0.0.1:0", "127.0.0.1:http", "a b:1"])
def test_a_malformed_address_stops_start_up(
    env: dict[str, str], prepared: None, value: str
) -> None:
    serve = GateCommand({**env, "GATE_METRICS_ADDR": value}, "serve", "--port", "1")
    try:
        serve.proc.wait(30)
    finally:
        code = serve.stop()
    assert code == 2 and "GATE_METRICS_ADDR" in serve.output(), serve.output()


def test_compose_and_prometheus_scrape_the_listener() -> None:
    """Inside compose the listener binds every interface of the container on the
    default metrics port of the public 8000 (18000), and Prometheus scrapes that port
    (not the public 8000)."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    for name in ("docker-compose.yml", "docker-compose.dev.yml"):
        compose = yaml.safe_load((root / name).read_text())
        gate = compose["services"]["gate"]
        environment = gate.get("environment", {})
        if isinstance(environment, list):
            environment = dict(e.split("=", 1) for e in environment)
        assert environment.get("GATE_METRICS_ADDR") == f"0.0.0.0:{metrics_port_for(8000)}", name
    config = yaml.safe_load((root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "gate")
    ports = [sd["port"] for sd in job.get("dns_sd_configs", [])] + [
        int(t.rsplit(":", 1)[1]) for sc in job.get("static_configs", []) for t in sc["targets"]
    ]
    assert ports and set(ports) == {metrics_port_for(8000)} == {18000}, ports
