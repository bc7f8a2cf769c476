"""The limiters' near-cache (`Refusals`) and the limiter arguments lua/admit.lua is sent."""

from __future__ import annotations

import math
import time
from typing import Any

from gate.base.limits import LimitSpec
from gate.base.metrics import METRICS, CounterTally
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
