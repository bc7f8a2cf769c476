"""Bucket-count advice for one deal (`gate deal buckets ID --advise`), following
docs/buckets.md, from the database alone: it needs no running gate.

    sample for `sample_seconds` (every SAMPLE_EVERY_SECONDS):
        information_schema.INNODB_TRX x INNODB_LOCKS
            -> transactions waiting for a lock on one of this deal's deal_buckets rows
               (how many, and for how long)          = the deal's row contention now
    read once:
        orders of the last WINDOW_SECONDS           -> reservations committed and how
               many commits carried them (a group commits its orders with one
               timestamp)                            = load and group sizes
        deal_buckets                                 -> units left, current count
    decide:
        waits seen (in CONTENDED_SHARE of the samples, or WAITERS_CONTENDED at once)
            -> more buckets: at least double, at least one per waiter seen, capped
               by MIN_UNITS_PER_BUCKET units a bucket and MAX_BUCKETS
        no waits -> keep the count (or fewer when buckets hold under
               MIN_UNITS_PER_BUCKET units each)

Reading INNODB_LOCKS needs the PROCESS privilege; without it the advice says the
contention could not be observed and recommends nothing new.

With `gate_url` (`--gate-url`), a running gate's /metrics is also read before and after
the sampling, and the differences are reported: transactions and their mean
duration (commit latency), lock-wait and deadlock retries, group sizes, pool waiters.
They are the gate's, for all deals together, not this deal's: a retry seen there
counts as contention only together with this deal's own waits, and a scrape that
fails leaves the advice to the database.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gate.base.errors import not_found
from gate.inventory import store
from gate.store.db import Database

SAMPLE_EVERY_SECONDS = 0.1
SAMPLE_SECONDS_MAX = 60.0
WINDOW_SECONDS = 60
MIN_UNITS_PER_BUCKET = 50
MAX_BUCKETS = 1024
CONTENDED_SHARE = 0.2
WAITERS_CONTENDED = 2
SCRAPE_TIMEOUT_SECONDS = 3.0
SCRAPE_BYTES_MAX = 8 * 1024 * 1024
# Series read from the gate's /metrics: name -> labels that must match.
_SERIES = {
    "gate_db_transaction_seconds_sum": {},
    "gate_db_transaction_seconds_count": {},
    "gate_reservation_group_size_sum": {},
    "gate_reservation_group_size_count": {},
    "gate_db_retries_total:1205": {"errno": "1205"},
    "gate_db_retries_total:1213": {"errno": "1213"},
    "gate_db_pool_waiting": {},
}


async def sample_lock_waits(db: Database, deal_id: int, sample_seconds: float) -> dict[str, Any]:
    """Lock waits on the deal's bucket rows, sampled; `observed` False when the server
    would not show them (no PROCESS privilege)."""
    samples = waiting = peak = 0
    total_waiters = 0
    longest_us = 0
    deadline = time.monotonic() + sample_seconds
    try:
        async with db.connection() as conn, conn.cursor() as cur:
            while True:
                await cur.execute(store.LOCK_WAITERS, (f"{deal_id}, %",))
                row = await cur.fetchone()
                n, us = (int(row[0]), int(row[1])) if row else (0, 0)
                samples += 1
                total_waiters += n
                waiting += 1 if n else 0
                peak = max(peak, n)
                longest_us = max(longest_us, us)
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(SAMPLE_EVERY_SECONDS)
    except Exception as exc:
        return {"observed": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    return {
        "observed": True,
        "samples": samples,
        "share_with_waits": round(waiting / samples, 3),
        "mean_waiters": round(total_waiters / samples, 3),
        "peak_waiters": peak,
        "longest_wait_ms": round(longest_us / 1000, 1),
    }


def _scrape(url: str) -> dict[str, float]:
    """The series of `_SERIES` from a gate's /metrics (blocking: run in a thread)."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECONDS) as resp:
        text = resp.read(SCRAPE_BYTES_MAX + 1)
    if len(text) > SCRAPE_BYTES_MAX:
        raise ValueError(f"/metrics answer larger than {SCRAPE_BYTES_MAX} bytes")
    values: dict[str, float] = dict.fromkeys(_SERIES, 0.0)
    for family in text_string_to_metric_families(text.decode("utf-8", "replace")):
        for sample in family.samples:
            for key, labels in _SERIES.items():
                if key.split(":")[0] == sample.name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    values[key] += float(sample.value)
    return values


