"""The verified-token cache cannot be inflated: spellings of one
token other than its canonical base64url are refused, not cached, and tokens over a
kilobyte are refused."""

from __future__ import annotations

import time

import jwt
import pytest

from gate.base.errors import Problem
from gate.base.settings import Secret
from gate.store.db import Database
from gate.web.auth import MAX_TOKEN_BYTES, BuyerAuth, canonical_jws
from tests.support import JWT_SECRET, Client, create_deal, token

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def variants(good: str) -> list[str]:
    """Other spellings of the same bytes: padding, and each segment's last character
    with its unused low bits set (strict base64url refuses both)."""
    out = [good + "=", good + "==", good + "==="]
    segments = good.split(".")
    for i, segment in enumerate(segments):
        left = len(segment) % 4
        if left == 0:
            continue
        spare = 0x0F if left == 2 else 0x03
        last = ALPHABET.index(segment[-1])
        for bits in range(1, spare + 1):
            changed = [*segments]
            changed[i] = segment[:-1] + ALPHABET[last | bits]
            out.append(".".join(changed))
        padded = [*segments]
        padded[i] = segment + "=" * (4 - left)
        out.append(".".join(padded))
    return [v for v in out if v != good]


def sized(user_id: int, length: int) -> str:
    """A validly signed token of exactly `length` characters."""
    base = len(token(user_id, pad=""))
    for extra in range(max(0, (length - base) * 3 // 4 - 4), length):
        candidate = token(user_id, pad="x" * extra)
        if len(candidate) == length:
            return candidate
        if len(candidate) > length:
            break
    raise AssertionError(f"no token of {length} characters")


def test_spellings_of_one_token_do_not_grow_the_cache() -> None:
    auth = BuyerAuth(Secret(JWT_SECRET), 1000)
    good = token(41)
    assert auth.user_id(f"Bearer {good}") == 41
    assert auth.cached == 1
    spellings = variants(good)
    # Padding on every segment, and 3 or 15 trailing-bit variants per unpadded segment.
    assert len(spellings) >= 9
    for spelling in spellings:
        assert not canonical_jws(spelling)
        with pytest.raises(Problem) as refused:
            auth.user_id(f"Bearer {spelling}")
        assert refused.value.status == 401, spelling
    assert auth.cached == 1
    # The canonical token is still answered from the cache.
    assert auth.user_id(f"Bearer {good}") == 41
    assert canonical_jws(good)


def test_the_cache_holds_one_entry_per_token_the_gate_signed() -> None:
    auth = BuyerAuth(Secret(JWT_SECRET), 1000)
    now = int(time.time())
    tokens = [
        jwt.encode({"sub": str(u), "exp": now + 600}, JWT_SECRET, algorithm="HS256")
        for u in range(1, 6)
    ]
    for t in tokens:
        for spelling in [t, *variants(t)]:
            try:
                auth.user_id(f"Bearer {spelling}")
            except Problem as refused:
                assert refused.status == 401
    assert auth.cached == len(tokens)


async def test_an_oversized_token_is_401_and_changes_nothing(client: Client, db: Database) -> None:
    deal = await create_deal(client, stock=10)
    big = sized(4242, MAX_TOKEN_BYTES + 76)
    jwt.decode(big, JWT_SECRET, algorithms=["HS256"])  # validly signed, only too long
    headers = {"Authorization": f"Bearer {big}", "Idempotency-Key": "oversized-token-1"}
    r = await client.post(f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["Content-Type"] == "application/problem+json"
    assert r.json()["code"] == "UNAUTHORIZED"
    r = await client.get("/v1/orders/01ARZ3NDEKTSV4RRFFQ69G5FAV", headers=headers)
    assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED"
    # Counted on this deal: other files of the suite buy as these users too.
    held = "SELECT COUNT(*) FROM orders WHERE user_id = %s AND deal_id = %s"
    assert await db.fetchone(held, (4242, deal)) == (0,)

    # A token just under the bound still works; its padded spelling does not.
    fits = sized(4243, MAX_TOKEN_BYTES - 24)
    ok = {"Authorization": f"Bearer {fits}", "Idempotency-Key": "fitting-token-01"}
    r = await client.post(f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=ok)
    assert r.status_code == 201, r.text
    padded = {"Authorization": f"Bearer {fits}=", "Idempotency-Key": "padded-token-001"}
    r = await client.post(f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=padded)
    assert r.status_code == 401 and r.json()["code"] == "UNAUTHORIZED", r.text
    assert await db.fetchone(held, (4243, deal)) == (1,)
