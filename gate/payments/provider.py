"""The payment provider interface, its value types and the event model.

Every provider call that changes something carries a stable idempotency key, so a
retry after a timeout can never do it twice; every call is bounded in time and in
attempts. A call whose outcome is unknown raises ProviderUnavailable and the
caller resolves it by querying (a session by its order) or by trying again with
the same key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gate.payments.codes import EVENT_TYPES
from gate.payments.config import PROVIDER_NAME_MAX

ID_MAX = 191
ORDER_ID_RE = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
CURRENCY_RE = re.compile(r"[A-Z]{3}")
# The sandbox's ids (the contract's alphabet: printable ASCII, the columns' width).
# Each real provider's adapter checks its ids against that provider's documented
# alphabet and length instead, short enough that the gate's composite event ids
# (`<provider>:<id>:<type>`) fit ID_MAX whole.
PROVIDER_ID_RE = re.compile(r"[\x21-\x7e]{1,191}")
AMOUNT_MAX = 2**63 - 1
# 9999-12-31T23:59:59Z: the last second a DATETIME (and datetime) can hold.
CREATED_MAX_SECONDS = 253_402_300_799


class ProviderError(Exception):
    pass


class ProviderUnavailable(ProviderError):
    """No answer within the bounds: the call may or may not have happened."""


class ProviderRejected(ProviderError):
    """A definitive refusal (4xx): trying again with the same request will not help."""

    def __init__(self, status: int, code: str, detail: str, body: dict[str, Any] | None = None):
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.body = body or {}


class EventInvalid(ValueError):
    """A verified body that is not an event this gate can read (answered 400)."""


def checked_id(value: Any, pattern: re.Pattern[str]) -> str | None:
    """`value` when it is a string the whole of which matches `pattern` (fullmatch:
    a trailing newline or a longer string is not an id), else None. Every id taken
    from a provider's webhook or answer passes here before it can reach a column."""
    return value if isinstance(value, str) and pattern.fullmatch(value) else None


def event_id_of(value: Any, pattern: re.Pattern[str], what: str) -> str:
    """An id a webhook must carry: EventInvalid (400, counted as rejected) otherwise."""
    found = checked_id(value, pattern)
    if found is None:
        raise EventInvalid(f"{what} is missing or not a valid id")
    return found


def answer_id(value: Any, pattern: re.Pattern[str], what: str) -> str:
    """An id an API answer must carry: a failed provider call otherwise."""
    found = checked_id(value, pattern)
    if found is None:
        raise ProviderUnavailable(f"the provider's answer has no valid {what}")
    return found


def order_id_or_none(value: Any) -> str | None:
    """An order id as the gate issues them, or None (the event names no order)."""
    return checked_id(value, ORDER_ID_RE)


@dataclass(frozen=True)
class SessionRequest:
    order_id: str
    amount: int
    currency: str
    capture_mode: str  # "automatic" | "manual"
    expires_at: int  # unix seconds: the hold's end
    description: str
    notify_url: str | None = None
    return_url: str | None = None


@dataclass(frozen=True)
class Session:
    session_id: str
    order_id: str
    redirect_url: str
    expires_at: int | None
    status: str


@dataclass(frozen=True)
class Payment:
    payment_id: str
    order_id: str | None
    amount: int
    currency: str
    status: str  # authorized | succeeded | failed | voided
    refunded_amount: int = 0


@dataclass(frozen=True)
class Refund:
    refund_id: str
    payment_id: str
    order_id: str | None
    amount: int
    currency: str
    status: str  # pending | succeeded | failed


@dataclass(frozen=True)
class Transaction:
    kind: str  # payment | refund
    id: str
    payment_id: str
    order_id: str | None
    amount: int
    currency: str
    status: str
    created: int


@dataclass(frozen=True)
class TransactionPage:
    items: list[Transaction]
    next_cursor: str | None


@dataclass(frozen=True)
class ProviderEvent:
    """One provider fact, normalised: from a verified webhook or an API answer."""

    event_id: str
    type: str
    created: int | None
    order_id: str | None  # None when the provider named no valid order id
    payment_id: str | None
    amount: int | None
    currency: str | None
    refund_id: str | None
    payload: bytes


class Provider(Protocol):
    name: str

    async def create_session(self, request: SessionRequest, key: str) -> Session: ...

    async def find_session(self, order_id: str) -> Session | None: ...

    async def payments_for_order(self, order_id: str) -> list[Payment]: ...

    async def get_payment(self, payment_id: str) -> Payment | None: ...

    async def capture(self, payment_id: str, amount: int, key: str) -> Payment: ...

    async def void(self, payment_id: str, key: str) -> Payment: ...

    async def refund(self, payment_id: str, amount: int, key: str) -> Refund: ...

    async def transactions(
        self, cursor: str | None, limit: int, since: int | None = None
    ) -> TransactionPage:
        """Payments and refunds created at or after `since` (unix seconds; None: all),
        a page from `cursor` (None: the first page); next_cursor None on the last.
        Any order (the sandbox lists oldest first, Stripe newest first)."""
        ...

    async def close(self) -> None: ...


