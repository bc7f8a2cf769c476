"""The automatic admission rate ("admit_per_second": "auto"): pure, no I/O.

    every second, per deal (one gate process at a time, under a work lease):
        units available, unspent admissions by age (the admissions ring), the
        admission stage gate/room/chance.py measures, the database's health
            ──> decide() ──> Decision(rate, bound, ratio, offset, young_from_ms, reason)
    room_advance.lua, every GATE_ROOM_INTERVAL_MS, admits while
        unspent admissions given at or after young_from_ms  <  floor(available x ratio + offset)
        and within `rate` admissions per second (its sliding second, as for a fixed rate)

Enough in flight, no more: the bound. An unspent admission of age a still becomes a
hold with probability later(a) (chance.py's cure model): about the measured share
when fresh, little once most buyers who reserve would have. A new admission is given
while the chance that those already out ask for every unit available is at most
EPS_MARGIN, so no admitted buyer risks SOLD_OUT more than that; the chance is exact
(dynamic programming over every admission out) up to EXACT_UNITS_MAX units and by
the normal approximation above. Buyers who never reserve so stop holding units back
once they are old enough to be unlikely to, and a sale is not held back by the
admission TTL as the fixed room's bound (unspent <= available x ratio) holds it.
The conversion used is the measured share raised by Z_CONVERSION posterior standard
deviations (conversion.Stage.spread): little evidence admits fewer, not more. With too
little evidence (chance.MIN_EVIDENCE) the bound is the fixed room's at ratio 1.

Why a ratio, an offset and a cut-off, not a count. The decision is a second old when
the room applies it, and meanwhile each reservation takes units and its admission
out together: the bound falls by `ratio` (the admissions one unit is worth, 1 / the
units a fresh admission asks for) per unit taken while the count falls by one, so the
room does not replace every admission spent since (a plain count would). It is
rounded down, unlike the fixed bound's ceil: a unit coming back between two
decisions must not let two buyers in. Admissions are young from `young_from_ms` (a
slot boundary of the admissions ring, so the room counts exactly the admissions the
decision counted): those older count only through `offset`, by what they are
expected to ask, so their lapsing, or growing old between two decisions, frees
nothing the decision did not mean to free. young_from_ms is the decision time less
the age by which YOUNG_SHARE of the eventual holds are made.

Never more than the database can commit: the rate. The gate processes' 503s, pool
waits and commit latency over the last second (summed, and the worst p99, across
processes) are the database's health. The rate's ceiling starts at START_SHARE of
max_admit_per_second and doubles each healthy second until the database first shows
its limit (slow start: the opening is no burst). Unhealthy (any 503, any pool wait,
or a p99 above the limit, GATE_ROOM_AUTO_COMMIT_P99_MS, 250 by default): it halves
(at most once per CUT_HOLD_SECONDS: reservations follow admissions by seconds, so the
signal lags); healthy after that: it grows by INCREASE_SHARE of max_admit_per_second
a second (AIMD). The ceiling carries from one decision to the next (`Steer`).

Holds not yet paid are not waited for: a unit they hold comes back only if the hold
lapses, and is then available again, and admitted for, like any other.

Reasons (the console's room panel; `detail` has the numbers): "no_units" (nothing
available), "learning" (too little evidence: ratio 1), "in_flight_full" (enough
admitted), "filling" (admitting the shortfall), "cap" (max_admit_per_second binds),
and where the database's ceiling binds: "starting" (slow start), "db_backoff"
(unhealthy), "db_recovering" (growing back).

In Redis (gate/room/estimate.py): the decision is written to the room's hash as
"arate", "aratio", "aoffset", "ayoung" (young_from_ms) and "aat" (Redis ms), the
`Steer` as "aceil", "acut" and "aprobe", the reason and detail as "areason" and
"adetail"; room_advance.lua uses them while "aat" is at most STALE_SECONDS old, else
a tenth of the cap within the fixed bound (a stalled decider never widens the room),
and counts the young unspent with ZCOUNT on the expiry index from young_from_ms + TTL.
The health is each process's last second (gate/base/db_health.py), summed in
gate:room:health:<second>.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gate.room.chance import MIN_EVIDENCE, Quantity
from gate.room.conversion import ADMISSION_SLOT_MS, Stage

COMMIT_P99_LIMIT_MS = 250.0
# A new admission is given while the chance that those already out ask for every
# unit left is at most this (so it is the most any admitted buyer risks meeting
# SOLD_OUT); exactly up to EXACT_UNITS_MAX units left, by the normal approximation
# above. The conversion is taken this many standard errors high.
EPS_MARGIN = 0.01
EXACT_UNITS_MAX = 64
Z_CONVERSION = 1.645
# Never more than this many admissions per unit from here on (a conversion of 1 in 4).
AUTO_RATIO_MAX = 4.0
# A decision older than this is not used: room_advance.lua falls back to ratio 1.
STALE_SECONDS = 3.0
# Young: younger than the age by which this share of the eventual holds are made.
YOUNG_SHARE = 0.95
RATE_MIN = 1
# The ceiling starts at this share of the cap and doubles each healthy second until
# the database first shows its limit (slow start: no burst at the opening).
START_SHARE = 0.1
BACKOFF = 0.5
INCREASE_SHARE = 0.05
CUT_HOLD_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Health:
    """The database over the last second, as every gate process saw it."""

    overloaded: int = 0  # 503s answered (summed across processes)
    pool_waits: int = 0  # database connections waited for (summed)
    commit_p99_ms: float | None = None  # the worst process's p99 commit latency

    def healthy(self, limit_ms: float) -> bool:
        slow = self.commit_p99_ms is not None and self.commit_p99_ms > limit_ms
        return self.overloaded == 0 and self.pool_waits == 0 and not slow


@dataclass(frozen=True, slots=True)
class Steer:
    """What one decision hands the next: the database's ceiling (admissions/s), when
    it was last cut (seconds), and whether it is still probing (doubling: no cut yet)."""

    ceiling: float
    cut_at_s: float = -math.inf
    probing: bool = True


@dataclass(frozen=True, slots=True)
class Decision:
    """rate: admissions per second; the room admits while the unspent admissions
    given at or after `young_from_ms` are fewer than floor(available x ratio + offset)
    (`bound`: that number now)."""

    rate: int
    bound: int
    ratio: float
    offset: float
    young_from_ms: int
    reason: str
    steer: Steer
    detail: dict[str, float]


def _weights(stage: Stage | None, evidence: float) -> Stage | None:
    """The admission stage with every share raised by Z_CONVERSION posterior standard
    deviations; None while there is too little to go on."""
    if stage is None or evidence < MIN_EVIDENCE:
        return None
    return stage.shifted(Z_CONVERSION * stage.spread)


def young_horizon(stage: Stage | None, deadline_s: float) -> float:
    """The age by which YOUNG_SHARE of the admissions that become holds have: younger
    admissions are bounded one by one, older ones by what they are expected to ask."""
    if stage is None:
        return deadline_s
    return min(deadline_s, max(1.0, stage.horizon(YOUNG_SHARE)))


def decide(
    *,
    now_ms: int,
    available: int,
    admissions: tuple[tuple[float, float], ...],
    stage: Stage | None,
    evidence: float,
    quantity: Quantity,
    admitted_last_second: int,
    health: Health,
    max_admit_per_second: int,
    steer: Steer | None,
    deadline_s: float,
    commit_p99_limit_ms: float = COMMIT_P99_LIMIT_MS,
) -> Decision:
    """The rate and bound for the next second, at `now_ms` (Redis time).
    `admissions`: (age s, count) of the unspent ones, one per slot of the admissions
    ring (chance.Sale.admissions); `stage` and `evidence`: the admission stage and how
    many admissions it rests on (chance.Sale.admit, chance.Sale.seasoned); `steer`:
    the previous decision's (None: the first); `deadline_s`: the admission TTL."""
    now_s = now_ms / 1000
    cap = max(RATE_MIN, max_admit_per_second)
    state = steer or Steer(max(float(RATE_MIN), START_SHARE * cap))
    # The database's ceiling: slow start, then AIMD.
    healthy = health.healthy(commit_p99_limit_ms)
    if not healthy:
        if now_s - state.cut_at_s >= CUT_HOLD_SECONDS:
            base = min(state.ceiling, max(float(admitted_last_second), float(RATE_MIN)))
            state = Steer(max(float(RATE_MIN), BACKOFF * base), now_s, probing=False)
    elif state.probing:
        state = Steer(min(float(cap), state.ceiling * 2), state.cut_at_s, probing=True)
    else:
        grown = min(float(cap), state.ceiling + max(1.0, INCREASE_SHARE * cap))
        state = Steer(grown, state.cut_at_s, probing=False)
    ceiling = max(RATE_MIN, math.floor(state.ceiling))
    units = max(0, available)
    raised = _weights(stage, evidence)
    # Young from a slot's start: the room counts by admission time from there, the
    # decision by the ring's slots, and both see the same admissions.
    into = (now_ms % ADMISSION_SLOT_MS) / 1000
    horizon = young_horizon(raised, deadline_s + 1.0)
    young_s = into + math.ceil(max(0.0, horizon - into))
    young_from_ms = now_ms - round(young_s * 1000)
    young = round(sum(c for age, c in admissions if age < young_s))
    old = tuple((age, c) for age, c in admissions if age >= young_s)
    m1 = quantity.m1
    if raised is None:
        # Every admission asks a unit: the fixed room's bound at ratio 1.
        ratio, offset, expected = 1.0, 0.0, float(young)
    else:
        weights = [(raised.later(age), count) for age, count in admissions]
        expected = sum(w * c * m1 for w, c in weights)
        fresh = raised.share
        most = young + _new_admissions(units, weights, fresh, quantity)
        # Between two decisions every unit taken lowers the bound by the admissions
        # a unit is worth, 1 / (units a fresh admission asks for).
        ratio = min(AUTO_RATIO_MAX, 1.0 / max(fresh * m1, 1e-6))
        offset = most - units * ratio
    bound = max(0, math.floor(units * ratio + offset + 1e-9))
    rate = max(RATE_MIN, min(cap, ceiling))
    want = bound - young
    if units <= 0:
        reason = "no_units"
    elif raised is None:
        reason = "learning"
    elif want <= 0:
        reason = "in_flight_full"
    elif want > ceiling and ceiling < cap:
        reason = "starting" if state.probing else ("db_backoff" if not healthy else "db_recovering")
    elif want > cap:
        reason = "cap"
    else:
        reason = "filling"
    detail = {
        "units_left": float(units),
        "young": float(young),
        "old": float(sum(c for _, c in old)),
        "young_s": round(young_s, 1),
        "expected_units": round(expected, 2),
        "conversion": round(raised.share, 3) if raised else 1.0,
        "ceiling": round(state.ceiling, 1),
        "ratio": round(ratio, 4),
        "offset": round(offset, 2),
    }
    return Decision(rate, bound, ratio, offset, young_from_ms, reason, state, detail)


