"""room_ticket.lua calls on the wire: the cheapest Redis round trip Python makes here.

A join or a poll is one buyer's part of a script call, and most of what it cost was
not the buyer's work but the call around it: packing a dozen arguments into RESP,
Redis reading them, setting up the script, reading the deal's state and the clock.
Here

- each deal's command is packed once per mode ("join", "read"): EVALSHA, the sha,
  the six keys and the ARGV that never change (mode, poll floor and ceiling) are
  one `Command`; a buyer adds only its user id (and a join its draw score and new
  ticket id, gate/room/fairness.py);
- the buyers of one deal and mode who ask in one event-loop turn share one call
  (`Batch`, at most `batch_max` buyers; the script handles them in turn, exactly as
  separate calls), and the calls of one turn go out in one write, as the script
  runner's do (both through gate/store/batcher.py), on a connection of the room's own
  (gate/store/resp.py RespConnection);
- each buyer still waits on a future of its own (a cancelled request cancels only
  its own), handed its part of the reply by the batch;
- the script's latency is observed once per write (its last reply), in
  `gate_redis_script_seconds{script="room_ticket"}` like every script's.

    turn:  join(u1) join(u2) read(u3) join(u4)         (deal 7)
    write: EVALSHA room_ticket … join … u1 s1 t1 u2 s2 t2 u4 s4 t4 | EVALSHA … read … u3
    reply: [[u1's], [u2's], [u4's]] | [[u3's]]  ──> four futures

Nothing is ever re-sent but a NOSCRIPT reply (the script did not run): each caller
gets the error object as its result, reloads the scripts and calls again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import ResponseError

from gate.store.batcher import TurnBatcher
from gate.store.resp import RespConnection
from gate.store.scripts import script_seconds


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Command:
    """EVALSHA sha numkeys KEYS… and the first ARGV, packed in RESP without the array
    header (which counts the buyers' arguments too), and how many arguments each
    buyer adds. Compared by identity: a deal's commands are built once and kept."""

    __slots__ = ("fixed", "packed", "step")

    def __init__(self, sha: str, keys: tuple[str, ...], head: tuple[str, ...], step: int):
        parts = ["EVALSHA", sha, str(len(keys)), *keys, *head]
        self.fixed = len(parts)
        self.packed = b"".join(bulk(p.encode()) for p in parts)
        self.step = step

    def pack(self, members: list[bytes]) -> bytes:
        """The whole command for these buyers' arguments (each already in RESP)."""
        count = self.fixed + len(members) * self.step
        return b"*%d\r\n%s%s" % (count, self.packed, b"".join(members))


# One buyer's part of a call: its arguments in RESP, and its future.
Part = tuple[bytes, "asyncio.Future[Any]"]


class Batch:
    """One script call's buyers: waits for the call's reply (gate/store/resp.py's Waiter)
    and hands each buyer its part, or every buyer the error."""

    __slots__ = ("callers", "command", "finished", "members")

    def __init__(self, command: Command, parts: list[Part]) -> None:
        self.command = command
        self.members = [member for member, _ in parts]
        self.callers = [fut for _, fut in parts]
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, reply: Any, /) -> None:
        self.finished = True
        callers = self.callers
        if type(reply) is list:
            if len(reply) == len(callers):
                for fut, part in zip(callers, reply, strict=True):
                    if not fut.done():
                        fut.set_result(part)
                return
            reply = ResponseError(f"room_ticket: {len(reply)} replies for {len(callers)} buyers")
        # An error reply (NOSCRIPT, a script error): the same for every buyer.
        for fut in callers:
            if not fut.done():
                fut.set_result(reply)

    def set_exception(self, exception: BaseException, /) -> None:
        self.finished = True
        for fut in self.callers:
            if not fut.done():
                fut.set_exception(exception)


class Wire:
    """Buyers' script calls, joined per deal and mode and written once per loop
    turn on one connection."""

    def __init__(
        self, url: str, timeout_seconds: float, batch_max: int, flush_every: int = 0
    ) -> None:
        self.conn = RespConnection(url, timeout_seconds)
        # At most this many buyers in one script call, and calls in one write.
        self.batch_max = max(1, batch_max)
        # Written before the loop turn ends once this many buyers wait (0: at the
        # end of the turn only), as the script runner's (GATE_REDIS_FLUSH_EVERY).
        self.flush_every = flush_every if flush_every > 0 else self.batch_max
        self._calls: TurnBatcher[Command, Part] = TurnBatcher(
            self._write, self.batch_max, self.flush_every
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.seconds = script_seconds("room_ticket")

    def call(self, command: Command, member: bytes) -> asyncio.Future[Any]:
        """One buyer's part of `command` (its arguments in RESP); the future resolves to
        the buyer's reply (an error reply to the exception object) or fails when the
        connection does."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(command, (member, fut))
        return fut

    def _write(self, groups: list[tuple[Command, list[Part]]]) -> None:
        batches = [Batch(command, parts) for command, parts in groups]
        if not self.conn.connected:
            task = asyncio.get_running_loop().create_task(self._connect_then_send(batches))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._send(batches)

    def _send(self, batches: list[Batch]) -> None:
        step = self.batch_max
        for i in range(0, len(batches), step):
            part = batches[i : i + step]
            try:
                self.conn.send_packed(b"".join(b.command.pack(b.members) for b in part), part)
            except Exception as exc:
                for batch in part:
                    batch.set_exception(exc)
                continue
            part[-1].callers[-1].add_done_callback(self._timer(time.perf_counter()))

    def _timer(self, sent: float) -> Any:
        def observe(_: asyncio.Future[Any]) -> None:
            self.seconds.observe(time.perf_counter() - sent)

        return observe

    async def _connect_then_send(self, batches: list[Batch]) -> None:
        try:
            await self.conn.connect()
        except Exception as exc:
            for batch in batches:
                batch.set_exception(exc)
            return
        self._send(batches)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.conn.close()
