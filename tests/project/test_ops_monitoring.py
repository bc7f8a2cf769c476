"""Prometheus configuration, alert rules and the Grafana dashboard: they parse, they
use only the agreed metric names, the seeds' thresholds are there, and — where
promtool is installed — the rules and every dashboard query compile and the rules'
unit tests (deploy/prometheus/alerts_test.yml) pass."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

import gate
from gate.base.metrics import AGREED_NAMES, METRICS
from gate.base.settings import metrics_port_for
from tests.support import ROOT

PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "gate.json"
AGREED = {name for names in AGREED_NAMES.values() for name in names}
METRIC_RE = re.compile(r"\bgate_[a-z0-9_]+\b")


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in METRIC_RE.findall(expr):
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name[: -len(suffix)] in AGREED:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def balanced(expr: str) -> bool:
    depth = {"(": 0, "[": 0, "{": 0}
    closing = {")": "(", "]": "[", "}": "{"}
    for ch in expr:
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return not any(depth.values())


def rules() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load((PROM / "alerts.yml").read_text())
    found: dict[str, dict[str, Any]] = {}
    for group in data["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert rule["alert"] not in found, f"duplicate alert {rule['alert']}"
            found[rule["alert"]] = rule
    return found


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]


def promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


# -- alert rules ---------------------------------------------------------------------


def anchors(doc: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    return {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in doc.read_text().splitlines()
        if line.startswith("#")
    }


def test_alert_rules_are_well_formed_and_use_agreed_metrics() -> None:
    for name, rule in rules().items():
        assert re.fullmatch(r"Gate[A-Za-z]+", name)
        expr = rule["expr"]
        assert balanced(expr), name
        unknown = metric_names(expr) - AGREED
        assert not unknown, f"{name} uses metrics nobody records: {unknown}"
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"], name
        # A runbook section, or the page that explains what to do (a Galera failover,
        # a full queue).
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert re.fullmatch(r"docs/[a-z-]+\.md", page) and (ROOT / page).is_file(), name
        assert anchor in anchors(ROOT / page), f"{name}: no section {page}#{anchor}"


def test_the_seeds_thresholds_are_alerted() -> None:
    r = rules()
    inconsistency = r["GateInventoryInconsistency"]
    assert "gate_inconsistency_ratio" in inconsistency["expr"]
    assert "> 0.005" in inconsistency["expr"] and inconsistency["for"] == "10m"
    failure = r["GateReleaseFailureRate"]["expr"]
    assert "gate_expiry_release_failures_total" in failure and "> 0.01" in failure
    lag = r["GateReleaseLagHigh"]["expr"]
    assert "gate_expiry_release_lag_seconds_sum" in lag and "> 300" in lag
    # "Any" means any: no threshold above zero, no waiting on the breach itself.
    assert (
        r["GateInvariantBreach"]["expr"].endswith("> 0") and "for" not in r["GateInvariantBreach"]
    )
    assert r["GateRedisDrift"]["expr"].endswith("> 0")
    # A paused sale (gate/inventory/pause.py) pages at once.
    paused = r["GateDealPaused"]
    assert "gate_deal_paused" in paused["expr"] and paused["expr"].endswith("> 0")
    assert "for" not in paused and paused["labels"]["severity"] == "critical"
    assert "gate_payment_quarantined_total" in r["GatePaymentQuarantined"]["expr"]
    assert "gate_refund_backlog" in r["GateRefundBacklogGrowing"]["expr"]


def test_every_agreed_name_is_recorded_by_the_code() -> None:
    # Every module of gate/ imported: each registers its metrics on METRICS.
    for module in pkgutil.walk_packages(gate.__path__, "gate."):
        importlib.import_module(module.name)
    # Some register on METRICS.registry directly; a counter's family drops "_total".
    recorded = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in METRICS.registry.collect()
    }
    missing = AGREED - recorded
    assert not missing, f"agreed but recorded nowhere: {missing}"


def test_new_metrics_are_alerted() -> None:
    r = rules()
    assert "gate_db_failovers_total" in r["GateDbWriterFailover"]["expr"]
    assert "gate_http_malformed_total" in r["GateMalformedRequests"]["expr"]
    assert "gate_queue_full_total" in r["GateQueueFull"]["expr"]
    # The exporters' jobs: the servers themselves, as the dashboard's rows show them.
    assert 'job="redis"' in r["GateRedisDown"]["expr"]
    assert "redis_memory_max_bytes" in r["GateRedisMemoryHigh"]["expr"]
    assert 'job="mysql"' in r["GateDatabaseDown"]["expr"]
    assert "max_connections" in r["GateDatabaseConnectionsHigh"]["expr"]


def test_prometheus_config_scrapes_the_gate_and_loads_the_rules() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert [Path(f).name for f in config["rule_files"]] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gate = jobs["gate"]
    assert gate.get("metrics_path", "/metrics") == "/metrics"
    ports = [sd["port"] for sd in gate.get("dns_sd_configs", [])] + [
        int(t.rsplit(":", 1)[1]) for sc in gate.get("static_configs", []) for t in sc["targets"]
    ]
    # The metrics listener (GATE_METRICS_ADDR in the compose files, the default for the
    # public port 8000), not the public port.
    assert ports == [metrics_port_for(8000)]
    # The exporters of docker-compose.yml, on the compose network (published nowhere).
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for job, service, port in (
        ("redis", "redis_exporter", 9121),
        ("mysql", "mysqld_exporter", 9104),
    ):
        assert jobs[job]["static_configs"] == [{"targets": [f"{service}:{port}"]}]
        assert "ports" not in services[service], service
        assert service in services["prometheus"]["depends_on"]


# -- dashboard -----------------------------------------------------------------------


def test_dashboard_is_generated_valid_and_covers_what_operators_watch() -> None:
    spec = importlib.util.spec_from_file_location(
        "make_dashboard", ROOT / "deploy" / "grafana" / "make_dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run deploy/grafana/make_dashboard.py"

    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0
    used: set[str] = set()
    for title, expr in dashboard_queries():
        assert balanced(expr), title
        unknown = metric_names(expr) - AGREED
        assert not unknown, f"panel {title!r} uses unknown metrics {unknown}"
        used |= metric_names(expr)
    # Seed 000's list: active connections, lock waits, transaction time, deadlocks,
    # order latency, reservation success rate, callback delay, expiry releases,
    # refund backlog; plus the invariant, drift and seed 003's ratios.
    watched = {
        "gate_db_pool_in_use",
        "gate_db_retries_total",
        "gate_db_transaction_seconds",
        "gate_reservation_latency_seconds",
        "gate_reservations_total",
        "gate_callback_delay_seconds",
        "gate_expiry_released_total",
        "gate_refund_backlog",
        "gate_invariant_breaches",
        "gate_redis_drift_units",
        "gate_inconsistency_ratio",
        "gate_expiry_release_failures_total",
        "gate_expiry_release_lag_seconds",
        "gate_http_requests_total",
        # The waiting room, queue mode, the edge and the database writer.
        "gate_room_waiting",
        "gate_room_admitted_total",
        "gate_room_wait_seconds",
        "gate_room_retired_total",
        "gate_queue_depth",
        "gate_queue_commit_lag_seconds",
        "gate_queue_dead_letters_total",
        "gate_edge_requests_total",
        "gate_http_malformed_total",
        "gate_db_writer_info",
        "gate_db_failovers_total",
    }
    assert watched <= used, watched - used
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    for word in ("Waiting room", "Queue mode", "Edge", "redis_exporter", "mysqld_exporter"):
        assert any(word in title for title in rows), word
    exprs = " ".join(expr for _, expr in dashboard_queries())
    assert 'job="redis"' in exprs and 'job="mysql"' in exprs
    # Per-instance and per-deal variables, each used by panels, "All" by default.
    variables = {v["name"]: v for v in board["templating"]["list"]}
    for name, label in (("instance", "instance"), ("deal", "deal")):
        variable = variables[name]
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
        assert variable["query"]["query"].endswith(f", {label})")
        assert f'{label}=~"${name}"' in exprs
    provisioning = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/gate.yml").read_text()
    )
    assert provisioning["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


# -- promtool, where installed --------------------------------------------------------


def _promtool_or_skip() -> str:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (set PROMTOOL=/path/to/promtool to run this)")
    return tool


def test_promtool_accepts_rules_and_passes_their_unit_tests() -> None:
    tool = _promtool_or_skip()
    check = subprocess.run(
        [tool, "check", "rules", "alerts.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [tool, "test", "rules", "alerts_test.yml"], cwd=PROM, capture_output=True, text=True
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_promtool_compiles_every_dashboard_query(tmp_path: Path) -> None:
    tool = _promtool_or_skip()
    # Each query as a recording rule: `check rules` parses the PromQL.
    records = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    check = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
