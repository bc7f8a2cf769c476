"""Prometheus metrics, defined once; every module records through METRICS."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reservations = Counter(
            "gate_reservations_total",
            "Reservation attempts by outcome (created, replayed, or the problem code).",
            ["outcome"],
            registry=r,
        )
        self.reservation_latency = Histogram(
            "gate_reservation_latency_seconds",
            "Reservation request latency, admission to answer.",
            buckets=LATENCY_BUCKETS_SECONDS,
            registry=r,
        )
        self.compensations = Counter(
            "gate_compensations_total",
            "Redis decrements given back after the database did not take them.",
            registry=r,
        )
        self.janitor_resolved = Counter(
            "gate_janitor_resolved_total",
            "Orphaned in-flight tokens resolved by the janitor.",
            ["action"],
            registry=r,
        )
        self.resync = Counter(
            "gate_resync_total", "Resync passes per deal by result.", ["result"], registry=r
        )
        self.db_retries = Counter(
            "gate_db_retries_total",
            "Transactions retried after a deadlock or lock-wait timeout.",
            ["errno"],
            registry=r,
        )
        self.unknown_outcomes = Counter(
            "gate_db_unknown_outcomes_total",
            "Reservations whose commit outcome had to be resolved by lookup.",
            ["resolution"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = Metrics()
