"""The waiting-room simulation (loadtest/room_sim.py), small and in process: the
automatic rate disappoints at most 2 % of admissions, answers no 503, sells out
within 1.25x the best fixed rate of a sweep, and the chance it shows is calibrated;
the same seed gives the same sale. Outcomes of the simulated sale, never timings of
this machine."""

from __future__ import annotations

import math
import subprocess
import sys

import orjson

from loadtest import room_sim
from tests.support import ROOT

SMALL = room_sim.Params(
    units=100,
    buyers=1200,
    join_seconds=20.0,
    hold_s=120.0,
    sale_s=400.0,
    snapshot_s=45.0,
)
SEED = 3


def test_auto_disappoints_few_and_sells_out_near_the_best_fixed_rate() -> None:
    got = room_sim.run_seed(SMALL, SEED, (20, 100, 500))
    auto: room_sim.Result = got["auto"]
    assert auto.admissions > SMALL.units
    assert auto.disappointed_share <= room_sim.DISAPPOINTED_MAX
    assert auto.overloaded == 0
    assert auto.held_units >= SMALL.units
    best = got["best"]
    assert best is not None and best.sellout_s < math.inf
    assert auto.sellout_s <= room_sim.SELLOUT_RATIO_MAX * best.sellout_s


def test_the_chance_shown_is_calibrated() -> None:
    auto = room_sim.Sale(SMALL, SEED, "auto").run()
    report = room_sim.calibration(auto.shown)
    assert report["buyers"] > 300
    checked = [row for row in report["tenths"] if row["checked"]]
    assert checked  # at least the near-certain tenths hold 100 buyers
    assert report["ok"], report["tenths"]
    assert report["brier"] is not None and report["brier"] < 0.1
    # Every p shown is a probability, and the buyers at the back were told so.
    assert all(0.0 <= p <= 1.0 for p, _ in auto.shown)
    assert any(p < 0.02 for p, _ in auto.shown)


def test_a_seed_is_one_sale() -> None:
    one = room_sim.Sale(SMALL, 5, 50).run()
    two = room_sim.Sale(SMALL, 5, 50).run()
    assert (one.admissions, one.sellout_s, one.shown) == (two.admissions, two.sellout_s, two.shown)
    other = room_sim.Sale(SMALL, 6, 50).run()
    assert other.shown != one.shown


def test_a_slow_database_makes_auto_back_off() -> None:
    slow = room_sim.Params(
        units=100, buyers=800, join_seconds=10.0, hold_s=120.0, sale_s=200.0,
        db_commits_per_second=4.0, db_pool=2, db_pool_timeout_s=2.0,
    )  # fmt: skip
    auto = room_sim.Sale(slow, SEED, "auto").run()
    assert auto.reasons.get("db_backoff", 0) > 0
    fixed = room_sim.Sale(slow, SEED, 1000).run()
    # The same crowd at a fixed 1,000/s meets a database as slow: more refusals.
    assert auto.overloaded <= fixed.overloaded


def test_the_command_prints_its_report_as_json() -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "loadtest", "room-sim", "--seeds", "1", "--units", "40",
            "--buyers", "400", "--join-seconds", "10", "--hold-s", "60", "--sale-s", "200",
            "--rates", "50,500", "--json",
        ],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    report = orjson.loads(done.stdout)
    (seed,) = report["seeds"]
    assert seed["seed"] == 1 and seed["admissions"] > 40
    assert {"worst_disappointed_pct", "overloaded", "worst_ratio", "targets_met"} <= set(
        report["summary"]
    )
    assert report["params"]["units"] == 40
