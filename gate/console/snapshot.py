"""The console's live snapshot: computed at most once a second per process and
shared by every open page of that process.

    page polls GET /console/api/snapshot (once a second)
        --> Snapshots.get(): younger than REFRESH_SECONDS? the kept one
            otherwise one computation (concurrent callers await the same task):
              database  one query: the newest DEALS_SHOWN_MAX deals with their bucket
                        rows (current layout), + SHOW GLOBAL STATUS (commits, lock waits)
              Redis     one pipeline: each shown deal's bucket counters
              panels    each installed area's ConsolePanel.fields (gate/extensions.py):
                        the waiting room's and queue mode's fields of the shown deals,
                        one pipeline (and at most one query) per area
              metrics   this gate's Prometheus samples (every worker's files merged in
                        multi-process mode): reservations by outcome, latency
                        histogram, invariant breaches per deal from the continuous
                        checks (gate/expiry/invariant_monitor.py)
            rates and quantiles are differences against the previous computation

So twenty open consoles cost what one does: a query, a pipeline and a metrics merge
per second per process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, multiprocess

from gate.base.clock import iso, parse_iso
from gate.base.metrics import METRICS, multiprocess_active
from gate.store.keys import partition_keys

if TYPE_CHECKING:
    from gate.runtime import Gate

log = logging.getLogger("gate.console")

REFRESH_SECONDS = 1.0
DEALS_SHOWN_MAX = 50
# Bucket rows read per snapshot, over every shown deal (a deal has at most 1024).
BUCKET_ROWS_MAX = 8192
# Outcome groups the page draws, from gate_reservations_total's outcome label.
OUTCOME_GROUPS = {
    "created": ("created",),
    "sold_out": ("SOLD_OUT",),
    "rate_limited": ("RATE_LIMITED",),
    "unavailable": ("OVERLOADED",),
}
_DB_STATUS = (
    "Com_commit",
    "Handler_commit",
    "Innodb_row_lock_waits",
    "Innodb_row_lock_current_waits",
)


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    if multiprocess_active():
        METRICS.flush()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        families = registry.collect()
    else:
        families = METRICS.registry.collect()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    wanted = (
        "gate_reservations_total",
        "gate_reservation_latency_seconds",
        "gate_invariant_breaches",
        "gate_redis_drift_units",
        "gate_db_retries_total",
    )
    for family in families:
        if family.name not in wanted and family.name + "_total" not in wanted:
            continue
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile, linearly interpolated, of cumulative (upper bound, count)
    pairs sorted by bound (Prometheus's histogram_quantile)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            width = count - lower_count
            share = (rank - lower_count) / width if width else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


class Snapshots:
    def __init__(self, gate: Gate, refresh_seconds: float = REFRESH_SECONDS) -> None:
        self.gate = gate
        self.refresh_seconds = refresh_seconds
        self._kept: tuple[float, dict[str, Any]] | None = None
        self._running: asyncio.Task[dict[str, Any]] | None = None
        self._previous: tuple[float, dict[Any, float], dict[str, float]] | None = None
        self.computed = 0  # how many snapshots this process computed (for the tests)

    async def get(self) -> dict[str, Any]:
        kept = self._kept
        if kept is not None and kept[0] > time.monotonic():
            return kept[1]
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._compute())
        return await asyncio.shield(self._running)

    async def _compute(self) -> dict[str, Any]:
        started = time.monotonic()
        try:
            snapshot = await self._build(started)
        finally:
            self._running = None
        self.computed += 1
        self._kept = (started + self.refresh_seconds, snapshot)
        return snapshot

    async def _build(self, now: float) -> dict[str, Any]:
        gate = self.gate
        timings: dict[str, float] = {}
        rows = await gate.db.fetchall(
            "SELECT d.id, d.title, d.starts_at, d.ends_at, d.bucket_count, d.hold_seconds,"
            " b.bucket, b.total, b.available, b.held, b.sold, d.paused_at, d.pause_reason"
            " FROM (SELECT id, title, starts_at, ends_at, bucket_count, hold_seconds,"
            " layout_epoch, paused_at, pause_reason FROM deals ORDER BY id DESC LIMIT %s) AS d"
            " JOIN deal_buckets b ON b.deal_id = d.id AND b.epoch = d.layout_epoch"
            " ORDER BY d.id DESC, b.bucket LIMIT %s",
            (DEALS_SHOWN_MAX, BUCKET_ROWS_MAX),
        )
        deals: dict[int, dict[str, Any]] = {}
        for r in rows:
            deal_id = int(r[0])
            deal = deals.get(deal_id)
            if deal is None:
                deal = deals[deal_id] = {
                    "id": deal_id,
                    "title": r[1],
                    "starts_at": iso(r[2]),
                    "ends_at": iso(r[3]),
                    "buckets": int(r[4]),
                    "hold_seconds": int(r[5]),
                    "total": 0,
                    "available": 0,
                    "held": 0,
                    "sold": 0,
                    "bucket_rows": [],
                    # The sale paused (gate/inventory/pause.py): the console's banner.
                    "paused": (
                        {"since": iso(r[11]), "reason": r[12]} if r[11] is not None else None
                    ),
                }
            total, avail, held, sold = (int(x) for x in r[7:11])
            deal["total"] += total
            deal["available"] += avail
            deal["held"] += held
            deal["sold"] += sold
            deal["bucket_rows"].append(
                {"bucket": int(r[6]), "available": avail, "held": held, "sold": sold}
            )
        wall = time.time()
        for deal in deals.values():
            deal["status"] = _status(deal, wall)
        await self._redis_buckets(deals)
        timings["deals"] = round((time.monotonic() - now) * 1000, 2)
        mark = time.monotonic()
        await self._panels(deals)
        gate_panels = await self._gate_panels()
        timings["panels"] = round((time.monotonic() - mark) * 1000, 2)
        mark = time.monotonic()
        samples = _samples()
        timings["metrics"] = round((time.monotonic() - mark) * 1000, 2)
        mark = time.monotonic()
        db_status = await self._db_status()
        timings["db_status"] = round((time.monotonic() - mark) * 1000, 2)
        rates = self._rates(now, samples, db_status)
        for deal in deals.values():
            key = ("gate_invariant_breaches", (("deal", str(deal["id"])),))
            drift = samples.get(("gate_redis_drift_units", (("deal", str(deal["id"])),)))
            breaches = samples.get(key)
            deal["invariant"] = {
                "checked": breaches is not None,
                "ok": breaches is None or breaches == 0,
                "breaches": int(breaches or 0),
                "redis_drift_units": None if drift is None else int(drift),
            }
        return {
            "generated_at": iso_now(),
            # What this snapshot cost its process, for the operator and the benchmark.
            "compute_ms": round((time.monotonic() - now) * 1000, 2),
            "timings_ms": timings,
            "refresh_seconds": self.refresh_seconds,
            "deals": list(deals.values()),
            "gate": rates,
            "panels": gate_panels,
        }

    async def _redis_buckets(self, deals: dict[int, dict[str, Any]]) -> None:
        if not deals:
            return
        # A partitioned deal (docs/scale-out.md): each bucket as its partition holds it.
        parts = {d: self.gate.mirror.parts.get(d, 1) for d in deals}
        try:
            pipe = self.gate.redis.pipeline(transaction=False)
            for deal_id in deals:
                for k in range(parts[deal_id]):
                    pipe.hgetall(partition_keys(deal_id, k).buckets)
            answers = iter(await pipe.execute())
        except Exception as exc:
            log.warning("console: Redis bucket counters unavailable: %r", exc)
            return
        for deal_id, deal in deals.items():
            counters: dict[int, int] = {}
            p = parts[deal_id]
            for k in range(p):
                answer = next(answers)
                counters.update(
                    {int(b): int(v) for b, v in (answer or {}).items() if int(b) % p == k}
                )
            for row in deal["bucket_rows"]:
                row["redis_available"] = counters.get(row["bucket"])

    async def _panels(self, deals: dict[int, dict[str, Any]]) -> None:
        """The areas' fields of each shown deal (their ConsolePanels, gate/extensions.py),
        asked together; a panel that fails leaves its fields out of this snapshot."""
        panels = [p for ext in self.gate.extensions for p in ext.console_panels]
        if not deals or not panels:
            return
        shown = list(deals)
        answers = await asyncio.gather(*(p.fields(shown) for p in panels), return_exceptions=True)
        for panel, answer in zip(panels, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("console: the %s panel failed: %r", type(panel).__name__, answer)
                continue
            for deal_id, fields in answer.items():
                if deal_id in deals:
                    deals[deal_id].update(fields)

    async def _gate_panels(self) -> dict[str, Any]:
        """The areas' gate-wide panels (gate/extensions.py ConsoleGatePanel), by name; a
        panel that fails is left out of this snapshot."""
        panels = [p for ext in self.gate.extensions for p in ext.console_gate_panels]
        if not panels:
            return {}
        answers = await asyncio.gather(*(p.gate_fields() for p in panels), return_exceptions=True)
        out: dict[str, Any] = {}
        for panel, answer in zip(panels, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("console: the %s panel failed: %r", panel.name, answer)
                continue
            out[panel.name] = answer
        return out

    async def _db_status(self) -> dict[str, float]:
        try:
            rows = await self.gate.db.fetchall(
                "SHOW GLOBAL STATUS WHERE Variable_name IN (%s, %s, %s, %s)", _DB_STATUS
            )
        except Exception as exc:
            log.warning("console: database status unavailable: %r", exc)
            return {}
        return {str(name): float(value) for name, value in rows}

    def _rates(
        self, now: float, samples: dict[Any, float], db_status: dict[str, float]
    ) -> dict[str, Any]:
        previous = self._previous
        self._previous = (now, samples, db_status)
        out: dict[str, Any] = {
            "reservations_per_second": {k: None for k in OUTCOME_GROUPS},
            "latency_seconds": {"p50": None, "p99": None},
            "db_commits_per_second": None,
            "db_lock_waits_per_second": None,
            "db_lock_waits_now": db_status.get("Innodb_row_lock_current_waits"),
            "db_retries_per_second": None,
            "interval_seconds": None,
        }
        if previous is None:
            return out
        then, old, old_db = previous
        span = max(now - then, 1e-3)
        out["interval_seconds"] = round(span, 3)

        def total(source: dict[Any, float], name: str, **labels: str) -> float:
            want = set(labels.items())
            return sum(v for (n, lab), v in source.items() if n == name and want <= set(lab))

        for group, outcomes in OUTCOME_GROUPS.items():
            moved = sum(
                total(samples, "gate_reservations_total", outcome=o)
                - total(old, "gate_reservations_total", outcome=o)
                for o in outcomes
            )
            out["reservations_per_second"][group] = round(max(0.0, moved) / span, 2)
        bounds: dict[float, float] = {}
        for (name, labels), value in samples.items():
            if name == "gate_reservation_latency_seconds_bucket":
                le = float(dict(labels)["le"])
                bounds[le] = bounds.get(le, 0.0) + value - old.get((name, labels), 0.0)
        cumulative = sorted(bounds.items())
        out["latency_seconds"] = {
            "p50": _quantile(cumulative, 0.5),
            "p99": _quantile(cumulative, 0.99),
        }
        if "Com_commit" in db_status and "Com_commit" in old_db:
            out["db_commits_per_second"] = round(
                (db_status["Com_commit"] - old_db["Com_commit"]) / span, 2
            )
        if "Innodb_row_lock_waits" in db_status and "Innodb_row_lock_waits" in old_db:
            out["db_lock_waits_per_second"] = round(
                (db_status["Innodb_row_lock_waits"] - old_db["Innodb_row_lock_waits"]) / span, 2
            )
        retried = total(samples, "gate_db_retries_total") - total(old, "gate_db_retries_total")
        out["db_retries_per_second"] = round(max(0.0, retried) / span, 2)
        return out


def _status(deal: dict[str, Any], wall: float) -> str:
    if deal.get("paused"):
        return "paused"
    starts = deal["starts_at"]
    ends = deal["ends_at"]
    if starts and parse_iso(starts).replace(tzinfo=UTC).timestamp() > wall:
        return "scheduled"
    if ends and parse_iso(ends).replace(tzinfo=UTC).timestamp() <= wall:
        return "ended"
    if deal["available"] <= 0:
        return "sold out"
    return "live"


def iso_now() -> str:
    return iso(datetime.now(UTC)) or ""
