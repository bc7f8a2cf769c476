"""Sharding by deal, simulated: one recorded workload routed over N schemas of one
MariaDB, then every invariant checked per shard (docs/scale-out.md, "MySQL beyond one
primary").

    python -m loadtest shard-sim --shards 4 --ops 2000 --seed 7
    python -m loadtest shard-sim --shards 3 --record /tmp/w.jsonl      (write the workload)
    python -m loadtest shard-sim --shards 5 --replay /tmp/w.jsonl      (replay it as is)

    workload: deals, buyers reserving (one at a time or in groups), repeating
    │ idempotency keys (same deal, other quantity, other deal), cancelling, paying,
    │ letting holds fall due, sweeper passes, deals moved between shards; built from a
    │ seed (independent of N) or read back from a recording
    ▼
    Router ── directory schema <base> (the one place that is not sharded):
    │           shard_map    deal -> shard, version, state   (every deal-keyed statement)
    │           order_index  order -> deal                    (statements that name only
    │                                                          an order: cancel, pay)
    │           idem_index   (user, key) -> order, deal       (the key is global per buyer)
    ▼
    <base>_0 … <base>_{N-1}: gate/store/migrate.py's migrations and stored procedures, each
    behind its own gate.store.db.Database pool; every statement is Gate's own: CALL
    gate_reserve / gate_reserve_group / gate_release / gate_payment_event, the
    sweeper's SKIP LOCKED batch + CALL gate_expire_batch
    │
    ▼
    checks: gate check's own check_deal on every deal in its shard (total = available +
    held + sold per bucket, held/sold = the orders, ledger sums = counters, quota), every
    deal-keyed row in the shard the map names, no deal in two shards, stock conserved
    across moves, idempotency keys unique within each shard and across shards (the
    directory's index and the shards agree), the order index complete

No Redis: the database side of Gate alone, sequentially (one router, no concurrency),
so that the answers are a function of the workload: the same workload gives the same
answer to every operation whatever N is (the test compares N=3 with N=1). A deal move
is one cross-schema transaction here (the one server's shortcut); across servers it is
a copy, a catch-up and a short freeze (see the docs).

`--idempotency shard` drops the directory's key index: a key reused on a deal of
another shard then commits a second order, and the cross-shard check fails. That is
the blocker the docs describe, shown.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiomysql
import orjson

from gate.base.codes import DbCode
from gate.base.settings import Settings, load_settings
from gate.inventory.check import check_deal
from gate.inventory.orders import new_id
from gate.reserve.request import fingerprint
from gate.store.db import Database, connect_kwargs, notes_off
from gate.store.migrate import migrate

# Bounds: a simulation, not a benchmark; it must stay seconds long.
SHARDS_MAX = 8
OPS_MAX = 20_000
DEALS_MAX = 500
USERS_MAX = 100_000
GROUP_MAX = 8
SWEEP_BATCH = 200
SWEEP_BATCHES_MAX = 1_000
BREACHES_SHOWN_MAX = 50

_DIGITS = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
HOLDING = ("PENDING_PAYMENT", "AUTHORIZED")

# Every table of a shard, and how its rows name their deal (for placement checks and
# moves). Payment rows carry only an order id: they belong to the order's deal.
DEAL_TABLES = ("deal_buckets", "user_quota", "orders", "inventory_ledger", "queue_dead_letters")
ORDER_TABLES = ("payment_events", "payments", "payment_sessions", "payment_refunds")
DATA_TABLES = ("deals", *DEAL_TABLES, *ORDER_TABLES, "outbox")
# Tables whose AUTO_INCREMENT id is local to a shard: a moved row gets a new one.
LOCAL_IDS = frozenset({"inventory_ledger", "outbox", "payment_refunds", "queue_dead_letters"})

DIRECTORY_DDL = (
    "CREATE TABLE IF NOT EXISTS shard_map ("
    " deal_id BIGINT UNSIGNED NOT NULL PRIMARY KEY,"
    " shard SMALLINT UNSIGNED NOT NULL,"
    " version INT UNSIGNED NOT NULL DEFAULT 1,"
    " state ENUM('active', 'moving') CHARACTER SET ascii NOT NULL DEFAULT 'active',"
    " updated_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)"
    ") ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS order_index ("
    " order_id CHAR(26) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,"
    " deal_id BIGINT UNSIGNED NOT NULL"
    ") ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS idem_index ("
    " user_id BIGINT UNSIGNED NOT NULL,"
    " idempotency_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " order_id CHAR(26) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,"
    " deal_id BIGINT UNSIGNED NOT NULL,"
    " PRIMARY KEY (user_id, idempotency_key),"
    " UNIQUE KEY uq_idem_order (order_id)"
    ") ENGINE=InnoDB",
)


# -- the workload ---------------------------------------------------------------------


def _order_id(rng: random.Random) -> str:
    # A valid order id (gate.inventory.orders.ORDER_ID_RE) drawn from the seed: a recorded
    # workload replays with the same ids.
    return "".join(rng.choice(_DIGITS) for _ in range(26))


def build_workload(seed: int, deals: int, users: int, ops: int, moves: int) -> list[dict[str, Any]]:
    """A deterministic workload, independent of the number of shards."""
    if not (1 <= deals <= DEALS_MAX and 2 <= users <= USERS_MAX and 1 <= ops <= OPS_MAX):
        raise ValueError(f"deals 1..{DEALS_MAX}, users 2..{USERS_MAX}, ops 1..{OPS_MAX}")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    prices: dict[int, int] = {}
    for d in range(1, deals + 1):
        limit = rng.choice([None, None, 2, 3, 4])
        max_per_order = rng.randint(1, 3) if limit is None else rng.randint(1, limit)
        prices[d] = rng.randint(100, 5_000)
        out.append(
            {
                "op": "deal",
                "deal": d,
                "stock": rng.randint(5, 60),
                "buckets": rng.randint(1, 4),
                "per_user_limit": limit,
                "max_per_order": max_per_order,
                "unit_price": prices[d],
            }
        )
    # A few hot deals take most of the clicks, as in a flash sale.
    weights = [8 if d <= max(1, deals // 6) else 1 for d in range(1, deals + 1)]
    keys: list[tuple[int, str, int, int]] = []  # (user, key, deal, quantity) sent so far
    made: list[str] = []  # order ids of reservations sent so far (committed or not)
    move_at = {int(ops * (i + 1) / (moves + 1)) for i in range(moves)}
    serial = 0
    for i in range(ops):
        if i in move_at:
            out.append({"op": "move", "deal": rng.randint(1, deals), "to": rng.randint(0, 63)})
            continue
        if i and i % 40 == 0:
            out.append({"op": "sweep"})
            continue
        r = rng.random()
        if r < 0.45 or not made:
            repeat = keys and rng.random() < 0.2
            if repeat:
                user, key, deal, qty = rng.choice(keys)
                kind = rng.random()
                if kind < 0.2:
                    qty = qty + 1  # the same key, another request: a mismatch
                elif kind < 0.5:
                    deal = rng.randint(1, deals)  # the same key on (perhaps) another deal
            else:
                serial += 1
                user = rng.randint(1, users)
                key = f"k{serial}-{rng.getrandbits(24):06x}"
                deal = rng.choices(range(1, deals + 1), weights)[0]
                qty = rng.choice((1, 1, 1, 2, 3))  # mostly one unit, as in a sale
            order = _order_id(rng)
            keys.append((user, key, deal, qty))
            made.append(order)
            out.append(
                {
                    "op": "reserve",
                    "deal": deal,
                    "user": user,
                    "qty": qty,
                    "key": key,
                    "order": order,
                    "bucket": rng.randint(0, 1023),
                }
            )
        elif r < 0.52:
            deal = rng.choices(range(1, deals + 1), weights)[0]
            items = []
            for _ in range(rng.randint(2, GROUP_MAX)):
                serial += 1
                user = rng.randint(1, users)
                key = f"g{serial}-{rng.getrandbits(24):06x}"
                order = _order_id(rng)
                keys.append((user, key, deal, 1))
                made.append(order)
                items.append(
                    {
                        "user": user,
                        "qty": 1,
                        "key": key,
                        "order": order,
                        "bucket": rng.randint(0, 63),
                    }
                )
            out.append({"op": "group", "deal": deal, "items": items})
        elif r < 0.64:
            out.append({"op": "cancel", "order": rng.choice(made), "user": None})
        elif r < 0.84:
            out.append(
                {
                    "op": "pay",
                    "order": rng.choice(made),
                    "event": f"ev-{i}-{rng.getrandbits(32):08x}",
                    "payment": f"pay-{i}-{rng.getrandbits(32):08x}",
                }
            )
        else:
            out.append({"op": "expire", "order": rng.choice(made)})
    out.append({"op": "sweep"})
    # Cancels name their buyer as the API does (the order's own user, from the
    # reservation that made it); a cancel of an order that never committed is a 404.
    owner: dict[str, int] = {}
    for op in out:
        if op["op"] == "reserve":
            owner[op["order"]] = op["user"]
        elif op["op"] == "group":
            for item in op["items"]:
                owner[item["order"]] = item["user"]
    for op in out:
        if op["op"] == "cancel":
            op["user"] = owner[op["order"]]
    return out


def write_workload(path: Path, workload: Sequence[dict[str, Any]]) -> None:
    with path.open("wb") as f:
        for op in workload:
            f.write(orjson.dumps(op) + b"\n")


def read_workload(path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as f:
        ops = [orjson.loads(line) for line in f if line.strip()]
    if len(ops) > OPS_MAX * 2:
        raise ValueError(f"a workload of at most {OPS_MAX * 2} lines")
    return ops


# -- the shards -----------------------------------------------------------------------


def shard_names(base: str, shards: int) -> list[str]:
    return [f"{base}_{i}" for i in range(shards)]


def _with_database(settings: Settings, name: str) -> Settings:
    return dataclasses.replace(settings, mysql=dataclasses.replace(settings.mysql, database=name))


async def prepare(settings: Settings, base: str, shards: int) -> None:
    """Migrate the directory and every shard schema (gate/store/migrate.py: a current schema
    is only read), then empty their data: each run starts from nothing."""
    if not 1 <= shards <= SHARDS_MAX:
        raise ValueError(f"1..{SHARDS_MAX} shards")
    for name in shard_names(base, shards):
        await migrate(_with_database(settings, name).mysql)
    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            await notes_off(cur)
            await cur.execute(
                f"CREATE DATABASE IF NOT EXISTS `{base}` CHARACTER SET utf8mb4"
                " COLLATE utf8mb4_unicode_ci"
            )
            for ddl in DIRECTORY_DDL:
                await cur.execute(f"USE `{base}`")
                await cur.execute(ddl)
            for table in ("shard_map", "order_index", "idem_index"):
                await cur.execute(f"TRUNCATE TABLE `{base}`.{table}")
            for name in shard_names(base, shards):
                for table in DATA_TABLES:
                    await cur.execute(f"TRUNCATE TABLE `{name}`.{table}")
    finally:
        conn.close()


@dataclasses.dataclass
class LookupCost:
    """What finding an order's shard from its id alone cost (cancel, pay, expire)."""

    lookups: int = 0
    table_queries: int = 0
    table_seconds: float = 0.0
    scatter_queries: int = 0
    scatter_seconds: float = 0.0
    disagreements: int = 0

    def report(self, shards: int) -> dict[str, Any]:
        n = max(1, self.lookups)
        return {
            "lookups": self.lookups,
            "lookup_table": {
                "queries_per_lookup": round(self.table_queries / n, 2),
                "ms_per_lookup": round(self.table_seconds * 1000 / n, 3),
            },
            "scatter_to_all_shards": {
                "queries_per_lookup": round(self.scatter_queries / n, 2),
                "ms_per_lookup": round(self.scatter_seconds * 1000 / n, 3),
            },
            "shards": shards,
            "disagreements": self.disagreements,
        }


