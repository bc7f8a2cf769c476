"""Versioned SQL migrations from db/: each applied once, recorded, safe to race.

Files are named NNN_name.sql and applied in order. DDL is not transactional in
MySQL/MariaDB, so concurrency safety comes from a named lock (GET_LOCK) held for
the whole run: a second `gate migrate` waits, then finds nothing left to do.
A recorded file whose checksum changed stops the run: migrations are append-only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import aiomysql

from gate.db import connect_kwargs
from gate.settings import MysqlTarget

log = logging.getLogger("gate.migrate")

DB_DIR = Path(__file__).resolve().parent.parent / "db"
LOCK_NAME = "gate.migrate"
LOCK_WAIT_SECONDS = 60
_FILE_RE = re.compile(r"(\d{3,})_([a-z0-9_]+)\.sql")


class MigrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Migration:
    version: int
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


async def migrate(target: MysqlTarget, timeout_seconds: float = 5.0) -> list[str]:
    """Create the database if needed and apply pending migrations. Returns applied names."""
    migrations = read_migrations()
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
                        if done[m.version] != m.checksum:
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
            finally:
                await cur.execute("SELECT RELEASE_LOCK(%s)", (LOCK_NAME,))
                await cur.fetchall()
    finally:
        conn.close()
    return applied


async def pending(target: MysqlTarget, timeout_seconds: float = 5.0) -> list[str]:
    """Migrations not yet applied (empty when the schema is current)."""
    migrations = read_migrations()
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
                return [f"{m.version:03d}_{m.name}" for m in migrations]
            await cur.execute(f"SELECT version FROM `{target.database}`.schema_migrations")
            done = {int(r[0]) for r in await cur.fetchall()}
            return [f"{m.version:03d}_{m.name}" for m in migrations if m.version not in done]
    finally:
        conn.close()
