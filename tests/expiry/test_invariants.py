"""Continuous invariants: breaches, Redis drift and stuck holds become metrics, logs
and alerts against the seeds' thresholds."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis

from gate.base.metrics import METRICS
from gate.base.settings import Settings
from gate.expiry import make_monitor
from gate.expiry.invariant_monitor import Alert, InvariantMonitor, MonitorConfig, ReleaseWindow
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.expiry_support import make_holds, statuses, wait_until
from tests.support import Client, assert_invariants, create_deal, locked_buckets


def sample(name: str, **labels: str) -> float | None:
    return METRICS.registry.get_sample_value(name, labels)


@pytest.fixture
def monitor(local_gate: Gate) -> InvariantMonitor:
    return make_monitor(local_gate, MonitorConfig(interval_seconds=0.1, deals_per_pass=1000))


async def _quiet_report(monitor: InvariantMonitor, deal_id: int) -> dict[str, object]:
    """A check that could compare Redis (nothing in flight)."""
    for _ in range(50):
        report = await monitor.check(deal_id)
        assert report is not None
        if report["redis"]["compared"]:  # type: ignore[index]
            return report
    raise AssertionError("the deal never settled")


async def test_a_healthy_deal_reports_no_breach(client: Client, monitor: InvariantMonitor) -> None:
    deal_id = await create_deal(client, stock=10, buckets=2)
    await make_holds(client, deal_id, 4, user_base=1_200_000)
    ok_before = sample("gate_invariant_checks_total", result="ok") or 0.0
    report = await _quiet_report(monitor, deal_id)
    assert report["inconsistent_units"] == 0
    assert sample("gate_invariant_breaches", deal=str(deal_id)) == 0
    assert sample("gate_redis_drift_units", deal=str(deal_id)) == 0
    assert (sample("gate_invariant_checks_total", result="ok") or 0) > ok_before
    # A whole pass walks every deal, bounded per pass, and sets the ratio gauge.
    assert await monitor.run_once() >= 1
    # The gauge is the pass's ratio over every deal it walked (other tests' deals too,
    # which may be mid-way through their own faults): this deal adds nothing to it.
    assert monitor._books[deal_id].inconsistent_units == 0
    assert sample("gate_inconsistency_ratio") == monitor.ratio()


async def test_a_book_breach_is_exported_logged_and_cleared(
    client: Client,
    db: Database,
    rds: aioredis.Redis,
    monitor: InvariantMonitor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    deal_id = await create_deal(client, stock=10, buckets=2)
    await make_holds(client, deal_id, 2, user_base=1_210_000)
    # "Stock that vanished": a unit held by no order, written past the ledger.
    tamper = (
        "UPDATE deal_buckets SET available = available {} 1, held = held {} 1"
        " WHERE deal_id = %s AND bucket = 0"
    )
    await db.execute(tamper.format("-", "+"), (deal_id,))
    try:
        with caplog.at_level(logging.ERROR, logger="gate.invariants"):
            report = await monitor.check(deal_id)
        assert report is not None
        breaches = report["invariant"]["breaches"]
        assert any("held" in b for b in breaches), breaches
        assert (sample("gate_invariant_breaches", deal=str(deal_id)) or 0) >= 1
        assert report["inconsistent_units"] >= 1
        assert monitor.ratio() > 0
        assert any(f"invariant breach on deal {deal_id}" in r.message for r in caplog.records)
    finally:
        await db.execute(tamper.format("+", "-"), (deal_id,))
    await assert_invariants(db, rds, deal_id)
    report = await _quiet_report(monitor, deal_id)
    assert report["invariant"]["ok"], report["invariant"]
    assert sample("gate_invariant_breaches", deal=str(deal_id)) == 0


async def test_redis_drift_is_measured_in_units(
    client: Client, db: Database, rds: aioredis.Redis, monitor: InvariantMonitor
) -> None:
    deal_id = await create_deal(client, stock=12, buckets=3)
    await make_holds(client, deal_id, 3, user_base=1_220_000)
    keys = deal_keys(deal_id)
    await _quiet_report(monitor, deal_id)
    # Hold the deal's resync lock so that the gate's resync loop cannot repair the
    # drift before the monitor has seen it.
    assert await rds.set(keys.sync_lock, "test", px=60_000)
    try:
        await rds.hincrby(keys.buckets, "1", 3)
        await rds.hincrby(keys.meta, "avail", 3)
        report = await _quiet_report(monitor, deal_id)
        assert sample("gate_redis_drift_units", deal=str(deal_id)) == 3
        # `gate check` lists it; the paging breach gauge does not count it (the books
        # hold, and GateRedisDrift is the alert for this).
        assert any("redis" in b for b in report["invariant"]["breaches"])  # type: ignore[index]
        assert report["redis"]["mismatches"]  # type: ignore[index]
        assert sample("gate_invariant_breaches", deal=str(deal_id)) == 0
        assert report["inconsistent_units"] == 3
    finally:
        await rds.delete(keys.sync_lock)
    await assert_invariants(db, rds, deal_id)
    await _quiet_report(monitor, deal_id)
    assert sample("gate_redis_drift_units", deal=str(deal_id)) == 0


async def test_a_hold_that_is_never_released_fires_the_release_lag_alert(
    client: Client, db: Database, rds: aioredis.Redis, monitor: InvariantMonitor, settings: Settings
) -> None:
    deal_id = await create_deal(client, stock=5, buckets=1)
    orders = await make_holds(client, deal_id, 1, user_base=1_230_000)
    order_id = orders[0]
    # Ten minutes overdue, and its bucket row locked by "someone" so that no sweeper
    # can finish releasing it: the article's hold that is never released.
    async with locked_buckets(settings, deal_id):
        await db.execute(
            "UPDATE orders SET expires_at = NOW(6) - INTERVAL 10 MINUTE WHERE id = %s",
            (order_id,),
        )
        await monitor.run_once()
        assert (sample("gate_expiry_oldest_due_seconds") or 0) >= 599
        assert monitor.release_lag.firing
        assert sample("gate_alert_firing", alert="release_lag") == 1
        report = await monitor.check(deal_id)
        assert report is not None and report["inconsistent_units"] >= 1
        assert (await statuses(db, orders))[order_id] == "PENDING_PAYMENT"
    # Unlocked: a sweeper releases it, and the alert resolves.

    async def released() -> bool:
        return (await statuses(db, orders))[order_id] == "EXPIRED"

    await wait_until(released, 10, "the stuck hold to be released")
    await monitor.run_once()
    assert not monitor.release_lag.firing
    assert sample("gate_alert_firing", alert="release_lag") == 0
    await assert_invariants(db, rds, deal_id)


def test_the_inconsistency_alert_waits_for_its_duration() -> None:
    alert = Alert("test_inconsistency", 0.005, 600)
    assert not alert.update(0.006, now=1000.0)
    assert not alert.update(0.007, now=1599.0)
    assert alert.update(0.006, now=1600.0)
    assert alert.fired_total == 1
    assert not alert.update(0.001, now=1601.0)  # back under: resolved at once
    assert not alert.update(0.006, now=1602.0)  # and the duration starts again
    assert not alert.update(0.006, now=2201.0)
    assert alert.update(0.006, now=2202.0)
    assert alert.fired_total == 2


def test_the_release_window_measures_failures_and_lag() -> None:
    window = ReleaseWindow(600)
    assert window.update(0, released=0, failed=0, lag_sum=0.0) == (0.0, 0.0)
    ratio, lag = window.update(60, released=990, failed=10, lag_sum=990.0)
    assert ratio == pytest.approx(0.01) and lag == pytest.approx(1.0)
    ratio, lag = window.update(300, released=1990, failed=10, lag_sum=2990.0)
    assert ratio == pytest.approx(10 / 2000) and lag == pytest.approx(2990 / 1990)
    # Later, what happened before the window (the failures at 0..60 s) drops out.
    ratio, lag = window.update(700, released=2990, failed=10, lag_sum=3990.0)
    assert ratio == 0.0 and lag == pytest.approx(3000 / 2000)


def test_the_pause_after_each_deal_bounds_the_time_spent_checking() -> None:
    monitor = InvariantMonitor(None, None, MonitorConfig(interval_seconds=10, duty_max=0.05))  # type: ignore[arg-type]
    # A check of 2 s over a large deal: 38 s of pause, 5 % of the time spent checking.
    assert monitor.pause_seconds(2.0) == pytest.approx(38.0)
    assert 2.0 / (2.0 + monitor.pause_seconds(2.0)) == pytest.approx(0.05)
    assert monitor.pause_seconds(0.0) == 0.0


async def test_a_pass_rests_after_each_deal_not_after_all_of_them(
    local_gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run` paces deal by deal: each check (here 2 s of a made-up clock) is followed
    by its own pause, so no burst of checks is longer than one deal's; then the rest
    of the interval. The lease is asked before each deal, covering the pause that
    follows the last."""
    import asyncio

    now = [0.0]
    monitor = make_monitor(
        local_gate, MonitorConfig(interval_seconds=10, deals_per_pass=3, duty_max=0.2)
    )
    monitor.clock = lambda: now[0]
    stop = asyncio.Event()
    events: list[tuple[str, float]] = []

    async def check(deal_id: int) -> None:
        events.append(("check", now[0]))
        now[0] += 2.0

    async def rest(_: asyncio.Event, seconds: float) -> None:
        events.append(("rest", seconds))
        now[0] += seconds
        if len([e for e in events if e[0] == "check"]) >= 3:
            stop.set()

    class Lease:
        def __init__(self) -> None:
            self.covers: list[float] = []

        async def held(self, cover_seconds: float = 0.0) -> bool:
            self.covers.append(cover_seconds)
            return True

        async def release(self) -> None:
            pass

    async def deals() -> list[int]:
        return [1, 2, 3]

    monkeypatch.setattr(monitor, "check", check)
    monkeypatch.setattr(monitor, "rest", rest)
    monkeypatch.setattr(monitor, "_next_deals", deals)
    lease = Lease()
    monitor.work_lease = lease  # type: ignore[assignment]
    await asyncio.wait_for(monitor.run(stop), 10)
    # 2 s of checking, 8 s of rest (20 % duty), deal after deal.
    assert events == [
        ("check", 0.0),
        ("rest", pytest.approx(8.0)),
        ("check", 10.0),
        ("rest", pytest.approx(8.0)),
        ("check", 20.0),
        ("rest", pytest.approx(8.0)),
    ]
    # Once for the pass, then before each deal: the interval, then the last pause.
    assert lease.covers == [10, 10, pytest.approx(10.0), pytest.approx(10.0)]
