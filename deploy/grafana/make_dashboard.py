"""Writes dashboards/gate.json, the Grafana dashboard of a flash sale.

    python deploy/grafana/make_dashboard.py        # rewrite the JSON after editing

Panels follow what operators watch during a sale (seed 000: active connections,
lock waits, transaction time, deadlocks, order latency, reservation success rate,
callback delay, expiry releases, refund backlog) plus the invariant, drift and
seed 003's thresholds, drawn as red lines where an alert fires.
tests/project/test_ops_monitoring.py checks that the committed JSON is this script's output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "gate.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
# Gauges describing the whole system are reported by every process that computes
# them; take the maximum over processes (see deploy/prometheus/alerts.yml).
STATE = "max without (instance, pid) ({})"
WIDTH = 24


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_height = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "id": self._next_id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x = 0
            self.row_height = 0

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        kind: str = "timeseries",
        unit: str = "short",
        w: int = 8,
        h: int = 8,
        description: str = "",
        threshold: float | None = None,
        stack: bool = False,
    ) -> None:
        if self.x + w > WIDTH:
            self._newline()
        defaults: dict[str, Any] = {"unit": unit}
        if threshold is not None:
            defaults["thresholds"] = {
                "mode": "absolute",
                "steps": [
                    {"color": "green", "value": None},
                    {"color": "red", "value": threshold},
                ],
            }
            if kind == "timeseries":
                defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
        if stack and kind == "timeseries":
            defaults.setdefault("custom", {})["stacking"] = {"mode": "normal", "group": "A"}
        panel: dict[str, Any] = {
            "id": self._next_id(),
            "type": kind,
            "title": title,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        if description:
            panel["description"] = description
        if kind == "stat":
            panel["options"] = {"colorMode": "background", "graphMode": "area"}
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def quantiles(
    metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.99)
) -> list[tuple[str, str]]:
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[$__rate_interval])))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in qs
    ]


def build() -> dict[str, Any]:
    d = Layout()
    rate = "[$__rate_interval]"

    d.row("Sale at a glance")
    d.panel(
        "Reservations committed /s",
        [(f'sum(rate(gate_reservations_total{{outcome="created"}}{rate}))', "created")],
        kind="stat",
        unit="reqps",
        w=4,
        h=5,
    )
    d.panel(
        "Reservation success rate",
        [
            (
                f'sum(rate(gate_reservations_total{{outcome="created"}}{rate}))'
                f' / sum(rate(gate_reservations_total{{outcome!="replayed"}}{rate}))',
                "created / attempts",
            )
        ],
        kind="stat",
        unit="percentunit",
        w=4,
        h=5,
        description="Attempts that got a hold. Falls to ~0 once sold out: that is normal.",
    )
    d.panel(
        "Invariant breaches",
        [(f"sum({STATE.format('gate_invariant_breaches')}) or vector(0)", "breaches")],
        kind="stat",
        w=4,
        h=5,
        threshold=1,
        description="Any value above 0 is an oversell or a lost unit: see the runbook.",
    )
    d.panel(
        "Redis drift (units)",
        [(f"sum({STATE.format('abs(gate_redis_drift_units)')}) or vector(0)", "drift")],
        kind="stat",
        w=4,
        h=5,
        threshold=1,
    )
    d.panel(
        "Quarantined callbacks (24 h)",
        [("sum(increase(gate_payment_quarantined_total[24h])) or vector(0)", "quarantined")],
        kind="stat",
        w=4,
        h=5,
        threshold=1,
    )
    d.panel(
        "Refund backlog",
        [(f"sum({STATE.format('gate_refund_backlog')}) or vector(0)", "owed")],
        kind="stat",
        w=4,
        h=5,
        threshold=1,
    )

    d.row("Reservations (order latency, success, rejections)")
    d.panel(
        "Reservation outcomes /s",
        [(f"sum by (outcome) (rate(gate_reservations_total{rate}))", "{{outcome}}")],
        unit="reqps",
        stack=True,
        description="created, replayed, or the problem code (SOLD_OUT, RATE_LIMITED, ...).",
    )
    d.panel(
        "Reservation latency (order latency)",
        quantiles("gate_reservation_latency_seconds", qs=(0.5, 0.95, 0.99)),
        unit="s",
    )
    d.panel(
        "Rate limited /s by scope",
        [(f"sum by (scope) (rate(gate_rate_limited_total{rate}))", "{{scope}}")],
        unit="reqps",
    )
    d.panel(
        "HTTP requests /s by route and status",
        [
            (
                f"sum by (route, status) (rate(gate_http_requests_total{rate}))",
                "{{status}} {{route}}",
            )
        ],
        unit="reqps",
        w=12,
    )
    d.panel(
        "HTTP p99 latency by route",
        quantiles("gate_http_request_seconds", by="route", qs=(0.99,)),
        unit="s",
        w=12,
    )

    d.row("Database (connections, lock waits, deadlocks, transaction time)")
    d.panel(
        "Active DB connections",
        [
            ("sum by (instance) (gate_db_pool_in_use)", "in use {{instance}}"),
            ("sum by (instance) (gate_db_pool_waiting)", "waiting {{instance}}"),
        ],
        description="Pool occupancy per gate instance (GATE_DB_POOL_MAX per worker).",
    )
    d.panel("Transaction time", quantiles("gate_db_transaction_seconds"), unit="s")
    d.panel(
        "Lock waits and deadlocks (retries /s)",
        [
            (f'sum(rate(gate_db_retries_total{{errno="1205"}}{rate}))', "lock wait timeout"),
            (f'sum(rate(gate_db_retries_total{{errno="1213"}}{rate}))', "deadlock"),
        ],
        unit="ops",
    )
    d.panel(
        "Unknown commit outcomes (resolved by lookup)",
        [
            (
                "sum by (resolution) (increase(gate_db_unknown_outcomes_total[5m]))",
                "{{resolution}}",
            )
        ],
    )

    d.row("Redis (mirror, scripts, compensation)")
    d.panel(
        "Redis script latency p99 by script",
        quantiles("gate_redis_script_seconds", by="script", qs=(0.99,)),
        unit="s",
    )
    d.panel(
        "Redis errors /s and open circuits",
        [
            (f"sum by (kind) (rate(gate_redis_errors_total{rate}))", "error {{kind}}"),
            ("max by (dependency) (gate_circuit_open)", "circuit open {{dependency}}"),
        ],
    )
    d.panel(
        "Redis drift by deal (units)",
        [(STATE.format("gate_redis_drift_units"), "deal {{deal}}")],
        threshold=1,
        description="Redis minus database available units; the resync loop repairs it.",
    )
    d.panel(
        "Compensations, janitor and resync /s",
        [
            (f"sum(rate(gate_compensations_total{rate}))", "compensations"),
            (f"sum by (action) (rate(gate_janitor_resolved_total{rate}))", "janitor {{action}}"),
            (
                f'sum by (result) (rate(gate_resync_total{{result!="in_sync"}}{rate}))',
                "resync {{result}}",
            ),
        ],
        unit="ops",
        w=24,
    )

    d.row("Expiry and invariants (seed 003 thresholds)")
    d.panel(
        "Expiry releases /s",
        [
            (f"sum(rate(gate_expiry_released_total{rate}))", "released"),
            (f"sum(rate(gate_expiry_release_failures_total{rate}))", "failed"),
        ],
        unit="ops",
    )
    d.panel(
        "Release failure rate (alert > 1 %)",
        [
            (
                "sum(rate(gate_expiry_release_failures_total[10m])) / (sum(rate("
                "gate_expiry_released_total[10m])) + sum(rate(gate_expiry_release_failures_total"
                "[10m])))",
                "failures / releases",
            ),
            (STATE.format("gate_release_failure_ratio"), "reported ratio"),
        ],
        unit="percentunit",
        threshold=0.01,
    )
    d.panel(
        "Release lag (alert: average > 5 min)",
        [
            (
                "sum(rate(gate_expiry_release_lag_seconds_sum[10m]))"
                " / sum(rate(gate_expiry_release_lag_seconds_count[10m]))",
                "average",
            ),
            *quantiles("gate_expiry_release_lag_seconds", qs=(0.99,)),
            (STATE.format("gate_expiry_oldest_due_seconds"), "oldest hold past due"),
        ],
        unit="s",
        threshold=300,
    )
    d.panel(
        "Inventory inconsistency (alert > 0.5 % for 10 min)",
        [(STATE.format("gate_inconsistency_ratio"), "inconsistency")],
        unit="percentunit",
        threshold=0.005,
    )
    d.panel(
        "Invariant breaches by deal",
        [(STATE.format("gate_invariant_breaches"), "deal {{deal}}")],
        threshold=1,
    )
    d.panel(
        "Invariant checks /s by result",
        [(f"sum by (result) (rate(gate_invariant_checks_total{rate}))", "{{result}}")],
        unit="ops",
    )

    d.row("Payments (callback delay, outcomes, refunds, outbox)")
    d.panel(
        "Callbacks /s by outcome",
        [(f"sum by (outcome) (rate(gate_callbacks_total{rate}))", "{{outcome}}")],
        unit="ops",
        stack=True,
    )
    d.panel("Callback delay", quantiles("gate_callback_delay_seconds"), unit="s")
    d.panel(
        "Refund backlog",
        [(STATE.format("gate_refund_backlog"), "refunds owed")],
        description="Refunds owed and not yet confirmed by the provider. Alert when it grows.",
    )
    d.panel(
        "Outbox",
        [
            (STATE.format("gate_outbox_unpublished"), "unpublished"),
            *quantiles("gate_outbox_lag_seconds", qs=(0.99,)),
        ],
        w=24,
    )

    return {
        "uid": "gate-flash-sale",
        "title": "Gate",
        "description": "Flash-sale gate: reservations, database, Redis, expiry, payments.",
        "tags": ["gate"],
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": d.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
