"""Invariant checks, per deal and per bucket.

Database (one consistent snapshot):
  * each bucket row balances: total = available + held + sold;
  * held and sold per bucket equal what the orders say (their allocations mapped
    onto the current layout), and so do the deal totals;
  * the ledger's deltas summed per bucket equal the bucket's counters;
  * per-user quota units equal the units of the buyers' holding and paid orders.
Redis, when nothing is in flight and the counters stay still while the database
is read: each bucket and the total equal the database's available units. A deal of
P > 1 partitions (docs/scale-out.md) is compared per partition: each bucket in the
partition that owns it (b MOD P), the others' fields 0, each partition's total
equal to its buckets' units in the database.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gate.inventory import store
from gate.inventory.room_check import room_report
from gate.store.db import Database
from gate.store.keys import DealKeys, deal_keys, partition_keys
from gate.store.resp import text
from gate.store.scripts import read_call

MISMATCHES_SHOWN_MAX = 20


async def _redis_state(
    client: aioredis.Redis, deal_id: int, parts: int = 1
) -> tuple[Any, ...] | None:
    if parts > 1:
        return await _partitions_state(client, deal_id, parts)
    meta, buckets, inflight = await _state_of(client, deal_keys(deal_id))
    if not meta:
        return None
    return (
        int(meta.get("nb", 0)),
        int(meta.get("avail", 0)),
        {int(b): int(v) for b, v in buckets.items()},
        int(inflight),
        meta.get("drift"),
    )


def _pairs(flat: list[Any]) -> dict[str, str]:
    """HGETALL's flat field/value list (a script's reply) as a dict."""
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


async def _state_of(
    client: aioredis.Redis, keys: DealKeys
) -> tuple[dict[str, str], dict[str, str], int]:
    """(meta, buckets, in-flight count) of one deal or partition, read in one step."""
    meta, buckets, inflight = await read_call(
        client, "deal_state", (keys.meta, keys.buckets, keys.inflight)
    )
    return _pairs(meta), _pairs(buckets), int(inflight)


async def _partitions_state(
    client: aioredis.Redis, deal_id: int, parts: int
) -> tuple[Any, ...] | None:
    """_redis_state of a partitioned deal: each bucket as its owner holds it, the
    totals summed, and per partition its total and any foreign bucket not at 0."""
    nb = 0
    avail = 0
    inflight = 0
    merged: dict[int, int] = {}
    per_total: list[int] = []
    foreign: list[str] = []
    for k in range(parts):
        meta, buckets, n = await _state_of(client, partition_keys(deal_id, k))
        if not meta:
            return None
        nb = int(meta.get("nb", 0))
        avail += int(meta.get("avail", 0))
        per_total.append(int(meta.get("avail", 0)))
        inflight += int(n)
        for b, v in buckets.items():
            if int(b) % parts == k:
                merged[int(b)] = int(v)
            elif int(v) != 0:
                foreign.append(
                    f"redis: partition {k} holds {v} in bucket {b} of partition {int(b) % parts}"
                )
    return (nb, avail, merged, inflight, None, tuple(per_total), tuple(foreign))


async def check_deal(db: Database, client: aioredis.Redis | None, deal_id: int) -> dict[str, Any]:
    """The whole report for one deal; `invariant.ok` is the verdict.

    Redis disagreeing with the database is listed among the breaches (for `gate
    check`) and on its own under `redis.mismatches` (the monitor pages on the others
    only: drift is the resync loop's to repair). A mismatch is confirmed by a second
    check before it is reported: with nothing in flight at both Redis reads, a
    reservation confirmed before the snapshot and a release applied after it can
    still leave Redis equal at both reads and the snapshot different."""
    report = await _check_deal(db, client, deal_id)
    if report.get("redis", {}).get("mismatches"):
        report = await _check_deal(db, client, deal_id)
    return report


async def _check_deal(db: Database, client: aioredis.Redis | None, deal_id: int) -> dict[str, Any]:
    """One pass: Redis read before, the database snapshot, its breaches, Redis read
    after and compared (see check_deal)."""
    parts = 1
    before = None
    if client is not None:
        parts = await _partitions_of(db, deal_id)
        before = await _redis_state_or_none(client, deal_id, parts)
    snap = await _read_snapshot(db, deal_id)
    if snap is None:
        return {
            "deal_id": deal_id,
            "invariant": {"ok": False, "breaches": ["no such deal"]},
        }
    breaches = [
        f"order allocation {alloc!r} does not add up to quantity {quantity}"
        for alloc, quantity in snap.mismatched
    ]
    buckets, totals, bucket_breaches = _bucket_report(snap)
    breaches += bucket_breaches
    breaches += _deal_breaches(snap, totals)
    redis_report: dict[str, Any] = {"loaded": False, "compared": False}
    if client is not None:
        redis_report, redis_breaches = await _compare_redis(
            client, deal_id, Reading(parts, before), snap, buckets, totals
        )
        breaches += redis_breaches
    return {
        "deal_id": deal_id,
        "bucket_count": snap.bucket_count,
        "totals": totals,
        "orders": {"held": snap.held_total, "sold": snap.sold_total},
        "bucket_rows": buckets,
        "redis": redis_report,
        "invariant": {"ok": not breaches, "breaches": breaches},
    }


async def _partitions_of(db: Database, deal_id: int) -> int:
    """The deal's partition count P (docs/scale-out.md); 1 when it cannot be read."""
    try:
        row = await store.partitions(db, deal_id)
        return int(row[0]) if row else 1
    except Exception:
        return 1


async def _redis_state_or_none(
    client: aioredis.Redis, deal_id: int, parts: int
) -> tuple[Any, ...] | None:
    """The Redis state before the snapshot; None when it cannot be read (the state
    after then differs from it, and nothing is compared)."""
    try:
        return await _redis_state(client, deal_id, parts)
    except Exception:
        return None


@dataclass(frozen=True)
class BucketRow:
    """One `deal_buckets` row of the snapshot."""

    epoch: int
    total: int
    available: int
    held: int
    sold: int

    @property
    def counters(self) -> tuple[int, int, int, int]:
        """(total, available, held, sold), the order the ledger sums come in."""
        return (self.total, self.available, self.held, self.sold)


@dataclass(frozen=True)
class Snapshot:
    """What one consistent read of the database says about a deal."""

    bucket_count: int
    epoch: int
    rows: dict[int, BucketRow]
    # Per bucket: the ledger's (total, available, held, sold) deltas summed.
    ledger: dict[int, tuple[int, ...]]
    # Units of holding (unpaid) and paid orders, per bucket of the current layout.
    held_by_orders: dict[int, int]
    sold_by_orders: dict[int, int]
    held_total: int
    sold_total: int
    # (alloc, quantity) of orders whose allocation does not add up, at most
    # MISMATCHES_SHOWN_MAX.
    mismatched: list[tuple[Any, Any]]
    # Units in user_quota; None when the deal has no per-user limit.
    quota_units: int | None


async def _read_snapshot(db: Database, deal_id: int) -> Snapshot | None:
    """The deal as one consistent snapshot of the database; None when there is no
    such deal."""
    async with db.snapshot() as cur:
        deal = await store.snapshot_deal(cur, deal_id)
        if deal is None:
            return None
        nb, epoch, limit = int(deal[0]), int(deal[1]), deal[2]
        rows = {
            int(r[0]): BucketRow(*(int(x) for x in r[1:]))
            for r in await store.snapshot_buckets(cur, deal_id)
        }
        ledger = {
            int(r[0]): tuple(int(x) for x in r[1:])
            for r in await store.snapshot_ledger(cur, deal_id)
        }
        # What the orders hold and sold, per bucket of the current layout, summed by
        # the server: a hot deal has tens of thousands of orders, and reading them
        # into the gate blocked its event loop for tenths of a second on every pass
        # of the continuous monitor.
        held_by_orders, sold_by_orders = _units_by_bucket(
            await store.snapshot_order_units(cur, nb, deal_id)
        )
        held_total, sold_total = _units_by_status(await store.snapshot_order_totals(cur, deal_id))
        mismatched = [
            (alloc, quantity)
            for alloc, quantity in await store.snapshot_mismatches(
                cur, deal_id, MISMATCHES_SHOWN_MAX
            )
        ]
        quota_units = None
        if limit is not None:
            quota_units = await store.snapshot_quota(cur, deal_id)
    return Snapshot(
        nb,
        epoch,
        rows,
        ledger,
        held_by_orders,
        sold_by_orders,
        held_total,
        sold_total,
        mismatched,
        quota_units,
    )


def _units_by_bucket(rows: list[tuple[Any, ...]]) -> tuple[dict[int, int], dict[int, int]]:
    """(held, sold) units per bucket from (bucket, paid, units) rows."""
    held_by_orders: dict[int, int] = defaultdict(int)
    sold_by_orders: dict[int, int] = defaultdict(int)
    for bucket, paid, units in rows:
        if bucket is None:
            continue  # an allocation with no parts: reported as a mismatch
        (sold_by_orders if int(paid) else held_by_orders)[int(bucket)] += int(units or 0)
    return held_by_orders, sold_by_orders


def _units_by_status(rows: list[tuple[Any, ...]]) -> tuple[int, int]:
    """(held, sold) units of the deal's orders from (paid, units) rows."""
    held_total = sold_total = 0
    for paid, units in rows:
        if int(paid):
            sold_total += int(units)
        else:
            held_total += int(units)
    return held_total, sold_total


def _bucket_report(snap: Snapshot) -> tuple[list[dict[str, Any]], dict[str, int], list[str]]:
    """(bucket rows, deal totals, breaches) of the snapshot, bucket by bucket."""
    breaches: list[str] = []
    buckets = []
    totals = {"total": 0, "available": 0, "held": 0, "sold": 0}
    nb = snap.bucket_count
    for b in sorted(set(snap.rows) | set(range(nb)) | set(snap.ledger)):
        row = snap.rows.get(b)
        if row is None:
            breaches += _absent_bucket_breaches(snap, b)
            continue
        breaches += _bucket_breaches(snap, b, row)
        totals["total"] += row.total
        totals["available"] += row.available
        totals["held"] += row.held
        totals["sold"] += row.sold
        buckets.append(
            {
                "bucket": b,
                "total": row.total,
                "available": row.available,
                "held": row.held,
                "sold": row.sold,
            }
        )
    return buckets, totals, breaches


def _absent_bucket_breaches(snap: Snapshot, b: int) -> list[str]:
    """Bucket `b` has no row: a breach inside the layout; outside it (a removed
    bucket), only when its ledger does not sum to zero."""
    if b < snap.bucket_count:
        return [f"bucket {b}: row missing"]
    led = snap.ledger.get(b, (0, 0, 0, 0))
    if any(led):
        return [f"bucket {b}: removed bucket's ledger does not sum to zero {led}"]
    return []


def _bucket_breaches(snap: Snapshot, b: int, row: BucketRow) -> list[str]:
    """Bucket `b`'s row against the layout, its own balance, the orders and the ledger."""
    breaches = []
    nb = snap.bucket_count
    total, avail, held, sold = row.counters
    if b >= nb:
        breaches.append(f"bucket {b}: row outside the layout of {nb} bucket(s)")
    if row.epoch != snap.epoch:
        breaches.append(f"bucket {b}: epoch {row.epoch}, deal layout epoch {snap.epoch}")
    if total != avail + held + sold:
        breaches.append(
            f"bucket {b}: total {total} != available {avail} + held {held} + sold {sold}"
        )
    if held != snap.held_by_orders.get(b, 0):
        breaches.append(f"bucket {b}: held {held} but orders hold {snap.held_by_orders.get(b, 0)}")
    if sold != snap.sold_by_orders.get(b, 0):
        breaches.append(f"bucket {b}: sold {sold} but orders sold {snap.sold_by_orders.get(b, 0)}")
    led = snap.ledger.get(b, (0, 0, 0, 0))
    if led != row.counters:
        breaches.append(
            f"bucket {b}: ledger sums (total, available, held, sold) {led}"
            f" != counters {row.counters}"
        )
    return breaches


def _deal_breaches(snap: Snapshot, totals: dict[str, int]) -> list[str]:
    """The buckets' totals against the orders, and the per-user quota against them."""
    breaches = []
    held_total, sold_total = snap.held_total, snap.sold_total
    if totals["held"] != held_total:
        breaches.append(f"deal: held {totals['held']} but holding orders total {held_total}")
    if totals["sold"] != sold_total:
        breaches.append(f"deal: sold {totals['sold']} but paid orders total {sold_total}")
    if snap.quota_units is not None and snap.quota_units != held_total + sold_total:
        breaches.append(
            f"deal: per-user quota units {snap.quota_units} != held + sold"
            f" {held_total + sold_total}"
        )
    return breaches


@dataclass(frozen=True)
class Reading:
    """The deal's partition count and the Redis state read before the snapshot."""

    parts: int
    before: tuple[Any, ...] | None


async def _compare_redis(
    client: aioredis.Redis,
    deal_id: int,
    reading: Reading,
    snap: Snapshot,
    buckets: list[dict[str, Any]],
    totals: dict[str, int],
) -> tuple[dict[str, Any], list[str]]:
    """(the report's `redis` part, breaches): Redis read after the snapshot, each
    bucket row given its `redis_available`, and compared with the snapshot when
    nothing was in flight and the state did not move. The breaches: Redis's
    mismatches, then the room's."""
    redis_report: dict[str, Any] = {"loaded": False, "compared": False}
    try:
        after = await _redis_state(client, deal_id, reading.parts)
    except Exception as exc:
        after = None
        redis_report["error"] = type(exc).__name__
    if after is None:
        return redis_report, []
    breaches: list[str] = []
    r_avail, inflight, drift = after[1], after[3], after[4]
    redis_report.update(
        {"loaded": True, "available": r_avail, "in_flight": inflight, "drift": drift}
    )
    for entry in buckets:
        entry["redis_available"] = after[2].get(entry["bucket"])
    if inflight == 0 and reading.before == after:
        redis_report["compared"] = True
        mismatches = _redis_mismatches(after, snap.bucket_count, buckets, totals, reading.parts)
        redis_report["mismatches"] = mismatches
        breaches.extend(mismatches)
    else:
        redis_report["reason"] = "requests in flight; compared by the resync loop instead"
    try:
        room = await room_report(client, deal_id, r_avail)
    except Exception as exc:
        room = {"on": None, "ok": True, "error": type(exc).__name__}
    if room["on"]:
        redis_report["room"] = room
        breaches.extend(f"room: {b}" for b in room["breaches"])
    return redis_report, breaches


def _redis_mismatches(
    after: tuple[Any, ...],
    nb: int,
    buckets: list[dict[str, Any]],
    totals: dict[str, int],
    parts: int,
) -> list[str]:
    """Where the Redis state `after` (see _redis_state) differs from the snapshot's
    buckets and totals."""
    r_nb, r_avail = after[0], after[1]
    mismatches: list[str] = []
    if r_nb != nb:
        mismatches.append(f"redis: {r_nb} bucket(s), database {nb}")
    for entry in buckets:
        # An absent bucket field is 0 to the scripts (tonumber(nil) or 0).
        held = entry["redis_available"] or 0
        if entry["bucket"] < nb and held != entry["available"]:
            mismatches.append(
                f"redis: bucket {entry['bucket']} has {entry['redis_available']},"
                f" database {entry['available']}"
            )
    if r_avail != totals["available"]:
        mismatches.append(f"redis: total {r_avail}, database {totals['available']}")
    if parts > 1:
        per_total, foreign = after[5], after[6]
        mismatches.extend(foreign)
        for k, have in enumerate(per_total):
            want = sum(e["available"] for e in buckets if e["bucket"] % parts == k)
            if have != want:
                mismatches.append(f"redis: partition {k} total {have}, database {want}")
    return mismatches


async def check_all(
    db: Database, client: aioredis.Redis | None, deal_id: int | None = None
) -> dict[str, Any]:
    if deal_id is not None:
        ids = [deal_id]
    else:
        ids = [int(r[0]) for r in await store.all_deal_ids(db)]
    reports = [await check_deal(db, client, i) for i in ids]
    database = await database_report(db)
    ok = all(r["invariant"]["ok"] for r in reports) and not database["errors"]
    return {"ok": ok, "deals": reports, "database": database}


_SERVER_VARIABLES = (
    "wsrep_on",
    "binlog_format",
    "innodb_autoinc_lock_mode",
    "innodb_flush_log_at_trx_commit",
    "sync_binlog",
    "log_bin",
    "read_only",
    "wsrep_auto_increment_control",
)
_SERVER_STATUS = ("wsrep_cluster_size", "wsrep_cluster_status", "wsrep_local_state")
# Fewer Galera nodes than this: losing one loses the quorum, and the sale stops.
GALERA_NODES_MIN = 3


async def database_report(db: Database) -> dict[str, Any]:
    """The settings of the writer node a sale depends on (`server_findings`), and each
    listed node's verdict when GATE_MYSQL_URL names several."""
    marks = ", ".join(["%s"] * len(_SERVER_VARIABLES))
    variables = {
        str(k).lower(): str(v)
        for k, v in await db.fetchall(
            f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({marks})", _SERVER_VARIABLES
        )
    }
    marks = ", ".join(["%s"] * len(_SERVER_STATUS))
    status = {
        str(k).lower(): str(v)
        for k, v in await db.fetchall(
            f"SHOW GLOBAL STATUS WHERE Variable_name IN ({marks})", _SERVER_STATUS
        )
    }
    listed = len(db.settings.mysql.node_list)
    errors, warnings = server_findings(variables, status, listed)
    nodes = db.selector.status() if db.selector is not None and listed > 1 else {}
    warnings += [f"node {name} is not usable: {why}" for name, why in nodes.items() if why != "ok"]
    return {
        "writer": db.node,
        "galera": variables.get("wsrep_on", "OFF").upper() == "ON",
        "nodes": nodes,
        "errors": errors,
        "warnings": warnings,
    }


def server_findings(
    variables: dict[str, str], status: dict[str, str], listed_nodes: int
) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the writer's settings. Errors fail `gate check`: with
    them a failover can lose or duplicate what was sold. Warnings are reported only:
    the single-server durability settings (a crash of the host may lose the last
    commits; MariaDB's defaults, which development and CI run with) and a cluster
    running with fewer nodes than it should."""
    errors: list[str] = []
    warnings: list[str] = []
    on = variables.get("wsrep_on", "OFF").upper() == "ON"
    if not on:
        if listed_nodes > 1:
            errors.append(
                "GATE_MYSQL_URL names several hosts but wsrep_on is OFF: only a synchronous"
                " (Galera) cluster keeps every commit through a failover"
            )
        if variables.get("innodb_flush_log_at_trx_commit", "1") != "1":
            warnings.append(
                "innodb_flush_log_at_trx_commit is not 1: a host crash may lose the last"
                " committed orders"
            )
        binlog_on = variables.get("log_bin", "OFF").upper() == "ON"
        if binlog_on and variables.get("sync_binlog", "0") != "1":
            warnings.append(
                "sync_binlog is not 1: a host crash may lose the last commits from the"
                " binary log (and from replicas)"
            )
        if variables.get("read_only", "OFF").upper() == "ON":
            errors.append("the database server is read-only")
        return errors, warnings
    if status.get("wsrep_cluster_status") != "Primary":
        errors.append(
            f"wsrep_cluster_status is {status.get('wsrep_cluster_status', '?')}, not Primary:"
            " the writer is cut off from the cluster's majority"
        )
    if status.get("wsrep_local_state") != "4":
        errors.append(
            f"wsrep_local_state is {status.get('wsrep_local_state', '?')}, not 4 (Synced)"
            " on the writer"
        )
    if variables.get("binlog_format", "").upper() != "ROW":
        errors.append(f"binlog_format is {variables.get('binlog_format', '?')}; Galera needs ROW")
    if variables.get("innodb_autoinc_lock_mode") != "2":
        errors.append(
            f"innodb_autoinc_lock_mode is {variables.get('innodb_autoinc_lock_mode', '?')};"
            " Galera needs 2 (interleaved)"
        )
    if variables.get("read_only", "OFF").upper() == "ON":
        errors.append("the writer node is read-only")
    if variables.get("wsrep_auto_increment_control", "ON").upper() != "ON":
        warnings.append(
            "wsrep_auto_increment_control is OFF: two nodes taking writes at once (a"
            " hold-down overlap) could hand out the same deal id"
        )
    size = int(status.get("wsrep_cluster_size", "0") or 0)
    if size < max(GALERA_NODES_MIN, listed_nodes):
        warnings.append(
            f"wsrep_cluster_size is {size}: fewer than {max(GALERA_NODES_MIN, listed_nodes)}"
            " nodes, one more failure may stop the sale"
        )
    return errors, warnings


def render(report: dict[str, Any]) -> str:
    """A readable report for operators."""
    lines = []
    for deal in report["deals"]:
        inv = deal["invariant"]
        verdict = "OK" if inv["ok"] else "BREACH"
        if "totals" not in deal:
            lines.append(f"deal {deal['deal_id']}: {verdict}")
        else:
            t = deal["totals"]
            r = deal["redis"]
            if not r.get("loaded"):
                redis_text = "not loaded"
            elif r.get("compared"):
                redis_text = "equal" if inv["ok"] else "compared"
            else:
                redis_text = f"{r.get('in_flight', 0)} in flight, not compared"
            lines.append(
                f"deal {deal['deal_id']}: {verdict}  total={t['total']} available={t['available']}"
                f" held={t['held']} sold={t['sold']}  buckets={deal['bucket_count']}"
                f"  redis: {redis_text}"
            )
        for breach in inv["breaches"]:
            lines.append(f"  ! {breach}")
    database = report.get("database")
    if database is not None:
        kind = "Galera" if database["galera"] else "single server"
        verdict = "UNSAFE" if database["errors"] else "OK"
        lines.append(f"database: {verdict}  writer={database['writer']} ({kind})")
        lines += [f"  ! {e}" for e in database["errors"]]
        lines += [f"  ? {w}" for w in database["warnings"]]
    if report["ok"]:
        lines.append("all invariants hold")
    elif all(d["invariant"]["ok"] for d in report["deals"]):
        lines.append("UNSAFE DATABASE SETTINGS")
    else:
        lines.append("INVARIANT BREACH")
    return "\n".join(lines)
