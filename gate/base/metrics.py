"""Prometheus metrics, defined once; every module records through METRICS.

Several uvicorn workers: prometheus-client's multi-process mode. Each worker writes
its values to memory-mapped files in one directory and a scrape, answered by any
worker, merges every file, so `/metrics` shows the whole server rather than the
share of whichever worker answered. The mode is chosen when prometheus-client is
first imported (from PROMETHEUS_MULTIPROC_DIR), so the `gate serve` parent prepares
the directory with `prepare_multiprocess(workers)` before uvicorn spawns workers;
the workers inherit the variable.

Areas add their own metrics with `METRICS.counter()`, `METRICS.gauge()` and
`METRICS.histogram()`: these register on `METRICS.registry`, return the metric
already registered under that name when called again (a second Gate built in one
process must not fail), and give gauges a multi-process mode that makes sense.
"""

from __future__ import annotations

import atexit
import bisect
import glob
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Literal, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.metrics import MetricWrapperBase

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Where `gate serve` keeps the workers' metric files; a fresh temporary directory
# when unset. Its *.db files are deleted at start-up: they belong to a previous run.
METRICS_DIR_ENV = "GATE_METRICS_DIR"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS_SECONDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Delays measured in seconds to hours: release lag past a deadline, callback delay,
# outbox lag.
DELAY_BUCKETS_SECONDS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)

# The names every area agreed on (see the common brief); dashboards and alert rules
# use exactly these. A metric outside this list is fine, but has no panel or alert.
AGREED_NAMES: dict[str, tuple[str, ...]] = {
    # Queue mode (gate/queuemode/, docs/queue-mode.md).
    "queue": (
        "gate_queue_enqueued_total",
        "gate_queue_committed_total",
        "gate_queue_rejected_total",
        "gate_queue_retries_total",
        "gate_queue_dead_letters_total",
        "gate_queue_depth",
        "gate_queue_oldest_age_seconds",
        "gate_queue_commit_lag_seconds",
        "gate_queue_full_total",
    ),
    # The waiting room (gate/room/, docs/waiting-room.md).
    "room": (
        "gate_room_waiting",
        "gate_room_unspent",
        "gate_room_spent",
        "gate_room_admitted_total",
        "gate_room_lapsed_total",
        "gate_room_wait_seconds",
        "gate_room_retired_total",
    ),
    # The HTTP protocol's own answers (gate/web/edge.py).
    "edge": (
        "gate_edge_requests_total",
        "gate_http_malformed_total",
        "gate_http_upgrades_refused_total",
    ),
    # The database writer among several hosts (gate/store/dbwriter.py).
    "ha": ("gate_db_writer_info", "gate_db_failovers_total", "gate_db_pool_refused_total"),
    "core": (
        "gate_reservations_total",
        "gate_reservation_latency_seconds",
        "gate_compensations_total",
        "gate_janitor_resolved_total",
        "gate_resync_total",
        "gate_db_retries_total",
        "gate_db_unknown_outcomes_total",
        "gate_rate_limited_total",
        "gate_db_pool_in_use",
        "gate_db_pool_waiting",
        "gate_db_transaction_seconds",
        "gate_redis_script_seconds",
        "gate_redis_errors_total",
        "gate_circuit_open",
    ),
    "expiry": (
        "gate_expiry_released_total",
        "gate_expiry_release_failures_total",
        "gate_expiry_release_lag_seconds",
        "gate_expiry_oldest_due_seconds",
        "gate_invariant_breaches",
        "gate_invariant_checks_total",
        "gate_redis_drift_units",
        "gate_inconsistency_ratio",
        "gate_release_failure_ratio",
        "gate_deal_paused",
    ),
    "payments": (
        "gate_callbacks_total",
        "gate_callback_delay_seconds",
        "gate_payment_quarantined_total",
        "gate_refund_backlog",
        "gate_outbox_unpublished",
        "gate_outbox_lag_seconds",
        "gate_reconcile_findings_total",
        "gate_reconcile_runs_total",
        "gate_reconcile_open",
        "gate_reconcile_last_run_timestamp_seconds",
    ),
    "ops": (
        "gate_http_requests_total",
        "gate_http_request_seconds",
        "gate_admin_auth_failures_total",
        "gate_console_signin_failures_total",
    ),
    # Outbound webhooks (gate/webhooks/, docs/webhooks.md).
    "webhooks": (
        "gate_webhook_attempts_total",
        "gate_webhook_attempt_seconds",
        "gate_webhook_deliveries_failed_total",
        "gate_webhook_events_total",
        "gate_webhook_delivery_lag_seconds",
        "gate_webhook_pending",
        "gate_webhook_overdue_seconds",
        "gate_webhook_endpoints_failing",
        "gate_webhook_endpoints_disabled_total",
    ),
}

