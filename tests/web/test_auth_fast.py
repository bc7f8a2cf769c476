"""gate/web/auth.py verify_hs256 against PyJWT: never more permissive, and the same
claims for every ordinary token. Pure computation: no server needed."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any

import jwt
import orjson
import pytest

from gate.base.errors import Problem
from gate.base.settings import Secret
from gate.web.auth import BuyerAuth, InvalidToken, TokenExpired, canonical_jws, verify_hs256

KEY = "fast-path-test-secret-0123456789abcdef"
NOW = time.time()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(header: Any, claims: Any, key: str = KEY, raw_payload: bytes | None = None) -> str:
    """A compact JWS with any header and payload, signed HS256 over what it carries."""
    head = b64(orjson.dumps(header))
    body = b64(raw_payload if raw_payload is not None else orjson.dumps(claims))
    sig = hmac.new(key.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def pyjwt_verdict(token: str) -> dict[str, Any] | None:
    try:
        return jwt.decode(token, KEY, algorithms=["HS256"], options={"require": ["exp", "sub"]})
    except jwt.InvalidTokenError:
        return None


def fast_verdict(token: str) -> dict[str, Any] | None:
    if not canonical_jws(token):
        return None
    try:
        return verify_hs256(token, KEY.encode(), time.time())
    except InvalidToken:
        return None


HS = {"alg": "HS256", "typ": "JWT"}
LATER, EARLIER = int(NOW) + 3600, int(NOW) - 3600

ORDINARY = [
    jwt.encode({"sub": "42", "exp": LATER}, KEY, algorithm="HS256"),
    jwt.encode({"sub": "7", "iat": EARLIER, "exp": LATER}, KEY, algorithm="HS256"),
    jwt.encode({"sub": "9", "nbf": EARLIER, "exp": LATER, "jti": "a"}, KEY, algorithm="HS256"),
    jwt.encode({"sub": "9", "exp": LATER + 0.5, "aud": ""}, KEY, algorithm="HS256"),
    jwt.encode({"sub": "1", "exp": LATER, "x": [1, {"y": None}]}, KEY, algorithm="HS256"),
    jwt.encode({"sub": "3", "exp": LATER}, KEY, algorithm="HS256", headers={"kid": "k1"}),
    forge({"alg": "HS256"}, {"sub": "5", "exp": LATER}),
]

HOSTILE = [
    # signature
    jwt.encode({"sub": "42", "exp": LATER}, KEY + "x", algorithm="HS256"),
    forge(HS, {"sub": "42", "exp": LATER}, key="another-key-of-enough-length-0123456"),
    # algorithm
    forge({"alg": "none"}, {"sub": "42", "exp": LATER}),
    forge({"alg": "HS512"}, {"sub": "42", "exp": LATER}),
    forge({"alg": "hs256"}, {"sub": "42", "exp": LATER}),
    forge({"typ": "JWT"}, {"sub": "42", "exp": LATER}),
    forge({"alg": "HS256", "crit": ["exp"]}, {"sub": "42", "exp": LATER}),
    forge({"alg": "HS256", "b64": False}, {"sub": "42", "exp": LATER}),
    forge({"alg": "HS256", "kid": 5}, {"sub": "42", "exp": LATER}),
    forge(["HS256"], {"sub": "42", "exp": LATER}),
    # time
    forge(HS, {"sub": "42", "exp": EARLIER}),
    forge(HS, {"sub": "42", "exp": int(NOW) - 1}),
    forge(HS, {"sub": "42", "exp": LATER, "nbf": LATER}),
    forge(HS, {"sub": "42", "exp": LATER, "iat": LATER}),
    forge(HS, {"sub": "42", "exp": "soon"}),
    forge(HS, {"sub": "42", "exp": None}),
    forge(HS, {"sub": "42", "exp": [LATER]}),
    forge(HS, {"sub": "42", "exp": LATER, "nbf": "x"}),
    forge(HS, {"sub": "42", "exp": LATER, "iat": {"a": 1}}),
    # claims
    forge(HS, {"exp": LATER}),
    forge(HS, {"sub": None, "exp": LATER}),
    forge(HS, {"sub": 42, "exp": LATER}),
    forge(HS, {"sub": "42", "exp": LATER, "aud": "shop"}),
    forge(HS, {"sub": "42", "exp": LATER, "aud": ["shop"]}),
    forge(HS, {"sub": "42", "exp": LATER, "jti": 5}),
    forge(HS, ["sub", "42"]),
    forge(HS, "a string"),
    forge(HS, None, raw_payload=b"not json"),
    forge(HS, None, raw_payload=b'{"sub": "42", "exp": ' + str(LATER).encode()),
    forge(HS, None, raw_payload=b"\xff\xfe{}"),
]


@pytest.mark.parametrize("token", ORDINARY)
def test_ordinary_tokens_give_the_same_claims(token: str) -> None:
    expected = pyjwt_verdict(token)
    assert expected is not None
    assert fast_verdict(token) == expected


@pytest.mark.parametrize("token", HOSTILE)
def test_every_token_pyjwt_refuses_is_refused(token: str) -> None:
    assert pyjwt_verdict(token) is None
    assert fast_verdict(token) is None


def test_stricter_than_pyjwt_only_where_documented() -> None:
    """Two spellings PyJWT takes and the fast path refuses: a numeric string for a
    NumericDate and a `crit` header (gate tokens have neither)."""
    for token in (
        forge(HS, {"sub": "42", "exp": str(LATER)}),
        forge({"alg": "HS256", "crit": ["b64"], "b64": True}, {"sub": "42", "exp": LATER}),
    ):
        assert pyjwt_verdict(token) is not None
        assert fast_verdict(token) is None


def test_a_flipped_bit_anywhere_is_refused() -> None:
    token = ORDINARY[0]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    refused = 0
    for i, ch in enumerate(token):
        if ch == ".":
            continue
        other = alphabet[(alphabet.index(ch) + 1) % 64]
        variant = token[:i] + other + token[i + 1 :]
        assert fast_verdict(variant) is None
        refused += 1
    assert refused > 100


def test_expiry_is_its_own_refusal() -> None:
    with pytest.raises(TokenExpired):
        verify_hs256(forge(HS, {"sub": "1", "exp": EARLIER}), KEY.encode(), time.time())
    auth = BuyerAuth(Secret(KEY), 16)
    with pytest.raises(Problem) as caught:
        auth.user_id("Bearer " + forge(HS, {"sub": "1", "exp": EARLIER}))
    assert caught.value.code == "UNAUTHORIZED"
    assert "expired" in caught.value.detail.lower()
    assert auth.user_id("Bearer " + ORDINARY[0]) == 42
    assert auth.cached == 1
