"""Buyer and admin authentication.

Buyers: `Authorization: Bearer <JWT>`, `exp` and `sub` required, `sub` a string of
digits. The header's `alg` routes a token (never chooses how it is checked):

    bearer -> cache hit (token -> user, exp)? ──yes──> user id (exp checked)
        │ no
        canonical_jws -> token_header: (alg, kid)
        ├─ alg HS256 ──> verify_hs256 with GATE_JWT_SECRET (401 when none is set)
        └─ other alg ──> JwksKeys.key_for(kid) (gate/web/jwks.py; unknown: 401)
                         alg == that key's algorithm, else 401
                         PyJWT: signature, exp/nbf/iat, iss and aud when configured
        -> sub -> cached

A flash sale's crowd is mostly first requests: every buyer's first click brings a
token not seen before. PyJWT's general decoder took ≈ 56 µs per token, more than
the rest of a sold-out answer, so HS256 tokens are verified here by `verify_hs256`,
the same rules written for this one algorithm (≈ 7 µs: the header segment checked
once per spelling, `hmac.digest` in C, orjson). tests/web/test_auth_fast.py holds it
to PyJWT's verdict on valid and hostile tokens. An identity provider's token costs
a public-key signature check (docs/benchmarks.md), paid once per token: verified
tokens are kept in a bounded cache that still honours `exp` on every use, and
emptied when a key is withdrawn from the key set.

The cache cannot be inflated by one buyer: a token is verified (and so
cached) only when each of its three segments is canonical base64url (no padding,
the last character's unused bits zero), so the bytes a token stands for have one
spelling only and the cache key, the token, cannot be varied for a token the buyer
holds (a variant is a 401). Tokens are at most MAX_TOKEN_BYTES long
(MAX_IDP_TOKEN_BYTES with a key set configured).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import math
import re
import time
from typing import Any

import jwt
import orjson
from jwt import PyJWK

from gate.base.errors import Problem
from gate.base.logs import set_user
from gate.base.settings import Secret
from gate.web.jwks import JwksKeys

ALGORITHM = "HS256"
# A gate token is ≈ 150 bytes; a kilobyte leaves room for a few claims more.
MAX_TOKEN_BYTES = 1024
# An identity provider's token (GATE_JWT_JWKS_*): an RSA-4096 signature is 683
# bytes, and providers add issuer, audience, scopes.
MAX_IDP_TOKEN_BYTES = 4096
_B64URL_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_B64URL_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")
MAX_USER_ID = 2**63 - 1


def _unauthorized(detail: str) -> Problem:
    return Problem("UNAUTHORIZED", detail)


def bearer(header: str | None, max_bytes: int = MAX_TOKEN_BYTES) -> str:
    if not header:
        raise _unauthorized("Missing Authorization header.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _unauthorized("Authorization must be 'Bearer <token>'.")
    token = token.strip()
    if len(token) > max_bytes:
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


class InvalidToken(Exception):
    """A token `verify_hs256` refuses; the message names why (never the token)."""


class TokenExpired(InvalidToken):
    pass


# Header segments seen, by spelling: (alg, kid) when the header is acceptable,
# None when not. Gate's tokens share one header, a provider's one per key; a
# forger's variants are bounded by the cache's size.
Header = tuple[str, str | None]
_HEADERS: dict[str, Header | None] = {}
HEADERS_MAX = 256


def _b64url(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def token_header(segment: str) -> Header | None:
    """(alg, kid) of a header segment, or None when it is not a JSON object with a
    string alg and (if any) a string kid, or it asks for an extension."""
    if segment in _HEADERS:
        return _HEADERS[segment]
    try:
        header = orjson.loads(_b64url(segment))
    except (ValueError, binascii.Error):
        header = None
    parsed: Header | None = None
    if (
        isinstance(header, dict)
        and isinstance(header.get("alg"), str)
        # No extensions: "crit" names what the verifier must understand (none
        # here), "b64": false a detached payload PyJWT would refuse too.
        and "crit" not in header
        and "b64" not in header
        and isinstance(header.get("kid", ""), str)
    ):
        parsed = (header["alg"], header.get("kid"))
    if len(_HEADERS) >= HEADERS_MAX:
        _HEADERS.clear()
    _HEADERS[segment] = parsed
    return parsed


def _number(claims: dict[str, Any], name: str) -> float | None:
    """A NumericDate claim: absent -> None; anything but a finite number (a bool,
    a string, null) is refused (PyJWT converts strings; a gate token never has one)."""
    if name not in claims:
        return None
    value = claims[name]
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return float(value)
    raise InvalidToken(f"claim {name} must be a number")


def verify_hs256(token: str, key: bytes, now: float) -> dict[str, Any]:
    """The claims of a canonical compact JWS (`canonical_jws` checked first) signed
    with HS256 under `key`, or InvalidToken. The rules PyJWT applies with
    algorithms=["HS256"], require=["exp", "sub"] and no audience or issuer: the
    header's alg exactly HS256, the signature over the two first segments, a JSON
    object payload, exp > now, nbf and iat not in the future, no aud, sub and jti
    strings when present."""
    head, payload, signature = token.split(".")
    header = token_header(head)
    if header is None or header[0] != ALGORITHM:
        raise InvalidToken("header")
    expected = hmac.digest(key, f"{head}.{payload}".encode("ascii"), "sha256")
    if not hmac.compare_digest(_b64url(signature), expected):
        raise InvalidToken("signature")
    try:
        claims = orjson.loads(_b64url(payload))
    except ValueError:
        raise InvalidToken("payload") from None
    if type(claims) is not dict:
        raise InvalidToken("payload")
    if claims.get("exp") is None or claims.get("sub") is None:
        raise InvalidToken("required claim missing")
    exp = _number(claims, "exp")
    assert exp is not None
    nbf, iat = _number(claims, "nbf"), _number(claims, "iat")
    if (nbf is not None and int(nbf) > now) or (iat is not None and int(iat) > now):
        raise InvalidToken("not yet valid")
    if claims.get("aud"):
        raise InvalidToken("audience")
    if not isinstance(claims["sub"], str) or not isinstance(claims.get("jti", ""), str):
        raise InvalidToken("claim type")
    if int(exp) <= now:
        raise TokenExpired("expired")
    return claims


class BuyerAuth:
    """A buyer's user id from their bearer token, routed by the header's `alg`:
    HS256 -> `verify_hs256` with GATE_JWT_SECRET (when `secret` is given); any
    other alg -> the identity provider's key the header's `kid` names (`jwks`),
    verified by PyJWT with the algorithm pinned to that key's, `exp` and `sub`
    required, and `iss`/`aud` checked when `issuer`/`audience` are set."""

    def __init__(
        self,
        secret: Secret | None,
        cache_max: int,
        *,
        jwks: JwksKeys | None = None,
        issuer: str | None = None,
        audience: str | None = None,
    ) -> None:
        self._key = secret.reveal().encode() if secret is not None else None
        self._jwks = jwks
        self._issuer = issuer
        self._audience = audience
        # A provider's tokens carry more (an RSA signature alone is 342 bytes).
        self._token_max_bytes = MAX_TOKEN_BYTES if jwks is None else MAX_IDP_TOKEN_BYTES
        self._cache_max = cache_max
        # token -> (user id, exp). Dicts keep insertion order, so eviction drops the
        # oldest entries first.
        self._cache: dict[str, tuple[int, float]] = {}
        if jwks is not None:
            # A withdrawn key's tokens must stop working now, not at their exp.
            jwks.on_removed.append(self._cache.clear)

    def user_id(self, authorization: str | None) -> int:
        token = bearer(authorization, self._token_max_bytes)
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
            claims = self._verify(token, now)
        except TokenExpired:
            raise _unauthorized("Token expired.") from None
        except InvalidToken as exc:
            raise _unauthorized(f"Invalid token: {exc}.") from None
        user = _subject(claims)
        exp = float(claims["exp"])
        if self._cache_max > 0:
            if len(self._cache) >= self._cache_max:
                for stale in list(self._cache)[: max(1, self._cache_max // 8)]:
                    del self._cache[stale]
            self._cache[token] = (user, exp)
        set_user(user)
        return user

    def _verify(self, token: str, now: float) -> dict[str, Any]:
        header = token_header(token[: token.index(".")])
        if header is None:
            raise InvalidToken("header")
        alg, kid = header
        if alg == ALGORITHM:
            if self._key is None:
                raise InvalidToken("HS256 tokens are not accepted here")
            return verify_hs256(token, self._key, now)
        if self._jwks is None:
            raise InvalidToken("only HS256 tokens are accepted here")
        key = self._jwks.key_for(kid)
        if key is None:
            raise InvalidToken("unknown key id")
        if alg != key.algorithm_name:
            raise InvalidToken("algorithm does not match the key")
        return self._verify_idp(token, key)

    def _verify_idp(self, token: str, key: PyJWK) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[key.algorithm_name],
                issuer=self._issuer,
                audience=self._audience,
                options={"require": ["exp", "sub"], "verify_aud": self._audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise TokenExpired("expired") from None
        except jwt.InvalidIssuerError:
            raise InvalidToken("issuer") from None
        except jwt.InvalidAudienceError:
            raise InvalidToken("audience") from None
        except jwt.InvalidSignatureError:
            raise InvalidToken("signature") from None
        except jwt.PyJWTError:
            raise InvalidToken("claims") from None
        # exp as a number (PyJWT takes a numeric string too), as verify_hs256 does.
        _number(claims, "exp")
        return claims

    @property
    def cached(self) -> int:
        """How many verified tokens are kept."""
        return len(self._cache)


def _subject(claims: dict[str, Any]) -> int:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.isdigit() or not sub.isascii() or len(sub) > 19:
        raise _unauthorized("Token subject must be a user id made of digits.")
    user = int(sub)
    if not 1 <= user <= MAX_USER_ID:
        raise _unauthorized("Token subject out of range.")
    return user


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
