"""Conversions measured as a sale runs, for the chance (gate/room/chance.py) and the
automatic rate (gate/room/steering.py): pure, no I/O.

    scripts ── HINCRBY ──> two rings per deal (Redis hashes) ──> Ring.from_hash
    Ring.slots ──> cohorts ──> fit() ──> Stage: the posterior of "a share converts,
                                          after a delay, before the deadline"

Two stages: an admission becomes a hold (before the admission TTL), a hold is paid
(before it lapses). Each item is counted in the slot of the second it was given
(made); its conversion is counted in that same slot, with its delay. A cohort of age
a has converted share x F(a) so far, F the delay's distribution function, so young
cohorts say little and old ones much, and the delays seen say what F is. Each stage
is the cure model "a share converts, after a delay, before the deadline" with an
lognormal delay, as people's times to act have (log-sd from SIGMAS: peaked to long
tailed), each log-sd fitted by maximum likelihood (share and median), mixed by their
likelihoods, and the share's standard deviation taken from the likelihood's
curvature in share and median together. So the stage is a posterior:
early in a sale, when the data cannot yet tell "few convert, soon" from "most convert,
later", its spread says so, and the chance widens instead of swinging. The stated
prior (`Prior`) adds `weight` closed pseudo-observations converting at `share` after
`delay_s`: evidence outweighs it within dozens of items.

The rings (Redis hashes; RING_SLOTS slots, field "<name>:<i>" with
i = (ms // slot_ms) % RING_SLOTS, and "t:<i>" the slot number the slot holds: a
writer finding another number there clears the slot first):

    {d:ID}:room:rca  admissions, 1 s slots (ADMISSION_SLOT_MS); written live:
        n   admissions given                       room_advance.lua, by admission time
        k   of those, spent                        admit.lua, in the admission's slot
                                                    (its record's admitted_ms); dropped
        g   LOG_SCALE x ln(delay ms) (sum)          once that slot was reused
        h   LOG_SCALE x ln(delay ms)^2 (sum)
      read by the models but not yet written live (loadtest/room_sim.py writes them):
        lv  tickets that left while likely          the leave, by leave time
        ex  likely waiting tickets x seconds        the loop, once a second
    {d:ID}:rch  holds, 10 s slots (HOLD_SLOT_MS); not yet written live (payments
                never reach Redis): the models then use the pay prior
        n   holds made         u  their units      v  units squared
        k   holds paid         w  units paid        in the hold's slot
        g, h  their delays to payment, as above
        x   units given back before lapsing (a cancel), in the hold's slot
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

RING_SLOTS = 256
ADMISSION_SLOT_MS = 1000
HOLD_SLOT_MS = 10_000
ADMISSION_FIELDS = ("n", "k", "g", "h", "lv", "ex")
HOLD_FIELDS = ("n", "k", "g", "h", "u", "v", "w", "x")

# The delay: lognormal, as people's times to act are; its log-sd taken from SIGMAS
# (peaked to long-tailed), its median searched from DELAY_MIN_S to DELAY_MAX_DEADLINES
# deadlines (golden section on its log, GOLDEN_STEPS steps). The prior's converters
# spread PRIOR_LOG_SD around its delay.
SIGMAS = (0.3, 0.5, 0.8, 1.2, 1.8)
DELAY_MIN_S = 0.05
DELAY_MAX_DEADLINES = 100.0
GOLDEN_STEPS = 24
PRIOR_LOG_SD = 1.0
# A delay is kept in the ring as LOG_SCALE x ln(ms) (g) and LOG_SCALE x ln(ms)^2 (h).
LOG_SCALE = 1000
# Age bands the slots are merged into before fitting (edges grow by 1.5x).
BANDS_MAX = 16
BAND_GROWTH = 1.5


@dataclass(frozen=True, slots=True)
class Prior:
    """What a stage is taken to be before the sale shows it: `weight` closed
    pseudo-observations converting at `share`, the delay's scale near `delay_s`."""

    share: float
    delay_s: float
    weight: float