# How a gauge's per-process values combine in a scrape under several workers:
#   "state"       a fact about the whole system (a backlog, a drift, a ratio) that
#                 any process may observe: the most recent observation wins;
#   "per_process" a quantity each live process holds (its pool): summed over live ones;
#   "flag"        a per-process condition (a circuit open): the maximum over live ones.
GaugeKind = Literal["state", "per_process", "flag"]
_GAUGE_MODES: dict[str, Literal["mostrecent", "livesum", "livemax"]] = {
    "state": "mostrecent",
    "per_process": "livesum",
    "flag": "livemax",
}

# The *_created series double the exposition and no panel or alert reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

_NAME_RE = re.compile(r"gate_[a-z0-9_]+")

M = TypeVar("M", bound=MetricWrapperBase)


def multiprocess_active() -> bool:
    """Whether this process's metric values live in the shared files."""
    return values.ValueClass is not values.MutexValue


def prepare_multiprocess(
    workers: int, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """Prepare the metric files' directory for `workers` uvicorn workers.

    Called by the `gate serve` parent before uvicorn spawns its workers; sets
    PROMETHEUS_MULTIPROC_DIR in `environ` (the process environment by default), which
    the workers inherit. One worker serves in the parent process itself, whose metrics
    may already exist: it keeps the in-process registry and nothing is set.
    Returns the directory, or None when nothing was prepared.
    """
    env = os.environ if environ is None else environ
    if workers <= 1:
        return None
    configured = env.get(METRICS_DIR_ENV) or env.get(MULTIPROC_ENV)
    if configured:
        path = configured
        os.makedirs(path, exist_ok=True)
        # Files of a previous run would add its dead processes to every sum.
        for stale in glob.glob(os.path.join(path, "*.db")):
            os.remove(stale)
    else:
        path = tempfile.mkdtemp(prefix="gate-metrics-")
        if environ is None:
            atexit.register(shutil.rmtree, path, ignore_errors=True)
    env[MULTIPROC_ENV] = path
    return path


def forget_dead_processes(path: str | None = None) -> list[int]:
    """Drop the live-gauge files of processes that no longer run (a worker killed
    and restarted by the supervisor), so their pool sizes and flags leave the sums.
    Counters and histograms of dead processes stay: their totals remain true."""
    path = path or os.environ.get(MULTIPROC_ENV)
    if not path:
        return []
    dead: set[int] = set()
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        pid_text = os.path.basename(name).rsplit("_", 1)[1][:-3]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead.add(pid)
        except PermissionError:
            pass  # alive, owned by someone else
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    return sorted(dead)


def process_stopping() -> None:
    """A worker leaving cleanly adds its last tallies and removes its live gauges
    from the sums."""
    METRICS.flush()
    if multiprocess_active():
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


# How often each process adds its tallies to the metrics (gate/api/ops.py runs the loop):
# under several workers a scrape reads the shared files, so what a worker counted
# shows up at most this late.
TALLY_FLUSH_SECONDS = 0.25


class CounterTally:
    """One counter series' increments kept in a plain int, added to the counter in
    one step by `flush`. For the per-request counters only: prometheus-client takes a
    lock for every increment (and under several workers writes a shared file), which
    costs more than the sold-out answer's own work; a tally costs an addition."""

    __slots__ = ("child", "pending")

    def __init__(self, child: Counter) -> None:
        self.child = child
        self.pending = 0

    def inc(self) -> None:
        self.pending += 1

    def flush(self) -> None:
        pending = self.pending
        if pending:
            self.pending = 0
            self.child.inc(pending)


class HistogramTally:
    """One histogram series' observations kept as per-bucket counts and a sum, added
    to the histogram by `flush` exactly as observe() would have (the value goes to
    the first bucket whose upper bound is at least the value)."""

    __slots__ = ("bounds", "child", "counts", "total")

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.bounds: list[float] = list(child._upper_bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        self.counts = [0] * len(counts)
        total, self.total = self.total, 0.0
        buckets = self.child._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
        self.child._sum.inc(total)


class _FlushFirst:
    """Registered first on the registry: every collection (a scrape, a test reading a
    sample) adds this process's tallies before the metrics are read. Only on the
    main thread, which runs the event loop that writes the tallies (a tally is a
    plain int: a flush from another thread could lose an increment made meanwhile);
    the metrics listener's thread has the loop flush instead (gate/web/metrics_listener.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[object]:
        return []

    def collect(self) -> list[object]:
        if threading.current_thread() is threading.main_thread():
            self.metrics.flush()
        return []


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._by_name: dict[str, MetricWrapperBase] = {}
        self._tallies: list[CounterTally | HistogramTally] = []
        self.registry.register(_FlushFirst(self))  # type: ignore[arg-type]

        # -- reservation path (core) -------------------------------------------------
        self.reservations = self.counter(
            "gate_reservations_total",
            "Reservation attempts by outcome (created, replayed, or the problem code).",
            ["outcome"],
        )
        self.reservation_latency = self.histogram(
            "gate_reservation_latency_seconds",
            "Reservation request latency, admission to answer.",
        )
        self.compensations = self.counter(
            "gate_compensations_total",
            "Redis decrements given back after the database did not take them.",
        )
        self.janitor_resolved = self.counter(
            "gate_janitor_resolved_total",
            "Orphaned in-flight tokens resolved by the janitor.",
            ["action"],
        )
        self.resync = self.counter(
            "gate_resync_total", "Resync passes per deal by result.", ["result"]
        )
        self.db_retries = self.counter(
            "gate_db_retries_total",
            "Transactions retried after a deadlock or lock-wait timeout.",
            ["errno"],
        )
        self.unknown_outcomes = self.counter(
            "gate_db_unknown_outcomes_total",
            "Reservations whose commit outcome had to be resolved by lookup.",
            ["resolution"],
        )
        # The rest of the core's agreed metrics, defined here so that the core's
        # modules only record (see docs/operations.md for where each is fed).
        self.rate_limited = self.counter(
            "gate_rate_limited_total", "Requests refused by a rate limit, by scope.", ["scope"]
        )
        self.db_pool_in_use = self.gauge(
            "gate_db_pool_in_use",
            "Database connections checked out of the pool (or being opened).",
            kind="per_process",
        )
        self.db_pool_waiting = self.gauge(
            "gate_db_pool_waiting",
            "Tasks waiting for a database connection.",
            kind="per_process",
        )
        self.db_transaction_seconds = self.histogram(
            "gate_db_transaction_seconds",
            "Duration of the gate's database transactions, from start to commit or rollback.",
        )
        self.redis_script_seconds = self.histogram(
            "gate_redis_script_seconds", "Redis script call duration.", ["script"]
        )
        self.redis_errors = self.counter(
            "gate_redis_errors_total", "Redis calls that failed, by kind.", ["kind"]
        )
        self.circuit_open = self.gauge(
            "gate_circuit_open",
            "1 while the circuit breaker in front of a dependency is open.",
            ["dependency"],
            kind="flag",
        )

        # -- HTTP (ops) ----------------------------------------------------------------
        self.http_requests = self.counter(
            "gate_http_requests_total",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
        )
        self.http_request_seconds = self.histogram(
            "gate_http_request_seconds",
            "HTTP request duration by route template, first byte in to last byte out.",
            ["route"],
        )

    # -- registration helpers, for every area --------------------------------------

    def _existing(self, name: str, kind: type[M], labels: Sequence[str]) -> M | None:
        found = self._by_name.get(name)
        if found is None:
            return None
        if not isinstance(found, kind) or tuple(found._labelnames) != tuple(labels):
            raise ValueError(f"metric {name} is already registered with another type or labels")
        return found

    def _check_name(self, name: str, suffix: str | None = None) -> None:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"metric name {name!r} must match {_NAME_RE.pattern}")
        if suffix and not name.endswith(suffix):
            raise ValueError(f"counter {name!r} must end in {suffix}")

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """A counter on the registry (the one already registered under `name`, if any)."""
        found = self._existing(name, Counter, labels)
        if found is not None:
            return found
        self._check_name(name, "_total")
        metric = Counter(name, doc, list(labels), registry=self.registry)
        self._by_name[name] = metric
        return metric

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS_SECONDS,
    ) -> Histogram:
        found = self._existing(name, Histogram, labels)
        if found is not None:
            return found
        self._check_name(name)
        metric = Histogram(name, doc, list(labels), buckets=tuple(buckets), registry=self.registry)
        self._by_name[name] = metric
        return metric

    def gauge(
        self, name: str, doc: str, labels: Sequence[str] = (), *, kind: GaugeKind = "state"
    ) -> Gauge:
        """A gauge; `kind` says how several workers' values combine (see GaugeKind)."""
        found = self._existing(name, Gauge, labels)
        if found is not None:
            return found
        self._check_name(name)
        metric = Gauge(
            name,
            doc,
            list(labels),
            registry=self.registry,
            multiprocess_mode=_GAUGE_MODES[kind],
        )
        self._by_name[name] = metric
        return metric

    # -- tallies: cheap recording for the per-request series -------------------------

    def counter_tally(self, child: Counter) -> CounterTally:
        """A tally of one labelled counter series; keep it (one per series)."""
        tally = CounterTally(child)
        self._tallies.append(tally)
        return tally

    def histogram_tally(self, child: Histogram) -> HistogramTally:
        """A tally of one labelled histogram series; keep it (one per series)."""
        tally = HistogramTally(child)
        self._tallies.append(tally)
        return tally

    def flush(self) -> None:
        """Add every tally to its metric (the ops loop calls this every
        TALLY_FLUSH_SECONDS; a collection and the exposition call it too)."""
        for tally in self._tallies:
            tally.flush()

    def names(self) -> list[str]:
        """The full names of every metric defined through the helpers."""
        return sorted(self._by_name)

    # -- exposition ------------------------------------------------------------------

    def render(self, *, flush: bool = True) -> bytes:
        """The text exposition: this process's registry, or with several workers the
        merge of every worker's files. `flush=False` off the event loop's thread
        (the tallies are that thread's)."""
        if flush:
            self.flush()
        if multiprocess_active():
            return render_files(os.environ[MULTIPROC_ENV])
        return generate_latest(self.registry)


def render_files(path: str) -> bytes:
    """The merge of every process's metric files in `path` (several workers)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def sample_values(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Parse a text exposition into {(sample name, labels): value}; for tests and
    for `gate`'s own tooling, never on the request path."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def value_of(
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float],
    name: str,
    **labels: str,
) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


METRICS = Metrics()
