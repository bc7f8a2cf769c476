"""A circuit breaker for a dependency (Redis): stop calling it while it is failing.

Closed: calls go through; `failures_max` consecutive failures open it. Open: calls
are refused at once for `open_seconds` (the caller answers 503 or takes its
fallback). Then half-open: one probe call goes through; success closes the
breaker, failure opens it again. Per process: each gate process learns on its own.

    allow() ──▶ CLOSED: yes ─────────────────────────▶ the call ─▶ success() / failure()
           ──▶ OPEN, within open_seconds: no
           ──▶ HALF_OPEN: yes to one probe at a time ─▶ the call ─▶ success() / failure()
                                                         └─ neither (cancelled, or it
                                                            ended before the dependency):
                                                            call() gives the turn back

A probe that is judged neither way must give its turn back: otherwise no call would
ever probe again and the breaker would stay half-open, refusing every call, for good.
Callers therefore go through `call()`, which does so however the call ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gate.base.metrics import METRICS

CIRCUIT_OPEN = METRICS.circuit_open

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(
        self,
        name: str,
        failures_max: int,
        open_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert failures_max >= 1 and open_seconds > 0
        self.name = name
        self.failures_max = failures_max
        self.open_seconds = open_seconds
        self._clock = clock
        self.state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        # Which probe is out: a probe released late must not release a later one.
        self._probe_number = 0
        self._retired = False
        CIRCUIT_OPEN.labels(name).set(0)

    def allow(self) -> bool:
        """May a call go through now? In half-open state only one probe at a time."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self._clock() - self._opened_at < self.open_seconds:
                return False
            self.state = HALF_OPEN
            self._probing = False
        if self._probing:
            return False
        self._probing = True
        self._probe_number += 1
        return True

    @contextmanager
    def call(self) -> Iterator[bool]:
        """allow(), with a half-open probe's turn given back if the call ends (by
        cancellation, or any exception) without success() or failure()."""
        allowed = self.allow()
        probe = self._probe_number if allowed and self.state == HALF_OPEN else None
        try:
            yield allowed
        finally:
            if probe is not None and self._probing and self._probe_number == probe:
                self._probing = False

    def success(self) -> None:
        if self.state != CLOSED:
            CIRCUIT_OPEN.labels(self.name).set(0)
        self.state = CLOSED
        self._failures = 0
        self._probing = False

    def failure(self) -> None:
        if self._retired:
            return  # a call that started before retire(): it opens nothing any more
        self._failures += 1
        if self.state == HALF_OPEN or self._failures >= self.failures_max:
            if self.state == CLOSED:
                CIRCUIT_OPEN.labels(self.name).set(1)
            self.state = OPEN
            self._opened_at = self._clock()
            self._probing = False

    def retire(self) -> None:
        """Its dependency is gone for good (a Redis Cluster node that serves no slot
        after a failover): the breaker is dropped, and its gauge must not report an
        open circuit that nothing will ever probe again."""
        self._retired = True
        self.state = CLOSED
        self._failures = 0
        self._probing = False
        CIRCUIT_OPEN.labels(self.name).set(0)

    def retry_after_seconds(self) -> int:
        left = self.open_seconds - (self._clock() - self._opened_at)
        return max(1, math.ceil(left)) if self.state == OPEN else 1