# An admitted buyer reserves half the time, within about ten seconds; four holds in
# five are paid, within about a minute. Ten pseudo-observations each.
ADMISSION_PRIOR = Prior(share=0.5, delay_s=10.0, weight=10.0)
PAY_PRIOR = Prior(share=0.8, delay_s=60.0, weight=10.0)


@dataclass(frozen=True, slots=True)
class Cohort:
    """Items given between `lo_s` and `hi_s` seconds ago: n of them, k converted;
    the sums of ln(delay in seconds) and of its square over the k."""

    lo_s: float
    hi_s: float
    n: float
    k: float
    log_delay: float = 0.0
    log_square: float = 0.0


class Ring:
    """A per-deal ring of cohort slots, as the scripts keep it in a Redis hash (see
    the module's docstring). `from_hash` reads what HGETALL gives, `as_hash` writes it
    back; the simulation and the tests change it through the operations the scripts
    make (`add`, `add_to`)."""

    def __init__(self, slot_ms: int) -> None:
        self.slot_ms = slot_ms
        # index -> (slot number, counters)
        self._slots: dict[int, tuple[int, dict[str, int]]] = {}

    @classmethod
    def from_hash(cls, slot_ms: int, fields: Mapping[str | bytes, int | str | bytes]) -> Ring:
        ring = cls(slot_ms)
        values: dict[int, dict[str, int]] = {}
        numbers: dict[int, int] = {}
        for key, value in fields.items():
            name, _, index = (key.decode() if isinstance(key, bytes) else key).partition(":")
            if not index.isdigit():
                continue
            i = int(index)
            if name == "t":
                numbers[i] = int(value)
            else:
                values.setdefault(i, {})[name] = int(value)
        for i, slot in numbers.items():
            if 0 <= i < RING_SLOTS:
                ring._slots[i] = (slot, values.get(i, {}))
        return ring

    def as_hash(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i, (slot, counters) in self._slots.items():
            out[f"t:{i}"] = slot
            for name, value in counters.items():
                out[f"{name}:{i}"] = value
        return out

    def add(self, now_ms: int, name: str, value: int = 1) -> None:
        """HINCRBY "<name>:<i>" in the slot of `now_ms` (given items, leaves, exposure),
        clearing the slot first when it held an older one ("t:<i>" differs)."""
        slot = now_ms // self.slot_ms
        i = slot % RING_SLOTS
        held = self._slots.get(i)
        if held is None or held[0] != slot:
            held = (slot, {})
            self._slots[i] = held
        counters = held[1]
        counters[name] = counters.get(name, 0) + value

    def add_to(self, given_ms: int, name: str, value: int = 1) -> None:
        """HINCRBY in the slot an item was given in (its conversion), if still held."""
        slot = given_ms // self.slot_ms
        held = self._slots.get(slot % RING_SLOTS)
        if held is not None and held[0] == slot:
            held[1][name] = held[1].get(name, 0) + value

    def converted(self, given_ms: int, now_ms: int) -> None:
        """A conversion of an item given at `given_ms`: k, g and h in its slot."""
        log_ms = math.log(max(now_ms - given_ms, 1))
        self.add_to(given_ms, "k")
        self.add_to(given_ms, "g", round(LOG_SCALE * log_ms))
        self.add_to(given_ms, "h", round(LOG_SCALE * log_ms * log_ms))

    def cohort(self, lo: float, hi: float, counters: Mapping[str, int]) -> Cohort:
        """A slot's counters as a Cohort (logs of seconds)."""
        k = counters.get("k", 0)
        to_s = math.log(1000)
        g, h = counters.get("g", 0) / LOG_SCALE, counters.get("h", 0) / LOG_SCALE
        return Cohort(lo, hi, counters.get("n", 0), k, g - k * to_s, h - 2 * to_s * g + k * to_s**2)

    def slots(self, now_ms: int) -> Iterable[tuple[float, float, Mapping[str, int]]]:
        """(youngest age s, oldest age s, that slot's counters) of every live slot."""
        now_slot = now_ms // self.slot_ms
        width = self.slot_ms / 1000
        now_s = now_ms / 1000
        for slot, counters in self._slots.values():
            if slot > now_slot or now_slot - slot >= RING_SLOTS:
                continue
            hi = now_s - slot * width
            yield max(0.0, hi - width), hi, counters


# -- the stage --------------------------------------------------------------------------


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


def _lognormal(x: float, mu: float, sigma: float, deadline: float) -> float:
    """The truncated delay's distribution function: lognormal (ln delay ~ N(mu,
    sigma^2), seconds) conditioned on being below the deadline."""
    if x <= 0:
        return 0.0
    if x >= deadline:
        return 1.0
    top = _phi((math.log(deadline) - mu) / sigma)
    return _phi((math.log(x) - mu) / sigma) / max(top, 1e-300)


@dataclass(frozen=True, slots=True)
class Part:
    """One component of a stage's posterior: its weight, the share's estimate and
    standard deviation, the delay's log-mean `mu` (ln seconds) and log-sd `sigma`."""

    weight: float
    share: float
    spread: float
    mu: float
    sigma: float

    def done(self, age_s: float, deadline_s: float) -> float:
        return _lognormal(age_s, self.mu, self.sigma, deadline_s)

    def later(self, age_s: float, deadline_s: float) -> float:
        """P(converts before the deadline | not converted by `age_s`)."""
        if age_s >= deadline_s:
            return 0.0
        f = self.done(age_s, deadline_s)
        return self.share * (1 - f) / (1 - self.share * f)

    def later_slope(self, age_s: float, deadline_s: float) -> float:
        """d later / d share at this part's share."""
        if age_s >= deadline_s:
            return 0.0
        f = self.done(age_s, deadline_s)
        return (1 - f) / (1 - self.share * f) ** 2


@dataclass(frozen=True, slots=True)
class Stage:
    """A conversion stage's posterior (`parts`, weights summing to 1) with
    `evidence`: real observations that could have shown a conversion (n x F(age))."""

    parts: tuple[Part, ...]
    deadline_s: float
    evidence: float

    @classmethod
    def point(
        cls, share: float, delay_s: float, deadline_s: float, evidence: float, sigma: float = 1.0
    ) -> Stage:
        """A known stage: `share` converts after a lognormal delay of median `delay_s`."""
        return cls((Part(1.0, share, 0.0, math.log(delay_s), sigma),), deadline_s, evidence)

    @property
    def share(self) -> float:
        return sum(p.weight * p.share for p in self.parts)

    @property
    def spread(self) -> float:
        """The share's posterior standard deviation (within and between parts)."""
        mean = self.share
        second = sum(p.weight * (p.share**2 + p.spread**2) for p in self.parts)
        return math.sqrt(max(0.0, second - mean * mean))

    def later(self, age_s: float) -> float:
        """P(converts before the deadline | not converted by `age_s`), averaged."""
        return sum(p.weight * p.later(age_s, self.deadline_s) for p in self.parts)

    def shifted(self, delta: float) -> Stage:
        """Every part's share moved by `delta` (within [0, 1]): a conservative stage."""
        parts = tuple(
            Part(p.weight, min(1.0, max(0.0, p.share + delta)), p.spread, p.mu, p.sigma)
            for p in self.parts
        )
        return Stage(parts, self.deadline_s, self.evidence)

    def horizon(self, fraction: float) -> float:
        """The age by which `fraction` of the eventual converters have converted."""
        total = sum(p.weight * p.share for p in self.parts) or 1.0

        def done(age: float) -> float:
            weighted = sum(p.weight * p.share * p.done(age, self.deadline_s) for p in self.parts)
            return weighted / total

        lo, hi = 0.0, self.deadline_s
        for _ in range(40):
            mid = (lo + hi) / 2
            if done(mid) < fraction:
                lo = mid
            else:
                hi = mid
        return hi


def bands(cohorts: Iterable[Cohort], first_s: float) -> list[Cohort]:
    """Cohorts merged into age bands whose edges grow by BAND_GROWTH from `first_s`
    (at most BANDS_MAX bands; the last takes everything older). A band sits at the
    mean age of its unconverted items (one slot wide): the likelihood asks how old
    they are, and a band's slots may hold very different numbers."""
    edges = [0.0]
    step = first_s
    while len(edges) < BANDS_MAX:
        edges.append(edges[-1] + step)
        step *= BAND_GROWTH
    # per band: n, k, logs, squares, sum u x age, sum u, sum n x age, width
    merged: list[list[float]] = [[0.0] * 8 for _ in edges]
    for c in cohorts:
        if c.n <= 0:
            continue
        mid = (c.lo_s + c.hi_s) / 2
        j = 0
        while j + 1 < len(edges) and edges[j + 1] <= mid:
            j += 1
        m = merged[j]
        u = c.n - c.k
        m[0] += c.n
        m[1] += c.k
        m[2] += c.log_delay
        m[3] += c.log_square
        m[4] += u * mid
        m[5] += u
        m[6] += c.n * mid
        m[7] = max(m[7], c.hi_s - c.lo_s)
    out = []
    for m in merged:
        if m[0] <= 0:
            continue
        age = m[4] / m[5] if m[5] > 0 else m[6] / m[0]
        half = m[7] / 2
        out.append(Cohort(max(0.0, age - half), age + half, m[0], m[1], m[2], m[3]))
    return out


class _Likelihood:
    """log L(share, mu) of one lognormal sigma over banded cohorts and the prior."""

    def __init__(self, data: Sequence[Cohort], deadline: float, prior: Prior, sigma: float) -> None:
        self.deadline, self.sigma = deadline, sigma
        k0 = prior.weight * prior.share
        self.conv = sum(c.k for c in data) + k0
        self.fail = prior.weight - k0
        # The prior's converters: ln delay around ln(delay_s), spread PRIOR_LOG_SD.
        centre = math.log(prior.delay_s)
        self.logs = sum(c.log_delay for c in data) + k0 * centre
        self.squares = sum(c.log_square for c in data) + k0 * (centre**2 + PRIOR_LOG_SD**2)
        self.open = [(c.n - c.k, c.lo_s, c.hi_s) for c in data if c.n - c.k > 0]

    def fs(self, mu: float) -> list[tuple[float, float]]:
        d, sg = self.deadline, self.sigma
        out = []
        for u, lo, hi in self.open:
            mid = (lo + hi) / 2
            f = (
                _lognormal(lo, mu, sg, d)
                + 4 * _lognormal(mid, mu, sg, d)
                + _lognormal(hi, mu, sg, d)
            ) / 6
            out.append((u, f))
        return out

    def delay_ll(self, mu: float) -> float:
        """The converters' delays: sum log f(d) of the truncated lognormal (less the
        terms that do not depend on mu)."""
        sg, k = self.sigma, self.conv
        top = max(_phi((math.log(self.deadline) - mu) / sg), 1e-300)
        quad = self.squares - 2 * mu * self.logs + k * mu * mu
        return -k * math.log(sg) - quad / (2 * sg * sg) - k * math.log(top)

    def at(self, share: float, mu: float) -> float:
        return _share_ll(share, self.conv, self.fail, self.fs(mu)) + self.delay_ll(mu)


def fit(cohorts: Sequence[Cohort], deadline_s: float, prior: Prior) -> Stage:
    """The stage's posterior over `cohorts` (already banded) with `prior`: for each
    log-sd in SIGMAS, the most likely share and log-mean, and the share's standard
    deviation from the likelihood's curvature in both (a share that trades off
    against a longer delay is as uncertain as it is); the log-sds weighted by their
    likelihood."""
    deadline = max(deadline_s, 1e-3)
    data = list(cohorts)
    found = []
    lo0, hi0 = math.log(DELAY_MIN_S), math.log(DELAY_MAX_DEADLINES * deadline)
    g = (math.sqrt(5) - 1) / 2
    for sigma in SIGMAS:
        like = _Likelihood(data, deadline, prior, sigma)

        def profile(mu: float, like: _Likelihood = like) -> tuple[float, float]:
            share, _, ll = _share(like.conv, like.fail, like.fs(mu))
            return ll + like.delay_ll(mu), share

        a, b = lo0, hi0
        c, d = b - g * (b - a), a + g * (b - a)
        fc, fd = profile(c)[0], profile(d)[0]
        for _ in range(GOLDEN_STEPS):
            if fc > fd:
                b, d, fd = d, c, fc
                c = b - g * (b - a)
                fc = profile(c)[0]
            else:
                a, c, fc = c, d, fd
                d = a + g * (b - a)
                fd = profile(d)[0]
        mu = (a + b) / 2
        best, share = profile(mu)
        found.append((best, share, _spread(like, share, mu), mu, sigma))
    top = max(f[0] for f in found)
    weights = [math.exp(f[0] - top) for f in found]
    total = sum(weights)
    parts = tuple(
        Part(w / total, f[1], f[2], f[3], f[4])
        for w, f in sorted(zip(weights, found, strict=True), key=lambda x: -x[0])
        if w / total > 1e-4
    )
    best_part = parts[0]
    evidence = sum(c.n * best_part.done((c.lo_s + c.hi_s) / 2, deadline) for c in data)
    return Stage(parts, deadline, evidence)


def _spread(like: _Likelihood, share: float, mu: float) -> float:
    """The share's standard deviation from the 2 x 2 curvature of log L in (share, mu)
    at the maximum (finite differences)."""
    hs, ht = min(0.01, share / 4, (1 - share) / 4) or 1e-4, 0.05

    def f(ds: float, dt: float) -> float:
        return like.at(min(1 - 1e-9, max(1e-9, share + ds)), mu + dt)

    f0 = f(0, 0)
    fss = (f(hs, 0) - 2 * f0 + f(-hs, 0)) / hs**2
    ftt = (f(0, ht) - 2 * f0 + f(0, -ht)) / ht**2
    fst = (f(hs, ht) - f(hs, -ht) - f(-hs, ht) + f(-hs, -ht)) / (4 * hs * ht)
    det = fss * ftt - fst * fst
    if fss >= 0 or det <= 0:
        return 0.5
    return math.sqrt(min(0.25, -ftt / det)) if ftt < 0 else 0.5


def _share_ll(s: float, conv: float, fail: float, fs: Sequence[tuple[float, float]]) -> float:
    ll = conv * math.log(s) + (fail * math.log(1 - s) if fail > 0 else 0.0)
    for u, f in fs:
        ll += u * math.log(max(1 - s * f, 1e-300))
    return ll


def _share(
    conv: float, fail: float, fs: Sequence[tuple[float, float]]
) -> tuple[float, float, float]:
    """The share maximising conv log s + fail log(1 - s) + sum u log(1 - s f), the
    curvature there and the maximum: concave, so Newton's steps inside a shrinking
    bracket converge in a few steps."""

    def slope(s: float) -> tuple[float, float]:
        g = conv / s
        h = conv / (s * s)
        if fail > 0:
            g -= fail / (1 - s)
            h += fail / ((1 - s) * (1 - s))
        for u, f in fs:
            r = 1 - s * f
            g -= u * f / r
            h += u * f * f / (r * r)
        return g, h

    lo, hi = 1e-9, 1.0 - 1e-9
    s = min(hi, max(lo, conv / (conv + fail + sum(u * f for u, f in fs))))
    h = 0.0
    for _ in range(40):
        g, h = slope(s)
        if abs(g) < 1e-9 or hi - lo < 1e-10:
            break
        if g > 0:
            lo = s
        else:
            hi = s
        step = s + g / h if h > 0 else (lo + hi) / 2
        s = step if lo < step < hi else (lo + hi) / 2
    return s, h, _share_ll(s, conv, fail, fs)