class Router:
    """Routes every statement of the workload to one shard by the deal it concerns."""

    def __init__(self, settings: Settings, base: str, shards: int, idempotency: str) -> None:
        if idempotency not in ("global", "shard"):
            raise ValueError("idempotency is 'global' or 'shard'")
        self.settings = settings
        self.base = base
        self.n = shards
        self.idempotency = idempotency
        self.directory = Database(_with_database(settings, base), pool_max=2)
        self.shards = [
            Database(_with_database(settings, name), pool_max=2)
            for name in shard_names(base, shards)
        ]
        self.map: dict[int, tuple[int, int]] = {}  # deal -> (shard, version), cached
        self.statements = [0] * shards
        self.directory_statements = 0
        self.lookup = LookupCost()
        self.moves = 0
        self.stale_retries = 0
        self.created_stock: dict[int, int] = {}

    async def start(self) -> None:
        await self.directory.start()
        for db in self.shards:
            await db.start()

    async def close(self) -> None:
        for db in (self.directory, *self.shards):
            await db.close()

    # -- the map ------------------------------------------------------------------

    async def _dir_one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        self.directory_statements += 1
        return await self.directory.fetchone(sql, args)

    async def _dir_exec(self, sql: str, args: Sequence[Any] = ()) -> int:
        self.directory_statements += 1
        return await self.directory.execute(sql, args)

    async def shard_of(self, deal_id: int, *, fresh: bool = False) -> int | None:
        if not fresh and deal_id in self.map:
            return self.map[deal_id][0]
        row = await self._dir_one(
            "SELECT shard, version FROM shard_map WHERE deal_id = %s AND state = 'active'",
            (deal_id,),
        )
        if row is None:
            self.map.pop(deal_id, None)
            return None
        self.map[deal_id] = (int(row[0]), int(row[1]))
        return int(row[0])

    async def _shard_call(self, shard: int, sql: str, args: Sequence[Any]) -> tuple[Any, ...]:
        db = self.shards[shard]

        async def attempt() -> tuple[Any, ...] | None:
            async with db.connection() as conn:
                return await db.call(conn, sql, args)

        self.statements[shard] += 1
        row = await db.retrying(attempt)
        assert row is not None, f"{sql.split('(')[0]} returned no row"
        return row

    async def _shard_one(self, shard: int, sql: str, args: Sequence[Any]) -> tuple[Any, ...] | None:
        self.statements[shard] += 1
        return await self.shards[shard].fetchone(sql, args)

    async def order_shard(self, order_id: str) -> int | None:
        """The shard of an order named by id alone: the lookup table (order -> deal,
        then the map), cross-checked by asking every shard (what it costs without one)."""
        self.lookup.lookups += 1
        started = time.perf_counter()
        # One query, the map read fresh: a procedure that takes only an order id cannot
        # say "not in this shard" (gate_release answers WRONG_STATE), so a stale map
        # must not route it.
        row = await self._dir_one(
            "SELECT m.shard FROM order_index AS o JOIN shard_map AS m ON m.deal_id = o.deal_id"
            " WHERE o.order_id = %s AND m.state = 'active'",
            (order_id,),
        )
        self.lookup.table_queries += 1
        by_table = None if row is None else int(row[0])
        self.lookup.table_seconds += time.perf_counter() - started
        started = time.perf_counter()
        found = []
        for shard, db in enumerate(self.shards):
            self.lookup.scatter_queries += 1
            if await db.fetchone("SELECT 1 FROM orders WHERE id = %s", (order_id,)) is not None:
                found.append(shard)
        self.lookup.scatter_seconds += time.perf_counter() - started
        # The index row is written before the order commits and removed if it did not:
        # an index row without an order is a reservation that did not commit.
        expected = [by_table] if by_table is not None and found else []
        if found != expected:
            self.lookup.disagreements += 1
        return by_table if found else None

    # -- operations ---------------------------------------------------------------

    async def create_deal(self, op: dict[str, Any]) -> str:
        deal_id = int(op["deal"])
        shard = deal_id % self.n  # any placement works: the map, not the id, decides
        await self._dir_exec(
            "INSERT INTO shard_map (deal_id, shard) VALUES (%s, %s)", (deal_id, shard)
        )
        stock, buckets = int(op["stock"]), int(op["buckets"])
        shares = [stock // buckets + (1 if b < stock % buckets else 0) for b in range(buckets)]
        db = self.shards[shard]
        # Deals.create's statements, with the id the directory gave (a shard's own
        # AUTO_INCREMENT would hand out the same ids in every shard).
        async with db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "INSERT INTO deals (id, title, unit_price, currency, bucket_count, hold_seconds,"
                " per_user_limit, max_per_order) VALUES (%s, %s, %s, 'EUR', %s, 600, %s, %s)",
                (
                    deal_id,
                    f"deal {deal_id}",
                    int(op["unit_price"]),
                    buckets,
                    op["per_user_limit"],
                    int(op["max_per_order"]),
                ),
            )
            await cur.executemany(
                "INSERT INTO deal_buckets (deal_id, bucket, epoch, total, available)"
                " VALUES (%s, %s, 0, %s, %s)",
                [(deal_id, b, n, n) for b, n in enumerate(shares)],
            )
            await cur.executemany(
                "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held,"
                " d_sold, available_before, available_after, reason, actor)"
                " VALUES (%s, %s, %s, %s, 0, 0, 0, %s, 'create', 'shard-sim')",
                [(deal_id, b, n, n, n) for b, n in enumerate(shares)],
            )
            await cur.execute("COMMIT")
        self.statements[shard] += 4
        self.map[deal_id] = (shard, 1)
        self.created_stock[deal_id] = stock
        return "created"

    async def _claim(self, deal_id: int, item: dict[str, Any]) -> str | None:
        """Claim the buyer's key and index the order before the shard's transaction,
        in one directory transaction (one commit). None: claimed; otherwise the answer
        (a replay or a mismatch)."""
        user, key, order = int(item["user"]), str(item["key"]), str(item["order"])
        held: tuple[Any, ...] | None = None
        async with self.directory.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            claimed = 1
            if self.idempotency == "global":
                # (Not INSERT IGNORE: its duplicate is a warning.) A held key changes
                # nothing and counts 0 rows.
                claimed = await cur.execute(
                    "INSERT INTO idem_index (user_id, idempotency_key, order_id, deal_id)"
                    " VALUES (%s, %s, %s, %s) ON DUPLICATE KEY UPDATE user_id = user_id",
                    (user, key, order, deal_id),
                )
                self.directory_statements += 1
                if claimed != 1:
                    await cur.execute(
                        "SELECT order_id, deal_id FROM idem_index"
                        " WHERE user_id = %s AND idempotency_key = %s",
                        (user, key),
                    )
                    held = await cur.fetchone()
                    self.directory_statements += 1
            if claimed == 1:
                await cur.execute(
                    "INSERT INTO order_index (order_id, deal_id) VALUES (%s, %s)",
                    (order, deal_id),
                )
                self.directory_statements += 1
            await cur.execute("COMMIT")
        if claimed == 1:
            return None
        assert held is not None, "a claim vanished"
        return await self._existing(int(held[1]), str(held[0]), deal_id, int(item["qty"]))

    async def _unclaim(self, item: dict[str, Any]) -> None:
        """The shard did not commit the order: its index rows go, in one directory
        transaction (a crash before this leaves them behind; a janitor would drop those
        whose order never appears in its deal's shard)."""
        order = str(item["order"])
        async with self.directory.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute("DELETE FROM order_index WHERE order_id = %s", (order,))
            if self.idempotency == "global":
                await cur.execute("DELETE FROM idem_index WHERE order_id = %s", (order,))
            await cur.execute("COMMIT")
        self.directory_statements += 2 if self.idempotency == "global" else 1

    async def _existing(self, home_deal: int, order_id: str, deal_id: int, qty: int) -> str:
        """Replay or mismatch, from the order that holds the key (in its deal's shard)."""
        shard = await self.shard_of(home_deal, fresh=True)
        assert shard is not None, f"deal {home_deal} of a claimed key has no shard"
        row = await self._shard_one(
            shard, "SELECT request_fingerprint FROM orders WHERE id = %s", (order_id,)
        )
        if row is None:
            return "in_progress"  # claimed, not committed yet (cannot happen sequentially)
        return "replay" if str(row[0]) == fingerprint(deal_id, qty) else "mismatch"

    async def _by_key_in_shard(
        self, shard: int, user: int, key: str, deal_id: int, qty: int
    ) -> str | None:
        """Without a global index the key can only be looked for in this deal's shard."""
        row = await self._shard_one(
            shard,
            "SELECT request_fingerprint FROM orders WHERE user_id = %s AND idempotency_key = %s",
            (user, key),
        )
        if row is None:
            return None
        return "replay" if str(row[0]) == fingerprint(deal_id, qty) else "mismatch"

    async def reserve(self, deal_id: int, item: dict[str, Any]) -> str:
        shard = await self.shard_of(deal_id)
        if shard is None:
            return "not_found"
        answer = await self._claim(deal_id, item)
        if answer is not None:
            return answer
        return await self._fallback(deal_id, shard, item)

    async def _reserve_call(
        self, deal_id: int, shard: int, item: dict[str, Any]
    ) -> tuple[Any, ...]:
        args = (
            item["order"],
            deal_id,
            int(item["user"]),
            int(item["qty"]),
            f"{int(item['bucket'])}:{int(item['qty'])}",
            item["key"],
            fingerprint(deal_id, int(item["qty"])),
            f"user:{item['user']}",
        )
        sql = "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)"
        row = await self._shard_call(shard, sql, args)
        if DbCode(int(row[0])) == DbCode.NOT_FOUND:
            # The deal is not (or no longer) in the shard this router's map named: a
            # move since the map was read. Read the map again and go there, once.
            moved = await self.shard_of(deal_id, fresh=True)
            if moved is not None and moved != shard:
                self.stale_retries += 1
                row = await self._shard_call(moved, sql, args)
        return row

    async def group(self, deal_id: int, items: list[dict[str, Any]]) -> list[str]:
        """A group of one deal's reservations: gate_reserve_group in the deal's shard,
        each item on its own through gate_reserve when the group falls back."""
        shard = await self.shard_of(deal_id)
        if shard is None:
            return ["not_found"] * len(items)
        answers: list[str | None] = []
        for item in items:
            answers.append(await self._claim(deal_id, item))
        todo = [item for item, a in zip(items, answers, strict=True) if a is None]
        if todo:
            payload = orjson.dumps(
                [
                    [
                        it["order"],
                        int(it["user"]),
                        int(it["qty"]),
                        int(it["bucket"]),
                        it["key"],
                        fingerprint(deal_id, int(it["qty"])),
                    ]
                    for it in todo
                ]
            ).decode()
            row = await self._shard_call(
                shard, "CALL gate_reserve_group(%s, %s)", (deal_id, payload)
            )
            grouped = DbCode(int(row[0])) == DbCode.OK
        else:
            grouped = False
        out: list[str] = []
        for item, answer in zip(items, answers, strict=True):
            if answer is not None:
                out.append(answer)
            elif grouped:
                out.append("ok")
            else:
                # The group wrote nothing: each item gets its exact answer on its own
                # (its claim stays; reserve's own claim is skipped).
                out.append(await self._fallback(deal_id, shard, item))
        return out

    async def _fallback(self, deal_id: int, shard: int, item: dict[str, Any]) -> str:
        """One claimed item through gate_reserve on its shard: its exact answer."""
        row = await self._reserve_call(deal_id, shard, item)
        code = DbCode(int(row[0]))
        if code == DbCode.OK:
            return "ok"
        await self._unclaim(item)
        if self.idempotency == "shard":
            # Gate's own order: the key the database holds answers, whatever the stock.
            found = await self._by_key_in_shard(
                shard, int(item["user"]), str(item["key"]), deal_id, int(item["qty"])
            )
            if found is not None:
                return found
        return code.name.lower()

    async def cancel(self, order_id: str, user_id: int) -> str:
        shard = await self.order_shard(order_id)
        if shard is None:
            return "not_found"
        row = await self._shard_call(
            shard,
            "CALL gate_release(%s, 'CANCELLED', %s, 0, 0, 'cancel', %s, %s)",
            (order_id, user_id, f"user:{user_id}", new_id()),
        )
        return "cancelled" if DbCode(int(row[0])) == DbCode.OK else "wrong_state"

    async def pay(self, order_id: str, event_id: str, payment_id: str) -> str:
        shard = await self.order_shard(order_id)
        if shard is None:
            # A real webhook for an unknown order still needs a home (see the docs).
            return "no_order"
        order = await self._shard_one(
            shard, "SELECT amount, currency FROM orders WHERE id = %s", (order_id,)
        )
        assert order is not None
        row = await self._shard_call(
            shard,
            "CALL gate_payment_event(0, 'sim', %s, 'payment.succeeded', %s, %s, %s, %s, NULL,"
            " '{}', NULL, %s, 'shard-sim')",
            (event_id, order_id, payment_id, int(order[0]), str(order[1]), new_id()),
        )
        return f"{row[1]}:{row[3]}"

    async def expire(self, order_id: str) -> str:
        """The clock passes the hold's deadline (the sweeper releases it later)."""
        shard = await self.order_shard(order_id)
        if shard is None:
            return "not_found"
        self.statements[shard] += 1
        n = await self.shards[shard].execute(
            "UPDATE orders SET expires_at = NOW(6) - INTERVAL 1 SECOND"
            " WHERE id = %s AND status IN ('PENDING_PAYMENT', 'AUTHORIZED')",
            (order_id,),
        )
        return "due" if n == 1 else "not_holding"

    async def sweep(self) -> int:
        """One sweeper per shard, each alone in its schema: the sweeper's batch (due
        holds FOR UPDATE SKIP LOCKED) and CALL gate_expire_batch, until none is due."""
        released = 0
        for shard, db in enumerate(self.shards):
            for _ in range(SWEEP_BATCHES_MAX):
                async with db.connection() as conn, conn.cursor() as cur:
                    await cur.execute("START TRANSACTION")
                    due: list[str] = []
                    for status in HOLDING:
                        await cur.execute(
                            "SELECT id FROM orders WHERE status = %s AND expires_at <= NOW(6)"
                            " ORDER BY expires_at, id LIMIT %s FOR UPDATE SKIP LOCKED",
                            (status, SWEEP_BATCH - len(due)),
                        )
                        due.extend(str(r[0]) for r in await cur.fetchall())
                    self.statements[shard] += 2
                    if not due:
                        await cur.execute("COMMIT")
                        break
                    batch = orjson.dumps([[o, new_id()] for o in due]).decode()
                    await cur.execute("CALL gate_expire_batch(%s, 'shard-sim')", (batch,))
                    row = await cur.fetchone()
                    while await cur.nextset():
                        pass
                    self.statements[shard] += 1
                    assert row is not None and int(row[1]) == len(due), row
                    released += len(due)
        return released

    async def move(self, deal_id: int, to: int) -> str:
        """Move a deal's rows to another shard and flip its map row, in one transaction
        (every schema is on the one server here; see the docs for several servers)."""
        src = await self.shard_of(deal_id, fresh=True)
        if src is None:
            return "not_found"
        if self.n == 1:
            return "stays"
        # `to` is a step, not a shard: the workload does not know N, and a move always
        # lands elsewhere.
        dst = (src + 1 + to % (self.n - 1)) % self.n
        s, d = shard_names(self.base, self.n)[src], shard_names(self.base, self.n)[dst]
        async with self.directory.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT shard FROM shard_map WHERE deal_id = %s FOR UPDATE", (deal_id,)
            )
            await cur.execute(
                "UPDATE shard_map SET state = 'moving' WHERE deal_id = %s", (deal_id,)
            )
            # The deal's rows, in the order the tables name it; the deal's own row and
            # bucket rows are locked first, as every stock change does.
            orders_of = f"(SELECT id FROM `{s}`.orders WHERE deal_id = {int(deal_id)})"
            where = {"deals": f"id = {int(deal_id)}"}
            where.update({t: f"deal_id = {int(deal_id)}" for t in DEAL_TABLES})
            where.update({t: f"order_id IN {orders_of}" for t in ORDER_TABLES})
            where["outbox"] = f"aggregate_id IN {orders_of}"
            await cur.execute(f"SELECT id FROM `{s}`.deals WHERE {where['deals']} FOR UPDATE")
            await cur.execute(
                f"SELECT bucket FROM `{s}`.deal_buckets WHERE {where['deal_buckets']} FOR UPDATE"
            )
            for table in DATA_TABLES:
                cols = await _columns(cur, s, table)
                # Rows in their source order (the ledger's order is its history).
                order = " ORDER BY id" if "id" in cols else ""
                if table in LOCAL_IDS:
                    cols = [c for c in cols if c != "id"]
                names = ", ".join(f"`{c}`" for c in cols)
                await cur.execute(
                    f"INSERT INTO `{d}`.{table} ({names}) SELECT {names} FROM `{s}`.{table}"
                    f" WHERE {where[table]}{order}"
                )
            # Rows keyed by order first: their condition reads the source's orders.
            for table in (*ORDER_TABLES, "outbox", *DEAL_TABLES, "deals"):
                await cur.execute(f"DELETE FROM `{s}`.{table} WHERE {where[table]}")
            await cur.execute(
                "UPDATE shard_map SET shard = %s, version = version + 1, state = 'active',"
                " updated_at = NOW(6) WHERE deal_id = %s",
                (dst, deal_id),
            )
            await cur.execute("COMMIT")
        # The cached map entry is left as it was, as in every other router: the next
        # reservation of the deal meets NOT_FOUND in the old shard and reads the map
        # again (_reserve_call). Order-id lookups read the map fresh (order_shard).
        self.moves += 1
        return "moved"


