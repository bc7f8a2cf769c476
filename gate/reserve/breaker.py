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

`Breakers` holds the reservation path's breakers: one per Redis node (on Redis
Cluster a failing primary pauses only the deals whose slots it serves; standalone,
just one), probed by a loop of their own once their open time is up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gate.base.metrics import METRICS
from gate.base.settings import Settings
from gate.store.keys import deal_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.reservations")

CIRCUIT_OPEN = METRICS.circuit_open

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


# Open breakers whose time is up are probed this often without waiting for a call
# (`Breakers.probe`), at most this many per round.
BREAKER_PROBE_SECONDS = 1.0


BREAKERS_PROBED_MAX = 1000


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


class Breakers:
    """The reservation path's Redis breakers, one per node that serves deals."""

    def __init__(self, settings: Settings, runner: ScriptRunner) -> None:
        self.failures_max = settings.redis_breaker_failures_max
        self.open_seconds = settings.redis_breaker_open_seconds
        self.runner = runner
        # Standalone Redis: this one (`node_of` names it "redis").
        self.standalone = Breaker("redis", self.failures_max, self.open_seconds)
        self._nodes: dict[str, Breaker] = {}
        runner.slot_map_listeners.append(self.retire)

    def for_deal(self, deal_id: int) -> Breaker:
        """The breaker of the Redis node that serves the deal's slot."""
        name = self.runner.node_of(deal_keys(deal_id).meta)
        if name == "redis":
            return self.standalone
        breaker = self._nodes.get(name)
        if breaker is None:
            breaker = self._nodes[name] = Breaker(name, self.failures_max, self.open_seconds)
        return breaker

    def retire(self, serving: frozenset[str]) -> None:
        """The slot map was read: the breakers of nodes that serve no slot any more
        (a primary that failed over) go, or /readyz and gate_circuit_open would report
        an open circuit for good. A node that serves again gets a new one."""
        for name in [n for n in self._nodes if n not in serving]:
            self._nodes.pop(name).retire()

    @property
    def state(self) -> str:
        """The worst state of the breakers ("closed" when all are)."""
        states = {self.standalone.state, *(b.state for b in self._nodes.values())}
        for state in (OPEN, HALF_OPEN):
            if state in states:
                return state
        return CLOSED

    async def probe(self, stop: asyncio.Event) -> None:
        """Every BREAKER_PROBE_SECONDS, `probe_once` (every serving process: each has
        breakers of its own)."""
        while not stop.is_set():
            try:
                await self.probe_once()
            except Exception as exc:
                log.warning("breaker probe failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), BREAKER_PROBE_SECONDS)
            except TimeoutError:
                pass

    async def probe_once(self) -> int:
        """An open breaker is probed by the first call past its open time. A node no
        call reaches any more (its deals' sales are over) would keep it open for
        good, and /readyz "degraded", gate_circuit_open and its alert with it: after
        a Redis Cluster failover every node answers CLUSTERDOWN for a while, so
        breakers of nodes that never failed open too. So breakers whose open time is
        up are probed here as well, one Redis call each in a call's place
        (`ScriptRunner.probe`). How many it probed."""
        probed = 0
        for breaker in [self.standalone, *self._nodes.values()][:BREAKERS_PROBED_MAX]:
            if breaker.state == CLOSED:
                continue
            with breaker.call() as allowed:
                if not allowed or breaker.state != HALF_OPEN:
                    continue
                probed += 1
                if await self.runner.probe(breaker.name):
                    breaker.success()
                else:
                    breaker.failure()
        return probed
