"""Every bad input of the contract: a clear problem+json 4xx, never a 5xx, nothing changed."""

from __future__ import annotations

import time
import warnings
from typing import Any

import jwt
import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.support import (
    ADMIN,
    JWT_SECRET,
    Client,
    Resp,
    assert_invariants,
    buyer,
    create_deal,
    redis_available,
    token,
)

CODES = {
    "INVALID_REQUEST",
    "UNAUTHORIZED",
    "NOT_FOUND",
    "SOLD_OUT",
    "NOT_ACTIVE",
    "LIMIT_EXCEEDED",
    "IDEMPOTENCY_MISMATCH",
    "IDEMPOTENCY_IN_PROGRESS",
    "RATE_LIMITED",
    "OVERLOADED",
    "PAYLOAD_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "CONFLICT",
    "METHOD_NOT_ALLOWED",
}


def assert_problem(resp: Resp, status: int, code: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"] == "application/problem+json"
    body = resp.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["code"] in CODES
    assert body["title"] and body["detail"] and body["type"]


async def _state(db: Database, rds: aioredis.Redis, deal_id: int) -> tuple[Any, ...]:
    counts = await db.fetchone(
        "SELECT (SELECT COUNT(*) FROM orders), (SELECT COUNT(*) FROM deals),"
        " (SELECT COUNT(*) FROM inventory_ledger), (SELECT COUNT(*) FROM outbox)"
    )
    return (counts, await redis_available(rds, deal_id))


def _jwt(claims: dict[str, Any], key: str = JWT_SECRET, alg: str = "HS256") -> str:
    # HS512 with our 41-byte test secret is "short" for PyJWT; that is the point here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jwt.warnings.InsecureKeyLengthWarning)
        return jwt.encode(claims, key, algorithm=alg)


NOW = int(time.time())
BAD_TOKENS = {
    "missing": None,
    "not bearer": "Basic dXNlcjpwYXNz",
    "empty bearer": "Bearer ",
    "garbage": "Bearer not.a.jwt",
    "wrong key": "Bearer "
    + _jwt({"sub": "1", "exp": NOW + 600}, key="another-secret-0123456789abcdef-0123456789"),
    "expired": "Bearer " + _jwt({"sub": "1", "exp": NOW - 10}),
    "no exp": "Bearer " + _jwt({"sub": "1"}),
    "no sub": "Bearer " + _jwt({"exp": NOW + 600}),
    "sub not digits": "Bearer " + _jwt({"sub": "alice", "exp": NOW + 600}),
    "sub zero": "Bearer " + _jwt({"sub": "0", "exp": NOW + 600}),
    "HS512": "Bearer " + _jwt({"sub": "1", "exp": NOW + 600}, alg="HS512"),
    "alg none": "Bearer " + jwt.encode({"sub": "1", "exp": NOW + 600}, None, algorithm="none"),  # type: ignore[arg-type]
}


@pytest.fixture
async def deal(client: Client) -> int:
    return await create_deal(client, stock=10, buckets=2, max_per_order=2)


async def test_bad_buyer_tokens_are_401_and_change_nothing(
    client: Client, db: Database, rds: aioredis.Redis, deal: int
) -> None:
    before = await _state(db, rds, deal)
    for name, auth in BAD_TOKENS.items():
        headers = {"Idempotency-Key": "bad-token-key-01"}
        if auth is not None:
            headers["Authorization"] = auth
        r = await client.post(
            f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=headers
        )
        assert_problem(r, 401, "UNAUTHORIZED")
        assert r.headers["WWW-Authenticate"] == "Bearer", name
        r = await client.get("/v1/orders/01ARZ3NDEKTSV4RRFFQ69G5FAV", headers=headers)
        assert_problem(r, 401, "UNAUTHORIZED")
    assert await _state(db, rds, deal) == before


async def test_bad_reservation_requests_are_4xx_and_change_nothing(
    client: Client, db: Database, rds: aioredis.Redis, deal: int
) -> None:
    before = await _state(db, rds, deal)
    auth = buyer(77)
    path = f"/v1/deals/{deal}/reservations"
    ok_key = {"Idempotency-Key": "good-key-000001"}

    # Idempotency-Key: required, 8-255 chars of [A-Za-z0-9_.:-].
    for key in (None, "", "short7c", "x" * 256, "has space-123", "ключ-123456", "semi;colon1"):
        headers = dict(auth)
        if key is not None:
            headers["Idempotency-Key"] = key
        assert_problem(
            await client.post(path, json={"quantity": 1}, headers=headers), 400, "INVALID_REQUEST"
        )

    # Admission-Token: at most 200 characters, on any deal (the OpenAPI schema's bound;
    # a deal without a waiting room otherwise ignores the header).
    for admission in ("t" * 201, "1." * 150):
        headers = {**auth, **ok_key, "Admission-Token": admission}
        assert_problem(
            await client.post(path, json={"quantity": 1}, headers=headers), 400, "INVALID_REQUEST"
        )

    # quantity: an integer in 1..max_per_order.
    for body in (
        {},
        {"quantity": 0},
        {"quantity": -1},
        {"quantity": "1"},
        {"quantity": 1.5},
        {"quantity": True},
        {"quantity": None},
        {"quantity": 3},
        {"quantity": 10**30},
        [],
        [1],
        "text",
        5,
        {"qty": 1},
        # Nothing rides along with the quantity: the fingerprint would not cover it.
        {"quantity": 1, "note": "gift"},
    ):
        r = await client.post(path, json=body, headers={**auth, **ok_key})
        assert_problem(r, 400, "INVALID_REQUEST")

    # Bodies that are not JSON, or too large, or not declared JSON.
    for content in (b"{", b"quantity=1", b"\xff\xfe", b'{"quantity": 1,}', b""):
        r = await client.post(
            path, content=content, headers={**auth, **ok_key, "Content-Type": "application/json"}
        )
        assert_problem(r, 400, "INVALID_REQUEST")
    big = b'{"quantity": 1, "pad": "' + b"x" * 5000 + b'"}'
    r = await client.post(
        path, content=big, headers={**auth, **ok_key, "Content-Type": "application/json"}
    )
    assert_problem(r, 413, "PAYLOAD_TOO_LARGE")
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**auth, **ok_key}
        if ctype:
            headers["Content-Type"] = ctype
        r = await client.post(path, content=b'{"quantity": 1}', headers=headers)
        assert_problem(r, 415, "UNSUPPORTED_MEDIA_TYPE")

    # Unknown deals and routes.
    for bad in (
        "/v1/deals/999999999/reservations",
        "/v1/deals/0/reservations",
        "/v1/deals/abc/reservations",
        "/v1/deals/99999999999999999999999/reservations",
    ):
        r = await client.post(bad, json={"quantity": 1}, headers={**auth, **ok_key})
        assert_problem(r, 404, "NOT_FOUND")
    assert_problem(await client.get("/v1/deals/424242424"), 404, "NOT_FOUND")
    wrong = await client.get(path, headers=auth)
    assert_problem(wrong, 405, "METHOD_NOT_ALLOWED")
    assert wrong.headers["Allow"] == "POST"  # RFC 9110: a 405 names what is allowed
    wrong = await client.request("TRACE", "/healthz")
    assert_problem(wrong, 405, "METHOD_NOT_ALLOWED")
    assert sorted(m.strip() for m in wrong.headers["Allow"].split(",")) == ["GET", "HEAD"]
    assert_problem(await client.get("/nope"), 404, "NOT_FOUND")

    # Orders: malformed, unknown.
    for order_id in ("nope", "01ARZ3NDEKTSV4RRFFQ69G5FAV", "x" * 300):
        assert_problem(await client.get(f"/v1/orders/{order_id}", headers=auth), 404, "NOT_FOUND")
        r = await client.post(f"/v1/orders/{order_id}/cancel", headers=auth)
        assert_problem(r, 404, "NOT_FOUND")

    assert await _state(db, rds, deal) == before
    await assert_invariants(db, rds, deal)