async def _columns(cur: Any, schema: str, table: str) -> list[str]:
    await cur.execute(
        "SELECT COLUMN_NAME FROM information_schema.COLUMNS"
        " WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
        (schema, table),
    )
    return [str(r[0]) for r in await cur.fetchall()]


# -- replay -----------------------------------------------------------------------------


async def replay(router: Router, workload: Iterable[dict[str, Any]]) -> list[str]:
    """Run every operation; returns one answer per reservation item and operation
    (moves answer "move" whatever happened, so the answers do not depend on N)."""
    answers: list[str] = []
    for op in workload:
        kind = op["op"]
        if kind == "deal":
            answers.append(await router.create_deal(op))
        elif kind == "reserve":
            answers.append(await router.reserve(int(op["deal"]), op))
        elif kind == "group":
            answers.extend(await router.group(int(op["deal"]), list(op["items"])))
        elif kind == "cancel":
            answers.append(await router.cancel(str(op["order"]), int(op["user"])))
        elif kind == "pay":
            answers.append(await router.pay(str(op["order"]), str(op["event"]), str(op["payment"])))
        elif kind == "expire":
            answers.append(await router.expire(str(op["order"])))
        elif kind == "sweep":
            answers.append(f"swept:{await router.sweep()}")
        elif kind == "move":
            await router.move(int(op["deal"]), int(op["to"]))
            answers.append("move")
        else:
            raise ValueError(f"unknown operation {kind!r}")
    return answers


