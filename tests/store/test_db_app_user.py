"""The least-privilege database user: `gate migrate` creates it with only what the
gate needs, a real gate serves as it (background loops and the start-up schema check
included), and it can change no schema, grant nothing and read nothing else.

Each test makes MariaDB users of its own (unique names) and drops them after."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiomysql
import pymysql
import pytest
import redis.asyncio as aioredis

from gate.base.settings import MysqlTarget, Settings
from gate.store.db import Database, connect_kwargs, notes_off
from gate.store.migrate import APP_PRIVILEGES, DB_DIR
from tests.support import (
    ADMIN_TOKEN,
    GATE_BIN,
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    reserve,
)

APP_PASSWORD = "test-app-password-0123456789"
# Access denied: database, table/command, "needs the X privilege", routine.
DENIED = (1044, 1142, 1227, 1370)


def gate_cmd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def app_url(settings: Settings, name: str) -> str:
    m = settings.mysql
    return f"mysql://{name}:{APP_PASSWORD}@{m.host}:{m.port}/{m.database}"


async def root_rows(settings: Settings, sql: str, args: tuple[object, ...] = ()) -> list[tuple]:
    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            # DROP USER IF EXISTS of a user never made is a note, not news.
            await notes_off(cur)
            await cur.execute(sql, args)
            return [tuple(r) for r in await cur.fetchall()]
    finally:
        conn.close()


@pytest.fixture
async def app_user(settings: Settings, prepared: None) -> AsyncIterator[str]:
    name = f"gt_app_{os.getpid()}_{secrets.token_hex(3)}"
    try:
        yield name
    finally:
        await root_rows(settings, "DROP USER IF EXISTS %s@'%%'", (name,))


def with_app_user(env: dict[str, str], name: str) -> dict[str, str]:
    return {**env, "GATE_MYSQL_APP_USER": name, "GATE_MYSQL_APP_PASSWORD": APP_PASSWORD}


async def grants_of(settings: Settings, name: str) -> tuple[set[str], list[str]]:
    """Privileges on the test database, and every other grant line but global USAGE."""
    lines = [str(r[0]) for r in await root_rows(settings, "SHOW GRANTS FOR %s@'%%'", (name,))]
    on_db: set[str] = set()
    other: list[str] = []
    pattern = settings.mysql.database.replace("_", "\\_")
    for line in lines:
        head = line.split(" TO ")[0]
        if head == "GRANT USAGE ON *.*":
            continue
        if head.endswith(f" ON `{pattern}`.*") and "GRANT OPTION" not in line:
            on_db |= {p.strip() for p in head[6 : -len(f" ON `{pattern}`.*")].split(",")}
        else:
            other.append(line.split(" IDENTIFIED BY")[0])
    return on_db, other


async def wait_status(client: Client, order_id: str, user: int, status: str) -> str:
    deadline = time.monotonic() + 20
    seen = ""
    while time.monotonic() < deadline:
        r = await client.get(f"/v1/orders/{order_id}", headers=buyer(user))
        seen = str(r.json()["status"])
        if seen == status:
            break
        await asyncio.sleep(0.1)
    return seen


async def test_migrate_creates_a_least_privilege_user_that_the_gate_serves_as(
    env: dict[str, str],
    settings: Settings,
    db: Database,
    rds: aioredis.Redis,
    app_user: str,
) -> None:
    out = gate_cmd(with_app_user(env, app_user), "migrate")
    assert out.returncode == 0, out.stderr
    assert APP_PASSWORD not in out.stdout + out.stderr
    on_db, other = await grants_of(settings, app_user)
    assert on_db == set(APP_PRIVILEGES), on_db
    assert other == [], other
    global_privileges = await root_rows(
        settings,
        "SELECT PRIVILEGE_TYPE FROM information_schema.USER_PRIVILEGES WHERE GRANTEE = %s",
        (f"'{app_user}'@'%'",),
    )
    assert global_privileges == [("USAGE",)]
    # Again: nothing changes (the password is set again: the rotation path).
    again = gate_cmd(with_app_user(env, app_user), "migrate")
    assert again.returncode == 0, again.stderr
    assert await grants_of(settings, app_user) == (set(APP_PRIVILEGES), [])

    # A real gate as that user: GATE_AUTO_MIGRATE on (a read-only check when the
    # schema is current), background loops on (sweeper, janitor, resync, payments).
    genv = {**env, "GATE_MYSQL_URL": app_url(settings, app_user)}
    gate = GateProcess(genv, workers=1)
    client = Client(gate.url)
    try:
        gate.wait_ready()
        deal_id = await create_deal(
            client, stock=5, buckets=1, hold_seconds=1, max_per_order=2, per_user_limit=2
        )
        r = await reserve(client, deal_id, 9_100_001, f"app-user-{app_user}-1", 2)
        assert r.status_code == 201, r.text
        held = r.json()["order_id"]
        r = await reserve(client, deal_id, 9_100_002, f"app-user-{app_user}-2", 1)
        assert r.status_code == 201, r.text
        cancelled = r.json()["order_id"]
        r = await client.post(f"/v1/orders/{cancelled}/cancel", headers=buyer(9_100_002))
        assert r.status_code == 200, r.text
        # The expiry sweeper (a background loop) releases the 1-second hold.
        assert await wait_status(client, held, 9_100_001, "EXPIRED") == "EXPIRED"
        report = await assert_invariants(db, rds, deal_id)
        assert report["invariant"]["ok"]
        row = await db.fetchone(
            "SELECT SUM(available) FROM deal_buckets WHERE deal_id = %s", (deal_id,)
        )
        assert row is not None and int(row[0]) == 5
        # The admin API and `gate check` work as that user too.
        r = await client.get(
            f"/v1/admin/deals/{deal_id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        assert r.status_code == 200, r.text
        check = gate_cmd(genv, "check", "--deal", str(deal_id))
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        await client.close()
        gate.stop()
    log = gate.output()
    assert "denied" not in log.lower() and "Traceback" not in log, log[-3000:]

    # Nothing else: no DDL, no GRANT, no user management, nothing global, no other data.
    target = MysqlTarget.parse(app_url(settings, app_user))
    conn = await aiomysql.connect(**connect_kwargs(target, 5))
    try:
        async with conn.cursor() as cur:
            for sql in (
                "DROP TABLE orders",
                "TRUNCATE TABLE orders",
                "CREATE TABLE ship_nope (id INT PRIMARY KEY)",
                "ALTER TABLE orders ADD COLUMN nope INT",
                "DROP PROCEDURE gate_reserve",
                f"GRANT SELECT ON `{settings.mysql.database}`.* TO '{app_user}'@'%'",
                "CREATE USER 'gt_ship_never'@'%'",
                "SET GLOBAL max_connections = 10",
                "SELECT COUNT(*) FROM mysql.user",
                f"DROP DATABASE `{settings.mysql.database}`",
            ):
                with pytest.raises(pymysql.err.MySQLError) as refused:
                    await cur.execute(sql)
                assert refused.value.args[0] in DENIED, (sql, refused.value.args)
    finally:
        conn.close()
    still = await root_rows(
        settings, f"SELECT COUNT(*) FROM `{settings.mysql.database}`.orders WHERE id = %s", (held,)
    )
    assert still == [(1,)]


async def test_the_app_user_cannot_apply_a_pending_migration_and_says_so(
    env: dict[str, str], settings: Settings, app_user: str, tmp_path: Path
) -> None:
    assert gate_cmd(with_app_user(env, app_user), "migrate").returncode == 0
    extra = tmp_path / "db"
    shutil.copytree(DB_DIR, extra)
    (extra / "999_ship_extra.sql").write_text("CREATE TABLE ship_extra (id INT PRIMARY KEY);\n")
    genv = {**env, "GATE_MYSQL_URL": app_url(settings, app_user), "GATE_DB_DIR": str(extra)}
    for args, code in ((("migrate",), 1), (("serve", "--port", "1"), 2)):
        out = gate_cmd(genv, *args)
        assert out.returncode == code, (args, out.stderr)
        assert "may not change it" in out.stderr, out.stderr
        assert "administrative GATE_MYSQL_URL" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and APP_PASSWORD not in out.stderr
    tables = await root_rows(
        settings,
        "SELECT COUNT(*) FROM information_schema.TABLES"
        " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = 'ship_extra'",
        (settings.mysql.database,),
    )
    assert tables == [(0,)]


async def test_an_existing_user_with_more_privileges_is_refused(
    env: dict[str, str], settings: Settings, app_user: str
) -> None:
    await root_rows(settings, "CREATE USER %s@'%%' IDENTIFIED BY %s", (app_user, APP_PASSWORD))
    await root_rows(settings, f"GRANT ALL ON `{settings.mysql.database}`.* TO %s@'%%'", (app_user,))
    out = gate_cmd(with_app_user(env, app_user), "migrate")
    assert out.returncode == 1, out.stderr
    assert "holds more than the gate needs" in out.stderr and "revoke" in out.stderr
    assert APP_PASSWORD not in out.stderr


async def test_app_user_settings_are_checked(
    env: dict[str, str], settings: Settings, app_user: str
) -> None:
    for extra, message in (
        ({"GATE_MYSQL_APP_USER": "bad-name;"}, "GATE_MYSQL_APP_USER must be"),
        ({"GATE_MYSQL_APP_USER": app_user}, "GATE_MYSQL_APP_PASSWORD is required"),
        (
            {"GATE_MYSQL_APP_USER": app_user, "GATE_MYSQL_APP_PASSWORD": "short"},
            "GATE_MYSQL_APP_PASSWORD is required",
        ),
        (
            {"GATE_MYSQL_APP_USER": settings.mysql.user, "GATE_MYSQL_APP_PASSWORD": APP_PASSWORD},
            "GATE_MYSQL_APP_USER must differ",
        ),
        (
            {
                "GATE_MYSQL_APP_USER": app_user,
                "GATE_MYSQL_APP_PASSWORD": APP_PASSWORD,
                "GATE_MYSQL_APP_HOST": "x'y",
            },
            "GATE_MYSQL_APP_HOST must be",
        ),
    ):
        out = gate_cmd({**env, **extra}, "migrate")
        assert out.returncode == 2, (extra, out.stderr)
        assert message in out.stderr, (extra, out.stderr)
    users = await root_rows(
        settings, "SELECT COUNT(*) FROM mysql.user WHERE User = %s", (app_user,)
    )
    assert users == [(0,)]
