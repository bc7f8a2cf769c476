"""The sharding simulation (loadtest/experiments/shard_sim.py) on real MariaDB: a seeded workload
routed by deal over 3 schemas with Gate's own procedures keeps every invariant per
shard, answers exactly as one schema does, and its checks catch a corrupted shard.

Schemas: `<suite database>_shard` (the directory) and `<suite database>_shard_0..2`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gate.base.settings import Settings
from gate.store.db import Database
from loadtest.experiments import shard_sim

SHARDS = 3
SEED = 11


@pytest.fixture(scope="module")
def base(settings: Settings) -> str:
    return f"{settings.mysql.database}_shard"


@pytest.fixture(scope="module")
def workload() -> list[dict[str, Any]]:
    return shard_sim.build_workload(SEED, deals=10, users=50, ops=260, moves=2)


@pytest.fixture(scope="module")
async def sharded(settings: Settings, base: str, workload: list[dict[str, Any]]) -> dict[str, Any]:
    return await shard_sim.simulate(settings, base, SHARDS, workload)


async def _shard_db(settings: Settings, base: str, shard: int) -> Database:
    db = Database(
        dataclasses.replace(
            settings, mysql=dataclasses.replace(settings.mysql, database=f"{base}_{shard}")
        ),
        pool_max=1,
    )
    await db.start()
    return db


@pytest.fixture
async def shard1(settings: Settings, base: str, sharded: dict[str, Any]) -> AsyncIterator[Database]:
    db = await _shard_db(settings, base, 1)
    try:
        yield db
    finally:
        await db.close()


def test_a_recorded_workload_replays_as_written(tmp_path: Path) -> None:
    made = shard_sim.build_workload(SEED, deals=10, users=50, ops=260, moves=2)
    assert made == shard_sim.build_workload(SEED, deals=10, users=50, ops=260, moves=2)
    path = tmp_path / "workload.jsonl"
    shard_sim.write_workload(path, made)
    assert shard_sim.read_workload(path) == made
    kinds = {op["op"] for op in made}
    assert kinds == {"deal", "reserve", "group", "cancel", "pay", "expire", "sweep", "move"}


async def test_every_invariant_holds_per_shard(sharded: dict[str, Any]) -> None:
    assert sharded["breaches"] == []
    assert sharded["ok"] is True
    assert sharded["cross_shard_keys"] == 0
    per_shard = sharded["per_shard"]
    assert [s["shard"] for s in per_shard] == [0, 1, 2]
    # The deals are spread: every shard holds some, and every shard took statements.
    assert all(s["deals"] > 0 and s["orders"] > 0 and s["statements"] > 0 for s in per_shard)
    assert sum(s["deals"] for s in per_shard) == 10
    for s in per_shard:
        assert s["total"] == s["available"] + s["held"] + s["sold"]
    answers = sharded["answers_by_kind"]
    # The workload did what it is for: sales, refusals, replays, payments, releases.
    for kind in ("ok", "sold_out", "replay", "mismatch", "applied", "cancelled", "due"):
        assert answers.get(kind, 0) > 0, (kind, answers)
    assert sum(s["held"] + s["sold"] for s in per_shard) > 0
    # Both moves happened, and each moved deal's next reservation met NOT_FOUND in
    # its old shard and was sent again through a fresh map row.
    assert sharded["moves"] == 2
    assert sharded["stale_route_retries"] >= 1


async def test_order_lookups_cost_one_query_or_one_per_shard(sharded: dict[str, Any]) -> None:
    lookup = sharded["order_lookup"]
    assert lookup["lookups"] > 0
    assert lookup["disagreements"] == 0
    assert lookup["lookup_table"]["queries_per_lookup"] == 1.0
    assert lookup["scatter_to_all_shards"]["queries_per_lookup"] == float(SHARDS)


async def test_one_schema_gives_the_same_answers(
    settings: Settings, base: str, workload: list[dict[str, Any]], sharded: dict[str, Any]
) -> None:
    # Runs after the 3-shard checks: it empties shard 0 for its own run.
    one = await shard_sim.simulate(settings, base, 1, workload)
    assert one["ok"] is True
    assert one["moves"] == 0
    assert len(one["answers"]) == len(sharded["answers"])
    differing = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(sharded["answers"], one["answers"], strict=True))
        if a != b
    ]
    assert differing == []
    # Restore the 3-shard state for the tests after this one.
    again = await shard_sim.simulate(settings, base, SHARDS, workload)
    assert again["ok"] is True
    assert again["answers"] == sharded["answers"]


async def test_a_unit_moved_in_one_shard_is_caught(
    settings: Settings, base: str, shard1: Database
) -> None:
    row = await shard1.fetchone(
        "SELECT deal_id, bucket FROM deal_buckets WHERE available > 0 ORDER BY deal_id LIMIT 1"
    )
    assert row is not None
    deal, bucket = int(row[0]), int(row[1])
    # One unit from available to held: the row still balances (its CHECK holds), but
    # no order holds that unit and the ledger says otherwise.
    moved = "UPDATE deal_buckets SET available = available - %s, held = held + %s"
    where = " WHERE deal_id = %s AND bucket = %s"
    assert await shard1.execute(moved + where, (1, 1, deal, bucket)) == 1
    try:
        verdict = await shard_sim.recheck(settings, base, SHARDS, "global")
        assert verdict["ok"] is False
        assert any(
            b.startswith(f"shard 1, deal {deal}: bucket {bucket}: held")
            for b in verdict["breaches"]
        ), verdict["breaches"]
        assert any("ledger sums" in b for b in verdict["breaches"])
    finally:
        assert await shard1.execute(moved + where, (-1, -1, deal, bucket)) == 1
    assert (await shard_sim.recheck(settings, base, SHARDS, "global"))["ok"] is True


async def test_an_order_in_the_wrong_shard_is_caught(
    settings: Settings, base: str, shard1: Database
) -> None:
    row = await shard1.fetchone(
        "SELECT id, deal_id FROM orders WHERE status = 'PAID' ORDER BY id LIMIT 1"
    )
    assert row is not None
    order_id, deal = str(row[0]), int(row[1])
    other = f"{base}_2"
    copy = f"INSERT INTO `{other}`.orders SELECT * FROM `{base}_1`.orders WHERE id = %s"
    assert await shard1.execute(copy, (order_id,)) == 1
    assert await shard1.execute("DELETE FROM orders WHERE id = %s", (order_id,)) == 1
    try:
        verdict = await shard_sim.recheck(settings, base, SHARDS, "global")
        breaches = verdict["breaches"]
        assert verdict["ok"] is False
        assert f"shard 2: orders rows of deal {deal}, which is mapped to shard 1" in breaches
        # Its deal's books in shard 1 no longer match its orders either.
        assert any(b.startswith(f"shard 1, deal {deal}: bucket") for b in breaches), breaches
    finally:
        back = f"INSERT INTO `{base}_1`.orders SELECT * FROM `{other}`.orders WHERE id = %s"
        assert await shard1.execute(back, (order_id,)) == 1
        assert await shard1.execute(f"DELETE FROM `{other}`.orders WHERE id = %s", (order_id,)) == 1
    assert (await shard_sim.recheck(settings, base, SHARDS, "global"))["ok"] is True


def _key_reused_on_two_deals() -> list[dict[str, Any]]:
    deal = {"stock": 10, "buckets": 2, "per_user_limit": None, "max_per_order": 2}
    one = {"op": "reserve", "user": 5, "qty": 1, "key": "same-key", "bucket": 0}
    return [
        {"op": "deal", "deal": 1, "unit_price": 100, **deal},  # shard 1 of 3
        {"op": "deal", "deal": 2, "unit_price": 200, **deal},  # shard 2 of 3
        {**one, "deal": 1, "order": "0" * 25 + "1"},
        {**one, "deal": 2, "order": "0" * 25 + "2"},
        {**one, "deal": 1, "order": "0" * 25 + "3"},
    ]


async def test_a_key_reused_across_shards_needs_the_global_index(
    settings: Settings, base: str, sharded: dict[str, Any]
) -> None:
    workload = _key_reused_on_two_deals()
    # Per-shard unique keys alone: the second deal's shard has never seen the key, so
    # a second order commits under it. The cross-shard check says so.
    alone = await shard_sim.simulate(settings, base, SHARDS, workload, idempotency="shard")
    assert alone["answers"][2:] == ["ok", "ok", "replay"]
    assert alone["ok"] is False
    assert alone["cross_shard_keys"] == 1
    assert alone["breaches"] == ["key 'same-key' of user 5 held by 2 orders across shards [1, 2]"]
    # With the directory's key index, the key answers as on one database.
    indexed = await shard_sim.simulate(settings, base, SHARDS, workload)
    assert indexed["answers"][2:] == ["ok", "mismatch", "replay"]
    assert indexed["ok"] is True
    one = await shard_sim.simulate(settings, base, 1, workload)
    assert one["answers"] == indexed["answers"]
