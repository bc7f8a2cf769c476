"""Migrations: versioned files applied once each, routines re-applied when their file
changes; safe to run twice or from several processes at once, also on every node of a
Galera cluster at once; a statement refused by a deadlock runs again, once; a database
migrated before the routines moved out of the versioned files upgrades cleanly."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiomysql
import pytest

from gate.base.settings import MysqlTarget, Settings
from gate.store import migrate_lock
from gate.store.db import connect_kwargs, notes_off
from gate.store.migrate import (
    DB_DIR,
    SUPERSEDED_FILE_NAME,
    MigrationError,
    migrate,
    pending,
    read_migrations,
    read_routines,
    read_superseded,
    split_statements,
)
from tests.galera import LocalGalera
from tests.support import GALERA_RUN, GATE_BIN


@pytest.fixture
async def scratch(settings: Settings) -> MysqlTarget:
    # Named after the suite's own database, so parallel suites never share it.
    name = f"{settings.mysql.database}_mig"
    target = MysqlTarget.parse(
        f"mysql://{settings.mysql.user}@{settings.mysql.host}:{settings.mysql.port}/{name}"
    )
    conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
    async with conn.cursor() as cur:
        await notes_off(cur)
        await cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    conn.close()
    return target


def _all_names() -> list[str]:
    return [f"{m.version:03d}_{m.name}" for m in read_migrations()] + [
        f"routine {r.name}" for r in read_routines()
    ]


async def _rows(
    target: MysqlTarget, sql: str, args: tuple[object, ...] = (), causal: bool = False
) -> list[tuple[Any, ...]]:
    conn = await aiomysql.connect(**connect_kwargs(target, 5))
    try:
        async with conn.cursor() as cur:
            if causal:
                # A Galera node answers after applying every write committed anywhere.
                await cur.execute("SET SESSION wsrep_sync_wait = 1")
            await cur.execute(sql, args)
            return [tuple(r) for r in await cur.fetchall()]
    finally:
        conn.close()


async def _server_routines(target: MysqlTarget) -> dict[str, str]:
    rows = await _rows(
        target,
        "SELECT ROUTINE_NAME, ROUTINE_DEFINITION FROM information_schema.ROUTINES"
        " WHERE ROUTINE_SCHEMA = %s",
        (target.database,),
    )
    return {str(n): str(d) for n, d in rows}


async def test_concurrent_and_repeated_migrations(scratch: MysqlTarget) -> None:
    names = _all_names()
    assert names[:2] == ["001_schema", "002_procedures"]
    assert "routine gate_reserve" in names and "routine gate_payment_event_group" in names
    assert await pending(scratch) == names
    results = await asyncio.gather(*(migrate(scratch) for _ in range(3)))
    assert sorted(map(tuple, results)) == [(), (), tuple(names)]
    assert await migrate(scratch) == []
    assert await pending(scratch) == []
    assert await _rows(scratch, "SELECT version, name FROM schema_migrations ORDER BY version") == [
        (m.version, m.name) for m in read_migrations()
    ]
    assert await _rows(scratch, "SELECT name, checksum FROM schema_routines ORDER BY name") == [
        (r.name, r.checksum) for r in read_routines()
    ]
    assert set(await _server_routines(scratch)) == {r.name for r in read_routines()}


async def _drop(target: MysqlTarget) -> None:
    conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            await notes_off(cur)
            await cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
    finally:
        conn.close()


async def _gate_migrate(env: dict[str, str], url: str) -> tuple[int | None, str, str]:
    proc = await asyncio.create_subprocess_exec(
        GATE_BIN,
        "migrate",
        env={**env, "GATE_MYSQL_URL": url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.skipif(
    not GALERA_RUN,
    reason="needs the local Galera cluster: GATE_TEST_GALERA=1 (scripts/test's Galera suite)",
)
async def test_gate_migrate_started_on_every_galera_node_at_once(
    galera: LocalGalera | None, scratch: MysqlTarget, env: dict[str, str]
) -> None:
    """Two `gate migrate` per node of a 3-node Galera cluster, all started at once, on
    a fresh database, several rounds: every run exits 0, each migration and routine is
    applied by exactly one of them, and every node has each recorded once. (With the
    lock a row held FOR UPDATE, runs on two nodes both applied 001: "Table 'deals'
    already exists"; on one node, another run's CREATE TABLE of the lock table aborted
    the lock row's insert: errno 1213.)"""
    assert galera is not None
    runs_per_node, rounds = 2, 4
    names = _all_names()
    nodes = [MysqlTarget.parse(f"mysql://root@{host}/{scratch.database}") for host in galera.hosts]
    for round_no in range(rounds):
        await _drop(nodes[round_no % len(nodes)])
        results = await asyncio.gather(
            *(
                _gate_migrate(env, f"mysql://root@{host}/{scratch.database}")
                for host in galera.hosts
                for _ in range(runs_per_node)
            )
        )
        for returncode, out, err in results:
            assert returncode == 0, (round_no, out, err)
            assert "Traceback" not in err, err
        applied: Counter[str] = Counter()
        for _, out, _ in results:
            for line in out.splitlines():
                if line.startswith("applied: "):
                    applied.update(line.removeprefix("applied: ").split(", "))
        assert applied == Counter(names), round_no
        for node in nodes:
            assert await _rows(
                node, "SELECT version, name FROM schema_migrations ORDER BY version", causal=True
            ) == [(m.version, m.name) for m in read_migrations()]
            assert await _rows(
                node, "SELECT name, checksum FROM schema_routines ORDER BY name", causal=True
            ) == [(r.name, r.checksum) for r in read_routines()]
            assert set(await _server_routines(node)) == {r.name for r in read_routines()}
            assert await _rows(node, "SELECT name, holder FROM schema_lock", causal=True) == [
                ("gate.migrate", None)
            ]
        assert await pending(nodes[0]) == []


async def test_a_deadlocked_migration_statement_runs_again_once(
    scratch: MysqlTarget,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real InnoDB deadlock on a migration's statement: the migration's UPDATE holds
    row 1 and waits for row 2, which a transaction of this test holds; that
    transaction (the heavier one: 200 rows written) then asks for row 1. InnoDB rolls
    the migration's statement back with errno 1213; gate migrate runs it again after
    a backoff and the data move happens exactly once."""
    await migrate(scratch)
    conn = await aiomysql.connect(**connect_kwargs(scratch, 5))
    async with conn.cursor() as cur:
        await cur.execute("CREATE TABLE probe (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB")
        await cur.execute("INSERT INTO probe VALUES (1, 0), (2, 0)")
        await cur.execute("CREATE TABLE ballast (id INT PRIMARY KEY) ENGINE=InnoDB")
    copy = tmp_path / "db"
    shutil.copytree(DB_DIR, copy)
    (copy / "999_probe_move.sql").write_text("-- a data move\nUPDATE probe SET v = v + 1;\n")
    monkeypatch.setenv("GATE_DB_DIR", str(copy))
    holder = await aiomysql.connect(**connect_kwargs(scratch, 5))
    try:
        async with holder.cursor() as tx, conn.cursor() as cur:
            await tx.execute("START TRANSACTION")
            await tx.execute(
                "INSERT INTO ballast VALUES " + ", ".join(f"({i})" for i in range(200))
            )
            await tx.execute("UPDATE probe SET v = v + 10 WHERE id = 2")
            with caplog.at_level(logging.INFO, logger="gate.migrate"):
                run = asyncio.create_task(migrate(scratch))
                deadline = time.monotonic() + 30
                while True:
                    await cur.execute(
                        "SELECT COUNT(*) FROM information_schema.INNODB_TRX"
                        " WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE 'UPDATE probe%'"
                    )
                    row = await cur.fetchone()
                    if row and int(row[0]):
                        break
                    assert not run.done() and time.monotonic() < deadline
                    # INNODB_TRX is a cache refreshed only when not read for 100 ms.
                    await asyncio.sleep(0.25)
                # Closes the cycle: the migration's statement is the victim.
                await tx.execute("UPDATE probe SET v = v + 100 WHERE id = 1")
                await tx.execute("COMMIT")
                assert await asyncio.wait_for(run, 60) == ["999_probe_move"]
    finally:
        holder.close()
        conn.close()
    retried = [r.getMessage() for r in caplog.records if "errno 1213" in r.getMessage()]
    assert len(retried) == 1 and "UPDATE probe SET v = v + 1" in retried[0], retried
    assert await _rows(scratch, "SELECT id, v FROM probe ORDER BY id") == [(1, 101), (2, 11)]
    assert await _rows(scratch, "SELECT name FROM schema_migrations WHERE version = 999") == [
        ("probe_move",)
    ]


async def test_a_held_lock_is_waited_for_and_a_dead_holders_lease_runs_out(
    scratch: MysqlTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    await migrate(scratch)
    conn = await aiomysql.connect(**connect_kwargs(scratch, 5))
    async with conn.cursor() as cur:
        # A lock table as it was when the lock was a row held FOR UPDATE: name only.
        await cur.execute("DROP TABLE schema_lock")
        await cur.execute(
            "CREATE TABLE schema_lock (name VARCHAR(64) CHARACTER SET ascii NOT NULL"
            " PRIMARY KEY) ENGINE=InnoDB"
        )
        await cur.execute("INSERT INTO schema_lock VALUES ('gate.migrate')")
        await cur.execute("DROP PROCEDURE gate_sell_held")
    assert await migrate(scratch) == ["routine gate_sell_held"]
    assert await _rows(scratch, "SELECT name, holder, expires_at FROM schema_lock") == [
        ("gate.migrate", None, None)
    ]
    async with conn.cursor() as cur:
        # Another run holds the lease (for an hour): this one waits, then names it.
        await cur.execute(
            "UPDATE schema_lock SET holder = 'host-b pid 7 0a0b0c0d',"
            " expires_at = NOW(6) + INTERVAL 1 HOUR"
        )
        await cur.execute("DROP PROCEDURE gate_sell_held")
    monkeypatch.setattr(migrate_lock, "LOCK_WAIT_SECONDS", 1.0)
    started = time.monotonic()
    with pytest.raises(MigrationError, match="held by host-b pid 7 0a0b0c0d"):
        await migrate(scratch)
    assert time.monotonic() - started >= 1.0
    assert "gate_sell_held" not in await _server_routines(scratch)
    async with conn.cursor() as cur:
        # That run died: its lease ran out a second ago.
        await cur.execute("UPDATE schema_lock SET expires_at = NOW(6) - INTERVAL 1 SECOND")
    conn.close()
    assert await migrate(scratch) == ["routine gate_sell_held"]
    assert await _rows(scratch, "SELECT holder, expires_at FROM schema_lock") == [(None, None)]


def test_each_routine_lives_once() -> None:
    """No versioned file creates a routine; each routine has exactly one file."""
    for m in read_migrations():
        for statement in m.statements:
            assert not re.match(
                r"(CREATE|DROP)\s.*\b(PROCEDURE|FUNCTION)\b", statement, re.I | re.S
            ), (
                m.name,
                statement[:80],
            )
    names = [r.name for r in read_routines()]
    assert len(names) == len(set(names)) == 12


async def test_an_edited_routine_is_reapplied_once(
    scratch: MysqlTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await migrate(scratch)
    before = dict(await _rows(scratch, "SELECT name, applied_at FROM schema_routines"))
    copy = tmp_path / "db"
    shutil.copytree(DB_DIR, copy)
    edited = copy / "routines" / "gate_retry_if.sql"
    text = edited.read_text()
    assert "concurrent payment row; retry" in text
    edited.write_text(text.replace("concurrent payment row; retry", "payment row raced; retry"))
    monkeypatch.setenv("GATE_DB_DIR", str(copy))
    # Nothing to do for a second run, nor for a concurrent one waiting on the lock.
    results = await asyncio.gather(*(migrate(scratch) for _ in range(3)))
    assert sorted(map(tuple, results)) == [(), (), ("routine gate_retry_if",)]
    assert await migrate(scratch) == []
    definition = (await _server_routines(scratch))["gate_retry_if"]
    assert "payment row raced; retry" in definition
    after = dict(await _rows(scratch, "SELECT name, applied_at FROM schema_routines"))
    assert after["gate_retry_if"] > before["gate_retry_if"]
    assert {k: v for k, v in after.items() if k != "gate_retry_if"} == {
        k: v for k, v in before.items() if k != "gate_retry_if"
    }
    recorded = dict(await _rows(scratch, "SELECT name, checksum FROM schema_routines"))
    assert recorded == {r.name: r.checksum for r in read_routines()}
    # Editing a comment only is a change too (the file is what is recorded).
    edited.write_text(edited.read_text() + "-- a note\n")
    assert await migrate(scratch) == ["routine gate_retry_if"]


async def test_a_routine_missing_on_the_server_is_restored(scratch: MysqlTarget) -> None:
    await migrate(scratch)
    conn = await aiomysql.connect(**connect_kwargs(scratch, 5))
    async with conn.cursor() as cur:
        await cur.execute("DROP PROCEDURE gate_sell_held")
    conn.close()
    assert await migrate(scratch) == ["routine gate_sell_held"]
    assert "gate_sell_held" in await _server_routines(scratch)


async def test_a_database_migrated_before_the_routines_moved_upgrades(
    scratch: MysqlTarget,
) -> None:
    """A database that applied 001–006 when they still held the routines: it recorded
    the old files' checksums and has no schema_routines. gate migrate records the new
    checksums (db/superseded.txt), creates every routine once, and keeps the data."""
    await migrate(scratch)
    superseded = read_superseded()
    assert {v for v, _, _ in superseded} == {2, 3, 4, 5, 6, 7, 20, 30, 40, 50, 70}
    conn = await aiomysql.connect(**connect_kwargs(scratch, 5))
    async with conn.cursor() as cur:
        await cur.execute("DROP TABLE schema_routines")
        for version, old, _ in superseded:
            await cur.execute(
                "UPDATE schema_migrations SET checksum = %s WHERE version = %s", (old, version)
            )
        await cur.execute(
            "INSERT INTO deals (title, unit_price, currency, bucket_count, hold_seconds,"
            " max_per_order) VALUES ('kept', 100, 'EUR', 1, 600, 1)"
        )
        await conn.commit()
    conn.close()
    assert await pending(scratch) == [f"routine {r.name}" for r in read_routines()]
    results = await asyncio.gather(*(migrate(scratch) for _ in range(2)))
    assert sorted(map(tuple, results)) == [
        (),
        tuple(f"routine {r.name}" for r in read_routines()),
    ]
    assert await migrate(scratch) == []
    assert dict(await _rows(scratch, "SELECT version, checksum FROM schema_migrations")) == {
        m.version: m.checksum for m in read_migrations()
    }
    assert await _rows(scratch, "SELECT title FROM deals") == [("kept",)]


def test_superseded_names_the_current_files() -> None:
    """Each sanctioned edit names the file as it is now: an entry that no longer matches
    would make the upgrade of an old database stop with 'changed after it was applied'."""
    current = {m.version: m.checksum for m in read_migrations()}
    for version, old, new in read_superseded():
        assert current[version] == new, f"{SUPERSEDED_FILE_NAME}: {version:03d} is stale"
        assert old != new


def test_routine_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "routines").mkdir()
    bad = tmp_path / "routines" / "gate_x.sql"
    bad.write_text("DELIMITER $$\nCREATE PROCEDURE gate_x() BEGIN SELECT 1; END$$\nDELIMITER ;\n")
    with pytest.raises(MigrationError, match="exactly one CREATE OR REPLACE"):
        read_routines(tmp_path)
    bad.write_text("CREATE OR REPLACE PROCEDURE gate_y() SELECT 1;\n")
    with pytest.raises(MigrationError, match="exactly one CREATE OR REPLACE"):
        read_routines(tmp_path)
    bad.write_text("CREATE OR REPLACE PROCEDURE gate_x() SELECT 1;\n")
    assert [r.name for r in read_routines(tmp_path)] == ["gate_x"]


async def test_edited_migration_is_refused(
    scratch: MysqlTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    await migrate(scratch)
    copy = tmp_path / "db"
    shutil.copytree(DB_DIR, copy)
    edited = copy / "001_schema.sql"
    edited.write_text(edited.read_text() + "\n-- edited after the fact\n")
    monkeypatch.setenv("GATE_DB_DIR", str(copy))
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await migrate(scratch)
    # `gate migrate` says so and exits 1, without a traceback (docs/cli.md).
    url = f"mysql://{scratch.user}@{scratch.host}:{scratch.port}/{scratch.database}"
    out = await asyncio.to_thread(
        subprocess.run,
        [GATE_BIN, "migrate"],
        env={**env, "GATE_MYSQL_URL": url, "GATE_DB_DIR": str(copy)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "gate migrate: migration 001_schema changed after it was applied" in out.stderr
    assert "Traceback" not in out.stderr


def test_split_statements_honours_delimiter() -> None:
    text = (
        "-- c\nCREATE TABLE a (x INT);\nDELIMITER $$\n"
        "CREATE PROCEDURE p() BEGIN SELECT 1; END$$\nDELIMITER ;\nSELECT 2;\n"
    )
    assert split_statements(text) == [
        "CREATE TABLE a (x INT)",
        "CREATE PROCEDURE p() BEGIN SELECT 1; END",
        "SELECT 2",
    ]