# -- the checks -------------------------------------------------------------------------


async def check_shards(router: Router) -> dict[str, Any]:
    """Every invariant, per shard and across shards. `ok` is the verdict."""
    breaches: list[str] = []
    mapped = {
        int(r[0]): int(r[1])
        for r in await router.directory.fetchall("SELECT deal_id, shard FROM shard_map")
    }
    homes: dict[int, list[int]] = defaultdict(list)
    keys: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    orders: dict[str, int] = {}
    per_shard: list[dict[str, Any]] = []
    for shard, db in enumerate(router.shards):
        deals = [int(r[0]) for r in await db.fetchall("SELECT id FROM deals ORDER BY id")]
        for deal in deals:
            homes[deal].append(shard)
        units = Counter[str]()
        for deal in deals:
            report = await check_deal(db, None, deal)
            for b in report["invariant"]["breaches"]:
                breaches.append(f"shard {shard}, deal {deal}: {b}")
            for name, value in report["totals"].items():
                units[name] += int(value)
            created = router.created_stock.get(deal)
            if created is not None and report["totals"]["total"] != created:
                breaches.append(
                    f"shard {shard}, deal {deal}: total {report['totals']['total']},"
                    f" created with {created}"
                )
        # Every deal-keyed row sits in the shard its deal is mapped to, beside its deal.
        for table in DEAL_TABLES:
            for (deal,) in await db.fetchall(f"SELECT DISTINCT deal_id FROM {table}"):
                if mapped.get(int(deal)) != shard or int(deal) not in deals:
                    breaches.append(
                        f"shard {shard}: {table} rows of deal {deal}, which is mapped to"
                        f" shard {mapped.get(int(deal))}"
                    )
        for table in ORDER_TABLES:
            row = await db.fetchone(
                f"SELECT COUNT(*) FROM {table} WHERE order_id IS NOT NULL"
                " AND order_id NOT IN (SELECT id FROM orders)"
            )
            if row is not None and int(row[0]):
                breaches.append(f"shard {shard}: {row[0]} {table} row(s) of orders not here")
        # The shard's own unique key: a key held twice here would be a broken schema.
        for user, key, n in await db.fetchall(
            "SELECT user_id, idempotency_key, COUNT(*) FROM orders"
            " GROUP BY user_id, idempotency_key HAVING COUNT(*) > 1"
        ):
            breaches.append(f"shard {shard}: key {key!r} of user {user} held by {n} orders")
        rows = await db.fetchall("SELECT id, deal_id, user_id, idempotency_key FROM orders")
        for order_id, deal, user, key in rows:
            keys[(int(user), str(key))].append((shard, str(order_id)))
            orders[str(order_id)] = int(deal)
        per_shard.append(
            {
                "shard": shard,
                "deals": len(deals),
                "orders": len(rows),
                **{k: units[k] for k in ("total", "available", "held", "sold")},
                "statements": router.statements[shard],
            }
        )
    for deal, shard in sorted(mapped.items()):
        where = homes.get(deal, [])
        if where != [shard]:
            breaches.append(f"deal {deal}: mapped to shard {shard}, found in shards {where}")
    for deal in sorted(set(homes) - set(mapped)):
        breaches.append(f"deal {deal}: in shards {homes[deal]} but not in the map")
    cross = {k: v for k, v in keys.items() if len(v) > 1}
    for (user, key), held in sorted(cross.items())[:BREACHES_SHOWN_MAX]:
        breaches.append(
            f"key {key!r} of user {user} held by {len(held)} orders across shards"
            f" {sorted({s for s, _ in held})}"
        )
    # The directory and the shards agree: every order is indexed under its deal, and
    # (global keys) every key an order holds is claimed by that order.
    index = {
        str(r[0]): int(r[1])
        for r in await router.directory.fetchall("SELECT order_id, deal_id FROM order_index")
    }
    missing = [o for o, d in orders.items() if index.get(o) != d]
    dangling = [o for o in index if o not in orders]
    if missing:
        breaches.append(f"{len(missing)} order(s) not in the order index under their deal")
    if dangling:
        breaches.append(f"{len(dangling)} order index row(s) without an order")
    if router.idempotency == "global":
        claims = {
            (int(r[0]), str(r[1])): str(r[2])
            for r in await router.directory.fetchall(
                "SELECT user_id, idempotency_key, order_id FROM idem_index"
            )
        }
        unclaimed = [k for k, held in keys.items() if any(claims.get(k) != o for _, o in held)]
        if unclaimed or len(claims) != len(keys):
            breaches.append(
                f"key index: {len(unclaimed)} key(s) held by an order that did not claim"
                f" them, {len(claims)} claims for {len(keys)} keys"
            )
    return {
        "ok": not breaches,
        "breaches": breaches[:BREACHES_SHOWN_MAX],
        "breach_count": len(breaches),
        "cross_shard_keys": len(cross),
        "per_shard": per_shard,
    }


