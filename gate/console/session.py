"""Console sessions: the admin token exchanged once for a short signed cookie.

    sign-in form --POST token--> compare with GATE_ADMIN_TOKEN (constant time)
        --> cookie gate_console = base64url(sid|expires) "." HMAC(key, that)
    every /console/api call --> verify the HMAC and the expiry (any worker: the key
        is derived from the settings, nothing is stored) --> not revoked in Redis?
    state-changing call --> X-CSRF-Token == HMAC(key, "csrf|" + sid)
    sign-out --> the sid is revoked in Redis until it would have expired anyway

The key is HMAC-SHA256(GATE_CONSOLE_SECRET or GATE_ADMIN_TOKEN, a fixed label and
SHA-256 of GATE_ADMIN_TOKEN): a cookie cannot be turned back into the admin token,
and rotating either secret ends every session (the admin token too when
GATE_CONSOLE_SECRET is set: whoever held the old token may have signed in with it).

The cookie is Secure when the request came over https (`request_scheme`: the
socket's scheme, or behind a trusted proxy its X-Forwarded-Proto), or always with
GATE_CONSOLE_SECURE_COOKIE=always.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass

from gate.base.errors import Problem
from gate.base.limits import Network

COOKIE_NAME = "gate_console"
CSRF_HEADER = "x-csrf-token"
_KEY_LABEL = b"gate-console-session-v2"
SID_BYTES = 16
# A cookie is ~80 bytes; anything much longer is not one of ours.
COOKIE_MAX_BYTES = 256


@dataclass(frozen=True)
class Session:
    sid: str
    expires_at: int  # unix seconds

    @property
    def actor(self) -> str:
        """Who the ledger and the log name for this operator's actions."""
        return f"console:{self.sid[:8]}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def unauthorized(detail: str = "Sign in to the console first.") -> Problem:
    # No WWW-Authenticate: Bearer here; the browser signs in through the form.
    return Problem("UNAUTHORIZED", detail, headers={"WWW-Authenticate": 'Cookie realm="console"'})


def request_scheme(
    scheme: str, peer: str | None, forwarded_proto: str | None, trusted: tuple[Network, ...]
) -> str:
    """The scheme the client used: the socket's, unless the peer is a trusted proxy
    (GATE_TRUSTED_PROXIES) that says otherwise in X-Forwarded-Proto. Of several
    comma-separated values the last counts: the one the trusted peer itself added
    (earlier ones came from further away, possibly from the client)."""
    if not trusted or not forwarded_proto or not peer:
        return scheme
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return scheme
    if not any(ip in net for net in trusted):
        return scheme
    said = forwarded_proto.rpartition(",")[2].strip().lower()
    return said if said in ("http", "https") else scheme


class SessionSigner:
    def __init__(self, secret: str, admin_token: str, lifetime_seconds: int) -> None:
        # The admin token's digest is part of the key: rotating the token ends every
        # session even when GATE_CONSOLE_SECRET (the key's secret) stays.
        bound = _KEY_LABEL + b"|" + hashlib.sha256(admin_token.encode()).digest()
        self._key = hmac.new(secret.encode(), bound, hashlib.sha256).digest()
        self.lifetime_seconds = lifetime_seconds

    def _mac(self, message: bytes) -> bytes:
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def issue(self, now: float | None = None) -> tuple[Session, str]:
        now = time.time() if now is None else now
        session = Session(secrets.token_hex(SID_BYTES), int(now) + self.lifetime_seconds)
        payload = f"{session.sid}|{session.expires_at}".encode()
        return session, f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def verify(self, cookie: str | None, now: float | None = None) -> Session:
        if not cookie:
            raise unauthorized()
        if len(cookie) > COOKIE_MAX_BYTES or cookie.count(".") != 1:
            raise unauthorized("Invalid console session.")
        body, _, mac = cookie.partition(".")
        try:
            payload = _unb64(body)
            given = _unb64(mac)
        except ValueError:
            raise unauthorized("Invalid console session.") from None
        if not hmac.compare_digest(given, self._mac(payload)):
            raise unauthorized("Invalid console session.")
        sid, _, expires = payload.decode("ascii", "replace").partition("|")
        if not expires.isdigit():
            raise unauthorized("Invalid console session.")
        now = time.time() if now is None else now
        if int(expires) <= now:
            raise unauthorized("The console session has expired; sign in again.")
        return Session(sid, int(expires))

    def csrf_token(self, session: Session) -> str:
        return _b64(self._mac(f"csrf|{session.sid}".encode()))

    def check_csrf(self, session: Session, header: str | None) -> None:
        if not header or not hmac.compare_digest(
            header.encode("ascii", "replace"), self.csrf_token(session).encode()
        ):
            raise Problem("FORBIDDEN", "Missing or wrong X-CSRF-Token header.")
