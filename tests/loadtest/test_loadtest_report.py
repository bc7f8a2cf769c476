"""The benchmark report: verdicts, the markdown, the bucket guide's curve, wrk parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest import report, wrkrun


def run(buckets: int, conns: int, per_s: float, p99_us: float) -> dict[str, Any]:
    return {
        "buckets": buckets,
        "connections": conns,
        "committed_per_s": per_s,
        "latency_us": {"p50": p99_us / 4, "p90": p99_us / 2, "p99": p99_us},
        "command": "wrk -t 1 -c 64 -d 8s -s /x/loadtest/wrk/reserve.lua http://h --"
        " /t/tokens-loop.txt loop",
        "cpu_cores": {"gate": 1.5, "mariadb": 0.3, "machine": 2.0},
    }


def results(*, ratio: float = 0.9, best: float = 6000.0, oversold: int = 0) -> dict[str, Any]:
    gate = {f"{n}/{c}": run(n, c, best * n / 64, 20_000) for n in (1, 16, 64) for c in (64,)}
    return {
        "plan": {
            "quick": False,
            "workers": 2,
            "threads": 1,
            "duration_s": 8,
            "warmup_s": 2,
            "buyers": 10_000,
        },
        "environment": {"commit": "abc1234", "cpus": 2, "date_utc": "2026-01-01 00:00:00 UTC"},
        "commands": {"bench": "loadtest/bench", "gate": "gate serve --workers 2"},
        "phases": {
            "ratio": {
                "connections": 64,
                "rounds": [],
                "healthz_per_s": 20_000.0,
                "rejections_per_s": 20_000.0 * ratio,
                "ratio": ratio,
                "target": 0.8,
            },
            "buckets": {
                "gate": gate,
                "baseline": {"64": {**run(1, 64, 1800.0, 40_000)}},
                "best": {"buckets": 64, "connections": 64},
                "best_per_s": best,
                "baseline_best": {"connections": 64},
                "baseline_best_per_s": 1800.0,
                "ratio": round(best / 1800.0, 3),
                "target": 3.0,
            },
            "sellout": {
                "gate": {
                    "units": 10_000,
                    "attempts": 100_000,
                    "units_ordered": 10_000 + oversold,
                    "oversold": oversold,
                    "lost": 0,
                    "unsold": 0,
                    "invariant_ok": oversold == 0,
                    "redis": "equal",
                    "db_calls": 10_020,
                    "db_calls_per_unit": 1.002,
                    "time_to_sell_out_s": 3.2,
                    "wrk": {"command": "wrk once"},
                    "client_201": 10_000,
                    "client_409": 90_000,
                    "client_other": 0,
                    "buckets": 64,
                    "connections": 512,
                    "orders": 10_000,
                },
                "target_calls_per_unit": 1.05,
            },
            "latency": {
                "gate": [
                    {
                        **run(64, 512, best * 0.9, 60_000),
                        "share": 0.9,
                        "achieved_share": 0.9,
                        "target_per_s": best * 0.9,
                        "delay_ms": 80.25,
                    }
                ],
                "baseline": [],
            },
        },
    }


def test_verdicts_follow_the_targets() -> None:
    good = results()
    assert report.all_met(good) and report.correctness_ok(good)
    slow = results(ratio=0.5, best=3000.0)
    assert not report.all_met(slow) and report.correctness_ok(slow)
    broken = results(oversold=1)
    assert not report.correctness_ok(broken)
    rows = {r["target"]: r for r in report.verdicts(slow)}
    assert (
        rows["committed reservations/s on one hot deal ≥ 3 × the DB-only baseline"]["ok"] is False
    )


def test_markdown_keeps_hand_written_notes_and_fills_the_bucket_guide(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("old\n" + report.END_MARK + "\n## Profile\nkept by hand\n")
    report.write_markdown(results(), out, {}, tmp_path)
    text = out.read_text()
    assert text.startswith("# Benchmarks")
    assert "| committed reservations/s on one hot deal ≥ 3 × the DB-only baseline |" in text
    assert "3.33×" in text and "met" in text
    assert "<tokens>" in text and "/t/tokens-loop.txt" not in text
    # The latency row names the connections and the pause that offered its load.
    assert "| gate | 90% | 90% | 5,400 | 512 | 80.2 | 15.00 | 30.00 | 60.00 |" in text
    assert text.rstrip().endswith("## Profile\nkept by hand")
    assert text.count(report.END_MARK) == 1

    guide = tmp_path / "buckets.md"
    guide.write_text(f"# Guide\n{report.CURVE_START}\nplaceholder\n{report.CURVE_END}\ntail\n")
    assert report.update_buckets_guide(guide, results(), {})
    text = guide.read_text()
    assert "placeholder" not in text and text.endswith("tail\n")
    assert "| 64 | 6,000 (20.00) |" in text
    assert "| baseline (DB only, 1 row) | 1,800 (40.00) |" in text


def test_wrk_output_is_parsed() -> None:
    line = (
        'WRKJSON {"requests": 120, "duration_us": 2000000, "sent": 100, "fillers": 20,'
        ' "errors": {"connect": 0, "read": 0, "write": 0, "timeout": 0, "status": 90},'
        ' "latency_us": {"p50": 900, "p90": 2000, "p99": 5000, "max": 9000, "mean": 1000.5},'
        ' "status": {"201": 10, "409": 90}}'
    )
    result = wrkrun.parse("Running 2s test\n" + line + "\n", "wrk …")
    assert result.status == {201: 10, 409: 90}
    assert result.rps == 50.0  # fillers are not answers
    assert result.count(201, 409) == 100
    with pytest.raises(wrkrun.WrkError):
        wrkrun.parse("no result here", "wrk …")


def test_the_ratio_target_holds_in_every_round_and_peer_and_expiry_rows_are_judged() -> None:
    r = results()
    r["phases"]["ratio"]["rounds"] = [
        {"healthz_per_s": 10_000.0, "rejections_per_s": 9_500.0},
        {"healthz_per_s": 10_000.0, "rejections_per_s": 8_800.0},
    ]
    r["phases"]["ratio"]["ratio"] = 0.915
    r["phases"]["ratio"]["target"] = 0.9
    rows = report.verdicts(r)
    ratio = next(x for x in rows if x["target"].startswith("sold-out rejections/s"))
    # The mean (0.915) passes; the worst round (0.88) does not.
    assert ratio["ok"] is False and ratio["value"].startswith("0.88")
    peer = {"committed_per_s": 1_000.0, "cpu_us_per_commit": 100.0}
    r["phases"]["peer"] = {
        "rows": [
            {
                "workers": 2,
                "connections": 64,
                "buckets": 16,
                "target": 3.0,
                "ratio": 3.2,
                "gate": {"committed_per_s": 3_200.0, "cpu_us_per_commit": 120.0},
                "lean": peer,
            },
            {
                "workers": 1,
                "connections": 64,
                "buckets": 16,
                "target": 1.5,
                "ratio": 1.4,
                "gate": {"committed_per_s": 1_400.0, "cpu_us_per_commit": 130.0},
                "lean": peer,
            },
        ]
    }
    r["phases"]["expiry"] = {
        "holds": 50_000,
        "elapsed_s": 4.0,
        "holds_per_s": 12_500.0,
        "cpu_us_per_hold": 40.0,
        "released_all": True,
        "invariant_ok": True,
        "breaches": [],
        "target": 10_000,
    }
    verdicts = {x["target"]: x["ok"] for x in report.verdicts(r)}
    peer_rows = [ok for target, ok in verdicts.items() if "lean DB-only peer" in target]
    assert peer_rows == [True, False]
    expiry = [ok for target, ok in verdicts.items() if target.startswith("expiry inside")]
    assert expiry == [True]
