"""Buyer tokens minted locally: HS256 with GATE_JWT_SECRET, as the gate verifies them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import jwt

CACHE_MAX = 200_000


class TokenMint:
    """Mints one token per buyer and keeps it while it is valid (bounded)."""

    def __init__(self, secret: str, ttl_seconds: int = 3600) -> None:
        if not secret:
            raise ValueError("a JWT secret is needed to mint buyer tokens (GATE_JWT_SECRET)")
        self._secret = secret
        self._ttl = ttl_seconds
        self._cache: dict[int, tuple[str, float]] = {}

    def token(self, user_id: int) -> str:
        now = time.time()
        hit = self._cache.get(user_id)
        # A minute of margin: a token must not expire between minting and use.
        if hit is not None and hit[1] > now + 60:
            return hit[0]
        exp = int(now) + self._ttl
        value = jwt.encode(
            {"sub": str(user_id), "iat": int(now), "exp": exp}, self._secret, algorithm="HS256"
        )
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[user_id] = (value, float(exp))
        return value

    def header(self, user_id: int) -> str:
        return f"Bearer {self.token(user_id)}"


def write_token_file(
    path: Path, secret: str, users: Iterator[int] | range, ttl_seconds: int
) -> int:
    """One "user_id token" line per buyer, for load generators that cannot sign (wrk)."""
    mint = TokenMint(secret, ttl_seconds)
    n = 0
    with path.open("w") as out:
        for user in users:
            out.write(f"{user} {mint.token(user)}\n")
            n += 1
    return n
