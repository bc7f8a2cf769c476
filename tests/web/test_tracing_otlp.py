"""Traces end to end: a real `gate serve` (two workers) and sandbox provider, tracing
on through OTEL_* only, exporting over OTLP/HTTP to a receiver on loopback that
decodes what it gets (tests/otlp_receiver.py, opentelemetry-proto). No part of the
gate is replaced.

    caller's traceparent ──> reservation (edge) ──> EVALSHA admit ──> CALL gate_reserve…
                        └──> payment start (ASGI) ──> POST sandbox /v1/sessions
                                                      (traceparent propagated)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest

from gate.base.settings import load_settings
from gate.store.db import Database
from tests.otlp_receiver import OtlpReceiver, Span
from tests.payments_support import PayStack, SandboxClient, running_pay_stack, wait_status
from tests.support import ADMIN, Client, base_env, buyer, create_deal, reserve, reset_stores
from tests.webhooks_support import Received, Receiver, create_endpoint, wait_for

TRACE_ID = os.urandom(16).hex()
CALLER_SPAN = os.urandom(8).hex()
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def _own_stores() -> dict[str, str]:
    """A MariaDB database and a Redis logical database of this module's own, migrated
    and empty: the suite's shared gate runs background loops on the suite's stores, and
    its sweeper would otherwise release the holds this module expects its traced gate
    to release."""
    env = base_env()
    mysql_url = env["GATE_MYSQL_URL"] + "_otlp"
    redis_base, _, number = env["GATE_REDIS_URL"].rpartition("/")
    redis_url = f"{redis_base}/{(int(number) + 15) % 16}"
    settings = load_settings({**env, "GATE_MYSQL_URL": mysql_url, "GATE_REDIS_URL": redis_url})
    asyncio.run(reset_stores(settings))
    return {"GATE_MYSQL_URL": mysql_url, "GATE_REDIS_URL": redis_url}


@pytest.fixture(scope="module")
def own_stores(prepared: None) -> dict[str, str]:
    return _own_stores()


@pytest.fixture(scope="module")
def traced(own_stores: dict[str, str], receiver: OtlpReceiver) -> Iterator[PayStack]:
    extra = {
        **own_stores,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "gate-under-test",
        # Spans leave within 100 ms (the SDK's batch processor).
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "GATE_ACCESS_LOG": "1",
        # The request log lines (info) too.
        "GATE_LOG_LEVEL": "INFO",
        # The sold-out near-cache on (the suite turns it off), renewed meanwhile.
        "GATE_SOLD_OUT_CACHE_MS": "1000",
        # Webhook deliveries (a receiver on loopback), always traced (ratio 1).
        "GATE_WEBHOOK_WORKERS": "1",
        "GATE_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
        "GATE_WEBHOOK_INTERVAL_SECONDS": "0.05",
    }
    with running_pay_stack(extra) as stack:
        yield stack


@pytest.fixture(scope="module")
async def db(traced: PayStack) -> AsyncIterator[Database]:
    """The traced gate's database (the module's own stores), for this module's tests."""
    database = Database(load_settings(traced.env), pool_max=4)
    await database.start()
    yield database
    await database.close()


def _log_lines(stack: PayStack) -> list[dict[str, Any]]:
    lines = []
    for raw in stack.gate.log_path.read_text(errors="replace").splitlines():
        if raw.startswith("{"):
            lines.append(orjson.loads(raw))
    return lines


def _traceparent(sampled: bool = True) -> tuple[str, str]:
    trace_id = os.urandom(16).hex()
    return trace_id, f"00-{trace_id}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"


def _one(spans: list[Span], **match: Any) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.name, s.kind, s.parent_span_id) for s in spans])
    return found[0]


