"""room_ticket.lua calls on the wire: the cheapest Redis round trip Python makes here.

A join or a poll is one script call, and most of what it costs in the gate is not
the script but the call: packing thirteen arguments into RESP, a future of the
runner's own per call with a gather over them, a timing metric per call. Here

- each deal's command is packed once per mode ("join", "read"): EVALSHA, the sha,
  the five keys and the ARGV that never change (mode, poll floor and ceiling) are
  one bytes prefix; a call appends only the user id (and a join its random score);
- the calls made in one event-loop turn go out in one write, as the script
  runner's do (gate/scripts.py), on a connection of the room's own
  (gate/resp.py RespConnection), whose reader resolves the callers' own futures;
- the script's latency is observed once per batch (the batch's last reply), in
  `gate_redis_script_seconds{script="room_ticket"}` like every script's.

Nothing is ever re-sent but a NOSCRIPT reply (the script did not run): the caller
gets the error object as its result, reloads the scripts and calls again.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from gate.resp import RespConnection
from gate.scripts import script_seconds

# Random prequeue scores: 50 bits from 7 bytes of os.urandom, drawn 1,024 at a time
# (one system call per 1,024 joins instead of one per join, secrets' quality).
SCORE_BYTES = 7
SCORE_SHIFT = SCORE_BYTES * 8 - 50
RANDOM_BATCH = 1024


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def command_prefix(sha: str, keys: tuple[str, ...], head: tuple[str, ...], rest: int) -> bytes:
    """EVALSHA sha numkeys KEYS… and the first ARGV, in RESP, announcing `rest` more
    arguments that each call appends."""
    parts = ["EVALSHA", sha, str(len(keys)), *keys, *head]
    return b"*%d\r\n" % (len(parts) + rest) + b"".join(bulk(p.encode()) for p in parts)


class RandomScores:
    """Uniform integers in [0, 2^50) from os.urandom, fetched in batches."""

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0

    def draw(self) -> int:
        at = self._at
        if at + SCORE_BYTES > len(self._buf):
            self._buf = os.urandom(SCORE_BYTES * RANDOM_BATCH)
            at = 0
        self._at = at + SCORE_BYTES
        return int.from_bytes(self._buf[at : at + SCORE_BYTES], "big") >> SCORE_SHIFT


class Wire:
    """Packed script calls, coalesced per loop turn onto one connection."""

    def __init__(
        self, url: str, timeout_seconds: float, batch_max: int, flush_every: int = 0
    ) -> None:
        self.conn = RespConnection(url, timeout_seconds)
        self.batch_max = max(1, batch_max)
        # Written before the loop turn ends once this many calls wait (0: at the end
        # of the turn only), as the script runner's (GATE_REDIS_FLUSH_EVERY).
        self.flush_every = flush_every if flush_every > 0 else self.batch_max
        self._data: list[bytes] = []
        self._futures: list[asyncio.Future[Any]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.seconds = script_seconds("room_ticket")

    def call(self, data: bytes) -> asyncio.Future[Any]:
        """Send one packed command; the future resolves to its reply (an error reply to
        the exception object) or fails when the connection does."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._data.append(data)
        self._futures.append(fut)
        if len(self._futures) >= self.flush_every:
            self._write()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        if self._futures:
            self._write()

    def _write(self) -> None:
        data, futures = self._data, self._futures
        self._data, self._futures = [], []
        if not self.conn.connected:
            task = asyncio.get_running_loop().create_task(self._connect_then_send(data, futures))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._send(data, futures)

    def _send(self, data: list[bytes], futures: list[asyncio.Future[Any]]) -> None:
        step = self.batch_max
        for i in range(0, len(futures), step):
            batch = futures[i : i + step]
            try:
                self.conn.send_packed(b"".join(data[i : i + step]), batch)
            except Exception as exc:
                self._fail(batch, exc)
                continue
            batch[-1].add_done_callback(self._timer(time.perf_counter()))

    def _timer(self, sent: float) -> Any:
        def observe(_: asyncio.Future[Any]) -> None:
            self.seconds.observe(time.perf_counter() - sent)

        return observe

    async def _connect_then_send(
        self, data: list[bytes], futures: list[asyncio.Future[Any]]
    ) -> None:
        try:
            await self.conn.connect()
        except Exception as exc:
            self._fail(futures, exc)
            return
        self._send(data, futures)

    @staticmethod
    def _fail(futures: list[asyncio.Future[Any]], exc: Exception) -> None:
        # Counted in gate_redis_errors_total by the caller, as a failed reply is.
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.conn.close()
