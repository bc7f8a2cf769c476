"""Queue-mode dispatch (`QueueDispatch`): an admitted reservation of a deal in queue
mode handed to the deal's queue (the QueuePort an area plugs in) and answered 202,
or taken back.

    mode_of(deal): QUEUED (admit.lua queues it in the same call), SYNC, or UNSURE (a
        deal newer than the process's view of the modes)
    QUEUED, admitted ──> accept: a buyer admitted before may be a replay whose Redis
        record was lost (asked of the database first: `lost_replay`) ──> 202
    QUEUED, refused ──> not_queued: its index dropped (a full queue: 503)
    UNSURE, admitted as sync, in queue mode after all ──> enqueue: a second call ──> 202
    a replay of a request that waits in the queue ──> replay: 202 again
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gate.base.codes import AdmitCode
from gate.base.errors import Problem, overloaded
from gate.reserve.admission import Admitter
from gate.reserve.ports import QueuePort
from gate.reserve.replays import Replays
from gate.reserve.request import (
    QUEUED,
    SYNC,
    UNSURE,
    Attempt,
    Mode,
    Reserved,
    consumed,
)

log = logging.getLogger("gate.reservations")


# Queue mode: how long an admission of a buyer admitted before waits for the database
# to say whether it is a replay whose Redis record was lost (`lost_replay`).
LOST_REPLAY_WAIT_SECONDS = 0.5


class QueueDispatch:
    def __init__(self, port: QueuePort, admitter: Admitter, replays: Replays) -> None:
        self.port = port
        self.admitter = admitter
        self.replays = replays
        self._known = port.modes.known

    def mode_of(self, deal_id: int) -> Mode:
        """The mode is known without a wait for every deal up to the last read of the
        modes; a newer deal is admitted as sync (UNSURE) and, if it is in queue mode
        after all, queued by a second call (`enqueue`)."""
        known = self._known(deal_id)
        return QUEUED if known else SYNC if known is False else UNSURE

    def queued_now(self, att: Attempt, reply: list[Any]) -> Reserved | None:
        """The 202 of a queue-mode admission whose reply is in, without a coroutine:
        when it queued the request, the buyer is new to the deal (else `accept` asks
        the database first), its index is written and the deal's price known."""
        if int(reply[0]) != AdmitCode.OK or reply[3] != 0:
            return None
        index = att.index
        if index is not None and (
            not index.done() or index.cancelled() or index.exception() is not None
        ):
            return None
        body = self.port.queued(att.req.deal_id, att.token, att.req.quantity)
        return None if body is None else Reserved(body, replayed=False, queued=True)

    def not_queued(self, att: Attempt, code: AdmitCode) -> None:
        """The admission of a QUEUED attempt refused it: nothing was queued."""
        self.port.drop_index(att.token, att.index)
        if code == AdmitCode.QUEUE_FULL:
            self.port.full(att.req.deal_id)
            raise overloaded("The deal's queue is full; retry shortly.")

    async def replay(self, deal_id: int, token: str) -> Reserved | None:
        """A replay of a request that waits in its deal's queue: 202 again (None: it
        does not wait there)."""
        queued = await self.port.replay(deal_id, token)
        return None if queued is None else Reserved(queued, replayed=True, queued=True)

    async def unqueue(self, att: Attempt, reason: str) -> bool:
        """Reject a request the admission queued, so that no consumer commits it (the
        caller then gives its units back); False when a consumer already commits it,
        or the call failed (then the consumers settle it)."""
        try:
            return await self.port.unqueue(att.req.deal_id, att.token, reason)
        except Exception as exc:
            log.warning("queued reservation %s not rejected: %r", att.token, exc)
            return False

    async def accept(self, att: Attempt, known_buyer: bool) -> Reserved:
        """A QUEUED attempt the admission queued: 202, unless it is a replay whose
        Redis record was lost (a buyer admitted before)."""
        if known_buyer:
            if att.index is not None:
                att.index.add_done_callback(consumed)  # not awaited if taken back
            replay = await self.lost_replay(att, queued=True)
            if replay is not None:
                return replay
        return await self.queued(att)

    async def queued(self, att: Attempt) -> Reserved:
        """The admission queued the request: 202 once the call that wrote the order's
        index beside it is in (`att.index`; None: the admission wrote it)."""
        req = att.req
        try:
            if att.index is not None:
                await att.index
        except Exception as exc:
            # Queued, but its order could not be found by id: rejected at once if no
            # consumer has taken it yet (then given back), else answered as queued.
            log.warning("reservation %s queued without its index: %r", att.token, exc)
            if await self.unqueue(att, "OVERLOADED"):
                await self.admitter.give_back(att)
                raise overloaded("Admission service unavailable; retry shortly.") from None
        body = self.port.queued(req.deal_id, att.token, req.quantity)
        if body is None:
            body = await self.port.queued_first(req.deal_id, att.token, req.quantity)
        return Reserved(body, replayed=False, queued=True)

    async def is_queue(self, deal_id: int) -> bool:
        """An UNSURE deal's mode, read once per new deal."""
        return await self.port.modes.is_queue(deal_id)

    async def enqueue(self, att: Attempt, alloc: str, known_buyer: bool) -> Reserved:
        """Queue mode, a deal newer than this process's last read of the modes: the
        request was admitted as sync; a second call queues it (202)."""
        if known_buyer:
            replay = await self.lost_replay(att, queued=False)
            if replay is not None:
                return replay
        req = att.req
        try:
            body = await self.port.enqueue(
                req.deal_id,
                att.token,
                req.user_id,
                req.quantity,
                alloc,
                req.idempotency_key,
                att.fp,
            )
        except Exception as exc:
            # Not queued (the script never ran, or ran: then the token is in the queue
            # and the consumers settle it; compensate acts only if it is not).
            log.warning("reservation %s not queued: %r", att.token, exc)
            body = None
        if body is None:
            await self.admitter.give_back(att)
            raise overloaded("The deal's queue is full; retry shortly.")
        return Reserved(body, replayed=False, queued=True)

    async def lost_replay(self, att: Attempt, queued: bool) -> Reserved | None:
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
        asked = asyncio.ensure_future(self.replays.hidden(att.req, att.fp))
        asked.add_done_callback(consumed)  # also when nobody waits for it any more
        try:
            existing = await asyncio.wait_for(asyncio.shield(asked), LOST_REPLAY_WAIT_SECONDS)
        except TimeoutError:
            return None
        except Problem as problem:
            if problem.code != "IDEMPOTENCY_MISMATCH":
                return None  # the database is unavailable: queued, as without the check
            await self._take_back(att, queued)
            raise
        except Exception as exc:
            log.warning("reservation %s: replay not checked: %r", att.token, exc)
            return None
        if existing is None:
            return None
        await self._take_back(att, queued)
        return existing

    async def _take_back(self, att: Attempt, queued: bool) -> None:
        """An admission that must not be queued after all: rejected first if queued (a
        consumer already committing it meets DUPLICATE and gives the units back
        itself), then its units given back."""
        if queued and not await self.unqueue(att, "DUPLICATE"):
            return  # a consumer meets it: DUPLICATE, given back there
        await self.admitter.give_back(att)