def _opt_str(data: dict[str, Any], name: str, pattern: re.Pattern[str]) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise EventInvalid(f"data.{name} must be a string matching {pattern.pattern}")
    return value


def parse_event(body: bytes) -> ProviderEvent:
    """The contract's event body; raises EventInvalid for anything else."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise EventInvalid("the body is not JSON") from None
    if not isinstance(doc, dict):
        raise EventInvalid("the body must be a JSON object")
    event_id = doc.get("id")
    event_type = doc.get("type")
    data = doc.get("data")
    created = doc.get("created")
    if not isinstance(event_id, str) or not PROVIDER_ID_RE.fullmatch(event_id):
        raise EventInvalid("id must be a string of 1-191 printable ASCII characters")
    if not isinstance(event_type, str) or not 1 <= len(event_type) <= 64:
        raise EventInvalid("type must be a string of 1-64 characters")
    if not isinstance(data, dict):
        raise EventInvalid("data must be an object")
    if created is not None and (
        isinstance(created, bool)
        or not isinstance(created, int)
        or not 0 <= created <= CREATED_MAX_SECONDS
    ):
        raise EventInvalid("created must be unix seconds before the year 10000")
    if not event_type.isascii() or not event_type.isprintable():
        raise EventInvalid("type must be printable ASCII")
    amount = data.get("amount")
    if amount is not None and (
        isinstance(amount, bool) or not isinstance(amount, int) or not 0 <= amount <= AMOUNT_MAX
    ):
        raise EventInvalid("data.amount must be a non-negative integer (minor units)")
    raw_order = data.get("order_id")
    if raw_order is not None and not isinstance(raw_order, str):
        raise EventInvalid("data.order_id must be a string")
    payment_id = _opt_str(data, "payment_id", PROVIDER_ID_RE)
    refund_id = _opt_str(data, "refund_id", PROVIDER_ID_RE)
    currency = data.get("currency")
    if currency is not None and not isinstance(currency, str):
        raise EventInvalid("data.currency must be a string")
    if event_type in EVENT_TYPES and payment_id is None:
        raise EventInvalid("data.payment_id is required")
    return ProviderEvent(
        event_id=event_id,
        type=event_type,
        created=created,
        # An order id this gate never issues cannot name an order: the event is kept
        # (payload) and quarantined as naming an unknown order.
        order_id=raw_order if raw_order and ORDER_ID_RE.fullmatch(raw_order) else None,
        payment_id=payment_id,
        amount=amount,
        # A currency that is not three capitals cannot match any order: quarantined.
        currency=currency if currency and CURRENCY_RE.fullmatch(currency) else None,
        refund_id=refund_id,
        payload=body,
    )


def synthetic_payment_event(provider: str, payment: Payment, source: str) -> ProviderEvent:
    """An API answer about a payment as an event with a deterministic id, so the
    same fact learnt twice (answer and webhook, or two answers) applies once."""
    event_type = {
        "succeeded": "payment.succeeded",
        "authorized": "payment.authorized",
        "failed": "payment.failed",
        "voided": "authorization.voided",
    }[payment.status]
    body = orjson.dumps(
        {
            "source": source,
            "provider": provider[:PROVIDER_NAME_MAX],
            "payment_id": payment.payment_id,
            "order_id": payment.order_id,
            "amount": payment.amount,
            "currency": payment.currency,
            "status": payment.status,
        }
    )
    return ProviderEvent(
        event_id=f"api:{payment.payment_id}:{payment.status}"[:ID_MAX],
        type=event_type,
        created=None,
        order_id=payment.order_id
        if payment.order_id and ORDER_ID_RE.fullmatch(payment.order_id)
        else None,
        payment_id=payment.payment_id,
        amount=payment.amount,
        currency=payment.currency,
        refund_id=None,
        payload=body,
    )


def synthetic_refund_event(provider: str, refund: Refund, source: str) -> ProviderEvent | None:
    if refund.status not in ("succeeded", "failed"):
        return None
    body = orjson.dumps(
        {
            "source": source,
            "provider": provider,
            "refund_id": refund.refund_id,
            "payment_id": refund.payment_id,
            "order_id": refund.order_id,
            "amount": refund.amount,
            "currency": refund.currency,
            "status": refund.status,
        }
    )
    return ProviderEvent(
        event_id=f"api:{refund.refund_id}:{refund.status}"[:ID_MAX],
        type=f"refund.{refund.status}",
        created=None,
        order_id=refund.order_id
        if refund.order_id and ORDER_ID_RE.fullmatch(refund.order_id)
        else None,
        payment_id=refund.payment_id,
        amount=refund.amount,
        currency=refund.currency,
        refund_id=refund.refund_id,
        payload=body,
    )
