"""A reservation request and its answers: what the edge and the ASGI app hand the
reservation path, and what comes back.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from dataclasses import dataclass
from typing import Any

from gate.base.codes import AdmitCode
from gate.base.errors import Problem
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


# lua/admit.lua ARGV[17] for `ReserveRequest.operator_retry` (a header never maps to it).
OPERATOR_ADMISSION = "*"


def _no_admission(header: str | None) -> str:
    """Without the waiting room installed no token is ever valid."""
    return "" if header is None else "-"


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


def _consumed(fut: asyncio.Future[Any]) -> None:
    """A call whose outcome no longer matters: its failure retrieved, not logged."""
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """An admission of a deal in queue mode started at the edge (`start_queued`):
    what settles it once its reply is in (`settle_queued`)."""

    keys: DealKeys
    fp: str
    token: str
    sent: float
    owner: str
    index: asyncio.Future[Any] | None  # None: the admission writes the order's index
    admit: asyncio.Future[Any]


@functools.lru_cache(maxsize=4096)
def fingerprint(deal_id: int, quantity: int) -> str:
    """What makes two requests with one idempotency key "the same request"."""
    return hashlib.sha256(f"reserve:{deal_id}:{quantity}".encode()).hexdigest()[:32]
