"""This process's view of the database's health, second by second: a leaf, no I/O.

    reservation commit ──> commit(ms)        ┐
    a database connection waited for ──> pool_wait()   ├─> HEALTH (this process)
    a 503 OVERLOADED made ──> overloaded()   ┘
    the room loop, once a second ──> HEALTH.take() ──> the room's shared counters in
        Redis (gate/room/estimate.py) ──> the automatic rate (gate/room/steering.py)

Only counts and a bounded sample of commit times: recording is an addition or an
append, taking the second's figures is a sort of at most SAMPLES_MAX numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

# Commit times kept per second at most (the p99 of a busier second is of these).
SAMPLES_MAX = 2048


@dataclass(frozen=True, slots=True)
class Tally:
    """One interval's figures: 503s made, connections waited for, commit p99 (ms,
    None without a commit)."""

    overloaded: int
    pool_waits: int
    commit_p99_ms: float | None


class DbHealth:
    def __init__(self) -> None:
        self._overloaded = 0
        self._pool_waits = 0
        self._commits: list[float] = []

    def overloaded(self) -> None:
        self._overloaded += 1

    def pool_wait(self) -> None:
        self._pool_waits += 1

    def commit(self, ms: float) -> None:
        if len(self._commits) < SAMPLES_MAX:
            self._commits.append(ms)

    def take(self) -> Tally:
        """The figures since the last take, and a fresh start."""
        commits, self._commits = self._commits, []
        p99 = None
        if commits:
            commits.sort()
            p99 = commits[min(len(commits) - 1, int(len(commits) * 0.99))]
        tally = Tally(self._overloaded, self._pool_waits, p99)
        self._overloaded = self._pool_waits = 0
        return tally


HEALTH = DbHealth()
