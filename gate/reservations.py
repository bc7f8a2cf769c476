"""The reservation path: one Redis admission, one authoritative database transaction.

    admit (Lua) ──rejected──> problem (no database work)
        │ OK: units taken in Redis, in-flight token recorded
        ▼
    CALL gate_reserve (one round trip, one short transaction)
        ├─ committed ──────────> confirm token ──> 201
        ├─ refused (sold out in the database, quota, duplicate key…) ──> compensate
        ├─ failed (database down, statement error) ──> compensate ──> 503
        └─ unknown (connection lost mid-commit) ──> make sure the server thread has
           ended, look the order up by id ──> confirm or compensate

Compensation gives units back only if it is the call that removes the token, so
the request, a retry and the janitor can never give back the same units twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass
from typing import Any

import pymysql

from gate import orders
from gate.alloc import normalise_alloc
from gate.clock import iso
from gate.codes import AdmitCode, DbCode
from gate.db import Database, DbUnavailable, OutcomeUnknown, is_connection_error
from gate.errors import Problem, from_admit, from_db, not_found, overloaded
from gate.keys import DealKeys, deal_keys
from gate.mirror import Mirror

log = logging.getLogger("gate.reservations")

MAX_QUANTITY = 1_000_000


@dataclass(frozen=True)
class Reserved:
    body: dict[str, Any]
    replayed: bool


def fingerprint(deal_id: int, quantity: int) -> str:
    """What makes two requests with one idempotency key "the same request"."""
    return hashlib.sha256(f"reserve:{deal_id}:{quantity}".encode()).hexdigest()[:32]


class Reservations:
    def __init__(self, db: Database, mirror: Mirror, timeout_seconds: float) -> None:
        self.db = db
        self.mirror = mirror
        self.timeout_seconds = timeout_seconds

    async def reserve(
        self, deal_id: int, user_id: int, quantity: int, idempotency_key: str
    ) -> Reserved:
        assert 1 <= quantity <= MAX_QUANTITY, "quantity is validated before the gate"
        keys = deal_keys(deal_id)
        fp = fingerprint(deal_id, quantity)
        token = orders.new_id()
        start = random.getrandbits(30)

        code, detail = await self._admit(keys, user_id, quantity, fp, token, start, idempotency_key)
        if code == AdmitCode.NOT_LOADED:
            try:
                found = await self.mirror.load(deal_id)
            except DbUnavailable:
                raise overloaded("Database unavailable; retry shortly.") from None
            if not found:
                raise not_found("deal")
            code, detail = await self._admit(
                keys, user_id, quantity, fp, token, start, idempotency_key
            )
            if code == AdmitCode.NOT_LOADED:
                raise overloaded("Deal state is being rebuilt; retry shortly.")
        if code == AdmitCode.REPLAY:
            return await self._replay(detail, user_id, fp)
        if code != AdmitCode.OK:
            raise from_admit(code, detail)

        alloc = normalise_alloc(detail)
        try:
            row = await self._transaction(
                token, deal_id, user_id, quantity, alloc, idempotency_key, fp
            )
        except OutcomeUnknown as exc:
            row = await self._resolve_unknown(exc, keys, user_id, idempotency_key, token)
        except Exception as exc:
            if not isinstance(exc, DbUnavailable | pymysql.err.MySQLError | TimeoutError):
                log.exception("reservation transaction failed unexpectedly")
            await self._compensate(keys, user_id, idempotency_key, token)
            raise overloaded("Database unavailable; retry shortly.") from None

        db_code = DbCode(int(row[0]))
        if db_code == DbCode.OK:
            committed_alloc = str(row[1])
            try:
                await self.mirror.confirm(
                    keys, user_id, idempotency_key, token, fp, committed_alloc
                )
            except Exception as exc:
                # The order is committed; the janitor confirms the token later.
                log.warning("order %s committed but not confirmed in Redis: %r", token, exc)
            unit_price = int(row[4])
            body = {
                "order_id": token,
                "status": "PENDING_PAYMENT",
                "deal_id": deal_id,
                "quantity": quantity,
                "unit_price": unit_price,
                "amount": unit_price * quantity,
                "currency": str(row[5]),
                "expires_at": iso(row[2]),
            }
            return Reserved(body, replayed=False)

        await self._compensate(keys, user_id, idempotency_key, token)
        if db_code == DbCode.DUPLICATE:
            existing = await orders.by_idempotency_key(self.db, user_id, idempotency_key)
            if existing is None:
                raise Problem(
                    "IDEMPOTENCY_IN_PROGRESS",
                    "A request with this Idempotency-Key is still in progress.",
                )
            if existing.fingerprint != fp:
                raise Problem(
                    "IDEMPOTENCY_MISMATCH",
                    "This Idempotency-Key was used with a different request.",
                )
            return Reserved(existing.reservation_body(), replayed=True)
        if db_code == DbCode.SOLD_OUT:
            log.info("deal %s: Redis admitted but the database is sold out (drift)", deal_id)
        raise from_db(db_code)

    async def _admit(
        self,
        keys: DealKeys,
        user_id: int,
        quantity: int,
        fp: str,
        token: str,
        start: int,
        idempotency_key: str,
    ) -> tuple[AdmitCode, str]:
        try:
            return await self.mirror.admit(
                keys, user_id, quantity, fp, token, start, idempotency_key
            )
        except Exception as exc:
            # Never re-run a script that may have run: if the admission did happen,
            # its token is in Redis and the janitor gives the units back.
            log.warning("admission failed for deal %s: %r", keys.deal_id, exc)
            raise overloaded("Admission service unavailable; retry shortly.") from None

    async def _transaction(
        self,
        token: str,
        deal_id: int,
        user_id: int,
        quantity: int,
        alloc: str,
        idempotency_key: str,
        fp: str,
    ) -> tuple[Any, ...]:
        thread: list[Any] = []

        async def attempt() -> tuple[Any, ...]:
            async with self.db.connection() as conn:
                thread[:] = [conn.thread_id(), conn.connected_time]
                try:
                    row = await self.db.call(
                        conn,
                        "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)",
                        (
                            token,
                            deal_id,
                            user_id,
                            quantity,
                            alloc,
                            idempotency_key,
                            fp,
                            f"user:{user_id}",
                        ),
                    )
                except Exception as exc:
                    if is_connection_error(exc):
                        raise OutcomeUnknown(thread[0], thread[1], exc) from exc
                    raise
                assert row is not None, "gate_reserve returned no row"
                return row

        try:
            return await asyncio.wait_for(self.db.retrying(attempt), self.timeout_seconds)
        except TimeoutError as exc:
            if thread:
                raise OutcomeUnknown(thread[0], thread[1], exc) from exc
            raise DbUnavailable("timed out waiting for a database connection") from exc

    async def _resolve_unknown(
        self, exc: OutcomeUnknown, keys: DealKeys, user_id: int, idempotency_key: str, token: str
    ) -> tuple[Any, ...]:
        """The connection broke mid-transaction: find out whether it committed."""
        log.warning("reservation %s: outcome unknown (%r); resolving", token, exc.cause)
        try:
            if exc.thread_id is not None and exc.connected_at is not None:
                age = asyncio.get_running_loop().time() - exc.connected_at
                if not await self.db.wait_thread_gone(exc.thread_id, age):
                    raise TimeoutError("the server thread did not end in time")
            order = await orders.get(self.db, token)
        except Exception as lookup_exc:
            # Cannot tell yet. Leave the token: the janitor resolves it against the
            # database once it answers, and never gives units back for a committed order.
            log.warning("reservation %s unresolved, left to the janitor: %r", token, lookup_exc)
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None:
            await self._compensate(keys, user_id, idempotency_key, token)
            raise overloaded("Database connection lost; the reservation was not made.")
        return (
            int(DbCode.OK),
            order.alloc,
            order.expires_at,
            order.created_at,
            order.unit_price,
            order.currency,
        )

    async def _compensate(
        self, keys: DealKeys, user_id: int, idempotency_key: str, token: str
    ) -> None:
        try:
            await self.mirror.compensate(keys, user_id, idempotency_key, token)
        except Exception as exc:
            log.warning("compensation of %s deferred to the janitor: %r", token, exc)

    async def _replay(self, order_id: str, user_id: int, fp: str) -> Reserved:
        try:
            order = await orders.get(self.db, order_id)
        except Exception:
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None or order.user_id != user_id or order.fingerprint != fp:
            # Redis remembers a request the database does not hold (a restored
            # database, say). The database is the truth: refuse rather than guess.
            raise overloaded("Idempotency record inconsistent; retry shortly.")
        return Reserved(order.reservation_body(), replayed=True)
