"""Waiting between attempts: one rule for every caller that tries again.

    attempt 0 fails ──> Backoff.delay_seconds(1) ──> sleep ──> attempt 1 fails ──> …
                            │
                            ├─ base · 2^(n-1), capped at cap_seconds
                            ├─ jitter: a uniform draw from [(1 - jitter) · d, d]
                            └─ a server's Retry-After, when given, replaces d,
                               bounded by retry_after_max_seconds

`Schedule` is the same for a fixed list of waits (outbound webhooks:
"5,300,1800,…"): the n-th wait is the n-th step, jittered, and a Retry-After is
honoured up to that step's length. `parse_retry_after` reads the header's two
forms (delay-seconds, HTTP-date), bounded, and never raises.

Jitter spreads the attempts of many callers that failed together (a database
failover, a provider's outage) so that they do not all come back in the same
millisecond.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

# A Retry-After beyond a day is not a wait any caller here would honour.
RETRY_AFTER_MAX_SECONDS = 86_400.0
# Header values longer than an HTTP-date are not read.
RETRY_AFTER_MAX_CHARS = 64


def parse_retry_after(value: str | bytes | None, now_epoch_seconds: float) -> float | None:
    """Seconds to wait from a Retry-After header value (delay-seconds or an
    HTTP-date), clamped to 0..RETRY_AFTER_MAX_SECONDS; None when absent or unreadable."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if not value or len(value) > RETRY_AFTER_MAX_CHARS:
        return None
    if value.isascii() and value.isdigit():
        return min(float(int(value)), RETRY_AFTER_MAX_SECONDS)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, min(when.timestamp() - now_epoch_seconds, RETRY_AFTER_MAX_SECONDS))


def _jittered(seconds: float, jitter: float, rng: random.Random | None) -> float:
    draw = (rng or random).uniform(1.0 - jitter, 1.0)
    return seconds * draw


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff: the wait before attempt n (n ≥ 1) is
    min(cap, base · 2^(n-1)), jittered down by up to `jitter` of itself."""

    base_seconds: float
    cap_seconds: float
    jitter: float = 0.5
    retry_after_max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not (0 < self.base_seconds <= self.cap_seconds) or not (0 <= self.jitter <= 1):
            raise ValueError("backoff needs 0 < base <= cap and 0 <= jitter <= 1")

    def delay_seconds(
        self,
        attempt: int,
        retry_after_seconds: float | None = None,
        rng: random.Random | None = None,
    ) -> float:
        """The wait before `attempt` (1 = the first retry). A server's Retry-After
        replaces the computed wait, bounded by retry_after_max_seconds."""
        if retry_after_seconds is not None:
            return max(0.0, min(retry_after_seconds, self.retry_after_max_seconds))
        exponent = min(max(attempt, 1) - 1, 62)
        return _jittered(min(self.cap_seconds, self.base_seconds * 2**exponent), self.jitter, rng)


@dataclass(frozen=True, slots=True)
class Schedule:
    """A fixed list of waits: the wait before attempt n (n ≥ 1) is step n-1,
    jittered; past the last step there is no further attempt (None)."""

    steps_seconds: tuple[float, ...]
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if not self.steps_seconds or any(s < 0 for s in self.steps_seconds):
            raise ValueError("a schedule needs at least one step, none negative")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be within 0..1")

    @classmethod
    def parse(cls, text: str, jitter: float = 0.2, steps_max: int = 32) -> Schedule:
        """ "5,300,1800" -> Schedule((5, 300, 1800)); ValueError when malformed."""
        parts = [p.strip() for p in text.split(",")]
        if not parts or len(parts) > steps_max or any(not p for p in parts):
            raise ValueError(f"a comma-separated list of 1..{steps_max} numbers of seconds")
        steps: list[float] = []
        for part in parts:
            try:
                step = float(part)
            except ValueError:
                raise ValueError(f"{part!r} is not a number of seconds") from None
            if not 0 <= step <= RETRY_AFTER_MAX_SECONDS:
                raise ValueError(f"{part!r} is outside 0..{int(RETRY_AFTER_MAX_SECONDS)} seconds")
            steps.append(step)
        return cls(tuple(steps), jitter)

    @property
    def attempts_max(self) -> int:
        """Every attempt, the first included."""
        return len(self.steps_seconds) + 1

    def delay_seconds(
        self,
        attempt: int,
        retry_after_seconds: float | None = None,
        rng: random.Random | None = None,
    ) -> float | None:
        """The wait before `attempt` (1 = the first retry), or None past the last
        step. A Retry-After is honoured up to the step's own length."""
        if attempt < 1 or attempt > len(self.steps_seconds):
            return None
        step = self.steps_seconds[attempt - 1]
        if retry_after_seconds is not None:
            return max(0.0, min(retry_after_seconds, step))
        return _jittered(step, self.jitter, rng)