# -- running it -------------------------------------------------------------------------


async def simulate(
    settings: Settings,
    base: str,
    shards: int,
    workload: Sequence[dict[str, Any]],
    idempotency: str = "global",
) -> dict[str, Any]:
    """Prepare the schemas, replay the workload, check; returns the report (with the
    answers under "answers")."""
    await prepare(settings, base, shards)
    router = Router(settings, base, shards, idempotency)
    await router.start()
    try:
        started = time.perf_counter()
        answers = await replay(router, workload)
        replay_seconds = time.perf_counter() - started
        started = time.perf_counter()
        verdict = await check_shards(router)
        check_seconds = time.perf_counter() - started
    finally:
        await router.close()
    return {
        "shards": shards,
        "idempotency": idempotency,
        "operations": len(workload),
        "answers_by_kind": dict(sorted(Counter(a.split(":")[0] for a in answers).items())),
        "moves": router.moves,
        "stale_route_retries": router.stale_retries,
        "directory_statements": router.directory_statements,
        "order_lookup": router.lookup.report(shards),
        "replay_seconds": round(replay_seconds, 3),
        "check_seconds": round(check_seconds, 3),
        **verdict,
        "answers": answers,
    }


async def recheck(settings: Settings, base: str, shards: int, idempotency: str) -> dict[str, Any]:
    """The checks alone, on schemas a simulation left behind."""
    router = Router(settings, base, shards, idempotency)
    await router.start()
    try:
        return await check_shards(router)
    finally:
        await router.close()


