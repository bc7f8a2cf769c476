"""A waiting buyer's chance (docs/waiting-room.md, "Your chance"): pure, no I/O.

    every second, per deal (the room loop, one process at a time):
        the rings (gate/room/conversion.py) + avail ──> measure() ──> Sale
        Sale ──> build() ──> Table (a few hundred numbers, published for every process)
    every ticket read:
        Table + position ──> chance() ──> {"p", "basis"} | None

What p is. The probability that this buyer, staying in line and reserving once
admitted, finds a unit: gets a hold, now or later in the sale. The room is FIFO, so
the buyer at position k finds one when the buyers ahead of them take for good fewer
units than the sale still has:

    pool     R = available + units held and not yet paid (a lapsed hold returns its unit)
    ahead    X = sum over every hold not yet paid:   q x Bernoulli(P(paid | unpaid, its age))
               + sum over every admission unspent:  q x Bernoulli(P(holds | unspent, age) x pay)
               + sum over the k - 1 waiting ahead:  q x Bernoulli(stay_j x convert x pay)
    p(k) = P(X <= R - 1)

q is a hold's quantity (moments measured from the holds ring), `convert` the share of
admissions that become a hold before the admission TTL, `pay` the share of holds paid
before they lapse (both conversion.Stage posteriors), stay_j the chance that the j-th
buyer ahead is still in line when their turn comes: leaving is a hazard per second of
waiting, measured over the tickets that were likely when they left; the buyers ahead
that the units available now will serve wait j / (the admissions per second lately),
the others until the unpaid holds would lapse (the units' mean remaining hold). A
hold that would lapse after the sale ends never comes back: it counts as taken.

The stages are posteriors, not point estimates: early in a sale the holds are too
young to show how many will be paid. p is computed at the posterior mean, and the
spread of the stages (the mean of X moves with them) is added to X's variance (the
law of total variance), so an uncertain sale shows a wider band of middling p, not a
confident one that swings from second to second. The exact path (small pools) uses
the posterior means only.

Too little to go on: p is None while fewer than MIN_EVIDENCE admissions of the window
have been out for EVIDENCE_AGE_SECONDS (a conversion could not yet have been seen),
or while the room's state is missing. Two cases need no data and are answered at
once: a buyer whose place is within the units available even if every buyer ahead,
waiting or admitted, took the most a buyer may (p = 1), and one behind a pool that is
empty with nothing to come back (p = 0).

Cost. `build` (once per second per deal) samples p at no more than TABLE_POINTS
positions: exactly (dynamic programming over the pool) when the pool is at most
EXACT_POOL_MAX units, else by the normal approximation with continuity and skewness
corrections (tests/room/test_chance.py measures its error against the exact sum).
`chance` (per read) interpolates in that table: no fitting, no loops.

In Redis: the rings and their writers are in gate/room/conversion.py. The estimate
loop (gate/room/estimate.py) reads the rings and `avail` once per second per deal
under a work lease, builds the table and writes it to the room's hash ("ch": start,
step, the values to 4 places, units_left, in_flight, conversion, sure_until, pool;
"chat": when); each gate process holds it a second (`Table.from_fields`) and
interpolates for a ticket's position. Unspent admissions and unpaid holds by age are
the open part of each ring's cohorts (n - k, u - w - x): no per-order index is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gate.room.conversion import (
    ADMISSION_PRIOR,
    ADMISSION_SLOT_MS,
    HOLD_SLOT_MS,
    PAY_PRIOR,
    Cohort,
    Ring,
    Stage,
    bands,
    fit,
)

__all__ = ["MIN_EVIDENCE", "Quantity", "Sale", "Table", "build", "chance", "measure"]

# Too little to go on: fewer than this many admissions of the window out this long.
MIN_EVIDENCE = 20
EVIDENCE_AGE_SECONDS = 30.0
# Leaving: no leave seen yet over this many ticket-seconds is taken as no hazard.
LEAVE_PRIOR_EXPOSURE_SECONDS = 600.0
# A hold's quantity before any hold is seen: 1, worth this many holds.
QUANTITY_PRIOR_WEIGHT = 5.0
# The table: p sampled at most at this many positions between the last where
# p >= 1 - EDGE and the first where p <= EDGE; beyond, p is 1 or 0 (shown to 3 places).
TABLE_POINTS = 256
EDGE = 0.0005
# Exact (dynamic programming) up to this pool; the normal approximation above it.
EXACT_POOL_MAX = 32
# Positions searched at most (a queue longer than this reads the last value), and
# walked at most by the exact sum.
POSITION_MAX = 10_000_000
EXACT_POSITIONS_MAX = 20_000
# The admissions per second "lately" (the pace of the waiting buyers ahead).
PACE_WINDOW_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Quantity:
    """Moments of a hold's quantity: E[q], E[q^2], and the most a buyer may take."""

    m1: float
    m2: float
    most: int


