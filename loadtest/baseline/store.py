"""The baseline's database: schema set-up, deal creation and the invariant check."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiomysql

from gate.base.settings import MysqlTarget
from gate.store.db import Database, connect_kwargs, notes_off

SCHEMA = Path(__file__).with_name("schema.sql")
DEFAULT_DATABASE = "gate_baseline"
MAX_STOCK = 2**32 - 1
HOLDING = ("PENDING_PAYMENT", "PAID")


def baseline_url(environ: Mapping[str, str] | None = None) -> str:
    """BASELINE_MYSQL_URL, or the gate's server with a database of the baseline's own."""
    env = os.environ if environ is None else environ
    url = env.get("BASELINE_MYSQL_URL")
    if url:
        return url
    gate_url = env.get("GATE_MYSQL_URL", "mysql://root@127.0.0.1:3306/gate")
    server, _, _ = gate_url.partition("?")
    return server.rsplit("/", 1)[0] + "/" + DEFAULT_DATABASE


def statements() -> list[str]:
    text = SCHEMA.read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    return [s.strip() for s in body.split(";;") if s.strip()]


async def migrate(target: MysqlTarget, *, drop: bool = False) -> None:
    """Create the database and its tables (dropping them first when asked)."""
    conn = await aiomysql.connect(**connect_kwargs(target, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            # "IF NOT EXISTS" on an existing object raises a note; notes become
            # SHOW WARNINGS round trips and Python warnings in aiomysql.
            await notes_off(cur)
            if drop:
                await cur.execute(f"DROP DATABASE IF EXISTS `{target.database}`")
            await cur.execute(f"CREATE DATABASE IF NOT EXISTS `{target.database}`")
            await cur.execute(f"USE `{target.database}`")
            for statement in statements():
                await cur.execute(statement)
    finally:
        conn.close()


def validate_deal(body: Any) -> dict[str, Any]:
    """The admin body the gate accepts, reduced to what the baseline stores."""
    from gate.base import validate

    body = validate.obj(body)
    return {
        "title": validate.string(body, "title", 200, default="Baseline deal"),
        "unit_price": validate.integer(body, "unit_price", 0, 10**12),
        "currency": validate.string(body, "currency", 3, default="EUR").upper(),
        "stock": validate.integer(body, "stock", 0, MAX_STOCK),
        "hold_seconds": validate.integer(body, "hold_seconds", 1, 86_400, default=600),
        "max_per_order": validate.integer(body, "max_per_order", 1, 1000, default=1),
    }


async def create_deal(db: Database, fields: Mapping[str, Any]) -> dict[str, Any]:
    async with db.connection() as conn, conn.cursor() as cur:
        await cur.execute(
            "INSERT INTO deals (title, unit_price, currency, hold_seconds, max_per_order,"
            " stock_total, stock_available, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s,"
            " NOW())",
            (
                fields["title"],
                fields["unit_price"],
                fields["currency"],
                fields["hold_seconds"],
                fields["max_per_order"],
                fields["stock"],
                fields["stock"],
            ),
        )
        deal_id = int(cur.lastrowid)
    return {"id": deal_id, **fields}


async def check_deal(db: Database, deal_id: int) -> dict[str, Any]:
    """stock_total = stock_available + units of holding and paid orders; never below 0."""
    async with db.snapshot() as cur:
        await cur.execute(
            "SELECT stock_total, stock_available FROM deals WHERE id = %s", (deal_id,)
        )
        row = await cur.fetchone()
        if row is None:
            return {"deal_id": deal_id, "invariant": {"ok": False, "breaches": ["no such deal"]}}
        total, available = int(row[0]), int(row[1])
        await cur.execute(
            "SELECT status, COUNT(*), COALESCE(SUM(quantity), 0) FROM orders"
            " WHERE deal_id = %s GROUP BY status",
            (deal_id,),
        )
        by_status = {str(s): (int(n), int(u)) for s, n, u in await cur.fetchall()}
    units = sum(u for s, (_, u) in by_status.items() if s in HOLDING)
    breaches = []
    oversold = max(0, units - total)
    if oversold:
        breaches.append(f"oversold: orders hold {units} units of a stock of {total}")
    gap = total - available - units
    if gap != 0 and not oversold:
        word = "lost" if gap > 0 else "phantom"
        breaches.append(f"{word} units: total {total} != available {available} + ordered {units}")
    return {
        "deal_id": deal_id,
        "totals": {"total": total, "available": available, "ordered": units},
        "orders": {s: {"count": n, "units": u} for s, (n, u) in sorted(by_status.items())},
        "oversold": oversold,
        "lost": max(0, gap) if not oversold else 0,
        "invariant": {"ok": not breaches, "breaches": breaches},
    }


async def deal_ids(db: Database) -> list[int]:
    return [int(r[0]) for r in await db.fetchall("SELECT id FROM deals ORDER BY id")]
