"""SQL migrations from db/: versioned schema changes once each, routines on change.

    gate migrate ──GET_LOCK('gate.migrate')──┐   (a second run waits, then finds nothing)
      1. db/NNN_name.sql, in order, each once ──> schema_migrations (version, checksum)
      2. db/routines/<name>.sql, one stored routine per file (CREATE OR REPLACE),
         applied when its checksum differs from the one recorded, or the routine is
         missing from the server ──> schema_routines (name, checksum)
    RELEASE_LOCK

Versioned files hold schema changes only and are append-only: a recorded file whose
checksum changed stops the run. The one sanctioned exception is db/superseded.txt:
`NNN old-checksum new-checksum` lines naming a former content of an applied file and
the content that replaced it (issue #17 moved the routines out of 002–006); a database
that recorded the old checksum has the new one recorded instead, nothing re-run.
Routines are repeatable (Flyway's idea): each lives once, in its own file, and an edit
is deployed by `gate migrate` re-creating it. They run after every versioned file, so
a routine may use any table; a versioned file must not call a routine.
DDL is not transactional in MySQL/MariaDB, so concurrency safety comes from the named
lock held for the whole run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomysql

from gate.db import connect_kwargs
from gate.settings import MysqlTarget

log = logging.getLogger("gate.migrate")

DB_DIR = Path(__file__).resolve().parent.parent / "db"
LOCK_NAME = "gate.migrate"
LOCK_WAIT_SECONDS = 60
_FILE_RE = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")
ROUTINES_DIR_NAME = "routines"
SUPERSEDED_FILE_NAME = "superseded.txt"
_ROUTINE_FILE_RE = re.compile(r"^([a-z][a-z0-9_]{0,63})\.sql$")
_CREATE_ROUTINE_RE = re.compile(
    r"^CREATE\s+OR\s+REPLACE\s+(?:PROCEDURE|FUNCTION)\s+`?([A-Za-z0-9_]+)`?\s*\(", re.I
)
_SUPERSEDED_RE = re.compile(r"^(\d{3,})\s+([0-9a-f]{64})\s+([0-9a-f]{64})(?:\s+#.*)?$")


class MigrationError(RuntimeError):
    pass


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
    return Path(os.environ.get("GATE_DB_DIR", str(DB_DIR)))


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
        match = _FILE_RE.match(path.name)
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
        match = _ROUTINE_FILE_RE.match(path.name)
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
        match = _SUPERSEDED_RE.match(line)
        if not match:
            raise MigrationError(
                f"{SUPERSEDED_FILE_NAME} line {number}: expected 'NNN old-sha256 new-sha256'"
            )
        found.add((int(match[1]), match[2], match[3]))
    return found


async def migrate(target: MysqlTarget, timeout_seconds: float = 5.0) -> list[str]:
    """Create the database if needed, apply pending migrations, then re-apply changed
    routines. Returns what was applied: 'NNN_name' and 'routine <name>'."""
    migrations = read_migrations()
    routines = read_routines()
    superseded = read_superseded()
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    applied: list[str] = []
    try:
        async with conn.cursor() as cur:
            # Notes such as "table exists" would become warnings; none are useful here.
            await cur.execute("SET SESSION sql_notes = 0")
            await cur.execute(
                f"CREATE DATABASE IF NOT EXISTS `{target.database}` "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )
            await cur.execute(f"USE `{target.database}`")
            await cur.execute("SELECT GET_LOCK(%s, %s)", (LOCK_NAME, LOCK_WAIT_SECONDS))
            row = await cur.fetchone()
            if not row or row[0] != 1:
                raise MigrationError("could not take the migration lock; another migrate is stuck")
            try:
                await cur.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations ("
                    " version INT UNSIGNED NOT NULL PRIMARY KEY,"
                    " name VARCHAR(200) NOT NULL,"
                    " checksum CHAR(64) NOT NULL,"
                    " applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
                    ") ENGINE=InnoDB"
                )
                await cur.execute("SELECT version, checksum FROM schema_migrations")
                done = {int(v): str(c) for v, c in await cur.fetchall()}
                for m in migrations:
                    if m.version in done:
                        if (m.version, done[m.version], m.checksum) in superseded:
                            log.info(
                                "migration %03d_%s: recording its current checksum (a"
                                " sanctioned edit, db/%s)",
                                m.version,
                                m.name,
                                SUPERSEDED_FILE_NAME,
                            )
                            await cur.execute(
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
                        await cur.execute(statement)
                    await cur.execute(
                        "INSERT INTO schema_migrations (version, name, checksum)"
                        " VALUES (%s, %s, %s)",
                        (m.version, m.name, m.checksum),
                    )
                    applied.append(f"{m.version:03d}_{m.name}")
                applied.extend(await _apply_routines(cur, target.database, routines))
            finally:
                await cur.execute("SELECT RELEASE_LOCK(%s)", (LOCK_NAME,))
                await cur.fetchall()
    finally:
        conn.close()
    return applied


async def _apply_routines(cur: Any, database: str, routines: list[Routine]) -> list[str]:
    """Re-create each routine whose file changed (or that the server lacks)."""
    await cur.execute(
        "CREATE TABLE IF NOT EXISTS schema_routines ("
        " name VARCHAR(64) CHARACTER SET ascii NOT NULL PRIMARY KEY,"
        " checksum CHAR(64) CHARACTER SET ascii NOT NULL,"
        " applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
        ") ENGINE=InnoDB"
    )
    await cur.execute("SELECT name, checksum FROM schema_routines")
    recorded = {str(n): str(c) for n, c in await cur.fetchall()}
    await cur.execute(
        "SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = %s",
        (database,),
    )
    present = {str(r[0]) for r in await cur.fetchall()}
    applied: list[str] = []
    for r in routines:
        if recorded.get(r.name) == r.checksum and r.name in present:
            continue
        log.info("applying routine %s", r.name)
        for statement in r.statements:
            await cur.execute(statement)
        await cur.execute(
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
