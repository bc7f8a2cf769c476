"""Guessing the admin token: every attempt counted per client address, one budget
for the admin API and the console's sign-in.

    /v1/admin/… (AdminGuard: an ASGI middleware before every admin route, those
                 the areas add included)
      no Authorization header        -> on to the route (its 401: not a guess)
      the admin token                -> AdminAttempts.look(address): over the bound?
                                        429, else on to the route
      anything else                  -> AdminAttempts.take(address): over the bound?
                                        429, else 401 here; both counted in
                                        gate_admin_auth_failures_total{reason}
    POST /console/api/session (gate/console/) -> the same: look, then take for a
                                        wrong token or a malformed body

AdminAttempts keeps, per client address (GATE_TRUSTED_PROXIES decides it, as for the
IP limiter), the attempts of the last WINDOW_SECONDS in Redis (lua/admin_attempt.lua,
judged by Redis's clock), so every worker and process shares one window: at most
ATTEMPTS_PER_WINDOW failed attempts, then 429 RATE_LIMITED with Retry-After. A wrong
token is counted atomically with the check of the bound, so guesses sent at once get
ten answers at most; the right token costs nothing (an operator cannot lock himself
out) but is refused too while its address is over the bound: were it let through, a
429 would mean "wrong" and a 200 "right", and guessing would go on at full speed. For the same
reason Redis unavailable is 503 for every attempt (an attempt that cannot be counted
is not let through). A wrong token is counted, not logged one by one: a guesser would
otherwise write the log.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable
from typing import Any

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from gate.base.errors import Problem, overloaded
from gate.base.limits import LimitSpec, Network, client_ip, rate_limited
from gate.base.metrics import METRICS
from gate.store.keys import admin_attempts
from gate.store.scripts import lua_source
from gate.web.auth import AdminAuth
from gate.web.http_io import send_answer

ATTEMPTS_PER_WINDOW = 10
WINDOW_SECONDS = 60
ADMIN_PREFIX = "/v1/admin/"
SCRIPT = "admin_attempt"

FAILURES = METRICS.counter(
    "gate_admin_auth_failures_total",
    "Admin API requests refused for their token, by reason (wrong_token, rate_limited).",
    ["reason"],
)


class AdminAttempts:
    """At most ATTEMPTS_PER_WINDOW attempts at the admin token per client address in
    any WINDOW_SECONDS, across every gate process (see the module docstring)."""

    SPEC = LimitSpec(ATTEMPTS_PER_WINDOW, WINDOW_SECONDS, ATTEMPTS_PER_WINDOW)
    SCOPE = "admin_auth"

    def __init__(self, redis: Any) -> None:
        # redis-py loads it again by itself when Redis answers NOSCRIPT.
        self._script = redis.register_script(lua_source(SCRIPT))

    async def take(self, address: str) -> None:
        """Count one attempt of `address`, or the 429 problem when its window is full
        (503 when Redis fails)."""
        await self._call(address, secrets.token_hex(8))

    async def look(self, address: str) -> None:
        """The 429 problem when `address`'s window is full; counts nothing."""
        await self._call(address, "")

    async def _call(self, address: str, member: str) -> None:
        try:
            retry_ms = await self._script(
                keys=[admin_attempts(address)],
                args=[WINDOW_SECONDS * 1000, ATTEMPTS_PER_WINDOW, member],
            )
        except RedisError:
            raise overloaded("Redis unavailable; the admin token cannot be checked.") from None
        if int(retry_ms) > 0:
            raise rate_limited(self.SCOPE, self.SPEC, int(retry_ms))


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None


class AdminGuard:
    """The ASGI middleware in front of /v1/admin/… (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        attempts: AdminAttempts,
        auth: AdminAuth,
        trusted: tuple[Network, ...],
        v6_prefix: int,
    ) -> None:
        self.app = app
        self.attempts = attempts
        self.auth = auth
        self.trusted = trusted
        self.v6_prefix = v6_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        authorization = _authorization(scope)
        if authorization is None:
            await self.app(scope, receive, send)
            return
        try:
            await self._check(scope, authorization)
        except Problem as refused:
            await send_answer(send, refused.encoded(scope["path"]))
            return
        await self.app(scope, receive, send)

    async def _check(self, scope: Scope, authorization: str) -> None:
        peer = scope.get("client")
        forwarded = next((v for k, v in scope["headers"] if k == b"x-forwarded-for"), None)
        address = client_ip(
            peer[0] if peer else None,
            forwarded.decode("latin-1") if forwarded is not None else None,
            self.trusted,
            self.v6_prefix,
        )
        try:
            self.auth.check(authorization)
        except Problem as wrong:
            await self._counted(self.attempts.take(address))
            FAILURES.labels("wrong_token").inc()
            raise wrong from None
        await self._counted(self.attempts.look(address))

    @staticmethod
    async def _counted(attempt: Awaitable[None]) -> None:
        try:
            await attempt
        except Problem as refused:
            if refused.code == "RATE_LIMITED":
                FAILURES.labels("rate_limited").inc()
            raise
