"""A reservation request, its way through the path and its answers: what the edge
and the ASGI app hand the reservation path, what travels between the path's parts,
and what comes back.

    ReserveRequest ──> Attempt (one per admission: the request, its keys, token and
                       mode) ──> Admission (Redis's answer) ──> Reserved (201, 200, 202)
                                                           └──> Problem (raised)
    QueuedCall: an Attempt whose admission's reply the edge settles in a callback
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gate.base.codes import AdmitCode
from gate.base.errors import Problem
from gate.inventory.mirror import QueueArgs
from gate.store.keys import DealKeys

MAX_QUANTITY = 1_000_000


def sold_out() -> Problem:
    return Problem("SOLD_OUT", "The deal is sold out.", extra={"remaining_hint": 0}, cacheable=True)


# Only ever encoded, never raised (raising one instance again and again would chain
# its tracebacks).
SOLD_OUT = sold_out()


@dataclass(frozen=True)
class ReserveRequest:
    deal_id: int
    user_id: int
    quantity: int
    idempotency_key: str
    ip: str
    device: str | None
    # The Admission-Token header of a deal with a waiting room (gate/room/).
    admission_token: str | None = None
    # The operator's re-submission of a queue dead letter (`gate queue retry`): the
    # request that died spent the buyer's admission, so none is asked or spent. Never
    # set from a buyer's request.
    operator_retry: bool = False


class Mode(enum.Enum):
    """How a reservation's admission is followed up."""

    SYNC = "sync"  # committed in the database by this request (201)
    QUEUED = "queued"  # queue mode: the admission also queued it (202)
    # A deal newer than this process's view of the modes: admitted as sync, then
    # queued by a second call if it is in queue mode after all.
    UNSURE = "unsure"


SYNC, QUEUED, UNSURE = Mode.SYNC, Mode.QUEUED, Mode.UNSURE


@dataclass(slots=True)
class Attempt:
    """One reservation from its admission on: what every part of the path after the
    near-caches needs. Made once per admission (a partitioned deal: once per
    partition asked) and never changed; slots, not frozen: it is made on every
    committed reservation, and a frozen dataclass costs five times as much to make."""

    req: ReserveRequest
    keys: DealKeys  # the deal's keys (of the partition admitted from)
    fp: str  # `fingerprint`
    token: str  # the order id, and the admission's in-flight token
    start: int  # the bucket lua/admit.lua starts from
    sent: float  # time.monotonic() before the admission: a limiter's wait counts from it
    owner: str  # the process lease its token names; the transaction runs under it
    mode: Mode = SYNC
    queue_args: QueueArgs | None = None  # QUEUED: what admit.lua needs to queue it
    index: asyncio.Future[Any] | None = None  # QUEUED: the call writing the order's index
    parts: int = 1  # the deal's partitions


@dataclass(frozen=True)
class Admission:
    """What the admission (and the global limiter beside it) answered."""

    code: AdmitCode
    detail: str
    # The user was admitted to this deal before: a refusal may hide a replay whose
    # Redis record was lost, so the database is asked.
    known_buyer: bool = False
    # Size of the deal's buyers set on a sold-out answer (-1: unknown), for the
    # near-cache.
    buyers: int = -1
    # The global limiter refused: retry after this many ms.
    global_retry_ms: int | None = None


@dataclass(frozen=True)
class Reserved:
    body: dict[str, Any]
    replayed: bool
    # Answered 202: the request waits in its deal's queue (docs/queue-mode.md).
    queued: bool = False


def admission_of(reply: list[Any], global_retry_ms: int | None = None) -> Admission:
    """lua/admit.lua's reply: {code, detail[, buyers, known buyer]}."""
    return Admission(
        code=AdmitCode(int(reply[0])),
        detail=str(reply[1]),
        buyers=int(reply[2]) if len(reply) > 2 else -1,
        known_buyer=len(reply) > 3 and int(reply[3]) == 1,
        global_retry_ms=global_retry_ms,
    )


def consumed(fut: asyncio.Future[Any]) -> None:
    """A call whose outcome no longer matters: its failure retrieved, not logged."""
    if not fut.cancelled():
        fut.exception()


@dataclass(slots=True)
class QueuedCall:
    """An admission of a deal in queue mode, sent by `ReservationPath.take` for the
    edge to settle in a callback on its reply (`admit`), with no task: `settle()`
    gives the 202, or the coroutine that answers from there."""

    attempt: Attempt
    admit: asyncio.Future[Any]
    # The path's settling, a bound method it keeps (nothing made per request).
    settled_by: Callable[[QueuedCall], Reserved | Awaitable[Reserved]]

    def settle(self) -> Reserved | Awaitable[Reserved]:
        """Once `admit` is done: the 202, else the rest of the way as a coroutine. A
        failed admission raises its 503."""
        return self.settled_by(self)


@functools.lru_cache(maxsize=4096)
def fingerprint(deal_id: int, quantity: int) -> str:
    """What makes two requests with one idempotency key "the same request"."""
    return hashlib.sha256(f"reserve:{deal_id}:{quantity}".encode()).hexdigest()[:32]
