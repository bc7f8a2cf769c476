"""Migrations: applied once each, safe to run twice or from two processes at once."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiomysql
import pytest

from gate.db import connect_kwargs
from gate.migrate import (
    DB_DIR,
    MigrationError,
    migrate,
    pending,
    read_migrations,
    split_statements,
)
from gate.settings import MysqlTarget, Settings


@pytest.fixture
async def scratch(settings: Settings) -> MysqlTarget:
    # Named after the suite's own database, so parallel suites never share it.
    name = f"{settings.mysql.database}_mig"
    target = MysqlTarget.parse(
        f"mysql://{settings.mysql.user}@{settings.mysql.host}:{settings.mysql.port}/{name}"
    )
    conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
    async with conn.cursor() as cur:
        await cur.execute("SET SESSION sql_notes = 0")
        await cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    conn.close()
    return target


async def test_concurrent_and_repeated_migrations(scratch: MysqlTarget) -> None:
    names = [f"{m.version:03d}_{m.name}" for m in read_migrations()]
    assert names[:2] == ["001_schema", "002_procedures"]
    assert await pending(scratch) == names
    results = await asyncio.gather(*(migrate(scratch) for _ in range(3)))
    assert sorted(map(tuple, results)) == [(), (), tuple(names)]
    assert await migrate(scratch) == []
    assert await pending(scratch) == []
    conn = await aiomysql.connect(**connect_kwargs(scratch, 5))
    async with conn.cursor() as cur:
        await cur.execute("SELECT version, name FROM schema_migrations ORDER BY version")
        assert [tuple(r) for r in await cur.fetchall()] == [
            (m.version, m.name) for m in read_migrations()
        ]
    conn.close()


async def test_edited_migration_is_refused(
    scratch: MysqlTarget, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await migrate(scratch)
    copy = tmp_path / "db"
    shutil.copytree(DB_DIR, copy)
    edited = copy / "001_schema.sql"
    edited.write_text(edited.read_text() + "\n-- edited after the fact\n")
    monkeypatch.setenv("GATE_DB_DIR", str(copy))
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await migrate(scratch)


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
