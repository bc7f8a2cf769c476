"""The automatic admission rate (gate/room/steering.py), pure: the bound it gives the
room, the risk it lets an admitted buyer run, the database's ceiling (AIMD) and the
reasons it gives."""

from __future__ import annotations

import math
import random

import pytest

from gate.room import steering
from gate.room.chance import Quantity
from gate.room.conversion import Stage
from gate.room.steering import Decision, Health, Steer

NOW_MS = 1_700_000_123_456
ONE = Quantity(1.0, 1.0, 1)
HEALTHY = Health()
SLOW = Health(commit_p99_ms=400.0)
# Three quarters of admitted buyers reserve, median 4 s; thousands of admissions seen.
MEASURED = Stage.point(0.75, 4.0, 120.0, 2000.0, sigma=0.9)


def decide(
    available: int,
    admissions: tuple[tuple[float, float], ...] = (),
    *,
    stage: Stage | None = MEASURED,
    evidence: float = 2000.0,
    health: Health = HEALTHY,
    steer: Steer | None = None,
    now_ms: int = NOW_MS,
    admitted: int = 0,
    cap: int = 1000,
    quantity: Quantity = ONE,
) -> Decision:
    return steering.decide(
        now_ms=now_ms,
        available=available,
        admissions=admissions,
        stage=stage,
        evidence=evidence,
        quantity=quantity,
        admitted_last_second=admitted,
        health=health,
        max_admit_per_second=cap,
        steer=steer,
        deadline_s=120.0,
    )


def young_of(d: Decision, admissions: tuple[tuple[float, float], ...]) -> float:
    """The admissions the room counts against the bound (given at or after the cut)."""
    cut_age = (NOW_MS - d.young_from_ms) / 1000
    return sum(c for age, c in admissions if age < cut_age)


def test_with_too_little_evidence_the_bound_is_the_fixed_rooms_at_ratio_1() -> None:
    d = decide(100, ((5.0, 30.0),), evidence=5)
    assert (d.reason, d.ratio, d.offset, d.bound) == ("learning", 1.0, 0.0, 100)
    assert young_of(d, ((5.0, 30.0), (100.0, 10.0))) == 40  # every admission counts


def test_buyers_who_never_reserve_stop_holding_units_back() -> None:
    # 100 units, 120 admissions out for 60 s (old: most who reserve would have).
    old = ((60.0, 120.0),)
    d = decide(100, old)
    assert d.reason == "filling"
    assert young_of(d, old) == 0
    # Room for about 100 / 0.75 fresh admissions, less a margin.
    assert 100 < d.bound < 134
    # The fixed room (unspent <= ceil(available x 1)) admits nobody until they lapse.
    assert math.ceil(100 * 1.0) - 120 < 0


def test_an_admitted_buyer_risks_sold_out_at_most_eps() -> None:
    """Monte Carlo of the admissions the decision allows: the last one admitted meets
    SOLD_OUT (everything taken by those before it) at most EPS_MARGIN of the time."""
    rng = random.Random(2)
    for units, out in ((3, ((50.0, 40.0),)), (40, ((2.0, 10.0), (70.0, 60.0))), (300, ())):
        d = decide(units, out)
        new = d.bound - int(young_of(d, out))
        assert new > 0
        weights = [(MEASURED.later(age), int(c)) for age, c in out]
        runs, last_out = 4000, 0
        for _ in range(runs):
            taken = sum(sum(rng.random() < w for _ in range(c)) for w, c in weights)
            taken += sum(rng.random() < MEASURED.share for _ in range(new - 1))
            last_out += taken >= units
        assert last_out / runs <= steering.EPS_MARGIN + 3 * math.sqrt(0.05 * 0.95 / runs)


