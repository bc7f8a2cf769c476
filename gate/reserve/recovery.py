"""Recovery of outcomes not known: a commit whose connection was lost (the order is
looked up by id, then confirmed or compensated), and a queue-mode replay whose Redis
record was lost (the database is asked).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gate.base.codes import DbCode
from gate.base.errors import Problem, overloaded
from gate.base.metrics import METRICS
from gate.reserve.core import ReservationCore
from gate.reserve.request import (
    Reserved,
    ReserveRequest,
    _consumed,
)
from gate.stock import orders
from gate.store.db import OutcomeUnknown
from gate.store.keys import DealKeys

log = logging.getLogger("gate.reservations")


# Queue mode: how long an admission of a buyer admitted before waits for the database
# to say whether it is a replay whose Redis record was lost (`_lost_replay`).
LOST_REPLAY_WAIT_SECONDS = 0.5


class Recovery(ReservationCore):
    async def _resolve_unknown(
        self,
        exc: OutcomeUnknown,
        keys: DealKeys,
        req: ReserveRequest,
        token: str,
        *,
        redis: bool,
    ) -> tuple[Any, ...]:
        """The connection broke mid-transaction: find out whether it committed."""
        log.warning("reservation %s: outcome unknown (%r); resolving", token, exc.cause)
        try:
            if exc.thread_id is not None and exc.connected_at is not None:
                age = asyncio.get_running_loop().time() - exc.connected_at
                if not await self.db.wait_thread_gone(exc.thread_id, age, node=exc.node):
                    raise TimeoutError("the server thread did not end in time")
            order = await orders.get(self.db, token)
        except Exception as lookup_exc:
            # Cannot tell yet. This process looks again once the database answers
            # (gate/reserve/giveback.py), and the janitor in any case; neither gives units back
            # for a committed order.
            METRICS.unknown_outcomes.labels("deferred").inc()
            log.warning("reservation %s unresolved, resolved later: %r", token, lookup_exc)
            if redis and exc.thread_id is not None and exc.connected_at is not None:
                self.givebacks.add_unresolved(
                    keys,
                    req.user_id,
                    req.idempotency_key,
                    token,
                    exc.thread_id,
                    exc.connected_at,
                    exc.node,
                )
            raise overloaded("Database unavailable; retry shortly.") from None
        if order is None:
            METRICS.unknown_outcomes.labels("rolled_back").inc()
            if redis:
                await self._compensate(keys, req, token)
            raise overloaded("Database connection lost; the reservation was not made.")
        METRICS.unknown_outcomes.labels("committed").inc()
        return (
            int(DbCode.OK),
            order.alloc,
            order.expires_at,
            order.created_at,
            order.unit_price,
            order.currency,
        )

    async def _lost_replay(
        self, keys: DealKeys, req: ReserveRequest, fp: str, token: str, queued: bool
    ) -> Reserved | None:
        """Queue mode: Redis admitted a buyer it had admitted to the deal before, with a
        key it holds no record of. Sync mode's transaction would meet the key in the
        database (DUPLICATE: the replay answered); a 202 would hand the buyer a second
        order id whose commit can only fail. So the database is asked first (at most
        one read per buyer per BUYER_KEYS_SECONDS, `BuyerKeys`), for at most
        LOST_REPLAY_WAIT_SECONDS: a replay whose record Redis lost (a flush, a
        failover) is taken back (unqueued, its units given back) and answered with
        the order, as in sync mode; a key used with another request is a 422. A
        database that does not answer in time leaves the 202 (queue mode accepts
        through database trouble; a consumer then meets DUPLICATE)."""
        # Shielded: a read cut short by the wait would cost its connection.
        asked = asyncio.ensure_future(self._replayed(req, fp))
        asked.add_done_callback(_consumed)  # also when nobody waits for it any more
        try:
            existing = await asyncio.wait_for(asyncio.shield(asked), LOST_REPLAY_WAIT_SECONDS)
        except TimeoutError:
            return None
        except Problem as problem:
            if problem.code != "IDEMPOTENCY_MISMATCH":
                return None  # the database is unavailable: queued, as without the check
            await self._take_back(keys, req, token, queued)
            raise
        except Exception as exc:
            log.warning("reservation %s: replay not checked: %r", token, exc)
            return None
        if existing is None:
            return None
        await self._take_back(keys, req, token, queued)
        return existing

    async def _replayed(self, req: ReserveRequest, fp: str) -> Reserved | None:
        if not await self.buyer_keys.may_hold(req.user_id, req.idempotency_key):
            return None
        return await self._existing_or_none(req, fp)

    async def _take_back(
        self, keys: DealKeys, req: ReserveRequest, token: str, queued: bool
    ) -> None:
        """An admission that must not be queued after all: rejected first if queued (a
        consumer already committing it meets DUPLICATE and gives the units back
        itself), then its units given back."""
        if queued:
            assert self.queue is not None
            try:
                rejected = await self.queue.unqueue(req.deal_id, token, "DUPLICATE")
            except Exception as exc:
                log.warning("queued reservation %s not rejected: %r", token, exc)
                return  # a consumer meets it: DUPLICATE, given back there
            if not rejected:
                return
        await self._compensate(keys, req, token)
