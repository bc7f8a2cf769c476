"""The live sale console: a page for the people running a sale.

    GET  /console                         the page (HTML; CSS and JS beside it, packaged)
    GET  /console/static/{name}           console.css, console.js
    POST /console/api/session             {"token": admin token} -> session cookie
    GET  /console/api/session             who is signed in, the CSRF token
    DELETE /console/api/session           sign out (CSRF)
    GET  /console/api/snapshot            the live numbers (gate/console/snapshot.py)
    GET  /console/api/deals/{id}/ledger   the deal's latest ledger rows, newest first
    GET  /console/api/deals/{id}/advice   bucket advice
    POST /console/api/deals/{id}/{action} buckets | stock | window | pause | resume, and
                                          the actions of
                                          the areas' console panels (room_message,
                                          retry_dead_letters)
    POST /console/api/panels/{panel}/{action}  the actions of the areas' gate-wide
                                          panels (webhooks/retry)

Off unless GATE_CONSOLE=1 (on by default with GATE_ENV=dev): then no route exists
and /console is the usual 404. Every /console/api call but sign-in needs the signed
session cookie (401 otherwise); every state-changing one the X-CSRF-Token header
(403 otherwise). The actions call the very functions the admin API calls
(gate/inventory/deals.py), with actor "console:<session prefix>", so the ledger names the
operator's session; actions that move no stock are logged with it.

Sign-in is the one call that takes the admin token, so it is the one a guesser
would hammer:

    POST /console/api/session
      -> AdminAttempts (gate/web/admin_guard.py): at most 10 attempts per client
         address (GATE_TRUSTED_PROXIES decides the address, as for the IP limiter) in
         any 60 s that failed (a wrong token, a malformed body), counted in Redis for
         every worker and process, one budget with the admin API's failed attempts;
         beyond it 429 RATE_LIMITED with Retry-After, the right token too (Redis
         unreachable: 503)
      -> the token compared in constant time; a wrong one is 401 and counted in
         gate_console_signin_failures_total{reason}, not logged one by one (a
         guesser would otherwise write the log)
"""

from __future__ import annotations

import importlib
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gate.base.errors import Problem, invalid, not_found, overloaded
from gate.base.limits import client_ip
from gate.base.metrics import METRICS
from gate.base.settings import SettingsError, env_bool, env_int
from gate.console.session import (
    COOKIE_NAME,
    CSRF_HEADER,
    Session,
    SessionSigner,
    request_scheme,
    unauthorized,
)
from gate.console.snapshot import Snapshots
from gate.extensions import ConsoleAction, Extension
from gate.inventory.pause import pause, pause_body, resume, resume_body
from gate.store.keys import console_revoked
from gate.web.admin_guard import AdminAttempts
from gate.web.http_io import json_response, read_json

if TYPE_CHECKING:
    from gate.base.settings import Settings
    from gate.runtime import Gate

log = logging.getLogger("gate.console")

SESSION_SECONDS_DEFAULT = 1800
SECRET_MIN_CHARS = 32
STATIC_FILES = {
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
}
# The page loads only its own files: no CDN, no inline script, no framing.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LEDGER_ROWS_SHOWN = 50
MAX_DEAL_ID = 2**63 - 1
SECURE_COOKIE_MODES = ("always", "auto")

SIGN_IN_FAILURES = METRICS.counter(
    "gate_console_signin_failures_total",
    "Console sign-ins refused, by reason (wrong_token, malformed, rate_limited).",
    ["reason"],
)


