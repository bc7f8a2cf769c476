"""The contract the Alipay and the WeChat Pay adapter both keep, each against its fake
as a real process on loopback (tests/fake_alipay.py, tests/fake_wechatpay.py):
sessions, payment and failure notifications with the provider's retries, refunds by
the gate's key, refusals, transient failures retried, answers not signed by the
provider not believed, per-order queries for reconciliation, ids the provider never
issues refused. What differs between the two is data (`CnCase`, tests/cn_support.py);
what only one provider does is in its own module."""

from __future__ import annotations

import dataclasses

import pytest
from ulid import ULID

from gate.payments.provider import ProviderRejected, ProviderUnavailable
from tests.cn_support import (
    CASES,
    CnStack,
    KeyPair,
    StaticWindow,
    cn_stack,
    eventually,
    session_request,
)
from tests.support import ServerProcess

BOTH = list(CASES)


async def test_session_payment_notification_and_query(cn: CnStack) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    request = session_request(sink, amount=12345)
    session = await provider.create_session(request, f"session-{request.order_id}")
    assert session.order_id == request.order_id
    assert session.redirect_url.startswith(cn.case.redirect_prefix)
    # Created again (a retry that opens the payment session anew): the same code.
    again = await provider.create_session(request, f"session-{request.order_id}")
    assert again.redirect_url == session.redirect_url
    # Nothing to find before the buyer scanned.
    assert await provider.payments_for_order(request.order_id) == []

    status, paid = await control.post(
        "/_fake/pay", {"out_trade_no": request.order_id, "outcome": "succeed"}
    )
    assert status == 200
    payment_id = paid[cn.case.payment_id_field]
    events = await eventually(lambda: sink.of_type("payment.succeeded", request.order_id))
    assert (events[0].amount, events[0].payment_id) == (12345, payment_id)
    notes = await control.get(f"/_fake/notifications?out_trade_no={request.order_id}")
    assert notes[0]["acknowledged"] and notes[0]["attempts"] == 1

    [payment] = await provider.payments_for_order(request.order_id)
    assert (payment.status, payment.amount, payment.payment_id) == (
        "succeeded",
        12345,
        payment_id,
    )
    assert await provider.get_payment(payment_id) == payment
    # A paid order cannot get another payment code.
    with pytest.raises(ProviderRejected) as refused:
        await provider.create_session(request, "k")
    assert refused.value.code == cn.case.paid_again_code


async def test_a_failed_payment_is_notified_or_learnt_by_query(cn: CnStack) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    request = session_request(sink)
    await provider.create_session(request, "k")
    await control.post("/_fake/pay", {"out_trade_no": request.order_id, "outcome": "fail"})
    if cn.case.notifies_failure:
        await eventually(lambda: sink.of_type("payment.failed", request.order_id))
    [payment] = await provider.payments_for_order(request.order_id)
    assert payment.status == "failed"
    if not cn.case.notifies_failure:
        assert sink.events == []  # WeChat notifies no failure


async def test_a_notification_is_retried_until_acknowledged(cn: CnStack) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    sink.fail_next = 2
    request = session_request(sink)
    await provider.create_session(request, "k")
    await control.post("/_fake/pay", {"out_trade_no": request.order_id})
    await eventually(lambda: sink.of_type("payment.succeeded", request.order_id))
    notes = await control.get(f"/_fake/notifications?out_trade_no={request.order_id}")
    assert notes[0]["attempts"] == 3 and notes[0]["acknowledged"]
    # A redelivery of the acknowledged notification is the same event.
    await control.post(f"/_fake/notifications/{notes[0]['id']}/redeliver", {})
    await eventually(lambda: sink.received == 4)
    assert len(sink.of_type("payment.succeeded", request.order_id)) == 1


async def test_a_refund_by_the_gates_key_and_its_notification(cn: CnStack) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    request = session_request(sink, amount=500)
    await provider.create_session(request, "k")
    _, paid = await control.post("/_fake/pay", {"out_trade_no": request.order_id})
    payment_id = paid[cn.case.payment_id_field]
    key = f"refund-{cn.case.name}-{payment_id}-0"
    refund = await provider.refund(payment_id, 500, key)
    assert (refund.refund_id, refund.amount, refund.order_id) == (key, 500, request.order_id)
    assert refund.status == cn.case.refund_answer_status
    # The same key again (a retry after a timeout): the same refund, no second one.
    again = await provider.refund(payment_id, 500, key)
    assert again.refund_id == key and again.status == "succeeded"
    assert again == dataclasses.replace(refund, status="succeeded")
    doc = await control.get(f"/_fake/trades/{request.order_id}")
    assert doc["refunded_fen"] == 500 and len(doc["refunds"]) == 1
    events = await eventually(lambda: sink.of_type("refund.succeeded", request.order_id))
    assert (events[0].refund_id, events[0].amount, events[0].payment_id) == (
        key,
        500,
        payment_id,
    )
    # More than was paid: the provider refuses.
    with pytest.raises(ProviderRejected) as refused:
        await provider.refund(payment_id, 1, f"refund-{cn.case.name}-{payment_id}-1")
    assert refused.value.code == cn.case.over_refund_code


