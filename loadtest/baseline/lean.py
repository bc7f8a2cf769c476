"""The lean peer: the DB-only design a user would pick instead of Gate, as plain as it gets.

    POST /v1/deals/{id}/reservations {"quantity": q}
      │  no authentication: the buyer is the JWT's unverified `sub` (the wrk scripts send
      │  the same tokens to every server; a lean shop trusts its session layer)
      ▼
    START TRANSACTION
    UPDATE deals SET stock_available = stock_available - q WHERE id = ? AND stock_available >= q
      │  0 rows → ROLLBACK, 409 SOLD_OUT
    INSERT INTO orders (…)            (a duplicate Idempotency-Key → ROLLBACK, 409)
    COMMIT                            → 201

Statement by statement over a pool of GATE_DB_POOL_MAX connections (32 by default), in
the baseline's own database and schema (`schema.sql`), so `python -m loadtest.baseline
check` and the verifier judge it like the article's baseline. It skips what Gate and the
article's baseline both do per request (token verification, the idempotency look-up),
which makes it the fastest honest DB-only peer, and the harder one to beat.
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime, timedelta

import orjson
import pymysql
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from gate.base.clock import iso
from gate.inventory.orders import new_id
from gate.store.db import DbUnavailable
from gate.web.http_io import json_response
from loadtest.baseline.app import (
    MAX_ID,
    Baseline,
    baseline_settings,
    build_app,
    insert_order,
)

BODY_MAX_BYTES = 1024
QUANTITY_MAX = 100


def _problem(status: int, code: str, detail: str) -> Response:
    body = orjson.dumps(
        {"type": "about:blank", "title": code, "status": status, "code": code, "detail": detail}
    )
    return Response(body, status, media_type="application/problem+json")


def _user_id(authorization: str | None) -> int | None:
    """The token's `sub`, read without verifying it (that is the point of the lean peer)."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    parts = authorization[7:].split(".")
    if len(parts) != 3 or len(parts[1]) > 1024:
        return None
    try:
        claims = orjson.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        user_id = int(claims["sub"])
    except (binascii.Error, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        return None
    return user_id if 1 <= user_id <= MAX_ID else None


async def reserve(request: Request) -> Response:
    baseline: Baseline = request.app.state.baseline
    user_id = _user_id(request.headers.get("authorization"))
    if user_id is None:
        return _problem(401, "UNAUTHENTICATED", "A bearer token with a numeric 'sub' is required.")
    key = request.headers.get("idempotency-key") or ""
    if not 1 <= len(key) <= 255 or not key.isascii():
        return _problem(400, "INVALID_REQUEST", "Idempotency-Key is required.")
    raw = await request.body()
    try:
        body = orjson.loads(raw) if len(raw) <= BODY_MAX_BYTES else None
        quantity = body["quantity"] if isinstance(body, dict) else None
    except orjson.JSONDecodeError:
        quantity = None
    if type(quantity) is not int or not 1 <= quantity <= QUANTITY_MAX:
        return _problem(400, "INVALID_REQUEST", "'quantity' must be an integer 1..100.")
    deal_id = int(request.path_params["deal_id"])
    if not 1 <= deal_id <= MAX_ID:
        return _problem(404, "NOT_FOUND", "No such deal.")
    meta = await baseline.deal(deal_id)
    order_id = new_id()
    try:
        async with baseline.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            updated = await cur.execute(
                "UPDATE deals SET stock_available = stock_available - %s, updated_at = NOW()"
                " WHERE id = %s AND stock_available >= %s",
                (quantity, deal_id, quantity),
            )
            if updated != 1:
                await cur.execute("ROLLBACK")
                return _problem(409, "SOLD_OUT", "This deal is sold out.")
            try:
                await insert_order(cur, order_id, user_id, deal_id, quantity, key, meta)
            except pymysql.err.IntegrityError:
                await cur.execute("ROLLBACK")
                return _problem(409, "DUPLICATE", "This Idempotency-Key was used already.")
            await cur.execute("COMMIT")
    except (DbUnavailable, pymysql.err.MySQLError):
        return _problem(503, "OVERLOADED", "Database unavailable; retry shortly.")
    expires = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=meta.hold_seconds)
    return json_response(
        {
            "order_id": order_id,
            "status": "PENDING_PAYMENT",
            "deal_id": deal_id,
            "quantity": quantity,
            "amount": meta.unit_price * quantity,
            "currency": meta.currency,
            "expires_at": iso(expires),
        },
        201,
    )


def create_app() -> Starlette:
    """uvicorn factory for `python -m loadtest.baseline serve --lean`."""
    from gate.base.logs import configure

    settings = baseline_settings()
    configure(settings.log_level)
    return build_app(settings, reserve)
