"""Several database hosts: GATE_MYSQL_URL's host list, the writer rule (one node takes
the writes, the first usable in list order, back only after the hold-down; a process
that starts follows the writer mark), server identity guarding thread ids, migrations
and start-up on MariaDB Galera.

The Galera tests start a 3-node cluster on loopback (tests/galera.py) at
GATE_TEST_GALERA_PORT (default 13400), or use one already started there with
`python -m tests.galera up PORT`; they are skipped where Galera is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime

import aiomysql
import pymysql
import pytest
import redis.asyncio as aioredis

from gate.base.settings import MysqlTarget, SettingsError, load_settings
from gate.inventory.check import server_findings
from gate.inventory.janitor import Janitor
from gate.store.db import Database, connect_kwargs
from gate.store.dbwriter import NoWriter, WriterSelector, choose, first_usable, judge
from gate.store.keys import owner_keys
from gate.store.migrate import migrate, read_migrations
from gate.store.process_lease import parse_thread_field, thread_field
from gate.store.writer_mark import WriterMark, freshest, marked_node
from tests.galera import LocalGalera, _pidfile, galera_supported
from tests.support import ADMIN_TOKEN, GATE_BIN, ROOT, GateProcess, base_env

GALERA_BASE = int(os.environ.get("GATE_TEST_GALERA_PORT", "13400"))
DATABASE = "gate_writer_test"
HOLD_DOWN_SECONDS = 4
FAILOVER_SECONDS = 10


# -- GATE_MYSQL_URL's hosts ----------------------------------------------------------


def test_a_single_host_parses_as_before() -> None:
    t = MysqlTarget.parse("mysql://gate_app:s%40cret@db.example:3307/gate")
    assert (t.host, t.port, t.user, t.password.reveal(), t.database) == (
        "db.example",
        3307,
        "gate_app",
        "s@cret",
        "gate",
    )
    assert t.nodes == () and t.node_list == (("db.example", 3307),) and not t.clustered
    assert MysqlTarget.parse("mysql:///gate").node_list == (("127.0.0.1", 3306),)
    sock = MysqlTarget.parse("mysql://root@localhost/gate?unix_socket=/run/mysqld/mysqld.sock")
    assert sock.unix_socket == "/run/mysqld/mysqld.sock" and sock.host == "localhost"


def test_several_hosts_name_every_node_in_order() -> None:
    t = MysqlTarget.parse("mysql://u:p:w@h1:3306,H2,10.0.0.3:3310,[fd00::4]:3311/gate?x=1")
    assert t.node_list == (
        ("h1", 3306),
        ("h2", 3306),
        ("10.0.0.3", 3310),
        ("fd00::4", 3311),
    )
    assert (t.host, t.port, t.user, t.password.reveal()) == ("h1", 3306, "u", "p:w")
    assert t.clustered
    assert t.on(("h2", 3306)).node_list == (("h2", 3306),)
    assert t.on(("h2", 3306)).database == "gate"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://root@h1:3306,h2:99999/gate", "has a port that is not 1-65535"),
        ("mysql://root@h1:3306,h2:0/gate", "has a port that is not 1-65535"),
        ("mysql://root@h1:3306,h2:http/gate", "has a port that is not 1-65535"),
        ("mysql://root@h1:3306,,h2/gate", "has a host that is not"),
        ("mysql://root@h1:3306,h1:3306/gate", "names a host:port twice"),
        ("mysql://root@h1,h2/gate?unix_socket=/tmp/s", "unix_socket goes with one host"),
        ("mysql://root@" + ",".join(f"h{i}" for i in range(17)) + "/gate", "more than 16"),
        ("mysql://root@h1:3306,h%2:1/gate", "has a host that is not"),
    ],
)
def test_bad_host_lists_are_refused(url: str, message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        MysqlTarget.parse(url)


def test_bad_host_list_stops_the_cli_with_exit_2() -> None:
    env = {**base_env(), "GATE_MYSQL_URL": "mysql://root@127.0.0.1:3306,127.0.0.1:70000/gate"}
    out = subprocess.run(
        [GATE_BIN, "check"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2, out.stderr
    assert "GATE_MYSQL_URL has a port that is not 1-65535" in out.stderr
    assert "Traceback" not in out.stderr


def test_writer_settings_are_bounded() -> None:
    env = base_env()
    s = load_settings(env)
    assert (s.db_probe_interval_seconds, s.db_probe_timeout_seconds) == (1.0, 1.0)
    assert s.db_writer_hold_down_seconds == 30.0
    for name, value in (
        ("GATE_DB_PROBE_INTERVAL_SECONDS", "6"),
        ("GATE_DB_PROBE_TIMEOUT_SECONDS", "0"),
        ("GATE_DB_PROBE_TIMEOUT_SECONDS", "2.5"),  # interval + 2 timeouts stay within 9 s
        ("GATE_DB_WRITER_HOLD_DOWN_SECONDS", "-1"),
    ):
        with pytest.raises(SettingsError, match=name):
            load_settings({**env, name: value})


# -- the rule ------------------------------------------------------------------------

A, B, C = ("a", 3306), ("b", 3306), ("c", 3306)


def test_the_first_usable_node_in_list_order_is_chosen() -> None:
    nodes = (A, B, C)
    # No history: a node usable for longer than the hold-down wins by its place.
    assert choose(nodes, {A: 0.0, B: 0.0, C: 0.0}, None, 100.0, 30.0) == A
    assert choose(nodes, {A: None, B: 0.0, C: 0.0}, None, 100.0, 30.0) == B
    assert choose(nodes, {A: None, B: None, C: None}, B, 100.0, 30.0) is None


def test_a_node_back_takes_the_writes_only_after_the_hold_down() -> None:
    nodes = (A, B, C)
    # A came back 10 s ago; B is the writer: B stays until A has been usable 30 s.
    assert choose(nodes, {A: 90.0, B: 0.0, C: 0.0}, B, 100.0, 30.0) == B
    assert choose(nodes, {A: 90.0, B: 0.0, C: 0.0}, B, 119.9, 30.0) == B
    assert choose(nodes, {A: 90.0, B: 0.0, C: 0.0}, B, 120.0, 30.0) == A
    # The writer fails while A is in its hold-down: C (usable long enough) is next.
    assert choose(nodes, {A: 90.0, B: None, C: 0.0}, B, 100.0, 30.0) == C
    # Nothing usable long enough: a node just back beats no writer.
    assert choose(nodes, {A: None, B: 99.0, C: 98.0}, A, 100.0, 30.0) == B


def test_a_node_is_usable_only_writable_and_synced() -> None:
    galera = {"wsrep_on": "ON", "read_only": "OFF", "server_id": "1", "wsrep_node_name": "n0"}
    synced = {"wsrep_local_state": "4", "wsrep_cluster_status": "Primary", "Uptime": "50"}
    ok = judge(A, galera, synced)
    assert ok.usable and ok.wsrep and ok.uptime_seconds == 50 and "n0" in ok.server
    assert judge(A, {**galera, "read_only": "ON"}, synced).reason == "read-only"
    assert "not Synced" in judge(A, galera, {**synced, "wsrep_local_state": "2"}).reason
    non_primary = judge(A, galera, {**synced, "wsrep_cluster_status": "non-Primary"})
    assert not non_primary.usable and "primary component" in non_primary.reason
    single = {"wsrep_on": "OFF", "read_only": "OFF", "hostname": "db", "port": "3306"}
    assert judge(A, single, {"Uptime": "5"}).usable
    assert judge(A, {**single, "read_only": "ON"}, {}).reason == "read-only"


def test_a_desynced_or_unready_node_is_not_usable() -> None:
    galera = {"wsrep_on": "ON", "read_only": "OFF", "server_id": "1", "wsrep_node_name": "n0"}
    synced = {"wsrep_local_state": "4", "wsrep_cluster_status": "Primary", "wsrep_ready": "ON"}
    desynced = judge(A, {**galera, "wsrep_desync": "ON"}, synced)
    assert not desynced.usable and "wsrep_desync = ON" in desynced.reason
    donor = {**synced, "wsrep_local_state": "2", "wsrep_local_state_comment": "Donor/Desynced"}
    assert judge(A, galera, donor).reason == "not Synced (Donor/Desynced, wsrep_local_state 2)"
    assert (
        judge(A, galera, {**synced, "wsrep_ready": "OFF"}).reason == "not ready (wsrep_ready = OFF)"
    )


def test_the_freshest_mark_names_a_listed_node_by_address_or_server() -> None:
    older = WriterMark("a:3306", "n0 (server_id 1)", datetime(2030, 1, 1, 0, 0, 0), "h pid 1")
    newer = WriterMark("b:3306", "n1 (server_id 2)", datetime(2030, 1, 1, 0, 0, 1), "h pid 2")
    assert freshest([older, None, newer]) == newer and freshest([None]) is None
    assert marked_node(newer, (A, B, C), {}) == B
    # The same servers listed under other names: found by who answers there.
    renamed = (("10.0.0.1", 3306), ("10.0.0.2", 3306))
    assert marked_node(newer, renamed, {renamed[1]: "n1 (server_id 2)"}) == renamed[1]
    assert marked_node(newer, renamed, {}) is None and marked_node(None, (A,), {}) is None


def test_thread_records_name_their_server_with_several_hosts() -> None:
    assert thread_field(42, None) == "42" and parse_thread_field("42") == (42, None)
    assert thread_field(42, "10.0.0.1:3306") == "42@10.0.0.1:3306"
    assert parse_thread_field("42@10.0.0.1:3306") == (42, "10.0.0.1:3306")


def test_check_reports_unsafe_galera_settings_as_errors_and_durability_as_warnings() -> None:
    galera = {"wsrep_on": "ON", "binlog_format": "ROW", "innodb_autoinc_lock_mode": "2"}
    good = {"wsrep_cluster_status": "Primary", "wsrep_local_state": "4", "wsrep_cluster_size": "3"}
    assert server_findings(galera, good, 3) == ([], [])
    errors, _ = server_findings(
        {**galera, "binlog_format": "STATEMENT", "innodb_autoinc_lock_mode": "1"},
        {**good, "wsrep_cluster_status": "non-Primary", "wsrep_local_state": "2"},
        3,
    )
    assert len(errors) == 4 and any("binlog_format" in e for e in errors)
    assert any("innodb_autoinc_lock_mode" in e for e in errors)
    assert any("Primary" in e for e in errors) and any("Synced" in e for e in errors)
    errors, warnings = server_findings(galera, {**good, "wsrep_cluster_size": "2"}, 3)
    assert errors == [] and "wsrep_cluster_size is 2" in warnings[0]
    # A single server with MariaDB's defaults: warnings only, `gate check` passes.
    single = {"wsrep_on": "OFF", "innodb_flush_log_at_trx_commit": "2", "log_bin": "ON"}
    errors, warnings = server_findings({**single, "sync_binlog": "0"}, {}, 1)
    assert errors == [] and len(warnings) == 2
    assert server_findings({**single, "innodb_flush_log_at_trx_commit": "1"}, {}, 1)[0] == []
    # Several hosts without a synchronous cluster (async replicas) is an error.
    errors, _ = server_findings(single, {}, 2)
    assert errors and "wsrep_on is OFF" in errors[0]


# -- on a real Galera cluster --------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalGalera]:
    if not galera_supported():
        pytest.skip("MariaDB Galera (galera-4, rsync) is not installed")
    if _pidfile(GALERA_BASE).exists():
        # Started by hand (`python -m tests.galera up PORT`): used, left running.
        yield LocalGalera(GALERA_BASE)
        return
    galera = LocalGalera(GALERA_BASE)
    try:
        galera.start()
        yield galera
    finally:
        galera.stop()


def _sql(galera: LocalGalera, i: int, sql: str) -> list[tuple[object, ...]]:
    conn = galera.connect(i)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return list(cur.fetchall())
    finally:
        conn.close()


@pytest.fixture
def writable(cluster: LocalGalera) -> Iterator[LocalGalera]:
    """Every node writable before and after the test."""
    for i in range(cluster.nodes):
        _sql(cluster, i, "SET GLOBAL read_only = 0")
    yield cluster
    for i in range(cluster.nodes):
        _sql(cluster, i, "SET GLOBAL read_only = 0")


def _url(galera: LocalGalera, database: str = DATABASE) -> str:
    return LocalGalera.url_for(galera.base_port, database, galera.nodes)


def _env(galera: LocalGalera, **extra: str) -> dict[str, str]:
    return {
        **base_env(),
        "GATE_MYSQL_URL": _url(galera),
        "GATE_DB_WRITER_HOLD_DOWN_SECONDS": str(HOLD_DOWN_SECONDS),
        **extra,
    }


def _reset(galera: LocalGalera, database: str = DATABASE) -> None:
    _sql(galera, 0, f"DROP DATABASE IF EXISTS `{database}`")


def _metric_nodes(text: str) -> dict[str, float]:
    found = re.findall(r'^gate_db_writer_info\{node="([^"]+)"\} ([0-9.e+-]+)$', text, re.M)
    return {node: float(value) for node, value in found}


def _new_deal(gate: GateProcess) -> int:
    """A deal made through the admin API (its id from the writer's AUTO_INCREMENT)."""
    body = b'{"title": "writer", "unit_price": 500, "currency": "EUR", "stock": 5}'
    req = urllib.request.Request(
        gate.url + "/v1/admin/deals",
        data=body,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 201
        return int(json.loads(resp.read())["id"])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_writer(gate: GateProcess, node: str, timeout_seconds: float) -> float:
    """Seconds until every worker's gate_db_writer_info names `node` alone."""
    started = time.monotonic()
    last: dict[str, float] = {}
    while time.monotonic() - started < timeout_seconds:
        last = _metric_nodes(_get(f"{gate.metrics_url}/metrics")[1].decode())
        if last.get(node) == 1 and all(v == 0 for n, v in last.items() if n != node):
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"writer not {node} after {timeout_seconds} s: {last}")


def test_every_process_moves_off_a_read_only_writer_and_back_after_the_hold_down(
    writable: LocalGalera,
) -> None:
    galera = writable
    _reset(galera)
    asyncio.run(migrate(MysqlTarget.parse(_url(galera))))
    first, second = galera.hosts[0], galera.hosts[1]
    gate = GateProcess(_env(galera), workers=2)
    try:
        gate.wait_ready(60)
        assert _wait_writer(gate, first, 10) >= 0
        deals = [_new_deal(gate)]
        ready = _get(gate.url + "/readyz")
        assert ready[0] == 200 and f'"db_writer":"{first}"' in ready[1].decode()
        failovers_before = _failovers(gate)

        _sql(galera, 0, "SET GLOBAL read_only = 1")
        moved_after = _wait_writer(gate, second, 30)
        assert moved_after <= FAILOVER_SECONDS, moved_after
        body = _get(gate.url + "/readyz")[1].decode()
        assert f'"db_writer":"{second}"' in body and "read-only" in body
        # Both workers moved (the counter is a tally: it may reach the scrape a
        # fraction of a second after the gauge the wait above read).
        assert _failovers_reach(gate, failovers_before + 2, 2.0), _failovers(gate)
        deals.append(_new_deal(gate))

        _sql(galera, 0, "SET GLOBAL read_only = 0")
        back_after = _wait_writer(gate, first, 60)
        # Not before the hold-down (less one probe interval of slack for the clock).
        assert back_after >= HOLD_DOWN_SECONDS - 1.5, back_after
        deals.append(_new_deal(gate))
        assert gate.alive()
        # AUTO_INCREMENT on three writers in turn: no deal id handed out twice, and
        # every node holds every deal.
        assert len(set(deals)) == 3, deals
        for i in range(galera.nodes):
            rows = _sql(galera, i, f"SELECT id FROM `{DATABASE}`.deals ORDER BY id")
            assert sorted(deals) == [int(r[0]) for r in rows]  # type: ignore[call-overload]
    finally:
        gate.stop()


def _writer_of(gate: GateProcess) -> str | None:
    """The node this one-worker gate's gate_db_writer_info names (None: no answer)."""
    status, body = _get(f"{gate.metrics_url}/metrics")
    if status != 200:
        return None
    nodes = [n for n, v in _metric_nodes(body.decode()).items() if v == 1]
    return nodes[0] if len(nodes) == 1 else None


def test_a_gate_that_starts_during_a_hold_down_writes_where_the_others_do(
    writable: LocalGalera,
) -> None:
    """Node 0 desynced (SET GLOBAL wsrep_desync = ON): gate A moves to node 1. Node 0
    resynced, and gate B starts during A's hold-down: B writes to node 1 with A (the
    writer mark A wrote there), then both go back to node 0 when A's hold-down ends.
    One writer throughout, read from each process's writer gauge and /readyz. By the
    rule without the mark, B took node 0 at once (usable since its server started):
    two writers for the hold-down."""
    galera = writable
    _reset(galera)
    asyncio.run(migrate(MysqlTarget.parse(_url(galera))))
    first, second = galera.hosts[0], galera.hosts[1]
    hold_down = 30.0  # the default: room for B to start well within it on a busy host
    env = _env(galera, GATE_DB_WRITER_HOLD_DOWN_SECONDS=str(hold_down))
    a, b = GateProcess(env), None
    try:
        a.wait_ready(60)
        _wait_writer(a, first, 10)
        _sql(galera, 0, "SET GLOBAL wsrep_desync = ON")
        assert _wait_writer(a, second, 30) <= FAILOVER_SECONDS
        ready = _get(a.url + "/readyz")[1].decode()
        assert "wsrep_desync = ON" in ready, ready
        _sql(galera, 0, "SET GLOBAL wsrep_desync = OFF")
        _wait_state(galera, 0, synced=True)
        resynced = time.monotonic()
        b = GateProcess(env)
        b.wait_ready(60)
        b_ready = time.monotonic() - resynced
        assert b_ready < hold_down - 5, f"B took {b_ready:.1f} s to start: no hold-down left"
        ready = _get(b.url + "/readyz")[1].decode()
        assert f'"db_writer":"{second}"' in ready, ready
        samples: list[tuple[float, str | None, str | None]] = []
        while time.monotonic() - resynced < hold_down + 20:
            at = time.monotonic() - resynced
            samples.append((at, _writer_of(a), _writer_of(b)))
            if samples[-1][1:] == (first, first) and at > hold_down:
                break
            time.sleep(0.2)
        assert samples[0][1:] == (second, second), samples[:3]
        assert samples[-1][1:] == (first, first), samples[-5:]
        a_back = next(at for at, wa, _ in samples if wa == first)
        # A kept its hold-down (less a probe interval of slack for the clocks) ...
        assert a_back >= hold_down - 1.5, a_back
        # ... and B moved with it, within a probe interval (plus a scrape) either way
        # (both end the same hold-down, each on its own probe's tick): no other
        # moment with two writers.
        apart = [(at, wa, wb) for at, wa, wb in samples if wa != wb]
        assert all(abs(at - a_back) <= 2.5 for at, _, _ in apart), apart
        assert all(None not in sample for sample in samples), samples
    finally:
        _sql(galera, 0, "SET GLOBAL wsrep_desync = OFF")
        a.stop()
        if b is not None:
            b.stop()
    _wait_state(galera, 0, synced=True)


def _failovers(gate: GateProcess) -> float:
    text = _get(f"{gate.metrics_url}/metrics")[1].decode()
    found = re.search(r"^gate_db_failovers_total ([0-9.e+]+)$", text, re.M)
    return float(found[1]) if found else 0.0


def _failovers_reach(gate: GateProcess, at_least: float, timeout_seconds: float) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while _failovers(gate) < at_least:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_gate_refuses_to_start_on_a_read_only_single_node(writable: LocalGalera) -> None:
    galera = writable
    _reset(galera)
    asyncio.run(migrate(MysqlTarget.parse(_url(galera))))
    _sql(galera, 0, "SET GLOBAL read_only = 1")
    only_first = f"mysql://root@{galera.hosts[0]}/{DATABASE}"
    refused = subprocess.run(
        [GATE_BIN, "serve", "--port", "1"],
        env={**_env(galera), "GATE_MYSQL_URL": only_first},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1, refused.stderr
    assert (
        "refusing to start" in refused.stderr and f"{galera.hosts[0]} read-only" in refused.stderr
    )
    assert "Traceback" not in refused.stderr
    # The same node listed first of three: another node is usable, so it starts there.
    target = MysqlTarget.parse(_url(galera))
    node, report = asyncio.run(first_usable(target, 3))
    assert node == ("127.0.0.1", galera.port(1)) and report.usable
    with pytest.raises(NoWriter, match="read-only"):
        asyncio.run(first_usable(MysqlTarget.parse(only_first), 3))


def test_migrations_run_twice_at_once_on_galera_apply_once(writable: LocalGalera) -> None:
    galera = writable
    database = DATABASE + "_mig"
    _reset(galera, database)
    code = (
        "import asyncio, sys\n"
        "from gate.store.migrate import migrate\n"
        "from gate.base.settings import MysqlTarget\n"
        "print(len(asyncio.run(migrate(MysqlTarget.parse(sys.argv[1])))))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, _url(galera, database)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    counts = sorted(int(o[0].strip()) for o in outs)
    assert counts[0] == 0 and counts[1] > len(read_migrations()), counts
    # Every node holds every migration, once.
    for i in range(galera.nodes):
        rows = _sql(galera, i, f"SELECT COUNT(*) FROM `{database}`.schema_migrations")
        assert int(rows[0][0]) == len(read_migrations())  # type: ignore[call-overload]
    _reset(galera, database)


async def _db_on(galera: LocalGalera) -> Database:
    env = _env(galera)
    db = Database(load_settings(env), pool_max=4)
    await db.start()
    return db


async def test_a_thread_id_is_never_killed_on_another_server(writable: LocalGalera) -> None:
    """The janitor's and the unknown outcomes' KILL: a thread id issued by node 0 is
    ended on node 0, never on node 1 where the same number is someone else's."""
    galera = writable
    _reset(galera)
    await migrate(MysqlTarget.parse(_url(galera)))
    db = await _db_on(galera)
    try:
        assert db.node == galera.hosts[0]
        second = MysqlTarget.parse(_url(galera)).on(("127.0.0.1", galera.port(1)))
        bystander = await aiomysql.connect(**connect_kwargs(second, 5))
        try:
            thread_id = bystander.thread_id()
            # Another server than the one this process wrote to answers at node 1's
            # address: its thread of that number is left alone, nothing is proven.
            db.servers[galera.hosts[1]] = "elsewhere:3306 (server_id 99)"
            assert not await db.wait_thread_gone(thread_id, 1.0, 3.0, node=galera.hosts[1])
            assert await _alive(bystander)
            del db.servers[galera.hosts[1]]
            # Named as node 1's thread: killed (it is ours there).
            gone = await db.wait_thread_gone(thread_id, 1.0, 3.0, node=galera.hosts[1])
            assert gone
            with pytest.raises(pymysql.err.MySQLError):
                async with bystander.cursor() as cur:
                    await cur.execute("SELECT 1")
        finally:
            bystander.close()
        bystander = await _bystander(galera, second)
        try:
            thread_id = bystander.thread_id()
            # The same number said to come from node 0 (the writer): node 1's thread
            # is left alone whatever node 0 does with it.
            await db.wait_thread_gone(thread_id, 1.0, 1.0, node=galera.hosts[0])
            await db.wait_thread_gone(thread_id, 1.0, 1.0, node=galera.hosts[2])
            async with bystander.cursor() as cur:
                await cur.execute("SELECT 1")
                assert await cur.fetchone() == (1,)
        finally:
            bystander.close()
    finally:
        await db.close()


# Every thread but the asking connection's own (it is gone once the question is answered).
PROCESSLIST = "SELECT ID FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID()"


async def _bystander(galera: LocalGalera, target: MysqlTarget) -> aiomysql.Connection:
    """A connection to `target` whose thread id no other node uses now (so that the
    test ends nobody else's thread)."""
    for _ in range(50):
        conn = await aiomysql.connect(**connect_kwargs(target, 5))
        ids = set()
        for i in (0, 2):
            rows = await asyncio.to_thread(_sql, galera, i, PROCESSLIST)
            ids |= {int(r[0]) for r in rows}  # type: ignore[call-overload]
        if conn.thread_id() not in ids:
            return conn
        conn.close()
    raise AssertionError("no free thread id")


async def test_the_pool_follows_the_writer(writable: LocalGalera) -> None:
    """A Database moves its connections to the next node when its writer turns
    read-only; what it reads afterwards comes from the new node."""
    galera = writable
    _reset(galera)
    await migrate(MysqlTarget.parse(_url(galera)))
    db = await _db_on(galera)
    try:
        row = await db.fetchone("SELECT @@port")
        assert row is not None and int(row[0]) == galera.port(0)
        await asyncio.to_thread(_sql, galera, 0, "SET GLOBAL read_only = 1")
        assert db.selector is not None
        await db.selector.run_once()
        assert db.node == galera.hosts[1]
        row = await db.fetchone("SELECT @@port")
        assert row is not None and int(row[0]) == galera.port(1)
        assert db.selector.status()[galera.hosts[0]] == "read-only"
    finally:
        await db.close()


async def test_one_late_probe_keeps_the_writer_two_in_a_row_move_it(
    writable: LocalGalera,
) -> None:
    """A writer that misses one probe's timeout (a load spike) keeps the writes; one
    that misses two in a row (a stalled or unreachable host) loses them. The node is
    stalled for real (SIGSTOP): it accepts connections and answers nothing. The
    selector is driven by hand (no probe loop beside it)."""
    galera = writable
    if not galera.procs:
        pytest.skip("the cluster was started by hand: its processes are not this run's")
    # A fresh database: no writer mark left by an earlier test naming another node.
    _reset(galera)
    await migrate(MysqlTarget.parse(_url(galera)))
    moves: list[str] = []

    async def moved(_old: object, new: tuple[str, int], _report: object) -> None:
        moves.append(f"{new[0]}:{new[1]}")

    selector = WriterSelector(load_settings(_env(galera)), moved)
    first, second = galera.hosts[0], galera.hosts[1]
    try:
        await selector.run_once()
        assert moves == [first]
        galera.pause(0)
        try:
            await selector.run_once()
        finally:
            galera.resume(0)
        assert moves == [first]
        assert selector.status()[first].startswith("unreachable")
        await selector.run_once()  # answered: the next late probe is a first one again
        assert selector.status()[first] == "ok"
        galera.pause(0)
        try:
            await selector.run_once()
            assert moves == [first]
            await selector.run_once()
        finally:
            galera.resume(0)
        assert moves == [first, second]
    finally:
        selector.close()
    _wait_state(galera, 0, synced=True)


def _wait_state(galera: LocalGalera, i: int, synced: bool, timeout_seconds: float = 60) -> None:
    deadline = time.monotonic() + timeout_seconds
    while galera.status(i).synced != synced or (
        synced and galera.status(i).cluster_size != galera.nodes
    ):
        assert time.monotonic() < deadline, f"node {i} synced is not {synced}"
        time.sleep(0.2)


async def test_a_partitioned_writers_thread_is_ended_on_it_then_read_on_the_new_one(
    writable: LocalGalera,
) -> None:
    """An unknown outcome of a writer that dropped out of the cluster: the thread id is
    asked about on that node (it still answers), which commits nothing any more, and
    the lookup then reads the new writer."""
    galera = writable
    if not galera.can_isolate():
        pytest.skip("the nodes refuse gmcast.isolate at run time (the wsrep_provider plugin)")
    _reset(galera)
    await migrate(MysqlTarget.parse(_url(galera)))
    db = await _db_on(galera)
    first = MysqlTarget.parse(_url(galera)).on(("127.0.0.1", galera.port(0)))
    stranded = await aiomysql.connect(**connect_kwargs(first, 5))
    try:
        assert db.node == galera.hosts[0] and db.selector is not None
        opened = asyncio.get_running_loop().time()
        await asyncio.to_thread(galera.isolate, 0)
        await asyncio.to_thread(_wait_state, galera, 0, False)
        await db.selector.run_once()
        assert db.node == galera.hosts[1]
        assert "primary component" in db.selector.status()[galera.hosts[0]] or (
            "not Synced" in db.selector.status()[galera.hosts[0]]
        )
        age = asyncio.get_running_loop().time() - opened
        assert await db.wait_thread_gone(stranded.thread_id(), age, 5.0, node=galera.hosts[0])
        # Why that is final: the cut-off node refuses every write (and the KILL).
        with pytest.raises(pymysql.err.OperationalError, match="WSREP"):
            async with stranded.cursor() as cur:
                await cur.execute("UPDATE deals SET title = title WHERE id = 0")
        row = await db.fetchone("SELECT @@port")
        assert row is not None and int(row[0]) == galera.port(1)
    finally:
        stranded.close()
        await asyncio.to_thread(galera.heal, 0, False)
        await asyncio.to_thread(_wait_state, galera, 0, True)
        await db.close()


async def _alive(conn: aiomysql.Connection) -> bool:
    try:
        async with conn.cursor() as cur:
            await cur.execute("SELECT 1")
            return await cur.fetchone() == (1,)
    except pymysql.err.MySQLError:
        return False


async def test_the_janitor_ends_a_dead_gates_thread_on_the_node_that_issued_it(
    writable: LocalGalera,
) -> None:
    """A dead gate's connection record names each thread's node: the janitor ends it
    there, and never ends a thread of the same number on another node."""
    galera = writable
    _reset(galera)
    await migrate(MysqlTarget.parse(_url(galera)))
    db = await _db_on(galera)
    rds = aioredis.Redis.from_url(base_env()["GATE_REDIS_URL"], decode_responses=True)
    janitor = Janitor(db.settings, db, rds, None)  # type: ignore[arg-type]
    second = MysqlTarget.parse(_url(galera)).on(("127.0.0.1", galera.port(1)))
    victims: list[aiomysql.Connection] = []
    try:
        assert db.node == galera.hosts[0]
        # The pool's connection exists before the victims' ids are chosen.
        assert await db.fetchone("SELECT 1") == (1,)
        seconds, micros = await rds.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        for owner, node in (("a0a0a0a0a0a0a0a1", galera.hosts[1]), ("a0a0a0a0a0a0a0a2", None)):
            conn = await _bystander(galera, second)
            victims.append(conn)
            keys = owner_keys(owner)
            await rds.delete(keys.lease, keys.conns)
            # node None: recorded as the writer's (node 0) thread, as a single server
            # records it; the same number on node 1 is someone else's.
            field = thread_field(conn.thread_id(), node or galera.hosts[0])
            await rds.hset(keys.conns, mapping={"_": "test", field: now_ms - 500})
            assert await janitor._threads_gone(owner)
        issued_by_node_1, same_number_on_node_1 = victims
        assert not await _alive(issued_by_node_1)
        assert await _alive(same_number_on_node_1)
    finally:
        for conn in victims:
            conn.close()
        await rds.aclose()
        await db.close()


def test_gate_check_on_galera_reports_the_writer_and_unusable_nodes(
    writable: LocalGalera,
) -> None:
    galera = writable
    _reset(galera)
    asyncio.run(migrate(MysqlTarget.parse(_url(galera))))
    _sql(galera, 2, "SET GLOBAL read_only = 1")
    out = subprocess.run(
        [GATE_BIN, "check", "--json"],
        env=_env(galera),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    database = json.loads(out.stdout)["database"]
    assert database["galera"] is True and database["writer"] == galera.hosts[0]
    assert database["errors"] == []
    assert f"node {galera.hosts[2]} is not usable: read-only" in database["warnings"]
    text = subprocess.run(
        [GATE_BIN, "check"], env=_env(galera), capture_output=True, text=True, timeout=120
    )
    assert f"database: OK  writer={galera.hosts[0]} (Galera)" in text.stdout
    assert "all invariants hold" in text.stdout


def test_a_gate_refuses_to_start_on_a_node_cut_off_from_the_cluster(
    writable: LocalGalera,
) -> None:
    galera = writable
    if not galera.can_isolate():
        pytest.skip("the nodes refuse gmcast.isolate at run time (the wsrep_provider plugin)")
    _reset(galera)
    asyncio.run(migrate(MysqlTarget.parse(_url(galera))))
    only_first = f"mysql://root@{galera.hosts[0]}/{DATABASE}"
    galera.isolate(0)
    try:
        _wait_state(galera, 0, False)
        refused = subprocess.run(
            [GATE_BIN, "serve", "--port", "1"],
            env={**_env(galera), "GATE_MYSQL_URL": only_first},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 1, refused.stderr
        assert f"{galera.hosts[0]} not in the primary component" in refused.stderr
        # Listed with the others, the gate would start on node 1.
        node, _ = asyncio.run(first_usable(MysqlTarget.parse(_url(galera)), 3))
        assert node == ("127.0.0.1", galera.port(1))
    finally:
        galera.heal(0, False)
        _wait_state(galera, 0, True)
