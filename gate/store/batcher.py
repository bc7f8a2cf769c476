"""Calls batched per event-loop turn: what is asked during one turn goes out together.

    one loop turn:  add(k1, a)  add(k2, b)  add(k1, c)  …
                       │ groups[k] += item
                       ├─ a group reaches group_max ──> set aside, full (a new one opens)
                       ├─ flush_every items wait ──> write now, before the turn ends
                       └─ the turn's first item ──> loop.call_soon ──> write at its end
    write([(k1, [a, c]), (k2, [b])])    called synchronously: full groups first,
                                        then the open ones in the order they opened

Three callers share it: the script runner's pipeline (gate/store/scripts.py, one
group), the waiting room's script calls joined per deal and mode (gate/room/wire.py)
and the confirmations of one deal joined into one script call (gate/inventory/mirror.py).
It is on the hot path: an `add` is a dict lookup, an append and two comparisons; no
task, no future of its own (the caller keeps its futures in its items), and one
`call_soon` per turn at most.

Writing before the turn ends (`flush_every`) lets Redis start on the first requests
of a crowded turn while the process still parses the rest, instead of idling until
all of them are in.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class TurnBatcher(Generic[K, T]):
    """Items added during one event-loop turn, grouped by key (at most `group_max` a
    group), handed to `write` at the end of the turn, or as soon as `flush_every`
    items wait (0: at the end of the turn only)."""

    __slots__ = ("_full", "_open", "_scheduled", "_waiting", "_write", "flush_every", "group_max")

    def __init__(
        self,
        write: Callable[[list[tuple[K, list[T]]]], None],
        group_max: int,
        flush_every: int = 0,
    ) -> None:
        self._write = write
        self.group_max = max(1, group_max)
        self.flush_every = flush_every if flush_every > 0 else sys.maxsize
        self._open: dict[K, list[T]] = {}
        self._full: list[tuple[K, list[T]]] = []
        self._waiting = 0
        self._scheduled = False

    def add(self, key: K, item: T) -> None:
        group = self._open.get(key)
        if group is None:
            group = self._open[key] = []
        group.append(item)
        if len(group) >= self.group_max:
            del self._open[key]
            self._full.append((key, group))
        self._waiting += 1
        if self._waiting >= self.flush_every:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn_ended)

    def flush(self) -> None:
        """Write what waits now (nothing when nothing does)."""
        if not self._waiting:
            return
        groups = self._full
        groups.extend(self._open.items())
        self._full, self._open, self._waiting = [], {}, 0
        self._write(groups)

    @property
    def waiting(self) -> int:
        """Items added and not written yet."""
        return self._waiting

    def _turn_ended(self) -> None:
        self._scheduled = False
        self.flush()
