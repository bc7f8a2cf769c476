"""Who goes first in a gate process while the expiry sweeper drains a backlog.

When a crowd's holds fall due together, the stock they hold is what buyers wait
for; the events of those releases (the outbox relay) and the next invariant check
are not. All three compete for the same CPU and the same database, so while a
sweeper of this process is draining (its last batch came back full), the relay and
the invariant monitor of the process wait before their next pass, but never longer
than `YIELD_MAX_SECONDS` at a time: a long drain delays them, it never starves
them. Process-local on purpose: another process's sweeper is not known here, and
every `gate serve` process runs a sweeper of its own. See docs/expiry.md ("Speed").
"""

from __future__ import annotations

import asyncio
import time

# A full batch marks the sweeper as draining for this long: the next batch starts at
# once, so a drain in progress is renewed well within it.
DRAINING_HOLD_SECONDS = 0.5
# The longest a background pass waits for a draining sweeper at a time.
YIELD_MAX_SECONDS = 5.0
# How often a waiting pass looks again.
YIELD_POLL_SECONDS = 0.05

_draining_until = 0.0


def mark_draining() -> None:
    """The sweeper's last batch came back full: more is due at once."""
    global _draining_until
    _draining_until = time.monotonic() + DRAINING_HOLD_SECONDS


def draining() -> bool:
    return time.monotonic() < _draining_until


async def yield_to_sweeper(stop: asyncio.Event, max_seconds: float = YIELD_MAX_SECONDS) -> float:
    """Wait while a sweeper of this process drains, at most `max_seconds` (or until
    `stop`); returns the seconds waited."""
    started = time.monotonic()
    while draining() and not stop.is_set():
        left = started + max_seconds - time.monotonic()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(stop.wait(), min(YIELD_POLL_SECONDS, left))
        except TimeoutError:
            pass
    return time.monotonic() - started
