"""The HTTP guard: what one worker's requests may hold, and for how long.

    request ─▶ RequestObserver ─▶ FastLane (the guard's checks, then the hot routes)
                                    │      ─▶ router ─▶ endpoint
                                    │                     │ receive()
           in flight ≥ http_concurrency_max?              ▼
             yes ─▶ 503 OVERLOADED at once,    the body, bounded: not all in within
                    Connection: close          body_timeout_seconds of the request's
                                               start ─▶ 408 REQUEST_TIMEOUT,
                                               Connection: close

    the body's first receive() is stepped once, right away (`Guard.body_receive`):
      done, the whole body in it (the usual small POST) ─▶ replayed to the endpoint;
                                                           nothing registered
      done, more to come / not done (it would wait) ─▶ the bounded reader
                                                       (`BodyReceive`, the watchdog)

A client that sends its headers and then a body slowly (or never) would otherwise
hold an application task, and its connection, for as long as it likes; enough of
them and the worker has nothing left for buyers. The body deadline bounds how long
one request may wait for its body; the concurrency bound caps the requests a worker
holds at once, so a flood of them is answered 503 straight away instead of queuing.

Why not uvicorn's `limit_concurrency`: it counts open connections too, so a load
balancer's idle keep-alive pool would trip it, and it answers in plain text where
every error of this API is a problem+json with Retry-After.

The operations endpoints (/healthz, /readyz, /metrics) are not counted: an
overloaded worker must still be seen, not restarted for failing its probes.
The deadline is enforced where the body is read (`receive`), as a Problem, so each
endpoint answers it the way it answers its other problems; it is kept to within
WATCH_SECONDS (see `Guard`).

The guard is no ASGI layer of its own: the fast lane (gate/api/app.py), the innermost
middleware, which every request passes anyway, does its two checks. A layer of its
own, with a bounded reader registered for every POST, cost the sold-out rejection
a quarter of its time (docs/hotpath.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from starlette.types import Message, Receive

from gate.base.errors import Problem

log = logging.getLogger("gate.guard")

# Not counted in the bound: probes and scrapes must reach an overloaded worker.
UNGUARDED_PATHS = frozenset(("/healthz", "/readyz", "/metrics"))
# Requests whose body is read (and bounded); a GET's receive() is not the body.
BODY_METHODS = frozenset(("POST", "PUT", "PATCH", "DELETE"))
CLOSE = {"Connection": "close"}
# How often, at most, the watchdog looks for bodies past their deadline.
WATCH_SECONDS = 0.25


def body_timeout(timeout_seconds: float) -> Problem:
    return Problem(
        "REQUEST_TIMEOUT",
        f"The request body did not arrive within {timeout_seconds:g} s.",
        headers=CLOSE,
    )


class _Started:
    """Awaits a coroutine whose first step already ran (it yielded `step`, the future
    it waits on): the rest of that receive(), driven by whichever task awaits this."""

    __slots__ = ("coro", "step")

    def __init__(self, coro: Coroutine[Any, Any, Message], step: Any) -> None:
        self.coro = coro
        self.step = step

    def __await__(self) -> Generator[Any, Any, Message]:
        coro, step = self.coro, self.step
        while True:
            try:
                sent = yield step
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown in by the task: a cancellation
                try:
                    step = coro.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
            else:
                try:
                    step = coro.send(sent)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]

    def close(self) -> None:
        self.coro.close()


async def _awaiting(pending: Any) -> Message:
    message: Message = await pending
    return message


def _replaying(message: Message, receive: Receive) -> Receive:
    """`receive` that first gives back `message`, already received."""
    first: Message | None = message

    async def replay() -> Message:
        nonlocal first
        if first is not None:
            taken, first = first, None
            return taken
        return await receive()

    return replay


class BodyReceive:
    """`receive` for a request whose body is due by `deadline` (time.monotonic()); while
    the body is not all in, it is listed in the guard's `waiting`. It starts with
    what the guard's first step of receive() left: a part of the body to give back
    (`first`), or that receive() itself, to resume (`started`)."""

    __slots__ = (
        "deadline",
        "expired",
        "first",
        "receive",
        "receiving",
        "started",
        "task",
        "timeout_seconds",
        "waiting",
    )

    def __init__(
        self,
        receive: Receive,
        waiting: dict[int, BodyReceive],
        deadline: float,
        timeout_seconds: float,
        first: Message | None,
        started: _Started | None,
    ) -> None:
        self.receive = receive
        self.waiting = waiting
        self.deadline = deadline
        self.timeout_seconds = timeout_seconds
        self.first = first
        self.started = started
        self.task: asyncio.Task[object] | None = None
        self.receiving = False  # awaiting the next part of the body right now
        self.expired = False  # the watchdog cancelled that wait

    async def __call__(self) -> Message:
        if self.first is not None:
            # The first part, with more to come (the guard saw more_body).
            message, self.first = self.first, None
            return message
        if id(self) not in self.waiting:
            # The body is in: only a disconnect can come, which a streaming answer
            # may wait for as long as it streams.
            return await self.receive()
        if self.expired or time.monotonic() >= self.deadline:
            raise body_timeout(self.timeout_seconds)
        self.task = asyncio.current_task()
        self.receiving = True
        try:
            started, self.started = self.started, None
            message = await (started if started is not None else self.receive())
        except asyncio.CancelledError:
            if not self.expired:
                raise
            # The watchdog's cancellation, not the server's: taken back, answered 408.
            if self.task is not None:
                self.task.uncancel()
            raise body_timeout(self.timeout_seconds) from None
        finally:
            self.receiving = False
        if message["type"] != "http.request" or not message.get("more_body", False):
            del self.waiting[id(self)]
        return message

    def close(self) -> None:
        """The request is over: off the list, and a receive() left started is closed."""
        self.waiting.pop(id(self), None)
        if self.started is not None:
            self.started.close()
            self.started = None


class Guard:
    """Bounds the requests in flight in this worker and the time each may take to
    send its body (see the module docstring). The fast lane calls it: `busy` when
    `in_flight` is at `concurrency_max`, else `in_flight` counted up and down around
    the request, and `body_receive` for a request with a body.

    The deadline is kept by one watchdog task per worker, not by a timer per request:
    in a micro-benchmark on the (shared, loaded) development machine `asyncio.timeout`
    around each read cost ~27 µs a POST on uvloop (a libuv timer made, started,
    stopped and freed), a registration 3-5 µs. And the usual POST needs neither: its
    body came with its headers, so the first receive() returns without waiting, and
    the guard hands it on as it is. Only a body that is not all in gets the bounded
    reader. The watchdog runs while some body is awaited, every `WATCH_SECONDS` (at
    most), and cancels only a wait *for the body* that is past its deadline; the body
    reader turns that cancellation into the 408."""

    def __init__(self, *, concurrency_max: int, body_timeout_seconds: float) -> None:
        assert concurrency_max >= 1 and body_timeout_seconds > 0
        self.concurrency_max = concurrency_max
        self.body_timeout_seconds = body_timeout_seconds
        self.watch_seconds = min(WATCH_SECONDS, body_timeout_seconds / 4)
        self.in_flight = 0
        self._waiting: dict[int, BodyReceive] = {}
        # The edge's requests whose body is still coming (gate/web/edge.py): key ->
        # (deadline, what to call once it has passed).
        self._deadlines: dict[int, tuple[float, Callable[[], None]]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self.busy = Problem(
            "OVERLOADED",
            "Too many requests in progress on this server; retry shortly.",
            retry_after_seconds=1,
            headers=CLOSE,
            cacheable=True,
        )

    def body_receive(self, receive: Receive) -> Receive:
        """The `receive` to give the endpoint of a request with a body: the server's
        own, with the first message given back, when the body is all in already;
        else a `BodyReceive`, which the caller closes when the request ends.

        One step of the server's receive() is taken here, synchronously: if it
        completes, the first message is in hand without a wait."""
        pending = receive()
        if type(pending) is types.CoroutineType:
            try:
                step = pending.send(None)
            except StopIteration as done:
                message: Message = done.value
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return _replaying(message, receive)
                return self._bounded(receive, message, None)
            return self._bounded(receive, None, _Started(pending, step))
        # Not a coroutine (no server of ours): every read bounded.
        return self._bounded(receive, None, _Started(_awaiting(pending), None))

    def _bounded(
        self, receive: Receive, first: Message | None, started: _Started | None
    ) -> BodyReceive:
        body = BodyReceive(
            receive,
            self._waiting,
            time.monotonic() + self.body_timeout_seconds,
            self.body_timeout_seconds,
            first,
            started,
        )
        self._waiting[id(body)] = body
        self._ensure_watchdog()
        return body

    def watch(self, key: int, expired: Callable[[], None]) -> None:
        """Call `expired` once `body_timeout_seconds` from now have passed, unless
        `unwatch(key)` comes first: the edge's request whose body did not come with
        its headers (it holds no slot and no task meanwhile, only its connection)."""
        self._deadlines[key] = (time.monotonic() + self.body_timeout_seconds, expired)
        self._ensure_watchdog()

    def unwatch(self, key: int) -> None:
        self._deadlines.pop(key, None)

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def expire(self, now: float) -> int:
        """Cancel the body waits past their deadline, and call the edge's; how many."""
        expired = 0
        for key, (deadline, late) in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[key]
                try:
                    late()
                except Exception:  # the watchdog must go on for the others
                    log.exception("a late body's answer failed")
                expired += 1
        for body in list(self._waiting.values()):
            if body.receiving and not body.expired and now >= body.deadline:
                body.expired = True
                if body.task is not None:
                    body.task.cancel()
                expired += 1
        return expired

    async def _watch(self) -> None:
        """While some body is awaited: expire the overdue ones every watch_seconds."""
        while self._waiting or self._deadlines:
            await asyncio.sleep(self.watch_seconds)
            self.expire(time.monotonic())
