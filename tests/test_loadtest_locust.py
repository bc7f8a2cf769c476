"""A short headless locust run against a real gate must pass the verifier (CI)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from loadtest.record import ClientRecord
from tests.loadtest_support import run_module
from tests.support import GateProcess


@pytest.mark.slow
def test_a_short_crowd_run_passes_the_verifier(
    gate: GateProcess, env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "ci"
    result = run_module(
        env,
        "loadtest.scenario",
        "ci",
        "--host",
        gate.url,
        "--run-time",
        "5s",
        "--users",
        "30",
        "--out",
        str(out),
        timeout_seconds=180,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "verifier: all checks hold" in result.stdout

    # locust's own outputs: the CSV statistics and the HTML report.
    with (out / "stats_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert "reserve" in rows
    assert (out / "report.html").stat().st_size > 0

    # The crowd sold the deal out; every order a client was told about was checked.
    record = ClientRecord.read(out / "client.json")
    flash = record.deals["flash"]
    assert record.outcomes[flash]["SOLD_OUT"] > 0
    assert len([r for r in record.created if r[2] == flash]) == 150
    assert record.violations == []
    verdict = (out / "verify.txt").read_text()
    assert (
        f"deal {flash} [flash]: OK  stock=150 available=0 ordered=150 oversold=0 lost=0" in verdict
    )
