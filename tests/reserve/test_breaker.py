"""The circuit breaker's half-open probe is given back when the probing call is
cancelled: a cancelled probe judged neither success nor failure would leave no
call ever to probe again, and the breaker would refuse every call for good."""

from __future__ import annotations

import asyncio

from gate.base.metrics import METRICS, sample_values, value_of
from gate.reserve.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from gate.reserve.request import ReserveRequest
from gate.runtime import Gate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def half_open(name: str) -> tuple[Breaker, Clock]:
    clock = Clock()
    breaker = Breaker(name, failures_max=1, open_seconds=1.0, clock=clock)
    breaker.failure()
    assert breaker.state == OPEN and not breaker.allow()
    clock.now += 2
    return breaker, clock


async def test_a_cancelled_probe_lets_the_next_call_probe() -> None:
    breaker, _ = half_open("test_cancelled_probe")
    probing = asyncio.Event()

    async def probe() -> None:
        with breaker.call() as allowed:
            assert allowed
            probing.set()
            await asyncio.Event().wait()  # the dependency never answers

    task = asyncio.create_task(probe())
    await asyncio.wait_for(probing.wait(), 30)  # a guard, not a timing
    assert breaker.state == HALF_OPEN
    assert not breaker.allow(), "one probe at a time"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    with breaker.call() as allowed:
        assert allowed, "the cancelled probe's turn was not given back"
        breaker.success()
    assert breaker.state == CLOSED


async def test_a_late_release_does_not_free_a_newer_probe() -> None:
    breaker, clock = half_open("test_late_release")
    with breaker.call() as first:
        assert first
        breaker.failure()  # the first probe failed: open again
        clock.now += 2
        assert breaker.allow()  # a second probe is out
    # The first call's exit must not give back the second probe's turn.
    assert not breaker.allow()


def _open_gauge(name: str) -> float:
    return value_of(sample_values(METRICS.render().decode()), "gate_circuit_open", dependency=name)


def test_a_retired_breaker_reports_no_open_circuit_and_stays_closed() -> None:
    """A Redis Cluster primary that failed over serves no slot: its breaker, open
    when the node died, is retired (gate/reserve/breaker.py `Breakers.retire`)."""
    name = "redis 127.0.0.1:1"
    breaker, _ = half_open(name)
    assert _open_gauge(name) == 1
    breaker.retire()
    assert breaker.state == CLOSED and _open_gauge(name) == 0
    for _ in range(3):  # calls that began before it was retired end in failures
        breaker.failure()
    assert breaker.state == CLOSED and _open_gauge(name) == 0


async def test_a_cancelled_reservation_probe_does_not_wedge_the_gate(local_gate: Gate) -> None:
    """The reservation path itself: its probe (the admission in Redis) cancelled
    mid-call. An unknown deal: the admission answers "not loaded" and changes nothing."""
    breaker, _ = half_open("test_reservation_probe")
    local_gate.reservations.breakers.standalone = breaker
    request = ReserveRequest(2**62, 4711, 1, "breaker-probe-0001", "127.0.0.1", None)
    task = asyncio.create_task(local_gate.reservations.reserve(request))
    await asyncio.sleep(0)  # the task runs until it waits on Redis
    assert breaker.state == HALF_OPEN and not breaker.allow(), "the probe is out"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert breaker.allow(), "a cancelled reservation left the breaker half-open for good"


async def test_an_open_breaker_no_call_reaches_is_probed_and_closes(local_gate: Gate) -> None:
    """A breaker opens, then no call comes (its deals' sales are over; after a Redis
    Cluster failover, breakers of nodes that never failed open too: every node answers
    CLUSTERDOWN for a while). Left alone it would stay open for good, /readyz reading
    "degraded" and gate_circuit_open 1; once its open time is up, the gate probes it
    itself, one Redis call, and closes it."""
    clock = Clock()
    breaker = Breaker("test_idle_probe", failures_max=1, open_seconds=1.0, clock=clock)
    local_gate.reservations.breakers.standalone = breaker
    breaker.failure()
    assert local_gate.reservations.breakers.state == "open"
    assert await local_gate.reservations.breakers.probe_once() == 0  # its time is not up
    assert breaker.state == OPEN
    clock.now += 2
    assert await local_gate.reservations.breakers.probe_once() == 1
    assert breaker.state == CLOSED and local_gate.reservations.breakers.state == "closed"
    assert _open_gauge("test_idle_probe") == 0
