"""Writes dashboards/gate.json, the Grafana dashboard of a flash sale.

    python deploy/grafana/make_dashboard.py        # rewrite the JSON after editing

Panels follow what operators watch during a sale (seed 000: active connections,
lock waits, transaction time, deadlocks, order latency, reservation success rate,
callback delay, expiry releases, refund backlog) plus the invariant, drift and
seed 003's thresholds, drawn as red lines where an alert fires; then the database
writer, the waiting room, queue mode, the edge, and the Redis and MariaDB servers as
their exporters (redis_exporter, mysqld_exporter) see them. The `instance` variable
narrows the per-process panels to some gates, `deal` the per-deal ones.
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
# Label matchers of the dashboard's variables (multi-value, "All" is ".*").
INSTANCE = 'instance=~"$instance"'
DEAL = 'deal=~"$deal"'
# The exporters' scrape jobs (deploy/prometheus/prometheus.yml).
REDIS = 'job="redis"'
MYSQL = 'job="mysql"'


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
    metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.99), where: str = ""
) -> list[tuple[str, str]]:
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    selector = f"{{{where}}}" if where else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group})"
            f" (rate({metric}_bucket{selector}[$__rate_interval])))",
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
        [
            (
                f"sum by (outcome) (rate(gate_reservations_total{{{INSTANCE}}}{rate}))",
                "{{outcome}}",
            )
        ],
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
        [(f"sum by (scope) (rate(gate_rate_limited_total{{{INSTANCE}}}{rate}))", "{{scope}}")],
        unit="reqps",
    )
    d.panel(
        "HTTP requests /s by route and status",
        [
            (
                f"sum by (route, status) (rate(gate_http_requests_total{{{INSTANCE}}}{rate}))",
                "{{status}} {{route}}",
            )
        ],
        unit="reqps",
        w=12,
    )
    d.panel(
        "HTTP p99 latency by route",
        quantiles("gate_http_request_seconds", by="route", qs=(0.99,), where=INSTANCE),
        unit="s",
        w=12,
    )

    d.row("Database (connections, lock waits, deadlocks, transaction time)")
    d.panel(
        "Active DB connections",
        [
            (f"sum by (instance) (gate_db_pool_in_use{{{INSTANCE}}})", "in use {{instance}}"),
            (f"sum by (instance) (gate_db_pool_waiting{{{INSTANCE}}})", "waiting {{instance}}"),
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
    database_writer(d)

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
        [(STATE.format(f"gate_redis_drift_units{{{DEAL}}}"), "deal {{deal}}")],
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
        [(STATE.format(f"gate_invariant_breaches{{{DEAL}}}"), "deal {{deal}}")],
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

    waiting_room(d)
    queue_mode(d)
    edge(d)
    redis_server(d)
    mariadb_server(d)

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
                },
                variable("instance", "Gate instance", 'up{job="gate"}'),
                variable(
                    "deal",
                    "Deal",
                    '{__name__=~"gate_invariant_breaches|gate_room_waiting|gate_queue_depth"}',
                ),
            ]
        },
        "panels": d.panels,
    }


def variable(name: str, label: str, series: str) -> dict[str, Any]:
    """A multi-value query variable over a label of `series`, "All" by default."""
    query = f"label_values({series}, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
    }


def database_writer(d: Layout) -> None:
    """Several database hosts (Galera, docs/high-availability.md): the node each gate
    writes to, its moves, and requests refused for want of a connection."""
    rate = "[$__rate_interval]"
    d.panel(
        "Database writer node per gate",
        [
            (
                f"max by (instance, node) (gate_db_writer_info{{{INSTANCE}}}) == 1",
                "{{instance}} → {{node}}",
            )
        ],
        description="The GATE_MYSQL_URL node each gate writes to (the first healthy one).",
    )
    d.panel(
        "Writer failovers (5 min)",
        [
            (
                f"sum by (instance) (increase(gate_db_failovers_total{{{INSTANCE}}}[5m]))",
                "{{instance}}",
            )
        ],
        threshold=1,
        description="A gate moved its writes to another node: a node left the cluster.",
    )
    d.panel(
        "Refused: no DB connection free /s",
        [(f"sum by (use) (rate(gate_db_pool_refused_total{{{INSTANCE}}}{rate}))", "{{use}}")],
        unit="reqps",
    )


def waiting_room(d: Layout) -> None:
    rate = "[$__rate_interval]"
    d.row("Waiting room (docs/waiting-room.md)")
    d.panel(
        "Waiting and admitted (unspent) by deal",
        [
            (STATE.format(f"gate_room_waiting{{{DEAL}}}"), "waiting {{deal}}"),
            (STATE.format(f"gate_room_unspent{{{DEAL}}}"), "admitted, unspent {{deal}}"),
        ],
        description="Tickets in the queue, and admissions neither spent nor lapsed.",
    )
    d.panel(
        "Admissions /s: given, spent, lapsed",
        [
            (
                f"sum by (deal) (rate(gate_room_admitted_total{{{DEAL}}}{rate}))",
                "admitted {{deal}}",
            ),
            (
                f"max by (deal) (rate(gate_room_spent{{{DEAL}}}{rate}))",
                "spent {{deal}}",
            ),
            (f"sum by (deal) (rate(gate_room_lapsed_total{{{DEAL}}}{rate}))", "lapsed {{deal}}"),
        ],
        unit="ops",
        description="Lapsed admissions return their slot; many lapses mean buyers leave.",
    )
    d.panel(
        "Wait from joining to admission",
        [
            *quantiles("gate_room_wait_seconds", qs=(0.5, 0.99), where=DEAL),
            ("sum(increase(gate_room_retired_total[1h]))", "rooms retired (1 h)"),
        ],
        unit="s",
    )


def queue_mode(d: Layout) -> None:
    rate = "[$__rate_interval]"
    d.row("Queue mode (docs/queue-mode.md)")
    d.panel(
        "Queue depth and oldest request by deal",
        [
            (STATE.format(f"gate_queue_depth{{{DEAL}}}"), "depth {{deal}}"),
            (STATE.format(f"gate_queue_oldest_age_seconds{{{DEAL}}}"), "oldest (s) {{deal}}"),
        ],
    )
    d.panel(
        "Queued, committed, rejected /s",
        [
            (f"sum by (deal) (rate(gate_queue_enqueued_total{{{DEAL}}}{rate}))", "queued {{deal}}"),
            (
                f"sum by (deal) (rate(gate_queue_committed_total{{{DEAL}}}{rate}))",
                "committed {{deal}}",
            ),
            (
                f"sum by (reason) (rate(gate_queue_rejected_total{{{DEAL}}}{rate}))",
                "rejected {{reason}}",
            ),
            (f"sum by (deal) (rate(gate_queue_full_total{{{DEAL}}}{rate}))", "queue full {{deal}}"),
        ],
        unit="ops",
    )
    d.panel(
        "Commit lag, retries and dead letters",
        [
            *quantiles("gate_queue_commit_lag_seconds"),
            (f"sum(rate(gate_queue_retries_total{{{DEAL}}}{rate}))", "retries /s"),
            (f"sum(increase(gate_queue_dead_letters_total{{{DEAL}}}[5m]))", "dead letters (5 min)"),
        ],
        description="From 202 QUEUED to PENDING_PAYMENT; a dead letter pages"
        " (GateQueueDeadLetter).",
    )


def edge(d: Layout) -> None:
    rate = "[$__rate_interval]"
    d.row("Edge (requests answered by the HTTP protocol, gate/web/edge.py)")
    d.panel(
        "Answered at the edge /s",
        [
            (
                f"sum by (instance) (rate(gate_edge_requests_total{{{INSTANCE}}}{rate}))",
                "{{instance}}",
            ),
        ],
        unit="reqps",
        description="Reservation and waiting-room requests that never reached the ASGI app.",
    )
    d.panel(
        "Share of requests answered at the edge",
        [
            (
                f"sum(rate(gate_edge_requests_total{{{INSTANCE}}}{rate}))"
                f" / sum(rate(gate_http_requests_total{{{INSTANCE}}}{rate}))",
                "edge / all",
            )
        ],
        unit="percentunit",
    )
    d.panel(
        "Malformed requests and refused upgrades /s",
        [
            (
                f"sum by (instance) (rate(gate_http_malformed_total{{{INSTANCE}}}{rate}))",
                "malformed {{instance}}",
            ),
            (
                f"sum by (instance) (rate(gate_http_upgrades_refused_total{{{INSTANCE}}}{rate}))",
                "upgrade refused {{instance}}",
            ),
        ],
        unit="reqps",
        description="Answered 400 (or as HTTP/1.1) and the connection closed; a steady"
        " rate is a broken client or a probe (alert GateMalformedRequests).",
    )


def redis_server(d: Layout) -> None:
    rate = "[$__rate_interval]"
    d.row("Redis server (redis_exporter)")
    d.panel("Redis up", [(f"min(redis_up{{{REDIS}}})", "up")], kind="stat", w=4, h=8)
    d.panel(
        "Memory used / maxmemory",
        [
            (
                f"max(redis_memory_used_bytes{{{REDIS}}}"
                f" / (redis_memory_max_bytes{{{REDIS}}} > 0))",
                "used",
            )
        ],
        unit="percentunit",
        threshold=0.9,
        w=6,
        description="noeviction: at 100 % every write fails (alert GateRedisMemoryHigh).",
    )
    d.panel(
        "Commands /s",
        [(f"sum(rate(redis_commands_processed_total{{{REDIS}}}{rate}))", "commands")],
        unit="ops",
        w=7,
    )
    d.panel(
        "Clients, rejected connections, evictions",
        [
            (f"sum(redis_connected_clients{{{REDIS}}})", "clients"),
            (f"sum(rate(redis_rejected_connections_total{{{REDIS}}}{rate}))", "rejected /s"),
            (f"sum(rate(redis_evicted_keys_total{{{REDIS}}}{rate}))", "evicted /s"),
        ],
        w=7,
    )


def mariadb_server(d: Layout) -> None:
    rate = "[$__rate_interval]"
    d.row("MariaDB server (mysqld_exporter)")
    d.panel("MariaDB up", [(f"min(mysql_up{{{MYSQL}}})", "up")], kind="stat", w=4, h=8)
    d.panel(
        "Connections / max_connections",
        [
            (
                f"max(mysql_global_status_threads_connected{{{MYSQL}}}"
                f" / mysql_global_variables_max_connections{{{MYSQL}}})",
                "connected",
            ),
            (
                f"max(mysql_global_status_threads_running{{{MYSQL}}}"
                f" / mysql_global_variables_max_connections{{{MYSQL}}})",
                "running",
            ),
        ],
        unit="percentunit",
        threshold=0.8,
        w=6,
    )
    d.panel(
        "Queries and row lock waits /s",
        [
            (f"sum(rate(mysql_global_status_queries{{{MYSQL}}}{rate}))", "queries"),
            (
                f"sum(rate(mysql_global_status_innodb_row_lock_waits{{{MYSQL}}}{rate}))",
                "row lock waits",
            ),
            (f"sum(rate(mysql_global_status_innodb_deadlocks{{{MYSQL}}}{rate}))", "deadlocks"),
        ],
        unit="ops",
        w=7,
    )
    d.panel(
        "Buffer pool misses and Galera cluster size",
        [
            (
                f"sum(rate(mysql_global_status_innodb_buffer_pool_reads{{{MYSQL}}}{rate}))"
                " / sum(rate(mysql_global_status_innodb_buffer_pool_read_requests"
                f"{{{MYSQL}}}{rate}))",
                "buffer pool miss ratio",
            ),
            (f"min(mysql_global_status_wsrep_cluster_size{{{MYSQL}}})", "Galera nodes"),
        ],
        w=7,
        description="Reads the buffer pool had to take from disk; the cluster size only"
        " with Galera.",
    )


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