def test_the_bound_falls_with_every_unit_taken_between_decisions() -> None:
    d = decide(200, ((3.0, 100.0),))
    young = young_of(d, ((3.0, 100.0),))
    room_now = math.floor(200 * d.ratio + d.offset + 1e-9) - young
    # Ten reservations: ten units and ten young admissions gone; nobody replaces them
    # one for one (each unit was worth 1 / 0.75 admissions).
    room_after = math.floor(190 * d.ratio + d.offset + 1e-9) - (young - 10)
    assert room_after < room_now
    assert d.ratio == pytest.approx(1 / 0.75)  # a point stage: no spread to add


def test_the_young_cut_sits_on_a_slot_boundary() -> None:
    for now in (NOW_MS, NOW_MS + 1, NOW_MS + 999):
        d = decide(100, ((3.0, 10.0),), now_ms=now)
        assert d.young_from_ms % 1000 == 0
        assert now - d.young_from_ms >= 1000 * MEASURED.horizon(steering.YOUNG_SHARE) - 1000


def test_the_ceiling_starts_low_and_doubles_until_the_database_shows_its_limit() -> None:
    steer = None
    rates = []
    for i in range(6):
        d = decide(5000, steer=steer, now_ms=NOW_MS + 1000 * i)
        steer = d.steer
        rates.append(d.rate)
    assert rates == [200, 400, 800, 1000, 1000, 1000]  # 10 % of the cap, doubled
    cut = decide(5000, admitted=800, health=SLOW, steer=steer, now_ms=NOW_MS + 7000)
    assert cut.rate == 400 and not cut.steer.probing
    after = decide(5000, steer=cut.steer, now_ms=NOW_MS + 8000)
    assert after.rate == 450  # additive from then on


def test_a_slow_database_halves_the_ceiling_and_a_healthy_one_grows_it_back() -> None:
    first = decide(500, admitted=400, health=SLOW, cap=1000, steer=Steer(1000.0))
    assert first.steer.ceiling == 200  # half of the 400 admitted last second
    assert first.rate == 200 and first.reason == "db_backoff"
    # Within CUT_HOLD_SECONDS no second cut: the signal lags the admissions.
    again = decide(500, admitted=200, health=SLOW, steer=first.steer, now_ms=NOW_MS + 1000)
    assert again.steer.ceiling == 200
    later = decide(500, admitted=200, health=SLOW, steer=again.steer, now_ms=NOW_MS + 2500)
    assert later.steer.ceiling == 100
    # Healthy: + INCREASE_SHARE of the cap a second, back to the cap.
    steer = later.steer
    rates = []
    for i in range(30):
        d = decide(500, steer=steer, now_ms=NOW_MS + 3000 + 1000 * i)
        steer = d.steer
        rates.append(d.rate)
    assert rates[0] == 150 and rates[1] == 200 and rates[-1] == 1000
    assert d.reason == "filling"


@pytest.mark.parametrize(
    "health",
    [Health(overloaded=1), Health(pool_waits=3), Health(commit_p99_ms=251.0)],
)
def test_each_signal_of_a_database_at_its_limit_backs_off(health: Health) -> None:
    assert decide(500, admitted=300, health=health, steer=Steer(1000.0)).steer.ceiling == 150


def test_a_p99_at_the_limit_is_healthy() -> None:
    steer = Steer(1000.0, probing=False)
    assert decide(500, health=Health(commit_p99_ms=250.0), steer=steer).steer.ceiling == 1000


def test_reasons() -> None:
    assert decide(0).reason == "no_units"
    assert decide(0).bound == 0
    full = decide(10, ((1.0, 40.0),))
    assert full.reason == "in_flight_full" and full.bound <= 40
    assert decide(5000, cap=100, steer=Steer(100.0)).reason == "cap"
    assert decide(5000, cap=100, steer=Steer(100.0)).rate == 100


def test_a_tiny_conversion_is_capped_at_auto_ratio_max() -> None:
    rare = Stage.point(0.05, 4.0, 120.0, 5000.0)
    d = decide(100, stage=rare)
    assert d.ratio == steering.AUTO_RATIO_MAX


def test_two_unit_buyers_count_twice() -> None:
    pairs = Quantity(2.0, 4.0, 2)
    assert decide(100, quantity=pairs).bound < decide(100).bound * 0.6
