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
endpoint answers it the way it answers its other problems.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gate.errors import Problem
from gate.http import send_answer

# Not counted in the bound: probes and scrapes must reach an overloaded worker.
UNGUARDED_PATHS = frozenset(("/healthz", "/readyz", "/metrics"))
# Requests whose body is read (and bounded); a GET's receive() is not the body.
BODY_METHODS = frozenset(("POST", "PUT", "PATCH", "DELETE"))
CLOSE = {"Connection": "close"}


def body_timeout(timeout_seconds: float) -> Problem:
    return Problem(
        "REQUEST_TIMEOUT",
        f"The request body did not arrive within {timeout_seconds:g} s.",
        headers=CLOSE,
    )


class Guard:
    """Bounds the requests in flight in this worker and the time each may take to
    send its body (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, concurrency_max: int, body_timeout_seconds: float) -> None:
        assert concurrency_max >= 1 and body_timeout_seconds > 0
        self.app = app
        self.concurrency_max = concurrency_max
        self.body_timeout_seconds = body_timeout_seconds
        self.in_flight = 0
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
        try:
            if scope["method"] in BODY_METHODS:
                receive = self._bounded(receive)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` with the body due within the bound of the request's start (not of
        each read: a body trickled a byte at a time must not reset the clock)."""
        timeout_seconds = self.body_timeout_seconds
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        body_done = False

        async def receive_body() -> Message:
            nonlocal body_done
            if body_done:
                # After the body only a disconnect can come, which a streaming
                # answer may wait for as long as it streams.
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise body_timeout(timeout_seconds) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        return receive_body
