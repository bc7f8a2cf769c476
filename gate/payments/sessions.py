"""POST /v1/orders/{id}/payment: the provider session for a held order, idempotent.

The provider is called only after the hold committed and outside any transaction.
The provider call's idempotency key is derived from the order, so concurrent or
repeated requests (and a creation that timed out, which the provider client
resolves by querying the session by its order) all end with the same session;
the first one stored wins.
"""

from __future__ import annotations

import logging
from typing import Any

from gate.base.clock import iso
from gate.base.codes import OrderStatus
from gate.base.errors import Problem, not_found, overloaded
from gate.inventory.orders import valid_order_id
from gate.payments import store
from gate.payments.config import PaymentSettings
from gate.payments.provider import (
    Provider,
    ProviderRejected,
    ProviderUnavailable,
    SessionRequest,
)
from gate.store.db import Database

log = logging.getLogger("gate.payments.sessions")


def session_key(order_id: str) -> str:
    return f"session-{order_id}"


def _body(provider: str, session_id: str, redirect_url: str, expires_at: Any) -> dict[str, Any]:
    return {
        "provider": provider,
        "session_id": session_id,
        "redirect_url": redirect_url,
        "expires_at": iso(expires_at),
    }


class PaymentSessions:
    def __init__(self, db: Database, provider: Provider | None, settings: PaymentSettings) -> None:
        self.db = db
        self.provider = provider
        self.settings = settings

    async def _stored(self, order_id: str, user_id: int) -> tuple[Any, ...]:
        row = await store.order_and_session(self.db, order_id)
        if row is None or int(row[0]) != user_id:
            raise not_found("order")
        return row

    async def get_or_create(self, order_id: str, user_id: int) -> tuple[dict[str, Any], bool]:
        """The session body, and whether this call created it."""
        if not valid_order_id(order_id):
            raise not_found("order")
        row = await self._stored(order_id, user_id)
        status, hold_valid = str(row[1]), bool(row[2])
        # Checked before a stored session is handed out again: an order that is paid,
        # expired or cancelled has nothing left to pay.
        if status == OrderStatus.PENDING_PAYMENT and hold_valid and row[10] is not None:
            return _body(str(row[9]), str(row[10]), str(row[11]), row[12]), False
        if status != OrderStatus.PENDING_PAYMENT or not hold_valid:
            shown = status if status != OrderStatus.PENDING_PAYMENT else "past its hold"
            raise Problem(
                "CONFLICT",
                f"Order is {shown}; only a PENDING_PAYMENT order within its hold can be paid.",
                extra={"order_status": status},
            )
        if self.provider is None:
            raise overloaded("No payment provider is configured; payments are unavailable.", 30)
        request = SessionRequest(
            order_id=order_id,
            amount=int(row[3]),
            currency=str(row[4]),
            capture_mode=str(row[6]),
            expires_at=int(row[7]),
            description=str(row[5]),
            notify_url=self.settings.callback_url,
            return_url=self.settings.return_url,
        )
        try:
            session = await self.provider.create_session(request, session_key(order_id))
        except ProviderUnavailable as exc:
            log.warning("order %s: payment session not created: %s", order_id, exc)
            raise overloaded("The payment provider did not answer; retry shortly.", 2) from None
        except ProviderRejected as exc:
            log.error("order %s: provider refused the session: %s", order_id, exc)
            raise overloaded("The payment provider refused the session; retry later.", 30) from None
        if session.order_id != order_id:
            raise AssertionError("the provider returned a session for another order")
        # 1 row when this call stored it, 0 when a concurrent call was first.
        stored = await store.store_session(
            self.db,
            order_id,
            self.provider.name,
            session.session_id,
            session.redirect_url[:1024],
            session.expires_at if session.expires_at is not None else int(row[7]),
        )
        await store.link_session(self.db, self.provider.name, session.session_id, order_id)
        row = await self._stored(order_id, user_id)
        return _body(str(row[9]), str(row[10]), str(row[11]), row[12]), stored == 1
