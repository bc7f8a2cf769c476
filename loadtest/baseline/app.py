"""The baseline's HTTP app: the gate's reservation request shape over article 000's SQL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pymysql
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.base import validate
from gate.base.clock import iso
from gate.base.errors import Problem, not_found, overloaded
from gate.base.settings import Settings, load_settings
from gate.inventory.orders import new_id
from gate.reserve.request import MAX_QUANTITY
from gate.store.db import Database, DbUnavailable
from gate.web.auth import AdminAuth, BuyerAuth
from gate.web.http_io import json_response, read_json
from loadtest.baseline import store

log = logging.getLogger("baseline")

MAX_ID = 2**63 - 1
DEAL_CACHE_MAX = 10_000


@dataclass(frozen=True)
class DealMeta:
    unit_price: int
    currency: str
    hold_seconds: int
    max_per_order: int


async def insert_order(
    cur: Any, order_id: str, user_id: int, deal_id: int, quantity: int, key: str, meta: DealMeta
) -> None:
    """The order row of a reservation (the article's INSERT; the lean peer's too)."""
    await cur.execute(
        "INSERT INTO orders (id, user_id, deal_id, quantity, amount, currency,"
        " status, idempotency_key, expires_at, created_at, updated_at) VALUES"
        " (%s, %s, %s, %s, %s, %s, 'PENDING_PAYMENT', %s,"
        " DATE_ADD(NOW(), INTERVAL %s SECOND), NOW(6), NOW(6))",
        (
            order_id,
            user_id,
            deal_id,
            quantity,
            meta.unit_price * quantity,
            meta.currency,
            key,
            meta.hold_seconds,
        ),
    )


class Baseline:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.db = Database(settings)
        self.buyer_auth = BuyerAuth(settings.jwt_secret, settings.jwt_cache_max)
        self.admin_auth = AdminAuth(settings.admin_token)
        # A deal's price and limits never change; the article passes them in as
        # arguments, read once here, outside the transaction.
        self._deals: dict[int, DealMeta] = {}

    async def deal(self, deal_id: int) -> DealMeta:
        meta = self._deals.get(deal_id)
        if meta is not None:
            return meta
        row = await self.db.fetchone(
            "SELECT unit_price, currency, hold_seconds, max_per_order FROM deals WHERE id = %s",
            (deal_id,),
        )
        if row is None:
            raise not_found("deal")
        meta = DealMeta(int(row[0]), str(row[1]), int(row[2]), int(row[3]))
        if len(self._deals) < DEAL_CACHE_MAX:
            self._deals[deal_id] = meta
        return meta

    async def reserve(
        self, deal_id: int, user_id: int, quantity: int, key: str
    ) -> tuple[dict[str, Any], bool]:
        """Article 000's createPendingOrder, statement by statement."""
        meta = await self.deal(deal_id)
        if quantity > meta.max_per_order:
            raise Problem("INVALID_REQUEST", f"'quantity' must be at most {meta.max_per_order}.")

        async def attempt() -> tuple[str, Any]:
            # Outcomes are returned, not raised, inside the connection block: the
            # pool closes a connection that an exception other than a database
            # error leaves, and a sold-out answer is no reason to reconnect.
            async with self.db.connection() as conn, conn.cursor() as cur:
                await cur.execute("START TRANSACTION")
                await cur.execute(
                    "SELECT id, deal_id, quantity, amount, currency, status, expires_at"
                    " FROM orders WHERE user_id = %s AND idempotency_key = %s LIMIT 1",
                    (user_id, key),
                )
                existing = await cur.fetchone()
                if existing is not None:
                    await cur.execute("COMMIT")
                    return "replay", existing
                updated = await cur.execute(
                    "UPDATE deals SET stock_available = stock_available - %s, updated_at = NOW()"
                    " WHERE id = %s AND stock_available >= %s",
                    (quantity, deal_id, quantity),
                )
                if updated != 1:
                    await cur.execute("ROLLBACK")
                    return "sold_out", None
                order_id = new_id()
                try:
                    await insert_order(cur, order_id, user_id, deal_id, quantity, key, meta)
                except pymysql.err.IntegrityError as exc:
                    if not (exc.args and exc.args[0] == 1062):
                        raise
                    await cur.execute("ROLLBACK")
                    return "duplicate", None
                await cur.execute("COMMIT")
                return "created", order_id

        try:
            outcome, value = await asyncio.wait_for(
                self.db.retrying(attempt), self.settings.reservation_db_timeout_seconds
            )
            if outcome == "duplicate":
                # A concurrent request with the same key won the unique index.
                value = await self.db.fetchone(
                    "SELECT id, deal_id, quantity, amount, currency, status, expires_at"
                    " FROM orders WHERE user_id = %s AND idempotency_key = %s",
                    (user_id, key),
                )
                if value is None:
                    raise Problem(
                        "IDEMPOTENCY_IN_PROGRESS",
                        "A request with this Idempotency-Key is still in progress.",
                    )
                outcome = "replay"
        except (DbUnavailable, TimeoutError, pymysql.err.MySQLError) as exc:
            log.warning("reservation failed: %r", exc)
            raise overloaded("Database unavailable; retry shortly.") from None
        if outcome == "sold_out":
            raise Problem("SOLD_OUT", "This deal is sold out.")
        if outcome == "replay":
            return self._replay(value, deal_id, quantity), True
        expires = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=meta.hold_seconds)
        body = {
            "order_id": value,
            "status": "PENDING_PAYMENT",
            "deal_id": deal_id,
            "quantity": quantity,
            "unit_price": meta.unit_price,
            "amount": meta.unit_price * quantity,
            "currency": meta.currency,
            "expires_at": iso(expires),
        }
        return body, False

    def _replay(self, row: Any, deal_id: int, quantity: int) -> dict[str, Any]:
        order_id, o_deal, o_qty, amount, currency, status, expires_at = row
        if int(o_deal) != deal_id or int(o_qty) != quantity:
            raise Problem(
                "IDEMPOTENCY_MISMATCH", "This Idempotency-Key was used with a different request."
            )
        return {
            "order_id": str(order_id),
            "status": str(status),
            "deal_id": int(o_deal),
            "quantity": int(o_qty),
            "unit_price": int(amount) // max(1, int(o_qty)),
            "amount": int(amount),
            "currency": str(currency),
            "expires_at": iso(expires_at),
        }


