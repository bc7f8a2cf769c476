"""The HTTP guard: what one worker's requests may hold, and for how long (issue #12).

    request ─▶ RequestObserver ─▶ Guard ─▶ FastLane ─▶ router ─▶ endpoint
                                    │                              │ receive()
           in flight ≥ http_concurrency_max?                       ▼
             yes ─▶ 503 OVERLOADED at once,           the body, bounded: not all in
                    Connection: close                 within body_timeout_seconds of
                                                      the request's start ─▶ 408
                                                      REQUEST_TIMEOUT, Connection: close

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
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gate.errors import Problem
from gate.http import send_answer

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


class _BodyReceive:
    """`receive` for a request whose body is due by `deadline` (time.monotonic()); while
    the body is not all in, it is listed in the guard's `waiting`."""

    __slots__ = (
        "deadline",
        "expired",
        "receive",
        "receiving",
        "task",
        "timeout_seconds",
        "waiting",
    )

    def __init__(
        self,
        receive: Receive,
        waiting: dict[int, _BodyReceive],
        deadline: float,
        timeout_seconds: float,
    ) -> None:
        self.receive = receive
        self.waiting = waiting
        self.deadline = deadline
        self.timeout_seconds = timeout_seconds
        self.task: asyncio.Task[object] | None = None
        self.receiving = False  # awaiting the next part of the body right now
        self.expired = False  # the watchdog cancelled that wait

    async def __call__(self) -> Message:
        if id(self) not in self.waiting:
            # The body is in: only a disconnect can come, which a streaming answer
            # may wait for as long as it streams.
            return await self.receive()
        if self.expired or time.monotonic() >= self.deadline:
            raise body_timeout(self.timeout_seconds)
        self.task = asyncio.current_task()
        self.receiving = True
        try:
            message = await self.receive()
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


class Guard:
    """Bounds the requests in flight in this worker and the time each may take to
    send its body (see the module docstring).

    The deadline is kept by one watchdog task per worker, not by a timer per request:
    in a micro-benchmark on the (shared, loaded) development machine `asyncio.timeout`
    around each read cost ~27 µs a POST on uvloop (a libuv timer made, started,
    stopped and freed), this registration 3-5 µs. The watchdog runs while some body is awaited,
    every `WATCH_SECONDS` (at most), and cancels only a wait *for the body* that is
    past its deadline; the body reader turns that cancellation into the 408."""

    def __init__(self, app: ASGIApp, *, concurrency_max: int, body_timeout_seconds: float) -> None:
        assert concurrency_max >= 1 and body_timeout_seconds > 0
        self.app = app
        self.concurrency_max = concurrency_max
        self.body_timeout_seconds = body_timeout_seconds
        self.watch_seconds = min(WATCH_SECONDS, body_timeout_seconds / 4)
        self.in_flight = 0
        self._waiting: dict[int, _BodyReceive] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._busy = Problem(
            "OVERLOADED",
            "Too many requests in progress on this server; retry shortly.",
            retry_after_seconds=1,
            headers=CLOSE,
            cacheable=True,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.concurrency_max:
            await send_answer(send, self._busy.encoded(scope["path"]))
            return
        self.in_flight += 1
        body: _BodyReceive | None = None
        try:
            if scope["method"] in BODY_METHODS:
                body = _BodyReceive(
                    receive,
                    self._waiting,
                    time.monotonic() + self.body_timeout_seconds,
                    self.body_timeout_seconds,
                )
                self._waiting[id(body)] = body
                if self._watchdog is None or self._watchdog.done():
                    self._watchdog = asyncio.get_running_loop().create_task(self._watch())
                receive = body
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if body is not None:
                self._waiting.pop(id(body), None)

    def expire(self, now: float) -> int:
        """Cancel the body waits past their deadline; how many were cancelled."""
        expired = 0
        for body in list(self._waiting.values()):
            if body.receiving and not body.expired and now >= body.deadline:
                body.expired = True
                if body.task is not None:
                    body.task.cancel()
                expired += 1
        return expired

    async def _watch(self) -> None:
        """While some body is awaited: expire the overdue ones every watch_seconds."""
        while self._waiting:
            await asyncio.sleep(self.watch_seconds)
            self.expire(time.monotonic())
