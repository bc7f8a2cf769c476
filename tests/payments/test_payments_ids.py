"""Ids read from providers' API answers are checked whole before the gate keeps them:
the answer readers of the sandbox's HTTP client and of the Stripe adapter (the Alipay
and WeChat Pay ones are driven through their fakes in their own test files). A
malformed id is a failed provider call (ProviderUnavailable), never a value that could
reach a column; an order id that is not one the gate issues names no order."""

from __future__ import annotations

from typing import Any

import pytest
from ulid import ULID

from gate.payments.provider import (
    PROVIDER_ID_RE,
    ProviderUnavailable,
    checked_id,
    order_id_or_none,
)
from gate.payments.providers import http as http_provider
from gate.payments.providers import stripe as stripe_provider

BAD_IDS = ["pay_1\n", "", "x" * 192, "pay 1", "pay_é", None, 12]


def test_checked_id_matches_the_whole_string() -> None:
    assert checked_id("pay_1", PROVIDER_ID_RE) == "pay_1"
    for bad in BAD_IDS:
        assert checked_id(bad, PROVIDER_ID_RE) is None, bad
    order = str(ULID())
    assert order_id_or_none(order) == order
    assert order_id_or_none(order + "\n") is None and order_id_or_none(order + "0") is None


def sandbox_payment(**over: Any) -> dict[str, Any]:
    return {"id": "pay_1", "order_id": str(ULID()), "amount": 1, "currency": "EUR",
            "status": "succeeded", **over}  # fmt: skip


@pytest.mark.parametrize("bad", BAD_IDS)
def test_sandbox_answers_with_a_malformed_id_are_failed_calls(bad: Any) -> None:
    with pytest.raises(ProviderUnavailable):
        http_provider._payment(sandbox_payment(id=bad))
    refund = {"id": "re_1", "payment_id": "pay_1", "amount": 1, "currency": "EUR"}
    with pytest.raises(ProviderUnavailable):
        http_provider._refund({**refund, "status": "succeeded", "id": bad})
    with pytest.raises(ProviderUnavailable):
        http_provider._refund({**refund, "status": "succeeded", "payment_id": bad})
    session = {"id": bad, "order_id": str(ULID()), "url": "https://x"}
    with pytest.raises(ProviderUnavailable):
        http_provider._session(session)
    assert http_provider._payment(sandbox_payment(order_id="01ABC\n")).order_id is None


def stripe_intent(**over: Any) -> dict[str, Any]:
    return {"id": "pi_1", "object": "payment_intent", "status": "succeeded", "amount": 5,
            "amount_received": 5, "currency": "eur",
            "metadata": {"order_id": str(ULID())}, **over}  # fmt: skip


@pytest.mark.parametrize("bad", [*BAD_IDS, "pi_1/capture", "pi_" + "1" * 126])
def test_stripe_answers_with_a_malformed_id_are_failed_calls(bad: Any) -> None:
    payment = stripe_provider._payment(stripe_intent())
    assert payment is not None and payment.payment_id == "pi_1"
    with pytest.raises(ProviderUnavailable):
        stripe_provider._payment(stripe_intent(id=bad))
    refund = {"id": "re_1", "payment_intent": "pi_1", "amount": 5, "currency": "eur",
              "status": "succeeded"}  # fmt: skip
    assert stripe_provider._refund(refund).refund_id == "re_1"
    with pytest.raises(ProviderUnavailable):
        stripe_provider._refund({**refund, "id": bad})
    with pytest.raises(ProviderUnavailable):
        stripe_provider._refund({**refund, "payment_intent": bad})
    odd_order = stripe_intent(metadata={"order_id": str(ULID()) + "\n"})
    assert stripe_provider._payment(odd_order).order_id is None  # type: ignore[union-attr]