async def test_bad_admin_requests_are_4xx_and_change_nothing(
    client: Client, db: Database, rds: aioredis.Redis, deal: int
) -> None:
    before = await _state(db, rds, deal)
    good = {"title": "x", "unit_price": 1, "currency": "EUR", "stock": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong-admin-token-000"},
        {"Authorization": f"Bearer {token(1)}"},
    ):
        assert_problem(
            await client.post("/v1/admin/deals", json=good, headers=headers), 401, "UNAUTHORIZED"
        )
        assert_problem(
            await client.get(f"/v1/admin/deals/{deal}", headers=headers), 401, "UNAUTHORIZED"
        )

    for patch in (
        {"title": ""},
        {"title": 5},
        {"unit_price": -1},
        {"unit_price": "1"},
        {"currency": "usd"},
        {"currency": "EURO"},
        {"stock": -1},
        {"stock": 1.5},
        {"buckets": 0},
        {"buckets": 5000},
        {"hold_seconds": 0},
        {"per_user_limit": 0},
        {"max_per_order": 0},
        {"per_user_limit": 1, "max_per_order": 2},
        {"starts_at": "tomorrow"},
        {"starts_at": "2026-01-01T00:00:00"},
        # Valid texts whose UTC time falls outside the calendar.
        {"starts_at": "0001-01-01T00:00:00+01:00"},
        {"ends_at": "9999-12-31T23:59:59-01:00"},
        {"starts_at": "2026-01-02T00:00:00Z", "ends_at": "2026-01-01T00:00:00Z"},
        {"capture_mode": "later"},
        {"surprise": 1},
    ):
        r = await client.post("/v1/admin/deals", json={**good, **patch}, headers=ADMIN)
        assert_problem(r, 400, "INVALID_REQUEST")
    for missing in good:
        body = {k: v for k, v in good.items() if k != missing}
        assert_problem(
            await client.post("/v1/admin/deals", json=body, headers=ADMIN), 400, "INVALID_REQUEST"
        )

    stock = f"/v1/admin/deals/{deal}/stock"
    for body in (
        {"delta": 0, "reason": "x"},
        {"delta": 1},
        {"delta": "1", "reason": "x"},
        {"delta": 1, "reason": ""},
        {"delta": 1, "reason": "x", "extra": 1},
    ):
        assert_problem(await client.post(stock, json=body, headers=ADMIN), 400, "INVALID_REQUEST")
    r = await client.post(stock, json={"delta": -11, "reason": "too many"}, headers=ADMIN)
    assert_problem(r, 409, "CONFLICT")
    r = await client.post(
        "/v1/admin/deals/987654321/stock", json={"delta": 1, "reason": "x"}, headers=ADMIN
    )
    assert_problem(r, 404, "NOT_FOUND")

    buckets = f"/v1/admin/deals/{deal}/buckets"
    for body in ({"count": 0}, {"count": 2000}, {"count": "4"}, {}):
        assert_problem(await client.put(buckets, json=body, headers=ADMIN), 400, "INVALID_REQUEST")
    # "²" is a digit to str.isdigit but not to int().
    for query in ("?limit=0", "?limit=1001", "?after=-1", "?limit=abc", "?limit=%C2%B2"):
        r = await client.get(f"/v1/admin/deals/{deal}/ledger{query}", headers=ADMIN)
        assert_problem(r, 400, "INVALID_REQUEST")
    assert_problem(await client.get("/v1/admin/deals/987654321", headers=ADMIN), 404, "NOT_FOUND")

    assert await _state(db, rds, deal) == before
    await assert_invariants(db, rds, deal)


async def test_integer_valued_numbers_are_integers(client: Client, db: Database) -> None:
    """JSON Schema's integer (the OpenAPI document's) is a number with no fractional
    part: 2.0 is the integer 2, as schemathesis's positive-data check insists; 2.5 is
    refused."""
    good = {"title": "x", "unit_price": 1, "currency": "EUR"}
    r = await client.post(
        "/v1/admin/deals", json={**good, "stock": 2.0, "buckets": 1.0}, headers=ADMIN
    )
    assert r.status_code == 201, r.text
    assert r.json()["stock"] == 2 and r.json()["buckets"] == 1
    row = await db.fetchone(
        "SELECT SUM(total), COUNT(*) FROM deal_buckets WHERE deal_id = %s", (r.json()["id"],)
    )
    assert row is not None and (int(row[0]), int(row[1])) == (2, 1)
    r = await client.post("/v1/admin/deals", json={**good, "stock": 2.5}, headers=ADMIN)
    assert_problem(r, 400, "INVALID_REQUEST")