@dataclass(frozen=True, slots=True)
class Sale:
    """What `build` needs, from the rings (`measure`) or written by hand in tests."""

    available: int
    admit: Stage
    pay: Stage
    quantity: Quantity
    # (age s, admissions) unspent, and (age s, holds, units) unpaid, by slot.
    admissions: tuple[tuple[float, float], ...]
    holds: tuple[tuple[float, float, float], ...]
    # Leaving: a hazard per second of waiting, and the admissions per second lately
    # (the j-th buyer ahead waits about j / rate).
    leave_per_second: float
    admit_per_second: float
    # Seconds until the sale ends (None: no end): a hold lapsing later never comes back.
    sale_left_s: float | None
    # Admissions at least EVIDENCE_AGE_SECONDS old in the window (the evidence rule).
    seasoned: int


def measure(
    now_ms: int,
    available: int,
    admissions: Ring,
    holds: Ring,
    admission_ttl_s: float,
    hold_s: float,
    most_per_order: int,
    sale_left_s: float | None = None,
) -> Sale:
    """A deal's `Sale` from its two rings and its available count."""
    adm_cohorts: list[Cohort] = []
    open_adm: list[tuple[float, float]] = []
    seasoned = 0
    leaves = exposure = recent = 0.0
    for lo, hi, v in admissions.slots(now_ms):
        n, k = v.get("n", 0), v.get("k", 0)
        leaves += v.get("lv", 0)
        exposure += v.get("ex", 0)
        if n:
            adm_cohorts.append(admissions.cohort(lo, hi, v))
            if lo >= EVIDENCE_AGE_SECONDS:
                seasoned += n
            if hi <= PACE_WINDOW_SECONDS:
                recent += n
            if n - k > 0 and lo < admission_ttl_s:
                open_adm.append(((lo + hi) / 2, float(n - k)))
    hold_cohorts: list[Cohort] = []
    open_holds: list[tuple[float, float, float]] = []
    holds_n = units = units2 = 0.0
    for lo, hi, v in holds.slots(now_ms):
        n, k = v.get("n", 0), v.get("k", 0)
        if not n:
            continue
        hold_cohorts.append(holds.cohort(lo, hi, v))
        holds_n += n
        units += v.get("u", n)
        units2 += v.get("v", n)
        left_units = v.get("u", n) - v.get("w", k) - v.get("x", 0)
        if left_units > 0 and lo < hold_s:
            open_holds.append(((lo + hi) / 2, float(max(0, n - k)), float(left_units)))
    w = QUANTITY_PRIOR_WEIGHT
    quantity = Quantity((units + w) / (holds_n + w), (units2 + w) / (holds_n + w), most_per_order)
    admit = fit(bands(adm_cohorts, ADMISSION_SLOT_MS / 1000), admission_ttl_s, ADMISSION_PRIOR)
    pay = fit(bands(hold_cohorts, HOLD_SLOT_MS / 1000), hold_s, PAY_PRIOR)
    return Sale(
        available=max(0, available),
        admit=admit,
        pay=pay,
        quantity=quantity,
        admissions=tuple(open_adm),
        holds=tuple(open_holds),
        leave_per_second=leaves / (exposure + LEAVE_PRIOR_EXPOSURE_SECONDS),
        admit_per_second=recent / PACE_WINDOW_SECONDS,
        sale_left_s=sale_left_s,
        seasoned=seasoned,
    )


