"""`gate deal …` against the real MariaDB and Redis the shared gate uses: every command
with its bad input (exit 2, a clear message, nothing changed), repair of a counter
changed by hand, the refusal while reservations are in flight, and bucket advice on
an idle and on a contended deal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from typing import Any

import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.inventory.repair import plan_counters
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.support import (
    GATE_BIN,
    Client,
    GateProcess,
    assert_invariants,
    create_deal,
    locked_buckets,
    reserve,
    settled_report,
    wait_for_reserve_statement,
)


def run(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


async def arun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, env, *args)


async def counters(db: Database, deal_id: int) -> list[tuple[int, ...]]:
    rows = await db.fetchall(
        "SELECT bucket, epoch, total, available, held, sold FROM deal_buckets"
        " WHERE deal_id = %s ORDER BY bucket",
        (deal_id,),
    )
    return [tuple(int(x) for x in r) for r in rows]


async def state(db: Database, deal_id: int) -> tuple[Any, ...]:
    """Everything a deal command could change in the database."""
    deal = await db.fetchone(
        "SELECT bucket_count, layout_epoch, version FROM deals WHERE id = %s", (deal_id,)
    )
    ledger = await db.fetchone(
        "SELECT COUNT(*), MAX(id) FROM inventory_ledger WHERE deal_id = %s", (deal_id,)
    )
    quota = await db.fetchall(
        "SELECT user_id, units FROM user_quota WHERE deal_id = %s ORDER BY user_id", (deal_id,)
    )
    deals = await db.fetchone("SELECT COUNT(*) FROM deals")
    return deal, ledger, quota, await counters(db, deal_id), deals


async def ledger_rows(db: Database, deal_id: int, reason: str) -> list[tuple[Any, ...]]:
    return await db.fetchall(
        "SELECT bucket, d_total, d_available, d_held, d_sold, actor, note FROM inventory_ledger"
        " WHERE deal_id = %s AND reason = %s ORDER BY id",
        (deal_id, reason),
    )


async def test_repair_finds_fixes_and_ledgers_a_counter_changed_by_hand(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=10, buckets=2, per_user_limit=3, max_per_order=2)
    assert (await reserve(client, deal_id, 1_700_001, "deal-repair-0001", 2)).status_code == 201
    assert (await reserve(client, deal_id, 1_700_002, "deal-repair-0002", 1)).status_code == 201
    await assert_invariants(db, rds, deal_id)
    truth = await counters(db, deal_id)
    held_bucket = next(r[0] for r in truth if r[4] > 0)
    # Hand edits: phantom stock in bucket 0, a held unit made available again, a buyer's
    # quota wiped (the per-user limit would let them buy 3 more).
    await db.execute(
        "UPDATE deal_buckets SET total = total + 3, available = available + 3"
        " WHERE deal_id = %s AND bucket = 0",
        (deal_id,),
    )
    await db.execute(
        "UPDATE deal_buckets SET held = held - 1, available = available + 1"
        " WHERE deal_id = %s AND bucket = %s",
        (deal_id, held_bucket),
    )
    await db.execute(
        "UPDATE user_quota SET units = 0 WHERE deal_id = %s AND user_id = 1700001", (deal_id,)
    )
    broken = await arun(env, "check", "--deal", str(deal_id))
    assert broken.returncode == 1 and "BREACH" in broken.stdout, broken.stdout
    before = await state(db, deal_id)

    dry = await arun(env, "deal", "repair", str(deal_id), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True and plan["changed"] is True and plan["applied"] is False
    wanted = {r[0]: r[2:] for r in truth}
    for b in plan["buckets"]:
        assert tuple(b["after"].values()) == wanted[b["bucket"]], plan
    assert {b["bucket"] for b in plan["buckets"]} == {0, held_bucket}
    assert plan["quota"]["shown"] == [{"user_id": 1_700_001, "before": 0, "after": 2}]
    assert await state(db, deal_id) == before  # the dry run changed nothing
    text = await arun(env, "deal", "repair", str(deal_id), "--dry-run")
    assert text.returncode == 0 and "would repair (dry run, nothing changed)" in text.stdout
    assert "bucket 0: total 8 -> 5" in text.stdout, text.stdout

    fixed = await arun(env, "deal", "repair", str(deal_id), "--operator", "alice", "--json")
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["applied"] is True
    assert await counters(db, deal_id) == truth
    quota = await db.fetchall(
        "SELECT user_id, units FROM user_quota WHERE deal_id = %s ORDER BY user_id", (deal_id,)
    )
    assert [(int(u), int(n)) for u, n in quota] == [(1_700_001, 2), (1_700_002, 1)]
    rows = await ledger_rows(db, deal_id, "repair")
    assert {r[5] for r in rows} == {"alice"}
    by_bucket = {int(r[0]): r for r in rows if "quota" not in str(r[6])}
    assert set(by_bucket) == {0, held_bucket}
    assert any("per-user quota of 1 buyer(s)" in str(r[6]) for r in rows)
    # Invariants, Redis included, hold again: gate check is clean.
    clean = await arun(env, "check", "--deal", str(deal_id))
    assert clean.returncode == 0, clean.stdout
    report = await assert_invariants(db, rds, deal_id)
    assert report["totals"] == {"total": 10, "available": 7, "held": 3, "sold": 0}
    assert int(await rds.hget(deal_keys(deal_id).users, "1700001") or 0) == 2
    # The per-user limit counts the repaired quota again: 2 held + 2 > 3.
    over = await reserve(client, deal_id, 1_700_001, "deal-repair-0003", 2)
    assert over.status_code == 422, over.text

    # Rebucketing refuses counters that disagree with the orders (it was a 500).
    await db.execute(
        "UPDATE deal_buckets SET held = held - 1, available = available + 1"
        " WHERE deal_id = %s AND bucket = %s",
        (deal_id, held_bucket),
    )
    damaged = await state(db, deal_id)
    refused = await arun(env, "deal", "buckets", str(deal_id), "--count", "3")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"Repair them first: gate deal repair {deal_id}" in refused.stderr
    assert await state(db, deal_id) == damaged
    assert (await arun(env, "deal", "repair", str(deal_id))).returncode == 0
    assert await counters(db, deal_id) == truth
    rows = await ledger_rows(db, deal_id, "repair")

    again = await arun(env, "deal", "repair", str(deal_id))
    assert again.returncode == 0 and "nothing to repair" in again.stdout
    assert len(await ledger_rows(db, deal_id, "repair")) == len(rows)


async def test_repair_refuses_rows_still_locked_without_a_mark_in_flight(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], settings: Settings
) -> None:
    """A transaction holding the deal's rows that Redis does not show (a reservation
    whose in-flight mark is gone): the repair's lock wait ends in the same refusal,
    never a raw database error, and nothing changes."""
    deal_id = await create_deal(client, stock=5)
    await settled_report(db, rds, deal_id)
    quick = {**env, "GATE_DB_LOCK_WAIT_SECONDS": "1", "GATE_DB_RETRY_MAX": "1"}
    async with locked_buckets(settings, deal_id):
        assert await rds.hlen(deal_keys(deal_id).inflight) == 0
        before = await state(db, deal_id)
        refused = await arun(quick, "deal", "repair", str(deal_id))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "in flight" in refused.stderr and "--wait" in refused.stderr, refused.stderr
        assert "OperationalError" not in refused.stderr
        assert await state(db, deal_id) == before


async def test_repair_refuses_while_reservations_are_in_flight(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str], settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=5)
    await settled_report(db, rds, deal_id)
    keys = deal_keys(deal_id)
    async with locked_buckets(settings, deal_id) as cur:
        pending = asyncio.create_task(reserve(client, deal_id, 1_700_101, "deal-inflight-01"))
        await wait_for_reserve_statement(cur, deal_id)
        assert await rds.hlen(keys.inflight) == 1
        before = await state(db, deal_id)
        refused = await arun(env, "deal", "repair", str(deal_id))
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "in flight" in refused.stderr and "--wait" in refused.stderr
        assert await state(db, deal_id) == before
        waiting = asyncio.create_task(arun(env, "deal", "repair", str(deal_id), "--wait", "60"))
        await asyncio.sleep(1.0)
        assert not waiting.done()
    # The lock is gone: the reservation commits, then the waiting repair runs.
    assert (await pending).status_code == 201
    waited = await waiting
    assert waited.returncode == 0, waited.stderr
    assert "nothing to repair" in waited.stdout
    await assert_invariants(db, rds, deal_id)


async def test_every_deal_command_with_its_bad_input(
    db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    created = await arun(
        env,
        "deal", "create", "--title", "CLI deal", "--unit-price", "1250", "--currency", "EUR",
        "--stock", "12", "--buckets", "3", "--per-user-limit", "4", "--operator", "bob", "--json",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    view = json.loads(created.stdout)
    deal_id = int(view["id"])
    assert view["buckets"] == 3 and view["stock"] == 12 and view["per_user_limit"] == 4
    assert [r[5] for r in await ledger_rows(db, deal_id, "create")] == ["bob"] * 3
    assert await rds.hget(deal_keys(deal_id).meta, "nb") == "3"  # Redis built, as the API does

    deals_before = await db.fetchone("SELECT COUNT(*) FROM deals")
    for bad, message in (
        (["--currency", "eur"], "'currency' has an invalid format"),
        (["--stock", "-1"], "'stock' must be between 0 and"),
        (["--buckets", "0"], "'buckets' must be between 1 and 1024"),
        (["--per-user-limit", "1", "--max-per-order", "2"], "cannot exceed 'per_user_limit'"),
        (["--starts-at", "yesterday"], "'starts_at' must be an ISO 8601"),
        (["--capture-mode", "later"], "'capture_mode' must be"),
        (["--unit-price", "cheap"], "invalid int value"),
        (["--operator", "a b"], "--operator"),
    ):
        args = {"--title": "Bad", "--unit-price": "1", "--currency": "EUR", "--stock": "1"}
        for flag, value in zip(bad[::2], bad[1::2], strict=True):
            args[flag] = value
        out = await arun(env, "deal", "create", *[x for kv in args.items() for x in kv])
        assert out.returncode == 2, (bad, out.stdout, out.stderr)
        assert message in out.stderr, (bad, out.stderr)
    assert await db.fetchone("SELECT COUNT(*) FROM deals") == deals_before

    listed = await arun(env, "deal", "list", "--after", str(deal_id - 1), "--limit", "1", "--json")
    assert listed.returncode == 0, listed.stderr
    page = json.loads(listed.stdout)
    assert [d["id"] for d in page["items"]] == [deal_id]
    assert page["items"][0]["totals"] == {"total": 12, "available": 12, "held": 0, "sold": 0}
    assert page["next_after"] == deal_id
    text = await arun(env, "deal", "list", "--after", str(deal_id - 1))
    assert f"deal {deal_id}: 'CLI deal'  buckets=3  total=12 available=12" in text.stdout
    for bad in (["--limit", "0"], ["--limit", "1001"], ["--after", "-1"], ["--after", "x"]):
        out = await arun(env, "deal", "list", *bad)
        assert out.returncode == 2 and "must be" in out.stderr, (bad, out.stderr)

    shown = await arun(env, "deal", "show", str(deal_id), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["invariant"]["ok"] and report["totals"]["total"] == 12
    text = await arun(env, "deal", "show", str(deal_id))
    assert f"deal {deal_id}: 'CLI deal'  1250 EUR  buckets=3" in text.stdout
    assert "all invariants hold" in text.stdout
    for bad, message in (("0", "must be within 1.."), ("x", "must be an integer"),
                         ("999999999999", "No such deal")):  # fmt: skip
        out = await arun(env, "deal", "show", bad)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)

    before = await state(db, deal_id)
    for bad, message, code in (
        (["--delta", "0", "--reason", "none"], "'delta' must not be zero", 2),
        (["--delta", "5", "--reason", " "], "'reason' must be a non-empty string", 2),
        (["--delta", "5"], "--reason", 2),
        (["--delta", "ten", "--reason", "r"], "invalid int value", 2),
        (["--delta", "-13", "--reason", "too many"], "only 12 available", 1),
    ):
        out = await arun(env, "deal", "stock", str(deal_id), *bad)
        assert out.returncode == code and message in out.stderr, (bad, out.stderr)
    assert await state(db, deal_id) == before
    out = await arun(env, "deal", "stock", str(deal_id), "--delta", "5", "--reason", "restock",
                     "--operator", "carol", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["totals"]["total"] == 17
    adjust = await ledger_rows(db, deal_id, "adjust")
    assert sum(int(r[1]) for r in adjust) == 5 and {r[5] for r in adjust} == {"carol"}
    assert {str(r[6]) for r in adjust} == {"restock"}

    before = await state(db, deal_id)
    for bad, message in (
        (["--count", "0"], "'count' must be between 1 and 1024"),
        (["--count", "1025"], "'count' must be between 1 and 1024"),
        (["--count", "2", "--advise"], "not allowed with argument"),
        ([], "one of the arguments --count --advise is required"),
        (["--advise", "--sample-seconds", "100"], "must be within 0..60"),
    ):
        out = await arun(env, "deal", "buckets", str(deal_id), *bad)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)
    assert await state(db, deal_id) == before
    out = await arun(env, "deal", "buckets", str(deal_id), "--count", "4", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["buckets"] == 4
    assert await rds.hget(deal_keys(deal_id).meta, "nb") == "4"
    assert len(await counters(db, deal_id)) == 4

    ledger = await arun(env, "deal", "ledger", str(deal_id), "--json")
    assert ledger.returncode == 0, ledger.stderr
    reasons = {r["reason"] for r in json.loads(ledger.stdout)["items"]}
    assert reasons == {"create", "adjust", "rebucket"}
    first = await arun(env, "deal", "ledger", str(deal_id), "--limit", "1", "--json")
    assert json.loads(first.stdout)["next_after"] is not None
    text = await arun(env, "deal", "ledger", str(deal_id))
    assert "create by bob: total +4 available +4" in text.stdout
    for bad in (["--limit", "0"], ["--limit", "5000"], ["--after", "-2"]):
        out = await arun(env, "deal", "ledger", str(deal_id), *bad)
        assert out.returncode == 2 and "must be" in out.stderr, (bad, out.stderr)
    out = await arun(env, "deal", "ledger", "999999999999")
    assert out.returncode == 2 and "No such deal" in out.stderr

    before = await state(db, deal_id)
    for bad, message in (
        (["0"], "must be within 1.."),
        (["999999999999"], "No such deal"),
        ([str(deal_id), "--wait", "-1"], "must be within 0..3600"),
        ([str(deal_id), "--operator", "x" * 65], "--operator"),
    ):
        out = await arun(env, "deal", "repair", *bad)
        assert out.returncode == 2 and message in out.stderr, (bad, out.stderr)
    assert await state(db, deal_id) == before
    out = await arun(env, "deal", "repair", str(deal_id), "--dry-run")
    assert out.returncode == 0 and "nothing to repair" in out.stdout
    out = await arun(env, "deal")
    assert out.returncode == 2
    assert (await arun(env, "check", "--deal", str(deal_id))).returncode == 0


async def test_advise_recommends_more_buckets_only_under_contention(
    client: Client,
    db: Database,
    rds: aioredis.Redis,
    env: dict[str, str],
    settings: Settings,
    gate: GateProcess,
) -> None:
    idle = await create_deal(client, stock=1000, buckets=1)
    out = await arun(env, "deal", "buckets", str(idle), "--advise", "--sample-seconds", "1",
                     "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    advice = json.loads(out.stdout)
    assert advice["change"] == "keep" and advice["recommended_buckets"] == 1, advice
    assert advice["observed"]["lock_waits"]["observed"] is True
    assert advice["observed"]["lock_waits"]["peak_waiters"] == 0
    before = await state(db, idle)
    text = await arun(env, "deal", "buckets", str(idle), "--advise", "--sample-seconds", "0")
    assert "1 bucket(s); recommended 1 (keep)" in text.stdout, text.stdout
    assert await state(db, idle) == before  # advice changes nothing

    hot = await create_deal(client, stock=1000, buckets=1)
    stop = asyncio.Event()
    answers: list[int] = []

    async def buyers() -> None:
        # Buyers keep arriving while a long transaction holds the deal's bucket row.
        tasks = []
        n = 0
        while not stop.is_set():
            n += 1
            tasks.append(
                asyncio.create_task(reserve(client, hot, 1_701_000 + n, f"deal-advise-{n:06d}"))
            )
            await asyncio.sleep(0.05)
        answers.extend(r.status_code for r in await asyncio.gather(*tasks))

    async with locked_buckets(settings, hot) as cur:
        crowd = asyncio.create_task(buyers())
        try:
            await wait_for_reserve_statement(cur, hot)
            out = await arun(env, "deal", "buckets", str(hot), "--advise", "--sample-seconds",
                             "1", "--gate-url", str(gate.metrics_url), "--json")  # fmt: skip
        finally:
            stop.set()
    with contextlib.suppress(Exception):
        await crowd
    assert out.returncode == 0, out.stderr
    advice = json.loads(out.stdout)
    assert advice["change"] == "more" and advice["recommended_buckets"] >= 2, advice
    assert advice["observed"]["lock_waits"]["peak_waiters"] >= 1
    assert "more buckets give more locks" in " ".join(advice["reasons"])
    # The running gate's own view over the same window (all deals): its transactions,
    # read from its metrics listener.
    seen = advice["observed"]["gate"]
    assert seen["observed"] is True, seen
    assert seen["transactions"] >= 0 and "lock_wait_retries" in seen
    for bad in ("ftp://gate", "gate:8000", "http://"):
        bad_url = await arun(env, "deal", "buckets", str(hot), "--advise", "--gate-url", bad)
        assert bad_url.returncode == 2 and "must be an http(s):// URL" in bad_url.stderr
    # An unreachable gate leaves the advice to the database, and says so.
    gone = await arun(env, "deal", "buckets", str(hot), "--advise", "--sample-seconds", "0",
                      "--gate-url", "http://127.0.0.1:9", "--json")  # fmt: skip
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["observed"]["gate"]["observed"] is False
    assert 201 in answers
    await assert_invariants(db, rds, hot, timeout_seconds=30)


async def test_repair_refuses_an_oversell_and_changes_nothing(
    client: Client, db: Database, rds: aioredis.Redis, env: dict[str, str]
) -> None:
    deal_id = await create_deal(client, stock=2, max_per_order=2)
    assert (await reserve(client, deal_id, 1_700_201, "deal-oversell-1", 2)).status_code == 201
    await assert_invariants(db, rds, deal_id)
    # A unit taken out of the ledger's stock by hand: the orders now hold more units
    # than the deal has. No repair can square that without going below zero.
    await db.execute(
        "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held, d_sold,"
        " available_before, available_after, reason, actor) VALUES (%s, 0, -1, -1, 0, 0, 0, 0,"
        " 'forged', 'test')",
        (deal_id,),
    )
    before = await state(db, deal_id)
    for args in ((), ("--dry-run",)):
        out = await arun(env, "deal", "repair", str(deal_id), *args)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "orders hold or sold 2 unit(s) but its ledger records 1" in out.stderr
        assert await state(db, deal_id) == before
    await db.execute(
        "DELETE FROM inventory_ledger WHERE deal_id = %s AND reason = 'forged'", (deal_id,)
    )
    await assert_invariants(db, rds, deal_id)


def test_a_bucket_short_of_its_orders_borrows_from_the_fullest() -> None:
    # Bucket 0's orders hold 3 units but its ledger stock is 2: it takes the missing
    # unit from bucket 2 (the fullest), the deal's total stays 9, nothing goes below 0.
    want = plan_counters(3, {0: 2, 1: 3, 2: 4}, held={0: 3, 1: 1}, sold={2: 1})
    assert want == {0: (3, 0, 3, 0), 1: (3, 2, 1, 0), 2: (3, 2, 0, 1)}
    assert sum(w[0] for w in want.values()) == 9
    assert all(w[0] == w[1] + w[2] + w[3] and min(w) >= 0 for w in want.values())
