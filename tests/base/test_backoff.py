"""The one backoff rule: exponential with a cap, jitter, Retry-After honoured and bounded."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from gate.base.backoff import Backoff, Schedule, parse_retry_after

NOW = 1_800_000_000.0


def test_delays_double_up_to_the_cap_and_jitter_only_shortens() -> None:
    backoff = Backoff(base_seconds=0.1, cap_seconds=1.0, jitter=0.5)
    rng = random.Random(7)
    for attempt, full in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (60, 1.0)):
        draws = [backoff.delay_seconds(attempt, rng=rng) for _ in range(200)]
        assert min(draws) >= full * 0.5 - 1e-12
        assert max(draws) <= full + 1e-12
        assert max(draws) - min(draws) > full * 0.3  # jittered, not constant


def test_retry_after_replaces_the_computed_wait_within_its_bound() -> None:
    backoff = Backoff(base_seconds=0.1, cap_seconds=1.0, retry_after_max_seconds=30)
    assert backoff.delay_seconds(1, retry_after_seconds=7) == 7
    assert backoff.delay_seconds(1, retry_after_seconds=3600) == 30
    assert backoff.delay_seconds(1, retry_after_seconds=-5) == 0


@pytest.mark.parametrize(
    ("bad"),
    [
        dict(base_seconds=0, cap_seconds=1),
        dict(base_seconds=2, cap_seconds=1),
        dict(base_seconds=1, cap_seconds=2, jitter=1.5),
    ],
)
def test_a_backoff_out_of_its_bounds_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**bad)


def test_parse_retry_after_reads_both_forms_and_refuses_the_rest() -> None:
    assert parse_retry_after("120", NOW) == 120
    assert parse_retry_after(b" 3 ", NOW) == 3
    assert parse_retry_after("999999999999", NOW) == 86_400
    date = format_datetime(datetime.fromtimestamp(NOW + 90, UTC), usegmt=True)
    assert parse_retry_after(date, NOW) == pytest.approx(90)
    past = format_datetime(datetime.fromtimestamp(NOW - 90, UTC), usegmt=True)
    assert parse_retry_after(past, NOW) == 0
    for bad in (None, "", "-1", "1.5", "soon", "x" * 65, "Wed, 99 Foo 2026 00:00:00 GMT", "٣"):
        assert parse_retry_after(bad, NOW) is None


def test_a_schedule_walks_its_steps_then_stops() -> None:
    schedule = Schedule.parse("5, 300,1800")
    assert schedule.steps_seconds == (5.0, 300.0, 1800.0)
    assert schedule.attempts_max == 4
    rng = random.Random(1)
    for attempt, step in ((1, 5), (2, 300), (3, 1800)):
        wait = schedule.delay_seconds(attempt, rng=rng)
        assert wait is not None and step * 0.8 <= wait <= step
    assert schedule.delay_seconds(4) is None
    assert schedule.delay_seconds(0) is None
    # A Retry-After is honoured up to the step's own length.
    assert schedule.delay_seconds(2, retry_after_seconds=60) == 60
    assert schedule.delay_seconds(1, retry_after_seconds=60) == 5


@pytest.mark.parametrize("text", ["", "5,,6", "five", "-1", "1e9", ",".join(["1"] * 33)])
def test_a_malformed_schedule_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Schedule.parse(text)