# -- the table ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Table:
    """p by position for one deal at one moment, and the basis shown with it."""

    units_left: int
    in_flight: int
    conversion: float
    start: int  # p(position) = values[0] for position <= start
    step: int
    values: tuple[float, ...]
    known: bool  # False: too little to go on (only certain answers are given)
    sure_until: int  # positions up to this find a unit whatever anyone ahead does
    pool: int

    def as_fields(self) -> dict[str, str]:
        """The table as the room's hash keeps it (field "ch"), values to 4 places."""
        head = (
            self.units_left,
            self.in_flight,
            self.conversion,
            self.start,
            self.step,
            int(self.known),
            self.sure_until,
            self.pool,
        )
        values = ",".join(f"{v:.4f}".rstrip("0").rstrip(".") or "0" for v in self.values)
        return {"ch": "|".join(str(h) for h in head) + "|" + values}

    @classmethod
    def from_fields(cls, raw: str | bytes) -> Table:
        text = raw.decode() if isinstance(raw, bytes) else raw
        units_left, in_flight, conversion, start, step, known, sure, pool, values = text.split("|")
        return cls(
            int(units_left),
            int(in_flight),
            float(conversion),
            int(start),
            int(step),
            tuple(float(v) for v in values.split(",")),
            known == "1",
            int(sure),
            int(pool),
        )

    def p(self, position: int) -> float | None:
        if position <= self.sure_until:
            return 1.0
        if self.pool <= 0:
            return 0.0
        if not self.known:
            return None
        if position <= self.start:
            return self.values[0]
        x = (position - self.start) / self.step
        i = int(x)
        if i >= len(self.values) - 1:
            return self.values[-1]
        frac = x - i
        return self.values[i] * (1 - frac) + self.values[i + 1] * frac


@dataclass(frozen=True, slots=True)
class _Parts:
    """The units taken for good by the pool's holders and by the admitted, as moments
    (mean, variance, third central moment) and as items for the exact sum."""

    mean: float
    var: float
    k3: float
    items: tuple[tuple[float, float, float], ...]  # (P(take), count, mean quantity)
    certain_units: float  # units sure to be taken (holds lapsing after the sale ends)
    hold_taken: float  # expected units the unpaid holds keep (certain ones included)


def _moments(p: float, q: Quantity) -> tuple[float, float, float]:
    m1, m2 = q.m1, q.m2
    m3 = m2 * m2 / m1 if m1 > 0 else 0.0
    e1, e2, e3 = p * m1, p * m2, p * m3
    return e1, e2 - e1 * e1, e3 - 3 * e1 * e2 + 2 * e1**3


def _parts(sale: Sale) -> _Parts:
    mean = var = k3 = certain = taken = 0.0
    items: list[tuple[float, float, float]] = []
    pay, q = sale.pay, sale.quantity
    for age, count, units in sale.holds:
        per_hold = units / count if count > 0 else 1.0
        if sale.sale_left_s is not None and pay.deadline_s - age > sale.sale_left_s:
            certain += units  # it cannot lapse before the sale ends
            taken += units
            continue
        w = pay.later(age)
        hq = Quantity(per_hold, q.m2 * (per_hold / q.m1) ** 2, q.most)
        e1, v, t = _moments(w, hq)
        mean += count * e1
        var += count * v
        k3 += count * t
        taken += count * e1
        items.append((w, count, per_hold))
    returns = sale.sale_left_s is None or pay.deadline_s <= sale.sale_left_s
    for age, count in sale.admissions:
        w = sale.admit.later(age) * (pay.share if returns else 1.0)
        e1, v, t = _moments(w, q)
        mean += count * e1
        var += count * v
        k3 += count * t
        items.append((w, count, q.m1))
    return _Parts(mean, var, k3, tuple(items), certain, taken)


