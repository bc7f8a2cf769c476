"""Single flight: concurrent callers asking for the same key share one call.

    caller A ── run(k, make) ── no flight for k: make() starts, as a task ──┐
    caller B ── run(k, make) ── k in flight: waits for that task ──────────┤
                                                                           └──> both get its
                                                   result, or both its exception
    caller C ── run(k, make) ── after it landed: a new flight

Every cache a request fills (a deal loaded into Redis, a deal's row, the highest deal
id, a room's document) fills through one of these, so that N requests arriving
together for what the process does not hold yet cost one look-up, not N: a gate
started (or a cache emptied) under a flood sends its stores the flood's number of
distinct keys, not its concurrency.

The call runs as a task of its own: a caller cancelled while it waits (its client
went away) leaves the flight running for the others. A flight ends when its call
does; nothing is remembered after (the caller's cache keeps the result). At most
`flights_max` keys are in flight at once; past that a caller runs its call alone,
so the map never grows beyond the bound whatever the keys.

`FreshRead` is the same for a read whose answer must be at least as new as the
question (a value another process may change, such as the deals' generation): a
caller shares only a read sent after it asked, so at most one read is in flight and
those who ask meanwhile share the next one.

    caller A ── read() ── none in flight: read 1 ─────────────────────> A
    caller B ── read() ── read 1 in flight (sent before B asked) ─┐
    caller C ── read() ───────────────────────────────────────────┴─ read 2 ──> B, C
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from functools import partial
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

FLIGHTS_MAX = 100_000


class SingleFlight(Generic[K, V]):
    __slots__ = ("_flights", "flights_max")

    def __init__(self, flights_max: int = FLIGHTS_MAX) -> None:
        self._flights: dict[K, asyncio.Task[V]] = {}
        self.flights_max = flights_max

    async def run(self, key: K, make: Callable[[], Coroutine[Any, Any, V]]) -> V:
        """The result of `make()`, shared with every caller of the same key while it runs."""
        task = self._flights.get(key)
        if task is None:
            if len(self._flights) >= self.flights_max:
                return await make()
            task = asyncio.get_running_loop().create_task(make())
            self._flights[key] = task
            task.add_done_callback(partial(self._landed, key))
        return await asyncio.shield(task)

    def in_flight(self, key: K) -> bool:
        return key in self._flights

    def __len__(self) -> int:
        return len(self._flights)

    def _landed(self, key: K, task: asyncio.Task[V]) -> None:
        if self._flights.get(key) is task:
            del self._flights[key]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone


class FreshRead(Generic[V]):
    """One read of `make()` in flight at a time, each caller given a read sent after
    it asked (see the module docstring)."""

    __slots__ = ("_make", "_next", "_running")

    def __init__(self, make: Callable[[], Coroutine[Any, Any, V]]) -> None:
        self._make = make
        self._running: asyncio.Task[V] | None = None
        self._next: asyncio.Future[V] | None = None

    async def read(self) -> V:
        if self._running is None:
            return await asyncio.shield(self._start())
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._next)

    def _start(self) -> asyncio.Task[V]:
        task = asyncio.get_running_loop().create_task(self._make())
        self._running = task
        task.add_done_callback(self._landed)
        return task

    def _landed(self, task: asyncio.Task[V]) -> None:
        self._running = None
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone
        waiting, self._next = self._next, None
        if waiting is not None:
            self._start().add_done_callback(partial(_settle, waiting))


def _settle(future: asyncio.Future[V], task: asyncio.Task[V]) -> None:
    """Hand a read's outcome to the callers who waited for it."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
        return
    exc = task.exception()
    if exc is not None:
        future.set_exception(exc)
        future.exception()  # retrieved: every waiter may have gone
    else:
        future.set_result(task.result())
