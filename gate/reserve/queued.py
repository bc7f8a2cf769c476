"""Queue-mode dispatch: an admitted reservation of a deal in queue mode handed to the
deal's queue (the QueuePort an area plugs in) and answered 202, or taken back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gate.base.errors import overloaded
from gate.reserve.core import ReservationCore
from gate.reserve.request import (
    Reserved,
    ReserveRequest,
)
from gate.store.keys import DealKeys, deal_keys

log = logging.getLogger("gate.reservations")


class QueueDispatch(ReservationCore):
    async def _queued(
        self, req: ReserveRequest, token: str, index: asyncio.Future[Any] | None
    ) -> Reserved:
        """Queue mode: the admission queued the request (202); `index`, the call that
        wrote the order's index beside it (None: the admission wrote it)."""
        assert self.queue is not None
        try:
            if index is not None:
                await index
        except Exception as exc:
            # Queued, but its order could not be found by id: rejected at once if no
            # consumer has taken it yet (then given back), else answered as queued.
            log.warning("reservation %s queued without its index: %r", token, exc)
            try:
                rejected = await self.queue.unqueue(req.deal_id, token, "OVERLOADED")
            except Exception:
                rejected = False  # the consumers settle it; the order reads once committed
            if rejected:
                await self._compensate(deal_keys(req.deal_id), req, token)
                raise overloaded("Admission service unavailable; retry shortly.") from None
        body = self.queue.queued(req.deal_id, token, req.quantity)
        if body is None:
            body = await self.queue.queued_first(req.deal_id, token, req.quantity)
        return Reserved(body, replayed=False, queued=True)

    async def _enqueue(
        self, keys: DealKeys, req: ReserveRequest, fp: str, token: str, alloc: str
    ) -> Reserved:
        """Queue mode, a deal newer than this process's last read of the modes: the
        request was admitted as sync; a second call queues it (202)."""
        assert self.queue is not None
        try:
            body = await self.queue.enqueue(
                req.deal_id, token, req.user_id, req.quantity, alloc, req.idempotency_key, fp
            )
        except Exception as exc:
            # Not queued (the script never ran, or ran: then the token is in the queue
            # and the consumers settle it; compensate acts only if it is not).
            log.warning("reservation %s not queued: %r", token, exc)
            body = None
        if body is None:
            await self._compensate(keys, req, token)
            raise overloaded("The deal's queue is full; retry shortly.")
        return Reserved(body, replayed=False, queued=True)
