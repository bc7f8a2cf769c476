"""SQL migrations from db/: versioned schema changes once each, routines on change.

    gate migrate ──> take the 'gate.migrate' lease of schema_lock (migrate_lock.py;
                     a second run waits for it, then finds nothing to do)
      1. db/NNN_name.sql, in order, each once ──> schema_migrations (version, checksum)
      2. db/routines/<name>.sql, one stored routine per file (CREATE OR REPLACE),
         applied when its checksum differs from the one recorded, or the routine is
         missing from the server ──> schema_routines (name, checksum)
    release the lease
    (every statement: again after errno 1213 or 1047, bounded: execute_retried)

Versioned files hold schema changes (and the data moves a change needs) and are
append-only: a recorded file whose checksum changed stops the run. The one sanctioned
exception is db/superseded.txt: `NNN old-checksum new-checksum` lines naming a former
content of an applied file and the content that replaced it (the routines left
002–006 for files of their own; header comments were reworded); a database that
recorded the old checksum has the new one recorded instead, nothing re-run.
Routines are repeatable (Flyway's idea): each lives once, in its own file, and an edit
is deployed by `gate migrate` re-creating it. They run after every versioned file, so
a routine may use any table; a versioned file must not call a routine.
DDL is not transactional in MySQL/MariaDB, so concurrency safety comes from the lock
held for the whole run: a committed lease row rather than GET_LOCK (which Galera does
not replicate) or a row held FOR UPDATE (which binds only the node that holds it), so
runs started at once on different nodes of a Galera cluster apply each file once.
With several hosts in GATE_MYSQL_URL every step runs on the writer node
(gate/store/dbwriter.py).

    migrate(target) ──> schema current? (reads only: versions, routine checksums)
          │ yes ──> done, no DDL: so `gate serve` may auto-migrate as the
          │         least-privilege app user
          no ──> the run above; a user that may not (the app user) gets a
                 MigrationError saying to migrate as an admin

    ensure_app_user(target, GATE_MYSQL_APP_USER…) ──> CREATE USER IF NOT EXISTS /
          ALTER USER (password), GRANT APP_PRIVILEGES ON `<database>`.*, then refuse a
          user that holds anything more (docs/operations.md, "Database users")
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomysql
import pymysql

from gate.base.settings import DEV_PASSWORDS, MysqlTarget, Secret, SettingsError, refuse_dev_value
from gate.store.db import connect_kwargs, notes_off
from gate.store.dbwriter import writer_target
from gate.store.migrate_lock import Lease, execute_retried, migration_lock
from gate.store.migrate_lock import MigrationError as MigrationError

log = logging.getLogger("gate.migrate")

# The migrations are the data package gate.db (db/ in a checkout, pyproject.toml
# package-dir), found alike in a checkout and in an installed wheel; GATE_DB_DIR
# points elsewhere (a test's copy).
DB_DIR = Path(str(importlib.resources.files("gate.db")))
_FILE_RE = re.compile(r"(\d{3,})_([a-z0-9_]+)\.sql")
# What the gate needs at run time, its background loops included: rows, the stored
# procedures, and the connection-private scratch tables of the batch procedures
# (SQL SECURITY INVOKER: gate_expire_scratch, gate_cb_scratch, gate_reserve_scratch), which
# is not the right to create or change any real table. No DDL, no GRANT, nothing global.
APP_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "EXECUTE", "CREATE TEMPORARY TABLES")
_APP_USER_RE = re.compile(r"[A-Za-z0-9_]{1,80}")
_APP_HOST_RE = re.compile(r"[A-Za-z0-9.%_:-]{1,255}")
APP_PASSWORD_MIN_CHARS = 16
# Access denied: to a database, a command, a table; "you need the X privilege".
_DENIED_ERRNOS = (1044, 1142, 1227, 1370)
ROUTINES_DIR_NAME = "routines"
SUPERSEDED_FILE_NAME = "superseded.txt"
_ROUTINE_FILE_RE = re.compile(r"([a-z][a-z0-9_]{0,63})\.sql")
_CREATE_ROUTINE_RE = re.compile(
    r"^CREATE\s+OR\s+REPLACE\s+(?:PROCEDURE|FUNCTION)\s+`?([A-Za-z0-9_]+)`?\s*\(", re.I
)
_SUPERSEDED_RE = re.compile(r"(\d{3,})\s+([0-9a-f]{64})\s+([0-9a-f]{64})(?:\s+#.*)?")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    checksum: str
    statements: tuple[str, ...]


@dataclass(frozen=True)
class Routine:
    name: str
    checksum: str
    statements: tuple[str, ...]


def db_dir() -> Path:
    return Path(os.environ.get("GATE_DB_DIR") or DB_DIR)


def split_statements(text: str) -> list[str]:
    """Split a script the way the mysql client does, honouring DELIMITER lines."""
    delimiter = ";"
    statements: list[str] = []
    buf: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.upper().startswith("DELIMITER "):
            delimiter = stripped.split(None, 1)[1]
            continue
        if not buf and (not stripped or stripped.startswith("--")):
            continue
        buf.append(line)
        if stripped.endswith(delimiter):
            statement = "\n".join(buf).rstrip()
            statement = statement[: -len(delimiter)].strip()
            if statement:
                statements.append(statement)
            buf = []
    rest = "\n".join(buf).strip()
    if rest:
        statements.append(rest)
    return statements


def read_migrations(directory: Path | None = None) -> list[Migration]:
    base = directory or db_dir()
    migrations: list[Migration] = []
    for path in sorted(base.glob("*.sql")):
        match = _FILE_RE.fullmatch(path.name)
        if not match:
            raise MigrationError(f"migration file {path.name} is not named NNN_name.sql")
        text = path.read_text(encoding="utf-8")
        migrations.append(
            Migration(
                version=int(match[1]),
                name=match[2],
                checksum=hashlib.sha256(text.encode()).hexdigest(),
                statements=tuple(split_statements(text)),
            )
        )
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise MigrationError("two migration files share a version number")
    return migrations


def read_routines(directory: Path | None = None) -> list[Routine]:
    """db/routines/*.sql: each file one CREATE OR REPLACE of the routine it is named after."""
    base = (directory or db_dir()) / ROUTINES_DIR_NAME
    if not base.is_dir():
        return []
    routines: list[Routine] = []
    for path in sorted(base.glob("*.sql")):
        match = _ROUTINE_FILE_RE.fullmatch(path.name)
        if not match:
            raise MigrationError(f"routine file {path.name} is not named <routine>.sql")
        text = path.read_text(encoding="utf-8")
        statements = split_statements(text)
        created = _CREATE_ROUTINE_RE.match(statements[0]) if len(statements) == 1 else None
        if created is None or created[1] != match[1]:
            # One routine per file, named as the file: a checksum then stands for exactly
            # one routine, and a forgotten OR REPLACE cannot fail on the second run.
            raise MigrationError(
                f"routine file {path.name} must hold exactly one"
                f" CREATE OR REPLACE PROCEDURE|FUNCTION {match[1]}"
            )
        routines.append(
            Routine(
                name=match[1],
                checksum=hashlib.sha256(text.encode()).hexdigest(),
                statements=tuple(statements),
            )
        )
    return routines


def read_superseded(directory: Path | None = None) -> set[tuple[int, str, str]]:
    """(version, old checksum, new checksum) of sanctioned edits of applied files."""
    path = (directory or db_dir()) / SUPERSEDED_FILE_NAME
    if not path.is_file():
        return set()
    found: set[tuple[int, str, str]] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SUPERSEDED_RE.fullmatch(line)
        if not match:
            raise MigrationError(
                f"{SUPERSEDED_FILE_NAME} line {number}: expected 'NNN old-sha256 new-sha256'"
            )
        found.add((int(match[1]), match[2], match[3]))
    return found


async def _recorded(cur: aiomysql.Cursor, database: str) -> dict[int, str] | None:
    """The recorded migrations (version → checksum), read-only; None when there is no
    schema_migrations table (or the user cannot see it)."""
    await cur.execute(
        "SELECT COUNT(*) FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = 'schema_migrations'",
        (database,),
    )
    row = await cur.fetchone()
    if not row or int(row[0]) == 0:
        return None
    await cur.execute(f"SELECT version, checksum FROM `{database}`.schema_migrations")
    return {int(v): str(c) for v, c in await cur.fetchall()}


def _check_recorded(
    migrations: list[Migration], done: dict[int, str], superseded: set[tuple[int, str, str]]
) -> list[Migration]:
    """The migrations with something to do: not applied yet, or applied under a former
    content that db/superseded.txt sanctions (its checksum is to be recorded anew). A
    recorded one whose file changed otherwise stops the run."""
    left = []
    for m in migrations:
        if m.version not in done:
            left.append(m)
        elif done[m.version] != m.checksum:
            if (m.version, done[m.version], m.checksum) not in superseded:
                raise MigrationError(
                    f"migration {m.version:03d}_{m.name} changed after it was "
                    "applied; add a new migration instead"
                )
            left.append(m)
    return left


async def _routines_current(cur: aiomysql.Cursor, database: str, routines: list[Routine]) -> bool:
    """Read-only: every routine present on the server under its file's checksum."""
    await cur.execute(
        "SELECT COUNT(*) FROM information_schema.TABLES "
        "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = 'schema_routines'",
        (database,),
    )
    row = await cur.fetchone()
    if not routines:
        return True
    if not row or int(row[0]) == 0:
        return False
    await cur.execute(f"SELECT name, checksum FROM `{database}`.schema_routines")
    recorded = {str(n): str(c) for n, c in await cur.fetchall()}
    await cur.execute(
        "SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = %s",
        (database,),
    )
    present = {str(r[0]) for r in await cur.fetchall()}
    return all(recorded.get(r.name) == r.checksum and r.name in present for r in routines)


async def migrate(target: MysqlTarget, timeout_seconds: float = 5.0) -> list[str]:
    """Create the database if needed, apply pending migrations, then re-apply changed
    routines. Returns what was applied: 'NNN_name' and 'routine <name>'.

    A current schema is only read (no DDL, no lock): the least-privilege app user may
    run this, which is what `gate serve` does at start with GATE_AUTO_MIGRATE on."""
    migrations = read_migrations()
    routines = read_routines()
    superseded = read_superseded()
    target = await writer_target(target, timeout_seconds)
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    try:
        async with conn.cursor() as cur:
            done = await _recorded(cur, target.database)
            if (
                done is not None
                and not _check_recorded(migrations, done, superseded)
                and await _routines_current(cur, target.database, routines)
            ):
                return []
    finally:
        conn.close()
    try:
        return await _apply(target, migrations, routines, superseded, timeout_seconds)
    except pymysql.err.MySQLError as exc:
        if exc.args and exc.args[0] in _DENIED_ERRNOS:
            raise MigrationError(
                f"the schema of `{target.database}` is not current and the database user"
                f" {target.user!r} may not change it ({exc.args[1]}); run `gate migrate`"
                " with an administrative GATE_MYSQL_URL"
            ) from None
        raise


async def _apply(
    target: MysqlTarget,
    migrations: list[Migration],
    routines: list[Routine],
    superseded: set[tuple[int, str, str]],
    timeout_seconds: float,
) -> list[str]:
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    applied: list[str] = []
    try:
        async with conn.cursor() as cur:
            # Notes such as "table exists" would become warnings; none are useful here.
            await notes_off(cur)
            await cur.execute(
                "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s",
                (target.database,),
            )
            row = await cur.fetchone()
            if not row or int(row[0]) == 0:
                # Only when missing: on Galera a CREATE DATABASE, even one that finds the
                # database there, is DDL replicated in total order that aborts the
                # statements it conflicts with on every node.
                await execute_retried(
                    cur,
                    f"CREATE DATABASE IF NOT EXISTS `{target.database}` "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci",
                )
            await cur.execute(f"USE `{target.database}`")
            async with migration_lock(target, timeout_seconds) as lease:
                step = _Steps(cur, lease)
                applied.extend(await _apply_migrations(step, migrations, superseded))
                applied.extend(await _apply_routines(step, target.database, routines))
    finally:
        conn.close()
    return applied


class _Steps:
    """The statements of one run under the lock: each one only while the lease is
    held, and run again after a transient refusal (gate/store/migrate_lock.py). Every
    step is safe to run again: DDL that is refused (1213, 1047) did not start, an
    autocommit statement that is refused was rolled back."""

    def __init__(self, cur: Any, lease: Lease) -> None:
        self.cur = cur
        self.lease = lease

    async def execute(self, statement: str, args: Any = None) -> int:
        self.lease.check()
        return await execute_retried(self.cur, statement, args)

    async def rows(self, statement: str, args: Any = None) -> list[tuple[Any, ...]]:
        await self.execute(statement, args)
        return [tuple(r) for r in await self.cur.fetchall()]


async def _apply_migrations(
    step: _Steps, migrations: list[Migration], superseded: set[tuple[int, str, str]]
) -> list[str]:
    await step.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INT UNSIGNED NOT NULL PRIMARY KEY,"
        " name VARCHAR(200) NOT NULL,"
        " checksum CHAR(64) NOT NULL,"
        " applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
        ") ENGINE=InnoDB"
    )
    # Read under the lease: on Galera the take of the lease committed after the former
    # holder's last write was applied on this node (commits apply in one order
    # everywhere), so what a former run recorded is seen here.
    done = {
        int(v): str(c)
        for v, c in await step.rows("SELECT version, checksum FROM schema_migrations")
    }
    applied: list[str] = []
    for m in migrations:
        if m.version in done:
            if (m.version, done[m.version], m.checksum) in superseded:
                log.info(
                    "migration %03d_%s: recording its current checksum (a sanctioned edit, db/%s)",
                    m.version,
                    m.name,
                    SUPERSEDED_FILE_NAME,
                )
                await step.execute(
                    "UPDATE schema_migrations SET checksum = %s WHERE version = %s",
                    (m.checksum, m.version),
                )
            elif done[m.version] != m.checksum:
                raise MigrationError(
                    f"migration {m.version:03d}_{m.name} changed after it was "
                    "applied; add a new migration instead"
                )
            continue
        log.info("applying migration %03d_%s", m.version, m.name)
        for statement in m.statements:
            await step.execute(statement)
        await step.execute(
            "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
            (m.version, m.name, m.checksum),
        )
        applied.append(f"{m.version:03d}_{m.name}")
    return applied


async def _apply_routines(step: _Steps, database: str, routines: list[Routine]) -> list[str]:
    """Re-create each routine whose file changed (or that the server lacks)."""
    await step.execute(
        "CREATE TABLE IF NOT EXISTS schema_routines ("
        " name VARCHAR(64) CHARACTER SET ascii NOT NULL PRIMARY KEY,"
        " checksum CHAR(64) CHARACTER SET ascii NOT NULL,"
        " applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
        ") ENGINE=InnoDB"
    )
    recorded = {
        str(n): str(c) for n, c in await step.rows("SELECT name, checksum FROM schema_routines")
    }
    present = {
        str(r[0])
        for r in await step.rows(
            "SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = %s",
            (database,),
        )
    }
    applied: list[str] = []
    for r in routines:
        if recorded.get(r.name) == r.checksum and r.name in present:
            continue
        log.info("applying routine %s", r.name)
        for statement in r.statements:
            await step.execute(statement)
        await step.execute(
            "INSERT INTO schema_routines (name, checksum) VALUES (%s, %s)"
            " ON DUPLICATE KEY UPDATE checksum = VALUES(checksum),"
            " applied_at = CURRENT_TIMESTAMP(6)",
            (r.name, r.checksum),
        )
        applied.append(f"routine {r.name}")
    return applied


async def pending(target: MysqlTarget, timeout_seconds: float = 5.0) -> list[str]:
    """Migrations not yet applied and routines never applied (empty when the schema is
    current). A routine whose file changed since is not pending: a gate of the previous
    release must still start against a database a newer one migrated (rolling deploys);
    `gate migrate` (or gate serve's auto-migration) re-applies it."""
    migrations = read_migrations()
    routines = read_routines()
    target = await writer_target(target, timeout_seconds)
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    try:
        async with conn.cursor() as cur:
            await cur.execute(
                "SELECT COUNT(*) FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = 'schema_migrations'",
                (target.database,),
            )
            row = await cur.fetchone()
            if not row or int(row[0]) == 0:
                return [f"{m.version:03d}_{m.name}" for m in migrations] + [
                    f"routine {r.name}" for r in routines
                ]
            await cur.execute(f"SELECT version FROM `{target.database}`.schema_migrations")
            done = {int(r[0]) for r in await cur.fetchall()}
            left = [f"{m.version:03d}_{m.name}" for m in migrations if m.version not in done]
            await cur.execute(
                "SELECT COUNT(*) FROM information_schema.TABLES "
                "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = 'schema_routines'",
                (target.database,),
            )
            row = await cur.fetchone()
            recorded: set[str] = set()
            if row and int(row[0]):
                await cur.execute(f"SELECT name FROM `{target.database}`.schema_routines")
                recorded = {str(r[0]) for r in await cur.fetchall()}
            return left + [f"routine {r.name}" for r in routines if r.name not in recorded]
    finally:
        conn.close()


@dataclass(frozen=True)
class AppUser:
    """The database account `gate serve` should connect as (GATE_MYSQL_APP_*)."""

    name: str
    host: str
    password: Secret


def load_app_user(env: Mapping[str, str], admin: MysqlTarget) -> AppUser | None:
    """GATE_MYSQL_APP_USER/_PASSWORD/_HOST, read by `gate migrate` only; None when no
    app user is asked for. SettingsError (exit 2) names the variable at fault."""
    name = env.get("GATE_MYSQL_APP_USER", "").strip()
    if not name:
        return None
    if not _APP_USER_RE.fullmatch(name):
        raise SettingsError("GATE_MYSQL_APP_USER must be 1-80 characters of [A-Za-z0-9_]")
    if name == admin.user:
        raise SettingsError(
            "GATE_MYSQL_APP_USER must differ from the GATE_MYSQL_URL user (the admin that"
            " migrates): the app user gets only " + ", ".join(APP_PRIVILEGES)
        )
    host = env.get("GATE_MYSQL_APP_HOST", "%").strip() or "%"
    if not _APP_HOST_RE.fullmatch(host):
        raise SettingsError("GATE_MYSQL_APP_HOST must be a MariaDB host pattern such as % or 10.%")
    password = env.get("GATE_MYSQL_APP_PASSWORD", "")
    dev = env.get("GATE_ENV", "production").strip().lower() == "dev"
    refuse_dev_value("GATE_MYSQL_APP_PASSWORD", password, DEV_PASSWORDS, dev)
    if len(password) < APP_PASSWORD_MIN_CHARS:
        raise SettingsError(
            f"GATE_MYSQL_APP_PASSWORD is required with GATE_MYSQL_APP_USER"
            f" (at least {APP_PASSWORD_MIN_CHARS} characters)"
        )
    return AppUser(name, host, Secret(password))


def _granted(grants: list[str], database: str) -> tuple[set[str], list[str]]:
    """The privileges SHOW GRANTS lists on `database`.*, and every other grant line
    (global privileges other than USAGE, other databases, tables, GRANT OPTION)."""
    on_db: set[str] = set()
    other: list[str] = []
    pattern = re.compile(r"^GRANT (.+) ON (\S+) TO .*$")
    for line in grants:
        m = pattern.match(line)
        if m is None:
            other.append(line)
            continue
        # Database-level grants read `_` as a wildcard, hence the escaped form.
        privileges, where = m.group(1), m.group(2).replace("`", "").replace("\\_", "_")
        names = {p.strip().upper() for p in privileges.split(",")}
        if "WITH GRANT OPTION" in line.upper():
            other.append(line)
        elif where == "*.*" and names == {"USAGE"}:
            continue
        elif where == f"{database}.*":
            on_db |= names
        else:
            other.append(line)
    return on_db, other


def _db_pattern(database: str) -> str:
    """The database name as a GRANT pattern that matches it alone (`_` is a wildcard
    there; `%` cannot occur: names are [A-Za-z0-9_])."""
    return database.replace("_", "\\_")


async def ensure_app_user(target: MysqlTarget, user: AppUser, timeout_seconds: float = 5.0) -> None:
    """Create (or re-password) the app user and grant it APP_PRIVILEGES on the gate's
    database. A user that already holds more is refused, never silently kept."""
    target = await writer_target(target, timeout_seconds)
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    account = (user.name, user.host)
    try:
        async with conn.cursor() as cur:
            await notes_off(cur)
            await cur.execute(
                "CREATE USER IF NOT EXISTS %s@%s IDENTIFIED BY %s",
                (*account, user.password.reveal()),
            )
            # Also the rotation path: a new GATE_MYSQL_APP_PASSWORD takes effect here.
            await cur.execute(
                "ALTER USER %s@%s IDENTIFIED BY %s", (*account, user.password.reveal())
            )
            await cur.execute(
                f"GRANT {', '.join(APP_PRIVILEGES)} ON `{_db_pattern(target.database)}`.* TO %s@%s",
                account,
            )
            await cur.execute("SHOW GRANTS FOR %s@%s", account)
            lines = [str(r[0]) for r in await cur.fetchall()]
    finally:
        conn.close()
    on_db, other = _granted(lines, target.database)
    extra = sorted(on_db - set(APP_PRIVILEGES)) + other
    if extra:
        raise MigrationError(
            f"database user {user.name!r}@{user.host!r} holds more than the gate needs"
            f" ({'; '.join(x.split(' IDENTIFIED BY')[0] for x in extra)}); revoke it or"
            " choose another GATE_MYSQL_APP_USER"
        )
    log.info(
        "database user %s@%s may %s on %s",
        user.name,
        user.host,
        ", ".join(APP_PRIVILEGES),
        target.database,
    )