def _baseline(request: Request) -> Baseline:
    baseline: Baseline = request.app.state.baseline
    return baseline


def _deal_id(request: Request) -> int:
    deal_id = int(request.path_params["deal_id"])
    if not 1 <= deal_id <= MAX_ID:
        raise not_found("deal")
    return deal_id


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def reserve(request: Request) -> Response:
    baseline = _baseline(request)
    user_id = baseline.buyer_auth.user_id(request.headers.get("authorization"))
    deal_id = _deal_id(request)
    key = validate.idempotency_key(request.headers.get("idempotency-key"))
    body = validate.obj(await read_json(request, baseline.settings.body_max_bytes))
    quantity = validate.integer(body, "quantity", 1, MAX_QUANTITY)
    result, replayed = await baseline.reserve(deal_id, user_id, quantity, key)
    if replayed:
        return json_response(result, 200, {"Idempotent-Replayed": "true"})
    return json_response(result, 201)


async def admin_create_deal(request: Request) -> Response:
    baseline = _baseline(request)
    baseline.admin_auth.check(request.headers.get("authorization"))
    fields = store.validate_deal(await read_json(request, baseline.settings.body_max_bytes))
    return json_response(await store.create_deal(baseline.db, fields), 201)


async def admin_deal(request: Request) -> Response:
    baseline = _baseline(request)
    baseline.admin_auth.check(request.headers.get("authorization"))
    report = await store.check_deal(baseline.db, _deal_id(request))
    if "totals" not in report:
        raise not_found("deal")
    return json_response(report)


async def _problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return not_found("route").response(request.url.path)
    return Problem("INVALID_REQUEST", str(exc.detail), status=exc.status_code).response()


async def _db_unavailable(request: Request, exc: Exception) -> Response:
    return overloaded("Database unavailable; retry shortly.").response(request.url.path)


def build_app(
    settings: Settings, reserve_handler: Callable[[Request], Awaitable[Response]] | None = None
) -> Starlette:
    """The article's baseline, or another peer's reservation handler (the lean peer's)
    over the same schema, admin routes and error handling."""
    baseline = Baseline(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await baseline.db.start()
        try:
            yield
        finally:
            await baseline.db.close()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        Problem: _problem,
        HTTPException: _http_error,
        DbUnavailable: _db_unavailable,
    }
    deal = "/v1/deals/{deal_id:int}"
    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route(deal + "/reservations", reserve_handler or reserve, methods=["POST"]),
            Route("/v1/admin/deals", admin_create_deal, methods=["POST"]),
            Route("/v1/admin/deals/{deal_id:int}", admin_deal, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers=handlers,
    )
    app.state.baseline = baseline
    return app


def baseline_settings() -> Settings:
    """The gate's settings, pointed at the baseline's database."""
    import os

    return load_settings({**os.environ, "GATE_MYSQL_URL": store.baseline_url()})


def create_app() -> Starlette:
    """uvicorn factory: every worker process reads the settings once."""
    from gate.base.logs import configure

    settings = baseline_settings()
    configure(settings.log_level)
    return build_app(settings)
