"""The rate limiters at the reservation path (`RateLimits`): the arguments
lua/admit.lua is sent, the answers of their refusals, and their near-cache
(`Refusals`).

    a request ──> RateLimits.answer: a refusal remembered here? ──> the kept 429
              └─> admit.lua (the scoped limiters) beside limit.lua (the global one)
                    └─ refused ──> RateLimits.refused: remembered, and its 429
"""

from __future__ import annotations

import math
import time
from typing import Any

from gate.base.errors import Encoded, Problem
from gate.base.limits import LimitSpec, rate_limited
from gate.base.metrics import METRICS, CounterTally
from gate.base.settings import Settings
from gate.reserve.request import ReserveRequest

RATE_LIMITED = METRICS.rate_limited


# Rate-limited refusals per scope as tallies (one per scope and process): a refusal
# answered from the near-cache must not pay prometheus-client's lock, and under
# several workers a write to the shared files, which its sold-out sibling does not.
_LIMITED_TALLIES: dict[str, CounterTally] = {}


SCOPED_LIMITS = ("deal", "user", "ip", "device")


SCOPE_NAMES = (*SCOPED_LIMITS, "global")


GLOBAL_INDEX = len(SCOPED_LIMITS)


# A request without X-Device-Id is not device-limited (README): it has no device to
# count against, and one shared "no device" bucket would limit all such buyers of a
# deal together.
DEVICE_INDEX = SCOPED_LIMITS.index("device")


REFUSALS_MAX = 100_000


LIMITED_ANSWERS_MAX = 4096


class Refusals:
    """The limiters' near-cache: what Redis refused, remembered in this process
    until the refusal's own end, so that a client hammering over its limit is
    answered 429 without a Redis round trip (a limiter rejection must cost
    no more than a sold-out one).

    Exact for the limits: a GCRA limiter that refuses "retry after w ms" keeps
    refusing for w ms whatever any process does (its theoretical arrival time only
    grows, and a refused request changes nothing), and the end is counted from the
    moment the call was *sent*, before Redis read its clock. What is approximate is
    only which answer such a client gets meanwhile: Redis answers a replay, a sold-out
    deal or an ended sale before its limiters, this cache answers 429 for up to the
    remaining wait; the retry after Retry-After gets the other answer.
    """

    def __init__(self, scoped: tuple[LimitSpec | None, ...], global_on: bool) -> None:
        self.scopes = tuple(i for i, spec in enumerate(scoped) if spec)
        self.global_on = global_on
        self._until: dict[tuple[int, int, Any], float] = {}

    def _keys(
        self, deal_id: int, user_id: int, ip: str, device: str | None
    ) -> list[tuple[int, int, Any]]:
        idents = (None, user_id, ip, device)
        keys = [
            (deal_id, i, idents[i]) for i in self.scopes if i != DEVICE_INDEX or device is not None
        ]
        if self.global_on:
            keys.append((0, GLOBAL_INDEX, None))
        return keys

    def check(
        self, deal_id: int, user_id: int, ip: str, device: str | None
    ) -> tuple[str, int] | None:
        """(scope, milliseconds still to wait) when a remembered refusal holds.
        On every reservation: plain look-ups, no key list built."""
        until_of = self._until
        if not until_of:
            return None
        for i in self.scopes:
            if i == DEVICE_INDEX and device is None:
                continue
            key = (deal_id, i, (None, user_id, ip, device)[i])
            until = until_of.get(key)
            if until is not None:
                left = until - time.monotonic()
                if left > 0:
                    return SCOPE_NAMES[i], math.ceil(left * 1000)
                del until_of[key]
        if self.global_on:
            key = (0, GLOBAL_INDEX, None)
            until = until_of.get(key)
            if until is not None:
                left = until - time.monotonic()
                if left > 0:
                    return "global", math.ceil(left * 1000)
                del until_of[key]
        return None

    def remember(self, req: ReserveRequest, scope: str, wait_ms: int, sent: float) -> None:
        if len(self._until) >= REFUSALS_MAX:
            now = time.monotonic()
            self._until = {k: v for k, v in self._until.items() if v > now}
            if len(self._until) >= REFUSALS_MAX:
                self._until.clear()
        index = SCOPE_NAMES.index(scope)
        for key in self._keys(req.deal_id, req.user_id, req.ip, req.device):
            if key[1] == index:
                self._until[key] = sent + wait_ms / 1000


def _limiter_args(specs: tuple[LimitSpec | None, ...]) -> list[int]:
    args: list[int] = []
    for spec in specs:
        args.extend((spec.emission_ms, spec.burst) if spec else (0, 0))
    return args


class RateLimits:
    """The limiters as the reservation path sees them."""

    def __init__(self, settings: Settings) -> None:
        scoped = (
            settings.limit_deal,
            settings.limit_user,
            settings.limit_ip,
            settings.limit_device,
        )
        # lua/admit.lua's limiter arguments: a request without a device id has the
        # device limiter off.
        self.args = _limiter_args(scoped)
        self.args_no_device = _limiter_args(
            tuple(None if i == DEVICE_INDEX else spec for i, spec in enumerate(scoped))
        )
        self.global_spec = settings.limit_global
        self.on = any(scoped) or self.global_spec is not None
        self.refusals = Refusals(scoped, self.global_spec is not None)
        self._specs = dict(zip(SCOPED_LIMITS, scoped, strict=True))
        self._specs["global"] = self.global_spec
        self._answers: dict[tuple[str, int], Problem] = {}

    def answer(
        self, deal_id: int, user_id: int, ip: str, device: str | None, instance: str
    ) -> Encoded | None:
        """The kept answer of a refusal this process remembers, ready for the wire."""
        if self.on:
            refused = self.refusals.check(deal_id, user_id, ip, device)
            if refused is not None:
                return self._made(*refused).encoded(instance)
        return None

    def refused(self, req: ReserveRequest, scope: str, wait_ms: int, sent: float) -> Problem:
        """Redis refused `req` (`scope`'s limiter, for `wait_ms` from `sent`): the
        refusal remembered, and the problem to raise."""
        self.refusals.remember(req, scope, wait_ms, sent)
        made = self._made(scope, wait_ms)
        # A copy to raise: raising the kept one again and again would chain tracebacks.
        return Problem(
            made.code,
            made.detail,
            retry_after_seconds=made.retry_after_seconds,
            headers=made.headers,
            extra=made.extra,
            cacheable=True,
        )

    def _made(self, scope: str, wait_ms: int) -> Problem:
        """The refusal counted, and its answer: one per scope and whole second of wait,
        made once and only ever encoded (`refused` copies it to raise)."""
        counter = _LIMITED_TALLIES.get(scope)
        if counter is None:
            counter = _LIMITED_TALLIES[scope] = METRICS.counter_tally(RATE_LIMITED.labels(scope))
        counter.inc()
        key = (scope, math.ceil(wait_ms / 1000))
        made = self._answers.get(key)
        if made is None:
            if len(self._answers) >= LIMITED_ANSWERS_MAX:
                self._answers.clear()
            spec = self._specs[scope]
            assert spec is not None, f"limiter {scope} refused while off"
            # Its body and headers follow from the detail (scope, limit, wait): cacheable.
            made = rate_limited(scope, spec, wait_ms)
            made.cacheable = True
            self._answers[key] = made
        return made
