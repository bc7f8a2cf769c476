"""A short headless locust run against a real gate must pass the verifier (CI)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from loadtest.record import ClientRecord
from tests.loadtest_support import run_module
from tests.support import GateProcess, free_port


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
        "6s",
        "--stock",
        "40",
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

    # Every order a client was told about was checked against the database; a crowd
    # that got SOLD_OUT answers must have bought every unit (how far a busy machine
    # gets in a few seconds is not asserted).
    record = ClientRecord.read(out / "client.json")
    flash = record.deals["flash"]
    ordered = len([r for r in record.created if r[2] == flash])
    assert 0 < ordered <= 40
    if record.outcomes[flash].get("SOLD_OUT"):
        assert ordered == 40
    assert record.violations == []
    verdict = (out / "verify.txt").read_text()
    line = re.search(
        rf"deal {flash} \[flash\]: OK  stock=40 available=(\d+) ordered=(\d+)"
        r" oversold=0 lost=0  redis: equal",
        verdict,
    )
    assert line is not None, verdict
    available, in_db = int(line[1]), int(line[2])
    assert available + in_db == 40 and in_db >= ordered


def test_a_run_against_no_gate_says_so_and_writes_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "nothing"
    host = f"http://127.0.0.1:{free_port()}"
    result = run_module(env, "loadtest.scenario", "ci", "--host", host, "--out", str(out))
    assert result.returncode == 4, result.stdout + result.stderr
    assert f"no gate answers at {host}" in result.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_waiting_room_run_passes_the_verifier(
    gate: GateProcess, env: dict[str, str], tmp_path: Path
) -> None:
    """The crowd queues, polls as advised, buys when admitted or abandons;
    the verifier holds the deal (and the room's counters) against the database."""
    out = tmp_path / "room"
    result = run_module(
        env,
        "loadtest.scenario",
        "waiting-room",
        "--host",
        gate.url,
        "--run-time",
        "12s",
        "--stock",
        "30",
        "--users",
        "60",
        "--spawn-rate",
        "60",
        "--room-rate",
        "20",
        # The room asks a proof of work: every buyer solves one before joining.
        "--room-min-bits",
        "4",
        "--room-max-bits",
        "10",
        "--out",
        str(out),
        timeout_seconds=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "verifier: all checks hold" in result.stdout
    with (out / "stats_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert "queue join" in rows and "queue poll" in rows and "reserve (admitted)" in rows
    assert int(rows["queue challenge"]["Request Count"]) >= int(rows["queue join"]["Request Count"])
    record = ClientRecord.read(out / "client.json")
    room = record.deals["room"]
    solved = {k: v for k, v in record.outcomes[room].items() if k.startswith("challenge:")}
    assert solved and all(4 <= int(k[10:].split("_")[0]) <= 10 for k in solved), solved
    assert not record.outcomes[room].get("ticket:CHALLENGE_INVALID")
    assert record.violations == []
    ordered = len([r for r in record.created if r[2] == room])
    assert 0 < ordered <= 30
    assert record.outcomes[room].get("ticket:admitted")
    verdict = (out / "verify.txt").read_text()
    assert re.search(rf"deal {room} \[room\]: OK  stock=30 .* oversold=0 lost=0", verdict), verdict
    assert re.search(r"room: waiting=\d+ admitted=\d+ spent=\d+", verdict), verdict


@pytest.mark.slow
def test_a_short_queue_mode_run_passes_the_verifier(
    gate: GateProcess, env: dict[str, str], tmp_path: Path
) -> None:
    """The `queue-mode` scenario (202, then PENDING_PAYMENT within 10 s)."""
    out = tmp_path / "queue"
    result = run_module(
        env,
        "loadtest.scenario",
        "queue-mode",
        "--host",
        gate.url,
        "--run-time",
        "6s",
        "--stock",
        "40",
        "--users",
        "30",
        "--out",
        str(out),
        timeout_seconds=180,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "verifier: all checks hold" in result.stdout
    with (out / "stats_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    record = ClientRecord.read(out / "client.json")
    deal = record.deals["queue"]
    assert record.outcomes[deal].get("202")
    assert not record.outcomes[deal].get("QUEUED_TOO_LONG")
    assert record.violations == []
    verdict = (out / "verify.txt").read_text()
    assert re.search(rf"deal {deal} \[queue\]: OK .* oversold=0 lost=0  redis: equal", verdict), (
        verdict
    )
