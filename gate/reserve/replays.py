"""The database's answers for an idempotency key (`Replays`): a replay's first answer
read back from its order, a key used with another request (422), a key whose
request is still in progress (409).

    Redis names the order of a replay (REPLAY) ──> of_order: its order's answer
    Redis refuses a buyer it admitted before ──> hidden: a replay whose Redis record
        was lost? (the buyer's keys remembered briefly: BuyerKeys)
    the database refuses a reservation Redis admitted ──> after_refusal: the key's
        own answer if the database holds it, else the refusal
"""

from __future__ import annotations

from gate.base.codes import DbCode
from gate.base.errors import Problem, from_db, overloaded
from gate.inventory import orders
from gate.reserve.buyer_keys import BuyerKeys
from gate.reserve.request import Reserved, ReserveRequest
from gate.store.db import Database


class Replays:
    def __init__(self, db: Database, buyer_keys: BuyerKeys) -> None:
        self.db = db
        self.buyer_keys = buyer_keys

    async def of_order(self, order_id: str, user_id: int, fp: str) -> Reserved:
        """Redis holds the key's record: its order's answer, read from the database."""
        try:
            order = await orders.get(self.db, order_id)
        except Exception:
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None or order.user_id != user_id or order.fingerprint != fp:
            # Redis remembers a request the database does not hold (a restored
            # database, say). The database is the truth: refuse rather than guess.
            raise overloaded("Idempotency record inconsistent; retry shortly.")
        return Reserved(order.reservation_body(), replayed=True)

    async def of_key(self, req: ReserveRequest, fp: str) -> Reserved | None:
        """The database's answer for this buyer's key, if it holds one."""
        try:
            existing = await orders.by_idempotency_key(self.db, req.user_id, req.idempotency_key)
        except Exception:
            raise overloaded("Database unavailable; retry shortly.") from None
        if existing is None:
            return None
        # The fingerprint names the deal: the key used on another deal is a mismatch.
        if existing.fingerprint != fp:
            raise Problem(
                "IDEMPOTENCY_MISMATCH",
                "This Idempotency-Key was used with a different request.",
            )
        return Reserved(existing.reservation_body(), replayed=True)

    async def hidden(self, req: ReserveRequest, fp: str) -> Reserved | None:
        """A refusal of a buyer Redis admitted before may hide a replay whose Redis
        record was lost: the database is asked, unless the buyer's keys, remembered
        briefly (BuyerKeys), show it does not hold this one (a buyer re-clicking with
        fresh keys at their limit does not cost a query each time)."""
        if not await self.buyer_keys.may_hold(req.user_id, req.idempotency_key):
            return None
        return await self.of_key(req, fp)

    async def after_refusal(self, req: ReserveRequest, fp: str, db_code: DbCode) -> Reserved:
        """The database refused the reservation (gate_reserve checks the window, stock
        and quota before it meets the key): a replay or a mismatch gets the key's own
        answer, whatever the deal's state now; else the refusal."""
        existing = await self.of_key(req, fp)
        if existing is not None:
            return existing
        if db_code == DbCode.DUPLICATE:
            # The key is taken but its order not readable yet: its request still runs.
            raise Problem(
                "IDEMPOTENCY_IN_PROGRESS",
                "A request with this Idempotency-Key is still in progress.",
            )
        raise from_db(db_code)