@dataclass(frozen=True, slots=True)
class _Spread:
    """How the mean of X moves with the stages' posteriors: X's mean is U + V x S1,
    U the units the holders and the admitted keep, V = q x convert x pay per buyer
    ahead, S1 the buyers ahead weighted by their staying; their variances and
    covariance over the posteriors (the stages are independent)."""

    var_u: float
    var_v: float
    cov: float

    def at(self, s1: float) -> float:
        return max(0.0, self.var_u + s1 * s1 * self.var_v + 2 * s1 * self.cov)


def _spread(sale: Sale) -> _Spread:
    pay, admit, m = sale.pay, sale.admit, sale.quantity.m1
    lapsing = [
        (age, units)
        for age, _, units in sale.holds
        if sale.sale_left_s is None or pay.deadline_s - age <= sale.sale_left_s
    ]

    def moments(stage: Stage, items: list[tuple[float, float]]) -> tuple[float, ...]:
        """E[T], E[T^2], E[s], E[s^2], E[T s] for T = sum of count x later(age)."""
        e_t = e_t2 = e_s = e_s2 = e_ts = 0.0
        for part in stage.parts:
            t = dt = 0.0
            for age, count in items:
                t += count * part.later(age, stage.deadline_s)
                dt += count * part.later_slope(age, stage.deadline_s)
            var_s = part.spread**2
            w = part.weight
            e_t += w * t
            e_t2 += w * (t * t + dt * dt * var_s)
            e_s += w * part.share
            e_s2 += w * (part.share**2 + var_s)
            e_ts += w * (t * part.share + dt * var_s)
        return e_t, e_t2, e_s, e_s2, e_ts

    e_h, e_h2, e_p, e_p2, e_hp = moments(pay, lapsing)
    e_a, e_a2, e_c, e_c2, e_ac = moments(admit, list(sale.admissions))
    var_u = (e_h2 - e_h * e_h) + m * m * (e_a2 * e_p2 - e_a * e_a * e_p * e_p)
    var_u += 2 * m * e_a * (e_hp - e_h * e_p)
    var_v = m * m * (e_c2 * e_p2 - e_c * e_c * e_p * e_p)
    cov = m * e_c * (e_hp - e_h * e_p) + m * m * (e_ac * e_p2 - e_a * e_c * e_p * e_p)
    return _Spread(var_u, var_v, cov)


