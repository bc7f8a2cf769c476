"""The reservation path's plugs: what an area hands over (through its Extension) to
take part in a reservation, so that the core never names an area's types.

    waiting room (gate/room/) ──AdmissionPort──> Admitter: the Admission-Token check
    queue mode (gate/queuemode/) ──QueuePort──> QueueDispatch: a queue-mode deal's
                                                admission queued instead of committed
                               ──QueuedOrders──> order view and cancel (gate/api/)

Without an area each plug is absent (None) and the path is the synchronous one.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from gate.inventory.mirror import QueueArgs


class AdmissionPort(Protocol):
    """The waiting room's admission tokens as lua/admit.lua checks them."""

    def arg(self, deal_id: int, user_id: int, header: str | None) -> str:
        """What lua/admit.lua is told of the request's Admission-Token header."""

    async def restore(self, deal_id: int, user_id: int, header: str | None) -> None:
        """Give back the admission a reservation spent, before it is tried once more
        after its lease was found lapsed."""


class ModeView(Protocol):
    def known(self, deal_id: int) -> bool | None:
        """True: the deal is in queue mode; False: sync; None: not known yet."""

    async def is_queue(self, deal_id: int) -> bool:
        """Whether the deal is in queue mode, the database asked for a deal `known`
        does not know yet."""


class QueuePort(Protocol):
    """Queue mode at the reservation path: the admission of a deal in queue mode
    queues the request in Redis, and the answer is a 202 instead of a commit."""

    @property
    def modes(self) -> ModeView: ...

    def admission(
        self, deal_id: int, token: str, user_id: int
    ) -> tuple[QueueArgs, asyncio.Future[Any] | None]: ...

    def drop_index(self, token: str, index: asyncio.Future[Any] | None) -> None: ...

    def full(self, deal_id: int) -> None: ...

    async def unqueue(self, deal_id: int, token: str, reason: str) -> bool: ...

    def queued(self, deal_id: int, token: str, quantity: int) -> dict[str, Any] | None: ...

    async def queued_first(self, deal_id: int, token: str, quantity: int) -> dict[str, Any]: ...

    async def enqueue(
        self,
        deal_id: int,
        token: str,
        user_id: int,
        quantity: int,
        alloc: str,
        idempotency_key: str,
        fp: str,
    ) -> dict[str, Any] | None: ...

    async def replay(self, deal_id: int, token: str) -> dict[str, Any] | None: ...


class QueuedOrders(Protocol):
    """An order that waits in a deal's queue, as the order view and cancel see it."""

    async def view_before_database(self, order_id: str, user_id: int) -> dict[str, Any] | None: ...

    async def view(self, order_id: str, user_id: int) -> dict[str, Any] | None: ...

    async def cancel(self, order_id: str, user_id: int) -> dict[str, Any] | None: ...