@dataclass(frozen=True)
class ConsoleSettings:
    enabled: bool
    session_seconds: int
    # GATE_CONSOLE_SECRET, or the admin token when unset.
    secret: str = field(repr=False)
    # The session key is bound to it (gate/console/session.py).
    admin_token: str = field(repr=False)
    # "always": every cookie Secure; "auto": when the request's scheme is https.
    secure_cookie: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str], settings: Settings) -> ConsoleSettings:
        enabled = env_bool(env, "GATE_CONSOLE", settings.is_dev)
        session_seconds = env_int(
            env, "GATE_CONSOLE_SESSION_SECONDS", SESSION_SECONDS_DEFAULT, 60, 43_200
        )
        secret = env.get("GATE_CONSOLE_SECRET", "").strip()
        if secret and len(secret) < SECRET_MIN_CHARS:
            raise SettingsError(
                f"GATE_CONSOLE_SECRET must be at least {SECRET_MIN_CHARS} characters"
            )
        secure_cookie = env.get("GATE_CONSOLE_SECURE_COOKIE", "auto").strip().lower() or "auto"
        if secure_cookie not in SECURE_COOKIE_MODES:
            raise SettingsError("GATE_CONSOLE_SECURE_COOKIE must be 'always' or 'auto'")
        admin_token = settings.admin_token.reveal()
        return cls(enabled, session_seconds, secret or admin_token, admin_token, secure_cookie)


# The console's own actions: (gate, deal id, body, actor) -> the deal's admin view.
# Areas' actions come with their console panels (gate/extensions.py ConsolePanel).
Action = Callable[["Gate", int, Any, str], Awaitable[dict[str, Any]]]