def _settings(url: str) -> Settings:
    env = {k: v for k, v in os.environ.items() if k.startswith("GATE_")}
    env.update({"GATE_ENV": "dev", "GATE_MYSQL_URL": url})
    return load_settings(env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest shard-sim", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shards", type=int, default=4, help=f"1..{SHARDS_MAX}")
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--deals", type=int, default=24)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--moves", type=int, default=3, help="deals moved mid-run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--idempotency", choices=("global", "shard"), default="global")
    parser.add_argument(
        "--mysql",
        default="mysql://root@127.0.0.1:3306/gate_shardsim",
        help="server and base name: the directory is <base>, the shards <base>_0..",
    )
    parser.add_argument("--record", type=Path, help="write the workload here (JSON lines)")
    parser.add_argument("--replay", type=Path, help="replay this recorded workload")
    parser.add_argument(
        "--baseline", action="store_true", help="also run it on 1 shard and compare"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.shards <= SHARDS_MAX:
        parser.error(f"--shards must be 1..{SHARDS_MAX}")
    if not 0 <= args.moves <= 100:
        parser.error("--moves must be 0..100")
    settings = _settings(args.mysql)
    base = settings.mysql.database
    if args.replay:
        workload = read_workload(args.replay)
    else:
        workload = build_workload(args.seed, args.deals, args.users, args.ops, args.moves)
    if args.record:
        write_workload(args.record, workload)
    report = asyncio.run(simulate(settings, base, args.shards, workload, args.idempotency))
    answers = report.pop("answers")
    if args.baseline:
        one = asyncio.run(simulate(settings, base, 1, workload, args.idempotency))
        differ = [i for i, (a, b) in enumerate(zip(answers, one["answers"], strict=True)) if a != b]
        report["baseline_1_shard"] = {"ok": one["ok"], "answers_differing": len(differ)}
    sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    return (
        0 if report["ok"] and not report.get("baseline_1_shard", {}).get("answers_differing") else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
