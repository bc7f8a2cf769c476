"""A waiting buyer's chance (gate/room/chance.py, gate/room/conversion.py), pure: the
rings as Redis keeps them, the conversion stages' fit, the table against an exact sum
and a Monte Carlo of the model it states, and the cases it answers without data."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from gate.room import chance, conversion
from gate.room.chance import Quantity, Sale
from gate.room.conversion import Cohort, Ring, Stage

NOW_MS = 1_700_000_123_456
ONE = Quantity(1.0, 1.0, 1)


def sale(
    available: int,
    *,
    holds: tuple[tuple[float, float, float], ...] = (),
    admissions: tuple[tuple[float, float], ...] = (),
    admit: Stage | None = None,
    pay: Stage | None = None,
    quantity: Quantity = ONE,
    leave: float = 0.0,
    rate: float = 10.0,
    left: float | None = None,
    seasoned: int = 500,
) -> Sale:
    return Sale(
        available=available,
        admit=admit or Stage.point(0.75, 5.0, 120.0, 1000.0),
        pay=pay or Stage.point(0.8, 60.0, 600.0, 1000.0),
        quantity=quantity,
        admissions=admissions,
        holds=holds,
        leave_per_second=leave,
        admit_per_second=rate,
        sale_left_s=left,
        seasoned=seasoned,
    )


def monte_carlo(s: Sale, position: int, runs: int, seed: int = 5) -> float:
    """P(buyer at `position` finds a unit) drawn from the model the module states."""
    rng = random.Random(seed)
    pool = s.available + sum(u for _, _, u in s.holds)
    found = 0
    rho = s.admit.share * s.pay.share
    ahead = chance._Ahead(
        rho,
        rho,
        s.leave_per_second,
        s.admit_per_second,
        (s.available - sum(s.admit.later(a) * c for a, c in s.admissions) * s.quantity.m1)
        / (s.admit.share * s.quantity.m1),
        (sum(u * (s.pay.deadline_s - a) for a, _, u in s.holds) / sum(u for _, _, u in s.holds))
        if s.holds
        else 0.0,
        s.quantity.m1,
    )
    low = int(s.quantity.m1)
    upper = s.quantity.m1 - low
    for _ in range(runs):
        taken = 0.0
        for age, count, units in s.holds:
            w = s.pay.later(age)
            taken += units / count * sum(rng.random() < w for _ in range(int(count)))

        def q() -> int:
            return low + (1 if rng.random() < upper else 0)

        for age, count in s.admissions:
            w = s.admit.later(age) * s.pay.share
            taken += sum(q() for _ in range(int(count)) if rng.random() < w)
        for j in range(1, position):
            if taken > pool - 1:
                break
            if rng.random() < ahead.take(j):
                taken += q()
        found += taken <= pool - 1
    return found / runs


# -- rings ----------------------------------------------------------------------------


def test_a_ring_reuses_a_slot_only_after_clearing_it_and_reads_back_from_redis() -> None:
    ring = Ring(1000)
    ring.add(NOW_MS, "n", 3)
    ring.add_to(NOW_MS - 10, "k")  # given in the same second: counted
    ring.add_to(NOW_MS - 5000, "k")  # given in a second the ring never held: dropped
    later = NOW_MS + conversion.RING_SLOTS * 1000  # the same index, 256 slots on
    ring.add(later, "n")
    counters = [dict(v) for _, _, v in ring.slots(later)]
    assert counters == [{"n": 1}]  # the old slot's 3 and 1 are gone, not added to
    ring.add_to(NOW_MS, "k")  # a conversion of the reused slot's old cohort: dropped
    assert [dict(v) for _, _, v in ring.slots(later)] == [{"n": 1}]
    copy = Ring.from_hash(1000, {k.encode(): str(v).encode() for k, v in ring.as_hash().items()})
    assert copy.as_hash() == ring.as_hash()


def test_a_rings_slots_report_their_ages() -> None:
    ring = Ring(1000)
    now = (NOW_MS // 1000) * 1000 + 400  # 0.4 s into a slot
    ring.add(now, "n")
    ring.add(now - 3000, "n", 2)
    ages = sorted((round(lo, 3), round(hi, 3), v["n"]) for lo, hi, v in ring.slots(now))
    assert ages == [(0.0, 0.4, 1), (2.4, 3.4, 2)]
    assert ring.slots(now - 10_000) and not list(ring.slots(now + 300_000))


# -- the fit --------------------------------------------------------------------------


def cohorts(share: float, median: float, ages: list[float], per: int, seed: int) -> list[Cohort]:
    """One cohort of `per` items per age (1 s wide), lognormal delays (log-sd 0.8)."""
    rng = random.Random(seed)
    out = []
    for age in ages:
        k, logs, squares = 0, 0.0, 0.0
        for _ in range(per):
            if rng.random() < share:
                d = math.exp(math.log(median) + 0.8 * rng.gauss(0, 1))
                if d <= age - rng.random():  # given within the slot
                    k += 1
                    logs += math.log(d)
                    squares += math.log(d) ** 2
        out.append(Cohort(max(0.0, age - 1), age, per, k, logs, squares))
    return out


def test_the_fit_finds_share_and_delay_while_most_cohorts_are_still_young() -> None:
    # 40 s of admissions, 20 a second, 60 % convert after 8 s (median): the naive
    # share (converted / given) is biased low by the young cohorts; the fit is not.
    data = cohorts(0.6, 8.0, [float(a) for a in range(1, 41)], 20, seed=3)
    naive = sum(c.k for c in data) / sum(c.n for c in data)
    stage = conversion.fit(conversion.bands(data, 1.0), 120.0, conversion.ADMISSION_PRIOR)
    assert naive < 0.52
    assert stage.share == pytest.approx(0.6, abs=0.05)
    best = stage.parts[0]
    assert math.exp(best.mu) == pytest.approx(8.0, rel=0.25)
    assert stage.spread < 0.05
    assert 400 < stage.evidence < 800


def test_the_prior_stands_alone_and_fades_under_evidence() -> None:
    alone = conversion.fit([], 120.0, conversion.ADMISSION_PRIOR)
    assert alone.share == pytest.approx(conversion.ADMISSION_PRIOR.share, abs=0.01)
    assert alone.evidence == 0 and alone.spread > 0.1
    data = cohorts(0.9, 3.0, [float(a) for a in range(30, 90)], 20, seed=4)
    rich = conversion.fit(conversion.bands(data, 1.0), 120.0, conversion.ADMISSION_PRIOR)
    assert rich.share == pytest.approx(0.9, abs=0.03)  # 1,200 against 10 pseudo-observations
    assert rich.spread < 0.02


def test_young_data_leave_the_share_uncertain() -> None:
    """Holds 0-40 s old whose payers take a minute: the data cannot yet tell how many
    will pay; the stage says so, and its spread shrinks as the holds age."""
    spreads = []
    for oldest in (40, 120, 400):
        data = cohorts(0.8, 45.0, [float(a) for a in range(oldest - 39, oldest + 1)], 10, seed=6)
        stage = conversion.fit(conversion.bands(data, 10.0), 600.0, conversion.PAY_PRIOR)
        assert abs(stage.share - 0.8) < 3 * stage.spread + 0.02
        spreads.append(stage.spread)
    assert spreads[0] > spreads[1] > spreads[2]


def test_bands_sit_where_their_unconverted_items_are() -> None:
    many_old = Cohort(30.0, 40.0, 250, 50)
    few_young = Cohort(20.0, 30.0, 100, 20)
    (band,) = conversion.bands([many_old, few_young], 10.0)[-1:]
    assert band.n == 350 and band.k == 70
    assert 31 < (band.lo_s + band.hi_s) / 2 < 33  # (200 x 35 + 80 x 25) / 280


def test_later_falls_with_age_to_nothing_at_the_deadline() -> None:
    stage = Stage.point(0.7, 10.0, 120.0, 100.0)
    values = [stage.later(a) for a in (0, 5, 10, 30, 60, 119.9, 120, 500)]
    assert values[0] == pytest.approx(0.7)
    assert all(a > b for a, b in itertools.pairwise(values[:6]))
    assert values[6] == values[7] == 0.0
    assert 9.8 < stage.horizon(0.5) < 10  # the median, truncated at the deadline


# -- the table ------------------------------------------------------------------------


SALES = [
    sale(40),
    sale(
        60, holds=((30.0, 20.0, 20.0), (400.0, 10.0, 10.0)), admissions=((3.0, 15.0), (50.0, 30.0))
    ),
    sale(150, admissions=((2.0, 60.0),), quantity=Quantity(1.1, 1.3, 2)),
    sale(300, holds=((20.0, 150.0, 160.0),), admissions=((5.0, 100.0),), leave=0.002),
    sale(33, holds=((100.0, 20.0, 20.0),), admit=Stage.point(0.3, 5.0, 120.0, 500.0)),
]


def test_the_normal_approximation_is_within_a_point_of_the_exact_sum() -> None:
    """The error of the table's normal approximation (continuity and skewness
    corrected) against the exact dynamic programme, over whole tables."""
    worst = 0.0
    for s in SALES:
        approx = _build(s, exact=False)
        exact = _build(s, exact=True)
        for position in range(1, 1500):
            a, e = approx.p(position), exact.p(position)
            assert a is not None and e is not None
            worst = max(worst, abs(a - e))
    assert worst < 0.01, worst


def _build(s: Sale, *, exact: bool) -> chance.Table:
    keep = chance.EXACT_POOL_MAX
    chance.EXACT_POOL_MAX = 10**9 if exact else 0
    try:
        return chance.build(s)
    finally:
        chance.EXACT_POOL_MAX = keep


@pytest.mark.parametrize("index", [0, 1, 2, 4])
def test_the_table_is_the_stated_model(index: int) -> None:
    """Against a Monte Carlo of the model: 2,000 draws, so within 4 standard errors."""
    s = SALES[index]
    table = chance.build(s)
    positions = [p for p in range(1, 1500) if 0.05 < (table.p(p) or 0) < 0.95]
    assert positions
    for position in positions[:: max(1, len(positions) // 3)]:
        p = table.p(position)
        assert p is not None
        drawn = monte_carlo(s, position, 2000)
        assert abs(p - drawn) < 4 * math.sqrt(p * (1 - p) / 2000) + 0.01, (position, p, drawn)


def test_p_falls_with_the_position_and_rests_at_0_and_1() -> None:
    table = chance.build(SALES[1])
    values = [table.p(p) for p in range(1, 3000)]
    assert all(v is not None for v in values)
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values))  # type: ignore[operator]
    assert values[0] == 1.0 and values[-1] == pytest.approx(0.0, abs=chance.EDGE)


def test_what_each_part_of_the_model_does() -> None:
    base = chance.build(sale(100))
    k = next(p for p in range(1, 2000) if (base.p(p) or 0) < 0.5)
    # Two units a buyer: the buyers ahead take more.
    pairs = chance.build(sale(100, quantity=Quantity(1.5, 2.5, 2)))
    assert (pairs.p(k) or 0) < (base.p(k) or 0) - 0.3
    # Buyers ahead who leave: more for those behind.
    leaving = chance.build(sale(100, leave=0.01, rate=2.0))
    assert (leaving.p(k) or 0) > (base.p(k) or 0) + 0.2
    # Admissions out: ahead of every waiting buyer.
    admitted = chance.build(sale(100, admissions=((1.0, 40.0),)))
    assert (admitted.p(k) or 0) < (base.p(k) or 0) - 0.3
    # Holds that may lapse: units that may come back, unless the sale ends first.
    held = sale(100, holds=((10.0, 50.0, 50.0),))
    ending = sale(100, holds=((10.0, 50.0, 50.0),), left=60.0)
    assert (chance.build(held).p(k) or 0) > (chance.build(ending).p(k) or 0) + 0.1
    assert chance.build(ending).units_left == 100


def test_too_little_to_go_on_is_none_except_where_no_data_is_needed() -> None:
    thin = sale(10, admissions=((2.0, 3.0),), seasoned=chance.MIN_EVIDENCE - 1)
    table = chance.build(thin)
    # 10 units, 3 admitted ahead: positions 1..7 find one whatever anyone does.
    assert [chance.chance(table, p) is not None for p in (1, 7, 8, 50)] == [
        True,
        True,
        False,
        False,
    ]
    assert chance.chance(table, 7) == {
        "p": 1.0,
        "basis": {"units_left": 10, "ahead": 9, "conversion": 0.6},
    }
    empty = chance.build(sale(0, seasoned=0))
    assert chance.chance(empty, 1) == {
        "p": 0.0,
        "basis": {"units_left": 0, "ahead": 0, "conversion": 0.6},
    }
    assert chance.chance(None, 1) is None


def test_a_ticket_reads_p_to_three_places_with_its_basis() -> None:
    table = chance.build(SALES[3])
    got = chance.chance(table, 400)
    assert got is not None
    p = got["p"]
    assert isinstance(p, float) and 0.0 <= p <= 1.0 and round(p, 3) == p
    basis = got["basis"]
    assert isinstance(basis, dict)
    assert basis["ahead"] == 399 + 100
    assert basis["conversion"] == 0.6
    # 300 available + the 160 held less what the holds are expected to keep.
    assert 300 < basis["units_left"] < 460


def test_an_uncertain_stage_widens_p_around_the_same_middle() -> None:
    sure = Stage.point(0.8, 60.0, 600.0, 1000.0)
    unsure = Stage((conversion.Part(1.0, 0.8, 0.08, math.log(60.0), 1.0),), 600.0, 50.0)
    holds = ((30.0, 300.0, 300.0),)
    sharp = chance.build(sale(100, holds=holds, pay=sure))
    wide = chance.build(sale(100, holds=holds, pay=unsure))
    half = next(p for p in range(1, 3000) if (sharp.p(p) or 0) < 0.5)
    assert wide.p(half) == pytest.approx(sharp.p(half), abs=0.06)
    low = next(p for p in range(half, 3000) if (sharp.p(p) or 0) < 0.05)
    high = next(p for p in range(1, half) if (sharp.p(p) or 0) < 0.95)
    assert (wide.p(low) or 0) > 0.1 and (wide.p(high) or 0) < 0.9


def test_a_table_survives_the_room_hash() -> None:
    table = chance.build(SALES[1])
    copy = chance.Table.from_fields(table.as_fields()["ch"].encode())
    assert (copy.units_left, copy.in_flight, copy.start, copy.step) == (
        table.units_left,
        table.in_flight,
        table.start,
        table.step,
    )
    for position in range(1, 400, 7):
        assert copy.p(position) == pytest.approx(table.p(position), abs=1e-4)


def test_measure_reads_the_rings_the_scripts_write() -> None:
    admissions = Ring(conversion.ADMISSION_SLOT_MS)
    holds = Ring(conversion.HOLD_SLOT_MS)
    rng = random.Random(9)
    given = []
    for i in range(300):  # 300 admissions over 30 s, 70 % reserve after ~3 s
        at = NOW_MS - 71_000 + i * 100  # all at least 40 s old
        admissions.add(at, "n")
        given.append(at)
    for at in given:
        if rng.random() < 0.7:
            spent = at + int(rng.expovariate(1 / 3) * 1000)
            admissions.converted(at, spent)
            holds.add(spent, "n")
            holds.add(spent, "u")
            holds.add(spent, "v")
    s = chance.measure(NOW_MS, 40, admissions, holds, 120.0, 600.0, 1)
    assert s.admit.share == pytest.approx(0.7, abs=0.07)
    assert s.seasoned == 300
    open_ = 300 - sum(v.get("k", 0) for _, _, v in admissions.slots(NOW_MS))
    assert sum(c for _, c in s.admissions) == open_
    # ~200 holds 40-70 s old and not one paid: fewer will be than the prior says.
    assert s.pay.share < conversion.PAY_PRIOR.share - 0.2
    assert s.quantity.m1 == 1.0