async def test_a_reservation_and_a_payment_are_one_trace_under_the_callers_span(
    traced: PayStack, receiver: OtlpReceiver
) -> None:
    client = Client(traced.gate.url)
    try:
        deal = await create_deal(client, stock=5, unit_price=700)
        headers = {**buyer(7001), "Idempotency-Key": "otel-7001", "traceparent": TRACEPARENT}
        r = await client.post(
            f"/v1/deals/{deal}/reservations", json={"quantity": 1}, headers=headers
        )
        assert r.status_code == 201, r.text
        order_id = r.json()["order_id"]
        reservation_rid = r.headers["x-request-id"]
        r = await client.post(
            f"/v1/orders/{order_id}/payment",
            headers={**buyer(7001), "traceparent": TRACEPARENT},
        )
        assert r.status_code in (200, 201), r.text
        session_id = r.json()["session_id"]
        sandbox = Client(traced.sandbox.url)
        try:
            sessions = await sandbox.get(
                f"/v1/sessions?order_id={order_id}",
                headers={"Authorization": f"Bearer {traced.env['GATE_PAYMENT_API_KEY']}"},
            )
        finally:
            await sandbox.close()
    finally:
        await client.close()

    def complete(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == TRACE_ID]
        names = {s.name for s in mine}
        return {
            "POST /v1/deals/{deal_id}/reservations",
            "POST /v1/orders/{order_id}/payment",
            "EVALSHA admit",
            "POST",
        } <= names and any(n.startswith("CALL gate_reserve") for n in names)

    receiver.wait_for(complete)
    spans = receiver.of_trace(TRACE_ID)
    assert {s.resource["service.name"] for s in spans} == {"gate-under-test"}
    # Both server spans are children of the caller's span: one trace.
    reservation = _one(spans, name="POST /v1/deals/{deal_id}/reservations", kind="server")
    payment = _one(spans, name="POST /v1/orders/{order_id}/payment", kind="server")
    assert reservation.parent_span_id == payment.parent_span_id == CALLER_SPAN
    assert reservation.attributes["http.response.status_code"] == 201
    assert reservation.attributes["http.route"] == "/v1/deals/{deal_id}/reservations"
    assert reservation.attributes["gate.request_id"] == reservation_rid
    # The Redis admission: a client span under the reservation.
    admit = _one(spans, name="EVALSHA admit")
    assert (admit.kind, admit.parent_span_id) == ("client", reservation.span_id)
    assert admit.attributes["db.system.name"] == "redis"
    # The database procedure: linked from the request span and linking back.
    [call] = [s for s in spans if s.name.startswith("CALL gate_reserve")]
    assert call.kind == "client" and call.attributes["db.system.name"] == "mariadb"
    assert (TRACE_ID, reservation.span_id) in call.links
    assert (TRACE_ID, call.span_id) in reservation.links
    # The provider call: a client span under the payment, its traceparent sent.
    provider = _one(spans, name="POST", kind="client")
    assert provider.parent_span_id == payment.span_id
    assert provider.attributes["url.full"].endswith("/v1/sessions")
    assert provider.attributes["http.response.status_code"] == 200
    assert sessions.status_code == 200, sessions.text
    [session] = [s for s in sessions.json()["data"] if s["id"] == session_id]
    assert session["traceparent"] == f"00-{TRACE_ID}-{provider.span_id}-01"

    # Log lines written inside the spans carry their ids; the access log the trace id.
    await asyncio.sleep(0.3)  # the access log's writer thread
    lines = _log_lines(traced)
    request_lines = [
        x
        for x in lines
        if x.get("logger") == "gate.request" and x.get("request_id") == reservation_rid
    ]
    assert request_lines and all(
        (x["trace_id"], x["span_id"]) == (TRACE_ID, reservation.span_id) for x in request_lines
    ), request_lines
    access = [
        x
        for x in lines
        if x.get("logger") == "gate.access" and x.get("request_id") == reservation_rid
    ]
    assert len(access) == 1 and access[0]["trace_id"] == TRACE_ID, access
    assert access[0]["route"] == "/v1/deals/{deal_id}/reservations"
    assert access[0]["status"] == 201 and access[0]["method"] == "POST"


async def test_the_callback_is_processed_in_a_span_of_its_request(
    traced: PayStack, receiver: OtlpReceiver, db: Database
) -> None:
    client = Client(traced.gate.url)
    sandbox = SandboxClient(traced.sandbox.url)
    try:
        deal = await create_deal(client, stock=5, unit_price=710)
        r = await reserve(client, deal, 7011, "otel-7011")
        order_id = r.json()["order_id"]
        r = await client.post(f"/v1/orders/{order_id}/payment", headers=buyer(7011))
        await sandbox.pay(r.json()["session_id"])
        await wait_status(db, order_id, "PAID")
    finally:
        await client.close()
        await sandbox.close()

    def called_back(spans: list[Span]) -> bool:
        return any(s.name == "payment callback" for s in spans) and any(
            s.name.startswith("CALL gate_payment_event") for s in spans
        )

    spans = receiver.wait_for(called_back)
    callbacks = [s for s in spans if s.name == "payment callback"]
    servers = {s.span_id: s for s in spans if s.kind == "server"}
    for callback in callbacks:
        server = servers[callback.parent_span_id]
        assert server.name == "POST /v1/payments/{provider}/webhook"
        assert callback.attributes["gate.payment.provider"] == "sandbox"
    calls = [s for s in spans if s.name.startswith("CALL gate_payment_event")]
    callback_ids = {c.span_id for c in callbacks}
    # A lone callback's CALL is its child; a group's is linked to every callback.
    assert all(c.parent_span_id in callback_ids for c in calls)
    assert all({sid for _, sid in c.links} <= callback_ids for c in calls)


