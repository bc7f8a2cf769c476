"""Buyer and admin authentication.

Buyers: `Authorization: Bearer <JWT>`, HS256 only (the algorithm is pinned, never
read from the token), `exp` and `sub` required, `sub` a string of digits.
Verification costs ≈ 29 µs, half of a trivial request's budget (DESIGN lever 3), so
verified tokens are kept in a bounded cache that still honours `exp` on every use.

The cache cannot be inflated by one buyer (issue #12): a token is verified (and so
cached) only when each of its three segments is canonical base64url (no padding,
the last character's unused bits zero), so the bytes a token stands for have one
spelling only and the cache key, the token, cannot be varied for a token the buyer
holds (a variant is a 401). Tokens are at most MAX_TOKEN_BYTES long.
"""

from __future__ import annotations

import hmac
import re
import time

import jwt

from gate.errors import Problem
from gate.logs import set_user
from gate.settings import Secret

ALGORITHM = "HS256"
# A gate token is ≈ 150 bytes; a kilobyte leaves room for a few claims more.
MAX_TOKEN_BYTES = 1024
_B64URL_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_B64URL_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")
MAX_USER_ID = 2**63 - 1


def _unauthorized(detail: str) -> Problem:
    return Problem("UNAUTHORIZED", detail)


def bearer(header: str | None) -> str:
    if not header:
        raise _unauthorized("Missing Authorization header.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("Authorization must be 'Bearer <token>'.")
    token = token.strip()
    if len(token) > MAX_TOKEN_BYTES:
        raise _unauthorized("Token too long.")
    return token


def canonical_jws(token: str) -> bool:
    """Three segments, each in the one spelling strict base64url decoding accepts:
    only the URL-safe alphabet, no padding, no impossible length, and the unused
    low bits of the last character zero (otherwise up to 16 spellings decode to the
    same bytes)."""
    segments = token.split(".")
    if len(segments) != 3:
        return False
    for segment in segments:
        if not _B64URL_SEGMENT.fullmatch(segment):
            return False
        left = len(segment) % 4
        if left == 1:
            return False
        if left and _B64URL_ALPHABET.index(segment[-1]) & (0x0F if left == 2 else 0x03):
            return False
    return True


class BuyerAuth:
    def __init__(self, secret: Secret, cache_max: int) -> None:
        self._key = secret.reveal()
        self._cache_max = cache_max
        # token -> (user id, exp). Dicts keep insertion order, so eviction drops the
        # oldest entries first.
        self._cache: dict[str, tuple[int, float]] = {}

    def user_id(self, authorization: str | None) -> int:
        token = bearer(authorization)
        hit = self._cache.get(token)
        now = time.time()
        if hit is not None:
            if hit[1] > now:
                set_user(hit[0])
                return hit[0]
            del self._cache[token]
            raise _unauthorized("Token expired.")
        if not canonical_jws(token):
            raise _unauthorized("Invalid token: not canonical base64url.")
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=[ALGORITHM],
                options={"require": ["exp", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise _unauthorized("Token expired.") from None
        except jwt.InvalidTokenError as exc:
            raise _unauthorized(f"Invalid token: {type(exc).__name__}.") from None
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub.isdigit() or not sub.isascii() or len(sub) > 19:
            raise _unauthorized("Token subject must be a user id made of digits.")
        user = int(sub)
        if not 1 <= user <= MAX_USER_ID:
            raise _unauthorized("Token subject out of range.")
        exp = float(claims["exp"])
        if self._cache_max > 0:
            if len(self._cache) >= self._cache_max:
                for stale in list(self._cache)[: max(1, self._cache_max // 8)]:
                    del self._cache[stale]
            self._cache[token] = (user, exp)
        set_user(user)
        return user

    @property
    def cached(self) -> int:
        """How many verified tokens are kept."""
        return len(self._cache)


class AdminAuth:
    def __init__(self, token: Secret) -> None:
        self._token = token.reveal().encode()

    def check(self, authorization: str | None) -> None:
        token = bearer(authorization)
        if not hmac.compare_digest(token.encode(), self._token):
            raise _unauthorized("Invalid admin token.")


def mint(secret: Secret, user_id: int, ttl_seconds: int = 86_400) -> str:
    if not 1 <= user_id <= MAX_USER_ID:
        raise ValueError("user id must be a positive 63-bit integer")
    now = int(time.time())
    return jwt.encode(
        {"sub": str(user_id), "iat": now, "exp": now + ttl_seconds},
        secret.reveal(),
        algorithm=ALGORITHM,
    )
