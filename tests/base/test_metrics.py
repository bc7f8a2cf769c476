"""Metrics: the agreed names, the registration helpers, multi-process collection, and
series that move with real traffic on a two-worker gate."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge, Histogram

from gate.base import metrics as gm
from gate.base.metrics import AGREED_NAMES, METRICS, value_of
from tests.ops_support import (
    FreshConnectionClient,
    Samples,
    multiprocess_env,
    per_process_values,
    scrape,
    scrape_until,
)
from tests.support import ADMIN, Client, GateProcess, create_deal, reserve, running_gate

RESERVE_ROUTE = "/v1/deals/{deal_id}/reservations"


# -- in-process ------------------------------------------------------------------------


def test_core_and_ops_metrics_carry_the_agreed_names() -> None:
    names = set(METRICS.names())
    for area in ("core", "ops"):
        missing = set(AGREED_NAMES[area]) - names
        assert not missing, f"{area} metrics not defined: {missing}"
    # The attribute names other modules record through keep working.
    for attr in (
        "reservations",
        "reservation_latency",
        "compensations",
        "janitor_resolved",
        "resync",
        "db_retries",
        "unknown_outcomes",
    ):
        assert hasattr(METRICS, attr)


def test_helpers_are_idempotent_and_strict() -> None:
    c1 = METRICS.counter("gate_test_helper_total", "A test counter.", ["kind"])
    c2 = METRICS.counter("gate_test_helper_total", "A test counter.", ["kind"])
    assert c1 is c2 and isinstance(c1, Counter)
    g = METRICS.gauge("gate_test_helper_gauge", "A test gauge.", kind="per_process")
    assert g is METRICS.gauge("gate_test_helper_gauge", "A test gauge.", kind="per_process")
    assert isinstance(g, Gauge)
    h = METRICS.histogram("gate_test_helper_seconds", "A test histogram.")
    assert isinstance(h, Histogram)
    with pytest.raises(ValueError, match="another type or labels"):
        METRICS.counter("gate_test_helper_total", "Other labels.", ["other"])
    with pytest.raises(ValueError, match="another type or labels"):
        METRICS.gauge("gate_test_helper_total", "Other type.", ["kind"])
    with pytest.raises(ValueError, match="must end in _total"):
        METRICS.counter("gate_test_helper_count", "No suffix.")
    with pytest.raises(ValueError, match="must match"):
        METRICS.counter("Gate-Bad_total", "Bad name.")
    c1.labels("x").inc(3)
    text = METRICS.render().decode()
    assert 'gate_test_helper_total{kind="x"} 3.0' in text
    # A module registering straight on the registry still shows up in the scrape.
    direct = Counter("gate_test_direct_total", "Registered directly.", registry=METRICS.registry)
    direct.inc()
    assert "gate_test_direct_total 1.0" in METRICS.render().decode()


def test_one_worker_keeps_the_in_process_registry() -> None:
    env: dict[str, str] = {}
    assert gm.prepare_multiprocess(1, env) is None
    assert env == {}


def test_prepare_multiprocess_clears_files_of_a_previous_run(tmp_path: Path) -> None:
    stale = tmp_path / "counter_999999.db"
    stale.write_bytes(b"\0" * 16)
    keep = tmp_path / "notes.txt"
    keep.write_text("not a metric file")
    env = {gm.METRICS_DIR_ENV: str(tmp_path)}
    assert gm.prepare_multiprocess(4, env) == str(tmp_path)
    assert env[gm.MULTIPROC_ENV] == str(tmp_path)
    assert not stale.exists() and keep.exists()
    # Without a configured directory a fresh one is made.
    fresh: dict[str, str] = {}
    path = gm.prepare_multiprocess(2, fresh)
    assert path is not None and os.path.isdir(path) and os.listdir(path) == []
    assert fresh[gm.MULTIPROC_ENV] == path
    os.rmdir(path)


def test_live_gauges_of_ended_workers_are_dropped(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    dead_pid = child.pid
    files = {
        "dead_live": tmp_path / f"gauge_livesum_{dead_pid}.db",
        "dead_counter": tmp_path / f"counter_{dead_pid}.db",
        "alive_live": tmp_path / f"gauge_livemax_{os.getpid()}.db",
    }
    for f in files.values():
        f.write_bytes(b"\0" * 16)
    assert gm.forget_dead_processes(str(tmp_path)) == [dead_pid]
    assert not files["dead_live"].exists()
    # A dead worker's counts stay part of the totals; a live worker's gauges stay.
    assert files["dead_counter"].exists() and files["alive_live"].exists()


# -- a real gate with two workers --------------------------------------------------------


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate-metrics")


@pytest.fixture(scope="module")
def mp_gate(env: dict[str, str], prepared: None, metrics_dir: Path) -> Iterator[GateProcess]:
    with running_gate(multiprocess_env(env, metrics_dir, workers=2), workers=2) as proc:
        yield proc


@pytest.fixture
async def mp_client(mp_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(mp_gate.url) as c:
        yield c


async def test_sold_out_rejections_are_counted_across_workers(
    mp_client: Client, metrics_dir: Path
) -> None:
    deal_id = await create_deal(mp_client, stock=1)
    first = await reserve(mp_client, deal_id, 7_100_000, "metrics-first-0001")
    assert first.status_code == 201, first.text

    # Losers on fresh connections, in rounds, until both workers have answered some
    # (the kernel decides which worker accepts a connection).
    rejected = 0
    fresh = FreshConnectionClient(mp_client.base_url)
    try:
        for round_no in range(10):
            responses = await asyncio.gather(
                *(
                    reserve(
                        fresh,
                        deal_id,
                        7_100_001 + round_no * 1000 + i,
                        f"metrics-loser-{round_no}-{i:04d}",
                    )
                    for i in range(40)
                )
            )
            assert all(r.status_code == 409 for r in responses), [r.text for r in responses][:3]
            assert all(r.json()["code"] == "SOLD_OUT" for r in responses)
            rejected += len(responses)
            by_pid = per_process_values(metrics_dir, "gate_reservations_total", outcome="SOLD_OUT")
            if sum(1 for v in by_pid.values() if v > 0) >= 2:
                break
    finally:
        await fresh.close()
    # Each worker adds its tallies to its file every TALLY_FLUSH_SECONDS.
    for _ in range(50):
        by_pid = per_process_values(metrics_dir, "gate_reservations_total", outcome="SOLD_OUT")
        if sum(by_pid.values()) == rejected:
            break
        await asyncio.sleep(gm.TALLY_FLUSH_SECONDS)
    assert sum(1 for v in by_pid.values() if v > 0) >= 2, by_pid
    assert sum(by_pid.values()) == rejected

    # One scrape of the metrics listener (the supervising parent) reports the whole
    # server: every worker's files merged.
    for _ in range(6):
        samples = await scrape(mp_client)
        assert value_of(samples, "gate_reservations_total", outcome="SOLD_OUT") == rejected
        assert value_of(samples, "gate_reservations_total", outcome="created") == 1
        assert (
            value_of(
                samples,
                "gate_http_requests_total",
                route=RESERVE_ROUTE,
                method="POST",
                status="409",
            )
            == rejected
        )
        assert value_of(samples, "gate_http_requests_total", route=RESERVE_ROUTE, status="201") == 1
        assert (
            value_of(samples, "gate_http_request_seconds_count", route=RESERVE_ROUTE)
            == rejected + 1
        )
        assert value_of(samples, "gate_reservation_latency_seconds_count") == rejected + 1


async def test_routes_are_labelled_by_template_never_by_raw_path(mp_client: Client) -> None:
    deal_id = await create_deal(mp_client, stock=3)
    assert (await mp_client.get(f"/v1/deals/{deal_id}")).status_code == 200
    assert (await mp_client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).status_code == 200
    assert (await mp_client.get("/v1/orders/01JD3W9K2XG5W7Q8M4Z6V1R0TB")).status_code == 401
    assert (await mp_client.get(f"/no/such/path/{deal_id}")).status_code == 404
    assert (await mp_client.request("DELETE", f"/v1/deals/{deal_id}")).status_code == 405

    def deleted(samples: Samples) -> bool:
        return (
            value_of(
                samples,
                "gate_http_requests_total",
                route="/v1/deals/{deal_id}",
                method="DELETE",
                status="405",
            )
            == 1
        )

    samples = await scrape_until(mp_client, deleted)
    routes = {
        dict(labels)["route"]
        for (name, labels) in samples
        if name in ("gate_http_requests_total", "gate_http_request_seconds_count")
    }
    assert {
        "/v1/deals/{deal_id}",
        "/v1/admin/deals/{deal_id}",
        "/v1/orders/{order_id}",
        "/v1/admin/deals",
        "unmatched",
    } <= routes
    assert not [r for r in routes if any(ch.isdigit() for ch in r.replace("v1", ""))], routes
    assert value_of(samples, "gate_http_requests_total", route="unmatched", status="404") >= 1
    assert (
        value_of(
            samples,
            "gate_http_requests_total",
            route="/v1/deals/{deal_id}",
            method="DELETE",
            status="405",
        )
        == 1
    )
    # Each worker samples its pool; the scrape sums the live workers.
    assert ("gate_db_pool_in_use", frozenset()) in samples
    assert ("gate_db_pool_waiting", frozenset()) in samples


async def test_a_successful_reservation_counts_once(mp_client: Client) -> None:
    before = await scrape(mp_client)
    deal_id = await create_deal(mp_client, stock=2)
    assert (await reserve(mp_client, deal_id, 7_300_001, "metrics-once-0001")).status_code == 201

    def delta(outcome: str, after: Samples) -> float:
        return value_of(after, "gate_reservations_total", outcome=outcome) - value_of(
            before, "gate_reservations_total", outcome=outcome
        )

    after = await scrape_until(mp_client, lambda s: delta("created", s) >= 1)

    assert delta("created", after) == 1
    assert delta("ERROR", after) == 0


# -- tallies ---------------------------------------------------------------------------


def test_tallies_add_up_to_what_the_metrics_would_have_counted() -> None:
    """A tally flushed gives the same samples as the metric recorded directly: the
    bucket of each observation (bounds included), the sum, the count."""
    registry = gm.CollectorRegistry()
    direct = Histogram("h_direct", "d", ["r"], registry=registry, buckets=(0.1, 1.0))
    tallied = Histogram("h_tallied", "d", ["r"], registry=registry, buckets=(0.1, 1.0))
    counted = Counter("c_tallied", "d", ["r"], registry=registry)
    metrics = gm.Metrics()
    h = metrics.histogram_tally(tallied.labels("x"))
    c = metrics.counter_tally(counted.labels("x"))
    for value in (0.0, 0.05, 0.1, 0.5, 1.0, 2.0, 7.5):
        direct.labels("x").observe(value)
        h.observe(value)
        c.inc()
    # Nothing reaches the metric before a flush.
    assert registry.get_sample_value("c_tallied_total", {"r": "x"}) == 0.0
    metrics.flush()
    for le in ("0.1", "1.0", "+Inf"):
        labels = {"r": "x", "le": le}
        assert registry.get_sample_value("h_tallied_bucket", labels) == (
            registry.get_sample_value("h_direct_bucket", labels)
        )
    assert registry.get_sample_value("h_tallied_sum", {"r": "x"}) == pytest.approx(
        registry.get_sample_value("h_direct_sum", {"r": "x"})
    )
    assert registry.get_sample_value("c_tallied_total", {"r": "x"}) == 7.0
    metrics.flush()  # a second flush adds nothing
    assert registry.get_sample_value("c_tallied_total", {"r": "x"}) == 7.0


def test_reading_the_registry_adds_the_tallies_first() -> None:
    """The gate's own registry flushes its tallies on every collection."""
    series = METRICS.reservations.labels("tally-probe")
    tally = METRICS.counter_tally(series)
    before = METRICS.registry.get_sample_value(
        "gate_reservations_total", {"outcome": "tally-probe"}
    )
    tally.inc()
    tally.inc()
    after = METRICS.registry.get_sample_value("gate_reservations_total", {"outcome": "tally-probe"})
    assert after == (before or 0.0) + 2
