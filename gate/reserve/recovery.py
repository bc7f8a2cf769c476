"""Recovery of outcomes not known (`Recovery`): a commit whose connection was lost
mid-transaction. The server thread is made to end, then the order is looked up by
id: committed (its row answers as the transaction's would), or never (its units
given back, 503); a look-up that fails leaves it to this process's give-back loop
(gate/reserve/giveback.py) and to the janitor.

    OutcomeUnknown(thread, connected at, node)
        ──> Database.wait_thread_gone ──> orders.get(token)
              ├─ found ──────> committed: gate_reserve's row (DbCode.OK, …)
              ├─ none ───────> rolled back: the admission given back, 503
              └─ no answer ──> deferred: GiveBacks.add_unresolved, 503
"""

from __future__ import annotations

import asyncio
import logging

from gate.base.codes import DbCode
from gate.base.errors import overloaded
from gate.base.metrics import METRICS
from gate.inventory import orders
from gate.reserve.admission import Admitter
from gate.reserve.giveback import GiveBacks
from gate.reserve.groups import Row
from gate.reserve.request import Attempt
from gate.store.db import Database, OutcomeUnknown

log = logging.getLogger("gate.reservations")


class Recovery:
    def __init__(self, db: Database, admitter: Admitter, givebacks: GiveBacks) -> None:
        self.db = db
        self.admitter = admitter
        self.givebacks = givebacks

    async def resolve(self, exc: OutcomeUnknown, token: str, admitted: Attempt | None) -> Row:
        """The connection broke mid-transaction: find out whether `token`'s order
        committed. `admitted`: its admission in Redis, given back if it did not (None:
        no admission, the no-Redis policy)."""
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
            if admitted is not None and exc.thread_id is not None and exc.connected_at is not None:
                req = admitted.req
                self.givebacks.add_unresolved(
                    admitted.keys,
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
            if admitted is not None:
                await self.admitter.give_back(admitted)
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