def _normal_cdf(x: float, mean: float, var: float, k3: float) -> float:
    """P(S <= x) for an integer S: normal with continuity and skewness corrections."""
    if var <= 1e-12:
        return 1.0 if x + 1e-9 >= mean else 0.0
    sd = math.sqrt(var)
    t = (x + 0.5 - mean) / sd
    phi = math.exp(-t * t / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * math.erfc(-t / math.sqrt(2))
    gamma = k3 / (sd**3)
    return min(1.0, max(0.0, cdf + gamma * (1 - t * t) * phi / 6))


class _Ahead:
    """Sums over the waiting buyers ahead: the j-th (j >= 1) takes a unit for good
    with probability rho_j x stay_j. The first `first` buyers ahead are admitted at
    the room's pace (wait_j = j / rate: stay_j = exp(-beta j), rho_j = `near`); those
    behind them only when units come back, after `far_s` seconds (stay_j =
    exp(-hazard far_s), rho_j = `far`). rho is convert x pay, or convert alone where
    a hold made then would lapse only after the sale ends (its unit never returns)."""

    def __init__(
        self,
        near: float,
        far: float,
        hazard: float,
        rate: float,
        first: float,
        far_s: float,
        m1: float,
    ) -> None:
        self.near_rho, self.far_rho, self.m1 = near, far, m1
        self.beta = hazard / max(rate, 0.1)
        self.first = max(0, math.floor(first))
        self.far = math.exp(-hazard * max(far_s, self.first / max(rate, 0.1)))
        self.rho = near  # for the spread: the typical buyer ahead

    def take(self, j: int) -> float:
        """P(the j-th buyer ahead takes a unit for good)."""
        if j <= self.first:
            return self.near_rho * math.exp(-self.beta * j)
        return self.far_rho * self.far

    def geometric(self, n: int, power: int) -> float:
        """sum over j = 1..n of (rho_j stay_j / rho) ** power: the buyers ahead,
        weighted by their chance to take a unit, relative to `rho`."""
        if n <= 0:
            return 0.0
        near = min(n, self.first)
        b = self.beta * power
        if near <= 0:
            head = 0.0
        elif b < 1e-12:
            head = float(near)
        else:
            head = math.exp(-b) * -math.expm1(-b * near) / -math.expm1(-b)
        ratio = self.far_rho / self.near_rho if self.near_rho > 0 else 0.0
        return head + max(0, n - near) * (self.far * ratio) ** power

    def moments(self, n: int, q: Quantity) -> tuple[float, float, float]:
        m1, m2 = q.m1, q.m2
        m3 = m2 * m2 / m1 if m1 > 0 else 0.0
        rho = self.rho
        s1, s2, s3 = self.geometric(n, 1), self.geometric(n, 2), self.geometric(n, 3)
        mean = m1 * rho * s1
        var = m2 * rho * s1 - m1 * m1 * rho * rho * s2
        k3 = m3 * rho * s1 - 3 * m1 * m2 * rho * rho * s2 + 2 * m1**3 * rho**3 * s3
        return mean, var, k3


def build(sale: Sale) -> Table:
    """The table of one deal at one moment."""
    q = sale.quantity
    parts = _parts(sale)
    held_units = sum(units for _, _, units in sale.holds)
    pool = sale.available + round(held_units)
    in_flight = round(sum(c for _, c in sale.admissions))
    # Sure: the buyer at position k finds a unit even if all the k - 1 ahead and all
    # the admitted took the most a buyer may (unpaid holds already have theirs).
    most = max(1, q.most)
    sure_until = 0
    if sale.available >= 1:
        sure_until = max(0, (sale.available - 1) // most - in_flight + 1)
    rho = sale.admit.share * sale.pay.share
    units_left = max(0, round(sale.available + held_units - parts.hold_taken))
    known = sale.seasoned >= MIN_EVIDENCE and pool > 0
    limit = pool - 1 - parts.certain_units  # the rest may take at most this many
    if not known or limit < 0:
        values: tuple[float, ...] = (0.0,)
        return Table(units_left, in_flight, round(rho, 3), 0, 1, values, known, sure_until, pool)
    # Who is admitted soon: the buyers ahead the units available now will serve (those
    # admitted take their share first); the rest wait for holds to lapse.
    in_flight_units = sum(sale.admit.later(age) * c for age, c in sale.admissions) * q.m1
    first = (sale.available - in_flight_units) / max(sale.admit.share * q.m1, 1e-6)
    lapsing = [
        (u, sale.pay.deadline_s - age) for age, _, u in sale.holds if age < sale.pay.deadline_s
    ]
    far_s = sum(u * r for u, r in lapsing) / sum(u for u, _ in lapsing) if lapsing else 0.0
    hold_s = sale.pay.deadline_s
    left = sale.sale_left_s

    def kept(wait_s: float) -> float:
        """convert x (pay, or 1 where a hold made after `wait_s` lapses too late)."""
        returns = left is None or wait_s + hold_s <= left
        return sale.admit.share * (sale.pay.share if returns else 1.0)

    near = kept(0.0)
    ahead = _Ahead(
        near, kept(far_s), sale.leave_per_second, sale.admit_per_second, first, far_s, q.m1
    )
    if pool <= EXACT_POOL_MAX:
        values, start, step = _exact(parts, ahead, int(limit))
    else:
        values, start, step = _approx(parts, ahead, q, limit, _spread(sale))
    return Table(units_left, in_flight, round(rho, 3), start, step, values, True, sure_until, pool)


def _approx(
    parts: _Parts, ahead: _Ahead, q: Quantity, limit: float, spread: _Spread
) -> tuple[tuple[float, ...], int, int]:
    def p_at(position: int) -> float:
        m, v, t = ahead.moments(position - 1, q)
        wide = spread.at(ahead.geometric(position - 1, 1))
        return _normal_cdf(limit, parts.mean + m, parts.var + v + wide, parts.k3 + t)

    first = _search(p_at, 1 - EDGE, POSITION_MAX)
    last = _search(p_at, EDGE, POSITION_MAX)
    return _sample(p_at, first, last)


def _search(p_at: Callable[[int], float], below: float, most: int) -> int:
    """The first position in 1..most where p_at(position) < below (p falls with the
    position), or `most`."""
    if p_at(1) < below:
        return 1
    hi = 2
    while hi < most and p_at(hi) >= below:
        hi *= 2
    hi = min(hi, most)
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if p_at(mid) < below:
            hi = mid
        else:
            lo = mid
    return hi


def _sample(
    p_at: Callable[[int], float], first: int, last: int
) -> tuple[tuple[float, ...], int, int]:
    """p at TABLE_POINTS positions at most, evenly from just before `first` to `last`."""
    start = max(1, first - 1)
    step = max(1, -(-max(1, last - start) // (TABLE_POINTS - 1)))
    values = [p_at(start)]
    position = start
    while position < last:
        position += step
        values.append(p_at(position))
    return tuple(values), start, step


def _exact(parts: _Parts, ahead: _Ahead, limit: int) -> tuple[tuple[float, ...], int, int]:
    """A small pool: P(X <= limit) by dynamic programming over every taker, position
    after position; each taker's quantity is one or two values matching its mean."""
    size = limit + 1
    pmf = [0.0] * size
    pmf[0] = 1.0

    def take(pmf: list[float], w: float, m1: float) -> list[float]:
        if w <= 0:
            return pmf
        low = max(1, int(m1))
        upper = min(1.0, max(0.0, m1 - low))  # P(q = low + 1)
        out = [x * (1 - w) for x in pmf]
        for units, share in ((low, 1 - upper), (low + 1, upper)):
            ws = w * share
            if ws > 0:
                for x in range(size - units):
                    out[x + units] += pmf[x] * ws
        return out

    for w, count, m1 in parts.items:
        for _ in range(round(count)):
            pmf = take(pmf, w, m1)
    values = [sum(pmf)]  # values[i]: p at position i + 1
    while values[-1] > EDGE and len(values) < EXACT_POSITIONS_MAX:
        w = ahead.take(len(values))
        if w < 1e-9:
            break
        pmf = take(pmf, w, ahead.m1)
        values.append(sum(pmf))

    def p_at(position: int) -> float:
        return values[min(position, len(values)) - 1]

    first = _search(p_at, 1 - EDGE, len(values))
    return _sample(p_at, first, len(values))


# -- per read -----------------------------------------------------------------------------


def chance(table: Table | None, position: int) -> dict[str, object] | None:
    """A waiting ticket's "chance": {"p", "basis": {"units_left", "ahead",
    "conversion"}}, or None while the room has too little to go on."""
    if table is None:
        return None
    p = table.p(position)
    if p is None:
        return None
    return {
        "p": round(min(1.0, max(0.0, p)), 3),
        "basis": {
            "units_left": table.units_left,
            "ahead": max(0, position - 1) + table.in_flight,
            "conversion": table.conversion,
        },
    }
