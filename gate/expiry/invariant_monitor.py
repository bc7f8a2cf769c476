"""Continuous invariants: the checks of `gate check`, run periodically inside the gate.

Each pass checks a bounded number of deals (`check.check_deal`, one consistent
database snapshot each, Redis compared when nothing is in flight), cycling through
every deal over successive passes, and exports what it found:

  gate_invariant_breaches{deal}    breaches in the deal's latest check (0: all hold)
  gate_invariant_checks_total      checks by result (ok, breach, error)
  gate_redis_drift_units{deal}     units Redis and the database disagree about, summed
                                   over buckets, when they could be compared
  gate_inconsistency_ratio         inconsistent units / total stock over the deals
                                   checked (see below)
  gate_release_failure_ratio       failed / attempted hold releases of this process's
                                   sweeper over the alert window
  gate_expiry_oldest_due_seconds   age of the oldest hold past its deadline and still
                                   holding stock (0: none)
  gate_alert_firing{alert}         1 while an alert of the seeds' table fires

The seeds' alert table (article 003) maps onto them:
  inconsistency rate > 0.5 % for 10 min  ->  gate_inconsistency_ratio
  release failure rate > 1 %             ->  gate_release_failure_ratio
  release lag > 5 min                    ->  the larger of the window's average lag
                                             and gate_expiry_oldest_due_seconds

"Inconsistent units" of a deal: units the books disagree about (bucket held/sold
against the orders), units Redis disagrees with the database about, and units still
held by holds whose deadline passed longer ago than the release-lag threshold (stock
that has "vanished" in the article's sense: neither sellable nor sold).

A deal whose books are broken is paused (GATE_PAUSE_ON_BREACH, on by default;
gate/inventory/pause.py): a breach of the books (counters against the orders, ghost
holds included, sold above total, a ledger that does not add up), or Redis still
disagreeing with the database after this monitor had the drift repaired
(Mirror.resync) and checked again:

    check(deal) ── breaches of the books ──────────────────────────> pause(deal, why)
              └─ Redis drift only ── resync, check again ── drift ──> pause(deal, why)

The pause lands in Redis at once, so every gate process refuses the deal's next
reservation (503 SALE_PAUSED); `PauseWatch` re-reads the paused deals on every
process each interval (gate_deal_paused).

The checks are read-only, so any number of processes may run the monitor; each
exports what it saw itself. With background leases (gate/store/work_lease.py, on by
default) one process at a time checks the deals; every process still evaluates its
own sweeper's failure ratio and lag each interval (`evaluate_sweeper`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gate.base.drain import yield_to_sweeper
from gate.base.metrics import METRICS
from gate.expiry.sweeper import STATS
from gate.inventory.check import check_deal
from gate.inventory.mirror import Mirror
from gate.inventory.pause import PauseWatch, breach_reason, pause
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.store.work_lease import WorkLease

log = logging.getLogger("gate.invariants")

# At most this many deals keep a per-deal entry for the ratio; beyond it the oldest
# entries are forgotten (a flash-sale gate runs few deals at a time).
TRACKED_DEALS_MAX = 100_000
LOGGED_BREACHES_MAX = 5
# The resync lock the monitor takes to repair a drift itself (gate/inventory/resync.py).
REPAIR_LOCK_MS = 5_000

BREACHES = METRICS.gauge(
    "gate_invariant_breaches",
    "Invariant breaches found by the latest check of a deal (0: every invariant holds).",
    ["deal"],
    kind="state",
)
CHECKS = METRICS.counter(
    "gate_invariant_checks_total",
    "Continuous invariant checks of one deal, by result (ok, breach, error).",
    ["result"],
)
DRIFT = METRICS.gauge(
    "gate_redis_drift_units",
    "Units Redis and the database disagree about, summed over a deal's buckets, as of"
    " the latest check that could compare them.",
    ["deal"],
    kind="state",
)
INCONSISTENCY = METRICS.gauge(
    "gate_inconsistency_ratio",
    "Inconsistent units (book mismatches, Redis drift, holds stuck past the lag"
    " threshold) over total stock, across the deals checked.",
    kind="state",
)
FAILURE_RATIO = METRICS.gauge(
    "gate_release_failure_ratio",
    "Failed over attempted hold releases by this process's sweeper in the alert window.",
    kind="flag",
)
OLDEST_DUE = METRICS.gauge(
    "gate_expiry_oldest_due_seconds",
    "Age of the oldest hold whose deadline has passed and that still holds stock.",
    kind="state",
)
ALERTS = METRICS.gauge(
    "gate_alert_firing",
    "1 while an alert of the seeds' threshold table fires in this process.",
    ["alert"],
    kind="flag",
)


@dataclass(frozen=True)
class MonitorConfig:
    interval_seconds: float = 10.0
    deals_per_pass: int = 20
    # At most this share of the time is spent checking: a check reads every order and
    # ledger row of its deal, so the pause after each deal's check grows with what the
    # check took.
    duty_max: float = 0.05
    inconsistency_ratio_max: float = 0.005
    inconsistency_for_seconds: float = 600.0
    release_failure_ratio_max: float = 0.01
    release_failure_window_seconds: float = 600.0
    release_lag_max_seconds: float = 300.0
    # Pause a deal whose books the check finds broken (GATE_PAUSE_ON_BREACH).
    pause_on_breach: bool = True


class Alert:
    """A threshold that fires once its value has stayed above it for `for_seconds`."""

    def __init__(self, name: str, threshold: float, for_seconds: float) -> None:
        self.name = name
        self.threshold = threshold
        self.for_seconds = for_seconds
        self.since: float | None = None
        self.firing = False
        self.fired_total = 0
        ALERTS.labels(name).set(0)

    def update(self, value: float, now: float) -> bool:
        if value > self.threshold:
            if self.since is None:
                self.since = now
            firing = now - self.since >= self.for_seconds
        else:
            self.since = None
            firing = False
        if firing and not self.firing:
            self.fired_total += 1
            log.error(
                "alert %s firing: %.6g > %.6g for %ds",
                self.name,
                value,
                self.threshold,
                int(self.for_seconds),
                extra={"alert": self.name, "value": value, "threshold": self.threshold},
            )
        elif self.firing and not firing:
            log.warning("alert %s resolved: %.6g", self.name, value, extra={"alert": self.name})
        self.firing = firing
        ALERTS.labels(self.name).set(1 if firing else 0)
        return firing


class ReleaseWindow:
    """The sweeper's totals sampled over a sliding window."""

    def __init__(self, window_seconds: float) -> None:
        self.window_seconds = window_seconds
        self.samples: deque[tuple[float, int, int, float]] = deque()

    def update(self, now: float, released: int, failed: int, lag_sum: float) -> tuple[float, float]:
        """Returns (failure ratio, average lag in seconds) over the window."""
        self.samples.append((now, released, failed, lag_sum))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window_seconds:
            self.samples.popleft()
        _, r0, f0, l0 = self.samples[0]
        released_d, failed_d = released - r0, failed - f0
        attempts = released_d + failed_d
        ratio = failed_d / attempts if attempts else 0.0
        lag = (lag_sum - l0) / released_d if released_d else 0.0
        return ratio, lag


