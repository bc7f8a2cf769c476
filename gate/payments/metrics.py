"""Payment metrics, registered on the gate's one registry (names agreed across areas)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from gate.base.metrics import METRICS

_r = METRICS.registry

CALLBACKS = Counter(
    "gate_callbacks_total",
    "Payment callbacks by provider and outcome"
    " (applied, duplicate, quarantined, rejected, ignored).",
    ["provider", "outcome"],
    registry=_r,
)
CALLBACK_DELAY = Histogram(
    "gate_callback_delay_seconds",
    "Time from the provider creating an event to the gate recording it.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
    registry=_r,
)
QUARANTINED = Counter(
    "gate_payment_quarantined_total",
    "Payment events recorded but never applied (wrong amount, currency or order). Alert on any.",
    registry=_r,
)
REFUND_BACKLOG = Gauge(
    "gate_refund_backlog",
    "Refunds the gate owes and the provider has not confirmed yet.",
    registry=_r,
)
OUTBOX_UNPUBLISHED = Gauge(
    "gate_outbox_unpublished",
    "Outbox rows not yet published to the event stream.",
    registry=_r,
)
OUTBOX_LAG = Histogram(
    "gate_outbox_lag_seconds",
    "Time from an outbox row's commit to its publication.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=_r,
)