async def test_sold_out_answers_at_the_edge_are_traced_only_when_the_caller_samples_them(
    traced: PayStack, receiver: OtlpReceiver
) -> None:
    client = Client(traced.gate.url)
    try:
        deal = await create_deal(client, stock=1, unit_price=720)
        path = f"/v1/deals/{deal}/reservations"
        assert (await reserve(client, deal, 7020, "otel-7020")).status_code == 201
        # Sold out: the first refusals of each worker come from Redis (traced: the
        # sampler takes every root), then the near-cache answers from memory.
        refused = []
        for user in range(7021, 7061):
            r = await reserve(client, deal, user, f"otel-{user}")
            assert r.status_code == 409, r.text
            refused.append(r.headers["x-request-id"])
        sampled_id, sampled = _traceparent()
        r = await client.post(
            path,
            json={"quantity": 1},
            headers={**buyer(7099), "Idempotency-Key": "otel-7099", "traceparent": sampled},
        )
        assert r.status_code == 409
        unsampled_id, unsampled = _traceparent(sampled=False)
        r = await client.post(
            path,
            json={"quantity": 1},
            headers={**buyer(7098), "Idempotency-Key": "otel-7098", "traceparent": unsampled},
        )
        assert r.status_code == 409
    finally:
        await client.close()

    # The caller's sampled trace is there (parent: the caller's span); its unsampled one not.
    spans = receiver.wait_for(lambda ss: any(x.trace_id == sampled_id for x in ss))
    [answer] = [x for x in spans if x.trace_id == sampled_id and x.kind == "server"]
    assert answer.attributes["http.response.status_code"] == 409
    assert answer.parent_span_id == sampled.split("-")[2]
    await asyncio.sleep(0.5)  # anything else would have been exported by now
    assert receiver.of_trace(unsampled_id) == []
    # Every other 409 that has a span reached Redis (its admission is its child); the
    # near-cache's answers have none at all.
    spans = list(receiver.spans)
    refusals = [
        x
        for x in spans
        if x.kind == "server"
        and x.attributes.get("url.path") == path
        and x.trace_id != sampled_id
        and x.attributes.get("http.response.status_code") == 409
    ]
    admitted = {x.parent_span_id for x in spans if x.name == "EVALSHA admit"}
    assert all(x.span_id in admitted for x in refusals)
    traced_ids = {x.attributes["gate.request_id"] for x in refusals}
    untraced = [rid for rid in refused if rid not in traced_ids]
    assert len(untraced) >= len(refused) - 4, (len(untraced), len(refused))
    lines = {x["request_id"]: x for x in _log_lines(traced) if x.get("logger") == "gate.access"}
    assert all("trace_id" not in lines[rid] for rid in untraced)


async def test_an_expiry_batch_is_a_root_span_with_its_work_under_it(
    traced: PayStack, receiver: OtlpReceiver, db: Database
) -> None:
    await _expire_one(traced, db)

    def swept(spans: list[Span]) -> bool:
        batches = {x.span_id for x in spans if x.name == "expiry batch"}
        return any(
            x.name == "CALL gate_expire_batch" and x.parent_span_id in batches for x in spans
        )

    spans = receiver.wait_for(swept)
    [call] = [x for x in spans if x.name == "CALL gate_expire_batch"][-1:]
    [batch] = [x for x in spans if x.span_id == call.parent_span_id]
    assert batch.parent_span_id == "" and batch.kind == "internal"
    assert batch.attributes["gate.expiry.released"] >= 1
    under = {x.name for x in spans if x.parent_span_id == batch.span_id}
    assert {"CALL gate_expire_batch", "EVALSHA intend"} <= under, under


async def _expire_one(traced: PayStack, db: Database) -> None:
    """A hold of the traced gate's, made due now: its sweeper is the only one that
    sees it (the module's own stores)."""
    client = Client(traced.gate.url)
    try:
        deal = await create_deal(client, stock=3, unit_price=730)
        r = await reserve(client, deal, 7101, "otel-7101")
        order_id = r.json()["order_id"]
    finally:
        await client.close()
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) - INTERVAL 1 SECOND WHERE id = %s", (order_id,)
    )
    await wait_status(db, order_id, "EXPIRED")


async def test_a_webhook_delivery_is_a_client_span_whose_traceparent_the_shop_gets(
    traced: PayStack, receiver: OtlpReceiver
) -> None:
    shop = Receiver()
    await shop.start()
    client = Client(traced.gate.url)
    try:
        made = await create_endpoint(client, shop.url, ["deal.sold_out"])
        r = await client.post(f"/v1/admin/webhook-endpoints/{made['id']}/test", headers=ADMIN)
        assert r.status_code in (200, 202), r.text

        def tested() -> list[Received]:
            got = shop.delivered().values()
            return [x for x in got if x.event["type"] == "webhook.test"]

        [got] = await wait_for(tested, 20)
        r = await client.delete(f"/v1/admin/webhook-endpoints/{made['id']}", headers=ADMIN)
        assert r.status_code in (200, 204), r.text
    finally:
        await client.close()
        await shop.stop()
    headers = {k.lower(): v for k, v in got.headers.items()}
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, flags) == ("00", "01")

    def delivered(spans: list[Span]) -> bool:
        return any(x.span_id == span_id for x in spans)

    [span] = [x for x in receiver.wait_for(delivered) if x.span_id == span_id]
    # A trace of its own (the loop serves no request), the POST to the shop's URL.
    assert span.trace_id == trace_id and span.parent_span_id == ""
    assert span.kind == "client" and span.name == "POST"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["url.full"] == shop.url