@dataclass
class DealBooks:
    inconsistent_units: int
    total_units: int
    breaches: tuple[str, ...]


def inconsistent_units(report: dict[str, Any]) -> tuple[int, int, int | None]:
    """(book mismatch units, total stock, Redis drift units or None if not compared)."""
    totals = report.get("totals")
    if totals is None:
        return 0, 0, None
    orders = report["orders"]
    book = abs(totals["held"] - orders["held"]) + abs(totals["sold"] - orders["sold"])
    drift: int | None = None
    redis = report["redis"]
    if redis.get("compared"):
        drift = sum(
            abs(int(b.get("redis_available") or 0) - int(b["available"]))
            for b in report["bucket_rows"]
        )
    elif not redis.get("loaded"):
        drift = 0  # nothing in Redis to disagree: the next request loads it exactly
    return book, int(totals["total"]), drift


class InvariantMonitor:
    def __init__(
        self,
        db: Database,
        client: aioredis.Redis | None,
        config: MonitorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        mirror: Mirror | None = None,
    ) -> None:
        self.db = db
        self.redis = client
        self.config = config
        self.clock = clock
        # With the mirror: drift repaired before it counts, broken deals paused, and
        # the paused deals' flags kept (`PauseWatch`).
        self.mirror = mirror
        self.watch = PauseWatch(db, mirror) if mirror is not None else None
        self._cursor = 0
        self._books: dict[int, DealBooks] = {}
        self._drift: dict[int, int] = {}
        self._window = ReleaseWindow(config.release_failure_window_seconds)
        self.inconsistency = Alert(
            "inconsistency", config.inconsistency_ratio_max, config.inconsistency_for_seconds
        )
        self.release_failures = Alert("release_failure", config.release_failure_ratio_max, 0)
        self.release_lag = Alert("release_lag", config.release_lag_max_seconds, 0)
        # Set by the gate: the pass runs only while this process holds the lease.
        self.work_lease: WorkLease | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Passes at most `interval_seconds` apart, each deal's check followed by a
        pause that keeps the time spent checking at `duty_max` (`pause_seconds`).

            pass: deal ─ pause ─ deal ─ pause ─ … ─ alerts    (then the interval's rest)

        A check reads every order and ledger row of its deal; back to back over a
        large database the checks held a MariaDB core for seconds at a time, in the
        middle of a sale. Paced deal by deal,
        no burst is longer than one deal's check."""
        while not stop.is_set():
            started = self.clock()
            if self.watch is not None:
                try:
                    await self.watch.run_once()
                except Exception as exc:
                    log.warning("paused deals not read: %r", exc)
            try:
                if not await self.run_paced(stop):
                    # The deals are checked by the lease's holder; this process's
                    # sweeper is seen by this process only.
                    self.evaluate_sweeper()
            except Exception as exc:
                log.warning("invariant pass failed: %r", exc)
            rest = self.config.interval_seconds - (self.clock() - started)
            if rest > 0:
                await self.rest(stop, rest)
        # Stopping: the next process to ask takes the work at once (gate/store/work_lease.py).
        if self.work_lease is not None:
            await self.work_lease.release()

    async def rest(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait `seconds`, or until the loop stops."""
        try:
            await asyncio.wait_for(stop.wait(), seconds)
        except TimeoutError:
            pass

    def pause_seconds(self, spent_seconds: float) -> float:
        """The pause after a deal's check that took `spent_seconds`: so long that
        checking takes at most `duty_max` of the time (and of a database connection)."""
        duty = self.config.duty_max
        return spent_seconds * (1.0 - duty) / duty

    async def run_paced(self, stop: asyncio.Event) -> bool:
        """One pass of `run`: the next deals, each checked while this process holds
        the lease (asked again before each, to cover the pause that follows the
        last), then the alerts. False when another process holds the lease."""
        lease = self.work_lease
        cover = self.config.interval_seconds
        if lease is not None and not await lease.held(cover):
            return False
        for deal_id in await self._next_deals():
            if stop.is_set():
                break
            # Not while this process's sweeper drains a backlog (gate/base/drain.py): a
            # check holds a snapshot open.
            await yield_to_sweeper(stop)
            if lease is not None and not await lease.held(cover):
                break
            started = self.clock()
            await self.check(deal_id)
            pause = self.pause_seconds(self.clock() - started)
            cover = max(self.config.interval_seconds, pause)
            await self.rest(stop, pause)
        await self.evaluate()
        return True

    async def _next_deals(self) -> list[int]:
        """The next `deals_per_pass` deals after the last pass's, from the start again
        once every deal was checked."""
        limit = self.config.deals_per_pass
        rows = await self.db.fetchall(
            "SELECT id FROM deals WHERE id > %s ORDER BY id LIMIT %s", (self._cursor, limit)
        )
        ids = [int(r[0]) for r in rows]
        self._cursor = ids[-1] if len(ids) == limit else 0
        return ids

    async def run_once(self) -> int:
        """Check the next `deals_per_pass` deals, back to back, and evaluate the
        alerts; returns how many deals were checked (`gate check`, the tests)."""
        ids = await self._next_deals()
        for deal_id in ids:
            await self.check(deal_id)
        await self.evaluate()
        return len(ids)

    async def check(self, deal_id: int) -> dict[str, Any] | None:
        """Check one deal, export and log what was found. None: the check failed."""
        try:
            # The database's time before the check: a resume after it wins over what
            # this check sees (gate/inventory/pause.py).
            seen_at = await self._db_now() if self._pausing() else None
            report = await check_deal(self.db, self.redis, deal_id)
            stuck = await self._stuck_units(deal_id)
        except Exception as exc:
            CHECKS.labels("error").inc()
            log.warning("invariant check of deal %s failed: %r", deal_id, exc)
            return None
        # Redis drift is not a breach of the books: it has its own gauge and alert
        # (GateRedisDrift) and the resync loop repairs it.
        drifted = set(report.get("redis", {}).get("mismatches", ()))
        breaches = tuple(b for b in report["invariant"]["breaches"] if b not in drifted)
        await self._pause_if_broken(deal_id, breaches, bool(drifted), seen_at)
        book, total, drift = inconsistent_units(report)
        if drift is not None:
            self._drift[deal_id] = drift
            DRIFT.labels(str(deal_id)).set(drift)
        units = book + stuck + self._drift.get(deal_id, 0)
        CHECKS.labels("ok" if not breaches else "breach").inc()
        BREACHES.labels(str(deal_id)).set(len(breaches))
        previous = self._books.get(deal_id)
        if breaches and (previous is None or previous.breaches != breaches):
            log.error(
                "invariant breach on deal %s: %s",
                deal_id,
                "; ".join(breaches[:LOGGED_BREACHES_MAX]),
                extra={"deal_id": deal_id, "breaches": len(breaches)},
            )
        elif not breaches and previous is not None and previous.breaches:
            log.warning("invariants hold again on deal %s", deal_id, extra={"deal_id": deal_id})
        if stuck:
            log.warning(
                "deal %s: %d unit(s) held by holds overdue by more than %ds",
                deal_id,
                stuck,
                int(self.config.release_lag_max_seconds),
                extra={"deal_id": deal_id},
            )
        if deal_id not in self._books and len(self._books) >= TRACKED_DEALS_MAX:
            self._books.pop(next(iter(self._books)))
        self._books[deal_id] = DealBooks(units, total, breaches)
        report["inconsistent_units"] = units
        return report

    def _pausing(self) -> bool:
        return self.mirror is not None and self.config.pause_on_breach

    async def _db_now(self) -> Any:
        row = await self.db.fetchone("SELECT NOW(6)")
        return row[0] if row else None

    async def _pause_if_broken(
        self, deal_id: int, breaches: tuple[str, ...], drift: bool, seen_at: Any
    ) -> None:
        """Pause the deal when its books are broken, or when Redis still disagrees
        with the database once the drift was repaired and the deal checked again."""
        if self.mirror is None or not self.config.pause_on_breach:
            return
        why = breaches
        if not why and drift:
            why = await self._drift_after_repair(deal_id)
        if not why:
            return
        try:
            await pause(
                self.db,
                self.mirror,
                deal_id,
                reason=breach_reason(why),
                actor="invariant-monitor",
                seen_at=seen_at,
            )
        except Exception as exc:
            log.error("deal %s: books broken, but not paused: %r", deal_id, exc)

    async def _drift_after_repair(self, deal_id: int) -> tuple[str, ...]:
        """The drift repaired as the resync loop would (under its per-deal lock: a
        pass holding it is repairing already, and the next check decides), then the
        deal checked again: the mismatches that remain."""
        assert self.mirror is not None and self.redis is not None
        lock = deal_keys(deal_id).sync_lock
        if not await self.redis.set(lock, "monitor", nx=True, px=REPAIR_LOCK_MS):
            return ()
        try:
            await self.mirror.resync(deal_id)
            again = await check_deal(self.db, self.redis, deal_id)
        except Exception as exc:
            log.warning("deal %s: drift not repaired: %r", deal_id, exc)
            return ()
        finally:
            await self.redis.delete(lock)
        return tuple(f"after a resync, {m}" for m in again.get("redis", {}).get("mismatches", ()))

    async def _stuck_units(self, deal_id: int) -> int:
        row = await self.db.fetchone(
            "SELECT COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s"
            " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED')"
            " AND expires_at <= NOW(6) - INTERVAL %s MICROSECOND",
            (deal_id, int(self.config.release_lag_max_seconds * 1_000_000)),
        )
        return int(row[0]) if row else 0

    async def oldest_due_seconds(self) -> float:
        oldest = 0.0
        for status in ("PENDING_PAYMENT", "AUTHORIZED"):
            # One index range per status: MIN over (status, expires_at) reads one entry.
            row = await self.db.fetchone(
                "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(expires_at), NOW(6)) FROM orders"
                " WHERE status = %s AND expires_at <= NOW(6)",
                (status,),
            )
            if row and row[0] is not None:
                oldest = max(oldest, int(row[0]) / 1_000_000)
        return oldest

    def ratio(self) -> float:
        total = sum(b.total_units for b in self._books.values())
        bad = sum(b.inconsistent_units for b in self._books.values())
        return bad / total if total else 0.0

    async def evaluate(self) -> None:
        """Every alert: the deals this monitor checked, and this process's sweeper."""
        now = self.clock()
        ratio = self.ratio()
        INCONSISTENCY.set(ratio)
        self.inconsistency.update(ratio, now)
        oldest = await self.oldest_due_seconds()
        OLDEST_DUE.set(oldest)
        self.evaluate_sweeper(oldest)

    def evaluate_sweeper(self, oldest_due_seconds: float = 0.0) -> None:
        """This process's sweeper over the window (its release failure ratio and
        average lag; the release-lag alert also takes the oldest due hold when this
        monitor read it). Run by every process, lease or not: STATS are per process,
        so the holder of the invariants lease cannot see another process's failures."""
        now = self.clock()
        failures, avg_lag = self._window.update(now, STATS.released, STATS.failed, STATS.lag_sum)
        FAILURE_RATIO.set(failures)
        self.release_failures.update(failures, now)
        self.release_lag.update(max(oldest_due_seconds, avg_lag), now)
