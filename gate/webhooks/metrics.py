"""The webhooks' metrics (agreed names: gate/base/metrics.py AGREED_NAMES["webhooks"];
alert rules in deploy/prometheus/alerts.yml)."""

from __future__ import annotations

from gate.base.metrics import DELAY_BUCKETS_SECONDS, METRICS

ATTEMPTS = METRICS.counter(
    "gate_webhook_attempts_total",
    "Webhook delivery attempts by outcome (delivered, http_error, gone, redirect, timeout,"
    " refused, connect_error, error).",
    ["outcome"],
)
ATTEMPT_SECONDS = METRICS.histogram(
    "gate_webhook_attempt_seconds",
    "Duration of one webhook delivery attempt, from connect to the answer read.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
FAILED = METRICS.counter(
    "gate_webhook_deliveries_failed_total",
    "Webhook deliveries that failed their last scheduled attempt.",
)
FANNED_OUT = METRICS.counter(
    "gate_webhook_events_total",
    "Webhook events recorded for delivery (fanned out to the endpoints subscribed).",
)
DELIVERY_LAG = METRICS.histogram(
    "gate_webhook_delivery_lag_seconds",
    "From an event's commit to its delivery's 2xx.",
    buckets=DELAY_BUCKETS_SECONDS,
)
PENDING = METRICS.gauge(
    "gate_webhook_pending",
    "Webhook deliveries waiting for an attempt (sampled by the maintenance pass).",
)
OVERDUE = METRICS.gauge(
    "gate_webhook_overdue_seconds",
    "How long the most overdue pending webhook delivery has been due.",
)
FAILING = METRICS.gauge(
    "gate_webhook_endpoints_failing",
    "Enabled webhook endpoints whose every attempt has failed for an hour or more.",
)
DISABLED = METRICS.counter(
    "gate_webhook_endpoints_disabled_total",
    "Webhook endpoints the gate disabled (reason: gone = answered 410, failing = every"
    " delivery failed for 5 days).",
    ["reason"],
)