async def test_no_authorize_then_capture(cn: CnStack) -> None:
    provider, sink = cn.provider, cn.sink
    with pytest.raises(ProviderRejected) as refused:
        await provider.create_session(session_request(sink, capture_mode="manual"), "k")
    assert refused.value.code == "capture_unsupported"
    with pytest.raises(ProviderRejected):
        await provider.capture("2013112011001004330000121536", 1, "k")


async def test_an_unavailable_provider_is_retried_within_retry_max(cn: CnStack) -> None:
    # GATE_PAYMENT_RETRY_MAX is 3 here: two failures then an answer is an answer;
    # three failures are ProviderUnavailable, for a change and for a read alike.
    provider, sink, control = cn.provider, cn.sink, cn.control
    await control.post("/_fake/configure", {cn.case.failing_calls: 2})
    request = session_request(sink)
    session = await provider.create_session(request, "k")
    assert session.order_id == request.order_id
    await control.post("/_fake/configure", {cn.case.failing_calls: 3})
    with pytest.raises(ProviderUnavailable):
        await provider.create_session(request, "k")
    await control.post("/_fake/configure", {cn.case.failing_calls: 3})
    with pytest.raises(ProviderUnavailable):
        await provider.payments_for_order(request.order_id)


@pytest.mark.parametrize("name", BOTH)
async def test_answers_not_signed_by_the_provider_are_not_believed(
    cn_keys: dict[str, dict[str, KeyPair]], cn_fakes: dict[str, ServerProcess], name: str
) -> None:
    # The gate holding another key for the provider: every answer fails verification.
    case, keys = CASES[name], cn_keys[name]
    other = {case.answer_key_variable: keys["other"].public_file}
    async with cn_stack(case, keys, cn_fakes[name], **other) as stack:
        with pytest.raises(ProviderUnavailable, match=r"(?i)signature"):
            await stack.provider.payments_for_order(str(ULID()))


@pytest.mark.parametrize("dropped", [1, 2])
async def test_a_dropped_notification_is_found_by_per_order_query(
    cn: CnStack, dropped: int
) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    requests = [session_request(sink, amount=100 + i) for i in range(3)]
    for r in requests:
        await provider.create_session(r, "k")
    await control.post("/_fake/configure", {"drop_notifications": 1})
    await control.post("/_fake/pay", {"out_trade_no": requests[dropped].order_id})
    notes = await control.get(f"/_fake/notifications?out_trade_no={requests[dropped].order_id}")
    assert notes[0]["dropped"] and notes[0]["attempts"] == 0
    provider.window = StaticWindow([r.order_id for r in requests])
    # Two orders a page: the paid order is on the first page or on the second.
    expected = [(requests[dropped].order_id, 100 + dropped, "succeeded")]
    on_first = dropped < 2
    page = await provider.transactions(None, 2, since=0)
    assert [(t.order_id, t.amount, t.status) for t in page.items] == (expected if on_first else [])
    assert page.next_cursor == requests[1].order_id
    rest = await provider.transactions(page.next_cursor, 2, since=0)
    assert [(t.order_id, t.amount, t.status) for t in rest.items] == ([] if on_first else expected)
    assert rest.next_cursor is None


NEVER_ISSUED = [
    *(("alipay", bad) for bad in ("2026120122001000000000000001\n", "9" * 65, "2026x")),
    *(
        ("wechatpay", bad)
        for bad in (
            "4200000000202612010000000001\n",
            "4" * 33,
            "42000000002026120100000000x1",
            "４２",
        )
    ),
]


@pytest.mark.parametrize(("cn", "bad_id"), NEVER_ISSUED, indirect=["cn"])
async def test_a_payment_id_the_provider_never_issues_is_refused(cn: CnStack, bad_id: str) -> None:
    # The notification is a 400 (EventInvalid: nothing recorded, counted as rejected
    # by the gate); the query's answer a failed call, never a stored id.
    provider, sink, control = cn.provider, cn.sink, cn.control
    field = cn.case.payment_id_field
    request = session_request(sink)
    await provider.create_session(request, "k")
    await control.post("/_fake/pay", {"out_trade_no": request.order_id, field: bad_id})
    await eventually(lambda: sink.refused)
    assert all(field in r for r in sink.refused)
    assert sink.events == []
    with pytest.raises(ProviderUnavailable, match=field):
        await provider.payments_for_order(request.order_id)