async def _rebucket(gate: Gate, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
    return await gate.deals.rebucket(deal_id, body, actor=actor)


async def _stock(gate: Gate, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
    return await gate.deals.adjust_stock(deal_id, body, actor=actor)


async def _window(gate: Gate, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
    return await gate.deals.set_window(deal_id, body, actor=actor)


async def _pause(gate: Gate, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
    reason = pause_body(body)
    return await pause(gate.db, gate.mirror, deal_id, reason=reason, actor=actor)


async def _resume(gate: Gate, deal_id: int, body: Any, actor: str) -> dict[str, Any]:
    """Refused (409, naming the breaches) while `gate check` of the deal fails."""
    note = resume_body(body)
    return await resume(gate.db, gate.mirror, deal_id, actor=actor, note=note)


ACTIONS: Mapping[str, Action] = {
    "buckets": _rebucket,
    "stock": _stock,
    "window": _window,
    "pause": _pause,
    "resume": _resume,
}


def area_action(gate: Gate, name: str) -> ConsoleAction | None:
    """An installed area's console action of that name (its ConsolePanel's), if any."""
    for ext in gate.extensions:
        for panel in ext.console_panels:
            action = panel.actions.get(name)
            if action is not None:
                return action
    return None


def _static(name: str) -> bytes:
    return importlib.resources.files("gate.console").joinpath("static", name).read_bytes()


def bucket_advice(available: int, buckets: int) -> dict[str, Any]:
    """docs/buckets.md's rule of thumb: 1 to 4 buckets, at least ~50 units each.
    `gate deal buckets --advise` (gate/inventory/advice.py) replaces it where it exists."""
    suggested = max(1, min(4, available // 50))
    return {
        "source": "docs/buckets.md",
        "suggested": suggested,
        "current": buckets,
        "rule": (
            "Most deals: 1 to 4 buckets (group commit makes one row enough for most);"
            " keep at least ~50 available units per bucket; more buckets only for many"
            " gate processes on one deal, confirmed by lock waits and DB retries rising."
        ),
    }


class Console:
    def __init__(self, gate: Gate, settings: ConsoleSettings) -> None:
        self.gate = gate
        self.settings = settings
        self.signer = SessionSigner(settings.secret, settings.admin_token, settings.session_seconds)
        # The admin API's attempts too: one budget per address (gate/web/admin_guard.py).
        self.sign_ins = AdminAttempts(gate.redis)
        self.snapshots = Snapshots(gate)
        self._files = {name: _static(name) for name in STATIC_FILES}
        self._page = _static("index.html")

    # -- session ---------------------------------------------------------------------

    async def session(self, request: Request) -> Session:
        session = self.signer.verify(request.cookies.get(COOKIE_NAME))
        try:
            revoked = await self.gate.redis.exists(console_revoked(session.sid))
        except RedisError:
            # Whether the session was signed out cannot be known: refuse, briefly.
            raise overloaded("Redis unavailable; the console session cannot be checked.") from None
        if revoked:
            raise unauthorized("The console session has ended; sign in again.")
        return session

    async def changing(self, request: Request) -> Session:
        """A state-changing call: a session and its CSRF token."""
        session = await self.session(request)
        self.signer.check_csrf(session, request.headers.get(CSRF_HEADER))
        return session

    def _secure(self, request: Request) -> bool:
        if self.settings.secure_cookie == "always":
            return True
        client = request.client
        scheme = request_scheme(
            request.url.scheme,
            client.host if client else None,
            request.headers.get("x-forwarded-proto"),
            self.gate.settings.trusted_proxies,
        )
        return scheme == "https"

    def _client_address(self, request: Request) -> str:
        settings = self.gate.settings
        return client_ip(
            request.client.host if request.client else None,
            request.headers.get("x-forwarded-for"),
            settings.trusted_proxies,
            settings.limit_ip_v6_prefix,
        )

    def _cookie(self, response: Response, request: Request, value: str, max_age: int) -> None:
        response.set_cookie(
            COOKIE_NAME,
            value,
            max_age=max_age,
            path="/console",
            httponly=True,
            samesite="strict",
            secure=self._secure(request),
        )

    # -- endpoints -------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in self._files:
            raise not_found("file")
        return Response(self._files[name], media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

    async def sign_in(self, request: Request) -> Response:
        # As on the admin API (gate/web/admin_guard.py): a failed attempt, a malformed
        # one too, is counted against its address; while the address is over the
        # bound even the right token is refused, so a 429 tells a guesser nothing.
        address = self._client_address(request)
        await self._attempt(self.sign_ins.look(address))
        try:
            token = await self._token(request)
        except Problem:
            SIGN_IN_FAILURES.labels("malformed").inc()
            await self._attempt(self.sign_ins.take(address))
            raise
        try:
            self.gate.admin_auth.check(f"Bearer {token}")
        except Problem:
            SIGN_IN_FAILURES.labels("wrong_token").inc()
            await self._attempt(self.sign_ins.take(address))
            raise unauthorized("Wrong admin token.") from None
        session, cookie = self.signer.issue()
        log.warning("console: %s signed in", session.actor)
        response = json_response(self._session_view(session))
        self._cookie(response, request, cookie, self.settings.session_seconds)
        return response

    async def _token(self, request: Request) -> str:
        body = await read_json(request, self.gate.settings.body_max_bytes)
        if (
            not isinstance(body, dict)
            or set(body) != {"token"}
            or not isinstance(body["token"], str)
        ):
            raise invalid('The body must be {"token": "<admin token>"}.')
        return body["token"]

    @staticmethod
    async def _attempt(counted: Awaitable[None]) -> None:
        try:
            await counted
        except Problem as refused:
            if refused.code == "RATE_LIMITED":
                SIGN_IN_FAILURES.labels("rate_limited").inc()
            raise

    def _session_view(self, session: Session) -> dict[str, Any]:
        return {
            "signed_in": True,
            "actor": session.actor,
            "expires_at": session.expires_at,
            "csrf_token": self.signer.csrf_token(session),
        }

    async def whoami(self, request: Request) -> Response:
        session = await self.session(request)
        return json_response(self._session_view(session))

    async def sign_out(self, request: Request) -> Response:
        session = await self.changing(request)
        left = max(1, session.expires_at - int(time.time()))
        await self.gate.redis.set(console_revoked(session.sid), "1", ex=left)
        log.warning("console: %s signed out", session.actor)
        response = json_response({"signed_in": False})
        self._cookie(response, request, "", 0)
        return response

    async def snapshot(self, request: Request) -> Response:
        await self.session(request)
        return json_response(await self.snapshots.get())

    @staticmethod
    def _deal_id(request: Request) -> int:
        deal_id = int(request.path_params["deal_id"])
        if not 1 <= deal_id <= MAX_DEAL_ID:
            raise not_found("deal")
        return deal_id

    async def ledger(self, request: Request) -> Response:
        await self.session(request)
        deal_id = self._deal_id(request)
        return json_response(
            await self.gate.deals.ledger(deal_id, 0, LEDGER_ROWS_SHOWN, newest_first=True)
        )

    async def advice(self, request: Request) -> Response:
        await self.session(request)
        deal_id = self._deal_id(request)
        view = await self.gate.deals.admin_view(deal_id)
        try:
            advise = importlib.import_module("gate.inventory.advice")
        except ImportError:
            advise = None
        hook = getattr(advise, "console_advice", None)
        if hook is not None:
            return json_response(await hook(self.gate, deal_id))
        return json_response(bucket_advice(view["totals"]["available"], view["bucket_count"]))

    def _action(self, name: str) -> ConsoleAction | None:
        own = ACTIONS.get(name)
        if own is None:
            return area_action(self.gate, name)
        gate = self.gate

        async def call(deal_id: int, body: Any, actor: str) -> dict[str, Any]:
            return await own(gate, deal_id, body, actor)

        return call

    async def act(self, request: Request) -> Response:
        session = await self.changing(request)
        deal_id = self._deal_id(request)
        name = request.path_params["action"]
        action = self._action(name)
        if action is None:
            raise not_found("console action")
        body = await read_json(request, self.gate.settings.body_max_bytes)
        view = await action(deal_id, body, session.actor)
        # As the admin routes do: this process must not answer from a stale near-cache.
        self.gate.soldout.forget(deal_id)
        log.warning(
            "console: %s did %s on deal %s: %s",
            session.actor,
            name,
            deal_id,
            body,
            extra={"deal_id": deal_id},
        )
        return json_response(view)

    async def panel_act(self, request: Request) -> Response:
        """An area's gate-wide panel's action (gate/extensions.py ConsoleGatePanel)."""
        session = await self.changing(request)
        panel_name, name = request.path_params["panel"], request.path_params["action"]
        action = None
        for ext in self.gate.extensions:
            for panel in ext.console_gate_panels:
                if panel.name == panel_name:
                    action = panel.actions.get(name)
        if action is None:
            raise not_found("console action")
        body = await read_json(request, self.gate.settings.body_max_bytes)
        view = await action(body, session.actor)
        log.warning("console: %s did %s/%s: %s", session.actor, panel_name, name, body)
        return json_response(view)

    def routes(self) -> list[BaseRoute]:
        deal = "/console/api/deals/{deal_id:id}"
        return [
            Route("/console", self.page, methods=["GET"]),
            Route("/console/static/{name:str}", self.static, methods=["GET"]),
            Route("/console/api/session", self.sign_in, methods=["POST"]),
            Route("/console/api/session", self.whoami, methods=["GET"]),
            Route("/console/api/session", self.sign_out, methods=["DELETE"]),
            Route("/console/api/snapshot", self.snapshot, methods=["GET"]),
            Route(deal + "/ledger", self.ledger, methods=["GET"]),
            Route(deal + "/advice", self.advice, methods=["GET"]),
            Route(deal + "/{action:str}", self.act, methods=["POST"]),
            Route("/console/api/panels/{panel:str}/{action:str}", self.panel_act, methods=["POST"]),
        ]


def install(gate: Gate) -> Extension:
    settings = ConsoleSettings.from_env(gate.settings.environ, gate.settings)
    if not settings.enabled:
        return Extension(name="console")
    return Extension(name="console", routes=Console(gate, settings).routes())


def add_commands(sub: Any) -> None:
    """The console has no command of its own: `gate serve` serves it."""
