"""A deadline around an await that is safe on every Python 3.11 the gate runs on.

Python 3.11.0 to 3.11.2 (3.11.2 is Debian 12's python3) have a bug in
`asyncio.timeout` / `asyncio.timeout_at` (CPython gh-102780, fixed in 3.11.3): when
the block is entered in a task that was cancelled before and carried on (its
`cancelling()` count above zero, e.g. a request whose body wait the HTTP guard
cancelled), an expiring deadline leaks a CancelledError instead of raising
TimeoutError, and the task then looks cancelled to everything above it. redis-py
avoids the stdlib's timeout on those versions for the same reason.

`deadline_at` is the corrected form (what 3.11.3+ does), used on every version so
that one implementation runs everywhere:

    enter:   remember the task's cancelling() count; call_at(when, expire)
    expire:  task.cancel(), marked expired
    exit:    timer cancelled; if expired: task.uncancel(); when no other cancel
             request is left (count back to what it was at enter) and the block
             ended with CancelledError -> TimeoutError; an outer cancel stays a
             CancelledError

Like `asyncio.timeout_at` it makes no task per call (asyncio.wait_for in 3.11 wraps
the awaited coroutine in one), which the group commit's hot path relies on.
Standard library only: it imports on a bare interpreter (tests/base/test_timeouts.py
runs it under /usr/bin/python3 too).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    """`async with deadline_at(when):` — TimeoutError once the loop's time passes
    `when` (None: no deadline)."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task", "_when")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._handle: asyncio.Handle | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline applies inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        if self._when is not None:
            loop = asyncio.get_running_loop()
            if self._when <= loop.time():
                self._handle = loop.call_soon(self._expire)
            else:
                self._handle = loop.call_at(self._when, self._expire)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._expired:
            return
        assert self._task is not None
        # Only our own cancel request is withdrawn; one made by anybody else (the
        # caller's caller cancelling the task) is still counted, so it propagates.
        if (
            self._task.uncancel() <= self._cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        ):
            raise TimeoutError from exc

    def _expire(self) -> None:
        assert self._task is not None
        self._handle = None
        self._expired = True
        self._task.cancel()

    @property
    def expired(self) -> bool:
        return self._expired


def deadline_at(when: float | None) -> Deadline:
    """A deadline at `when`, in the running loop's time (loop.time())."""
    return Deadline(when)


def deadline_in(seconds: float | None) -> Deadline:
    """A deadline `seconds` from now (None: none)."""
    if seconds is None:
        return Deadline(None)
    return Deadline(asyncio.get_running_loop().time() + seconds)
