"""The database commit (`Committer`): an admitted reservation's one authoritative
transaction, its token confirmed in Redis after, or its units given back.

    commit(attempt, alloc)
      CALL gate_reserve, or, with several reservations of the deal admitted while the
      database is busy with the previous ones, CALL gate_reserve_group for all of them
      in one transaction (gate/reserve/groups.py), on the reservations' share of the
      pool, under the process lease its token names
        ├─ committed ──> the token confirmed in Redis (Mirror.confirm) ──> 201
        ├─ refused (sold out in the database, quota, duplicate key…) ──> given back
        │      ──> the key's own answer if the database holds it (Replays), else the
        │          refusal
        ├─ failed (database busy or down, statement error) ──> given back ──> 503
        └─ unknown (connection lost mid-commit) ──> Recovery.resolve
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import pymysql

from gate.base.clock import iso
from gate.base.codes import DbCode
from gate.base.db_health import HEALTH
from gate.base.errors import overloaded
from gate.base.settings import Settings
from gate.inventory.mirror import Mirror
from gate.reserve.admission import Admitter
from gate.reserve.breaker import Breakers
from gate.reserve.buyer_keys import BuyerKeys
from gate.reserve.groups import Item, ReservationGroups, Row, reservation_call
from gate.reserve.recovery import Recovery
from gate.reserve.replays import Replays
from gate.reserve.request import Attempt, Reserved, ReserveRequest
from gate.store.db import Database, DbUnavailable, OutcomeUnknown
from gate.store.process_lease import Lease, LeaseLapsed

log = logging.getLogger("gate.reservations")


class Committer:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        mirror: Mirror,
        lease: Lease | None,
        breakers: Breakers,
        admitter: Admitter,
        recovery: Recovery,
        replays: Replays,
        buyer_keys: BuyerKeys,
    ) -> None:
        self.db = db
        # Each reservation transaction runs only on a connection recorded under the
        # process lease its token names.
        self.lease = lease
        self.timeout_seconds = settings.reservation_db_timeout_seconds
        self.admitter = admitter
        self.recovery = recovery
        self.replays = replays
        self.buyer_keys = buyer_keys
        self.groups = (
            ReservationGroups(
                db,
                self.single,
                settings.reservation_group_max,
                settings.reservation_groups_in_flight_max,
                settings.db_reservation_acquire_seconds,
                lease,
            )
            if settings.reservation_group_max > 1
            else None
        )
        self.mirror = mirror
        self.breakers = breakers

    async def commit(self, att: Attempt, alloc: str) -> Reserved:
        """The admitted reservation's transaction, and its answer. `alloc`: the
        admission's allocation, normalised ("bucket:units[,…]")."""
        req = att.req
        # An allocation over several buckets goes through gate_reserve with `alloc`;
        # the item's bucket (its first) is used only when it names one.
        item = self.item(att.token, req, att.fp, int(alloc.split(":", 1)[0]), att.owner)
        started = time.perf_counter()
        try:
            if self.groups is not None and "," not in alloc:
                row = await self.groups.reserve(req.deal_id, item)
            else:
                row = await self.transaction(req.deal_id, item, alloc)
        except OutcomeUnknown as exc:
            row = await self.recovery.resolve(exc, att.token, att)
        except Exception as exc:
            if not isinstance(exc, DbUnavailable | pymysql.err.MySQLError | TimeoutError):
                log.exception("reservation transaction failed unexpectedly")
            await self.admitter.give_back(att)
            if isinstance(exc, LeaseLapsed):
                # A fresh instance: a group's items share theirs.
                raise LeaseLapsed(str(exc)) from None
            raise overloaded("Database unavailable; retry shortly.") from None
        finally:
            HEALTH.commit((time.perf_counter() - started) * 1000)

        db_code = DbCode(int(row[0]))
        if db_code == DbCode.OK:
            self.buyer_keys.forget(req.user_id)
            try:
                await self.mirror.confirm(
                    att.keys, req.user_id, req.idempotency_key, att.token, att.fp, str(row[1])
                )
                self.breakers.for_deal(req.deal_id).success()
            except Exception as exc:
                # The order is committed; the janitor confirms the token later.
                self.breakers.for_deal(req.deal_id).failure()
                log.warning("order %s committed but not confirmed in Redis: %r", att.token, exc)
            return Reserved(reserved_body(att.token, req, row), replayed=False)

        await self.admitter.give_back(att)
        if db_code == DbCode.SOLD_OUT:
            log.info("deal %s: Redis admitted but the database is sold out", req.deal_id)
        # Redis admitted what the database refuses: Redis lost something, perhaps this
        # key's record too, and gate_reserve checks stock and quota before it meets the
        # key. A replay gets its first answer, whatever the deal's state now.
        return await self.replays.after_refusal(req, att.fp, db_code)

    async def aclose(self) -> None:
        if self.groups is not None:
            await self.groups.aclose()

    def item(
        self, token: str, req: ReserveRequest, fp: str, bucket: int, owner: str | None
    ) -> Item:
        """The request's database part, due within the reservation's deadline from now."""
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        return Item(
            token, req.user_id, req.quantity, bucket, req.idempotency_key, fp, deadline, owner
        )

    def single(self, deal_id: int, item: Item) -> Awaitable[Row]:
        """One grouped item on its own (a group of one, or a group that fell back)."""
        return self.transaction(deal_id, item, f"{item.bucket}:{item.quantity}")

    async def transaction(self, deal_id: int, item: Item, alloc: str) -> Row:
        """CALL gate_reserve, retried after deadlocks, within the item's deadline."""
        return await reservation_call(
            self.db,
            "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)",
            (
                item.token,
                deal_id,
                item.user_id,
                item.quantity,
                alloc,
                item.idempotency_key,
                item.fingerprint,
                f"user:{item.user_id}",
            ),
            item.deadline,
            1,
            self.lease,
            {item.owner} if item.owner else None,
        )


def reserved_body(token: str, req: ReserveRequest, row: tuple[Any, ...]) -> dict[str, Any]:
    """The 201's body, from gate_reserve's row (code, alloc, expires at, created at,
    unit price, currency)."""
    unit_price = int(row[4])
    return {
        "order_id": token,
        "status": "PENDING_PAYMENT",
        "deal_id": req.deal_id,
        "quantity": req.quantity,
        "unit_price": unit_price,
        "amount": unit_price * req.quantity,
        "currency": str(row[5]),
        "expires_at": iso(row[2]),
    }