def _new_admissions(
    units: int, weights: list[tuple[float, float]], fresh: float, quantity: Quantity
) -> int:
    """How many new admissions (each becoming a hold with probability `fresh`) may
    join the unspent ones (`weights`: (probability, count)): the n-th is admitted while
    the chance that those before it ask for every unit left is at most EPS_MARGIN."""
    if units <= 0:
        return 0
    most = math.ceil(units / max(fresh * quantity.m1, 1e-6)) + 1
    if units <= EXACT_UNITS_MAX:
        low = max(1, int(quantity.m1))
        upper = min(1.0, max(0.0, quantity.m1 - low))
        pmf = [0.0] * units  # P(demand = x) for x < units
        pmf[0] = 1.0

        def take(w: float) -> None:
            old = pmf[:]
            for x in range(units):
                pmf[x] = old[x] * (1 - w)
            for size, share in ((low, 1 - upper), (low + 1, upper)):
                ws = w * share
                if ws > 0:
                    for x in range(units - size):
                        pmf[x + size] += old[x] * ws

        for w, count in weights:
            for _ in range(round(count)):
                take(w)
        n = 0
        while n < most and 1 - sum(pmf) <= EPS_MARGIN:
            take(fresh)
            n += 1
        return n
    m1, m2 = quantity.m1, quantity.m2
    mean = sum(c * w * m1 for w, c in weights)
    var = sum(c * (w * m2 - w * w * m1 * m1) for w, c in weights)
    a, b = fresh * m1, max(fresh * m2 - fresh * fresh * m1 * m1, 1e-9)

    def fits(n: int) -> bool:
        # P(demand of the others >= units) <= EPS_MARGIN, continuity-corrected.
        sd = max(math.sqrt(max(0.0, var + n * b)), 1e-9)
        t = (units - 0.5 - mean - n * a) / sd
        return 0.5 * math.erfc(t / math.sqrt(2)) <= EPS_MARGIN

    if not fits(0):
        return 0
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo + 1