async def _gate_metrics(gate_url: str, before: dict[str, float] | Exception) -> dict[str, Any]:
    try:
        if isinstance(before, Exception):
            raise before
        after = await asyncio.to_thread(_scrape, gate_url.rstrip("/") + "/metrics")
    except Exception as exc:
        return {"observed": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
    d = {k: after[k] - before[k] for k in after}
    txs = d["gate_db_transaction_seconds_count"]
    groups = d["gate_reservation_group_size_count"]
    return {
        "observed": True,
        "scope": "the whole gate (every deal), during the sampling",
        "transactions": int(txs),
        "mean_transaction_ms": round(1000 * d["gate_db_transaction_seconds_sum"] / txs, 2)
        if txs
        else None,
        "lock_wait_retries": int(d["gate_db_retries_total:1205"]),
        "deadlock_retries": int(d["gate_db_retries_total:1213"]),
        "groups": int(groups),
        "mean_group_size": round(d["gate_reservation_group_size_sum"] / groups, 2)
        if groups
        else None,
        "pool_waiting": int(after["gate_db_pool_waiting"]),
    }


async def advise(
    db: Database, deal_id: int, sample_seconds: float, gate_url: str | None = None
) -> dict[str, Any]:
    row = await store.deal_buckets(db, deal_id)
    if row is None:
        raise not_found("deal")
    nb = int(row[0])
    before: dict[str, float] | Exception = {}
    if gate_url:
        try:
            before = await asyncio.to_thread(_scrape, gate_url.rstrip("/") + "/metrics")
        except Exception as exc:
            before = exc
    waits = await sample_lock_waits(db, deal_id, sample_seconds)
    gate_seen = await _gate_metrics(gate_url, before) if gate_url else None
    stock = await store.deal_stock(db, deal_id)
    available = int(stock[0]) if stock else 0
    load = await store.recent_orders(db, deal_id, WINDOW_SECONDS)
    reservations, commits = (int(load[0]), int(load[1])) if load else (0, 0)
    observed = {
        "lock_waits": waits,
        "recent": {
            "window_seconds": WINDOW_SECONDS,
            "reservations": reservations,
            "commits": commits,
            "mean_group_size": round(reservations / commits, 2) if commits else None,
        },
        "available": available,
        "units_per_bucket": available // nb,
    }
    if gate_seen is not None:
        observed["gate"] = gate_seen
    by_stock = max(1, min(MAX_BUCKETS, available // MIN_UNITS_PER_BUCKET))
    reasons: list[str] = []
    contended = bool(waits.get("observed")) and (
        waits["share_with_waits"] >= CONTENDED_SHARE or waits["peak_waiters"] >= WAITERS_CONTENDED
    )
    if not waits.get("observed"):
        reasons.append(
            "lock waits could not be read (information_schema.INNODB_LOCKS needs the PROCESS"
            f" privilege: {waits.get('error')}); keeping the count"
        )
        recommended = nb
    elif contended:
        reasons.append(
            f"transactions waited for this deal's bucket rows in"
            f" {waits['share_with_waits']:.0%} of {waits['samples']} samples (up to"
            f" {waits['peak_waiters']} at once, the longest {waits['longest_wait_ms']} ms):"
            " the row locks are a queue, and more buckets give more locks"
        )
        wanted = min(MAX_BUCKETS, max(2 * nb, nb + waits["peak_waiters"]))
        recommended = min(wanted, by_stock)
        if recommended <= nb:
            recommended = nb
            reasons.append(
                f"but only {available} unit(s) are left: more than {by_stock} bucket(s) would"
                f" hold under {MIN_UNITS_PER_BUCKET} units each and the end of the sale would"
                " be spent falling over between empty buckets; keep the count and look for the"
                " long transaction holding the rows (information_schema.INNODB_TRX)"
            )
        elif recommended < wanted:
            reasons.append(
                f"capped at {recommended} so that each bucket keeps at least"
                f" {MIN_UNITS_PER_BUCKET} of the {available} units left"
            )
    else:
        reasons.append(
            f"no transaction waited for this deal's bucket rows in {waits['samples']} samples"
            f" over {sample_seconds:g} s: the row locks are not the queue, and more buckets"
            " would not help"
        )
        recommended = nb
        if nb > by_stock:
            recommended = by_stock
            reasons.append(
                f"{nb} buckets hold under {MIN_UNITS_PER_BUCKET} units each ({available} left):"
                f" {by_stock} would spare the fall-over between nearly empty buckets"
            )
    if gate_seen and gate_seen.get("observed"):
        retries = gate_seen["lock_wait_retries"] + gate_seen["deadlock_retries"]
        if gate_seen["mean_transaction_ms"] is not None:
            reasons.append(
                f"the gate's transactions took {gate_seen['mean_transaction_ms']} ms on average"
                f" ({gate_seen['transactions']} in the window, all deals)"
                + (f", {retries} retried after lock waits or deadlocks" if retries else "")
            )
        if gate_seen["pool_waiting"]:
            reasons.append(
                f"{gate_seen['pool_waiting']} task(s) waited for a database connection: with"
                " no waits on this deal's rows, the pool or the database is the limit"
                if not contended
                else f"{gate_seen['pool_waiting']} task(s) waited for a database connection"
            )
    elif gate_seen is not None:
        reasons.append(f"the gate's metrics could not be read ({gate_seen.get('error')})")
    if commits and reservations / commits > 1.5:
        reasons.append(
            f"group commit is carrying {reservations / commits:.1f} reservations per"
            " transaction: each bucket row is locked once per group, not per buyer"
        )
    return {
        "deal_id": deal_id,
        "buckets": nb,
        "recommended_buckets": recommended,
        "change": "more" if recommended > nb else "fewer" if recommended < nb else "keep",
        "reasons": reasons,
        "observed": observed,
        "source": "database (information_schema lock waits, orders, bucket rows)"
        + (", and the gate's /metrics" if gate_url else "; no gate needed"),
    }
